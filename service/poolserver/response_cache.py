"""Triton's response cache, in the pool server: a reply computed once for a
model whose settings ask for it (``parameters.extra.response_cache``) is kept,
and the same request again is answered from here, without a worker.

One cache per pool server process, shared by the pool's models, bounded in
bytes and in entries (the settings ``response_cache_bytes`` and
``response_cache_entries``), least recently used out first.

The key is a 128-bit BLAKE2b digest of the model's name and version and of
the request as it came, less what differs per call without changing the
answer: its ``id`` and the scheduling parameters ``priority``, ``timeout``
and ``idempotent``. Everything else is in it: the inputs (names, datatypes,
shapes, parameters, bytes), the requested outputs and their parameters, and
every other request parameter. A gRPC request is keyed by its wire bytes, a
REST body by its JSON document (written again with sorted keys, so
whitespace and key order do not matter) and its binary tensors' bytes; the
two doors' replies differ, so they never share an entry.

A reply is kept as its bytes around the ``id`` (a gRPC ModelInferResponse's
field 3, a REST reply's ``"id"`` member), and a hit puts the request's own
``id`` there, as Triton answers a hit with the request's id: the bytes are
those a computed reply would have. A reply is kept only when it has that
shape and echoes the request's id (a model that makes up its own ids is not
cached).

Never cached: errors; decoupled and sequence models (their answers are
streams or depend on state); requests that name shared-memory regions (the
inputs' bytes are not in the request, the outputs go to the region);
requests in a router slab (over 64 KiB: their bytes are not in the pool);
REST bodies that are compressed (Content-Encoding), are not the Open
Inference Protocol's V2 (KServe's V1, custom endpoints), have a JSON over
64 KiB or one with NaN or Infinity; a reply of more than 1/16 of
``response_cache_bytes``. A compressed REST reply (the client's
Accept-Encoding) is kept inflated and compressed again on a hit, as the
worker compresses it, so its bytes too are a computed reply's.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson

from poolserve.service.contract.errors import InvalidInput
from poolserve.service.contract.framing import Payload
from poolserve.service.contract.rest import IDENTITY, REPLY_HEAD, V2, deflate
from poolserve.service.contract.rest import unwrap as unwrap_rest
from poolserve.service.contract.shm import is_wrapped
from poolserve.service.contract.slab import is_enveloped
from poolserve.service.contract.wire import Routing, Wire, encode_varint, fields, read_varint
from poolserve.service.poolserver.catalog import ModelEntry

# What an entry costs beyond its bytes: its key, the entry and the LRU's node.
ENTRY_OVERHEAD = 256
# The largest share of the byte bound one reply may take.
MAX_ENTRY_SHARE = 16
# Request parameters that change per call and never the answer (poolserve's scheduling).
PER_CALL = frozenset((b"priority", b"timeout", b"idempotent"))
_PER_CALL_REST = frozenset(key.decode() for key in PER_CALL)
_ID_TAG = 0x1A  # field 3, length-delimited: ModelInferRequest.id and ModelInferResponse.id
_PARAMETERS_TAG = 0x22  # field 4: an entry of the parameters map
_NON_FINITE = re.compile(rb"NaN|Infinity")
_GRPC, _REST = 0, 1
# A reply as kept: before its id, after it, binary outputs, head flag, encoding.
_Parts = tuple[bytes, bytes, bytes, int, int]


@dataclass(slots=True)
class Probe:
    """One request's look at the cache: its key, its id, and the model's generation."""

    key: bytes
    ident: str
    kind: int  # _GRPC or _REST
    model: str
    generation: int


@dataclass(slots=True)
class _Entry:
    model: str
    kind: int
    before: bytes  # the reply up to its id (REST: the JSON up to it)
    after: bytes  # the reply after its id (REST: the JSON after it)
    tail: bytes  # REST: the binary outputs after the JSON
    binary: int  # REST: the reply head's flag (binary outputs follow)
    encoding: int  # REST: the reply's Content-Encoding (compressed again on a hit)
    size: int


class ResponseCache:
    """A pool server's response cache (see the module)."""

    def __init__(self, max_bytes: int, max_entries: int) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.max_entry = max_bytes // MAX_ENTRY_SHARE
        self.bytes = 0
        self.evictions = 0
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        # by model key (a version's own: name:version): bumped by each load
        self._generations: dict[str, int] = {}
        # by model key: its verdict, and the settings and declared policy it is for
        self._verdicts: dict[str, tuple[object, object, bool]] = {}

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0 and self.max_entries > 0

    @property
    def entries(self) -> int:
        return len(self._entries)

    def caches(self, entry: ModelEntry) -> bool:
        """Whether the model's replies are cached (its setting, and not a
        decoupled or sequence model, also as the loaded model declares itself)."""
        settings, declared = entry.settings, entry.declared
        known = self._verdicts.get(entry.key)
        if known is not None and known[0] is settings and known[1] is declared:
            return known[2]  # (on every request: read once per load)
        policy = entry.policy
        verdict = (
            settings is not None
            and self.enabled
            and settings.response_cache
            and settings.sequence is None
            and not policy.decoupled
            and policy.unary
        )
        self._verdicts[entry.key] = (settings, declared, verdict)
        return verdict

    def probe(self, entry: ModelEntry, request: Payload, routing: Routing) -> Probe | None:
        """The request's key, or None when it is not cached (see the module)."""
        if not self.caches(entry) or is_wrapped(request) or is_enveloped(request):
            return None
        digest = hashlib.blake2b(digest_size=16)
        digest.update(f"{entry.name}\0{entry.version}\0".encode())
        try:
            if routing.rest_view is not None:
                ident = _rest_key(digest, request, routing)
                kind = _REST
            else:
                ident = _grpc_key(digest, request)
                kind = _GRPC
        except (InvalidInput, UnicodeDecodeError):
            return None  # malformed: the worker says what is wrong
        if ident is None:
            return None
        return Probe(digest.digest(), ident, kind, entry.key, self._generations.get(entry.key, 0))

    def get(self, probe: Probe) -> bytes | None:
        """The reply for ``probe``'s request, with its id, or None (a miss)."""
        found = self._entries.get(probe.key)
        if found is None:
            return None
        self._entries.move_to_end(probe.key)
        ident = probe.ident.encode()
        if found.kind == _GRPC:
            field = b"" if not ident else b"%c%s%s" % (_ID_TAG, encode_varint(len(ident)), ident)
            return b"".join((found.before, field, found.after))
        member = b',"id":' + orjson.dumps(probe.ident) if ident else b""
        length = len(found.before) + len(member) + len(found.after)
        head = REPLY_HEAD.pack(length, found.encoding, found.binary)
        parts: list[bytes] = [found.before, member, found.after, found.tail]
        if found.encoding != IDENTITY:  # as the worker compresses it
            return head + deflate(list(parts), found.encoding)
        return b"".join((head, *parts))

    def put(self, probe: Probe, entry: ModelEntry, reply: Payload) -> None:
        """Keeps a computed reply (unless too large, of an older load, or not of
        the shape a hit can give the next request's id)."""
        if self._generations.get(probe.model, 0) != probe.generation:
            return  # computed by a model loaded before the current one
        size = len(reply) + len(probe.key) + ENTRY_OVERHEAD
        if size > self.max_entry:
            return
        data = bytes(reply)
        try:
            if probe.kind == _GRPC:
                kept = _split_grpc(data, probe.ident.encode())
            else:
                kept = _split_rest(data, probe.ident, entry)
        except (InvalidInput, IndexError, ValueError):
            kept = None  # not a reply of the shape a hit is made from: it goes as it is
        if kept is None:
            return
        old = self._entries.pop(probe.key, None)
        if old is not None:
            self.bytes -= old.size
        self._entries[probe.key] = _Entry(probe.model, probe.kind, *kept, size)
        self.bytes += size
        while self.bytes > self.max_bytes or len(self._entries) > self.max_entries:
            _, gone = self._entries.popitem(last=False)
            self.bytes -= gone.size
            self.evictions += 1

    def forget(self, model: str) -> None:
        """Drops a model's replies (it was loaded again, or unloaded); replies
        still being computed by its previous load are not kept either."""
        self._generations[model] = self._generations.get(model, 0) + 1
        for key in [k for k, e in self._entries.items() if e.model == model]:
            self.bytes -= self._entries.pop(key).size


