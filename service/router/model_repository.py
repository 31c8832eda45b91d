"""MLServer's model repository service (``inference.model_repository.
ModelRepositoryService``: RepositoryIndex, RepositoryModelLoad,
RepositoryModelUnload), served on the router's port beside the Open
Inference Protocol's service, for MLServer's clients and generated stubs.

Its messages are, field for field, those of the Open Inference Protocol's
calls of the same names (MLServer's load and unload requests lack only the
``parameters`` map), so each call goes through the router's own handler of
that call, the one path for model control; only the answers are said in
MLServer's words, as ``mlserver start`` says them on this service (compared
side by side in tests/test_mlserver_readme_examples.py):

- the index's states are MLServer's (a model unloaded on request is
  ``UNAVAILABLE``, with no reason: MLServer knows no UNLOADED, it answers
  UNAVAILABLE for a model not in its registry), written as MLServer 1.7.1's
  gRPC converter writes them, its enum's ``str()``: ``State.READY``,
  ``State.UNAVAILABLE``; a client that works with ``mlserver start`` reads
  the same text here;
- a load or unload of a model it does not have is NOT_FOUND ``Model <name>
  not found`` (MLServer's ``ModelNotFound``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from poolserve.protos import model_repository_pb2 as mr
from poolserve.service.contract.errors import ModelNotFound, clip
from poolserve.service.grpcserver.handlers import guarded

SERVICE = "inference.model_repository.ModelRepositoryService"

# The router's byte handlers of the same calls (request bytes in, reply bytes out).
Handler = Callable[[bytes, Any], Awaitable[bytes]]

# poolserve's states (service/poolserver/catalog.py ModelState) -> MLServer's
# (mlserver.types.State: UNKNOWN, READY, UNAVAILABLE, LOADING, UNLOADING)
MLSERVER_STATES = {
    "READY": "READY",
    "LOADING": "LOADING",
    "UNAVAILABLE": "UNAVAILABLE",
    "UNLOADED": "UNAVAILABLE",
}


def mlserver_index(reply: bytes) -> bytes:
    """The router's RepositoryIndex reply as MLServer's gRPC service says it."""
    index = mr.RepositoryIndexResponse.FromString(reply)
    for model in index.models:
        if model.state == "UNLOADED":
            model.reason = ""  # MLServer: a model out of its registry, no reason
        model.state = "State." + MLSERVER_STATES.get(model.state, "UNKNOWN")
    return index.SerializeToString()


def _mlserver_not_found(handler: Handler, request: type[Any]) -> Handler:
    """A load or unload handler whose NOT_FOUND is MLServer's text."""

    async def call(body: bytes, context: Any) -> bytes:
        try:
            return await handler(body, context)
        except ModelNotFound:
            name = request.FromString(body).model_name
            raise ModelNotFound(f"Model {clip(name)} not found") from None

    call.__name__ = getattr(handler, "__name__", "call")
    return call


def model_repository_handler(
    index: Handler, load: Handler, unload: Handler
) -> grpc.GenericRpcHandler:
    """The service, over the router's RepositoryIndex, RepositoryModelLoad and
    RepositoryModelUnload handlers."""

    async def repository_index(body: bytes, context: Any) -> bytes:
        mr.RepositoryIndexRequest.FromString(body)  # INVALID_ARGUMENT if it is not one
        return mlserver_index(await index(body, context))

    repository_index.__name__ = "RepositoryIndex"
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
        "RepositoryIndex": grpc.unary_unary_rpc_method_handler(guarded(repository_index)),
        "RepositoryModelLoad": grpc.unary_unary_rpc_method_handler(
            guarded(_mlserver_not_found(load, mr.RepositoryModelLoadRequest))
        ),
        "RepositoryModelUnload": grpc.unary_unary_rpc_method_handler(
            guarded(_mlserver_not_found(unload, mr.RepositoryModelUnloadRequest))
        ),
    }
    return grpc.method_handlers_generic_handler(SERVICE, handlers)
