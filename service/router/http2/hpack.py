"""HPACK (RFC 7541): the decoder of a connection's request header blocks, a
stateless encoder, and the encoder of one connection's replies, whose
dynamic table makes a repeated field one byte.

Names and values are raw bytes, in block order. Every malformed block raises
``HpackError`` (HTTP/2's COMPRESSION_ERROR, which ends the connection): a
truncated integer or string, an integer over 2**31 - 1, index 0, an index
past the tables, a table size update over our advertised limit or after a
field, bad Huffman padding or EOS.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from .huffman import HpackError, huffman_decode
from .static_table import FIELD_INDEX, NAME_INDEX, STATIC_LENGTH, STATIC_TABLE

__all__ = ["Decoder", "Encoder", "Fields", "HeaderListTooLarge", "HpackError", "TableEncoder"]


class HeaderListTooLarge(HpackError):
    """A header list over the limit: the block was decoded whole (the table
    is in sync), so only its stream is refused, not the connection."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"header list size {size} over {limit}")
        self.size = size
        self.limit = limit


ENTRY_OVERHEAD = 32  # RFC 7541 4.1, and RFC 7540 6.5.2 per header field
_MAX_INTEGER = 2**31 - 1
_CACHE_ENTRIES = 256  # Huffman strings remembered per decoder
_CACHE_MAX_STRING = 256  # encoded length past which a string is not remembered


def decode_integer(block: bytes, pos: int, prefix_bits: int) -> tuple[int, int]:
    """The integer whose ``prefix_bits``-bit prefix is in ``block[pos]``
    (RFC 7541 5.1), and the position after it."""
    mask = (1 << prefix_bits) - 1
    value = block[pos] & mask
    pos += 1
    if value < mask:
        return value, pos
    shift = 0
    end = len(block)
    while True:
        if pos >= end:
            raise HpackError("truncated integer")
        byte = block[pos]
        pos += 1
        value += (byte & 0x7F) << shift
        if value > _MAX_INTEGER:
            raise HpackError("integer over 2**31 - 1")
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 28:  # more continuation bytes than 2**31 needs (zero-padded)
            raise HpackError("integer encoding too long")


def encode_integer(value: int, prefix_bits: int, first: int) -> bytearray:
    """``value`` with a ``prefix_bits``-bit prefix, ``first`` holding the
    first byte's other (high) bits."""
    mask = (1 << prefix_bits) - 1
    if value < mask:
        return bytearray((first | value,))
    out = bytearray((first | mask,))
    value -= mask
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return out


