"""HTTP/2 conformance of the gRPC port, on both engines (``grpc_engine``).

What RFC 9113 (HTTP/2) and RFC 7541 (HPACK) require of a server, section by
section, in the manner of h2spec: each test is named after the section whose
MUST it checks, writes raw frames on a fresh connection (tests/h2wire.py)
and judges what the server does with them. Every test runs against the
router's own HTTP/2 (``poolserve``) and grpc's server (``grpcio``, with the
router's channel options). Where grpcio answers otherwise, that case is
marked for grpcio alone (``differs``) with what it does: strict, so a
grpcio that comes into line shows; never for our engine.

An error the RFC calls a stream error may come as RST_STREAM of that stream
or as GOAWAY (RFC 9113 5.4.1: an endpoint may treat a stream error as a
connection error). Our engine always sends GOAWAY before it closes for an
error; a bare close is taken from grpcio (5.4.1: SHOULD). Priority signals
are deprecated (RFC 9113 5.3.2) and the RFC 7540 rule that a stream may not
depend on itself is not in RFC 9113: both engines ignore them.
"""

from __future__ import annotations

import dataclasses
import socket
import ssl
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from h2wire import (
    END_HEADERS,
    END_STREAM,
    ENGINES,
    EngineServer,
    Peer,
    block,
    data,
    grpc_message,
    headers,
    literal,
    request,
)

from poolserve.service.contract.settings import ServerSettings
from poolserve.service.router.http2.frames import (
    ACK,
    HEADER,
    PADDED,
    PREFACE,
    PRIORITY_FLAG,
    ErrorCode,
    Kind,
    Setting,
    frame,
    goaway,
    ping,
    rst_stream,
    settings_frame,
    window_update,
)
from poolserve.service.router.http2.hpack import encode_integer
from poolserve.service.router.http2.huffman import huffman_encode
from poolserve.service.router.http_connection import tls_context

from certs import make_certs

F = TypeVar("F", bound=Callable[..., Any])
MAX_WINDOW = 2**31 - 1
PROTOCOL = ErrorCode.PROTOCOL_ERROR
FRAME_SIZE = ErrorCode.FRAME_SIZE_ERROR
FLOW = ErrorCode.FLOW_CONTROL_ERROR
CLOSED = ErrorCode.STREAM_CLOSED
COMPRESSION = ErrorCode.COMPRESSION_ERROR


def differs(grpcio: str, only: tuple[str, ...] = (), skip: bool = False) -> Callable[[F], F]:
    """The case fails on grpcio for the reason given (xfail, strict, for grpcio
    alone; ``only`` these parameter ids of it; ``skip``: it would hang there)."""

    def mark(test: F) -> F:
        test.engine_differs = (grpcio, only, skip)  # type: ignore[attr-defined]
        return test

    return mark


IGNORES = "ignores it: no GOAWAY, no RST_STREAM"
AS_A_CALL = (
    "answers a gRPC status (Trailers-Only) and RST_STREAM NO_ERROR, and closes without"
    " GOAWAY: not the RFC's error"
)


@pytest.fixture(scope="module", params=ENGINES)
def engine(request: pytest.FixtureRequest) -> Iterator[EngineServer]:
    with EngineServer(request.param) as server:
        yield server


@pytest.fixture
def h2(engine: EngineServer, request: pytest.FixtureRequest) -> EngineServer:
    differ = getattr(request.function, "engine_differs", None)
    if differ is not None and engine.engine == "grpcio":
        reason, only, skip = differ
        ids = request.node.callspec.id.split("-")[1:]
        if not only or set(only) & set(ids):
            if skip:
                pytest.skip(f"grpcio: {reason}")
            request.applymarker(pytest.mark.xfail(strict=True, reason=f"grpcio: {reason}"))
    return engine


# -- judging ---------------------------------------------------------------------------


def connection_error(peer: Peer, *codes: int) -> None:
    """GOAWAY with one of ``codes`` (or, from grpcio, a bare close)."""
    got = peer.outcome()
    if got.kind == "closed" and not peer.strict:
        return
    assert got.kind == "goaway" and got.code in codes, str(got)


def stream_error(peer: Peer, stream: int, *codes: int) -> None:
    """RST_STREAM of ``stream`` or GOAWAY, with one of ``codes``."""
    got = peer.outcome(stream)
    if got.kind == "closed" and not peer.strict:
        return
    assert got.kind in ("reset", "goaway") and got.code in codes, str(got)


def no_error(peer: Peer) -> None:
    """The server read it all and ended nothing (the PING sent after it is answered)."""
    got = peer.outcome()
    assert got.kind == "served", str(got)


def served(peer: Peer, stream: int, message: bytes = b"ok") -> None:
    """A call on ``stream`` is answered: the connection serves on."""
    peer.call(stream, message)
    answer = peer.response(stream)
    assert answer.status == b"0" and answer.message == message, answer


def priority(dependency: int, weight: int = 15, exclusive: bool = False) -> bytes:
    return struct.pack(">IB", dependency | (1 << 31 if exclusive else 0), weight)


def request_frames(stream: int, fields: list[tuple[bytes, bytes]], message: bytes = b"x") -> bytes:
    return headers(stream, fields) + data(stream, grpc_message(message))


# -- 3.4 HTTP/2 Connection Preface -----------------------------------------------------


def test_9113_3_4_the_server_preface_is_a_settings_frame_first(h2: EngineServer) -> None:
    with h2.peer() as peer:
        first = peer.read()
        assert first is not None and first.kind == Kind.SETTINGS and not first.flags & ACK


def test_9113_3_4_the_clients_settings_are_acknowledged(h2: EngineServer) -> None:
    with h2.peer() as peer:
        while True:
            got = peer.read()
            assert got is not None
            if got.kind == Kind.SETTINGS and got.flags & ACK:
                break


