"""What makes a request's header or trailer section malformed (RFC 9113
8.1-8.3), for the router's gRPC door: a malformed request is a stream error
PROTOCOL_ERROR (8.1.1), its call never begins.

Checked: the pseudo-header fields (only ``:method``, ``:scheme``,
``:path`` and ``:authority``, each at most once, before every regular field,
the first three present but for CONNECT, 8.5, ``:path`` not empty; none in
trailers), the
minimal validity of names and values (8.2.1: no uppercase, control
characters, space, DEL or non-ASCII in a name, no colon past a pseudo-header's
first; no NUL, CR or LF in a value, none starting or ending with space or
tab), the connection-specific fields (8.2.2: ``connection``,
``proxy-connection``, ``keep-alive``, ``transfer-encoding``, ``upgrade``;
``te`` other than ``trailers``) and a ``content-length`` that is not a number
(the connection holds the DATA to the number, 8.1.1). A field already seen
valid on the connection is not checked again (``Validity``): a gRPC client's
fields come from its HPACK table, the same few each call.
"""

from __future__ import annotations

import re

__all__ = ["Malformed", "Validity"]

CONNECTION_SPECIFIC = frozenset(
    (b"connection", b"proxy-connection", b"keep-alive", b"transfer-encoding", b"upgrade")
)
_BAD_NAME = re.compile(rb"[\x00-\x20A-Z\x7f-\xff:]")
_BAD_VALUE = re.compile(rb"[\x00\r\n]|^[ \t]|[ \t]$")
KNOWN_MAX = 256  # valid fields remembered per connection


class Malformed(Exception):
    """A malformed request (RFC 9113 8.1.1): its stream is reset PROTOCOL_ERROR."""


def _field_error(name: bytes, value: bytes) -> str | None:
    """Why one field breaks RFC 9113 8.2.1 or 8.2.2, or None."""
    if not name or _BAD_NAME.search(name, 1 if name[0] == 0x3A else 0):
        return f"field name {name!r} is not a lowercase token"
    if _BAD_VALUE.search(value):
        return f"the value of {name!r} holds NUL, CR or LF, or starts or ends with a space"
    if name in CONNECTION_SPECIFIC:
        return f"connection-specific field {name!r}"
    if name == b"te" and value != b"trailers":
        return f"te: {value!r} (only 'trailers' is allowed)"
    if name == b"content-length" and not value.isdigit():
        return f"content-length {value!r} is not a number"
    return None


PSEUDO_BITS = {b":method": 1, b":scheme": 2, b":path": 4, b":authority": 8}
REQUIRED_BITS = 1 | 2 | 4
CONTENT_LENGTH = 16  # (a regular field, whose value the connection holds the DATA to)


class Validity:
    """One connection's checks of its request header and trailer sections."""

    __slots__ = ("_known",)

    def __init__(self) -> None:
        # fields found valid: 0 for a regular one, its bit for a pseudo-header
        self._known: dict[tuple[bytes, bytes], int] = {}

    def _learn(self, field: tuple[bytes, bytes]) -> int:
        """Checks a field not seen before; its bit (0: a regular field)."""
        name, value = field
        if name[:1] == b":":
            bit = PSEUDO_BITS.get(name)
            if bit is None:
                raise Malformed(f"{name!r} is not a request pseudo-header field")
            if name == b":path" and not value:
                raise Malformed("an empty :path")
        else:
            bit = CONTENT_LENGTH if name == b"content-length" else 0
        why = _field_error(name, value)
        if why is not None:
            raise Malformed(why)
        if len(self._known) < KNOWN_MAX and name != b"grpc-timeout":  # (new each call)
            self._known[field] = bit
        return bit

    def request(self, fields: list[tuple[bytes, bytes]]) -> int:
        """Checks a request's header section; its content-length (-1: none)."""
        known = self._known
        seen = 0
        regular = False
        length = -1
        for field in fields:
            bit = known.get(field)
            if bit is None:
                bit = self._learn(field)
            if not bit:
                regular = True
            elif bit == CONTENT_LENGTH:
                if length >= 0:
                    raise Malformed("content-length twice")
                regular = True
                length = int(field[1])
            elif regular:
                raise Malformed(f"pseudo-header field {field[0]!r} after a regular field")
            elif seen & bit:
                raise Malformed(f"pseudo-header field {field[0]!r} twice")
            else:
                seen |= bit
        if seen & REQUIRED_BITS != REQUIRED_BITS:
            if seen == 1 | 8 and (b":method", b"CONNECT") in fields:
                return length  # 8.5: CONNECT has :authority, no :scheme or :path
            missing = [n.decode() for n, b in PSEUDO_BITS.items() if b & REQUIRED_BITS & ~seen]
            raise Malformed(f"the request has no {', '.join(missing)}")
        return length

    def trailers(self, fields: list[tuple[bytes, bytes]]) -> None:
        """Checks a request's trailer section (8.1: no pseudo-header fields)."""
        known = self._known
        for field in fields:
            if field[0][:1] == b":":
                raise Malformed(f"pseudo-header field {field[0]!r} in trailers")
            if field not in known:
                self._learn(field)