def _grpc_key(digest: Any, data: Wire) -> str:
    """Hashes a ModelInferRequest's top-level fields but its id and its per-call
    parameters; returns its id (the last field 3, as protobuf reads it)."""
    view = memoryview(data)
    ident = b""
    for tag, start, value, end in fields(view):
        if tag == _ID_TAG:
            ident = bytes(view[value:end])
        elif tag != _PARAMETERS_TAG or _parameter_key(view, value, end) not in PER_CALL:
            digest.update(view[start:end])
    return ident.decode()


def _parameter_key(view: memoryview, pos: int, end: int) -> bytes:
    """The key of one ``map<string, InferParameter>`` entry whose value is one
    varint (bool, int64 or uint64: how the scheduling parameters are set);
    b"" for any other entry, which is then hashed whatever its key."""
    if pos >= end or view[pos] != 0x0A:
        return b""
    size, pos = read_varint(view, pos + 1)
    key, pos = bytes(view[pos : pos + size]), pos + size
    if pos >= end or view[pos] != 0x12:
        return b""
    size, pos = read_varint(view, pos + 1)
    if pos + size != end or size < 2 or view[pos] & 7 != 0 or view[pos] >> 3 not in (1, 2, 5):
        return b""
    _, after = read_varint(view, pos + 1)
    return key if after == end else b""


