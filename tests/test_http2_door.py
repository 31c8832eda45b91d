"""The router's own HTTP/2 gRPC server (service/router/http2), in this process
on a loopback port: grpc's own client (C-core, as tritonclient's and
perf_analyzer's) for the four kinds of call, metadata, statuses, deadlines,
cancellation, compression, size limits and flow control; and raw frames for
what a well-behaved client never sends (no preface, no SETTINGS, a broken
header block, pings, a client that reads nothing)."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace
from typing import Any, ClassVar

import grpc
import pytest

from poolserve.service.contract.settings import ServerSettings
from poolserve.service.router.http2.connection import (
    EMPTY_DATA_FRAMES,
    MAX_CONTINUATIONS,
    UNREAD_FRAMES,
    WRITE_SLICE,
)
from poolserve.service.router.http2.frames import (
    ACK,
    END_HEADERS,
    END_STREAM,
    HEADER,
    PREFACE,
    ErrorCode,
    Kind,
    Setting,
    frame,
    settings_frame,
    window_update,
)
from poolserve.service.router.http2.hpack import Decoder, Encoder, encode_integer
from poolserve.service.router.http2.replies import ACCEPT_ENCODING
from poolserve.service.router.http2.resets import (
    COST_OPENED,
    COST_RUNNING,
    COST_STARTED,
    EARLY_RESET_SHARE,
    RESET_BUDGET,
    reset_cost,
)
from poolserve.service.router.http2.server import GrpcServer

from support import held_in_cycles, no_collector

SERVICE = "test.Echo"
WAIT = 30.0


class Echo:
    """Handlers that say what they saw; ``cancelled`` counts handlers cancelled."""

    def __init__(self) -> None:
        self.cancelled = 0
        self.waiting = 0  # handlers waiting to be cancelled
        self.started = asyncio.Event()
        self.waiting = 0  # handlers that began to wait until cancelled
        self.done_callbacks = 0

    async def unary(self, request: bytes, context: Any) -> bytes:
        metadata = dict(context.invocation_metadata())
        if request == b"metadata":
            return repr(sorted(metadata.items())).encode()
        if request == b"abort":
            context.set_trailing_metadata((("where", "here"), ("blob-bin", b"\x00\xff")))
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no: é 100%")
        if request == b"raise":
            raise RuntimeError("boom")
        if request == b"remaining":
            return repr(context.time_remaining()).encode()
        if request.startswith(b"big:"):
            context.add_done_callback(lambda _: self._done())
            return b"x" * int(request[4:])
        if request.startswith(b"lent:"):  # a view, whose memory is reused once the call is done
            assert context.sends_views
            lent = bytearray(bytes(range(256)) * (int(request[5:]) // 256))
            context.add_done_callback(lambda _: lent.__setitem__(slice(None), bytes(len(lent))))
            return memoryview(lent)
        if request == b"wait" or request.startswith(b"hold:"):
            await self._wait_until_cancelled()
        return request

    async def _wait_until_cancelled(self) -> None:
        self.started.set()
        self.waiting += 1
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.waiting -= 1

    def _done(self) -> None:
        self.done_callbacks += 1

    async def server_stream(self, request: bytes, context: Any) -> AsyncIterator[bytes]:
        for i in range(int(request)):
            yield b"%d" % i

    async def bidi(self, requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        async for request in requests:
            yield request.upper()

    async def client_stream(self, requests: AsyncIterator[bytes], context: Any) -> bytes:
        return b",".join([r async for r in requests])

    async def stall(self, requests: AsyncIterator[bytes], context: Any) -> bytes:
        """Never reads its requests (a handler busy elsewhere)."""
        await self._wait_until_cancelled()
        return b""

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Unary": grpc.unary_unary_rpc_method_handler(self.unary),
                "ServerStream": grpc.unary_stream_rpc_method_handler(self.server_stream),
                "Bidi": grpc.stream_stream_rpc_method_handler(self.bidi),
                "ClientStream": grpc.stream_unary_rpc_method_handler(self.client_stream),
                "Stall": grpc.stream_unary_rpc_method_handler(self.stall),
            },
        )


def settings(**changes: Any) -> ServerSettings:
    return dataclasses.replace(ServerSettings(), **changes)


async def serving(
    echo: Echo, test: Callable[[str, GrpcServer], Awaitable[None]], **changes: Any
) -> None:
    server = GrpcServer(settings(**changes), [echo.handler()])
    port = await server.bind("127.0.0.1", 0)
    await server.start()
    try:
        await asyncio.wait_for(test(f"127.0.0.1:{port}", server), 120)
    finally:
        for raw in Raw.opened:
            raw.writer.close()
        Raw.opened.clear()
        await server.stop(1.0)


def path(method: str) -> str:
    return f"/{SERVICE}/{method}"


def test_grpc_clients_four_kinds_of_call_metadata_and_statuses() -> None:
    echo = Echo()

    async def test(address: str, _: GrpcServer) -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            unary = channel.unary_unary(path("Unary"))
            assert await unary(b"hello", timeout=WAIT) == b"hello"
            assert await unary(b"", timeout=WAIT) == b""
            seen = await unary(
                b"metadata", metadata=(("k", "v"), ("b-bin", b"\x01\x02")), timeout=WAIT
            )
            assert "('k', 'v')" in seen.decode() and "('b-bin', b'\\x01\\x02')" in seen.decode()
            assert "grpc-timeout" not in seen.decode()
            left = float(await unary(b"remaining", timeout=20))
            assert 0 < left <= 21  # (grpc rounds the timeout it sends up)
            assert await unary(b"remaining") == b"None"
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await unary(b"abort", timeout=WAIT)
            assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert refused.value.details() == "no: é 100%"
            trailing = dict(refused.value.trailing_metadata() or ())
            assert trailing["where"] == "here" and trailing["blob-bin"] == b"\x00\xff"
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await unary(b"raise", timeout=WAIT)
            assert failed.value.code() is grpc.StatusCode.UNKNOWN
            assert "boom" in (failed.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await channel.unary_unary(path("Nope"))(b"", timeout=WAIT)
            assert unknown.value.code() is grpc.StatusCode.UNIMPLEMENTED
            streamed = channel.unary_stream(path("ServerStream"))(b"5", timeout=WAIT)
            assert [m async for m in streamed] == [b"0", b"1", b"2", b"3", b"4"]
            bidi = channel.stream_stream(path("Bidi"))(timeout=WAIT)
            for word in (b"a", b"bc", b"def"):
                await bidi.write(word)
                assert await bidi.read() == word.upper()
            await bidi.done_writing()
            assert await bidi.read() is grpc.aio.EOF
            assert await bidi.code() is grpc.StatusCode.OK

            async def three() -> AsyncIterator[bytes]:
                for word in (b"x", b"y", b"z"):
                    yield word

            joined = await channel.stream_unary(path("ClientStream"))(three(), timeout=WAIT)
            assert joined == b"x,y,z"
            # many at once on one connection, each reply to its own call
            calls = [unary(b"%d" % i, timeout=WAIT) for i in range(200)]
            assert await asyncio.gather(*calls) == [b"%d" % i for i in range(200)]

    asyncio.run(serving(echo, test))


def test_large_messages_both_ways_compression_and_the_size_limit() -> None:
    echo = Echo()
    limit = 9 << 20

    async def test(address: str, _: GrpcServer) -> None:
        options = [("grpc.max_receive_message_length", 64 << 20)]
        async with grpc.aio.insecure_channel(address, options=options) as channel:
            unary = channel.unary_unary(path("Unary"))
            body = bytes(range(256)) * (8 << 12)  # 8 MiB: many windows, many frames
            assert await unary(body, timeout=WAIT) == body
            assert len(await unary(b"big:%d" % (8 << 20), timeout=WAIT)) == 8 << 20
            squeezed = await unary(b"z" * 100_000, timeout=WAIT, compression=grpc.Compression.Gzip)
            assert squeezed == b"z" * 100_000
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await unary(b"q" * (limit + 1), timeout=WAIT)
            assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "Received message larger than max" in (refused.value.details() or "")
            # a compressed message that inflates past the limit is refused too
            with pytest.raises(grpc.aio.AioRpcError) as inflated:
                await unary(b"\0" * (limit + 1), timeout=WAIT, compression=grpc.Compression.Gzip)
            assert inflated.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert await unary(b"still here", timeout=WAIT) == b"still here"

    asyncio.run(serving(echo, test, max_message_size=limit))


def test_deadline_and_cancel_end_the_handler() -> None:
    echo = Echo()

    async def test(address: str, _: GrpcServer) -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            unary = channel.unary_unary(path("Unary"))
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await unary(b"wait", timeout=0.5)
            assert late.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            await until(lambda: echo.cancelled == 1)
            echo.started.clear()
            call = unary(b"wait", timeout=WAIT)
            await asyncio.wait_for(echo.started.wait(), WAIT)
            call.cancel()
            await until(lambda: echo.cancelled == 2)
            assert await unary(b"after", timeout=WAIT) == b"after"

    asyncio.run(serving(echo, test))


async def until(predicate: Callable[[], bool]) -> None:
    """Polls ``predicate`` (state of the server in this process) for up to WAIT."""
    for _ in range(int(WAIT / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


# -- raw frames ------------------------------------------------------------------


class Raw:
    """A client of bare frames over a socket (closed when its test ends)."""

    opened: ClassVar[list[Raw]] = []

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.decoder = Decoder()
        self.fields: list[tuple[bytes, bytes]] = []  # of the last HEADERS frame read
        self.blocks: list[bytes] = []  # every header block read, in order

    @classmethod
    async def open(cls, address: str, preface: bool = True, window: int = 65_535) -> Raw:
        host, port = address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        raw = cls(reader, writer)
        cls.opened.append(raw)
        if preface:
            writer.write(PREFACE + settings_frame({Setting.INITIAL_WINDOW_SIZE: window}))
        return raw

    async def frame(self) -> tuple[int, int, int, bytes]:
        """The next frame: kind, flags, stream, payload. A header block is decoded
        here (every one must be, in order: the server's dynamic table)."""
        head = await self.reader.readexactly(9)
        high, low, kind, flags, stream = HEADER.unpack(head)
        payload = await self.reader.readexactly(high << 16 | low)
        if kind == Kind.HEADERS:  # (the server's: END_HEADERS, no padding or priority)
            self.fields = self.decoder.decode(payload)
            self.blocks.append(payload)
        return kind, flags, stream, payload

    async def until_kind(self, kind: int) -> tuple[int, int, bytes]:
        while True:
            got, flags, stream, payload = await asyncio.wait_for(self.frame(), WAIT)
            if got == kind:
                return flags, stream, payload

    def call(
        self, stream: int, method: str, message: bytes, end: bool = True, extra: bytes = b""
    ) -> None:
        headers = [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", path(method).encode()),
            (b":authority", b"x"),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        ]
        if extra:
            headers.append((b"x-extra", extra))
        block = Encoder().encode(headers)
        data = b"\0" + struct.pack(">I", len(message)) + message
        self.writer.write(
            frame(Kind.HEADERS, END_HEADERS, stream, block)
            + frame(Kind.DATA, END_STREAM if end else 0, stream, data)
        )


def test_what_a_client_must_not_send_ends_its_connection_not_the_server() -> None:
    echo = Echo()

    async def test(address: str, _: GrpcServer) -> None:
        # HTTP/1.1 at the gRPC port: said so, and closed
        raw = await Raw.open(address, preface=False)
        raw.writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        answer = await asyncio.wait_for(raw.reader.read(), WAIT)
        assert answer.startswith(b"HTTP/1.1 505")
        # a header block HPACK cannot read: GOAWAY COMPRESSION_ERROR
        raw = await Raw.open(address)
        raw.writer.write(frame(Kind.HEADERS, END_HEADERS | END_STREAM, 1, b"\x80"))  # index 0
        _, _, payload = await raw.until_kind(Kind.GOAWAY)
        assert struct.unpack(">I", payload[4:8])[0] == ErrorCode.COMPRESSION_ERROR
        assert await asyncio.wait_for(raw.reader.read(), WAIT) == b""
        # a ping is answered with its own bytes
        raw = await Raw.open(address)
        raw.writer.write(frame(Kind.PING, 0, 0, b"12345678"))
        flags, _, payload = await raw.until_kind(Kind.PING)
        assert flags & ACK and payload == b"12345678"
        # and grpc's clients are still served
        async with grpc.aio.insecure_channel(address) as channel:
            assert await channel.unary_unary(path("Unary"))(b"ok", timeout=WAIT) == b"ok"

    asyncio.run(serving(echo, test))


def test_headers_over_the_limit_refuse_their_call_not_the_connection() -> None:
    echo = Echo()

    async def test(address: str, _: GrpcServer) -> None:
        raw = await Raw.open(address)
        raw.call(1, "Unary", b"x", extra=b"v" * 20_000)
        raw.call(3, "Unary", b"fine")
        statuses: dict[int, bytes] = {}
        replies: dict[int, bytes] = {}
        while len(statuses) < 2:
            kind, flags, stream, payload = await asyncio.wait_for(raw.frame(), WAIT)
            assert kind != Kind.GOAWAY
            if kind == Kind.DATA:
                replies[stream] = payload[5:]
            if kind == Kind.HEADERS and flags & END_STREAM:
                fields = dict(raw.fields)
                statuses[stream] = fields[b"grpc-status"]
                if stream == 1:
                    assert b"http_max_header_bytes" in fields[b"grpc-message"]
        assert statuses == {1: b"8", 3: b"0"}  # RESOURCE_EXHAUSTED, and OK
        assert replies == {3: b"fine"}

    asyncio.run(serving(echo, test, http_max_header_bytes=16_384))


def test_frames_crossing_our_rst_stream_are_ignored() -> None:
    """A call refused before its body ended is reset (NO_ERROR); the client's
    trailers for it, sent before it saw the reset, do not end the connection."""
    echo = Echo()

    async def test(address: str, _: GrpcServer) -> None:
        raw = await Raw.open(address)
        raw.call(1, "Nope", b"x", end=False)  # UNIMPLEMENTED at once, then RST_STREAM
        _, stream, _ = await raw.until_kind(Kind.RST_STREAM)
        assert stream == 1
        trailers = Encoder().encode(((b"x-late", b"1"),))
        raw.writer.write(frame(Kind.HEADERS, END_HEADERS | END_STREAM, 1, trailers))
        raw.call(3, "Unary", b"after")
        while True:
            kind, flags, stream, _ = await asyncio.wait_for(raw.frame(), WAIT)
            assert kind != Kind.GOAWAY
            if kind == Kind.HEADERS:
                fields = dict(raw.fields)
                if stream == 3 and flags & END_STREAM:
                    assert fields[b"grpc-status"] == b"0"
                    break

    asyncio.run(serving(echo, test))


def test_a_connection_without_settings_is_closed_after_the_handshake_timeout() -> None:
    echo = Echo()

    async def test(address: str, _: GrpcServer) -> None:
        raw = await Raw.open(address, preface=False)
        raw.writer.write(PREFACE)  # and no SETTINGS
        _, _, payload = await raw.until_kind(Kind.GOAWAY)
        assert struct.unpack(">I", payload[4:8])[0] == ErrorCode.SETTINGS_TIMEOUT

    asyncio.run(serving(echo, test, handshake_timeout_s=0.5))


def test_a_reply_the_client_has_no_window_for_waits_and_its_call_stays_open() -> None:
    """A client that grants no window gets the reply only as it opens one:
    the call's done callbacks (the router's count of unread reply bytes) run
    only once the last byte left, and other connections are served meanwhile."""
    echo = Echo()

    async def test(address: str, _: GrpcServer) -> None:
        raw = await Raw.open(address, window=1000)
        raw.call(1, "Unary", b"big:300000")
        got = 0
        while got < 1000:  # the stream's first window, and no more
            kind, _, _, payload = await asyncio.wait_for(raw.frame(), WAIT)
            if kind == Kind.DATA:
                got += len(payload)
        async with grpc.aio.insecure_channel(address) as channel:
            assert await channel.unary_unary(path("Unary"))(b"ok", timeout=WAIT) == b"ok"
        assert echo.done_callbacks == 0  # held: the client has not taken it
        raw.writer.write(window_update(0, 1 << 20) + window_update(1, 1 << 20))
        while True:
            kind, flags, _, payload = await asyncio.wait_for(raw.frame(), WAIT)
            if kind == Kind.DATA:
                got += len(payload)
            if kind == Kind.HEADERS and flags & END_STREAM:
                break
        assert got == 300_005
        await until(lambda: echo.done_callbacks == 1)

    asyncio.run(serving(echo, test))


def test_stop_lets_calls_in_flight_finish_and_refuses_new_ones() -> None:
    echo = Echo()

    async def test(address: str, server: GrpcServer) -> None:
        raw = await Raw.open(address)
        raw.call(1, "Unary", b"wait")
        await asyncio.wait_for(echo.started.wait(), WAIT)
        stopping = asyncio.ensure_future(server.stop(0.5))
        _, _, payload = await raw.until_kind(Kind.GOAWAY)
        last, code = struct.unpack(">II", payload[:8])
        assert (last, code) == (1, ErrorCode.NO_ERROR)
        raw.call(3, "Unary", b"late")
        _, stream, _ = await raw.until_kind(Kind.RST_STREAM)
        assert stream == 3
        await stopping
        assert echo.cancelled == 1  # past the grace: cancelled
        host, port = address.rsplit(":", 1)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((host, int(port)), timeout=5).close()

    asyncio.run(serving(echo, test))


def test_keepalive_closes_a_connection_that_stops_answering_pings() -> None:
    echo = Echo()

    async def test(address: str, _: GrpcServer) -> None:
        raw = await Raw.open(address)
        raw.call(1, "Unary", b"wait")
        await asyncio.wait_for(echo.started.wait(), WAIT)
        flags, _, _ = await raw.until_kind(Kind.PING)  # a call in flight, silence
        assert not flags & ACK
        # no ack: the connection is closed and its call cancelled
        assert await asyncio.wait_for(raw.reader.read(), WAIT) is not None
        await until(lambda: echo.cancelled == 1)

    asyncio.run(serving(echo, test, keepalive_time_s=0.3, keepalive_timeout_s=0.3))


def test_an_idle_connection_is_sent_goaway() -> None:
    echo = Echo()

    async def test(address: str, _: GrpcServer) -> None:
        raw = await Raw.open(address)
        raw.call(1, "Unary", b"hi")
        _, _, payload = await raw.until_kind(Kind.GOAWAY)
        assert struct.unpack(">II", payload[:8]) == (1, ErrorCode.NO_ERROR)

    asyncio.run(serving(echo, test, max_connection_idle_s=0.3))


async def frames_until_reset(raw: Raw, stream: int) -> list[tuple[int, int]]:
    """The (kind, flags) of ``stream``'s frames up to its RST_STREAM (whose code is last)."""
    seen: list[tuple[int, int]] = []
    while True:
        kind, flags, got, payload = await asyncio.wait_for(raw.frame(), WAIT)
        if got != stream:
            continue
        if kind == Kind.RST_STREAM:
            seen.append((kind, struct.unpack(">I", payload)[0]))
            return seen
        seen.append((kind, flags))


def test_data_or_headers_after_end_stream_reset_the_stream_not_a_second_call() -> None:
    """Found by reliability/http2_fuzzing.py: DATA after the request's END_STREAM
    began a second handler on the same stream (two replies, DATA after the
    trailers); HEADERS after it sent a status while the handler ran on. The
    stream is half-closed: STREAM_CLOSED (RFC 9113 5.1), the handler cancelled."""
    echo = Echo()

    async def test(address: str, _: GrpcServer) -> None:
        raw = await Raw.open(address)
        raw.call(1, "Unary", b"wait")
        await asyncio.wait_for(echo.started.wait(), WAIT)
        echo.started.clear()
        raw.writer.write(frame(Kind.DATA, END_STREAM, 1, b"\0\0\0\0\5hello"))
        seen = await frames_until_reset(raw, 1)
        assert seen == [(Kind.RST_STREAM, ErrorCode.STREAM_CLOSED)], seen
        await until(lambda: echo.cancelled == 1)
        trailers = Encoder().encode(((b"x-t", b"1"),))
        raw.call(3, "Unary", b"wait")
        await asyncio.wait_for(echo.started.wait(), WAIT)
        raw.writer.write(frame(Kind.HEADERS, END_HEADERS | END_STREAM, 3, trailers))
        seen = await frames_until_reset(raw, 3)
        assert seen == [(Kind.RST_STREAM, ErrorCode.STREAM_CLOSED)], seen
        await until(lambda: echo.cancelled == 2)
        raw.call(5, "Unary", b"still served")  # the connection goes on
        _, stream, _ = await raw.until_kind(Kind.DATA)
        assert stream == 5

    asyncio.run(serving(echo, test))


def test_frames_on_streams_never_opened_end_the_connection() -> None:
    """Found by reliability/http2_fuzzing.py: RST_STREAM and WINDOW_UPDATE on a
    stream never opened (idle) were ignored; RFC 9113 5.1 makes them a
    connection error PROTOCOL_ERROR. So is a HEADERS frame whose PRIORITY
    flag claims five bytes it does not have (FRAME_SIZE_ERROR, 4.2)."""
    echo = Echo()

    async def test(address: str, _: GrpcServer) -> None:
        bad = [
            (frame(Kind.RST_STREAM, 0, 5, b"\0\0\0\x08"), ErrorCode.PROTOCOL_ERROR),
            (frame(Kind.RST_STREAM, 0, 2, b"\0\0\0\x08"), ErrorCode.PROTOCOL_ERROR),
            (window_update(3, 100), ErrorCode.PROTOCOL_ERROR),
            (frame(Kind.HEADERS, 0x20 | END_HEADERS, 1, b"\0\0"), ErrorCode.FRAME_SIZE_ERROR),
        ]
        for data, code in bad:
            raw = await Raw.open(address)
            raw.writer.write(data)
            _, _, payload = await raw.until_kind(Kind.GOAWAY)
            assert struct.unpack(">I", payload[4:8])[0] == code, data
        # a stream that was opened and ended: its RST_STREAM and WINDOW_UPDATE are lawful
        raw = await Raw.open(address)
        raw.call(1, "Unary", b"one")
        await raw.until_kind(Kind.DATA)
        raw.writer.write(frame(Kind.RST_STREAM, 0, 1, b"\0\0\0\x08") + window_update(1, 10))
        raw.call(3, "Unary", b"two")
        _, stream, _ = await raw.until_kind(Kind.DATA)
        assert stream == 3

    asyncio.run(serving(echo, test))


def test_data_past_the_connections_window_ends_the_connection() -> None:
    """Found reading the fuzzer's DATA cases: a client that ignores flow control
    could make the router hold any amount (past max_request_bytes_held the
    window is not given back, but nothing checked the client kept to it). Past
    the window: GOAWAY FLOW_CONTROL_ERROR (RFC 9113 6.9.1), the bytes held are
    bounded. Here eight streams whose handlers take nothing send whole
    messages, past the 1 MiB bound and then past the connection's 16 MiB window."""
    echo = Echo()

    async def test(address: str, server: GrpcServer) -> None:
        raw = await Raw.open(address)
        message = b"\0" + struct.pack(">I", 1019) + b"x" * 1019
        chunk = message * 1024  # 1 MiB of whole messages
        for stream in range(1, 17, 2):
            raw.call(stream, "Stall", b"x", end=False)
        for k in range(17):  # 16 of these fit the connection's window, each stream's too
            raw.writer.write(frame(Kind.DATA, 0, 1 + 2 * (k % 8), chunk[: (1 << 20) - 16]))
        _, _, payload = await raw.until_kind(Kind.GOAWAY)
        assert struct.unpack(">I", payload[4:8])[0] == ErrorCode.FLOW_CONTROL_ERROR
        assert server.requests.withheld > 0

    asyncio.run(serving(echo, test, max_request_bytes_held=1 << 20))


def test_data_after_a_unary_calls_message_ends_that_call_at_once() -> None:
    """A unary call's stream that sends more than its one message is answered
    INTERNAL as soon as the extra bytes come (its window would otherwise keep
    them coming, past max_message_size); the connection serves on."""
    echo = Echo()

    async def test(address: str, server: GrpcServer) -> None:
        raw = await Raw.open(address)
        raw.call(1, "Unary", b"x" * 10, end=False)
        raw.writer.write(frame(Kind.DATA, 0, 1, b"more"))
        _, stream, payload = await raw.until_kind(Kind.HEADERS)
        fields = dict(raw.decoder.decode(payload))
        assert (stream, fields[b"grpc-status"]) == (1, b"13")
        assert b"one request message" in fields[b"grpc-message"]
        raw.call(3, "Unary", b"after")
        _, stream, data = await raw.until_kind(Kind.DATA)
        assert (stream, data[5:]) == (3, b"after")
        assert server.requests.total == 0

    asyncio.run(serving(echo, test))


def test_data_past_a_streams_window_resets_that_stream() -> None:
    """A client may send a stream no more than the window it was given (4 MiB,
    then what its handler took). One that ignores it on a stream whose handler
    does not read gets RST_STREAM FLOW_CONTROL_ERROR (RFC 9113 6.9.1), its
    handler is cancelled, and the connection serves on. Before, only the
    connection's window was checked: one stream could hold it all."""
    echo = Echo()

    async def test(address: str, _: GrpcServer) -> None:
        raw = await Raw.open(address)
        raw.call(1, "Stall", b"x", end=False)
        await asyncio.wait_for(echo.started.wait(), WAIT)
        message = b"\0" + struct.pack(">I", 1019) + b"x" * 1019
        chunk = message * 1024  # 1 MiB of whole messages
        for _ in range(5):  # past the stream's 4 MiB, inside the connection's 16 MiB
            raw.writer.write(frame(Kind.DATA, 0, 1, chunk))
        kind, _, stream, payload = await asyncio.wait_for(raw.frame(), WAIT)
        while kind in (Kind.SETTINGS, Kind.WINDOW_UPDATE, Kind.PING):
            kind, _, stream, payload = await asyncio.wait_for(raw.frame(), WAIT)
        assert (kind, stream) == (Kind.RST_STREAM, 1)
        assert struct.unpack(">I", payload)[0] == ErrorCode.FLOW_CONTROL_ERROR
        raw.call(3, "Unary", b"after")
        _, stream, data = await raw.until_kind(Kind.DATA)
        assert (stream, data[5:]) == (3, b"after")
        for _ in range(100):
            if echo.cancelled:
                break
            await asyncio.sleep(0.05)
        assert echo.cancelled == 1

    asyncio.run(serving(echo, test))


def test_initial_window_size_that_pushes_a_stream_past_the_limit_ends_the_connection() -> None:
    """Found writing reliability/http2_fuzzing.py's SETTINGS cases: an INITIAL_WINDOW_SIZE that
    takes an open stream's window past 2^31-1 was taken; it is a connection
    error FLOW_CONTROL_ERROR (RFC 9113 6.9.2)."""
    echo = Echo()

    async def test(address: str, _: GrpcServer) -> None:
        raw = await Raw.open(address)
        raw.call(1, "Unary", b"x", end=False)
        raw.writer.write(
            window_update(1, 2**31 - 1 - 65_535)
            + settings_frame({Setting.INITIAL_WINDOW_SIZE: 2**31 - 1})
        )
        _, _, payload = await raw.until_kind(Kind.GOAWAY)
        assert struct.unpack(">I", payload[4:8])[0] == ErrorCode.FLOW_CONTROL_ERROR

    asyncio.run(serving(echo, test))


def test_a_frame_past_the_size_limit_is_refused_even_when_its_header_comes_in_pieces() -> None:
    """Found by reliability/http2_fuzzing.py writing cases in pieces: a frame
    header cut across two reads, announcing more than the 1 MiB we advertise,
    was waited for (up to 16 MiB held) instead of refused: FRAME_SIZE_ERROR."""
    echo = Echo()

    async def test(address: str, _: GrpcServer) -> None:
        raw = await Raw.open(address)
        await raw.until_kind(Kind.SETTINGS)  # the preface and SETTINGS are read
        head = HEADER.pack(0xFF, 0xFFFF, Kind.DATA, 0, 1)
        raw.writer.write(head[:4])
        await raw.writer.drain()
        await asyncio.sleep(0.05)  # (a second read: the header cut, as a slow client does)
        raw.writer.write(head[4:] + b"x" * 100)
        _, _, payload = await raw.until_kind(Kind.GOAWAY)
        assert struct.unpack(">I", payload[4:8])[0] == ErrorCode.FRAME_SIZE_ERROR

    asyncio.run(serving(echo, test))


def test_frames_cut_anywhere_across_reads_give_the_same_messages_without_buffering_them() -> None:
    """A large DATA frame's payload goes on to its call as it comes, in parts
    (views of the reads), instead of waiting whole in the connection's buffer;
    the message is the same bytes wherever the client's writes cut the frames:
    inside a frame header, a gRPC length prefix, a payload, at its end."""
    echo = Echo()
    message = bytes(range(256)) * 1200  # 307,200 bytes: three DATA frames and a bit
    prefixed = b"\0" + struct.pack(">I", len(message)) + message
    sizes = (100_000, 100_000, 100_000, len(prefixed) - 300_000)

    def request(stream: int) -> bytes:
        headers = [(b":method", b"POST"), (b":scheme", b"http"),
                   (b":path", path("Unary").encode()), (b":authority", b"x"),
                   (b"content-type", b"application/grpc")]  # fmt: skip
        out = frame(Kind.HEADERS, END_HEADERS, stream, Encoder().encode(headers))
        at = 0
        for i, size in enumerate(sizes):
            flags = END_STREAM if i == len(sizes) - 1 else 0
            out += frame(Kind.DATA, flags, stream, prefixed[at : at + size])
            at += size
        return out

    async def test(address: str, server: GrpcServer) -> None:
        raw = await Raw.open(address, window=1 << 20)
        raw.writer.write(window_update(0, 1 << 20))
        await raw.until_kind(Kind.SETTINGS)
        for stream, cuts in ((1, (3, 60, 70_000, 100_012, 100_020)), (3, (1, 2, 50_000))):
            data = request(stream)
            (conn,) = server.connections
            at = 0
            for cut in (*cuts, len(data)):
                raw.writer.write(data[at:cut])
                await raw.writer.drain()
                await asyncio.sleep(0.02)  # (separate reads, as a slow client's; not a handshake)
                assert len(conn.buffer) < 9 + 1024  # at most a frame header (or a small frame)
                at = cut
            got = b""
            while True:
                kind, flags, on, payload = await asyncio.wait_for(raw.frame(), WAIT)
                if kind == Kind.DATA and on == stream:
                    got += payload
                if kind == Kind.HEADERS and flags & END_STREAM and on == stream:
                    break
            assert dict(raw.fields)[b"grpc-status"] == b"0"
            assert got == prefixed
        assert server.requests.total == 0

    asyncio.run(serving(echo, test))


def test_a_frame_in_parts_whose_stream_ends_midway_drops_its_rest_and_serves_on() -> None:
    """A unary call's one DATA frame carrying its message and more, in parts: the
    call is answered INTERNAL when the extra bytes come; the rest of that frame
    is dropped (counted for the window) and the next call on the connection runs."""
    echo = Echo()

    async def test(address: str, server: GrpcServer) -> None:
        raw = await Raw.open(address, window=1 << 20)
        await raw.until_kind(Kind.SETTINGS)
        payload = b"\0" + struct.pack(">I", 10) + b"x" * 10 + b"y" * 200_000
        data = frame(Kind.HEADERS, END_HEADERS, 1, Encoder().encode(_request_headers("Unary")))
        data += frame(Kind.DATA, END_STREAM, 1, payload)
        (conn,) = server.connections
        for at in range(0, len(data), 40_000):
            raw.writer.write(data[at : at + 40_000])
            await raw.writer.drain()
            await asyncio.sleep(0.02)  # (separate reads; not a handshake)
        _, stream, _ = await raw.until_kind(Kind.HEADERS)
        fields = dict(raw.fields)
        assert (stream, fields[b"grpc-status"]) == (1, b"13")
        raw.call(3, "Unary", b"after")
        _, stream, reply = await raw.until_kind(Kind.DATA)
        assert (stream, reply[5:]) == (3, b"after")
        assert conn._data_left is None and server.requests.total == 0

    asyncio.run(serving(echo, test))


def test_a_large_reply_to_a_slow_reader_is_fed_to_the_socket_a_slice_at_a_time() -> None:
    """A reply in one large DATA frame is not handed to the transport whole (which
    would copy what the socket does not take at once, most of it): it waits as a
    view and goes a WRITE_SLICE at a time as the client reads, and a call made
    meanwhile on the same connection is answered after it, frames intact."""
    echo = Echo()
    size = 8 << 20

    async def test(address: str, server: GrpcServer) -> None:
        raw = await Raw.open(address, preface=False)
        ours = {Setting.INITIAL_WINDOW_SIZE: 1 << 30, Setting.MAX_FRAME_SIZE: (1 << 24) - 1}
        raw.writer.write(PREFACE + settings_frame(ours))
        raw.writer.write(window_update(0, 1 << 30))
        raw.call(1, "Unary", b"big:%d" % size)
        (conn,) = server.connections
        await until(lambda: bool(conn._backlog))  # the client reads nothing yet
        assert conn.transport is not None
        assert conn.transport.get_write_buffer_size() <= WRITE_SLICE
        raw.call(3, "Unary", b"after")
        got: dict[int, int] = {1: 0, 3: 0}
        ended: list[int] = []
        while len(ended) < 2:
            kind, flags, stream, payload = await asyncio.wait_for(raw.frame(), WAIT)
            if kind == Kind.DATA:
                got[stream] += len(payload)
            elif kind == Kind.HEADERS and flags & END_STREAM:
                assert dict(raw.fields)[b"grpc-status"] == b"0"
                ended.append(stream)
            assert conn.transport.get_write_buffer_size() <= WRITE_SLICE
        assert got == {1: 5 + size, 3: 5 + len(b"after")}
        await until(lambda: not conn._backlog and not conn._paused)

    asyncio.run(serving(echo, test))


def test_a_reply_that_is_a_view_is_sent_before_its_done_callbacks_reuse_its_memory() -> None:
    """A handler's reply may be a view of memory that its done callbacks give
    back for reuse (a slab: router/grpc_door.py lender): the callbacks run only
    once the reply has left, after the turn's flush and the transport's drain,
    also for a client that reads slowly."""
    echo = Echo()

    async def test(address: str, _: GrpcServer) -> None:
        options = [("grpc.max_receive_message_length", 64 << 20)]
        async with grpc.aio.insecure_channel(address, options=options) as channel:
            unary = channel.unary_unary(path("Unary"))
            for size in (1 << 16, 6 << 20):
                replies = await asyncio.gather(
                    *(unary(b"lent:%d" % size, timeout=WAIT) for _ in range(4))
                )
                assert all(r == bytes(range(256)) * (size // 256) for r in replies)

    asyncio.run(serving(echo, test))


def test_a_request_part_never_keeps_more_than_twice_its_bytes_of_a_read_alive() -> None:
    """A few bytes of a DATA frame at the start of a large read (the rest of it
    other frames) are copied, not kept as a view: a view holds its whole read,
    memory the request bounds (which count the bytes) would not see."""
    echo = Echo()
    message = bytes(range(256)) * 3 + b"t" * 227  # 995 bytes
    prefixed = b"\0" + struct.pack(">I", len(message)) + message

    async def test(address: str, server: GrpcServer) -> None:
        raw = await Raw.open(address)
        await raw.until_kind(Kind.SETTINGS)
        block = Encoder().encode(_request_headers("Unary"))
        (conn,) = server.connections
        raw.writer.write(frame(Kind.HEADERS, END_HEADERS, 1, block)
                         + frame(Kind.DATA, 0, 1, prefixed)[:9 + 10])  # fmt: skip
        await raw.writer.drain()
        await until(lambda: 1 in conn.calls and conn._data_left is not None)
        unknown = frame(0xEE, 0, 0, b"u" * 200_000)  # ignored (RFC 9113 5.5)
        raw.writer.write(prefixed[10:] + unknown)
        await raw.writer.drain()
        call = conn.calls[1]
        await until(lambda: call._have == len(prefixed) and not conn.buffer)
        for chunk in call._chunks:
            if isinstance(chunk, memoryview):
                assert len(chunk.obj) <= 2 * len(chunk)  # type: ignore[arg-type]
        raw.writer.write(frame(Kind.DATA, END_STREAM, 1, b""))
        _, stream, reply = await raw.until_kind(Kind.DATA)
        assert (stream, reply) == (1, prefixed)

    asyncio.run(serving(echo, test))


class _Sink:
    """A sink of the test's own (the router's are slabs): what it was given, and drops."""

    def __init__(self, size: int) -> None:
        self.buffer = bytearray(size)
        self.view = memoryview(self.buffer)
        self.dropped = 0

    def drop(self) -> None:
        self.dropped += 1


def test_a_large_unary_request_is_received_into_the_servers_sink_not_joined() -> None:
    """GrpcServer.sink: once a unary call's length prefix says its message is
    large, its DATA goes straight into the sink the server gives (the router's
    slab), wherever the frames were cut, and the handler gets that view; the
    sink is dropped once the call holds its request no more, also when the
    request was refused. A compressed message is not sunk (it is inflated)."""
    sinks: list[_Sink] = []
    seen: list[tuple[bool, bool]] = []

    def sink(path_: str, size: int) -> _Sink | None:
        if path_ != path("Unary") or size < 100_000:
            return None
        sinks.append(_Sink(size))
        return sinks[-1]

    async def unary(request: bytes | memoryview, context: Any) -> bytes:
        given = context.sink
        seen.append((isinstance(request, memoryview), given is not None and request is given.view))
        return bytes(request)

    handler = grpc.method_handlers_generic_handler(
        SERVICE, {"Unary": grpc.unary_unary_rpc_method_handler(unary)}
    )

    async def main() -> None:
        server = GrpcServer(settings(), [handler], sink=sink)
        port = await server.bind("127.0.0.1", 0)
        await server.start()
        try:
            options = [("grpc.max_receive_message_length", 64 << 20)]
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
                call = channel.unary_unary(path("Unary"))
                body = bytes(range(256)) * (3 << 12)  # 3 MiB: many frames and reads
                assert await call(body, timeout=WAIT) == body
                assert await call(b"small", timeout=WAIT) == b"small"
                gzip = grpc.Compression.Gzip
                assert await call(b"z" * 200_000, timeout=WAIT, compression=gzip) == b"z" * 200_000
            assert seen == [(True, True), (False, False), (False, False)]
            assert [s.dropped for s in sinks] == [1]
            raw = await Raw.open(f"127.0.0.1:{port}", window=1 << 20)
            raw.call(1, "Unary", b"x" * 150_000, end=False)
            raw.writer.write(frame(Kind.DATA, END_STREAM, 1, b"more"))
            _, stream, _ = await raw.until_kind(Kind.HEADERS)
            assert (stream, dict(raw.fields)[b"grpc-status"]) == (1, b"13")
            await until(lambda: sinks[-1].dropped == 1)
            assert len(sinks) == 2 and len(seen) == 3  # refused before its handler ran
            assert server.requests.total == 0
        finally:
            for opened in Raw.opened:
                opened.writer.close()
            Raw.opened.clear()
            await server.stop(1.0)

    asyncio.run(asyncio.wait_for(main(), 120))


def test_a_header_block_in_too_many_continuation_frames_ends_the_connection() -> None:
    """Empty CONTINUATION frames never reach the header-size limit: a block may
    take MAX_CONTINUATIONS of them, one more is ENHANCE_YOUR_CALM."""
    echo = Echo()

    def headers(stream: int, continuations: int) -> bytes:
        block = Encoder().encode(
            [(b":method", b"POST"), (b":scheme", b"http"), (b":path", path("Unary").encode()),
             (b":authority", b"x"), (b"content-type", b"application/grpc")]
        )  # fmt: skip
        out = frame(Kind.HEADERS, 0, stream, block[:3])
        out += frame(Kind.CONTINUATION, 0, stream, b"") * (continuations - 1)
        out += frame(Kind.CONTINUATION, END_HEADERS, stream, block[3:])
        return out + frame(Kind.DATA, END_STREAM, stream, b"\0\0\0\0\x02ok")

    async def test(address: str, _: GrpcServer) -> None:
        raw = await Raw.open(address)
        raw.writer.write(headers(1, MAX_CONTINUATIONS))  # at the bound: served
        _, stream, payload = await raw.until_kind(Kind.DATA)
        assert stream == 1 and payload == b"\0\0\0\0\x02ok"
        raw.writer.write(headers(3, MAX_CONTINUATIONS + 1))
        _, _, payload = await raw.until_kind(Kind.GOAWAY)
        assert struct.unpack(">I", payload[4:8])[0] == ErrorCode.ENHANCE_YOUR_CALM
        assert b"CONTINUATION" in payload[8:]

    asyncio.run(serving(echo, test))


async def _flood(address: str, chunk: Callable[[], bytes], most: int) -> int:
    """Writes ``chunk()`` until the server drops the connection (and returns how
    many were written), reading nothing, from a socket with a small receive
    buffer; ``most`` chunks at most."""
    host, port = address.rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    _, writer = await asyncio.open_connection(sock=sock)
    writer.write(PREFACE + settings_frame({}))
    sent = 0
    try:
        while sent < most:
            writer.write(chunk())
            await asyncio.wait_for(writer.drain(), WAIT)
            sent += 1
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()
    return sent


@pytest.mark.parametrize("kind", ["ping", "refused call"])
def test_a_client_that_makes_the_router_answer_and_reads_nothing_is_dropped(kind: str) -> None:
    """A PING flood (each answered), or calls refused at once (each a Trailers-Only
    HEADERS), from a client that reads none of the answers: they would wait in
    the router's memory behind a full socket. Past UNREAD_FRAMES (plus four per
    stream it may open) the connection is dropped; other clients are served."""
    echo = Echo()
    block = Encoder().encode(
        [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/no.Such/Method"),
         (b":authority", b"x"), (b"content-type", b"application/grpc")]
    )  # fmt: skip
    streams = iter(range(1, 2**31, 2))
    pings = frame(Kind.PING, 0, 0, b"12345678") * 1000

    def chunk() -> bytes:
        if kind == "ping":
            return pings
        return b"".join(  # UNIMPLEMENTED at once, stream after stream
            frame(Kind.HEADERS, END_HEADERS | END_STREAM, next(streams), block) for _ in range(1000)
        )

    async def test(address: str, server: GrpcServer) -> None:
        most = 3000  # chunks of 1,000 frames: far past the socket buffers and the bound
        sent = await _flood(address, chunk, most)
        assert sent < most, "the connection was never dropped"
        assert sent * 1000 > UNREAD_FRAMES + 4 * (2 * 8 + 64)  # not before the bound
        await until(lambda: not server.connections)
        async with grpc.aio.insecure_channel(address) as channel:
            assert await channel.unary_unary(path("Unary"))(b"ok", timeout=WAIT) == b"ok"

    asyncio.run(serving(echo, test, max_concurrent_streams=8))


def _unary_frames(
    stream: int, message: bytes, timeout: bytes = b"", method: str = "Unary"
) -> bytes:
    headers = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", path(method).encode()),
               (b":authority", b"x"), (b"content-type", b"application/grpc")]  # fmt: skip
    if timeout:
        headers.append((b"grpc-timeout", timeout))
    data = b"\0" + struct.pack(">I", len(message)) + message
    return frame(Kind.HEADERS, END_HEADERS, stream, Encoder().encode(headers)) + frame(
        Kind.DATA, END_STREAM, stream, data
    )


def _reset(stream: int) -> bytes:
    return frame(Kind.RST_STREAM, 0, stream, struct.pack(">I", ErrorCode.CANCEL))


class Frames:
    """Reads every frame of ``raw`` (the client reads all): DATA's streams, and
    the first GOAWAY (its last stream and code)."""

    def __init__(self, raw: Raw) -> None:
        self.data: set[int] = set()
        self.goaway: tuple[int, int] | None = None
        self.task = asyncio.get_running_loop().create_task(self._read(raw))

    async def _read(self, raw: Raw) -> None:
        while True:
            kind, _, stream, payload = await raw.frame()
            if kind == Kind.DATA:
                self.data.add(stream)
            elif kind == Kind.GOAWAY and self.goaway is None:
                self.goaway = struct.unpack(">II", payload[:8])


def test_rapid_reset_past_the_budget_is_sent_goaway_and_its_call_in_flight_finishes() -> None:
    """CVE-2023-44487: calls reset right after they came whole (each handler made,
    not yet run, COST_STARTED): past RESET_BUDGET, GOAWAY ENHANCE_YOUR_CALM. The
    call the client had in flight is still answered; new connections are served."""
    echo = Echo()

    async def test(address: str, server: GrpcServer) -> None:
        raw = await Raw.open(address)
        raw.call(1, "Unary", b"in flight", end=False)  # its body comes after the flood
        count = int(RESET_BUDGET / COST_STARTED) + 500  # (time refills the budget a little)
        last = 1 + 2 * count
        flood = b"".join(_unary_frames(s, b"x") + _reset(s) for s in range(3, last + 1, 2))
        raw.writer.write(flood)
        _, _, payload = await raw.until_kind(Kind.GOAWAY)
        assert struct.unpack(">I", payload[4:8])[0] == ErrorCode.ENHANCE_YOUR_CALM
        assert 1 < struct.unpack(">I", payload[:4])[0] < last  # not all were taken
        raw.writer.write(frame(Kind.DATA, END_STREAM, 1, b""))
        _, stream, message = await raw.until_kind(Kind.DATA)
        assert stream == 1 and message[5:] == b"in flight"
        async with grpc.aio.insecure_channel(address) as channel:
            assert await channel.unary_unary(path("Unary"))(b"ok", timeout=WAIT) == b"ok"

    asyncio.run(serving(echo, test))


def test_resets_hidden_among_streams_answered_at_once_are_still_a_flood() -> None:
    """Each reset of a running call paired with an unknown method (answered at
    once, no handler: it earns nothing) -- under a rule of shares, half the
    streams reset is no flood. Weighed by what they cost, the resets pass the
    budget: GOAWAY ENHANCE_YOUR_CALM (rounds of 200 resets: time gives back 50
    a second, so this holds unless a round takes 4 s)."""
    echo = Echo()

    async def test(address: str, server: GrpcServer) -> None:
        raw = await Raw.open(address)
        frames = Frames(raw)
        rounds, per_round = 10 * int(RESET_BUDGET / COST_RUNNING) // 200, 200
        stream = 1
        for _ in range(rounds):
            calls = list(range(stream, stream + 4 * per_round, 4))
            stream += 4 * per_round
            raw.writer.write(
                b"".join(
                    _unary_frames(s, b"wait") + _unary_frames(s + 2, b"x", method="NoSuchMethod")
                    for s in calls
                )
            )
            await until(lambda: echo.waiting == per_round or frames.goaway is not None)
            if frames.goaway is not None:
                break
            raw.writer.write(b"".join(_reset(s) for s in calls))
            await until(lambda: echo.waiting == 0)
        await until(lambda: frames.goaway is not None)
        assert frames.goaway is not None
        assert frames.goaway[1] == ErrorCode.ENHANCE_YOUR_CALM
        frames.task.cancel()

    asyncio.run(serving(echo, test))


def test_a_client_that_cancels_half_its_calls_is_served() -> None:
    """A client that cancels as many running calls as it lets finish, three
    budgets' worth, is served to the end: each answer pays for a reset."""
    echo = Echo()

    async def test(address: str, server: GrpcServer) -> None:
        raw = await Raw.open(address)
        frames = Frames(raw)
        per_round = 250
        served: set[int] = set()
        streams = iter(range(1, 2**31, 2))
        for _ in range(3 * int(RESET_BUDGET / COST_RUNNING) // per_round):
            pairs = [(next(streams), next(streams)) for _ in range(per_round)]
            raw.writer.write(
                b"".join(
                    _unary_frames(kept, b"%d" % kept) + _unary_frames(dropped, b"wait")
                    for kept, dropped in pairs
                )
            )
            served.update(kept for kept, _ in pairs)
            await until(lambda: echo.waiting == per_round and served <= frames.data)
            raw.writer.write(b"".join(_reset(dropped) for _, dropped in pairs))
            await until(lambda: echo.waiting == 0)
        (conn,) = server.connections
        assert frames.goaway is None and not conn.going_away
        assert conn.resets.level >= 0
        frames.task.cancel()

    asyncio.run(serving(echo, test))


def test_what_a_reset_costs_is_the_work_started_for_it() -> None:
    """A reset costs what was started: a running handler COST_RUNNING, one made
    but not run COST_STARTED, a call without its whole request COST_OPENED;
    nothing once answered, or with at most EARLY_RESET_SHARE of its timeout
    left (a client giving up at its deadline reaches us about when our own
    timer fires)."""
    echo = Echo()

    async def test(address: str, server: GrpcServer) -> None:
        raw = await Raw.open(address)
        raw.writer.write(_unary_frames(1, b"wait", timeout=b"100S"))
        raw.writer.write(_unary_frames(3, b"wait"))
        raw.call(5, "Unary", b"body to come", end=False)
        await until(lambda: echo.waiting == 2)
        (conn,) = server.connections
        timed, untimed, opened = conn.calls[1], conn.calls[3], conn.calls[5]
        assert timed.timeout == 100.0 and untimed.deadline is None
        now = time.monotonic()
        assert reset_cost(timed, now) == reset_cost(untimed, now) == COST_RUNNING
        assert reset_cost(opened, now) == COST_OPENED
        assert reset_cost(timed, timed.deadline - (EARLY_RESET_SHARE / 2) * 100) == 0.0
        assert reset_cost(timed, timed.deadline - 2 * EARLY_RESET_SHARE * 100) == COST_RUNNING

        async def handler() -> None:
            pass

        made = asyncio.get_running_loop().create_task(handler())  # not run yet
        call = SimpleNamespace(finished=False, deadline=None, timeout=0.0, task=made)
        assert reset_cost(call, now) == COST_STARTED  # type: ignore[arg-type]
        await made
        call.finished = True
        assert reset_cost(call, now) == 0.0  # type: ignore[arg-type]

    asyncio.run(serving(echo, test))


def test_empty_data_frames_past_the_bound_end_the_connection() -> None:
    """CVE-2019-9518: DATA frames with no byte and no END_STREAM cost the client
    nothing, not even window. EMPTY_DATA_FRAMES in a row are taken (a byte
    starts the count again); one more is GOAWAY ENHANCE_YOUR_CALM."""
    echo = Echo()
    empty = frame(Kind.DATA, 0, 1, b"")

    async def test(address: str, server: GrpcServer) -> None:
        raw = await Raw.open(address)
        raw.writer.write(
            frame(Kind.HEADERS, END_HEADERS, 1, Encoder().encode(_request_headers("ClientStream")))
        )
        for _ in range(3):
            raw.writer.write(empty * EMPTY_DATA_FRAMES + frame(Kind.DATA, 0, 1, b"\0"))
        raw.writer.write(frame(Kind.PING, 0, 0, b"stillok?"))
        flags, _, payload = await raw.until_kind(Kind.PING)
        assert flags & ACK and payload == b"stillok?"
        assert server.connections and not next(iter(server.connections)).going_away
        raw.writer.write(empty * (EMPTY_DATA_FRAMES + 1))
        _, _, payload = await raw.until_kind(Kind.GOAWAY)
        assert struct.unpack(">I", payload[4:8])[0] == ErrorCode.ENHANCE_YOUR_CALM
        assert b"empty DATA" in payload[8:]

    asyncio.run(serving(echo, test))


def _request_headers(method: str) -> list[tuple[bytes, bytes]]:
    return [(b":method", b"POST"), (b":scheme", b"http"), (b":path", path(method).encode()),
            (b":authority", b"x"), (b"content-type", b"application/grpc")]  # fmt: skip


async def _one_call(raw: Raw, stream: int, method: str = "Unary") -> list[bytes]:
    """A call on ``raw``; the header blocks of its reply, in order."""
    raw.call(stream, method, b"x")
    blocks = []
    while True:
        kind, flags, got, payload = await asyncio.wait_for(raw.frame(), WAIT)
        assert kind != Kind.GOAWAY, payload
        if kind == Kind.HEADERS and got == stream:
            blocks.append(payload)
            if flags & END_STREAM:
                return blocks


def test_replies_say_what_they_accept_and_repeat_their_headers_in_a_byte_each() -> None:
    """The response headers carry grpc-accept-encoding (what the router
    decompresses, as grpcio's server says); the fields every reply repeats go
    into the connection's HPACK dynamic table once: after the first call, one
    byte per field."""
    echo = Echo()

    async def test(address: str, server: GrpcServer) -> None:
        raw = await Raw.open(address)
        headers, trailers = await _one_call(raw, 1)
        decoder = Decoder()
        assert decoder.decode(headers) == [
            (b":status", b"200"),
            (b"content-type", b"application/grpc"),
            (b"grpc-accept-encoding", ACCEPT_ENCODING),
        ]
        assert decoder.decode(trailers) == [(b"grpc-status", b"0")]
        assert ACCEPT_ENCODING == b"identity,deflate,gzip"
        for stream in (3, 5):
            headers, trailers = await _one_call(raw, stream)
            assert (len(headers), len(trailers)) == (3, 1)  # one index each
            assert raw.fields == [(b"grpc-status", b"0")]
        (refused,) = await _one_call(raw, 7, "Nope")  # Trailers-Only: four indexes, the message
        assert all(byte & 0x80 for byte in refused[:3])
        fields = dict(raw.fields)
        assert fields[b"grpc-status"] == b"12" and b"Nope" in fields[b"grpc-message"]
        (again,) = await _one_call(raw, 9, "Nope")
        assert all(byte & 0x80 for byte in again[:4]) and len(again) < len(refused)

    asyncio.run(serving(echo, test))


def test_the_clients_header_table_size_bounds_the_replies_table() -> None:
    """RFC 7541 4.2: the client's SETTINGS_HEADER_TABLE_SIZE bounds the table
    our replies index into; each change is signalled at the start of the next
    block (the lowest first when it fell and rose), and the client's decoder,
    held to what it allowed, reads every reply."""
    echo = Echo()

    async def test(address: str, server: GrpcServer) -> None:
        raw = await Raw.open(address, preface=False)
        raw.decoder = Decoder(max_table_size=0)
        raw.writer.write(PREFACE + settings_frame({Setting.HEADER_TABLE_SIZE: 0}))
        headers, _ = await _one_call(raw, 1)
        assert headers[0] == 0x20  # the size update to 0
        assert raw.decoder.table == [] and raw.fields == [(b"grpc-status", b"0")]
        await _one_call(raw, 3)
        assert raw.decoder.table == []
        raw.decoder.max_table_size = 4096
        raw.writer.write(settings_frame({Setting.HEADER_TABLE_SIZE: 4096}))
        headers, _ = await _one_call(raw, 5)
        assert headers.startswith(encode_integer(4096, 5, 0x20))
        assert len(raw.decoder.table) == 3
        raw.writer.write(
            settings_frame({Setting.HEADER_TABLE_SIZE: 60})
            + settings_frame({Setting.HEADER_TABLE_SIZE: 200})
        )
        headers, _ = await _one_call(raw, 7)
        assert headers.startswith(encode_integer(60, 5, 0x20) + encode_integer(200, 5, 0x20))
        assert raw.fields == [(b"grpc-status", b"0")]
        assert 0 < raw.decoder.table_size <= 200

    asyncio.run(serving(echo, test))


def test_streams_reset_before_their_handler_ran_give_back_what_they_held() -> None:
    """A streaming call reset in the read that brought its first message: its
    handler's task never runs (so never runs its own cleanup); the request
    bytes it held are given back all the same, or the connection's window
    would shrink for good."""
    echo = Echo()

    async def test(address: str, server: GrpcServer) -> None:
        raw = await Raw.open(address)
        head = Encoder().encode(_request_headers("ClientStream"))
        message = b"\0" + struct.pack(">I", 1000) + b"x" * 1000
        raw.writer.write(
            b"".join(
                frame(Kind.HEADERS, END_HEADERS, s, head)
                + frame(Kind.DATA, 0, s, message)
                + _reset(s)
                for s in range(1, 200, 2)
            )
            + frame(Kind.PING, 0, 0, b"synced!!")
        )
        await raw.until_kind(Kind.PING)
        (conn,) = server.connections
        await until(lambda: not conn.calls and not conn.tasks)
        assert conn.held == 0 and server.requests.total == 0

    asyncio.run(serving(echo, test))


# -- request bytes held (issue 42 §1 and §4) ------------------------------------------


async def ping_round_trip(raw: Raw, data: bytes = b"roundtr!") -> list[tuple[int, int, bytes]]:
    """Sends a PING; the (kind, stream, payload) of every frame before its ack:
    what the router wrote for the frames sent before it."""
    raw.writer.write(frame(Kind.PING, 0, 0, data))
    seen = []
    while True:
        kind, flags, stream, payload = await asyncio.wait_for(raw.frame(), WAIT)
        if kind == Kind.PING and flags & ACK and payload == data:
            return seen
        seen.append((kind, stream, payload))


def test_requests_held_past_the_bound_get_no_window_and_new_streams_are_refused() -> None:
    """Issue 42 §1: the router gave a connection's window back as each handler
    took its whole message, so handlers that wait (a client that never reads
    its replies) held streams x message size. Here a client sends 16 calls of
    1 MiB whose handlers wait, its whole 16 MiB window, and
    max_request_bytes_held is 4 MiB: five calls are held (the fifth passes the
    bound), the next eleven are answered RESOURCE_EXHAUSTED naming the
    setting, no WINDOW_UPDATE for the connection comes back, another
    connection is served, and once the calls end the window is given back.
    (Before: all 16 held, and the window given back for more.)"""
    echo = Echo()
    message = b"hold:" + b"x" * ((1 << 20) - 10)  # one DATA frame of 1 MiB, with its prefix

    async def test(address: str, server: GrpcServer) -> None:
        raw = await Raw.open(address)
        await raw.until_kind(Kind.WINDOW_UPDATE)  # the connection's 16 MiB
        streams = range(1, 33, 2)
        for stream in streams:
            raw.call(stream, "Unary", message)
        await until(lambda: echo.waiting >= 5)
        answered = await ping_round_trip(raw)
        assert echo.waiting == 5
        given = [p for kind, stream, p in answered if kind == Kind.WINDOW_UPDATE and stream == 0]
        assert given == [], "the connection's window was given back past the bound"
        refused = {}
        for kind, stream, payload in answered:
            if kind == Kind.HEADERS:
                fields = dict(raw.decoder.decode(payload))
                refused[stream] = (fields[b"grpc-status"], fields[b"grpc-message"])
        assert sorted(refused) == list(range(11, 33, 2))
        assert {code for code, _ in refused.values()} == {b"8"}  # RESOURCE_EXHAUSTED
        why = refused[11][1].decode()
        assert "max_request_bytes_held is 4194304" in why and "this connection" in why
        assert server.requests.total == 5 << 20
        async with grpc.aio.insecure_channel(address) as channel:
            assert await channel.unary_unary(path("Unary"))(b"ok", timeout=WAIT) == b"ok"
        raw.writer.write(b"".join(_reset(stream) for stream in range(1, 11, 2)))
        while True:  # the calls end: their bytes are released, the window comes back
            kind, _, stream, payload = await asyncio.wait_for(raw.frame(), WAIT)
            if kind == Kind.WINDOW_UPDATE and stream == 0:
                break
        assert server.requests.total == 0
        raw.call(33, "Unary", b"after")
        _, stream, data = await raw.until_kind(Kind.DATA)
        assert (stream, data[5:]) == (33, b"after")

    asyncio.run(serving(echo, test, max_request_bytes_held=4 << 20))


def test_the_total_bound_holds_back_connections_that_hold_requests_not_small_callers() -> None:
    """max_request_bytes_held_total: past it a connection that holds requests
    gets no window and its new streams are refused; one that holds none (small
    calls) is served."""
    echo = Echo()
    message = b"hold:" + b"x" * ((1 << 20) - 10)

    async def test(address: str, server: GrpcServer) -> None:
        raw = await Raw.open(address)
        await raw.until_kind(Kind.WINDOW_UPDATE)
        for stream in range(1, 11, 2):  # the fifth passes the 4 MiB bound
            raw.call(stream, "Unary", message)
        await until(lambda: echo.waiting == 5)
        raw.call(11, "Unary", b"more")
        _, stream, payload = await raw.until_kind(Kind.HEADERS)
        fields = dict(raw.decoder.decode(payload))
        assert (stream, fields[b"grpc-status"]) == (11, b"8")
        assert b"max_request_bytes_held_total" in fields[b"grpc-message"]
        async with grpc.aio.insecure_channel(address) as channel:
            calls = [channel.unary_unary(path("Unary"))(b"%d" % i, timeout=WAIT) for i in range(20)]
            assert await asyncio.gather(*calls) == [b"%d" % i for i in range(20)]

    asyncio.run(serving(echo, test, max_request_bytes_held_total=4 << 20))


def test_one_request_of_max_message_size_always_comes_whatever_the_bound() -> None:
    """A connection whose bytes are all one call's is not held back by its
    bound: a request of max_message_size passes a bound far below it."""
    echo = Echo()

    async def test(address: str, _: GrpcServer) -> None:
        options = [
            ("grpc.max_send_message_length", 32 << 20),
            ("grpc.max_receive_message_length", 32 << 20),
        ]
        async with grpc.aio.insecure_channel(address, options=options) as channel:
            body = b"z" * (24 << 20)
            reply = await channel.unary_unary(path("Unary"))(body, timeout=WAIT)
            assert reply == body

    asyncio.run(
        serving(
            echo,
            test,
            max_message_size=32 << 20,
            max_request_bytes_held=1 << 20,
            max_request_bytes_held_total=1 << 20,
        )
    )


def test_a_call_reset_before_its_handler_ran_leaves_no_cycle_holding_its_request() -> None:
    """Issue 42 §4: a call whose stream is reset in the same read as its
    request (or whose deadline passes first) has its task cancelled before its
    first turn; the task kept that CancelledError, whose traceback held the
    frame (the request), which held the call, which held the task: the request
    stayed until the garbage collector ran. Its bytes are released too."""
    echo = Echo()
    message = b"x" * ((1 << 20) - 5)

    async def test(address: str, server: GrpcServer) -> None:
        raw = await Raw.open(address)
        await raw.until_kind(Kind.WINDOW_UPDATE)
        raw.call(1, "Unary", message)
        raw.writer.write(_reset(1))
        await ping_round_trip(raw)
        (conn,) = server.connections
        await until(lambda: not conn.tasks)
        assert server.requests.total == 0

    with no_collector():
        asyncio.run(serving(echo, test))
        assert held_in_cycles() == []