class Decoder:
    """One connection's HPACK decoder: its dynamic table lives across blocks,
    so every block of the connection goes through ``decode`` in order.

    ``max_table_size`` is the SETTINGS_HEADER_TABLE_SIZE we advertise: the
    peer's size updates may not exceed it. ``max_header_list_size`` bounds a
    decoded block (RFC 7540 6.5.2: name + value + 32 per field); a block over
    it raises HpackError only after the whole block was decoded, so that its
    insertions still reach the dynamic table and the connection's later
    blocks decode right (a caller may answer that stream alone, e.g. with
    RST_STREAM or a 431, instead of ending the connection).
    """

    def __init__(self, max_table_size: int = 4096, max_header_list_size: int = 65536) -> None:
        self.max_table_size = max_table_size
        self.max_header_list_size = max_header_list_size
        self._table_limit = max_table_size  # the peer's latest size update
        self._table: deque[tuple[bytes, bytes]] = deque()  # newest first
        self._table_size = 0
        self._huffman_cache: dict[bytes, bytes] = {}

    @property
    def table_size(self) -> int:
        """The dynamic table's size (RFC 7541 4.1)."""
        return self._table_size

    @property
    def table(self) -> list[tuple[bytes, bytes]]:
        """The dynamic table's entries, newest first (index 62 onwards)."""
        return list(self._table)

    def decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        """The header fields of one complete header block (HEADERS plus its
        CONTINUATIONs), in order."""
        fields: list[tuple[bytes, bytes]] = []
        list_size = 0
        over_limit = False
        pos = 0
        end = len(block)
        size_update_allowed = True
        table = self._table
        while pos < end:
            byte = block[pos]
            if byte & 0x80:  # indexed field (6.1)
                if byte != 0xFF:  # a one-byte index, the common case: inline
                    index = byte - 0x80
                    pos += 1
                else:
                    index, pos = decode_integer(block, pos, 7)
                if 0 < index <= STATIC_LENGTH:
                    field = STATIC_TABLE[index - 1]
                elif STATIC_LENGTH < index <= STATIC_LENGTH + len(table):
                    field = table[index - STATIC_LENGTH - 1]
                else:
                    field = self._field(index)  # raises
            elif byte & 0xE0 == 0x20:  # dynamic table size update (6.3)
                if not size_update_allowed:
                    raise HpackError("dynamic table size update after a header field")
                size, pos = decode_integer(block, pos, 5)
                if size > self.max_table_size:
                    raise HpackError(f"table size update {size} over {self.max_table_size}")
                self._table_limit = size
                self._evict(size)
                continue
            else:  # literal (6.2): incremental indexing, without, never indexed
                indexing = byte & 0xC0 == 0x40
                index, pos = decode_integer(block, pos, 6 if indexing else 4)
                if index:
                    name = self._field(index)[0]
                else:
                    name, pos = self._string(block, pos)
                value, pos = self._string(block, pos)
                field = (name, value)
                if indexing:
                    self._insert(field)
            size_update_allowed = False
            list_size += len(field[0]) + len(field[1]) + ENTRY_OVERHEAD
            if list_size > self.max_header_list_size:
                over_limit = True  # decode on: the table must see the block
            else:
                fields.append(field)
        if over_limit:
            raise HeaderListTooLarge(list_size, self.max_header_list_size)
        return fields

    def _field(self, index: int) -> tuple[bytes, bytes]:
        if index == 0:
            raise HpackError("index 0")
        if index <= STATIC_LENGTH:
            return STATIC_TABLE[index - 1]
        try:
            return self._table[index - STATIC_LENGTH - 1]
        except IndexError:
            raise HpackError(f"index {index} past the tables") from None

    def _string(self, block: bytes, pos: int) -> tuple[bytes, int]:
        if pos >= len(block):
            raise HpackError("truncated block: a string is missing")
        huffman = block[pos] & 0x80
        length, pos = decode_integer(block, pos, 7)
        stop = pos + length
        if stop > len(block):
            raise HpackError("truncated string")
        raw = bytes(block[pos:stop])  # bytes even from a bytearray (the cache's key)
        if not huffman:
            return raw, stop
        cache = self._huffman_cache
        decoded = cache.get(raw)
        if decoded is None:
            decoded = huffman_decode(raw)
            if length <= _CACHE_MAX_STRING:
                if len(cache) >= _CACHE_ENTRIES:
                    del cache[next(iter(cache))]  # the oldest
                cache[raw] = decoded
        return decoded, stop

    def _insert(self, field: tuple[bytes, bytes]) -> None:
        """Add ``field`` per 4.4: evict to make room; one larger than the
        whole table empties it and is not added."""
        size = len(field[0]) + len(field[1]) + ENTRY_OVERHEAD
        self._evict(self._table_limit - size)
        if size <= self._table_limit:
            self._table.appendleft(field)
            self._table_size += size

    def _evict(self, limit: int) -> None:
        """Drop the oldest entries until the table's size is at most ``limit``."""
        table = self._table
        while self._table_size > limit and table:
            name, value = table.pop()
            self._table_size -= len(name) + len(value) + ENTRY_OVERHEAD
        if not table:
            self._table_size = 0


class Encoder:
    """A stateless HPACK encoder: a field of the static table is one index;
    any other is a literal without indexing (the static table's name index
    when it has the name), raw strings (no Huffman), no dynamic table. So
    any decoder decodes our blocks whatever its table, and a block of
    constant headers can be encoded once and its bytes reused."""

    def encode(self, headers: Iterable[tuple[bytes, bytes]]) -> bytes:
        out = bytearray()
        for name, value in headers:
            index = FIELD_INDEX.get((name, value))
            if index is not None:
                out += encode_integer(index, 7, 0x80)
                continue
            _literal(out, name, value, 0x00, 4)
        return bytes(out)


Field = tuple[bytes, bytes]


class Fields(tuple[Field, ...]):
    """Fields made once and given again and again (a reply's constant ones):
    hashed and compared by identity, so finding their block costs no hashing
    of their bytes."""

    __slots__ = ()
    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        return self is other

    def __ne__(self, other: object) -> bool:
        return self is not other


