"""A custom REST endpoint's call (the REST wrapper's ``CUSTOM`` protocol,
:mod:`poolserve.service.contract.rest`) run by the model that declared it:
an MLServer model's ``@custom_handler``
(:mod:`poolserve.service.runtimes.mlserver_rest`). The reply is
:data:`~poolserve.service.contract.rest.REPLY_HEAD` with
:data:`~poolserve.service.contract.rest.CUSTOM_REPLY`, the handler's status
and headers as JSON, then its body: the router sends them as they are."""

from __future__ import annotations

import time

import orjson

from poolserve.service.contract.errors import ModelNotFound, clip
from poolserve.service.contract.rest import CUSTOM_REPLY, IDENTITY, REPLY_HEAD, RestHead
from poolserve.service.inference.model import Model
from poolserve.service.inference.rawwire import Buffer
from poolserve.service.poolcore.stats import Timings


def run_custom(model: Model, head: RestHead, body: Buffer) -> tuple[list[Buffer], Timings]:
    call = getattr(model, "call_custom", None)
    if call is None:
        name = clip(model.settings.name)
        raise ModelNotFound(f"model '{name}' has no custom REST endpoints")
    t0 = time.perf_counter_ns()
    status, headers, content = call(head.call, bytes(body))
    t1 = time.perf_counter_ns()
    reply_head = orjson.dumps({"status": status, "headers": headers})
    parts: list[Buffer] = [
        REPLY_HEAD.pack(len(reply_head), IDENTITY, CUSTOM_REPLY),
        reply_head,
        content,
    ]
    return parts, Timings(compute_ns=t1 - t0)
