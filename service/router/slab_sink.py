"""Large ModelInfer requests received straight into a slab (contract/slab.py).

The router's own HTTP/2 (``http2.call.Sink``) asks, once a unary call's gRPC
length prefix says how large its message is, where to put it. A ModelInfer
message over :data:`slab.THRESHOLD` (and within :data:`slab.MAX_BODY`) goes
into a slab leased for it as its DATA frames come: the one copy of the
request in the router, instead of joining the frames and then copying the
result into a slab. The handler is given the view of it; the lane takes the
slab over (``LaneClient.call``: freed on the worker's REPLY, retired on any
other end). A call that ends before the lane took it (a refusal, an error,
an ensemble, which copies its request) frees it: nobody else saw it.
"""

from __future__ import annotations

from collections.abc import Callable

from poolserve.service.contract import slab
from poolserve.service.grpcserver.handlers import SERVICE

MODEL_INFER = f"/{SERVICE}/ModelInfer"


class SlabSink:
    """One call's slab, owned by the call until the lane takes it."""

    __slots__ = ("_arena", "_taken", "ref", "slab", "view")

    def __init__(self, arena: slab.Arena, where: slab.Slab, ref: slab.Ref) -> None:
        self._arena = arena
        self.slab = where
        self.ref = ref
        self.view = where.view[: ref.length]
        self._taken = False

    def take(self) -> tuple[slab.Slab, slab.Ref] | None:
        """For the lane: the slab and its reference, once (None after a drop)."""
        if self._taken:
            return None
        self._taken = True
        return self.slab, self.ref

    def drop(self) -> None:
        """The call is done with it: freed, unless the lane took it."""
        if not self._taken:
            self._taken = True
            self._arena.free(self.slab)


def slab_sinks(arena: slab.Arena) -> Callable[[str, int], SlabSink | None]:
    """The router's ``GrpcServer.sink``: a slab for a large ModelInfer message,
    with a reply area of the same size (a larger reply comes back inline)."""

    def sink(path: str, size: int) -> SlabSink | None:
        if path != MODEL_INFER or not slab.THRESHOLD < size <= slab.MAX_BODY:
            return None
        got = arena.lease(size, size)
        return None if got is None else SlabSink(arena, *got)

    return sink