def test_9113_3_4_an_invalid_preface_is_a_connection_error(h2: EngineServer) -> None:
    with h2.peer(preface=False) as peer:
        peer.send(b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n" + settings_frame({}))
        got = peer.outcome()  # (a GOAWAY MAY be omitted: the peer is not HTTP/2)
        assert got.kind == "closed" or (got.kind, got.code) == ("goaway", PROTOCOL), str(got)


def test_9113_3_4_a_preface_not_followed_by_settings_is_a_connection_error(
    h2: EngineServer,
) -> None:
    with h2.peer(preface=False) as peer:
        peer.send(PREFACE + ping(b"12345678"))
        connection_error(peer, PROTOCOL)


# -- 4.1 Frame Format ------------------------------------------------------------------


def test_9113_4_1_frames_of_unknown_type_are_ignored(h2: EngineServer) -> None:
    with h2.peer() as peer:
        peer.send(frame(0x20, 0xFF, 0, b"unknown") + frame(0x21, 0, 1, b"x" * 10))
        no_error(peer)
        served(peer, 1)


@differs("closes the connection on a PING with unused flags, resets HEADERS with them")
def test_9113_4_1_unused_flags_are_ignored(h2: EngineServer) -> None:
    with h2.peer() as peer:
        peer.send(frame(Kind.PING, 0xFE, 0, b"unusedfl"))  # every flag but ACK
        while True:
            got = peer.read()
            assert got is not None
            if got.kind == Kind.PING and got.flags & ACK:
                assert got.payload == b"unusedfl"
                break
        unused_headers, unused_data = 0x02 | 0x10 | 0x40 | 0x80, 0x02 | 0x04 | 0x10 | 0x20
        peer.send(
            frame(Kind.HEADERS, END_HEADERS | unused_headers, 1, block(request()))
            + frame(Kind.DATA, END_STREAM | unused_data, 1, grpc_message(b"flags"))
        )
        answer = peer.response(1)
        assert answer.status == b"0" and answer.message == b"flags"


def test_9113_4_1_the_reserved_bit_of_the_stream_identifier_is_ignored(h2: EngineServer) -> None:
    with h2.peer() as peer:
        peer.send(headers(1 | 1 << 31, request()), data(1 | 1 << 31, grpc_message(b"r")))
        answer = peer.response(1)
        assert answer.status == b"0" and answer.message == b"r"


# -- 4.2 Frame Size --------------------------------------------------------------------


def test_9113_4_2_a_frame_of_2_14_octets_is_taken(h2: EngineServer) -> None:
    body = b"x" * (2**14 - 5)
    with h2.peer() as peer:
        peer.send(headers(1, request()), data(1, grpc_message(body)))
        answer = peer.response(1)
        assert answer.status == b"0" and answer.message == body


def test_9113_4_2_data_over_the_max_frame_size_is_a_frame_size_error(h2: EngineServer) -> None:
    with h2.peer() as peer:
        limit = peer.settings_seen().get(Setting.MAX_FRAME_SIZE, 2**14)
        peer.send(headers(1, request()), frame(Kind.DATA, 0, 1, b"\0" * (limit + 1)))
        stream_error(peer, 1, FRAME_SIZE)


def test_9113_4_2_headers_over_the_max_frame_size_is_a_connection_frame_size_error(
    h2: EngineServer,
) -> None:
    with h2.peer() as peer:
        limit = peer.settings_seen().get(Setting.MAX_FRAME_SIZE, 2**14)
        pad = limit
        while True:  # a field block of exactly limit + 1 bytes
            fields = block(request("Unary", (b"x-pad", b"p" * pad)))
            if len(fields) == limit + 1:
                break
            pad -= len(fields) - (limit + 1)
        peer.send(frame(Kind.HEADERS, END_HEADERS | END_STREAM, 1, fields))
        connection_error(peer, FRAME_SIZE)


def test_9113_4_2_no_frame_exceeds_the_clients_max_frame_size(h2: EngineServer) -> None:
    with h2.peer(settings={Setting.INITIAL_WINDOW_SIZE: MAX_WINDOW}) as peer:
        peer.send(window_update(0, 1 << 20))
        peer.call(1, b"big:100000")
        answer = peer.response(1)
        assert answer.status == b"0" and len(answer.message) == 100_000
        assert max(size for _, size in peer.sizes) <= 2**14


def test_9113_4_2_a_header_block_over_the_clients_max_frame_size_is_continued(
    h2: EngineServer,
) -> None:
    """A long grpc-message (ours says the unknown method's path, 36 KB
    percent-encoded) goes out in HEADERS and CONTINUATION frames of at most
    2^14 bytes (4.2, 6.10), one block the client's decoder reads."""
    fields = [(b":path", b"/" + b"\xc3\xa9" * 3000), *request(drop=(b":path",))]
    with h2.peer() as peer:
        peer.send(request_frames(1, fields))
        answer = peer.response(1)
        assert answer.status == b"12", answer  # UNIMPLEMENTED, its block read whole
        assert max(size for _, size in peer.sizes) <= 2**14


# -- 4.3 Field Section Compression and Decompression -----------------------------------


@differs(AS_A_CALL)
def test_9113_4_3_a_field_block_that_does_not_decode_is_a_compression_error(
    h2: EngineServer,
) -> None:
    with h2.peer() as peer:
        peer.send(frame(Kind.HEADERS, END_HEADERS | END_STREAM, 1, b"\x40\x05abc"))
        connection_error(peer, COMPRESSION)


@differs(AS_A_CALL)
def test_9113_4_3_a_priority_frame_inside_a_field_block_is_a_connection_error(
    h2: EngineServer,
) -> None:
    fields = block(request())
    with h2.peer() as peer:
        peer.send(
            frame(Kind.HEADERS, 0, 1, fields[:5])
            + frame(Kind.PRIORITY, 0, 1, priority(0))
            + frame(Kind.CONTINUATION, END_HEADERS, 1, fields[5:])
        )
        connection_error(peer, PROTOCOL)


@differs(AS_A_CALL)
def test_9113_4_3_headers_of_another_stream_inside_a_field_block_is_a_connection_error(
    h2: EngineServer,
) -> None:
    fields = block(request())
    with h2.peer() as peer:
        peer.send(frame(Kind.HEADERS, 0, 1, fields[:5]) + headers(3, request()))
        connection_error(peer, PROTOCOL)


# -- 5.1 Stream States -----------------------------------------------------------------


@differs(IGNORES, only=("data", "rst_stream", "window_update"))
@pytest.mark.parametrize(
    "kind",
    [
        pytest.param(data(1, grpc_message(b"x")), id="data"),
        pytest.param(rst_stream(1, ErrorCode.CANCEL), id="rst_stream"),
        pytest.param(window_update(1, 100), id="window_update"),
        pytest.param(frame(Kind.CONTINUATION, END_HEADERS, 1, block(request())), id="continuation"),
    ],
)
def test_9113_5_1_frames_on_an_idle_stream_are_a_connection_error(
    h2: EngineServer, kind: bytes
) -> None:
    with h2.peer() as peer:
        peer.send(kind)
        got = peer.outcome(1)  # (DATA: also a stream error STREAM_CLOSED, 6.1)
        if got.kind == "closed" and not peer.strict:
            return
        assert (got.kind, got.code) in (("goaway", PROTOCOL), ("goaway", CLOSED), ("reset", CLOSED))
        assert got.kind == "goaway" or kind[3] == Kind.DATA, str(got)


def test_9113_5_1_priority_on_an_idle_stream_is_no_error(h2: EngineServer) -> None:
    with h2.peer() as peer:
        peer.send(frame(Kind.PRIORITY, 0, 1, priority(0)) + frame(Kind.PRIORITY, 0, 7, priority(1)))
        no_error(peer)
        served(peer, 1)


def _half_closed_remote(peer: Peer) -> None:
    """Stream 1 half-closed (remote): its request ended, its handler waits."""
    peer.call(1, b"wait")


@differs(IGNORES)
def test_9113_5_1_data_on_a_half_closed_remote_stream_is_stream_closed(h2: EngineServer) -> None:
    with h2.peer() as peer:
        _half_closed_remote(peer)
        peer.send(data(1, grpc_message(b"more")))
        stream_error(peer, 1, CLOSED)


@differs(IGNORES)
def test_9113_5_1_headers_on_a_half_closed_remote_stream_is_stream_closed(
    h2: EngineServer,
) -> None:
    with h2.peer() as peer:
        _half_closed_remote(peer)
        peer.send(headers(1, [(b"x-trailer", b"1")], END_HEADERS | END_STREAM))
        stream_error(peer, 1, CLOSED)


def test_9113_5_1_window_update_priority_and_rst_stream_on_a_half_closed_remote_stream(
    h2: EngineServer,
) -> None:
    """Lawful there; the RST_STREAM is not answered with another (5.4.2: MUST
    NOT, to avoid looping), and the connection serves on."""
    with h2.peer() as peer:
        _half_closed_remote(peer)
        peer.send(window_update(1, 1000) + frame(Kind.PRIORITY, 0, 1, priority(0)))
        no_error(peer)
        peer.send(rst_stream(1, ErrorCode.CANCEL))
        no_error(peer)
        assert not [f for f in peer.seen if f.kind == Kind.RST_STREAM and f.stream == 1]
        served(peer, 3)


@differs(IGNORES)
def test_9113_6_1_data_after_the_clients_rst_stream_is_stream_closed(h2: EngineServer) -> None:
    with h2.peer() as peer:
        peer.send(headers(1, request()), rst_stream(1, ErrorCode.CANCEL))
        peer.send(data(1, grpc_message(b"late")))
        stream_error(peer, 1, CLOSED)


@differs(IGNORES)
def test_9113_6_1_data_on_a_stream_closed_both_ways_is_stream_closed(h2: EngineServer) -> None:
    with h2.peer() as peer:
        served(peer, 1)
        peer.send(data(1, grpc_message(b"late")))
        stream_error(peer, 1, CLOSED)


@differs(IGNORES)
def test_9113_5_1_headers_after_the_clients_rst_stream_is_an_error(h2: EngineServer) -> None:
    """5.1 "closed": a connection error STREAM_CLOSED (MAY), PROTOCOL_ERROR for a
    stream identifier it may not open again (5.1.1), or RFC 7540's stream error."""
    with h2.peer() as peer:
        peer.send(headers(1, request()), rst_stream(1, ErrorCode.CANCEL))
        peer.send(headers(1, request(), END_HEADERS | END_STREAM))
        got = peer.outcome(1)
        if got.kind == "closed" and not peer.strict:
            return
        assert (got.kind, got.code) in (("goaway", PROTOCOL), ("goaway", CLOSED), ("reset", CLOSED))


@differs(IGNORES)
def test_9113_5_1_headers_on_a_stream_closed_both_ways_is_a_connection_error(
    h2: EngineServer,
) -> None:
    with h2.peer() as peer:
        served(peer, 1)
        peer.send(headers(1, request(), END_HEADERS | END_STREAM))
        connection_error(peer, PROTOCOL, CLOSED)


def test_9113_5_1_window_update_rst_stream_and_priority_on_a_closed_stream_are_no_error(
    h2: EngineServer,
) -> None:
    with h2.peer() as peer:
        served(peer, 1)
        peer.send(
            window_update(1, 10)
            + rst_stream(1, ErrorCode.CANCEL)
            + frame(Kind.PRIORITY, 0, 1, priority(0))
        )
        no_error(peer)
        served(peer, 3)


def test_9113_5_1_frames_after_the_servers_rst_stream_are_processed_and_dropped(
    h2: EngineServer,
) -> None:
    """A call refused before its request ended is reset by the server; the
    client's DATA and trailers that crossed the reset are dropped, but the
    trailers' field block still enters the HPACK table (minimal processing):
    the next request refers to that entry."""
    with h2.peer() as peer:
        peer.send(headers(1, request("Nope")), data(1, grpc_message(b"x"), end=False))
        answer = peer.response(1)
        assert answer.status == b"12"  # UNIMPLEMENTED
        trailers = literal(b"x-crossed", b"1", first=0x40)  # with incremental indexing
        peer.send(
            data(1, grpc_message(b"crossed"), end=False)
            + frame(Kind.HEADERS, END_HEADERS | END_STREAM, 1, trailers)
        )
        fields = block(request()) + b"\xbe"  # index 62: the newest dynamic entry
        peer.send(frame(Kind.HEADERS, END_HEADERS, 3, fields), data(3, grpc_message(b"after")))
        answer = peer.response(3)
        assert answer.status == b"0" and answer.message == b"after"


# -- 5.1.1 Stream Identifiers ----------------------------------------------------------


@differs(IGNORES)
def test_9113_5_1_1_an_even_stream_identifier_is_a_connection_error(h2: EngineServer) -> None:
    with h2.peer() as peer:
        peer.send(request_frames(2, request()))
        connection_error(peer, PROTOCOL)


@differs(IGNORES)
def test_9113_5_1_1_a_stream_identifier_below_a_previous_one_is_a_connection_error(
    h2: EngineServer,
) -> None:
    with h2.peer() as peer:
        peer.send(request_frames(5, request()), request_frames(3, request()))
        connection_error(peer, PROTOCOL)


# -- 5.4 Error Handling ----------------------------------------------------------------


def test_9113_5_4_1_a_connection_error_sends_goaway_with_the_last_stream_then_closes(
    h2: EngineServer,
) -> None:
    with h2.peer() as peer:
        served(peer, 1)
        peer.send(frame(Kind.PING, 0, 0, b"1234567"))
        got = peer.outcome()
        if got.kind == "closed" and not peer.strict:
            return
        assert got.kind == "goaway", str(got)
        assert struct.unpack(">I", got.frames[-1].payload[:4])[0] == 1
        while peer.read() is not None:
            pass  # then the connection is closed


def test_9113_5_4_1_the_goaway_of_a_connection_error_reaches_a_client_still_sending(
    h2: EngineServer,
) -> None:
    """A frame over the size limit, and 4 MiB more behind it: the server
    stops reading at the error. A socket closed with bytes unread sends a TCP
    reset, which destroys the GOAWAY before the client reads it; the server
    must read on (and drop) until its GOAWAY is through."""
    with h2.peer() as peer:
        peer.settings_seen()
        peer.send(HEADER.pack(0xFF, 0xFFFF, Kind.DATA, 0, 1) + b"\0" * (4 << 20))
        connection_error(peer, FRAME_SIZE)


# -- 5.5 Extending HTTP/2 --------------------------------------------------------------


def test_9113_5_5_an_unknown_frame_inside_a_stream_is_ignored(h2: EngineServer) -> None:
    with h2.peer() as peer:
        peer.send(headers(1, request()), frame(0xEE, 0, 1, b"ext"), data(1, grpc_message(b"e")))
        answer = peer.response(1)
        assert answer.status == b"0" and answer.message == b"e"


@differs(AS_A_CALL)
def test_9113_5_5_an_unknown_frame_inside_a_field_block_is_a_connection_error(
    h2: EngineServer,
) -> None:
    fields = block(request())
    with h2.peer() as peer:
        peer.send(
            frame(Kind.HEADERS, 0, 1, fields[:5])
            + frame(0xEE, 0, 1, b"ext")
            + frame(Kind.CONTINUATION, END_HEADERS, 1, fields[5:])
        )
        connection_error(peer, PROTOCOL)


# -- 6.1 DATA --------------------------------------------------------------------------


@differs(IGNORES)
def test_9113_6_1_data_on_stream_0_is_a_connection_error(h2: EngineServer) -> None:
    with h2.peer() as peer:
        peer.send(data(0, grpc_message(b"x")))
        connection_error(peer, PROTOCOL)


@differs("resets the stream (PROTOCOL_ERROR): no connection error")
def test_9113_6_1_padding_as_long_as_the_frame_is_a_connection_error(h2: EngineServer) -> None:
    with h2.peer() as peer:
        peer.send(headers(1, request()), frame(Kind.DATA, PADDED | END_STREAM, 1, b"\x05abcd"))
        connection_error(peer, PROTOCOL)


@differs("resets a stream whose DATA is padded")
def test_9113_6_1_padded_data_is_served(h2: EngineServer) -> None:
    message = grpc_message(b"padded")
    with h2.peer() as peer:
        peer.send(headers(1, request()))
        peer.send(frame(Kind.DATA, PADDED | END_STREAM, 1, b"\x07" + message + b"\0" * 7))
        answer = peer.response(1)
        assert answer.status == b"0" and answer.message == b"padded"


# -- 6.2 HEADERS -----------------------------------------------------------------------


@differs(IGNORES)
def test_9113_6_2_headers_on_stream_0_is_a_connection_error(h2: EngineServer) -> None:
    with h2.peer() as peer:
        peer.send(headers(0, request(), END_HEADERS | END_STREAM))
        connection_error(peer, PROTOCOL)


@differs(AS_A_CALL)
def test_9113_6_2_padding_as_long_as_the_frame_is_a_connection_error(h2: EngineServer) -> None:
    fields = block(request())
    with h2.peer() as peer:
        pad = bytes((len(fields) + 1,))
        peer.send(frame(Kind.HEADERS, END_HEADERS | PADDED | END_STREAM, 1, pad + fields))
        connection_error(peer, PROTOCOL)


@differs("answers grpc-status 13 to padded HEADERS with priority fields")
def test_9113_6_2_padded_headers_with_priority_fields_are_served(h2: EngineServer) -> None:
    fields = block(request())
    payload = b"\x03" + priority(0, 200, exclusive=True) + fields + b"\0\0\0"
    with h2.peer() as peer:
        peer.send(frame(Kind.HEADERS, END_HEADERS | PADDED | PRIORITY_FLAG, 1, payload))
        peer.send(data(1, grpc_message(b"prio")))
        answer = peer.response(1)
        assert answer.status == b"0" and answer.message == b"prio"


@differs("never answers HEADERS with END_STREAM continued by CONTINUATION", skip=True)
def test_9113_6_2_end_stream_headers_may_be_continued(h2: EngineServer) -> None:
    """HEADERS with END_STREAM and without END_HEADERS, then CONTINUATION: one
    request with no body (the call says so: a unary call needs its message)."""
    fields = block(request())
    with h2.peer() as peer:
        peer.send(
            frame(Kind.HEADERS, END_STREAM, 1, fields[:4])
            + frame(Kind.CONTINUATION, END_HEADERS, 1, fields[4:])
        )
        answer = peer.response(1)
        assert answer.ended_by == "end_stream" and answer.status not in (None, b"0"), answer


# -- 6.3 PRIORITY ----------------------------------------------------------------------


@differs(IGNORES)
def test_9113_6_3_priority_on_stream_0_is_a_connection_error(h2: EngineServer) -> None:
    with h2.peer() as peer:
        peer.send(frame(Kind.PRIORITY, 0, 0, priority(1)))
        connection_error(peer, PROTOCOL)


@differs(IGNORES)
@pytest.mark.parametrize("size", [4, 6])
def test_9113_6_3_priority_of_other_than_5_octets_is_a_frame_size_error(
    h2: EngineServer, size: int
) -> None:
    with h2.peer() as peer:
        peer.send(headers(1, request()), frame(Kind.PRIORITY, 0, 1, b"\0" * size))
        stream_error(peer, 1, FRAME_SIZE)


def test_9113_5_3_2_priority_signals_are_ignored_even_a_stream_depending_on_itself(
    h2: EngineServer,
) -> None:
    """RFC 9113 dropped RFC 7540's rule (5.3.1) that a self-dependency is a
    stream error: priority signals are deprecated, and both engines ignore them."""
    with h2.peer() as peer:
        peer.send(frame(Kind.PRIORITY, 0, 1, priority(1)))
        payload = priority(3, 7) + block(request())
        peer.send(frame(Kind.HEADERS, END_HEADERS | PRIORITY_FLAG, 3, payload))
        peer.send(data(3, grpc_message(b"self")))
        answer = peer.response(3)
        assert answer.status == b"0" and answer.message == b"self"


# -- 6.4 RST_STREAM --------------------------------------------------------------------


@differs(IGNORES)
def test_9113_6_4_rst_stream_on_stream_0_is_a_connection_error(h2: EngineServer) -> None:
    with h2.peer() as peer:
        peer.send(rst_stream(0, ErrorCode.CANCEL))
        connection_error(peer, PROTOCOL)


@differs(AS_A_CALL)
@pytest.mark.parametrize("size", [3, 5])
def test_9113_6_4_rst_stream_of_other_than_4_octets_is_a_connection_frame_size_error(
    h2: EngineServer, size: int
) -> None:
    with h2.peer() as peer:
        peer.send(headers(1, request()), frame(Kind.RST_STREAM, 0, 1, b"\0" * size))
        connection_error(peer, FRAME_SIZE)


# -- 6.5 SETTINGS ----------------------------------------------------------------------


def test_9113_6_5_settings_ack_with_payload_is_a_frame_size_error(h2: EngineServer) -> None:
    with h2.peer() as peer:
        peer.send(frame(Kind.SETTINGS, ACK, 0, b"\0\x01\0\0\x10\0"))
        connection_error(peer, FRAME_SIZE)


def test_9113_6_5_settings_on_a_stream_is_a_connection_error(h2: EngineServer) -> None:
    with h2.peer() as peer:
        peer.send(frame(Kind.SETTINGS, 0, 1, b""))
        connection_error(peer, PROTOCOL)


def test_9113_6_5_settings_not_a_multiple_of_6_octets_is_a_frame_size_error(
    h2: EngineServer,
) -> None:
    with h2.peer() as peer:
        peer.send(frame(Kind.SETTINGS, 0, 0, b"\0\x03\0\0\0\x64\0"))
        connection_error(peer, FRAME_SIZE)


@pytest.mark.parametrize(
    ("setting", "value", "code"),
    [
        pytest.param(Setting.ENABLE_PUSH, 2, PROTOCOL, id="enable_push_2"),
        pytest.param(Setting.INITIAL_WINDOW_SIZE, 2**31, FLOW, id="initial_window_2_31"),
        pytest.param(Setting.MAX_FRAME_SIZE, 2**14 - 1, PROTOCOL, id="max_frame_below_2_14"),
        pytest.param(Setting.MAX_FRAME_SIZE, 2**24, PROTOCOL, id="max_frame_2_24"),
    ],
)
def test_9113_6_5_2_a_setting_out_of_range_is_a_connection_error(
    h2: EngineServer, setting: Setting, value: int, code: ErrorCode
) -> None:
    with h2.peer() as peer:
        peer.send(settings_frame({setting: value}))
        connection_error(peer, code)


def test_9113_6_5_2_unknown_settings_are_ignored(h2: EngineServer) -> None:
    with h2.peer() as peer:
        peer.send(frame(Kind.SETTINGS, 0, 0, struct.pack(">HI", 0xFF, 1234)))
        no_error(peer)
        served(peer, 1)


def test_9113_6_5_2_the_server_does_not_enable_push(h2: EngineServer) -> None:
    with h2.peer() as peer:
        assert peer.settings_seen().get(Setting.ENABLE_PUSH, 0) == 0


def test_9113_6_5_2_a_header_table_size_of_0_binds_the_servers_encoder(h2: EngineServer) -> None:
    """The client's decoder has no dynamic table: the server's header blocks
    must not use one (4.3.1; RFC 7541 4.2)."""
    with h2.peer(settings={Setting.HEADER_TABLE_SIZE: 0}, table_size=0) as peer:
        for stream in (1, 3, 5):  # (an encoder with a table would index the repeats)
            served(peer, stream)
        assert peer.decoder.table_size == 0


def test_9113_6_5_3_settings_values_are_processed_in_order(h2: EngineServer) -> None:
    values = struct.pack(">HIHI", Setting.INITIAL_WINDOW_SIZE, 100, Setting.INITIAL_WINDOW_SIZE, 1)
    with h2.peer(preface=False) as peer:
        peer.send(PREFACE + frame(Kind.SETTINGS, 0, 0, values))
        peer.call(1, b"big:50")
        first = _first_data(peer, 1)
        assert len(first) == 1


def _first_data(peer: Peer, stream: int) -> bytes:
    while True:
        got = peer.read()
        assert got is not None, peer.seen
        assert got.kind != Kind.GOAWAY and got.kind != Kind.RST_STREAM, peer.seen
        if got.kind == Kind.DATA and got.stream == stream:
            return got.payload


# -- 6.6 PUSH_PROMISE / 8.4 Server Push ------------------------------------------------


@differs(IGNORES)
def test_9113_8_4_push_promise_from_a_client_is_a_connection_error(h2: EngineServer) -> None:
    with h2.peer() as peer:
        peer.send(headers(1, request()))
        promise = struct.pack(">I", 2) + block(request())
        peer.send(frame(Kind.PUSH_PROMISE, END_HEADERS, 1, promise))
        connection_error(peer, PROTOCOL)


# -- 6.7 PING --------------------------------------------------------------------------


def test_9113_6_7_ping_is_answered_with_its_payload(h2: EngineServer) -> None:
    with h2.peer() as peer:
        peer.send(ping(b"\x00\x01\x02\x03\x04\x05\x06\x07"))
        while True:
            got = peer.read()
            assert got is not None
            if got.kind == Kind.PING:
                assert got.flags & ACK and got.payload == b"\x00\x01\x02\x03\x04\x05\x06\x07"
                return


def test_9113_6_7_a_ping_ack_is_not_answered(h2: EngineServer) -> None:
    with h2.peer() as peer:
        peer.send(ping(b"acked...", ack=True), ping(b"answered"))
        while True:
            got = peer.read()
            assert got is not None
            if got.kind == Kind.PING and got.flags & ACK:
                assert got.payload == b"answered"
                return


@differs(IGNORES)
def test_9113_6_7_ping_on_a_stream_is_a_connection_error(h2: EngineServer) -> None:
    with h2.peer() as peer:
        peer.send(frame(Kind.PING, 0, 1, b"12345678"))
        connection_error(peer, PROTOCOL)


@pytest.mark.parametrize("size", [7, 9])
def test_9113_6_7_ping_of_other_than_8_octets_is_a_frame_size_error(
    h2: EngineServer, size: int
) -> None:
    with h2.peer() as peer:
        peer.send(frame(Kind.PING, 0, 0, b"p" * size))
        connection_error(peer, FRAME_SIZE)


# -- 6.8 GOAWAY / 7 Error Codes --------------------------------------------------------


@differs(IGNORES)
def test_9113_6_8_goaway_on_a_stream_is_a_connection_error(h2: EngineServer) -> None:
    with h2.peer() as peer:
        peer.send(frame(Kind.GOAWAY, 0, 1, struct.pack(">II", 0, 0)))
        connection_error(peer, PROTOCOL)


def test_9113_4_2_goaway_too_short_for_its_fields_is_a_frame_size_error(h2: EngineServer) -> None:
    """4.2: a frame too small for its mandatory data is FRAME_SIZE_ERROR, a
    connection error for a frame on stream 0."""
    with h2.peer() as peer:
        peer.send(frame(Kind.GOAWAY, 0, 0, b"\0\0\0\0\0\0\0"))
        connection_error(peer, FRAME_SIZE)


def test_9113_7_unknown_error_codes_trigger_nothing_special(h2: EngineServer) -> None:
    """RST_STREAM with an unknown code ends that stream only; the client's
    GOAWAY with one leaves its call in flight to finish."""
    with h2.peer() as peer:
        peer.send(headers(1, request()), rst_stream(1, 0xABCD))
        no_error(peer)
        peer.send(headers(3, request()), data(3, grpc_message(b"in flight"), end=False))
        peer.send(goaway(3, 0xABCD))  # type: ignore[arg-type]
        peer.send(data(3, b"", end=True))
        answer = peer.response(3)
        assert answer.status == b"0" and answer.message == b"in flight"


# -- 6.9 WINDOW_UPDATE -----------------------------------------------------------------


def test_9113_6_9_a_connection_window_update_of_0_is_a_connection_error(h2: EngineServer) -> None:
    with h2.peer() as peer:
        peer.send(window_update(0, 0))
        connection_error(peer, PROTOCOL)


@differs(AS_A_CALL)
def test_9113_6_9_a_stream_window_update_of_0_is_a_stream_error(h2: EngineServer) -> None:
    with h2.peer() as peer:
        peer.send(headers(1, request()), window_update(1, 0))
        stream_error(peer, 1, PROTOCOL)


@differs(AS_A_CALL)
@pytest.mark.parametrize("size", [3, 5])
def test_9113_6_9_window_update_of_other_than_4_octets_is_a_frame_size_error(
    h2: EngineServer, size: int
) -> None:
    with h2.peer() as peer:
        peer.send(headers(1, request()), frame(Kind.WINDOW_UPDATE, 0, 1, b"\0\0\0\x01\0"[:size]))
        connection_error(peer, FRAME_SIZE)


def test_9113_6_9_the_reserved_bit_of_an_increment_is_ignored(h2: EngineServer) -> None:
    with h2.peer() as peer:
        peer.send(frame(Kind.WINDOW_UPDATE, 0, 0, struct.pack(">I", 1 << 31 | 1000)))
        no_error(peer)
        served(peer, 1)


def test_9113_6_9_1_the_server_keeps_to_a_window_of_1(h2: EngineServer) -> None:
    with h2.peer(settings={Setting.INITIAL_WINDOW_SIZE: 1}) as peer:
        peer.call(1, b"big:20")
        assert len(_first_data(peer, 1)) == 1
        no_error(peer)  # and no more DATA before the window opens
        assert sum(len(f.payload) for f in peer.seen if f.kind == Kind.DATA) == 1
        peer.send(window_update(1, 100))
        answer = peer.response(1)
        assert answer.status == b"0" and len(answer.data) == 24  # the 25 bytes, less the one


def test_9113_6_9_1_the_server_keeps_to_the_connection_window(h2: EngineServer) -> None:
    """Streams with room to spare, the connection's 65,535 bytes (never
    opened, and SETTINGS_INITIAL_WINDOW_SIZE does not change it, 6.9.2)."""
    with h2.peer(settings={Setting.INITIAL_WINDOW_SIZE: MAX_WINDOW}) as peer:
        peer.call(1, b"big:100000")
        got = 0
        while got < 65_535:
            got += len(_first_data(peer, 1))
        no_error(peer)
        assert sum(len(f.payload) for f in peer.seen if f.kind == Kind.DATA) == 65_535
        peer.send(window_update(0, 100_000))
        answer = peer.response(1)
        assert answer.status == b"0" and got + len(answer.data) == 100_005


@differs(IGNORES)
def test_9113_6_9_1_a_connection_window_past_2_31_1_is_a_flow_control_error(
    h2: EngineServer,
) -> None:
    with h2.peer() as peer:
        peer.send(window_update(0, MAX_WINDOW))  # 65,535 + 2^31-1
        connection_error(peer, FLOW)


@differs(IGNORES)
def test_9113_6_9_1_a_stream_window_past_2_31_1_is_a_flow_control_error(h2: EngineServer) -> None:
    with h2.peer() as peer:
        _half_closed_remote(peer)
        peer.send(window_update(1, MAX_WINDOW))
        stream_error(peer, 1, FLOW)


def test_9113_6_9_2_a_new_initial_window_applies_to_open_streams(h2: EngineServer) -> None:
    with h2.peer(settings={Setting.INITIAL_WINDOW_SIZE: 0}) as peer:
        peer.call(1, b"big:20")
        no_error(peer)  # no window: no DATA
        assert not [f for f in peer.seen if f.kind == Kind.DATA]
        peer.send(settings_frame({Setting.INITIAL_WINDOW_SIZE: 1}))
        assert len(_first_data(peer, 1)) == 1


def test_9113_6_9_2_a_window_made_negative_by_settings_is_tracked(h2: EngineServer) -> None:
    """A window of 5, all used; the initial window cut to 2 (the stream's
    window -3); an update of 4 leaves room for exactly 1 byte."""
    with h2.peer(settings={Setting.INITIAL_WINDOW_SIZE: 5}) as peer:
        peer.call(1, b"big:20")
        got = 0
        while got < 5:
            got += len(_first_data(peer, 1))
        peer.send(settings_frame({Setting.INITIAL_WINDOW_SIZE: 2}))
        no_error(peer)
        peer.send(window_update(1, 4))
        assert len(_first_data(peer, 1)) == 1
        no_error(peer)
        assert sum(len(f.payload) for f in peer.seen if f.kind == Kind.DATA) == 6


@differs(IGNORES)
def test_9113_6_9_2_an_initial_window_that_takes_a_stream_past_2_31_1_is_a_connection_error(
    h2: EngineServer,
) -> None:
    with h2.peer() as peer:
        _half_closed_remote(peer)
        peer.send(window_update(1, MAX_WINDOW - 65_535))
        peer.send(settings_frame({Setting.INITIAL_WINDOW_SIZE: MAX_WINDOW}))
        connection_error(peer, FLOW)


# -- 6.10 CONTINUATION -----------------------------------------------------------------


def test_9113_6_10_a_field_block_in_several_continuations_is_served(h2: EngineServer) -> None:
    fields = block(request())
    with h2.peer() as peer:
        peer.send(
            frame(Kind.HEADERS, 0, 1, fields[:3])
            + frame(Kind.CONTINUATION, 0, 1, fields[3:9])
            + frame(Kind.CONTINUATION, 0, 1, b"")
            + frame(Kind.CONTINUATION, END_HEADERS, 1, fields[9:])
            + data(1, grpc_message(b"cont"))
        )
        answer = peer.response(1)
        assert answer.status == b"0" and answer.message == b"cont"


_FIELDS = block(request())


@differs(AS_A_CALL)
@pytest.mark.parametrize(
    "frames",
    [
        pytest.param(
            frame(Kind.HEADERS, 0, 1, _FIELDS[:3])
            + frame(Kind.CONTINUATION, 0, 1, _FIELDS[3:9])
            + data(1, grpc_message(b"x")),
            id="continuation_then_data",
        ),
        pytest.param(
            frame(Kind.HEADERS, 0, 1, _FIELDS[:3])
            + frame(Kind.CONTINUATION, END_HEADERS, 0, _FIELDS[3:]),
            id="continuation_on_stream_0",
        ),
        pytest.param(
            frame(Kind.HEADERS, 0, 1, _FIELDS[:3])
            + frame(Kind.CONTINUATION, END_HEADERS, 3, _FIELDS[3:]),
            id="continuation_on_another_stream",
        ),
        pytest.param(
            headers(1, request()) + frame(Kind.CONTINUATION, END_HEADERS, 1, b"\x82"),
            id="after_end_headers",
        ),
        pytest.param(
            frame(Kind.HEADERS, 0, 1, _FIELDS[:3])
            + frame(Kind.CONTINUATION, END_HEADERS, 1, _FIELDS[3:])
            + frame(Kind.CONTINUATION, END_HEADERS, 1, b"\x82"),
            id="after_a_continuation_with_end_headers",
        ),
        pytest.param(
            headers(1, request())
            + data(1, b"", end=False)
            + frame(Kind.CONTINUATION, END_HEADERS, 1, b"\x82"),
            id="after_data",
        ),
    ],
)
def test_9113_6_10_a_continuation_out_of_place_is_a_connection_error(
    h2: EngineServer, frames: bytes
) -> None:
    with h2.peer() as peer:
        peer.send(frames)
        connection_error(peer, PROTOCOL)


# -- 8.1 HTTP Message Framing ----------------------------------------------------------


def test_9113_8_1_trailers_end_the_request(h2: EngineServer) -> None:
    with h2.peer() as peer:
        peer.send(headers(1, request()), data(1, grpc_message(b"t"), end=False))
        peer.send(headers(1, [(b"x-trailer", b"1")], END_HEADERS | END_STREAM))
        answer = peer.response(1)
        assert answer.status == b"0" and answer.message == b"t"


@differs(AS_A_CALL)
def test_9113_8_1_a_second_headers_without_end_stream_is_malformed(h2: EngineServer) -> None:
    with h2.peer() as peer:
        peer.send(headers(1, request()), data(1, grpc_message(b"t"), end=False))
        peer.send(headers(1, [(b"x-trailer", b"1")]))
        stream_error(peer, 1, PROTOCOL)


@differs(IGNORES)
def test_9113_8_1_pseudo_header_fields_in_trailers_are_malformed(h2: EngineServer) -> None:
    with h2.peer() as peer:
        peer.send(headers(1, request()), data(1, grpc_message(b"t"), end=False))
        peer.send(headers(1, [(b":path", b"/x")], END_HEADERS | END_STREAM))
        stream_error(peer, 1, PROTOCOL)


# -- 8.1.1 Malformed Messages: content-length ------------------------------------------


@differs(IGNORES)
@pytest.mark.parametrize("frames", [1, 2])
def test_9113_8_1_1_a_content_length_unlike_the_data_is_malformed(
    h2: EngineServer, frames: int
) -> None:
    message = grpc_message(b"12345")
    with h2.peer() as peer:
        peer.send(headers(1, request("Unary", (b"content-length", b"20"))))
        if frames == 1:
            peer.send(data(1, message))
        else:
            peer.send(data(1, message[:4], end=False), data(1, message[4:]))
        stream_error(peer, 1, PROTOCOL)


def test_9113_8_1_1_a_content_length_like_the_data_is_served(h2: EngineServer) -> None:
    message = grpc_message(b"12345")
    with h2.peer() as peer:
        fields = request("Unary", (b"content-length", str(len(message)).encode()))
        peer.send(headers(1, fields), data(1, message[:3], end=False), data(1, message[3:]))
        answer = peer.response(1)
        assert answer.status == b"0" and answer.message == b"12345"


# -- 8.2 HTTP Fields / 8.2.1 Field Validity --------------------------------------------


@differs(AS_A_CALL)
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(b"x-Upper", id="uppercase"),
        pytest.param(b"x y", id="space"),
        pytest.param(b"x\x01y", id="control"),
        pytest.param(b"x\x7fy", id="del"),
        pytest.param(b"x\xc3\xa9", id="non_ascii"),
        pytest.param(b"x:y", id="colon"),
    ],
)
def test_9113_8_2_1_a_field_name_with_a_prohibited_character_is_malformed(
    h2: EngineServer, name: bytes
) -> None:
    with h2.peer() as peer:
        peer.send(request_frames(1, request("Unary", (name, b"v"))))
        stream_error(peer, 1, PROTOCOL)


