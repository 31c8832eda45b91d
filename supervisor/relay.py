"""A child's output (stdout and stderr, one pipe) relayed into the supervisor's log.

With ``log_format json`` every line a tree writes must be one JSON object. A
child's own log lines are (its handler writes them), but a process also
writes what no Python handler sees: grpc's C core, a native library, a model's
``print``, a crash in C. The supervisor gives each child (router, pool, and
through the pool its zygote and workers) one pipe for stdout and stderr and
reads it here: a line that is a JSON object passes through as it is; any
other line (or a JSON line that another process's write tore apart, when two
processes of one pool write more than ``PIPE_BUF`` at once) is wrapped as an
object naming the child, so a line of the log never fails ``json.loads``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable

from poolserve.service.lifecycle.logs import MAX_LINE, wrap_line, write_verbatim

log = logging.getLogger("poolserve.output")

_READ = 65536

LineSink = Callable[[bytes, int], None]  # (line without its newline, the child's pid)


class PipeRelay:
    """Reads one pipe on the event loop and hands each line to ``sink``
    until EOF (every writer gone: the child and whatever it started)."""

    def __init__(self, fd: int, pid: int, sink: LineSink) -> None:
        os.set_blocking(fd, False)
        self._fd: int | None = fd
        self._pid = pid
        self._sink = sink
        self._pending = bytearray()
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._fd is not None:
            self._loop = loop
            loop.add_reader(self._fd, self.drain)

    def drain(self) -> None:
        """Relays what the pipe holds now; closes it at EOF."""
        while self._fd is not None:
            try:
                chunk = os.read(self._fd, _READ)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                self._close()
                return
            self._take(chunk)

    def _take(self, chunk: bytes) -> None:
        self._pending += chunk
        while True:
            end = self._pending.find(b"\n")
            if end < 0:
                break
            line = bytes(self._pending[:end])
            del self._pending[: end + 1]
            self._emit(line)
        while len(self._pending) >= MAX_LINE:
            piece = bytes(self._pending[:MAX_LINE])
            del self._pending[:MAX_LINE]
            self._emit(piece)

    def _emit(self, line: bytes) -> None:
        try:
            self._sink(line, self._pid)
        except Exception:  # a relay never takes the supervisor down
            log.exception("relaying a line of pid %d failed", self._pid)

    def _close(self) -> None:
        if self._pending:
            self._emit(bytes(self._pending))
            self._pending.clear()
        fd, self._fd = self._fd, None
        if fd is None:
            return
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(fd)
        os.close(fd)

    def close(self) -> None:
        """Relays what is left now and stops reading (the supervisor is exiting)."""
        self.drain()
        self._close()


def json_sink(role: str, write: Callable[[str], None] | None = None) -> LineSink:
    """A sink for ``log_format json``: a JSON object line passes through; any
    other line is wrapped (:func:`~poolserve.service.lifecycle.logs.wrap_line`)
    with the child's role and pid. ``write`` defaults to the supervisor's log
    handler (one lock with its own lines)."""
    out = write or write_verbatim

    def sink(line: bytes, pid: int) -> None:
        text = line.decode("utf-8", errors="replace").rstrip("\r")
        if text.strip():
            out(wrap_line(text, role, pid))

    return sink
