"""MLServer models served unchanged (extra ``poolserve[mlserver]``).

A model whose ``implementation`` is a subclass of ``mlserver.MLModel`` (a
custom runtime in the model's folder, or a packaged one such as
``mlserver_sklearn.SKLearnModel``) is served through :class:`MLModelAdapter`,
a poolserve :class:`~poolserve.service.inference.model.Model` (resolution:
:func:`poolserve.service.inference.model.resolve_implementation`, which names
this module as a string: poolserve's core never imports mlserver).

- Settings: the model's own ``model-settings.json`` parsed by MLServer's
  ``load_model_settings`` (``ModelSettings``; relative ``uri`` resolved
  against the model folder as MLServer does, ``MLSERVER_MODEL_*`` variables).
- ``async load()`` runs once where poolserve loads models (the pool's
  zygote), on an event loop closed before the zygote forks: workers share the
  loaded model copy-on-write. A load that returns a false value fails, as
  MLServer then never marks the model ready.
- ``async predict`` runs in the worker, on an event loop of that worker (one
  per process and thread), on the request converted by MLServer's own gRPC
  converters from the wire bytes; the response goes back the same way (raw
  output contents when the request used raw input contents, as MLServer).
- ``predict_stream`` (ModelStreamInfer): as MLServer, the class decides. A
  class that overrides ``MLModel.predict_stream`` is a poolserve decoupled
  model (:meth:`MLModelAdapter.transaction_policy`, reported by the zygote):
  each request of the gRPC stream runs its ``async predict_stream`` in a
  worker on an input iterator of that one request (MLServer feeds every
  request of the stream to one call), each response it yields is sent at once
  with the request's id (as MLServer's data plane); a client that goes away
  closes the async generator (``aclose``). ModelInfer of such a class runs
  its ``predict`` (as MLServer), or is refused (UNIMPLEMENTED, use
  ModelStreamInfer) when it has none. A class that does not override it is
  served by ``predict``, one response per stream request (MLModel's default).
  ``parameters.extra.decoupled: true`` in the settings still makes any
  MLModel decoupled, and then refuses ModelInfer (Triton's rule).
- Errors: ``MLServerError`` subclasses get the status MLServer gives them
  (its HTTP status mapped as ``mlserver.grpc.utils`` does: 400
  INVALID_ARGUMENT, e.g. ``InferenceError``; 404 NOT_FOUND; 422
  FAILED_PRECONDITION; 500 INTERNAL; another status INTERNAL where MLServer
  says UNKNOWN), anything else INTERNAL, with MLServer's text
  (:func:`serving_error`); a request with an invalid datatype (``INT322``)
  or that MLServer's types refuse (pydantic) is INVALID_ARGUMENT, with
  MLServer's text, where MLServer says INTERNAL. A
  UnicodeDecodeError (MLServer's StringCodec decoding a BYTES input as
  UTF-8) whose cause is an input of the request that is not UTF-8 is
  INVALID_ARGUMENT naming that input; any other stays the model's INTERNAL.
- Declared inputs are not enforced, as MLServer does not enforce them: an
  MLServer folder answers here as under ``mlserver start`` (every other model
  has them checked, :mod:`poolserve.service.inference.declared`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import numpy as np

from poolserve.service.contract.errors import (
    FailedPrecondition,
    InvalidInput,
    ModelError,
    ModelNotFound,
    ServingError,
    Unimplemented,
    clip,
)
from poolserve.service.contract.repository import ModelSettings, TensorSpec, TransactionPolicy
from poolserve.service.inference.codec import decode_raw
from poolserve.service.inference.model import Array, WireModel
from poolserve.service.poolcore.frames import Frame, part_frame, reply_frame
from poolserve.service.poolcore.stats import Timings

log = logging.getLogger(__name__)

# MLServer's MLServerError carries an HTTP status; its gRPC server maps it with
# this table (mlserver.grpc.utils.STATUS_CODE_MAPPING) and anything else to UNKNOWN.
_ERROR_FOR_HTTP: dict[int, type[ServingError]] = {
    400: InvalidInput,
    404: ModelNotFound,
    422: FailedPrecondition,
    500: ModelError,
}


def adapt(cls: type[Any], settings: ModelSettings) -> MLModelAdapter:
    """The poolserve model serving ``cls``, a subclass of ``mlserver.MLModel``."""
    return MLModelAdapter(settings, cls)


def serving_error(model: str, exc: BaseException, worker: bool = False) -> ServingError:
    """The error a client gets for what an MLModel raised, in MLServer's words:
    an ``MLServerError`` keeps its status (its HTTP status mapped as
    MLServer's gRPC server maps it), anything else is INTERNAL. The text is
    the exception's, as MLServer's servicer says it (``str(exc)``); for what
    raises in a parallel worker (``worker``: its ``predict``, when MLServer
    would run it in a worker) MLServer wraps it in its ``WorkerError``, whose
    text names the exception's class: ``builtins.TypeError: message``."""
    from mlserver.errors import MLServerError

    if isinstance(exc, ServingError):
        return exc
    text = str(exc)
    if worker:  # mlserver.parallel.errors.WorkerError's text
        kind = type(exc)
        text = f"{kind.__module__}.{kind.__name__}: {exc}"
    if isinstance(exc, MLServerError):
        # a status MLServer's table lacks: MLServer says UNKNOWN, poolserve INTERNAL
        return _ERROR_FOR_HTTP.get(int(exc.status_code), ModelError)(text)
    return ModelError(text)


class _Loops(threading.local):
    """One event loop per worker process and thread, made on first use.

    A loop made before a fork belongs to the parent: the pid check makes a
    forked worker build its own instead of running its parent's."""

    loop: asyncio.AbstractEventLoop | None = None
    pid: int = 0

    def get(self) -> asyncio.AbstractEventLoop:
        if self.loop is None or self.pid != os.getpid() or self.loop.is_closed():
            self.loop = asyncio.new_event_loop()
            self.pid = os.getpid()
        return self.loop


class MLModelAdapter(WireModel):
    """An ``mlserver.MLModel`` as a poolserve model."""

    rest_as_mlserver = True  # REST bodies read as MLServer's types read them

    def __init__(self, settings: ModelSettings, cls: type[Any]) -> None:
        super().__init__(settings)
        self.cls = cls
        self.mlmodel: Any = None
        self._loops = _Loops()
        # run in the pool server's process (parallel_workers 0): MLServer's errors
        # are then those of its inline models, not of its parallel workers
        self.runs_inline = False
        # ModelMetadata as MLServer answers it (its MLModel.metadata() and gRPC
        # converter): the pool answers these bytes for this model
        self.own_metadata: bytes | None = None
        # its @custom_handler endpoints ((method, path) pairs) and the app serving
        # them (service/runtimes/mlserver_rest.py), made at load
        self.custom_routes: tuple[tuple[str, str], ...] = ()
        self._custom_app: Any = None

    def load(self) -> None:
        from mlserver.repository.load import load_model_settings

        ml_settings = load_model_settings(str(self.settings.source))
        if self.settings.versioned:  # one version of a numbered model: its number, its folder
            from mlserver.settings import ModelParameters

            parameters = ml_settings.parameters or ModelParameters()
            parameters.version = self.settings.version
            parameters.uri = self.settings.uri or str(self.settings.folder)
            ml_settings.parameters = parameters
        self.mlmodel = self.cls(ml_settings)
        loop = asyncio.new_event_loop()
        try:
            ready = loop.run_until_complete(self.mlmodel.load())
            if ready:
                self.own_metadata = loop.run_until_complete(self._metadata())
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()  # before the zygote forks: no worker inherits a live loop
        if not ready:
            raise RuntimeError(
                f"{self.cls.__name__}.load() returned {ready!r}: MLServer never marks "
                "such a model ready (load() must return True)"
            )
        self.mlmodel.ready = True
        from poolserve.service.runtimes.mlserver_rest import custom_app

        self.custom_routes, self._custom_app = custom_app(self.mlmodel)

    def call_custom(self, call: bytes, body: bytes) -> tuple[int, list[list[str]], bytes]:
        """One call of a @custom_handler endpoint: (status, headers, body)."""
        from poolserve.service.runtimes.mlserver_rest import call_app

        if self._custom_app is None:
            raise ModelNotFound(f"model '{self.settings.name}' has no custom REST endpoints")
        result: tuple[int, list[list[str]], bytes] = self._run(
            call_app(self._custom_app, call, body)
        )
        return result

    async def _metadata(self) -> bytes | None:
        """MLServer's ModelMetadataResponse of this model, as its data plane makes it."""
        from mlserver.context import model_context
        from mlserver.grpc.converters import ModelMetadataResponseConverter

        try:
            with model_context(self.mlmodel.settings):
                metadata = await self.mlmodel.metadata()
            return bytes(ModelMetadataResponseConverter.from_types(metadata).SerializeToString())
        except Exception:  # poolserve's own answer then
            log.exception("model %s: its metadata() failed", self.settings.name)
            return None

    @property
    def warm_up_by_default(self) -> bool:
        """Whether each fresh worker's self-test calls ``predict`` on zeros with
        no setting: for MLServer's packaged runtimes (``mlserver_sklearn``,
        ``mlserver_xgboost``, ...: pure functions of their inputs, and the
        native thread pools whose hang after fork the self-test is there to
        catch), not for a custom runtime, whose ``predict`` may count, call
        another service or write an audit log, and would see requests no
        client sent (``parameters.extra.warmup: true`` or
        ``parameters.extra.example`` ask for one)."""
        return self.cls.__module__.split(".")[0].startswith("mlserver_")

    def transaction_policy(self) -> TransactionPolicy:
        """As MLServer: ModelStreamInfer runs the class's own ``predict_stream``
        if it has one, ModelInfer its ``predict`` if it has one; the settings'
        ``decoupled: true`` still makes any MLModel decoupled (stream only)."""
        if self.settings.decoupled:
            return self.settings.policy
        if overrides_predict_stream(self.cls):
            return TransactionPolicy(decoupled=True, unary=overrides_predict(self.cls))
        return self.settings.policy

    def metadata(self) -> tuple[Sequence[TensorSpec], Sequence[TensorSpec]]:
        """Inputs and outputs as the MLModel sees them (its load may set them)."""
        return _specs(self.mlmodel.inputs), _specs(self.mlmodel.outputs)

    def _run(self, coroutine: Any) -> Any:
        from mlserver.context import model_context

        with model_context(self.mlmodel.settings):
            return self._loops.get().run_until_complete(coroutine)

    def infer_wire(self, body: bytes) -> tuple[bytes, Timings]:
        from mlserver.grpc.converters import ModelInferResponseConverter

        name = self.settings.name
        t0 = time.perf_counter_ns()
        request, payload, use_raw = _parse(name, body)
        t1 = time.perf_counter_ns()
        try:
            response = self._run(self.mlmodel.predict(payload))
        except NotImplementedError as exc:
            if overrides_predict_stream(self.cls) and not overrides_predict(self.cls):
                raise Unimplemented(
                    f"model '{name}' implements predict_stream only: use ModelStreamInfer"
                ) from exc
            raise serving_error(name, exc, not self.runs_inline) from exc
        except UnicodeDecodeError as exc:
            raise not_utf8(name, request, exc, not self.runs_inline) from exc
        except Exception as exc:
            raise serving_error(name, exc, not self.runs_inline) from exc
        t2 = time.perf_counter_ns()
        try:
            response.id = payload.id  # as MLServer's data plane
            message = ModelInferResponseConverter.from_types(response, use_raw=use_raw)
            data = message.SerializeToString()
        except Exception as exc:  # a response MLServer could not send either
            raise serving_error(name, exc) from exc
        t3 = time.perf_counter_ns()
        return data, Timings(decode_ns=t1 - t0, compute_ns=t2 - t1, encode_ns=t3 - t2)

    def stream_wire(self, body: bytes, seq: int) -> Iterator[Frame]:
        """A decoupled MLModel's answer to one request: a PART frame per response
        its ``predict_stream`` yields, then the REPLY frame ending the stream.
        Closing this iterator (the client went away) closes the model's
        async generator. Raises ServingError subclasses only."""
        from mlserver.grpc.converters import ModelInferResponseConverter

        from poolserve.service.inference.stream import FINAL, FINAL_FLAG

        name = self.settings.name
        t0 = time.perf_counter_ns()
        request, payload, use_raw = _parse(name, body)
        flag = request.parameters.get(FINAL_FLAG)
        flagged = flag is not None and flag.WhichOneof("parameter_choice") == "bool_param"
        flagged = flagged and bool(flag.bool_param)
        timings = Timings(decode_ns=time.perf_counter_ns() - t0)
        try:
            responses = self.mlmodel.predict_stream(_one(payload)).__aiter__()
        except Exception as exc:
            raise serving_error(name, exc) from exc
        try:
            while True:
                t1 = time.perf_counter_ns()
                try:
                    response = self._run(responses.__anext__())
                except StopAsyncIteration:
                    break
                except UnicodeDecodeError as exc:
                    raise not_utf8(name, request, exc) from exc
                except Exception as exc:
                    raise serving_error(name, exc) from exc
                t2 = time.perf_counter_ns()
                try:
                    response.id = payload.id  # as MLServer's data plane
                    message = ModelInferResponseConverter.from_types(response, use_raw=use_raw)
                    if flagged:
                        message.parameters[FINAL].bool_param = False
                    data = message.SerializeToString()
                except Exception as exc:  # a response MLServer could not send either
                    raise serving_error(name, exc) from exc
                timings.compute_ns += t2 - t1
                timings.encode_ns += time.perf_counter_ns() - t2
                yield part_frame(seq, data)
        finally:
            self._close(responses)  # also when the client went away (GeneratorExit here)
        final = b""
        if flagged:
            final = _final_response(self.mlmodel, payload.id)
        yield reply_frame(seq, timings, final)

    def _close(self, responses: Any) -> None:
        aclose = getattr(responses, "aclose", None)
        if aclose is None:
            return
        try:
            self._run(aclose())
        except Exception:  # the generator raised while closing: the stream is over anyway
            log.exception("model %s: closing its predict_stream raised", self.settings.name)

    def predict_stream(
        self, inputs: dict[str, Array], parameters: dict[str, object]
    ) -> Iterator[dict[str, Array]]:
        """A stream on arrays (a fresh worker's warm-up of a decoupled model)."""
        responses = self.mlmodel.predict_stream(_one(_numpy_request(inputs))).__aiter__()
        try:
            while True:
                try:
                    response = self._run(responses.__anext__())
                except StopAsyncIteration:
                    return
                yield {out.name: _decoded(out) for out in response.outputs}
        finally:
            self._close(responses)

    def predict(self, inputs: dict[str, Array], parameters: dict[str, object]) -> dict[str, Array]:
        """A prediction on arrays (each fresh worker's warm-up): encoded with
        MLServer's NumpyCodec, the outputs decoded with it."""
        response = self._run(self.mlmodel.predict(_numpy_request(inputs)))
        return {out.name: _decoded(out) for out in response.outputs}


def overrides_predict_stream(cls: type[Any]) -> bool:
    """Whether ``cls`` has its own ``predict_stream`` (MLModel's yields one predict)."""
    from mlserver.model import MLModel

    return getattr(cls, "predict_stream", None) is not MLModel.predict_stream


def overrides_predict(cls: type[Any]) -> bool:
    """Whether ``cls`` has its own ``predict`` (MLModel's raises NotImplementedError)."""
    from mlserver.model import MLModel

    return getattr(cls, "predict", None) is not MLModel.predict


def not_utf8(
    model: str, request: Any, exc: UnicodeDecodeError, worker: bool = False
) -> ServingError:
    """What a UnicodeDecodeError of an MLModel's predict is: INVALID_ARGUMENT
    naming the request's BYTES input that is not UTF-8 (MLServer's StringCodec
    decodes str inputs so), else the model's own error (INTERNAL). Runs only
    after the error, so requests that decode pay nothing for it."""
    raw = list(request.raw_input_contents)
    for index, tensor in enumerate(request.inputs):
        if tensor.datatype != "BYTES":
            continue
        try:
            items = (
                decode_raw(tensor, raw[index]).ravel().tolist()
                if raw
                else list(tensor.contents.bytes_contents)
            )
        except (InvalidInput, IndexError):  # not this input's fault: look on
            continue
        for position, item in enumerate(items):
            try:
                item.decode("utf-8")
            except UnicodeDecodeError as bad:
                return InvalidInput(
                    f"input '{clip(tensor.name)}' of model '{model}': BYTES element "
                    f"{position} is not valid UTF-8 ({bad.reason} at byte {bad.start}); "
                    "a string input must be UTF-8"
                )
    return serving_error(model, exc, worker)


def _parse(name: str, body: bytes) -> tuple[Any, Any, bool]:
    """(the request message, MLServer's InferenceRequest with an id, use_raw)."""
    from google.protobuf.message import DecodeError
    from mlserver.grpc import dataplane_pb2
    from mlserver.grpc.converters import ModelInferRequestConverter
    from mlserver.types import Datatype
    from mlserver.utils import generate_uuid
    from pydantic import ValidationError

    try:
        request = dataplane_pb2.ModelInferRequest.FromString(body)
    except DecodeError as exc:
        raise InvalidInput(f"ModelInferRequest cannot be parsed: {exc}") from None
    try:
        use_raw = bool(request.raw_input_contents)  # as MLServer's servicer
        payload = ModelInferRequestConverter.to_types(request)
    except UnicodeDecodeError as exc:
        raise not_utf8(name, request, exc) from exc
    except ValidationError as exc:  # a request MLServer's types refuse: MLServer says INTERNAL
        raise InvalidInput(str(exc)) from exc
    except Exception as exc:
        raise serving_error(name, exc) from exc
    for tensor in request.inputs:  # MLServer fails on it in the model (INTERNAL): a mistake
        try:
            Datatype(tensor.datatype)
        except ValueError as exc:  # its text: "'INT322' is not a valid Datatype"
            raise InvalidInput(str(exc)) from None
    if payload.id is None:
        payload.id = generate_uuid()  # as MLServer's data plane
    return request, payload, use_raw


async def _one(payload: Any) -> AsyncIterator[Any]:
    """The input stream of one request, as MLServer's data plane hands it over."""
    yield payload


def _final_response(mlmodel: Any, request_id: str) -> bytes:
    """Triton's empty final response, asked by ``triton_enable_empty_final_response``."""
    from mlserver.grpc import dataplane_pb2

    from poolserve.service.inference.stream import FINAL

    message = dataplane_pb2.ModelInferResponse(
        model_name=mlmodel.name, model_version=mlmodel.version or "", id=request_id
    )
    message.parameters[FINAL].bool_param = True
    return bytes(message.SerializeToString())


def _numpy_request(inputs: dict[str, Array]) -> Any:
    from mlserver.codecs import NumpyCodec
    from mlserver.types import InferenceRequest

    return InferenceRequest(
        inputs=[NumpyCodec.encode_input(k, np.asarray(v)) for k, v in inputs.items()]
    )


def _decoded(output: Any) -> Array:
    from mlserver.codecs import NumpyCodec

    try:
        return np.asarray(NumpyCodec.decode_output(output))
    except Exception:  # not numeric (strings, JSON): the raw data
        return np.asarray(output.data.root, dtype=object)


def _specs(tensors: Sequence[Any] | None) -> tuple[TensorSpec, ...]:
    return tuple(
        TensorSpec(str(t.name), str(t.datatype), tuple(int(d) for d in t.shape or ()))
        for t in tensors or ()
    )