def _rest_key(digest: Any, data: Payload, routing: Routing) -> str | None:
    """Hashes a REST body's JSON document (sorted keys, no id, no per-call
    parameters) and its binary tensors; returns its id. None: not cached."""
    unwrapped = unwrap_rest(data)
    doc, text = routing.rest_doc, routing.rest_text
    if unwrapped is None or doc is None or text is None:
        return None
    rest, body = unwrapped
    if rest.protocol != V2 or rest.encoding != IDENTITY:
        return None
    if _NON_FINITE.search(text) is not None:
        return None  # NaN and the infinities: no JSON to write them back as
    ident = doc.get("id", "")
    if not isinstance(ident, str):
        return None
    kept = {k: v for k, v in doc.items() if k != "id"}
    params = kept.get("parameters")
    if isinstance(params, dict):
        kept["parameters"] = {k: v for k, v in params.items() if k not in _PER_CALL_REST}
        if not kept["parameters"]:
            del kept["parameters"]  # none left: as a body without parameters
    try:
        canonical = orjson.dumps(kept, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        return None
    digest.update(b"rest\0%d\0%d\0" % (rest.accept, len(canonical)))  # its reply's encoding
    digest.update(canonical)
    length = rest.header_length
    if length is not None:
        digest.update(memoryview(body)[length:])
    return ident


def _split_grpc(reply: bytes, ident: bytes) -> _Parts | None:
    """A ModelInferResponse's bytes before and after its id (field 3, right
    after fields 1 and 2, as protobuf writes them), when its id is ``ident``."""
    pos, end = 0, len(reply)
    while pos < end and reply[pos] in (0x0A, 0x12):  # model_name, model_version
        size, after = read_varint(reply, pos + 1)
        pos = after + size
    if pos > end:
        return None
    if pos < end and reply[pos] == _ID_TAG:
        size, start = read_varint(reply, pos + 1)
        if reply[start : start + size] != ident or not ident:
            return None
        return reply[:pos], reply[start + size :], b"", 0, IDENTITY
    if ident:
        return None  # the reply does not echo the request's id
    return reply[:pos], reply[pos:], b"", 0, IDENTITY


def _split_rest(reply: bytes, ident: str, entry: ModelEntry) -> _Parts | None:
    """A REST reply's JSON before and after its ``"id"`` member (after
    ``model_name`` and ``model_version``, as the worker writes them), its
    binary outputs, head flag and encoding, when its id is ``ident``; a
    compressed reply is kept inflated."""
    if len(reply) < REPLY_HEAD.size:
        return None
    length, encoding, binary = REPLY_HEAD.unpack_from(reply)
    data = reply[REPLY_HEAD.size :]
    if encoding != IDENTITY:
        try:
            data = zlib.decompress(data, wbits=47)  # gzip or zlib
        except zlib.error:
            return None
    if length > len(data):
        return None
    text, tail = data[:length], data[length:]
    prefix = b'{"model_name":' + orjson.dumps(entry.name)
    if entry.version:
        prefix += b',"model_version":' + orjson.dumps(entry.version)
    member = b',"id":' + orjson.dumps(ident) if ident else b""
    rest = text[len(prefix) :]
    if not text.startswith(prefix) or not rest.startswith(member or b","):
        return None
    if not ident and rest.startswith(b',"id":'):
        return None
    return prefix, rest[len(member) :], tail, binary, encoding
