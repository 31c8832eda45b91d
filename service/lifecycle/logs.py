"""The log line format of every poolserve process (text or JSON, with role and pid).

``json``: one JSON object per line, written by python-json-logger, with the
fields ``ts`` (UTC, ISO 8601), ``level``, ``role``, ``pid``, ``logger`` and
``msg``; an exception goes in ``exc_info`` (its whole traceback, one string),
a stack in ``stack_info``, and whatever a call passes in ``extra`` (say a
supervisor's ``event``) as fields of their own. Uncaught exceptions (of the
main thread and of other threads) and :mod:`warnings` go through the same
handler, so they are objects too.

A process started by exec from one that set up logging (a spawned worker;
the library's exec'd zygote when its host is a poolserve process) reads the
format from :data:`LOG_FORMAT_ENV` with :func:`setup_inherited_logging`; a
forked one (a pool's zygote, its workers) keeps its parent's handler and only
changes its role (:func:`set_role_kind`).

What a process writes past its handler (grpc's C core, a native library, a
``print``) is made JSON by a relay: the supervisor relays its children's
stdout and stderr (:mod:`poolserve.supervisor.relay`) and its own fd 2 (a
thread); a router or pool run alone relays its own through a child process
(``setup_logging(relay=...)``).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import logging
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

# Not a POOLSERVE_<setting> name on purpose: it carries the format the tree
# was started with down to processes started by exec, and must not override
# settings.json on a reload the way POOLSERVE_LOG_FORMAT would.
LOG_FORMAT_ENV = "POOLSERVE_INHERITED_LOG_FORMAT"
LOG_ROLE_ENV = "POOLSERVE_INHERITED_LOG_ROLE"
# Set once a process of the tree relays its fd 2 (or has it relayed): its
# children's output is taken care of.
RELAYED_ENV = "POOLSERVE_OUTPUT_RELAYED"
MAX_LINE = 1024 * 1024  # a longer line without a newline is relayed in pieces
_GLOG = re.compile(r"([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ")
_GLOG_LEVELS = {"I": "INFO", "W": "WARNING", "E": "ERROR", "F": "CRITICAL"}
TEXT_FORMAT = "%(asctime)s %(levelname)s %(role)s[%(process)d] %(message)s"
JSON_FIELDS = ("levelname", "role", "process", "name", "message")
RECORD_KEYS = frozenset({"ts", "level", "role", "pid"})
JSON_NAMES = {"levelname": "level", "process": "pid", "name": "logger", "message": "msg"}

_role = "poolserve"
_relay_process: subprocess.Popen[bytes] | None = None  # relay="process": kept, never waited


class _RoleFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.role = _role
        return True


def json_formatter() -> logging.Formatter:
    from pythonjsonlogger.json import JsonFormatter

    class Formatter(JsonFormatter):
        def format(self, record: logging.LogRecord) -> str:
            # A line relayed from a child that is already one JSON object.
            verbatim = getattr(record, "verbatim", None)
            if isinstance(verbatim, str):
                return verbatim
            return str(super().format(record))

    return Formatter(list(JSON_FIELDS), rename_fields=dict(JSON_NAMES), timestamp="ts")


def setup_logging(
    role: str, log_format: str = "text", *, relay: str = "", relay_stdout: bool = False
) -> None:
    """``relay`` (json only, in a process whose output nobody relays yet):
    fd 2 (and fd 1) become a pipe whose lines are wrapped as JSON objects
    (:func:`wrap_line`), so what grpc's C core, a native library or ``print``
    writes there is JSON too; the handler itself writes to the real stderr.
    ``"thread"`` (the supervisor, which never forks) relays in a thread of
    this process; ``"process"`` (a router or pool run alone, by supervisord
    say, or ``serve-inprocess``) in a small child process, since a fork while
    a thread writes would leave the stream's lock held in the forked child.
    ``relay_stdout``: fd 1 goes into the same pipe (a model's ``print`` in a
    process that prints nothing of its own on stdout)."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(json_formatter())
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    handler.addFilter(_RoleFilter())
    handler.addFilter(_late_reply_filter)
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    set_role(role)
    os.environ[LOG_FORMAT_ENV] = log_format
    if log_format == "json":
        # What Python would print raw goes through the handler instead.
        logging.captureWarnings(True)
        sys.excepthook = _log_uncaught
        threading.excepthook = _log_thread_uncaught
        if relay and os.environ.get(RELAYED_ENV) != "1":
            _relay_own_output(handler, relay, relay_stdout)


def wrap_line(text: str, role: str, pid: int) -> str:
    """A line written outside any log handler, as one JSON object; a line
    that is a log record already (an object with ``ts``, ``level``, ``role``
    and ``pid``: what a handler of the tree writes) is returned as it is.

    A record that follows output with no newline of its own (a model's
    ``sys.stderr.write("...")``) shares its line: that line becomes two, the
    output wrapped, then the record as it is, so that no record is lost in
    another's ``msg``."""
    if _is_record(text):
        return text
    if text.endswith("}"):
        start = text.find('{"', 1)
        while start != -1:
            if _is_record(text[start:]):
                return _wrapped(text[:start], role, pid) + "\n" + text[start:]
            start = text.find('{"', start + 1)
    return _wrapped(text, role, pid)


