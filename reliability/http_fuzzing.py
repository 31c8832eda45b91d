"""Hostile HTTP/1.1 requests for the REST door (issue 29), and how to send them.

Each case is raw bytes written on a fresh connection, which is then
half-closed: the door must answer a 4xx (or close without an answer when
the request never ended), never a 5xx, never a 200 for a bad request. A
valid echo call among them must get 200 and its data back. Families:
malformed request lines, bad chunked bodies, header floods, bodies that lie
about their length, JSON bombs (deep nesting, huge arrays, many keys),
wrong datatypes and shapes, the binary extension's lengths, compression
(garbage, a gzip bomb, unknown encodings), and random mutants of a valid
request. Standard library only, beside :mod:`fuzz`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

PATH = b"/v2/models/echo/infer"
VALID, BAD = "valid", "bad"


@dataclass(frozen=True)
class Case:
    family: str
    request: bytes
    kind: str = BAD  # VALID: 200 with the data echoed; BAD: a 4xx or no answer
    data: tuple[float, ...] = ()


def _post(body: bytes, *headers: bytes, path: bytes = PATH, length: int | None = None) -> bytes:
    size = len(body) if length is None else length
    head = b"POST %s HTTP/1.1\r\nhost: fuzz\r\ncontent-length: %d\r\n" % (path, size)
    return head + b"".join(h + b"\r\n" for h in headers) + b"\r\n" + body


def _doc(tensor: dict[str, object], **parameters: object) -> bytes:
    doc: dict[str, object] = {"inputs": [tensor]}
    if parameters:
        doc["parameters"] = parameters
    return json.dumps(doc).encode()


def _tensor(data: object, datatype: str = "FP32", shape: object = None) -> dict[str, object]:
    if shape is None:
        shape = [1, len(data)] if isinstance(data, list) else [1]
    return {"name": "INPUT0", "datatype": datatype, "shape": shape, "data": data}


def valid(rng: random.Random) -> Case:
    data = tuple(round(rng.uniform(-1e3, 1e3), 3) for _ in range(rng.randint(1, 8)))
    return Case("valid", _post(_doc(_tensor(list(data)))), VALID, data)


def request_lines(rng: random.Random) -> Case:
    line = rng.choice(
        [
            b"GET\r\n\r\n",
            b"POST  HTTP/1.1\r\n\r\n",
            b"GET / HTTP/9.9\r\n\r\n",
            b"G\x00T / HTTP/1.1\r\n\r\n",
            b"GET /v2/health/live HTTP/1.1\n\n\n",
            b"GET /v2/\x01\x02 HTTP/1.1\r\nhost: x\r\n\r\n",
            b"GET " + b"/x" * rng.randint(10_000, 40_000) + b" HTTP/1.1\r\n\r\n",
            b"BREW /v2 HTCPCP/1.0\r\n\r\n",
            b"GET /v2 HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n",
            rng.randbytes(rng.randint(1, 200)),
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        ]
    )
    return Case("request line", line)


def chunked(rng: random.Random) -> Case:
    body = _doc(_tensor([1.0]))
    head = b"POST %s HTTP/1.1\r\nhost: fuzz\r\ntransfer-encoding: chunked\r\n" % PATH
    chunks = rng.choice(
        [
            b"zz\r\n" + body + b"\r\n0\r\n\r\n",
            b"-5\r\n" + body + b"\r\n0\r\n\r\n",
            b"ffffffffffffffffff\r\n" + body,
            b"%x\r\n" % (len(body) + 50) + body + b"\r\n0\r\n\r\n",
            b"%x\r\n" % len(body) + body + b"XX0\r\n\r\n",
            LONG_EXTENSION,
            b"%x\r\n" % len(body) + body,  # never ends
            rng.randbytes(rng.randint(1, 100)),
        ]
    )
    extra = rng.choice([b"", b"content-length: 5\r\n", b"transfer-encoding: gzip\r\n"])
    if chunks is LONG_EXTENSION:
        chunks = b"%x;%s\r\n" % (len(body), b"e" * 9000) + body + b"\r\n0\r\n\r\n"
        if not extra:  # a long chunk extension is lawful HTTP/1.1 (RFC 9112 7.1.1): answered
            return Case("chunked", head + b"\r\n" + chunks, kind=VALID, data=(1.0,))
    return Case("chunked", head + extra + b"\r\n" + chunks)


LONG_EXTENSION = b"<a whole chunk with a 9,000-byte chunk extension>"


def header_floods(rng: random.Random) -> Case:
    choice = rng.randrange(5)
    if choice == 0:
        headers = b"".join(b"x-%d: y\r\n" % i for i in range(rng.randint(2_000, 6_000)))
    elif choice == 1:
        headers = b"x-big: " + b"a" * rng.randint(70_000, 200_000) + b"\r\n"
    elif choice == 2:
        headers = b"no colon here\r\n"
    elif choice == 3:
        headers = b"x-fold: a\r\n  continued\r\n"
    else:
        headers = b"x bad name: 1\r\n"
    return Case("header flood", b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\n" + headers + b"\r\n")


def lying_lengths(rng: random.Random) -> Case:
    body = _doc(_tensor([1.0, 2.0]))
    request = rng.choice(
        [
            _post(body, length=len(body) + rng.randint(1, 5000)),  # shorter than said
            _post(body, length=rng.randint(1, len(body) - 1)),  # longer: the rest is garbage
            _post(body, length=1 << 40),  # over max_message_size
            b"POST %s HTTP/1.1\r\ncontent-length: -1\r\n\r\n" % PATH + body,
            b"POST %s HTTP/1.1\r\ncontent-length: 1e3\r\n\r\n" % PATH + body,
            b"POST %s HTTP/1.1\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\n" % PATH + body,
            _post(body, b"inference-header-content-length: %d" % (len(body) + 10)),
            _post(body, b"inference-header-content-length: -3"),
            _post(body + b"\0" * 8, b"inference-header-content-length: %d" % len(body)),
        ]
    )
    return Case("lying length", request)


def json_bombs(rng: random.Random) -> Case:
    depth = rng.randint(1_000, 200_000)
    choice = rng.randrange(6)
    if choice == 0:
        data = "[" * depth + "]" * depth
        body = ('{"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "FP32", "data": '
                + data + "}]}").encode()  # fmt: skip
    elif choice == 1:
        body = b'{"a":' * depth + b"1" + b"}" * depth
    elif choice == 2:
        body = _doc(_tensor([0] * rng.randint(100_000, 250_000), shape=[1]))
    elif choice == 3:
        body = json.dumps({f"k{i}": i for i in range(rng.randint(10_000, 60_000))}).encode()
    elif choice == 4:
        body = _doc(_tensor(["x" * rng.randint(100_000, 500_000)], "BYTES", [1]), x=[1])
    else:
        params = {f"p{i}": i for i in range(rng.randint(1_000, 20_000))}
        body = _doc(_tensor("not a list"), **params)
    return Case("JSON bomb", _post(body, b"content-type: application/json"))


def wrong_types(rng: random.Random) -> Case:
    body = rng.choice(
        [
            _doc(_tensor(["a", "b"])),
            _doc(_tensor([1.5], "INT32")),
            _doc(_tensor([300], "INT8")),
            _doc(_tensor([-1], "UINT8")),
            _doc(_tensor([1], "BOOL")),
            _doc(_tensor([1], "BYTES")),
            _doc(_tensor([1.0], "NOPE")),
            _doc(_tensor([1.0], shape="1")),
            _doc(_tensor([1.0], shape=[2])),
            _doc(_tensor([1.0], shape=[-1])),
            _doc(_tensor([[1.0], [2.0, 3.0]], shape=[2, 2])),
            _doc(_tensor([1.0]), priority="high"),
            _doc(_tensor([1.0]), timeout=-1.5),
            _doc(_tensor([1.0]), sequence_id=[1]),
            _doc(_tensor([1.0]), binary_data_output="yes"),
            json.dumps({"inputs": [{**_tensor([1.0]), "name": 1}]}).encode(),
            json.dumps({"inputs": []}).encode(),
            json.dumps([1, 2, 3]).encode(),
            b"null",
            b"",
            b"{",
            b'{"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1], "data": [NaN]}]}',
            b'{"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1], "data": [nan]}]}',
            b"\xff\xfe" + rng.randbytes(20),
        ]
    )  # fmt: skip
    return Case("wrong datatype", _post(body, b"content-type: application/json"))


def compression(rng: random.Random) -> Case:
    body = _doc(_tensor([1.0]))
    choice = rng.randrange(5)
    if choice == 0:
        request = _post(rng.randbytes(rng.randint(1, 500)), b"content-encoding: gzip")
    elif choice == 1:
        request = _post(gzip.compress(body)[:-9], b"content-encoding: gzip")  # truncated
    elif choice == 2:  # a bomb: inflates past max_message_size
        request = _post(gzip.compress(b" " * (8 << 20)), b"content-encoding: gzip")
    elif choice == 3:
        request = _post(body, b"content-encoding: br")
    else:
        request = _post(gzip.compress(b"[" * 100_000), b"content-encoding: deflate")
    return Case("compression", request)


def mutant(rng: random.Random) -> Case:
    data = bytearray(valid(rng).request)
    for _ in range(rng.randint(1, 4)):
        pos = rng.randrange(len(data))
        action = rng.randrange(3)
        if action == 0:
            data[pos] = rng.randrange(256)
        elif action == 1:
            del data[pos : pos + rng.randint(1, 8)]
        else:
            data[pos:pos] = rng.randbytes(rng.randint(1, 8))
    return Case("mutant", bytes(data), kind="any")  # a mutant may still be valid


FAMILIES: tuple[Callable[[random.Random], Case], ...] = (
    valid,
    request_lines,
    chunked,
    header_floods,
    lying_lengths,
    json_bombs,
    wrong_types,
    compression,
    mutant,
)


def largest() -> list[Case]:
    """Each family's largest allocations, for the warm-up: the heaps reach their
    size before the run that is measured (so that growth means a leak)."""
    deep = 200_000
    bombs = [
        b'{"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "FP32", "data": '
        + b"[" * deep
        + b"]" * deep
        + b"}]}",
        _doc(_tensor([0] * 250_000, shape=[1])),
        json.dumps({f"k{i}": i for i in range(60_000)}).encode(),
        _doc(_tensor(["x" * 500_000], "BYTES", [1]), x=[1]),
        _doc(_tensor("not a list"), **{f"p{i}": i for i in range(20_000)}),
    ]
    out = [Case("JSON bomb", _post(body, b"content-type: application/json")) for body in bombs]
    out.append(
        Case("compression", _post(gzip.compress(b" " * (8 << 20)), b"content-encoding: gzip"))
    )
    flood = b"".join(b"x-%d: y\r\n" % i for i in range(6_000))
    out.append(Case("header flood", b"GET /v2/health/live HTTP/1.1\r\n" + flood + b"\r\n"))
    return out


def cases(seed: int) -> Iterator[Case]:
    rng = random.Random(seed)
    while True:
        yield rng.choice(FAMILIES)(rng)


async def send(
    host: str, port: int, request: bytes, timeout: float = 30.0, half_open: bool = False
) -> bytes:
    """Writes the request and reads whatever the door answers, until it closes
    the connection (a valid call's answer: until its length is read).

    A bad request is followed by a half-close, so that one that never ends
    (a short body, an endless chunked one) ends there: the door drops a
    request cut short by a half-close and answers a whole one (a request that
    is lawful after all is a VALID case, not half-closed)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(request)
        with contextlib.suppress(ConnectionError):  # refused mid-request: read its answer
            await writer.drain()
            if not half_open and writer.can_write_eof():
                writer.write_eof()
        if half_open:
            return await _one_response(reader, timeout)
        chunks = []
        with contextlib.suppress(ConnectionError):
            async with asyncio.timeout(timeout):
                while chunk := await reader.read(65536):
                    chunks.append(chunk)
        return b"".join(chunks)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def _one_response(reader: asyncio.StreamReader, timeout: float) -> bytes:
    async with asyncio.timeout(timeout):
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return head + await reader.readexactly(length)


def status_of(answer: bytes) -> int | None:
    """The first response's status (None: no answer)."""
    if not answer.startswith(b"HTTP/1.1 "):
        return None
    return int(answer[9:12])


def final(answer: bytes) -> bytes:
    """The answer without the interim (1xx) responses in front, which a client
    reads past: the door sends ``100 Continue`` when a FIN comes before its answer."""
    while (status := status_of(answer)) is not None and 100 <= status < 200:
        _, sep, rest = answer.partition(b"\r\n\r\n")
        if not sep:
            return answer
        answer = rest
    return answer


def judge(case: Case, answer: bytes) -> str | None:
    """What is wrong with the answer to a case, or None."""
    answer = final(answer)
    status = status_of(answer)
    if not answer:
        return None if case.kind != VALID else "a valid call got no answer"
    if status is None:
        return f"not an HTTP response: {answer[:60]!r}"
    if case.kind == VALID:
        if status != 200:
            return f"a valid call got {status}: {answer[:200]!r}"
        _, _, body = answer.partition(b"\r\n\r\n")
        try:
            data = json.loads(body)["outputs"][0]["data"]
        except (ValueError, KeyError, IndexError, TypeError):
            return f"a valid call's reply is not its echo: {body[:120]!r}"
        if [round(x, 3) for x in data] != list(case.data):
            return f"a valid call's echo differs: {data} != {case.data}"
        return None
    if status >= 500:
        return f"{status} (a 5xx) for a bad request: {answer[:200]!r}"
    if status == 200 and case.kind == BAD:
        return f"200 for a bad request: {answer[:200]!r}"
    return None