@differs(IGNORES)
@pytest.mark.parametrize(
    "value",
    [
        pytest.param(b"a\0b", id="nul"),
        pytest.param(b"a\rb", id="cr"),
        pytest.param(b"a\nb", id="lf"),
        pytest.param(b" a", id="leading_space"),
        pytest.param(b"a\t", id="trailing_tab"),
    ],
)
def test_9113_8_2_1_a_field_value_with_a_prohibited_character_is_malformed(
    h2: EngineServer, value: bytes
) -> None:
    with h2.peer() as peer:
        peer.send(request_frames(1, request("Unary", (b"x-value", value))))
        stream_error(peer, 1, PROTOCOL)


# -- 8.2.2 Connection-Specific Header Fields -------------------------------------------


@differs(IGNORES)
@pytest.mark.parametrize(
    "name", [b"connection", b"proxy-connection", b"keep-alive", b"transfer-encoding", b"upgrade"]
)
def test_9113_8_2_2_a_connection_specific_field_is_malformed(h2: EngineServer, name: bytes) -> None:
    with h2.peer() as peer:
        peer.send(request_frames(1, request("Unary", (name, b"x"))))
        stream_error(peer, 1, PROTOCOL)


@differs(AS_A_CALL)
def test_9113_8_2_2_te_other_than_trailers_is_malformed(h2: EngineServer) -> None:
    with h2.peer() as peer:
        peer.send(request_frames(1, [*request(drop=(b"te",)), (b"te", b"trailers, deflate")]))
        stream_error(peer, 1, PROTOCOL)


