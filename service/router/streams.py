"""Calls in flight per client connection, counted by the router itself.

``max_concurrent_streams`` bounds the calls one client connection has in
flight at the router. It is not given to grpc as its channel option
``grpc.max_concurrent_streams``: in grpcio 1.81 that option also sets the
server's stream quota (grpc core's ``StreamQuota``), a budget for the whole
server shared out between its connections, so 50 connections with 25 calls
each had streams refused with RST_STREAM REFUSED_STREAM (UNAVAILABLE at the
client, issue 28 §6) although none of them came near 1,024.

So grpc sets no stream limit, and :class:`StreamLimit` counts each
connection's calls (grpc's peer string, address and port, names one TCP
connection) from the moment its handler starts until it ends, every method
of the port included (health, shared memory, streams). A call past the bound
ends at once with RESOURCE_EXHAUSTED saying so (:class:`TooManyStreams`),
before any work; the connection's other calls, and every other connection,
go on. A refused call costs its client a round trip and the router a few
microseconds: no more than any call that is answered at once.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from poolserve.service.contract.errors import QueueFull
from poolserve.service.grpcserver.handlers import abort
from poolserve.service.grpcserver.status import grpc_status

Context = grpc.aio.ServicerContext[Any, Any]


class TooManyStreams(QueueFull):
    """RESOURCE_EXHAUSTED: a connection has max_concurrent_streams calls in flight."""


class StreamLimit:
    def __init__(self, per_connection: int) -> None:
        self.per_connection = per_connection
        self.open: dict[str, int] = {}

    def enter(self, peer: str) -> None:
        """Counts one more call of ``peer``; raises, counting nothing, past the bound."""
        held = self.open.get(peer, 0)
        if held >= self.per_connection:
            raise TooManyStreams(
                f"this connection has {held} calls in flight at the router "
                f"(max_concurrent_streams is {self.per_connection}): wait for some "
                "to end before sending more, or open another connection"
            )
        self.open[peer] = held + 1

    def leave(self, peer: str) -> None:
        left = self.open.get(peer, 0) - 1
        if left > 0:
            self.open[peer] = left
        else:
            self.open.pop(peer, None)

    def bound(self, generic: grpc.GenericRpcHandler) -> grpc.GenericRpcHandler:
        """``generic`` with every call it serves counted against its connection."""
        return _Bounded(self, generic)

    # -- the wrapped behaviours --------------------------------------------------

    def unary_response(
        self, fn: Callable[[Any, Context], Awaitable[Any]]
    ) -> Callable[[Any, Context], Awaitable[Any]]:
        async def handler(request: Any, context: Context) -> Any:
            peer = context.peer()
            try:
                self.enter(peer)
            except TooManyStreams as exc:
                await abort(context, *grpc_status(exc))
                raise AssertionError("unreachable: abort raises") from None
            try:
                return await fn(request, context)
            finally:
                self.leave(peer)

        return handler

    def stream_response(
        self, fn: Callable[[Any, Context], AsyncGenerator[Any, None]]
    ) -> Callable[[Any, Context], AsyncIterator[Any]]:
        async def handler(request: Any, context: Context) -> AsyncIterator[Any]:
            peer = context.peer()
            try:
                self.enter(peer)
            except TooManyStreams as exc:
                await abort(context, *grpc_status(exc))
                raise AssertionError("unreachable: abort raises") from None
            try:
                # closed with this one: the stream's own cleanup (its lane stream,
                # its worker) runs when the call ends, not when it is collected
                async with contextlib.aclosing(fn(request, context)) as replies:
                    async for reply in replies:
                        yield reply
            finally:
                self.leave(peer)

        return handler


class _Bounded(grpc.GenericRpcHandler):
    """A generic handler whose method handlers count their calls; each method
    handler is wrapped once, on its first call."""

    def __init__(self, limit: StreamLimit, inner: grpc.GenericRpcHandler) -> None:
        self.limit = limit
        self.inner = inner
        self.wrapped: dict[int, tuple[grpc.RpcMethodHandler[Any, Any], object]] = {}

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = self.inner.service(handler_call_details)
        if handler is None:
            return None
        known = self.wrapped.get(id(handler))
        if known is not None and known[1] is handler:
            return known[0]
        bounded = self._wrap(handler)
        self.wrapped[id(handler)] = (bounded, handler)  # the handler kept: its id stays its own
        return bounded

    def _wrap(self, handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
        limit = self.limit
        for kind in ("unary_unary", "stream_unary", "unary_stream", "stream_stream"):
            fn = getattr(handler, kind)
            if fn is None:
                continue
            # (grpc's handlers are namedtuples; the stubs do not say so)
            if inspect.isasyncgenfunction(fn):
                bounded: grpc.RpcMethodHandler[Any, Any] = handler._replace(  # type: ignore[attr-defined]
                    **{kind: limit.stream_response(fn)}
                )
                return bounded
            if inspect.iscoroutinefunction(fn):
                bounded = handler._replace(**{kind: limit.unary_response(fn)})  # type: ignore[attr-defined]
                return bounded
        return handler  # a synchronous handler (none on this port): left as it is
