"""The response cache's key, its LRU bounds and what it never holds, without a
tree (the end-to-end checks, both doors: test_response_cache.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.repository import (
    ModelSettings,
    TransactionPolicy,
    parse_model_settings,
)
from poolserve.service.contract.rest import RestHead, wrap_head
from poolserve.service.contract.settings import ConfigError
from poolserve.service.poolserver.catalog import ModelEntry, ModelState
from poolserve.service.poolserver.response_cache import ENTRY_OVERHEAD, ResponseCache
from poolserve.service.poolserver.rest_scheduling import scheduling_routing

from support import infer_request


def _entry(name: str = "m", **extra: Any) -> ModelEntry:
    settings = ModelSettings(
        name, "model.M", Path("."), Path("m.json"), extra={"response_cache": True, **extra}
    )
    return ModelEntry(name, "1", "default", ModelState.READY, settings=settings)


def _request(ident: str = "", data: bytes = b"\0\0\x80?", **params: Any) -> bytes:
    array = np.frombuffer(data, dtype=np.float32).reshape(1, -1)
    return infer_request("m", array, ident=ident, **params)


def _reply(ident: str = "", data: bytes = b"\0\0\x80?") -> bytes:
    reply = pb.ModelInferResponse(model_name="m", model_version="1", id=ident)
    reply.outputs.add(name="OUTPUT0", datatype="FP32", shape=[1, len(data) // 4])
    reply.raw_output_contents.append(data)
    return reply.SerializeToString()


def _key(cache: ResponseCache, entry: ModelEntry, request: bytes) -> bytes:
    probe = cache.probe(entry, request, scheduling_routing(request))
    assert probe is not None
    return probe.key


def test_the_key_leaves_out_only_the_id_and_the_per_call_parameters() -> None:
    cache, entry = ResponseCache(1 << 20, 100), _entry()
    base = _key(cache, entry, _request())
    assert _key(cache, entry, _request("an id")) == base
    assert _key(cache, entry, _request(priority=1)) == base
    assert _key(cache, entry, _request(timeout=5_000_000)) == base
    assert _key(cache, entry, _request(mode="a")) != base
    assert _key(cache, entry, _request(mode="a")) != _key(cache, entry, _request(mode="b"))
    assert _key(cache, entry, _request(data=b"\0\0\0@")) != base
    assert _key(cache, entry, _request(data=b"\0\0\x80?" * 2)) != base  # another shape
    wanted = pb.ModelInferRequest.FromString(_request())
    wanted.outputs.add(name="OUTPUT0")
    assert _key(cache, entry, wanted.SerializeToString()) != base
    assert _key(cache, _entry("n"), _request()) != base  # another model


def test_a_request_cut_short_is_not_cached() -> None:
    cache, entry = ResponseCache(1 << 20, 100), _entry()
    for cut in (_request() + b"\x1a\x05ab", _request()[:-1], _request() + b"\x0b"):
        assert cache.probe(entry, cut, scheduling_routing(_request())) is None


def test_a_hit_is_the_computed_reply_with_the_requests_id() -> None:
    cache, entry = ResponseCache(1 << 20, 100), _entry()
    first = cache.probe(entry, _request("a"), scheduling_routing(_request("a")))
    assert first is not None and cache.get(first) is None
    cache.put(first, entry, _reply("a"))
    for ident in ("a", "", "a much longer id than the first" * 10):
        probe = cache.probe(entry, _request(ident), scheduling_routing(_request(ident)))
        assert probe is not None
        assert cache.get(probe) == _reply(ident)


def test_a_reply_that_does_not_echo_the_id_is_not_kept() -> None:
    cache, entry = ResponseCache(1 << 20, 100), _entry()
    probe = cache.probe(entry, _request("a"), scheduling_routing(_request("a")))
    assert probe is not None
    cache.put(probe, entry, _reply("made-up"))
    for broken in (b"\xff not a reply", b"\x0a\xff", b"\x0a\x05ab", b""):
        cache.put(probe, entry, broken)  # never raises: the reply goes as it is
    assert cache.entries == 0 and cache.get(probe) is None


def test_rest_keys_read_the_document_not_its_spelling() -> None:
    cache, entry = ResponseCache(1 << 20, 100), _entry()

    def rest(doc: Any, accept: int = 0, text: bytes | None = None) -> bytes:
        body = text if text is not None else json.dumps(doc).encode()
        return wrap_head("m", "", len(body), RestHead(accept=accept)) + body

    inputs = [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}]
    base = _key(cache, entry, rest({"inputs": inputs}))
    spaced = json.dumps({"id": "x", "parameters": {"priority": 1}, "inputs": inputs}, indent=3)
    assert _key(cache, entry, rest(None, text=spaced.encode())) == base
    assert _key(cache, entry, rest({"inputs": inputs, "parameters": {"p": 1}})) != base
    assert _key(cache, entry, rest({"inputs": inputs}, accept=1)) != base  # a gzip reply
    assert _key(cache, entry, _request()) != base  # the gRPC door's reply differs
    nan = rest(None, text=b'{"inputs": [{"name": "INPUT0", "shape": [1, 1], "data": [NaN]}]}')
    assert cache.probe(entry, nan, scheduling_routing(nan)) is None


def test_the_bounds_hold_least_recently_used_out_first() -> None:
    size = len(_reply()) + 16 + ENTRY_OVERHEAD
    cache, entry = ResponseCache(size * 64, 8), _entry()
    probes = []
    for i in range(100):
        request = _request(data=i.to_bytes(4, "little"))
        probe = cache.probe(entry, request, scheduling_routing(request))
        assert probe is not None
        cache.put(probe, entry, _reply(data=i.to_bytes(4, "little")))
        probes.append(probe)
        if i >= 2:
            assert cache.get(probes[1]) is not None  # used: it stays
        assert cache.entries <= 8 and cache.bytes <= cache.max_bytes
    assert cache.get(probes[0]) is None and cache.get(probes[1]) is not None
    assert cache.evictions == 100 - 8
    by_bytes = ResponseCache(size * 16, 1000)  # sixteen replies' bytes (each at its share)
    for probe in probes[:20]:
        by_bytes.put(probe, entry, _reply(data=b"x" * 4))
    assert by_bytes.entries == 16 and by_bytes.bytes == 16 * size == by_bytes.max_bytes


def test_a_reply_over_its_share_is_not_kept() -> None:
    cache, entry = ResponseCache(16 * 1024, 100), _entry()
    request = _request(data=b"\0" * 4096)
    probe = cache.probe(entry, request, scheduling_routing(request))
    assert probe is not None
    cache.put(probe, entry, _reply(data=b"\0" * 4096))  # over 1/16 of 16 KiB
    assert cache.entries == 0


def test_a_load_forgets_the_models_replies_even_those_in_flight() -> None:
    cache, entry, other = ResponseCache(1 << 20, 100), _entry(), _entry("n")
    request = _request()
    probe = cache.probe(entry, request, scheduling_routing(request))
    theirs = cache.probe(other, request, scheduling_routing(request))
    in_flight = cache.probe(entry, _request(mode="x"), scheduling_routing(_request(mode="x")))
    assert probe is not None and theirs is not None and in_flight is not None
    cache.put(probe, entry, _reply())
    cache.put(theirs, other, pb.ModelInferResponse(model_name="n").SerializeToString())
    cache.forget("m")
    assert cache.get(probe) is None and cache.get(theirs) is not None
    cache.put(in_flight, entry, _reply())  # computed by the load before
    assert cache.entries == 1


def test_what_is_never_cached() -> None:
    cache, request = ResponseCache(1 << 20, 100), _request()
    routing = scheduling_routing(request)
    plain = ModelEntry(
        "m", "1", "default", ModelState.READY, settings=ModelSettings("m", "x", Path(), Path())
    )
    assert cache.probe(plain, request, routing) is None  # no setting
    streaming = _entry()
    streaming.declared = TransactionPolicy(decoupled=True, unary=False)  # as it loaded
    assert cache.probe(streaming, request, routing) is None
    assert cache.probe(_entry(), b"\x00shm1" + request, routing) is None  # shared memory
    assert cache.probe(_entry(), b"\x00slab1" + request, routing) is None  # in a slab
    assert ResponseCache(0, 100).probe(_entry(), request, routing) is None  # cache off


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        ({"response_cache": "yes"}, "expected true, false"),
        ({"response_cache": True, "decoupled": True}, "decoupled model"),
        ({"response_cache": {"enable": True}, "sequence": {}}, "sequence model"),
    ],
)
def test_bad_settings_name_the_field(tmp_path: Path, extra: dict[str, Any], error: str) -> None:
    path = tmp_path / "model-settings.json"
    settings = {"name": "m", "implementation": "x.M", "parameters": {"extra": extra}}
    path.write_text(json.dumps(settings))
    with pytest.raises(ConfigError, match=r"parameters\.extra\.response_cache") as caught:
        parse_model_settings(path)
    assert error in str(caught.value)


def test_settings_that_turn_it_on(tmp_path: Path) -> None:
    path = tmp_path / "model-settings.json"
    for value, on in ((True, True), ({"enable": True}, True), ({"enable": False}, False)):
        extra = {"extra": {"response_cache": value}}
        path.write_text(json.dumps({"name": "m", "implementation": "x.M", "parameters": extra}))
        assert parse_model_settings(path).response_cache is on