# -- 8.3 HTTP Control Data / 8.3.1 Request Pseudo-Header Fields ------------------------


@differs(
    "serves most of them; answers unknown ones as a call, missing ones with RST_STREAM"
    " INTERNAL_ERROR"
)
@pytest.mark.parametrize(
    "fields",
    [
        pytest.param([*request(), (b":unknown", b"x")], id="unknown_pseudo"),
        pytest.param([(b":status", b"200"), *request()], id="response_pseudo"),
        pytest.param(
            [(b"x-first", b"1"), *request(drop=(b":authority",)), (b":authority", b"a")],
            id="pseudo_after_regular",
        ),
        pytest.param([*request(), (b":method", b"POST")], id="repeated_method"),
        pytest.param([*request(), (b":scheme", b"http")], id="repeated_scheme"),
        pytest.param([*request(), (b":path", b"/test.Echo/Unary")], id="repeated_path"),
        pytest.param(request(drop=(b":method",)), id="no_method"),
        pytest.param(request(drop=(b":scheme",)), id="no_scheme"),
        pytest.param(request(drop=(b":path",)), id="no_path"),
        pytest.param([*request(drop=(b":path",)), (b":path", b"")], id="empty_path"),
    ],
)
def test_9113_8_3_pseudo_header_fields_out_of_rule_are_malformed(
    h2: EngineServer, fields: list[tuple[bytes, bytes]]
) -> None:
    with h2.peer() as peer:
        peer.send(request_frames(1, fields))
        stream_error(peer, 1, PROTOCOL)


