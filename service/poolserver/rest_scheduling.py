"""What the pool schedules a REST call by: the ``priority``, ``timeout``,
``idempotent`` and sequence parameters in its JSON body.

A gRPC request carries them in its wire bytes, where the pool peeks at them
without parsing (:mod:`poolserve.service.contract.wire`,
:mod:`poolserve.service.contract.sequence`). A REST body arrives as the
router forwarded it (:mod:`poolserve.service.contract.rest`); here its JSON
is read with orjson when it is small enough to read on the pool's event loop
(:data:`MAX_PEEK` bytes: Triton's binary extension keeps the JSON small
whatever the tensors' size), and the parameters are turned into the same
wire bytes, so that the same peeks, with the same checks and the same
errors, apply. A larger or compressed JSON body is scheduled with the
defaults, and its parameters reach the model only.
"""

from __future__ import annotations

import orjson

from poolserve.service.contract.framing import Payload
from poolserve.service.contract.rest import (
    IDENTITY,
    MAX_PEEK,
    SCHEDULING,
    RestHead,
    encode_parameters,
    routing_head,
)
from poolserve.service.contract.rest import unwrap as unwrap_rest
from poolserve.service.contract.shm import unwrap
from poolserve.service.contract.wire import Wire, peek_model


def scheduling_view(request: Payload) -> Wire:
    """The bytes the pool's peeks read: the request itself, or for a REST
    body its model, version and JSON scheduling parameters as wire fields."""
    data = unwrap(request)[1]
    rest = unwrap_rest(data)
    if rest is None:
        return data
    head, body = rest
    name, version = peek_model(data)
    return routing_head(name, version) + encode_parameters(_parameters(head, body))


def _parameters(head: RestHead, body: Wire) -> dict[str, object]:
    length = head.header_length
    text = body if length is None else body[:length]
    if head.encoding != IDENTITY or len(text) > MAX_PEEK:
        return {}
    try:
        doc = orjson.loads(text)
    except orjson.JSONDecodeError:
        return {}  # the worker says what is wrong with it
    params = doc.get("parameters") if isinstance(doc, dict) else None
    if not isinstance(params, dict):
        return {}
    return {key: params[key] for key in SCHEDULING if key in params}
