"""The Huffman code of HPACK (RFC 7541 Appendix B) and its two directions.

``CODES[sym]`` is ``(code, bit length)`` for the 256 byte values and EOS
(``CODES[256]``), the code aligned to its least significant bit, as the RFC's
table lists it. Decoding walks a table built once at import: one state per
inner node of the code's tree, four input bits per step (no code is shorter
than 5 bits, so a step emits at most one byte). RFC 7541 5.2: padding is at
most 7 bits, all ones (a prefix of EOS), and EOS itself is an error.
"""

from __future__ import annotations


class HpackError(Exception):
    """A malformed or over-limit header block: HTTP/2's COMPRESSION_ERROR
    (RFC 7540 4.3), which ends the connection."""


EOS = 256

# fmt: off
CODES: tuple[tuple[int, int], ...] = (
    (0x1ff8, 13), (0x7fffd8, 23), (0xfffffe2, 28), (0xfffffe3, 28),  # 0
    (0xfffffe4, 28), (0xfffffe5, 28), (0xfffffe6, 28), (0xfffffe7, 28),  # 4
    (0xfffffe8, 28), (0xffffea, 24), (0x3ffffffc, 30), (0xfffffe9, 28),  # 8
    (0xfffffea, 28), (0x3ffffffd, 30), (0xfffffeb, 28), (0xfffffec, 28),  # 12
    (0xfffffed, 28), (0xfffffee, 28), (0xfffffef, 28), (0xffffff0, 28),  # 16
    (0xffffff1, 28), (0xffffff2, 28), (0x3ffffffe, 30), (0xffffff3, 28),  # 20
    (0xffffff4, 28), (0xffffff5, 28), (0xffffff6, 28), (0xffffff7, 28),  # 24
    (0xffffff8, 28), (0xffffff9, 28), (0xffffffa, 28), (0xffffffb, 28),  # 28
    (0x14, 6), (0x3f8, 10), (0x3f9, 10), (0xffa, 12),  # 32
    (0x1ff9, 13), (0x15, 6), (0xf8, 8), (0x7fa, 11),  # 36
    (0x3fa, 10), (0x3fb, 10), (0xf9, 8), (0x7fb, 11),  # 40
    (0xfa, 8), (0x16, 6), (0x17, 6), (0x18, 6),  # 44
    (0x0, 5), (0x1, 5), (0x2, 5), (0x19, 6),  # 48
    (0x1a, 6), (0x1b, 6), (0x1c, 6), (0x1d, 6),  # 52
    (0x1e, 6), (0x1f, 6), (0x5c, 7), (0xfb, 8),  # 56
    (0x7ffc, 15), (0x20, 6), (0xffb, 12), (0x3fc, 10),  # 60
    (0x1ffa, 13), (0x21, 6), (0x5d, 7), (0x5e, 7),  # 64
    (0x5f, 7), (0x60, 7), (0x61, 7), (0x62, 7),  # 68
    (0x63, 7), (0x64, 7), (0x65, 7), (0x66, 7),  # 72
    (0x67, 7), (0x68, 7), (0x69, 7), (0x6a, 7),  # 76
    (0x6b, 7), (0x6c, 7), (0x6d, 7), (0x6e, 7),  # 80
    (0x6f, 7), (0x70, 7), (0x71, 7), (0x72, 7),  # 84
    (0xfc, 8), (0x73, 7), (0xfd, 8), (0x1ffb, 13),  # 88
    (0x7fff0, 19), (0x1ffc, 13), (0x3ffc, 14), (0x22, 6),  # 92
    (0x7ffd, 15), (0x3, 5), (0x23, 6), (0x4, 5),  # 96
    (0x24, 6), (0x5, 5), (0x25, 6), (0x26, 6),  # 100
    (0x27, 6), (0x6, 5), (0x74, 7), (0x75, 7),  # 104
    (0x28, 6), (0x29, 6), (0x2a, 6), (0x7, 5),  # 108
    (0x2b, 6), (0x76, 7), (0x2c, 6), (0x8, 5),  # 112
    (0x9, 5), (0x2d, 6), (0x77, 7), (0x78, 7),  # 116
    (0x79, 7), (0x7a, 7), (0x7b, 7), (0x7ffe, 15),  # 120
    (0x7fc, 11), (0x3ffd, 14), (0x1ffd, 13), (0xffffffc, 28),  # 124
    (0xfffe6, 20), (0x3fffd2, 22), (0xfffe7, 20), (0xfffe8, 20),  # 128
    (0x3fffd3, 22), (0x3fffd4, 22), (0x3fffd5, 22), (0x7fffd9, 23),  # 132
    (0x3fffd6, 22), (0x7fffda, 23), (0x7fffdb, 23), (0x7fffdc, 23),  # 136
    (0x7fffdd, 23), (0x7fffde, 23), (0xffffeb, 24), (0x7fffdf, 23),  # 140
    (0xffffec, 24), (0xffffed, 24), (0x3fffd7, 22), (0x7fffe0, 23),  # 144
    (0xffffee, 24), (0x7fffe1, 23), (0x7fffe2, 23), (0x7fffe3, 23),  # 148
    (0x7fffe4, 23), (0x1fffdc, 21), (0x3fffd8, 22), (0x7fffe5, 23),  # 152
    (0x3fffd9, 22), (0x7fffe6, 23), (0x7fffe7, 23), (0xffffef, 24),  # 156
    (0x3fffda, 22), (0x1fffdd, 21), (0xfffe9, 20), (0x3fffdb, 22),  # 160
    (0x3fffdc, 22), (0x7fffe8, 23), (0x7fffe9, 23), (0x1fffde, 21),  # 164
    (0x7fffea, 23), (0x3fffdd, 22), (0x3fffde, 22), (0xfffff0, 24),  # 168
    (0x1fffdf, 21), (0x3fffdf, 22), (0x7fffeb, 23), (0x7fffec, 23),  # 172
    (0x1fffe0, 21), (0x1fffe1, 21), (0x3fffe0, 22), (0x1fffe2, 21),  # 176
    (0x7fffed, 23), (0x3fffe1, 22), (0x7fffee, 23), (0x7fffef, 23),  # 180
    (0xfffea, 20), (0x3fffe2, 22), (0x3fffe3, 22), (0x3fffe4, 22),  # 184
    (0x7ffff0, 23), (0x3fffe5, 22), (0x3fffe6, 22), (0x7ffff1, 23),  # 188
    (0x3ffffe0, 26), (0x3ffffe1, 26), (0xfffeb, 20), (0x7fff1, 19),  # 192
    (0x3fffe7, 22), (0x7ffff2, 23), (0x3fffe8, 22), (0x1ffffec, 25),  # 196
    (0x3ffffe2, 26), (0x3ffffe3, 26), (0x3ffffe4, 26), (0x7ffffde, 27),  # 200
    (0x7ffffdf, 27), (0x3ffffe5, 26), (0xfffff1, 24), (0x1ffffed, 25),  # 204
    (0x7fff2, 19), (0x1fffe3, 21), (0x3ffffe6, 26), (0x7ffffe0, 27),  # 208
    (0x7ffffe1, 27), (0x3ffffe7, 26), (0x7ffffe2, 27), (0xfffff2, 24),  # 212
    (0x1fffe4, 21), (0x1fffe5, 21), (0x3ffffe8, 26), (0x3ffffe9, 26),  # 216
    (0xffffffd, 28), (0x7ffffe3, 27), (0x7ffffe4, 27), (0x7ffffe5, 27),  # 220
    (0xfffec, 20), (0xfffff3, 24), (0xfffed, 20), (0x1fffe6, 21),  # 224
    (0x3fffe9, 22), (0x1fffe7, 21), (0x1fffe8, 21), (0x7ffff3, 23),  # 228
    (0x3fffea, 22), (0x3fffeb, 22), (0x1ffffee, 25), (0x1ffffef, 25),  # 232
    (0xfffff4, 24), (0xfffff5, 24), (0x3ffffea, 26), (0x7ffff4, 23),  # 236
    (0x3ffffeb, 26), (0x7ffffe6, 27), (0x3ffffec, 26), (0x3ffffed, 26),  # 240
    (0x7ffffe7, 27), (0x7ffffe8, 27), (0x7ffffe9, 27), (0x7ffffea, 27),  # 244
    (0x7ffffeb, 27), (0xffffffe, 28), (0x7ffffec, 27), (0x7ffffed, 27),  # 248
    (0x7ffffee, 27), (0x7ffffef, 27), (0x7fffff0, 27), (0x3ffffee, 26),  # 252
    (0x3fffffff, 30),  # 256: EOS

)
# fmt: on