class TableEncoder:
    """One connection's encoder for its replies, with a dynamic table (RFC 7541
    2.3.2): a field given as ``indexed`` goes in as a literal with incremental
    indexing the first time and is one index after; the others are literals
    without indexing (the static table's name index when it has the name).

    The table is at most the peer's SETTINGS_HEADER_TABLE_SIZE (and at most
    ``limit``): :meth:`resize` applies the peer's setting, and the next block
    begins with the dynamic table size update (6.3) -- the smallest size first
    when it fell and rose between two blocks (4.2). Every block must reach the
    peer, in the order encoded (its decoder's table follows ours). A block of
    indexed fields only is kept and reused while the table is unchanged, so
    ``indexed`` should be a few tuples made once (:class:`Fields`).
    """

    def __init__(self, limit: int = 4096) -> None:
        self._limit = limit  # the most we use, whatever the peer allows
        self._max = min(4096, limit)  # the table's maximum size (4096 until the peer says)
        self._entries: deque[Field] = deque()  # newest first
        self._numbers: dict[Field, int] = {}  # each entry's insertion number
        self._inserted = 0
        self._size = 0
        self._lowest: int | None = None  # size updates owed: the lowest since the last block
        self._blocks: dict[tuple[Field, ...], bytes] = {}

    @property
    def table(self) -> list[Field]:
        """The dynamic table's entries, newest first (index 62 onwards)."""
        return list(self._entries)

    @property
    def max_size(self) -> int:
        return self._max

    def resize(self, peer_size: int) -> None:
        """The peer's SETTINGS_HEADER_TABLE_SIZE."""
        size = min(peer_size, self._limit)
        if size == self._max and self._lowest is None:
            return
        self._lowest = size if self._lowest is None else min(self._lowest, size)
        self._max = size
        self._evict(size)
        self._blocks.clear()

    def encode(self, indexed: tuple[Field, ...], literal: Sequence[Field] = ()) -> bytes:
        """The block of ``indexed`` (into the table) then ``literal`` fields."""
        head = self._blocks.get(indexed) if self._lowest is None else None
        if head is None:
            head = self._encode_indexed(indexed)
        if not literal:
            return head
        out = bytearray(head)
        for name, value in literal:
            _literal(out, name, value, 0x00, 4)
        return bytes(out)

    def _encode_indexed(self, indexed: tuple[Field, ...]) -> bytes:
        out = bytearray()
        changed = self._lowest is not None  # (a block with size updates is not kept)
        if self._lowest is not None:
            out += encode_integer(self._lowest, 5, 0x20)
            if self._max != self._lowest:
                out += encode_integer(self._max, 5, 0x20)
            self._lowest = None
        for field in indexed:
            index = FIELD_INDEX.get(field)
            if index is None:
                number = self._numbers.get(field)
                if number is not None:
                    index = STATIC_LENGTH + 1 + self._inserted - number
            if index is not None:
                out += encode_integer(index, 7, 0x80)
                continue
            size = len(field[0]) + len(field[1]) + ENTRY_OVERHEAD
            if size > self._max:  # it would empty the table: not indexed
                _literal(out, field[0], field[1], 0x00, 4)
                continue
            _literal(out, field[0], field[1], 0x40, 6)
            self._evict(self._max - size)
            self._entries.appendleft(field)
            self._inserted += 1
            self._numbers[field] = self._inserted
            self._size += size
            changed = True
        block = bytes(out)
        if changed:
            self._blocks.clear()
        else:
            self._blocks[indexed] = block
        return block

    def _evict(self, limit: int) -> None:
        while self._size > limit and self._entries:
            field = self._entries.pop()
            del self._numbers[field]
            self._size -= len(field[0]) + len(field[1]) + ENTRY_OVERHEAD
            self._blocks.clear()


def _literal(out: bytearray, name: bytes, value: bytes, first: int, prefix_bits: int) -> None:
    """A literal field (6.2): ``first`` 0x40 with incremental indexing (6-bit
    name index), 0x00 without (4-bit); raw strings."""
    name_index = NAME_INDEX.get(name, 0)
    out += encode_integer(name_index, prefix_bits, first)
    if not name_index:
        out += encode_integer(len(name), 7, 0x00)
        out += name
    out += encode_integer(len(value), 7, 0x00)
    out += value
