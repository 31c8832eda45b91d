"""The one table from poolserve's errors to gRPC status codes, both ways, and
beside it the one table to HTTP status codes.

The router and the pool server answer every failure through :func:`grpc_status`;
the router rebuilds a pool's status as an error with :func:`from_upstream`. The
router's HTTP door answers through :func:`http_status`, with the same message.
"""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError

from poolserve.service.contract.errors import (
    MAX_MESSAGE,
    Failure,
    InvalidInput,
    ServingError,
    clip,
    error_for,
)

_STATUS: dict[Failure, grpc.StatusCode] = {
    Failure.INTERNAL: grpc.StatusCode.INTERNAL,
    Failure.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Failure.INVALID_INPUT: grpc.StatusCode.INVALID_ARGUMENT,
    Failure.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Failure.QUEUE_FULL: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Failure.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
    Failure.CANCELLED: grpc.StatusCode.CANCELLED,
    Failure.TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Failure.MODEL_ERROR: grpc.StatusCode.INTERNAL,
    Failure.NOT_READY: grpc.StatusCode.UNAVAILABLE,
    Failure.UNIMPLEMENTED: grpc.StatusCode.UNIMPLEMENTED,
    Failure.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    Failure.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
}


# As Triton's HTTP endpoint and the Open Inference Protocol's REST spec: 400 bad
# input, 404 unknown model, 503 not ready or down; a full queue is 429 (retry
# later, at this server); a deadline spent is 504.
_HTTP_STATUS: dict[Failure, int] = {
    Failure.INTERNAL: 500,
    Failure.NOT_FOUND: 404,
    Failure.INVALID_INPUT: 400,
    Failure.UNAVAILABLE: 503,
    Failure.QUEUE_FULL: 429,
    Failure.DEADLINE: 504,
    Failure.CANCELLED: 499,  # nginx's "client closed request": nobody reads it
    Failure.TOO_LARGE: 413,
    Failure.MODEL_ERROR: 500,
    Failure.NOT_READY: 503,
    Failure.UNIMPLEMENTED: 501,
    Failure.FAILED_PRECONDITION: 400,
    Failure.ALREADY_EXISTS: 409,
}


def as_serving_error(exc: BaseException) -> ServingError:
    """Any exception as the error a client gets for it."""
    if isinstance(exc, ServingError):
        return exc
    if isinstance(exc, DecodeError):  # bytes that are not the message they claim to be
        return InvalidInput(f"request cannot be parsed: {exc}")
    return ServingError(f"internal error: {type(exc).__name__}: {exc}")


def grpc_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client sees for ``exc``.

    The message is cut to MAX_MESSAGE characters: a status message travels in
    a trailer, and one over the client's metadata limit would reach it as a
    metadata-size error instead of this status.
    """
    error = as_serving_error(exc)
    return _STATUS[error.failure], clip(error.message, MAX_MESSAGE)


def http_status(exc: BaseException) -> tuple[int, str]:
    """The HTTP status and message a REST client sees for ``exc`` (the message
    is the gRPC door's, whole: a body has no trailer's size limit)."""
    error = as_serving_error(exc)
    return _HTTP_STATUS[error.failure], error.message


_FAILURE_FOR_STATUS: dict[grpc.StatusCode, Failure] = {
    grpc.StatusCode.NOT_FOUND: Failure.NOT_FOUND,
    grpc.StatusCode.INVALID_ARGUMENT: Failure.INVALID_INPUT,
    grpc.StatusCode.UNAVAILABLE: Failure.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Failure.QUEUE_FULL,
    grpc.StatusCode.DEADLINE_EXCEEDED: Failure.DEADLINE,
    grpc.StatusCode.CANCELLED: Failure.CANCELLED,
    grpc.StatusCode.UNIMPLEMENTED: Failure.UNIMPLEMENTED,
    grpc.StatusCode.FAILED_PRECONDITION: Failure.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS: Failure.ALREADY_EXISTS,
}


STAGE_METADATA = "poolserve-stage"  # trailing metadata: where the budget ran out


def from_upstream(code: grpc.StatusCode, details: str, where: str, stage: str = "") -> ServingError:
    """An error that a pool answered, as the router passes it on.

    The status code is kept; an empty message (a status made by the gRPC
    library rather than by a pool, e.g. the router's own deadline on the
    forwarded call) is replaced by one that says where it happened.
    """
    failure = _FAILURE_FOR_STATUS.get(code, Failure.INTERNAL)
    message = details or f"{code.name.lower().replace('_', ' ')} {where}"
    if code is grpc.StatusCode.UNAVAILABLE and not message.startswith("pool"):
        message = f"{where} is unavailable: {message}"
    error = error_for(failure, message)
    error.stage = stage
    return error