_NIBBLE = 4
_ROOT = 0
_NONE = -1


def _build_tree() -> tuple[list[list[int]], list[int]]:
    """The code's tree: ``children[node] = [zero, one]`` where a child >= 0 is
    an inner node and ``-1 - sym`` a leaf; ``depth_if_ones[node]`` is the
    node's depth when its path is all ones (a padding prefix), else -1."""
    children: list[list[int]] = [[0, 0]]
    filled: list[list[bool]] = [[False, False]]
    for sym, (code, length) in enumerate(CODES):
        node = _ROOT
        for shift in range(length - 1, 0, -1):
            bit = (code >> shift) & 1
            if not filled[node][bit]:
                children.append([0, 0])
                filled.append([False, False])
                children[node][bit] = len(children) - 1
                filled[node][bit] = True
            node = children[node][bit]
        children[node][code & 1] = -1 - sym
        filled[node][code & 1] = True
    depth_if_ones = [-1] * len(children)
    node, depth = _ROOT, 0
    while node >= 0:
        depth_if_ones[node] = depth
        node, depth = children[node][1], depth + 1
    return children, depth_if_ones


def _build_steps(children: list[list[int]]) -> list[tuple[int, int]]:
    """``steps[state << 4 | nibble] = (next state, byte emitted or -1)``;
    a nibble that reaches EOS emits ``EOS``."""
    steps: list[tuple[int, int]] = []
    for state in range(len(children)):
        for nibble in range(1 << _NIBBLE):
            node, emitted = state, _NONE
            for shift in range(_NIBBLE - 1, -1, -1):
                child = children[node][(nibble >> shift) & 1]
                if child >= 0:
                    node = child
                    continue
                emitted = -1 - child
                node = _ROOT
                if emitted == EOS:
                    break
            steps.append((node, emitted))
    return steps


