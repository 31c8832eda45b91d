"""One HTTP/2 connection of the router's gRPC door (RFC 9113), on the event loop.

It reads frames, keeps both directions' flow-control windows, answers
SETTINGS and PING, and hands each stream to a :class:`~.call.Call`. What it
writes in one turn of the event loop goes out in one ``write``. Limits: the
client's preface and SETTINGS must come within ``handshake_timeout_s``; a
connection with no call for ``max_connection_idle_s`` is sent GOAWAY; one
with calls and no traffic for ``keepalive_time_s`` is pinged and closed when
the ping is not answered within ``keepalive_timeout_s``; one older than
``max_connection_age_s`` is sent GOAWAY and closed after the grace.
A client that goes away cancels its calls.

Floods (RFC 9113 10.5): a client that makes the router answer (PING,
SETTINGS, streams refused or reset, calls refused at once) and reads none of
the answers is dropped (no GOAWAY: it would wait behind the rest) once
:data:`UNREAD_FRAMES` answers, beyond four per stream it may have open, wait
behind a full socket: its answers are the router's memory. DATA, held to the
client's own windows, does not count. A header block may take at most
:data:`MAX_CONTINUATIONS` CONTINUATION frames (empty ones never reach the
header-size limit), and :data:`EMPTY_DATA_FRAMES` DATA frames in a row may
carry nothing (no byte, no END_STREAM; CVE-2019-9518). A client whose
resets cost more than its budget (rapid reset, CVE-2023-44487: each reset
frees its stream's place for another call; :mod:`.resets` weighs them by the
work started) is sent GOAWAY ENHANCE_YOUR_CALM; its calls in flight finish,
its new streams are refused, and it may reconnect. Replies' header blocks
index in the HPACK dynamic table the client allows (:mod:`.replies`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import struct
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc

from poolserve.service.contract.turns import turn_end
from poolserve.service.router.http2.call import STREAM_WINDOW
from poolserve.service.router.http2.fields import Malformed, Validity
from poolserve.service.router.http2.frames import (
    ACK,
    DEFAULT_FRAME_SIZE,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    HEADER,
    HEADER_SIZE,
    MAX_FRAME_SIZE_LIMIT,
    MAX_WINDOW,
    PADDED,
    PREFACE,
    PRIORITY_FLAG,
    SETTINGS_ACK,
    ConnectionError_,
    ErrorCode,
    Kind,
    Setting,
    StreamError,
    frame,
    frame_header,
    goaway,
    parse_settings,
    ping,
    rst_stream,
    settings_frame,
    unpadded,
    window_update,
)
from poolserve.service.router.http2.hpack import (
    Decoder,
    HeaderListTooLarge,
    HpackError,
    TableEncoder,
)
from poolserve.service.router.http2.replies import trailers_only
from poolserve.service.router.http2.resets import ResetBudget, reset_cost

if TYPE_CHECKING:
    from poolserve.service.router.http2.call import Call
    from poolserve.service.router.http2.server import GrpcServer

log = logging.getLogger(__name__)

FRAME_SIZE = 1 << 20  # the largest frame we take (advertised)
CONNECTION_WINDOW = 16 << 20  # the connection's receive window
WRITE_HIGH_WATER = 64 << 10  # unsent bytes past this: writers wait (and replies count unread)
PING_DATA = b"poolserv"
RESET_REMEMBERED = 256  # streams we reset whose late frames are ignored
UNREAD_FRAMES = 10_000  # answers (not DATA) a client may leave unread (+4 per open stream)
MAX_CONTINUATIONS = 32  # CONTINUATION frames in one header block
EMPTY_DATA_FRAMES = 100  # DATA frames in a row with no byte and no END_STREAM
LINGER_S = 2.0  # after a GOAWAY and our FIN, how long what the client still sends is read
WRITTEN_ALONE = 64 << 10  # a queued part this large is written as it is, not joined ...
WRITE_SLICE = 512 << 10  # ... and fed to the transport this much at a time
COPIED_DATA = 4096  # a whole DATA frame's payload from this size on may be a view of the read


def _payload(data: bytes, start: int, size: int) -> bytes | memoryview:
    """DATA bytes of a read for a call: a view when they are at least half the
    read, else a copy: a view keeps its whole read alive (up to asyncio's 256
    KiB), and a call holding a few bytes must not hold a read's worth of
    memory the request bounds do not count (budget.py counts the bytes)."""
    if size * 2 >= len(data):
        return memoryview(data)[start : start + size]
    return data[start : start + size]


class _DataLeft:
    """A DATA frame that came in parts: whose, its flags, and its bytes still to come."""

    __slots__ = ("dropped", "flags", "size", "stream")

    def __init__(self, stream: int, flags: int, size: int) -> None:
        self.stream = stream
        self.flags = flags
        self.size = size
        self.dropped = False  # its stream was reset: the rest is not delivered


class Http2Connection(asyncio.Protocol):
    """The frames of one client connection, and its streams' calls."""

    def __init__(self, server: GrpcServer) -> None:
        self.server = server
        settings = server.settings
        self.loop = asyncio.get_running_loop()
        self._turn = turn_end(self.loop)
        self._spawned = 0  # calls' tasks started (data_received arms the turn's end after them)
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.buffer = bytearray()  # the start of a frame that is not all here
        self._data_left: _DataLeft | None = None  # a DATA frame's payload, passed on as it comes
        self.preface = False
        self.handshaken = False
        self.decoder = Decoder(max_header_list_size=settings.http_max_header_bytes)
        self.encoder = TableEncoder()  # our replies' (the client's table size bounds it)
        self.validity = Validity()  # RFC 9113 8.1-8.3: malformed requests are reset
        self._content_left: dict[int, int] = {}  # streams with a content-length: bytes to come
        self.calls: dict[int, Call] = {}
        self.last_stream = 0  # the highest stream the client opened
        self.send_window = DEFAULT_WINDOW  # the connection's, for what we send
        self.peer_stream_window = DEFAULT_WINDOW  # each new stream's
        self.peer_frame_size = DEFAULT_FRAME_SIZE
        self.unacked = 0  # bytes received that the client's window has not got back
        # request bytes its calls hold, and of those in messages still coming: past
        # a bound its windows are not given back (the client waits, not the router)
        self.requests = server.requests
        self.held = 0
        self.partial = 0
        self.holders = 0  # calls holding request bytes
        self.owing: dict[int, Call] = {}  # calls whose stream window a bound holds back
        self.max_streams = 2 * settings.max_concurrent_streams + 64
        # non-DATA frames written since the client last read: past the bound, a flood
        self.unread_frames = 0
        self.max_unread_frames = UNREAD_FRAMES + 4 * self.max_streams
        self.opened = 0  # streams that began a call
        self.resets = ResetBudget()  # what the client's resets of them may still cost
        self.empty_data = 0  # DATA frames in a row that carried nothing
        self.going_away = False
        self.closed = False
        self.lingering = False  # closed for an error: reading what the client still sends
        self._continuation: tuple[int, int, bytearray] | None = None
        self._continuations = 0  # CONTINUATION frames of the block in _continuation
        self._reset_streams: dict[int, None] = {}  # the last ones we reset, in order
        self._out: list[bytes | memoryview] = []  # written at the end of the turn
        self._large_parts = 0  # of those, not joined with the rest (WRITTEN_ALONE)
        # what the transport is fed as it drains (_feed): never empty but while it is paused
        self._backlog: deque[bytes | memoryview] = deque()
        self._tight = False  # the transport pauses on any byte held, while the backlog waits
        self._flush_pending = False
        # made by a writer waiting for the client's window; set on WINDOW_UPDATE / SETTINGS
        self._window_opened: asyncio.Event | None = None
        self._paused = False
        self._drained: asyncio.Event | None = None
        self._after_drain: list[Callable[[], None]] = []
        self._after_flush: list[Callable[[], None]] = []  # (when_sent before the flush)
        self.tasks: set[asyncio.Task[Any]] = set()
        now = time.monotonic()
        self.last_read = now
        self.idle_since: float | None = now
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._ping_sent: float | None = None

    # -- the transport ---------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER, low=0)
        self.peer = _peer_of(transport)
        self.server.connections.add(self)
        settings = self.server.settings
        self._arm("handshake", settings.handshake_timeout_s, self._handshake_late)
        if settings.max_connection_idle_s > 0:
            self._arm("idle", settings.max_connection_idle_s, self._check_idle)
        if settings.max_connection_age_s > 0:  # jittered as grpc does: not all at once
            self._arm(
                "age", settings.max_connection_age_s * random.uniform(0.9, 1.1), self._too_old
            )
        self._arm("alive", settings.keepalive_time_s, self._check_alive)

    def _arm(self, name: str, delay: float, action: Callable[[], None]) -> None:
        """One timer of each name: a new one replaces the old."""
        old = self._timers.pop(name, None)
        if old is not None:
            old.cancel()
        self._timers[name] = self.loop.call_later(max(delay, 0.01), action)

    def _greet(self) -> None:
        """Our SETTINGS and the connection's window, once the client spoke HTTP/2."""
        self.write(
            settings_frame(
                {
                    Setting.ENABLE_PUSH: 0,
                    Setting.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
                    Setting.MAX_FRAME_SIZE: FRAME_SIZE,
                    Setting.MAX_HEADER_LIST_SIZE: self.server.settings.http_max_header_bytes,
                }
            )
        )
        self.write(window_update(0, CONNECTION_WINDOW - DEFAULT_WINDOW))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._backlog.clear()
        self.server.connections.discard(self)
        for timer in self._timers.values():
            timer.cancel()
        for call in list(self.calls.values()):
            call.reset_by_peer()
        self.calls.clear()
        self.owing.clear()
        self.requests.forget(self)
        self._open_window()
        if self._drained is not None:
            self._drained.set()
        self._run_after_drain()
        actions, self._after_flush = self._after_flush, []
        for action in actions:
            action()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._backlog:
            self._feed()
            if self._paused:  # the transport took its fill again
                return
        self.unread_frames = 0
        if self._drained is not None:
            self._drained.set()
            self._drained = None
        self._run_after_drain()

    def _run_after_drain(self) -> None:
        actions, self._after_drain = self._after_drain, []
        for action in actions:
            action()

    def when_sent(self, action: Callable[[], None]) -> None:
        """Runs ``action`` once what was written so far has left the process
        (at once when little waits; a client that does not read holds it):
        after this turn's flush, and then once the transport has drained, when
        it holds anything (what was written may be views: lane_client.Lend)."""
        if self.closed:
            action()
        elif self._flush_pending:
            self._after_flush.append(action)
        elif self._paused:
            self._after_drain.append(action)
        else:
            action()

    async def drained(self) -> None:
        """Returns when the transport takes more (the client reads)."""
        if self._flush_pending:
            self._flush()
        while self._paused and not self.closed:
            if self._drained is None:
                self._drained = asyncio.Event()
            await self._drained.wait()

    def write(self, data: bytes) -> None:
        """Queued; out in one write at the end of this turn of the loop. A frame
        written while the client reads nothing counts towards the flood bound."""
        if self._paused:
            self.unread_frames += 1
            if self.unread_frames > self.max_unread_frames:
                self._flooded()
                return
        self._queue(data)

    def _queue(self, data: bytes | memoryview) -> None:
        self._out.append(data)
        if len(data) >= WRITTEN_ALONE:
            self._large_parts += 1
        if not self._flush_pending:
            self._flush_pending = True
            if not self._turn.take(self._flush):
                self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_pending = False
        out = self._out
        transport = self.transport
        if out and transport is not None and not self.closed:
            self._out = []
            if self._large_parts or self._backlog:
                self._large_parts = 0
                self._backlog.extend(out)
                self._feed()
            elif len(out) == 1:
                transport.write(out[0])
            else:
                transport.write(b"".join(out))
        else:
            out.clear()
            self._large_parts = 0
        if self._after_flush:
            actions, self._after_flush = self._after_flush, []
            for action in actions:
                self.when_sent(action)

    def _feed(self, everything: bool = False) -> None:
        """The backlog to the transport, in order, until the transport holds more
        than its high-water mark (``resume_writing`` feeds the rest): a large part
        a :data:`WRITE_SLICE` at a time, so that what the transport copies into
        its own buffer, the part the socket did not take, is at most a slice,
        not the rest of a reply. Small parts between are joined. ``everything``:
        all of it now (the connection is closing)."""
        backlog = self._backlog
        transport = self.transport
        assert transport is not None
        while backlog and (everything or not self._paused):
            if not everything and transport.get_write_buffer_size():
                # it holds a little (under its mark): paused at once, so that the
                # next slice is fed when it holds nothing, not copied behind it
                transport.set_write_buffer_limits(high=0, low=0)
                self._tight = True
                continue
            part = backlog.popleft()
            if len(part) >= WRITTEN_ALONE:
                if len(part) > WRITE_SLICE and not everything:
                    view = memoryview(part)
                    backlog.appendleft(view[WRITE_SLICE:])
                    part = view[:WRITE_SLICE]
                transport.write(part)
                continue
            small = [part]
            while backlog and len(backlog[0]) < WRITTEN_ALONE:
                small.append(backlog.popleft())
            transport.write(b"".join(small) if len(small) > 1 else small[0])
        if self._tight and not backlog:
            self._tight = False
            transport.set_write_buffer_limits(high=WRITE_HIGH_WATER, low=0)

    def _flooded(self) -> None:
        """The client keeps sending what needs answers and reads none of them:
        the connection is dropped with what it did not read (a GOAWAY would wait
        behind the rest: it is not sent). Its calls are cancelled."""
        if self.closed or self.transport is None:
            return
        log.warning(
            "router: dropping an HTTP/2 connection from %s: %d answers unread, the client "
            "sends but does not read",
            self.peer,
            self.unread_frames - 1,
        )
        self._abort_calls()

    def close(self, code: ErrorCode = ErrorCode.NO_ERROR, why: str = "") -> None:
        """GOAWAY, then the connection is closed. For an error, only our end
        (FIN): what the client still sends is read and dropped for up to
        LINGER_S, as a socket closed with unread bytes sends a TCP reset,
        which can destroy the GOAWAY before the client reads it."""
        transport = self.transport
        if self.closed or transport is None:
            return
        self._queue(goaway(self.last_stream, code, why.encode()[:256]))
        self._flush()
        if self._backlog:  # (what the client has not read yet, held by the transport now)
            self._feed(everything=True)
        self.closed = True
        if code is ErrorCode.NO_ERROR or not transport.can_write_eof():  # (TLS cannot)
            transport.close()
            return
        try:
            transport.write_eof()
        except OSError:  # the client is gone already
            transport.abort()
            return
        self.lingering = True
        self._arm("linger", LINGER_S, transport.abort)

    # -- reading frames ----------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        spawned = self._spawned
        self._received(data)
        if self._spawned != spawned:  # their first writes leave with this turn's
            self._turn.arm()

    def _received(self, data: bytes) -> None:
        if self.closed:
            return
        self.last_read = time.monotonic()
        at = 0
        if not self.preface:
            if self.buffer:
                self.buffer += data
                data = bytes(self.buffer)
                self.buffer.clear()
            if len(data) < len(PREFACE):
                if not PREFACE.startswith(data):
                    self._refuse_not_h2()
                    return
                self.buffer += data
                return
            if not data.startswith(PREFACE):
                self._refuse_not_h2()
                return
            self.preface = True
            at = len(PREFACE)
            self._greet()
        end = len(data)
        try:
            while at < end and not self.closed:
                if self._data_left is not None:
                    at = self._data_goes_on(data, at)
                elif self.buffer:
                    at = self._straddling(data, at)
                else:
                    at = self._frames(data, at)
                    if at < end and not self.closed:
                        at = self._incomplete(data, at)
        except ConnectionError_ as exc:
            log.info("router: closing an HTTP/2 connection from %s: %s", self.peer, exc.message)
            self.close(exc.code, exc.message)

    def _incomplete(self, data: bytes, at: int) -> int:
        """The frame at ``at`` is not all here: a DATA frame's payload goes on to
        its call as it comes (no copy); any other frame waits in the buffer."""
        if len(data) - at >= HEADER_SIZE and self._streams_data(data, at):
            return at + HEADER_SIZE
        self.buffer += data[at:]
        return len(data)

    def _straddling(self, data: bytes, at: int) -> int:
        """The buffered start of a frame, completed from ``data`` (only that frame's
        bytes are copied); the rest of ``data`` is read in place."""
        buffer = self.buffer
        end = len(data)
        if len(buffer) < HEADER_SIZE:
            take = min(HEADER_SIZE - len(buffer), end - at)
            buffer += data[at : at + take]
            at += take
            if len(buffer) < HEADER_SIZE:
                return at
            if self._streams_data(buffer, 0):
                buffer.clear()
                return at
        take = min(self._wanted() - len(buffer), end - at)
        buffer += data[at : at + take]
        at += take
        if len(buffer) < self._wanted():
            return at
        whole = bytes(buffer)
        buffer.clear()
        self._frames(whole, 0)
        return at

    def _streams_data(self, data: bytes | bytearray, at: int) -> bool:
        """Whether the frame whose header is at ``at`` is DATA whose payload is
        passed on as it arrives (unpadded, not empty); its header is checked now."""
        high, low, kind, flags, stream = HEADER.unpack_from(data, at)
        size = high << 16 | low
        if kind != Kind.DATA or flags & PADDED or not 0 < size <= FRAME_SIZE:
            return False
        self._check_header(kind)
        self._data_left = _DataLeft(stream & 0x7FFFFFFF, flags, size)
        return True

    def _data_goes_on(self, data: bytes, at: int) -> int:
        """The next bytes of a DATA frame that came in parts, to its call: as if
        the client had sent the frame as several (END_STREAM with the last)."""
        left = self._data_left
        assert left is not None
        size = min(left.size, len(data) - at)
        left.size -= size
        flags = left.flags
        if left.size:
            flags &= ~END_STREAM
        else:
            self._data_left = None
        if left.dropped:  # its stream was reset: counted for the window, dropped
            self._count_flow(size)
            return at + size
        try:
            self._data(flags, left.stream, _payload(data, at, size))
        except StreamError as exc:
            left.dropped = True
            self._reset(left.stream, exc.code)
        return at + size

    def _wanted(self) -> int:
        """How many buffered bytes the next frame needs."""
        if len(self.buffer) < HEADER_SIZE:
            return HEADER_SIZE
        size = self.buffer[0] << 16 | self.buffer[1] << 8 | self.buffer[2]
        if size > FRAME_SIZE:  # refused at once (in _frames), not waited for
            return HEADER_SIZE
        return HEADER_SIZE + size

    def _check_header(self, kind: int) -> None:
        if self._continuation is not None and kind != Kind.CONTINUATION:
            raise ConnectionError_(ErrorCode.PROTOCOL_ERROR, "headers not continued")
        if not self.handshaken and kind != Kind.SETTINGS:
            raise ConnectionError_(ErrorCode.PROTOCOL_ERROR, "the first frame is not SETTINGS")

    def _frames(self, data: bytes, at: int) -> int:
        """The whole frames from ``at``; where the first incomplete one starts."""
        end = len(data)
        unpack = HEADER.unpack_from
        while end - at >= HEADER_SIZE and not self.closed:
            high, low, kind, flags, stream = unpack(data, at)
            size = high << 16 | low
            if size > FRAME_SIZE:
                raise ConnectionError_(ErrorCode.FRAME_SIZE_ERROR, f"a frame of {size} bytes")
            if end - at < HEADER_SIZE + size:
                break
            payload: bytes | memoryview
            if kind == Kind.DATA and size >= COPIED_DATA:
                payload = _payload(data, at + HEADER_SIZE, size)
            else:
                payload = data[at + HEADER_SIZE : at + HEADER_SIZE + size]
            at += HEADER_SIZE + size
            stream &= 0x7FFFFFFF
            self._check_header(kind)
            try:
                self._frame(kind, flags, stream, payload)
            except StreamError as exc:
                self._reset(stream, exc.code)
        return at

    def _frame(self, kind: int, flags: int, stream: int, payload: Any) -> None:
        if kind == Kind.DATA:
            self._data(flags, stream, payload)
        elif kind == Kind.HEADERS:
            self._headers(flags, stream, payload)
        elif kind == Kind.CONTINUATION:
            self._more_headers(flags, stream, payload)
        elif kind == Kind.WINDOW_UPDATE:
            self._window_update(stream, payload)
        elif kind == Kind.RST_STREAM:
            if stream == 0:
                raise ConnectionError_(ErrorCode.PROTOCOL_ERROR, "RST_STREAM on stream 0")
            if len(payload) != 4:  # RFC 9113 6.4
                raise ConnectionError_(ErrorCode.FRAME_SIZE_ERROR, "a RST_STREAM not of 4 bytes")
            if self._idle(stream):
                raise ConnectionError_(ErrorCode.PROTOCOL_ERROR, "RST_STREAM on an idle stream")
            call = self.calls.pop(stream, None)
            if call is not None:
                now = time.monotonic()
                cost = reset_cost(call, now)
                call.reset_by_peer()
                self._maybe_idle()
                if cost and not self.resets.spend(cost, now):
                    self._rapid_reset()
        elif kind == Kind.SETTINGS:
            self._settings(flags, stream, payload)
        elif kind == Kind.PING:
            if stream != 0:
                raise ConnectionError_(ErrorCode.PROTOCOL_ERROR, "PING on a stream")
            if len(payload) != 8:  # RFC 9113 6.7
                raise ConnectionError_(ErrorCode.FRAME_SIZE_ERROR, "a PING not of 8 bytes")
            if flags & ACK:
                self._ping_sent = None
            else:
                self.write(ping(payload, ack=True))
        elif kind == Kind.GOAWAY:
            if stream != 0:
                raise ConnectionError_(ErrorCode.PROTOCOL_ERROR, "GOAWAY on a stream")
            if len(payload) < 8:  # RFC 9113 4.2: too short for its fields
                raise ConnectionError_(ErrorCode.FRAME_SIZE_ERROR, "a GOAWAY under 8 bytes")
            self.going_away = True  # the client opens no more; its calls go on
        elif kind == Kind.PRIORITY:
            if stream == 0:
                raise ConnectionError_(ErrorCode.PROTOCOL_ERROR, "PRIORITY on stream 0")
            if len(payload) != 5:  # RFC 9113 6.3: a stream error (on an idle one: no RST_STREAM)
                if self._idle(stream):
                    raise ConnectionError_(ErrorCode.FRAME_SIZE_ERROR, "a PRIORITY not of 5 bytes")
                raise StreamError(ErrorCode.FRAME_SIZE_ERROR, "a PRIORITY not of 5 bytes")
        elif kind == Kind.PUSH_PROMISE:
            raise ConnectionError_(ErrorCode.PROTOCOL_ERROR, "a client may not push")
        # frames of unknown kinds are ignored (RFC 9113 5.5)

    def _idle(self, stream: int) -> bool:
        """Never opened (RFC 9113 5.1): only HEADERS and PRIORITY may name it."""
        return stream > self.last_stream or stream % 2 == 0

    def _count_flow(self, size: int) -> None:
        """``size`` bytes of DATA received, against the connection's window."""
        self.unacked += size
        if self.unacked > CONNECTION_WINDOW:  # past what we gave: memory it may not take
            raise ConnectionError_(ErrorCode.FLOW_CONTROL_ERROR, "DATA past the window")
        self.give_back()

    def _data(self, flags: int, stream: int, payload: bytes | memoryview) -> None:
        if stream == 0:
            raise ConnectionError_(ErrorCode.PROTOCOL_ERROR, "DATA on stream 0")
        if payload or flags & END_STREAM:
            self.empty_data = 0
        else:  # no progress, no window spent: only a count bounds them
            self.empty_data += 1
            if self.empty_data > EMPTY_DATA_FRAMES:
                why = f"more than {EMPTY_DATA_FRAMES} empty DATA frames in a row"
                raise ConnectionError_(ErrorCode.ENHANCE_YOUR_CALM, why)
        self._count_flow(len(payload))
        call = self.calls.get(stream)
        if call is None:
            if self._idle(stream):
                raise ConnectionError_(ErrorCode.PROTOCOL_ERROR, "DATA on an idle stream")
            if stream in self._reset_streams:
                return  # it crossed our RST_STREAM: dropped (counted above), RFC 9113 5.1
            raise StreamError(ErrorCode.STREAM_CLOSED, "DATA on a closed stream")  # 6.1
        if call.remote_done:  # half-closed (remote): its request already ended
            raise StreamError(ErrorCode.STREAM_CLOSED, "DATA after END_STREAM")
        call.receive_window -= len(payload)
        if call.receive_window < 0:  # RFC 9113 6.9.1: more than the stream was given
            raise StreamError(ErrorCode.FLOW_CONTROL_ERROR, "DATA past the stream's window")
        body = unpadded(flags, payload)
        if self._content_left and stream in self._content_left:
            self._count_content(stream, len(body), bool(flags & END_STREAM))
        call.received(body, bool(flags & END_STREAM), len(payload))

    def _count_content(self, stream: int, size: int, end: bool) -> None:
        """A request with a content-length holds its DATA to it (RFC 9113 8.1.1)."""
        left = self._content_left[stream] - size
        if left < 0 or (end and left):
            del self._content_left[stream]
            raise StreamError(ErrorCode.PROTOCOL_ERROR, "DATA unlike the content-length")
        if end:
            del self._content_left[stream]
        else:
            self._content_left[stream] = left

    def give_back(self) -> None:
        """The connection's window, given back in large steps while the
        requests held here are within their bounds (budget.py)."""
        if self.unacked >= CONNECTION_WINDOW // 2 and self.requests.window_open(
            self, CONNECTION_WINDOW
        ):
            self.write(window_update(0, self.unacked))
            self.unacked = 0

    def resume_window(self) -> None:
        """Request bytes were released: the windows held back, as the bounds allow."""
        if self.closed:
            return
        self.give_back()
        for call in list(self.owing.values()):
            self.grant(call, 0)

    def _headers(self, flags: int, stream: int, payload: bytes) -> None:
        if stream == 0:
            raise ConnectionError_(ErrorCode.PROTOCOL_ERROR, "HEADERS on stream 0")
        block = unpadded(flags, payload)
        if flags & PRIORITY_FLAG:
            if len(block) < 5:
                raise ConnectionError_(ErrorCode.FRAME_SIZE_ERROR, "HEADERS too short for PRIORITY")
            block = block[5:]
        if flags & END_HEADERS:
            self._header_block(flags, stream, block)
        else:
            self._continuation = (stream, flags, bytearray(block))
            self._continuations = 0

    def _more_headers(self, flags: int, stream: int, payload: bytes) -> None:
        if self._continuation is None or self._continuation[0] != stream:
            raise ConnectionError_(ErrorCode.PROTOCOL_ERROR, "CONTINUATION out of place")
        _, first_flags, block = self._continuation
        block += payload
        if len(block) > self.server.settings.http_max_header_bytes:
            raise ConnectionError_(ErrorCode.ENHANCE_YOUR_CALM, "a header block too large")
        self._continuations += 1
        if self._continuations > MAX_CONTINUATIONS:
            why = f"a header block in more than {MAX_CONTINUATIONS} CONTINUATION frames"
            raise ConnectionError_(ErrorCode.ENHANCE_YOUR_CALM, why)
        if flags & END_HEADERS:
            self._continuation = None
            self._header_block(first_flags, stream, bytes(block))

    def _header_block(self, flags: int, stream: int, block: bytes) -> None:
        end = bool(flags & END_STREAM)
        try:
            headers = self.decoder.decode(block)
        except HeaderListTooLarge as exc:
            self._too_many_headers(stream, end, exc)
            return
        except HpackError as exc:
            raise ConnectionError_(ErrorCode.COMPRESSION_ERROR, str(exc)) from None
        call = self.calls.get(stream)
        if call is not None:  # trailers from the client: the end of its requests
            if call.remote_done:
                raise StreamError(ErrorCode.STREAM_CLOSED, "HEADERS after END_STREAM")
            if not end:
                raise StreamError(ErrorCode.PROTOCOL_ERROR, "trailers without END_STREAM")
            try:
                self.validity.trailers(headers)
            except Malformed as exc:
                raise StreamError(ErrorCode.PROTOCOL_ERROR, str(exc)) from None
            if self._content_left and stream in self._content_left:
                self._count_content(stream, 0, True)
            call.received(b"", True, 0)
            return
        if stream % 2 == 0:
            raise ConnectionError_(ErrorCode.PROTOCOL_ERROR, f"HEADERS opening stream {stream}")
        if stream <= self.last_stream:
            if stream in self._reset_streams:
                return  # a stream we reset: what crossed our RST_STREAM is ignored
            raise ConnectionError_(ErrorCode.PROTOCOL_ERROR, f"HEADERS on closed stream {stream}")
        self.last_stream = stream
        try:
            length = self.validity.request(headers)
        except Malformed as exc:  # RFC 9113 8.1.1: the stream is reset, no call begins
            raise StreamError(ErrorCode.PROTOCOL_ERROR, str(exc)) from None
        if length >= 0:
            if end and length:
                raise StreamError(ErrorCode.PROTOCOL_ERROR, "no DATA for the content-length")
            if not end:
                self._content_left[stream] = length
        if self.going_away or len(self.calls) >= self.max_streams:
            # (max_concurrent_streams bounds the calls: each handler counts its
            # connection's; this bounds the streams that have not begun one)
            self._reset(stream, ErrorCode.REFUSED_STREAM)
            return
        refusal = self.requests.refusal(self)
        if refusal:  # past max_request_bytes_held(_total): no new call brings more
            code = grpc.StatusCode.RESOURCE_EXHAUSTED
            self.write(trailers_only(self.encoder, stream, code, refusal))
            if not end:
                self._send_reset(stream, ErrorCode.NO_ERROR)
            return
        self.idle_since = None
        self.opened += 1
        call = self.server.open_call(self, stream, headers)
        self.calls[stream] = call
        call.start(end)

    def _too_many_headers(self, stream: int, end: bool, exc: HeaderListTooLarge) -> None:
        """A stream whose headers are over http_max_header_bytes: answered
        RESOURCE_EXHAUSTED; the connection and its other calls go on."""
        call = self.calls.pop(stream, None)
        if call is not None:  # its trailers: the call ends here
            self._send_reset(stream, ErrorCode.CANCEL)
            call.reset_by_peer()
            self._maybe_idle()
            return
        if stream % 2 == 0 or stream <= self.last_stream:
            raise ConnectionError_(ErrorCode.PROTOCOL_ERROR, f"HEADERS opening stream {stream}")
        self.last_stream = stream
        why = f"{exc.size} bytes of headers, over http_max_header_bytes ({exc.limit})"
        self.write(trailers_only(self.encoder, stream, grpc.StatusCode.RESOURCE_EXHAUSTED, why))
        if not end:
            self._send_reset(stream, ErrorCode.NO_ERROR)

    def _window_update(self, stream: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ConnectionError_(ErrorCode.FRAME_SIZE_ERROR, "a WINDOW_UPDATE not of 4 bytes")
        increment = struct.unpack(">I", payload)[0] & 0x7FFFFFFF
        if stream == 0:
            if increment == 0:
                raise ConnectionError_(ErrorCode.PROTOCOL_ERROR, "a window update of 0")
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise ConnectionError_(ErrorCode.FLOW_CONTROL_ERROR, "window past 2^31-1")
        else:
            call = self.calls.get(stream)
            if call is None:
                if self._idle(stream):
                    raise ConnectionError_(
                        ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE on an idle stream"
                    )
                return
            if increment == 0:
                raise StreamError(ErrorCode.PROTOCOL_ERROR, "a window update of 0")
            call.send_window += increment
            if call.send_window > MAX_WINDOW:
                raise StreamError(ErrorCode.FLOW_CONTROL_ERROR, "window past 2^31-1")
        self._open_window()

    def _open_window(self) -> None:
        opened = self._window_opened
        if opened is not None:
            self._window_opened = None
            opened.set()

    def _settings(self, flags: int, stream: int, payload: bytes) -> None:
        if stream != 0:
            raise ConnectionError_(ErrorCode.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise ConnectionError_(ErrorCode.FRAME_SIZE_ERROR, "a SETTINGS ack with a payload")
            return
        for key, value in parse_settings(payload):
            if key == Setting.INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ConnectionError_(ErrorCode.FLOW_CONTROL_ERROR, "initial window too large")
                delta = value - self.peer_stream_window
                self.peer_stream_window = value
                for call in self.calls.values():
                    call.send_window += delta
                    if call.send_window > MAX_WINDOW:  # RFC 9113 6.9.2
                        raise ConnectionError_(ErrorCode.FLOW_CONTROL_ERROR, "a window past 2^31-1")
            elif key == Setting.MAX_FRAME_SIZE:
                if not DEFAULT_FRAME_SIZE <= value <= MAX_FRAME_SIZE_LIMIT:
                    raise ConnectionError_(ErrorCode.PROTOCOL_ERROR, "MAX_FRAME_SIZE out of range")
                self.peer_frame_size = value
            elif key == Setting.ENABLE_PUSH and value > 1:
                raise ConnectionError_(ErrorCode.PROTOCOL_ERROR, "ENABLE_PUSH not 0 or 1")
            elif key == Setting.HEADER_TABLE_SIZE:
                self.encoder.resize(value)  # signalled at the start of our next block
            # the rest do not bind us
        self.write(SETTINGS_ACK)
        if not self.handshaken:
            self.handshaken = True
        self._open_window()

    def _refuse_not_h2(self) -> None:
        """Not HTTP/2 (an HTTP/1.1 client at the gRPC port): said, and closed."""
        if self.transport is not None:
            self.transport.write(
                b"HTTP/1.1 505 HTTP Version Not Supported\r\ncontent-length: 0\r\n"
                b"connection: close\r\n\r\n"
            )
            self.closed = True
            self.transport.close()

    # -- what calls use ------------------------------------------------------

    def _send_reset(self, stream: int, code: ErrorCode) -> None:
        """RST_STREAM; what the client already sent on that stream is ignored."""
        self.write(rst_stream(stream, code))
        self._reset_streams[stream] = None
        if len(self._reset_streams) > RESET_REMEMBERED:
            del self._reset_streams[next(iter(self._reset_streams))]

    def _reset(self, stream: int, code: ErrorCode) -> None:
        self._send_reset(stream, code)
        if self._content_left:
            self._content_left.pop(stream, None)
        call = self.calls.pop(stream, None)
        if call is not None:
            call.reset_by_peer()
            self._maybe_idle()

    def reset(self, call: Call, code: ErrorCode) -> None:
        """We end ``call``'s stream (it is finished on our side already)."""
        self._send_reset(call.stream, code)

    def ended(self, call: Call) -> None:
        """``call`` sent its status (or was reset): the stream is closed."""
        if self.calls.get(call.stream) is call:
            del self.calls[call.stream]
            if self._content_left:
                self._content_left.pop(call.stream, None)
            self.resets.answered(call)
            self._maybe_idle()

    def _maybe_idle(self) -> None:
        if not self.calls:
            self.idle_since = time.monotonic()
            if self.going_away and self.transport is not None and not self.closed:
                self.loop.call_soon(self._close_if_idle)

    def _close_if_idle(self) -> None:
        if not self.calls and not self.closed:
            self._flush()
            self.close()

    def grant(self, call: Call, size: int) -> None:
        """The stream's ``size`` received bytes are taken: the client may send more
        (with what a bound held back before), unless a bound holds it back."""
        size += call.owed
        if size <= 0 or call.remote_done or call.finished:
            return
        if not self.requests.may_grant(self, call):
            call.owed = size
            self.owing[call.stream] = call
            return
        if call.owed:
            call.owed = 0
            del self.owing[call.stream]
        call.receive_window += size
        self.write(window_update(call.stream, size))

    def data_frames(self, call: Call, prefix: bytes, body: bytes | memoryview) -> bool:
        """Writes one DATA frame of ``prefix`` and ``body`` when the windows have
        room for all of it at once."""
        size = len(prefix) + len(body)
        if size > call.send_window or size > self.send_window or size > self.peer_frame_size:
            return False
        call.send_window -= size
        self.send_window -= size
        self._queue(frame_header(Kind.DATA, 0, call.stream, size) + prefix)
        if body:
            self._queue(body)
        return True

    async def send_data(self, call: Call, prefix: bytes, body: bytes | memoryview) -> None:
        """Writes ``prefix`` and ``body`` in DATA frames as the client's windows
        allow; the frames' payloads are views of them, not copies."""
        parts = [memoryview(body), memoryview(prefix)]  # (taken from the end)
        while parts:
            if self.closed or call.finished:
                raise asyncio.CancelledError
            room = min(call.send_window, self.send_window, self.peer_frame_size)
            room = min(room, sum(len(part) for part in parts))
            if room <= 0:
                if self._window_opened is None:
                    self._window_opened = asyncio.Event()
                opened = self._window_opened
                await opened.wait()
                continue
            call.send_window -= room
            self.send_window -= room
            self._queue(frame_header(Kind.DATA, 0, call.stream, room))
            while room:
                part = parts[-1]
                if len(part) <= room:
                    parts.pop()
                    if part:
                        self._queue(part)
                    room -= len(part)
                else:
                    self._queue(part[:room])
                    parts[-1] = part[room:]
                    room = 0
            if self._paused:
                await self.drained()

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        """A call's task, owned by this connection (and the server, at stop)."""
        task = self.loop.create_task(coro)
        self._spawned += 1
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def _rapid_reset(self) -> None:
        """The client's resets cost past its budget: a flood."""
        if self.going_away:
            return
        log.warning(
            "router: sending GOAWAY to %s: its resets cost more than their budget "
            "(rapid reset; %d streams opened)",
            self.peer,
            self.opened,
        )
        self.go_away("streams reset before their answer", ErrorCode.ENHANCE_YOUR_CALM)

    def go_away(self, why: str, code: ErrorCode = ErrorCode.NO_ERROR) -> None:
        """No new streams; the open ones finish. Closed when the last ends."""
        if self.closed:
            return
        if not self.going_away:
            self.going_away = True
            self.write(goaway(self.last_stream, code, why.encode()))
        if not self.calls:
            self.close()

    # -- timers ----------------------------------------------------------------

    def _handshake_late(self) -> None:
        if not self.handshaken and not self.closed:
            why = "did not receive HTTP/2 settings within handshake_timeout_s"
            self.close(ErrorCode.SETTINGS_TIMEOUT, why)

    def _check_idle(self) -> None:
        if self.closed:
            return
        idle_s = self.server.settings.max_connection_idle_s
        since = self.idle_since
        now = time.monotonic()
        if since is not None and now - since >= idle_s and not self.calls:
            self.go_away("idle: no call for max_connection_idle_s")
            return
        self._arm("idle", idle_s if since is None else idle_s - (now - since), self._check_idle)

    def _too_old(self) -> None:
        if self.closed:
            return
        self.go_away("max_connection_age_s")
        grace = self.server.settings.max_connection_age_grace_s
        self._arm("grace", grace, self._abort_calls)

    def drop(self) -> None:
        """The server stops: a connection still lingering after an error is closed now."""
        if self.lingering and self.transport is not None:
            self.transport.abort()

    def _abort_calls(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.abort()

    def _check_alive(self) -> None:
        if self.closed:
            return
        settings = self.server.settings
        now = time.monotonic()
        if self._ping_sent is not None:
            if now - self._ping_sent >= settings.keepalive_timeout_s:
                log.info("router: %s did not answer a ping: closing its connection", self.peer)
                self._abort_calls()
                return
            wait = settings.keepalive_timeout_s - (now - self._ping_sent)
        elif self.calls and now - self.last_read >= settings.keepalive_time_s:
            self._ping_sent = now
            self.write(frame(Kind.PING, 0, 0, PING_DATA))
            wait = settings.keepalive_timeout_s
        elif self.calls:
            wait = settings.keepalive_time_s - (now - self.last_read)
        else:
            wait = settings.keepalive_time_s
        self._arm("alive", wait, self._check_alive)


def _peer_of(transport: asyncio.Transport) -> str:
    """grpc's form of the client's address: ``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``."""
    address = transport.get_extra_info("peername")
    if isinstance(address, tuple) and len(address) >= 2:
        host, port = address[0], address[1]
        if ":" in str(host):
            return f"ipv6:[{host}]:{port}"
        return f"ipv4:{host}:{port}"
    return f"unix:{address}"
