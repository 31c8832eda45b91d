"""What the pool schedules a REST call by: the ``priority``, ``timeout``,
``idempotent`` and sequence parameters in its JSON body.

A gRPC request carries them in its wire bytes, where the pool peeks at them
without parsing (:mod:`poolserve.service.contract.wire`,
:mod:`poolserve.service.contract.sequence`). A REST body arrives as the
router forwarded it (:mod:`poolserve.service.contract.rest`); here its JSON
is read as the worker reads it (:mod:`poolserve.service.inference.json_body`)
when it is small enough to read on the pool's event loop (:data:`MAX_PEEK`
bytes, inflated first when compressed: Triton's binary
extension keeps the JSON small whatever the tensors' size), and the
parameters are turned into the same wire bytes, so that the same peeks, with
the same checks and the same errors, apply
(:func:`poolserve.service.contract.rest.scheduling_json` says which JSON).
A larger JSON is scheduled with the defaults and runs alone (no batch); the
worker refuses it when it carries a scheduling parameter
(:func:`poolserve.service.inference.rest.decode`), so that none is ignored.

The body is read once per request (a compressed one inflated once), where
the pool first routes it (:func:`scheduling_routing`): the routing keeps
what was read, and batching and sequences take it from there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson

from poolserve.service.contract.framing import Payload
from poolserve.service.contract.rest import (
    SCHEDULING,
    RestHead,
    encode_parameters,
    routing_head,
    scheduling_json,
)
from poolserve.service.contract.rest import unwrap as unwrap_rest
from poolserve.service.contract.shm import unwrap
from poolserve.service.contract.wire import Routing, Wire, peek_model, peek_routing
from poolserve.service.inference import json_body

if TYPE_CHECKING:
    from poolserve.service.poolserver.catalog import Catalog, ModelEntry


def ready_route(catalog: Catalog, request: Payload) -> tuple[ModelEntry, Routing]:
    """The ready model a request names, and its routing."""
    routing = scheduling_routing(request)
    return catalog.lookup_ready(routing.name, routing.version), routing


def scheduling_routing(request: Payload) -> Routing:
    """The request's routing (model, version, scheduling parameters), read
    from :func:`scheduling_view`; for a REST body, with what was read of it
    (:attr:`Routing.rest_view`, :attr:`Routing.rest_json`): the one read of
    the body for this request."""
    data = unwrap(request)[1]
    rest = unwrap_rest(data)
    if rest is None:
        return peek_routing(data)
    text, doc = _document(*rest)
    name, version = peek_model(data)
    view = routing_head(name, version) + encode_parameters(_parameters(doc))
    routing = peek_routing(view)
    routing.rest_view, routing.rest_json = view, _batch_fields(doc)
    routing.rest_doc, routing.rest_text = doc, text
    return routing


def _batch_fields(doc: dict[str, Any] | None) -> dict[str, Any] | None:
    """What :func:`rest_batch` reads of a body's JSON, kept with its routing
    while the call queues: its parameters, and its tensors but their data."""
    if doc is None:
        return None
    inputs = doc.get("inputs")
    if isinstance(inputs, list):
        inputs = [
            {k: v for k, v in tensor.items() if k != "data"} if isinstance(tensor, dict) else tensor
            for tensor in inputs
        ]
    return {"parameters": doc.get("parameters"), "inputs": inputs}


def scheduling_view(request: Payload, routing: Routing | None = None) -> Wire:
    """The bytes the pool's peeks read: the request itself, or for a REST
    body its model, version and JSON scheduling parameters as wire fields
    (``routing``'s, from :func:`scheduling_routing`; read here without one)."""
    routing = routing if routing is not None else scheduling_routing(request)
    if routing.rest_view is not None:
        return routing.rest_view
    return unwrap(request)[1]


def _document(head: RestHead, body: Wire) -> tuple[Wire | None, dict[str, Any] | None]:
    """The body's JSON text when the pool reads it (:func:`scheduling_json`),
    and its document when that is an object."""
    text = scheduling_json(head, body)
    if text is None:
        return None, None
    try:
        doc = json_body.loads(text)  # NaN and the infinities as the worker reads them
    except json_body.NotJson:
        return text, None  # the worker says what is wrong with it
    return text, (doc if isinstance(doc, dict) else None)


def _parameters(doc: dict[str, Any] | None) -> dict[str, object]:
    params = doc.get("parameters") if doc is not None else None
    if not isinstance(params, dict):
        return {}
    return {key: params[key] for key in SCHEDULING if key in params}


# what differs per request without keeping requests apart
_PER_REQUEST = frozenset(("binary_data_size", "binary_data_output"))


def rest_batch(
    request: Payload, safe: frozenset[str], routing: Routing | None = None
) -> tuple[int, bytes] | None:
    """(rows, batch key) of a REST body, as :func:`poolserve.service.contract.batching.peek_batch`
    gives them for a ModelInferRequest; None when it runs alone (too large to
    read here, no inputs, inputs that disagree on dimension 0). The body's
    JSON is ``routing``'s (:func:`scheduling_routing`; read here without one)."""
    routing = routing if routing is not None else scheduling_routing(request)
    if routing.rest_view is None:  # not a REST body
        return None
    doc = routing.rest_json
    inputs = doc.get("inputs") if doc is not None else None
    if doc is None or not isinstance(inputs, list) or not inputs:
        return None
    rows: set[object] = set()
    tensors = []
    for tensor in inputs:
        shape = tensor.get("shape") if isinstance(tensor, dict) else None
        if not isinstance(shape, list) or not shape:
            return None
        params = tensor.get("parameters") or {}
        if not isinstance(params, dict):
            return None
        rows.add(shape[0])
        kept = sorted((k, repr(v)) for k, v in params.items() if k not in _PER_REQUEST)
        tensors.append([tensor.get("name"), tensor.get("datatype"), shape[1:], kept])
    count = rows.pop() if len(rows) == 1 else None
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        return None
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        return None
    skip = safe | _PER_REQUEST | frozenset(SCHEDULING)
    kept = sorted((k, repr(v)) for k, v in params.items() if k not in skip)
    return count, b"rest\x00" + orjson.dumps([tensors, kept])