def test_9113_8_5_a_connect_request_without_scheme_and_path_is_not_malformed(
    h2: EngineServer,
) -> None:
    """CONNECT carries :authority alone (8.5): a gRPC port answers it (a
    gRPC status, or a reset other than PROTOCOL_ERROR), not as malformed."""
    with h2.peer() as peer:
        fields = [(b":method", b"CONNECT"), (b":authority", b"example:443")]
        peer.send(headers(1, fields))
        answer = peer.response(1)
        assert answer.ended_by in ("end_stream", "reset") and answer.reset != PROTOCOL, answer


@differs(AS_A_CALL)
def test_9113_8_3_a_malformed_request_leaves_the_connection_serving(h2: EngineServer) -> None:
    with h2.peer() as peer:
        peer.send(request_frames(1, request("Unary", (b"x-Upper", b"v"))))
        stream_error(peer, 1, PROTOCOL)
        served(peer, 3)


# -- RFC 7541 (HPACK) ------------------------------------------------------------------


def _huffman_literal(name: bytes, value: bytes) -> bytes:
    out = b"\x00"
    for text in (name, value):
        coded = huffman_encode(text)
        out += bytes(encode_integer(len(coded), 7, 0x80)) + coded
    return out


@differs(AS_A_CALL)
@pytest.mark.parametrize(
    "fields",
    [
        pytest.param(b"\xbe", id="2_3_3_index_past_the_tables"),
        pytest.param(b"\x7e\x01v", id="2_3_3_name_index_past_the_tables"),
        pytest.param(b"\x80", id="6_1_index_0"),
        pytest.param(b"\xff\xff\xff\xff\xff\xff\x0f", id="5_1_integer_past_2_31_1"),
        pytest.param(b"\x00\x85abc", id="5_2_string_past_the_block"),
        pytest.param(b"\x00\x84\xff\xff\xff\xff\x01v", id="5_2_huffman_eos"),
        pytest.param(
            b"\x00\x82" + huffman_encode(b"a") + b"\xff\x01v", id="5_2_padding_over_7_bits"
        ),
        pytest.param(b"\x00\x81\x18\x01v", id="5_2_padding_of_zeros"),
        pytest.param(bytes(encode_integer(4097, 5, 0x20)), id="6_3_size_update_over_the_setting"),
        pytest.param(b"\x82\x20", id="4_2_size_update_after_a_field"),
    ],
)
def test_7541_a_field_block_it_forbids_is_a_compression_error(
    h2: EngineServer, fields: bytes
) -> None:
    with h2.peer() as peer:
        peer.send(frame(Kind.HEADERS, END_HEADERS | END_STREAM, 1, fields))
        connection_error(peer, COMPRESSION)