def _is_record(text: str) -> bool:
    if not text.startswith("{"):
        return False
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and value.keys() >= RECORD_KEYS


def _wrapped(text: str, role: str, pid: int) -> str:
    glog = _GLOG.match(text)  # grpc's C core: "E1201 14:20:02.510713 17173 file.cc:1] ..."
    record = {
        "ts": datetime.datetime.now(datetime.UTC).isoformat(),
        "level": _GLOG_LEVELS[glog.group(1)] if glog else "WARNING",
        "role": role,
        "pid": pid,
        "logger": "poolserve.output",
        "msg": text,
        "raw": True,  # written outside the log handler (print, a C library, a crash)
    }
    return json.dumps(record)


def write_verbatim(text: str) -> None:
    """Writes ``text`` as one line through the root logger's handlers, under
    their locks (the JSON formatter writes a record's ``verbatim`` as it is)."""
    log = logging.getLogger("poolserve.output")
    record = log.makeRecord(log.name, logging.INFO, "", 0, text, (), None)
    record.verbatim = text
    for each in logging.getLogger().handlers:
        each.handle(record)


def _relay_own_output(handler: logging.StreamHandler[Any], how: str, stdout: bool) -> None:
    """See :func:`setup_logging`. Children inherit :data:`RELAYED_ENV` and
    leave their output alone (the supervisor relays its children's itself)."""
    sys.stdout.flush()
    sys.stderr.flush()
    real = os.dup(2)
    read_fd, write_fd = os.pipe()
    if how == "process":
        # Started by vfork+exec (no preexec hook): safe beside threads. It
        # exits at EOF, once this process and all it started are gone.
        argv = [sys.executable, "-P", "-m", "poolserve.service.lifecycle.logs"]
        global _relay_process
        _relay_process = subprocess.Popen(
            [*argv, _role, str(os.getpid())], stdin=read_fd, stdout=real, stderr=real
        )
        os.close(read_fd)
    os.dup2(write_fd, 2)
    if stdout:
        os.dup2(write_fd, 1)
    os.close(write_fd)
    stream = open(real, "w", encoding="utf-8", errors="backslashreplace", buffering=1)  # noqa: SIM115
    handler.setStream(stream)
    os.environ[RELAYED_ENV] = "1"
    if how != "thread":
        return
    pump = threading.Thread(target=_pump, args=(read_fd, _relay), name="stderr-relay", daemon=True)
    pump.start()

    def stop() -> None:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(real, 2)  # closes the pipe's last write end here: the pump reads EOF
        pump.join(timeout=2)

    atexit.register(stop)


def _pump(fd: int, relay: Callable[[bytes], None]) -> None:
    pending = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            chunk = b""
        if not chunk:
            break
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            relay(line)
        if len(pending) >= MAX_LINE:
            relay(pending)
            pending = b""
    if pending:
        relay(pending)
    os.close(fd)


def _relay(line: bytes) -> None:
    text = line.decode("utf-8", errors="replace").rstrip("\r")
    if text.strip():
        with contextlib.suppress(Exception):
            write_verbatim(wrap_line(text, _role, os.getpid()))


def setup_inherited_logging(kind: str) -> None:
    """For a process started by exec inside the tree (a spawned worker): its
    parent's format, and its parent's role with ``kind`` in front."""
    setup_logging(_with_kind(kind, os.environ.get(LOG_ROLE_ENV, "")), inherited_format() or "text")


def inherited_format() -> str | None:
    """The format of the tree this process runs in (None outside one)."""
    return os.environ.get(LOG_FORMAT_ENV)


def set_role(role: str) -> None:
    """Names this process in the lines it writes (and in its exec'd children's)."""
    global _role
    _role = role
    os.environ[LOG_ROLE_ENV] = role


def set_role_kind(kind: str) -> None:
    """A forked zygote or worker: ``pool:a`` becomes ``zygote:a`` or ``worker:a``."""
    set_role(_with_kind(kind, _role))


def role() -> str:
    return _role


def _with_kind(kind: str, parent: str) -> str:
    _, sep, rest = parent.partition(":")
    return f"{kind}:{rest}" if sep else kind


def _log_uncaught(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, exc, tb)
        return
    logging.getLogger("poolserve").critical("uncaught exception", exc_info=(kind, exc, tb))


def _log_thread_uncaught(args: Any) -> None:
    if args.exc_type is SystemExit or args.exc_value is None:
        return
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger("poolserve").error(
        "uncaught exception in thread %s",
        name,
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
    )


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


def _relay_main(role: str, pid: int) -> None:
    """The relay process of :func:`setup_logging` (``relay="process"``): its
    stdin is the pipe, its stdout the real stderr. Stops at EOF only: a
    SIGTERM to the process group must not cut the last lines off."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    out = sys.stdout

    def relay(line: bytes) -> None:
        text = line.decode("utf-8", errors="replace").rstrip("\r")
        if text.strip():
            out.write(wrap_line(text, role, pid) + "\n")
            out.flush()

    _pump(0, relay)


if __name__ == "__main__":
    _relay_main(sys.argv[1], int(sys.argv[2]))
