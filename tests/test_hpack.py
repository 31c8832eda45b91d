"""The router's HPACK codec (service/router/http2): RFC 7541 Appendix C's
examples, the Huffman code both ways, every malformed input it must refuse,
the header-list-size limit, and our encoders (the stateless one, and the
replies' one with a dynamic table the peer's size bounds) read back by our
Decoder."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from poolserve.service.router.http2.hpack import (
    Decoder,
    Encoder,
    HpackError,
    TableEncoder,
    encode_integer,
)
from poolserve.service.router.http2.huffman import CODES, huffman_decode, huffman_encode


def unhex(text: str) -> bytes:
    return bytes.fromhex(text.replace(" ", "").replace("\n", ""))


def fields(*pairs: str) -> list[tuple[bytes, bytes]]:
    """``"name: value"`` lines (the RFC's header lists) as byte pairs."""
    out = []
    for pair in pairs:
        name, _, value = pair[1:].partition(": ")
        out.append(((pair[0] + name).encode(), value.encode()))
    return out


# C.2: one literal field each, from a fresh decoder.
C2 = [
    (
        "400a 6375 7374 6f6d 2d6b 6579 0d63 7573 746f 6d2d 6865 6164 6572",
        fields("custom-key: custom-header"),
        55,
    ),
    ("040c 2f73 616d 706c 652f 7061 7468", fields(":path: /sample/path"), 0),
    ("1008 7061 7373 776f 7264 0673 6563 7265 74", fields("password: secret"), 0),
    ("82", fields(":method: GET"), 0),
]

REQUEST_1 = fields(":method: GET", ":scheme: http", ":path: /", ":authority: www.example.com")
REQUEST_2 = [*REQUEST_1, *fields("cache-control: no-cache")]
REQUEST_3 = fields(
    ":method: GET",
    ":scheme: https",
    ":path: /index.html",
    ":authority: www.example.com",
    "custom-key: custom-value",
)
# C.3 (raw strings) and C.4 (Huffman): three requests on one connection.
C3 = [
    ("8286 8441 0f77 7777 2e65 7861 6d70 6c65 2e63 6f6d", REQUEST_1, 57),
    ("8286 84be 5808 6e6f 2d63 6163 6865", REQUEST_2, 110),
    (
        "8287 85bf 400a 6375 7374 6f6d 2d6b 6579 0c63 7573 746f 6d2d 7661 6c75 65",
        REQUEST_3,
        164,
    ),
]
C4 = [
    ("8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff", REQUEST_1, 57),
    ("8286 84be 5886 a8eb 1064 9cbf", REQUEST_2, 110),
    ("8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf", REQUEST_3, 164),
]

RESPONSE_1 = fields(
    ":status: 302",
    "cache-control: private",
    "date: Mon, 21 Oct 2013 20:13:21 GMT",
    "location: https://www.example.com",
)
RESPONSE_2 = [*fields(":status: 307"), *RESPONSE_1[1:]]
RESPONSE_3 = fields(
    ":status: 200",
    "cache-control: private",
    "date: Mon, 21 Oct 2013 20:13:22 GMT",
    "location: https://www.example.com",
    "content-encoding: gzip",
    "set-cookie: foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1",
)
TABLE_1 = [RESPONSE_1[3], RESPONSE_1[2], RESPONSE_1[1], RESPONSE_1[0]]
TABLE_2 = [RESPONSE_2[0], RESPONSE_1[3], RESPONSE_1[2], RESPONSE_1[1]]
TABLE_3 = [RESPONSE_3[5], RESPONSE_3[4], RESPONSE_3[2]]
# C.5 (raw strings) and C.6 (Huffman): three responses, a 256-byte table, evictions.
C5 = [
    (
        """4803 3330 3258 0770 7269 7661 7465 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 3133
        2032 303a 3133 3a32 3120 474d 546e 1768 7474 7073 3a2f 2f77 7777 2e65 7861 6d70
        6c65 2e63 6f6d""",
        RESPONSE_1,
        TABLE_1,
        222,
    ),
    ("4803 3330 37c1 c0bf", RESPONSE_2, TABLE_2, 222),
    (
        """88c1 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 3133 2032 303a 3133 3a32 3220 474d
        54c0 5a04 677a 6970 7738 666f 6f3d 4153 444a 4b48 514b 425a 584f 5157 454f 5049
        5541 5851 5745 4f49 553b 206d 6178 2d61 6765 3d33 3630 303b 2076 6572 7369 6f6e
        3d31""",
        RESPONSE_3,
        TABLE_3,
        215,
    ),
]
C6 = [
    (
        """4882 6402 5885 aec3 771a 4b61 96d0 7abe 9410 54d4 44a8 2005 9504 0b81 66e0 82a6
        2d1b ff6e 919d 29ad 1718 63c7 8f0b 97c8 e9ae 82ae 43d3""",
        RESPONSE_1,
        TABLE_1,
        222,
    ),
    ("4883 640e ffc1 c0bf", RESPONSE_2, TABLE_2, 222),
    (
        """88c1 6196 d07a be94 1054 d444 a820 0595 040b 8166 e084 a62d 1bff c05a 839b d9ab
        77ad 94e7 821d d7f2 e6c7 b335 dfdf cd5b 3960 d5af 2708 7f36 72c1 ab27 0fb5 291f
        9587 3160 65c0 03ed 4ee5 b106 3d50 07""",
        RESPONSE_3,
        TABLE_3,
        215,
    ),
]


@pytest.mark.parametrize(("block", "expected", "table_size"), C2)
def test_c2_single_literals(block: str, expected: list[tuple[bytes, bytes]], table_size: int):
    decoder = Decoder()
    assert decoder.decode(unhex(block)) == expected
    assert decoder.table_size == table_size
    assert decoder.table == (expected if table_size else [])


@pytest.mark.parametrize("examples", [C3, C4], ids=["C.3 raw", "C.4 Huffman"])
def test_requests_share_one_decoder(examples: list[tuple[str, list[tuple[bytes, bytes]], int]]):
    decoder = Decoder()
    for block, expected, table_size in examples:
        assert decoder.decode(unhex(block)) == expected
        assert decoder.table_size == table_size
    assert decoder.table == fields(
        "custom-key: custom-value", "cache-control: no-cache", ":authority: www.example.com"
    )


@pytest.mark.parametrize("examples", [C5, C6], ids=["C.5 raw", "C.6 Huffman"])
def test_responses_evict_from_a_256_byte_table(examples):
    decoder = Decoder(max_table_size=256)
    for block, expected, table, table_size in examples:
        assert decoder.decode(unhex(block)) == expected
        assert decoder.table == table
        assert decoder.table_size == table_size


def test_huffman_code_is_the_rfcs():
    """Spot checks against RFC 7541 Appendix B, and a complete prefix code."""
    assert len(CODES) == 257
    assert CODES[0] == (0x1FF8, 13)
    assert CODES[ord("0")] == (0x0, 5)
    assert CODES[ord("t")] == (0x9, 5)
    assert CODES[255] == (0x3FFFFEE, 26)
    assert CODES[256] == (0x3FFFFFFF, 30)
    assert sum(2 ** (30 - length) for _, length in CODES) == 2**30  # Kraft: complete


def test_huffman_round_trips_every_byte_value():
    for value in range(256):
        assert huffman_decode(huffman_encode(bytes([value]))) == bytes([value])
    everything = bytes(range(256)) * 3
    assert huffman_decode(huffman_encode(everything)) == everything
    assert huffman_encode(b"www.example.com") == unhex("f1e3 c2e5 f23a 6ba0 ab90 f4ff")


@given(st.binary(max_size=300))
def test_huffman_round_trips_random_strings(data: bytes):
    assert huffman_decode(huffman_encode(data)) == data


@pytest.mark.parametrize(
    "data",
    [
        # 'a' is 00011 (5 bits): then 3 bits of zero padding (not all ones)
        bytes([0b00011000]),
        # 'a' then 11 bits of ones: padding longer than 7 bits
        bytes([0b00011111, 0xFF]),
        # a whole byte of ones and nothing else: 8 bits of padding
        b"\xff",
        # EOS (30 ones) then 2 bits of padding
        b"\xff\xff\xff\xff",
        # 'a', then EOS inside the string, then 'a' again
        bytes.fromhex("1fffffffff18"),
    ],
    ids=["zero padding", "padding over 7 bits", "one byte of ones", "EOS", "EOS inside"],
)
def test_huffman_refuses_bad_padding_and_eos(data: bytes):
    with pytest.raises(HpackError):
        huffman_decode(data)


def test_huffman_accepts_short_ones_padding():
    assert huffman_decode(bytes([0b00011111])) == b"a"  # 3 bits of ones
    assert huffman_decode(b"") == b""


@pytest.mark.parametrize(
    ("block", "error"),
    [
        ("80", "index 0"),  # indexed field, index 0
        ("be", "past the tables"),  # index 62: the dynamic table is empty
        ("ff80 01", "past the tables"),  # index 255, past both tables (7-bit prefix + continuation)
        ("7f", "truncated integer"),  # literal with indexing, name index: truncated integer
        ("ff ff ff ff ff ff 0f", "over 2"),  # an integer over 2**31
        ("ff 80 80 80 80 80 80 00", "too long"),  # zero continuation bytes past what 2**31 needs
        ("40", "string is missing"),  # literal new name: its string is missing
        ("40 05 61 62", "truncated string"),  # name string shorter than its length
        ("40 01 61 03 62", "truncated string"),  # value string shorter than its length
        ("44 8a ff", "truncated string"),  # Huffman value string truncated
        ("41 81 ff", "padding"),  # Huffman value of 8 one bits: padding over 7 bits
        ("41 84 ff ff ff ff", "EOS"),  # Huffman value holding EOS
        ("3fe2 1f", "over 4096"),  # table size update to 4097, over our 4096
        ("82 20", "after a header field"),  # table size update after a field
        (
            "0f",
            "truncated integer",
        ),  # literal without indexing: a full 4-bit prefix, its continuation missing
    ],
)
def test_malformed_blocks_raise_hpack_error(block: str, error: str):
    with pytest.raises(HpackError, match=error):
        Decoder().decode(unhex(block))


def test_table_size_updates_at_the_start_evict_and_bound_the_table():
    decoder = Decoder()
    decoder.decode(unhex("400a 6375 7374 6f6d 2d6b 6579 0d63 7573 746f 6d2d 6865 6164 6572"))
    assert decoder.table_size == 55
    assert decoder.decode(unhex("20 3fe1 1f 82")) == fields(":method: GET")  # to 0, then 4096
    assert decoder.table == []
    with pytest.raises(HpackError):
        decoder.decode(unhex("be"))  # the entry was evicted by the update to 0
    decoder.decode(unhex("3f 15 40 01 61 01 62"))  # limit 36: no room for a 34-byte entry
    assert decoder.table == [(b"a", b"b")]
    assert Decoder(max_table_size=0).decode(unhex("20 82")) == fields(":method: GET")


def test_an_entry_larger_than_the_table_empties_it():
    decoder = Decoder(max_table_size=40)
    decoder.decode(unhex("40 01 61 01 62"))  # 34 bytes
    assert decoder.table == [(b"a", b"b")]
    decoder.decode(unhex("40 01 63 0a") + b"x" * 10)  # 43 bytes: over 40
    assert decoder.table == []
    assert decoder.table_size == 0


def test_literal_forms_index_only_with_incremental_indexing():
    decoder = Decoder()
    block = unhex("00 01 61 01 62  10 01 63 01 64  0f 2e 01 31")  # without, never, name idx 61
    assert decoder.decode(block) == [(b"a", b"b"), (b"c", b"d"), (b"www-authenticate", b"1")]
    assert decoder.table == []


def test_header_list_over_the_limit_raises_after_filling_the_table():
    decoder = Decoder(max_header_list_size=100)
    big = b"v" * 80
    block = unhex("40 01 6b") + bytes([len(big)]) + big + unhex("40 01 6c 01 6d")
    with pytest.raises(HpackError, match="header list size"):
        decoder.decode(block)
    assert decoder.table == [(b"l", b"m"), (b"k", big)]  # both insertions happened
    assert decoder.decode(unhex("be")) == [(b"l", b"m")]  # the next block sees them
    with pytest.raises(HpackError):
        decoder.decode(unhex("bf"))  # k: 80 bytes, over 100 with the 32 overhead


def test_huffman_strings_are_decoded_once_per_encoded_form():
    decoder = Decoder()
    block = unhex("0f2e 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff")  # www-authenticate, Huffman value
    first = decoder.decode(block)
    assert first == [(b"www-authenticate", b"www.example.com")]
    assert decoder.decode(block)[0][1] is first[0][1]  # the cached bytes object


def test_encoder_indexes_a_static_field():
    assert Encoder().encode([(b":status", b"200")]) == b"\x88"
    block = Encoder().encode([(b"content-type", b"application/grpc")])
    assert block[0] == 0x0F and block[1] == 31 - 15  # without indexing, name index 31


header_bytes = st.binary(max_size=200)
static_names = st.sampled_from([b":status", b":path", b"content-type", b"te", b"grpc-status"])


@given(st.lists(st.tuples(static_names | header_bytes, header_bytes), max_size=20))
def test_encoder_output_decodes_back(headers: list[tuple[bytes, bytes]]):
    decoder = Decoder(max_header_list_size=2**31)
    block = Encoder().encode(headers)
    assert decoder.decode(block) == headers
    assert decoder.table == []  # nothing indexed: a second decoder state is the same
    assert decoder.decode(block) == headers


def test_table_encoder_sends_a_field_once_then_one_index():
    encoder, decoder = TableEncoder(), Decoder()
    grpc_type = ((b":status", b"200"), (b"content-type", b"application/grpc"))
    first = encoder.encode(grpc_type, [(b"x-id", b"1")])
    assert first[:2] == b"\x88\x5f"  # static :status 200; with indexing, name index 31
    assert decoder.decode(first) == [*grpc_type, (b"x-id", b"1")]
    assert decoder.table == encoder.table == [(b"content-type", b"application/grpc")]
    again = encoder.encode(grpc_type, [(b"x-id", b"2")])
    assert again[:2] == b"\x88\xbe"  # the dynamic table's index 62
    assert decoder.decode(again) == [*grpc_type, (b"x-id", b"2")]
    assert decoder.table == encoder.table  # literals are not indexed
    assert encoder.encode(grpc_type) == b"\x88\xbe"


def test_table_encoder_signals_the_lowest_size_then_the_last():
    """RFC 7541 4.2: a size that fell and rose between two blocks is signalled
    at the next block's start, the smallest first; the table was evicted to it."""
    encoder, decoder = TableEncoder(), Decoder()
    field = ((b"grpc-status", b"0"),)
    decoder.decode(encoder.encode(field))
    assert decoder.table == [(b"grpc-status", b"0")]
    encoder.resize(0)
    encoder.resize(100)
    block = encoder.encode(field)
    assert block.startswith(encode_integer(0, 5, 0x20) + encode_integer(100, 5, 0x20))
    assert decoder.decode(block) == list(field)
    assert decoder.table == encoder.table == [(b"grpc-status", b"0")]  # in again
    encoder.resize(100)  # unchanged: nothing to signal
    assert encoder.encode(field) == b"\xbe"
    encoder.resize(1 << 20)  # more than we use: 4096
    assert encoder.encode(field) == encode_integer(4096, 5, 0x20) + b"\xbe"
    assert encoder.encode(field) == b"\xbe"  # signalled once
    assert encoder.max_size == 4096


def test_table_encoder_with_a_table_of_0_indexes_nothing():
    encoder, decoder = TableEncoder(), Decoder(max_table_size=0)
    encoder.resize(0)
    block = encoder.encode(((b"content-type", b"application/grpc"),))
    assert block[0] == 0x20 and decoder.decode(block) == [(b"content-type", b"application/grpc")]
    assert encoder.table == decoder.table == []
    assert decoder.decode(encoder.encode(((b"grpc-status", b"0"),))) == [(b"grpc-status", b"0")]


pool = st.sampled_from(
    [(b"content-type", b"application/grpc"), (b"grpc-status", b"0"), (b"grpc-status", b"13"),
     (b":status", b"200"), (b"x-big", b"v" * 300), (b"x-huge", b"w" * 5000), (b"a", b"")]
)  # fmt: skip
operation = st.one_of(
    st.tuples(st.just("encode"), st.lists(pool, max_size=6), st.lists(st.tuples(
        st.sampled_from([b"grpc-message", b"x-meta", b"content-type"]), header_bytes
    ), max_size=3)),
    st.tuples(st.just("resize"), st.integers(0, 5000), st.just([])),
)  # fmt: skip


@given(st.lists(operation, max_size=40))
def test_table_encoder_and_a_decoder_keep_the_same_table(operations):
    """Any sequence of blocks and size changes: each block decodes to its fields,
    the decoder's table is the encoder's, and within the size last signalled."""
    encoder = TableEncoder()
    decoder = Decoder(max_table_size=4096, max_header_list_size=2**31)
    for kind, first, second in operations:
        if kind == "resize":
            encoder.resize(first)
            continue
        block = encoder.encode(tuple(first), second)
        assert decoder.decode(block) == [*first, *second]
        assert decoder.table == encoder.table
        assert decoder.table_size <= encoder.max_size