_CHILDREN, _PADDING_DEPTH = _build_tree()
_STEPS = _build_steps(_CHILDREN)


def huffman_decode(data: bytes) -> bytes:
    """The bytes ``data`` encodes; HpackError on EOS or bad padding."""
    steps = _STEPS
    out = bytearray()
    state = _ROOT
    for byte in data:
        state, emitted = steps[state << 4 | byte >> 4]
        if emitted >= 0:
            if emitted == EOS:
                raise HpackError("Huffman string contains EOS")
            out.append(emitted)
        state, emitted = steps[state << 4 | (byte & 0xF)]
        if emitted >= 0:
            if emitted == EOS:
                raise HpackError("Huffman string contains EOS")
            out.append(emitted)
    if state != _ROOT and not 0 < _PADDING_DEPTH[state] <= 7:
        raise HpackError("Huffman padding is longer than 7 bits or not all ones")
    return bytes(out)


def huffman_encode(data: bytes) -> bytes:
    """``data`` in the Huffman code, padded to a byte with ones (EOS's prefix)."""
    codes = CODES
    out = bytearray()
    acc = 0
    bits = 0
    for byte in data:
        code, length = codes[byte]
        acc = acc << length | code
        bits += length
        while bits >= 8:
            bits -= 8
            out.append(acc >> bits & 0xFF)
        acc &= (1 << bits) - 1
    if bits:
        out.append((acc << (8 - bits) | (0xFF >> bits)) & 0xFF)
    return bytes(out)