def test_7541_2_3_2_the_dynamic_table_lives_across_field_blocks(h2: EngineServer) -> None:
    indexed = literal(b"x-kept", b"1", first=0x40)
    with h2.peer() as peer:
        peer.send(frame(Kind.HEADERS, END_HEADERS, 1, block(request()) + indexed))
        peer.send(data(1, grpc_message(b"one")))
        assert peer.response(1).status == b"0"
        peer.send(frame(Kind.HEADERS, END_HEADERS, 3, block(request()) + b"\xbe"))
        peer.send(data(3, grpc_message(b"two")))
        answer = peer.response(3)
        assert answer.status == b"0" and answer.message == b"two"


@differs(AS_A_CALL + " (or, racing it, a reset TCP connection)", skip=True)
def test_7541_4_2_a_size_update_to_0_empties_the_table(h2: EngineServer) -> None:
    indexed = literal(b"x-gone", b"1", first=0x40)
    with h2.peer() as peer:
        peer.send(frame(Kind.HEADERS, END_HEADERS, 1, block(request()) + indexed))
        peer.send(data(1, grpc_message(b"one")))
        assert peer.response(1).status == b"0"
        peer.send(frame(Kind.HEADERS, END_HEADERS, 3, b"\x20" + block(request()) + b"\xbe"))
        connection_error(peer, COMPRESSION)


