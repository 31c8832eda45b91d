"""Tensor bytes of a ModelInferRequest/Response without copies (issue 20).

protobuf copies a ``bytes`` field twice on its way to numpy (parsing copies
the message into its arena, reading a repeated bytes entry copies it out
again) and twice on the way back (appending copies in, serializing copies
out). The tensors are most of a large request, so a worker handles the raw
contents itself and lets protobuf parse and write only the rest:

- :func:`split_raw_inputs` walks the top level of a serialized request and
  returns the request without its ``raw_input_contents`` (field 7; a few
  hundred bytes for protobuf to parse) and each raw entry as a view of the
  request's own bytes;
- :func:`raw_output_parts` writes each raw output as the field's tag and
  length then the array's own memory (a view of a C-contiguous array, no
  ``tobytes``), to follow the serialized response without any field 6 of its
  own: protobuf reads fields in any order, and field 6 after fields 1 to 5 is
  the order it writes itself.
"""

from __future__ import annotations

from collections.abc import Sequence

from poolserve.service.contract.errors import InvalidInput
from poolserve.service.contract.wire import encode_varint, read_varint

RAW_INPUT_CONTENTS = 7  # ModelInferRequest.raw_input_contents
RAW_OUTPUT_CONTENTS = 6  # ModelInferResponse.raw_output_contents
_LEN = 2
_RAW_INPUT_TAG = (RAW_INPUT_CONTENTS << 3) | _LEN

Buffer = bytes | bytearray | memoryview


def split_raw_inputs(data: Buffer) -> tuple[bytes, list[memoryview]]:
    """(the request without raw_input_contents, each raw entry as a view of ``data``).

    Without raw entries the request comes back as it is (one copy only when
    it was not bytes already). Truncated or malformed bytes are InvalidInput,
    as protobuf's own parser would make them.
    """
    view = memoryview(data).toreadonly()
    raw: list[memoryview] = []
    kept: list[memoryview] = []
    pos, end, since = 0, len(view), 0
    while pos < end:
        field_start = pos
        key, pos = read_varint(view, pos)
        wire_type = key & 7
        if wire_type == 0:
            _, pos = read_varint(view, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == _LEN:
            size, pos = read_varint(view, pos)
            if key == _RAW_INPUT_TAG:
                if pos + size > end:
                    raise InvalidInput("request bytes are truncated (a field runs past the end)")
                kept.append(view[since:field_start])
                raw.append(view[pos : pos + size])
                since = pos + size
            pos += size
        else:
            raise InvalidInput(f"request bytes use unsupported wire type {wire_type}")
        if pos > end:
            raise InvalidInput("request bytes are truncated")
    if not raw:
        return (data if isinstance(data, bytes) else bytes(view)), raw
    kept.append(view[since:end])
    return b"".join(kept), raw


def raw_output_parts(views: Sequence[Buffer]) -> list[Buffer]:
    """``raw_output_contents`` entries as wire parts: (tag and length, bytes) each."""
    parts: list[Buffer] = []
    tag = encode_varint((RAW_OUTPUT_CONTENTS << 3) | _LEN)
    for view in views:
        parts.append(
            tag + encode_varint(len(view) if not isinstance(view, memoryview) else view.nbytes)
        )
        parts.append(view)
    return parts
