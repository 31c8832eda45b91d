"""The log line format of every poolserve process (text or JSON, with role and pid)."""

from __future__ import annotations

import logging
import sys


def setup_logging(role: str, log_format: str = "text") -> None:
    if log_format == "json":
        fmt = (
            '{"ts": "%(asctime)s", "level": "%(levelname)s", "role": "' + role + '", '
            '"pid": %(process)d, "msg": "%(message)s"}'
        )
    else:
        fmt = f"%(asctime)s %(levelname)s {role}[%(process)d] %(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt, stream=sys.stderr, force=True)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_late_reply_filter)


def _late_reply_filter(record: logging.LogRecord) -> bool:
    """grpc logs a full traceback when a reply meets a call that already ended
    (the client left, or its deadline passed, a moment before): one line is
    enough, since nobody was waiting for that reply."""
    if record.name.startswith("grpc._cython") and "ExecuteBatchError" in record.getMessage():
        record.msg = "a reply was not sent: its call had already ended (client gone or deadline)"
        record.args = ()
        record.exc_info = None
        record.exc_text = None
        record.levelno, record.levelname = logging.INFO, "INFO"
    return True
