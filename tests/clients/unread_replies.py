"""A gRPC client that sends unary calls and never reads the replies, in its own process.

Raw HTTP/2 over a socket (no gRPC library: a gRPC client always reads): it
acknowledges SETTINGS and PING, so the connection stays healthy, but it
never sends a WINDOW_UPDATE, so the server can send at most the initial
65,535 bytes of reply data and has to hold the rest. Calls carry no
grpc-timeout (unless ``--timeout``), so no deadline frees them.

usage: unread_replies.py HOST:PORT METHOD_PATH REQUEST_FILE COUNT [--at-once] [--timeout T]

Sends COUNT calls of the serialized request in REQUEST_FILE one after the
other (``--at-once``: all streams opened first, their bodies interleaved as
the server's windows allow, as a client with COUNT calls in flight does),
prints ``{"sent": COUNT}`` once all are on the wire, then one line
``{"ended": STREAM_ID, "data": BYTES}`` per stream the server ends (a
trailers-only error ends a stream at once; a reply held back by flow control
never ends), until it is killed. ``--timeout``: a grpc-timeout header (such
as ``2S``) on every call.
"""

from __future__ import annotations

import json
import select
import socket
import struct
import sys

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE = 0x4, 0x5
CHUNK = 16384  # the smallest SETTINGS_MAX_FRAME_SIZE a server may have
LARGEST_CHUNK = 1 << 20  # the most sent in one DATA frame when the server takes more


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes([kind, flags])
        + struct.pack(">I", stream)
        + payload
    )


def hpack_string(text: str) -> bytes:
    data = text.encode()
    assert len(data) < 127, "one-byte lengths only"
    return bytes([len(data)]) + data


def hpack_literal(name: str, value: str) -> bytes:
    """Literal header field without indexing, new name, no Huffman (RFC 7541 6.2.2)."""
    return b"\x00" + hpack_string(name) + hpack_string(value)


class Connection:
    def __init__(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        self.authority = address
        self.sock = socket.create_connection((host.strip("[]"), int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.inbox = bytearray()
        self.conn_window = 65535
        self.initial_window = 65535
        self.windows: dict[int, int] = {}
        self.received: dict[int, int] = {}
        self.chunk = CHUNK
        self.timeout = ""
        self.sock.sendall(PREFACE + frame(SETTINGS, 0, 0))

    def pump(self, timeout: float) -> None:
        """Reads what the server sent (waiting up to ``timeout``) and answers it."""
        readable, _, _ = select.select([self.sock], [], [], timeout)
        if not readable:
            return
        data = self.sock.recv(1 << 20)
        if not data:
            raise SystemExit(0)  # the server closed the connection
        self.inbox += data
        while len(self.inbox) >= 9:
            length = int.from_bytes(self.inbox[:3], "big")
            if len(self.inbox) < 9 + length:
                break
            kind, flags = self.inbox[3], self.inbox[4]
            stream = int.from_bytes(self.inbox[5:9], "big") & 0x7FFFFFFF
            payload = bytes(self.inbox[9 : 9 + length])
            del self.inbox[: 9 + length]
            self.on_frame(kind, flags, stream, payload)

    def on_frame(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        if kind == SETTINGS and not flags & ACK:
            for pos in range(0, len(payload), 6):
                key, value = struct.unpack(">HI", payload[pos : pos + 6])
                if key == INITIAL_WINDOW_SIZE:
                    for sid in self.windows:
                        self.windows[sid] += value - self.initial_window
                    self.initial_window = value
                elif key == MAX_FRAME_SIZE:
                    self.chunk = min(value, LARGEST_CHUNK)
            self.sock.sendall(frame(SETTINGS, ACK, 0))
        elif kind == PING and not flags & ACK:
            self.sock.sendall(frame(PING, ACK, 0, payload))
        elif kind == WINDOW_UPDATE:
            increment = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
            if stream == 0:
                self.conn_window += increment
            elif stream in self.windows:
                self.windows[stream] += increment
        elif kind == DATA:
            self.received[stream] = self.received.get(stream, 0) + len(payload)
            if flags & END_STREAM:
                self.ended(stream)
        elif (kind == HEADERS and flags & END_STREAM) or kind == RST_STREAM:
            self.windows.pop(stream, None)
            self.ended(stream)
        elif kind == GOAWAY:
            print(json.dumps({"goaway": True}), flush=True)

    def ended(self, stream: int) -> None:
        print(json.dumps({"ended": stream, "data": self.received.get(stream, 0)}), flush=True)

    def open(self, stream: int, path: str) -> None:
        fields = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", self.authority),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]
        if self.timeout:
            fields.append(("grpc-timeout", self.timeout))
        headers = b"".join(hpack_literal(name, value) for name, value in fields)
        self.windows[stream] = self.initial_window
        self.sock.sendall(frame(HEADERS, END_HEADERS, stream, headers))

    def send(self, bodies: dict[int, bytes]) -> None:
        """Sends each stream's body, round robin, as the windows allow."""
        sent = dict.fromkeys(bodies, 0)
        while sent:
            moved = False
            for stream, at in list(sent.items()):
                body = bodies[stream]
                if stream not in self.windows:  # the server ended it: nothing more to send
                    del sent[stream]
                    continue
                room = min(self.chunk, self.conn_window, self.windows[stream], len(body) - at)
                if room <= 0:
                    continue
                last = at + room == len(body)
                self.sock.sendall(
                    frame(DATA, END_STREAM if last else 0, stream, body[at : at + room])
                )
                self.conn_window -= room
                self.windows[stream] -= room
                moved = True
                if last:
                    del sent[stream]
                else:
                    sent[stream] = at + room
            self.pump(0 if moved else 1.0)  # no room: wait for the server's WINDOW_UPDATE


def main(argv: list[str]) -> int:
    address, path, request_file, count = argv[1], argv[2], argv[3], int(argv[4])
    with open(request_file, "rb") as f:
        message = f.read()
    connection = Connection(address)
    if "--timeout" in argv:
        connection.timeout = argv[argv.index("--timeout") + 1]
    body = b"\x00" + struct.pack(">I", len(message)) + message
    streams = [1 + 2 * k for k in range(count)]
    if "--at-once" in argv:
        for stream in streams:
            connection.open(stream, path)
        connection.send(dict.fromkeys(streams, body))
    else:
        for stream in streams:
            connection.open(stream, path)
            connection.send({stream: body})
    print(json.dumps({"sent": count}), flush=True)
    while True:
        connection.pump(3600.0)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
