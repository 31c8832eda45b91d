"""What every gRPC handler of the router and the pool server shares: errors
become statuses in :func:`guarded`, calls end with :func:`abort`, deadlines
come from the call (:func:`deadline_from`); the service's name and extensions.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

from poolserve.service.contract.errors import ServingError
from poolserve.service.grpcserver.status import STAGE_METADATA, grpc_status

SERVICE = "inference.GRPCInferenceService"
EXTENSIONS = (
    "model_repository",
    "statistics",
    "model_configuration",
    "schedule_policy",
    "system_shared_memory",
    "classification",
    "sequence",
)
NO_DEADLINE_S = 1e6  # grpc.aio reports a huge time_remaining() when the client set none

log = logging.getLogger(__name__)

Req = TypeVar("Req")
Resp = TypeVar("Resp")


def deadline_from(
    context: grpc.aio.ServicerContext[Any, Any], default_s: float, margin_s: float = 0.0
) -> float:
    """Absolute monotonic deadline: the client's, or ``default_s`` when it set none.

    ``margin_s`` ends our part a little early, so that we answer (saying where
    the time went) before our caller's own timer fires.
    """
    remaining = context.time_remaining()
    if remaining is None or remaining > NO_DEADLINE_S:
        remaining = default_s
    return time.monotonic() + remaining - margin_s


def guarded(
    fn: Callable[[Req, grpc.aio.ServicerContext[Any, Any]], Awaitable[Resp]],
) -> Callable[[Req, grpc.aio.ServicerContext[Any, Any]], Awaitable[Resp]]:
    """Maps every error of a unary handler to a status, in one place."""

    async def handler(request: Req, context: grpc.aio.ServicerContext[Any, Any]) -> Resp:
        try:
            return await fn(request, context)
        except ServingError as exc:
            code, message = grpc_status(exc)
            if exc.stage:
                context.set_trailing_metadata(((STAGE_METADATA, exc.stage),))
        except DecodeError as exc:  # bytes that are not the message they claim to be
            code, message = grpc_status(exc)
        except Exception as exc:
            log.exception("unexpected error in %s", fn.__name__)
            code, message = grpc_status(exc)
        await abort(context, code, message)
        raise AssertionError("unreachable: abort raises")

    handler.__name__ = fn.__name__
    return handler


async def abort(
    context: grpc.aio.ServicerContext[Any, Any], code: grpc.StatusCode, message: str
) -> None:
    """Ends the call with a status, unless the client already ended it.

    A call whose client cancelled or whose deadline passed is already closed;
    sending a status then fails inside grpc. Nobody is listening, so the
    call just ends, quietly, as a cancellation.
    """
    if context.done():
        raise asyncio.CancelledError
    try:
        await context.abort(code, message)
    except grpc.aio.AbortError as exc:
        # grpc.aio keeps this exception on the call, and its traceback keeps every
        # frame it passes with their locals (the request's bytes, a reply): a
        # reference cycle that holds them until the garbage collector happens to
        # run. Once the call has ended, the traceback goes.
        error = exc  # the name ``exc`` is deleted at the end of this block
        context.add_done_callback(lambda _: error.with_traceback(None))  # type: ignore[arg-type]
        raise
    except Exception:
        raise asyncio.CancelledError from None
