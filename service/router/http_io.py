"""The bytes of a REST call the door forwards, between uvicorn's parser and the
door: the body as the parser gave it, and the response written in one go.

- :class:`Body`: a forwarded call's body, the chunks httptools made, kept as
  they are (uvicorn would append them to a bytearray, then copy that into
  the bytes its ``receive`` returns): the door joins them once, behind the
  wrapper's head (:mod:`poolserve.service.contract.rest`), the body's one
  copy in the router.
- :class:`Corked`: the transport as a call's response cycle sees it. uvicorn
  writes a response's status line and headers, then its body, as two writes
  (two ``send`` calls, two TCP segments); while corked, they are gathered
  and written as one.
"""

from __future__ import annotations

import asyncio
from typing import Any

FORWARDED = ("/infer", "/generate", "/generate_stream", ":predict")


def forwarded(method: str, path: str) -> bool:
    """Whether the door forwards this call's body to a pool (unparsed)."""
    return method == "POST" and path.endswith(FORWARDED)


class Body:
    """A forwarded call's body as it comes."""

    __slots__ = ("chunks", "complete", "size", "unread")

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.size = 0  # bytes so far
        self.unread = 0  # bytes since the door last looked (flow control)
        self.complete = False  # the parser saw the message's end

    def add(self, chunk: bytes) -> None:
        self.chunks.append(chunk)
        self.size += len(chunk)
        self.unread += len(chunk)


class Corked(asyncio.Transport):
    """A connection's transport as its response cycles see it: writes go
    through, except between :meth:`cork` and :meth:`uncork`."""

    def __init__(self, transport: asyncio.Transport) -> None:
        super().__init__()
        self.transport = transport
        self._pending: list[bytes | memoryview] | None = None
        self._ended = False  # the connection answered on its own (a refusal): no more writes

    def cork(self) -> None:
        self._pending = []

    def end(self) -> None:
        """Drops what is gathered and any later write: the connection's own
        answer went out, and the transport takes no more."""
        self._pending = None
        self._ended = True

    def uncork(self) -> None:
        pending, self._pending = self._pending, None
        if not pending or self._ended or self.transport.is_closing():
            return
        self.transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def write(self, data: Any) -> None:
        if self._ended:
            return
        if self._pending is not None:
            self._pending.append(data)
        else:
            self.transport.write(data)

    def close(self) -> None:
        self.uncork()
        self.transport.close()

    def is_closing(self) -> bool:
        return self.transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.transport.get_extra_info(name, default)

    def get_write_buffer_size(self) -> int:
        return self.transport.get_write_buffer_size()

    def can_write_eof(self) -> bool:
        return self.transport.can_write_eof()

    def write_eof(self) -> None:
        self.uncork()
        self.transport.write_eof()

    def abort(self) -> None:
        self._pending = None
        self.transport.abort()

    def pause_reading(self) -> None:
        self.transport.pause_reading()

    def resume_reading(self) -> None:
        self.transport.resume_reading()

    def is_reading(self) -> bool:
        return self.transport.is_reading()