def test_7541_5_2_huffman_coded_and_never_indexed_fields_are_served(h2: EngineServer) -> None:
    fields = b"".join(_huffman_literal(name, value) for name, value in request())
    fields += b"\x10" + literal(b"x-secret", b"s")[1:]  # never indexed (6.2.3)
    with h2.peer() as peer:
        peer.send(frame(Kind.HEADERS, END_HEADERS, 1, fields), data(1, grpc_message(b"huff")))
        answer = peer.response(1)
        assert answer.status == b"0" and answer.message == b"huff"


# -- 9.2 Use of TLS Features -------------------------------------------------------


@pytest.fixture(scope="module", params=ENGINES)
def tls(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    certs = make_certs(tmp_path_factory.mktemp("certs"))
    files = {"tls_cert_file": str(certs / "server.crt"), "tls_key_file": str(certs / "server.key")}
    with EngineServer(request.param, **files) as server:
        yield server, certs / "ca.crt"


def _tls_1_2_handshake(address: str, ca: Path, ciphers: str) -> ssl.SSLSocket:
    client = ssl.create_default_context(cafile=str(ca))
    client.maximum_version = ssl.TLSVersion.TLSv1_2
    client.set_ciphers(ciphers)
    client.set_alpn_protocols(["h2"])
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    try:
        return client.wrap_socket(sock, server_hostname=host)
    except BaseException:
        sock.close()
        raise


def test_9113_9_2_2_a_prohibited_tls_1_2_cipher_suite_is_not_negotiated(tls: Any) -> None:
    """Appendix A prohibits TLS 1.2's non-AEAD suites (CBC): a client that
    offers only those has no handshake."""
    server, ca = tls
    with pytest.raises(ssl.SSLError):
        _tls_1_2_handshake(server.address, ca, "ECDHE-ECDSA-AES128-SHA256:ECDHE-ECDSA-AES128-SHA")


def test_9113_9_2_tls_1_2_with_an_aead_suite_serves_h2(tls: Any) -> None:
    server, ca = tls
    with _tls_1_2_handshake(server.address, ca, "ECDHE-ECDSA-AES128-GCM-SHA256") as sock:
        assert sock.version() == "TLSv1.2" and sock.selected_alpn_protocol() == "h2"
        sock.sendall(PREFACE + settings_frame({}))
        head = b""
        while len(head) < 9:
            chunk = sock.recv(9 - len(head))
            assert chunk, "closed before the server's preface"
            head += chunk
        assert head[3] == Kind.SETTINGS  # the server's preface


def test_9113_9_2_1_the_ports_tls_has_no_renegotiation_or_compression(tmp_path: Path) -> None:
    """(What a client cannot probe with Python's ssl: the context's options.)"""
    certs = make_certs(tmp_path)
    context = tls_context(
        dataclasses.replace(
            ServerSettings(),
            tls_cert_file=str(certs / "server.crt"),
            tls_key_file=str(certs / "server.key"),
        )
    )
    assert context is not None
    assert context.options & ssl.OP_NO_RENEGOTIATION and context.options & ssl.OP_NO_COMPRESSION
    assert context.minimum_version >= ssl.TLSVersion.TLSv1_2
