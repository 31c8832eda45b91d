"""The pool server's cargo: what its zygote loads and what its workers run.

The zygote (:mod:`poolserve.service.poolcore.zygote`) knows only the
:class:`~poolserve.service.poolcore.zygote.Cargo` protocol; this module is the
inference side of that seam: runtime models loaded from their
``model-settings.json`` (live loads and unloads included), a worker's handler
that answers serialized ModelInferRequests (:func:`handle`), each model's
warm-up for a fresh worker's self-test, and the exec of a fresh interpreter
per worker for ``start_method: "spawn"`` (:mod:`poolserve.service.inference.spawned`).
The pool server starts it as an :class:`InferenceZygote`, forked before any
gRPC object exists; the cargo is built in the child.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import sys
import traceback
from collections.abc import Callable, Collection, Generator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from poolserve.service.contract.errors import Failure, ModelNotFound, ServingError, clip
from poolserve.service.contract.repository import ModelSettings
from poolserve.service.lifecycle.procutil import interpreter_flags
from poolserve.service.poolcore import worker
from poolserve.service.poolcore.frames import error_frame, reply_frame
from poolserve.service.poolcore.stats import Timings
from poolserve.service.poolcore.zygote import Emit, specs_json, truncate_reason
from poolserve.service.poolcore.zygote_control import ForkedZygote

if TYPE_CHECKING:
    from poolserve.service.inference.model import Array, Model
    from poolserve.service.inference.rawwire import Buffer

log = logging.getLogger(__name__)


def handle(models: Mapping[str, Model], body: bytes, seq: int) -> worker.FrameOut:
    """The inference handler: one serialized ModelInferRequest, one frame."""
    try:
        response, timings = _infer_named()(models, body)
        return reply_frame(seq, timings, response)  # parts: the tensors are not joined
    except ServingError as exc:
        return error_frame(seq, Timings(), exc.failure, exc.message)
    except Exception as exc:  # a bug in our own path: report it, keep serving
        return error_frame(seq, Timings(), Failure.INTERNAL, f"{type(exc).__name__}: {exc}")


@functools.cache
def _infer_named() -> Callable[[Mapping[str, Model], bytes], tuple[list[Buffer], Timings]]:
    # Imported in the worker, on its first request (then kept): the pool server
    # imports this module for InferenceZygote and must not load protobuf, the
    # codec or numpy itself.
    from poolserve.service.inference.infer import infer_named

    return infer_named


def handle_batch(models: Mapping[str, Model], bodies: list[bytes]) -> list[worker.FrameOut]:
    """The batch handler: several serialized ModelInferRequests, one frame each."""
    from poolserve.service.inference.batch import run_batch

    try:
        return run_batch(models, bodies)
    except Exception as exc:  # a bug in our own path: report it, keep serving
        message = f"{type(exc).__name__}: {exc}"
        return [error_frame(i, Timings(), Failure.INTERNAL, message) for i in range(len(bodies))]


def handle_stream(
    models: Mapping[str, Model], body: bytes, seq: int
) -> Generator[worker.FrameOut, None, None]:
    """The stream handler: one serialized ModelInferRequest to a decoupled model,
    its PART frames and then one REPLY or ERROR frame."""
    from poolserve.service.contract.shm import unwrap
    from poolserve.service.contract.wire import peek_model
    from poolserve.service.inference.named import model_named
    from poolserve.service.inference.stream import stream_infer

    try:
        regions, request = unwrap(body)
        name, version = peek_model(request)
        model = model_named(models, name, version)
        yield from stream_infer(model, request, regions, seq)
    except ServingError as exc:
        yield error_frame(seq, Timings(), exc.failure, exc.message)
    except Exception as exc:  # a bug in our own path: report it, keep serving
        yield error_frame(seq, Timings(), Failure.INTERNAL, f"{type(exc).__name__}: {exc}")


def handle_sequence_end(models: Mapping[str, Model], body: bytes, seq: int) -> worker.FrameOut:
    """A SEQUENCE_END notice: the model's ``sequence_ended`` hook, one REPLY frame."""
    import json

    try:
        notice = json.loads(body)
        model = models.get(str(notice["model"]))
        if model is None:
            raise ModelNotFound(f"model '{clip(str(notice['model']))}' is not loaded")
        model.sequence_ended(notice["id"], str(notice["reason"]))
        return reply_frame(seq, Timings(), b"")
    except ServingError as exc:
        return error_frame(seq, Timings(), exc.failure, exc.message)
    except Exception as exc:  # the model's hook raised: said, and the worker serves on
        return error_frame(seq, Timings(), Failure.INTERNAL, f"{type(exc).__name__}: {exc}")


def inference_handler(models: Mapping[str, Model]) -> worker.Handler:
    handler = functools.partial(handle, models)
    handler.batch = functools.partial(handle_batch, models)  # type: ignore[attr-defined]
    handler.stream = functools.partial(handle_stream, models)  # type: ignore[attr-defined]
    handler.sequence_end = functools.partial(handle_sequence_end, models)  # type: ignore[attr-defined]
    return handler


class InferenceCargo:
    """The pool server's cargo: runtime models from their settings.

    With ``start_method`` "spawn", workers are fresh interpreters that load
    the models themselves (:mod:`poolserve.service.inference.spawned`): the zygote loads
    each model once to check it and learn its metadata, then lets it go, and
    keeps only where its settings are.
    """

    def __init__(self, settings: Sequence[ModelSettings], start_method: str = "fork") -> None:
        self.settings = settings
        self.start_method = start_method
        self.models: dict[str, Model] = {}
        self.examples: dict[str, dict[str, Array] | None] = {}
        self.sources: dict[str, Path] = {}  # spawn: what a fresh worker loads

    def load_initial(self, emit: Emit) -> None:
        # The request path's modules (protobuf, codec, numpy), imported here once
        # so that every worker shares their pages instead of importing its own.
        import poolserve.service.contract.wire  # noqa: F401

        for s in self.settings:
            self.load_one(s, emit)

    def load_one(self, settings: ModelSettings, emit: Emit) -> None:
        """Loads (or reloads) one model; a failure leaves the previous one in place."""
        from poolserve.service.inference.model import load_model, tensor_specs
        from poolserve.service.inference.warmup import warmup_inputs

        try:
            model = load_model(settings)
            policy = model.transaction_policy()  # the model's word on ModelStreamInfer
        except BaseException as exc:  # a model's load may raise anything, even SystemExit
            reason = truncate_reason(
                f"load failed: {type(exc).__name__}: {exc} (model {settings.source})"
            )
            # The whole traceback, for the log's field (never in the reason clients see).
            trace = truncate_reason("".join(traceback.format_exception(exc)))
            emit(
                {
                    "event": "model",
                    "name": settings.key,
                    "ok": False,
                    "reason": reason,
                    "traceback": trace,
                }
            )
            return
        self.models[settings.key] = model
        own_metadata = getattr(model, "own_metadata", None)  # an adapter's server's answer
        routes = custom_routes_json(model)  # before a spawn start lets go of the model
        inputs, outputs = tensor_specs(model)
        try:
            example, source = warmup_inputs(model, inputs)
        except Exception as exc:  # a model's example() or settings example is broken
            example, source = None, f"no warm-up: its example failed: {type(exc).__name__}: {exc}"
        self.examples[settings.key] = example
        if self.start_method == "spawn":  # each worker loads its own copy
            self.sources[settings.key] = settings.source
            del self.models[settings.key], model
            self.examples.pop(settings.key, None)
            source = "loaded by each spawned worker; its self-test: " + source
        log.info("model %s: self-test in each fresh worker: %s", settings.key, source)
        emit(
            {
                "event": "model",
                "name": settings.key,
                "ok": True,
                "inputs": specs_json(inputs),
                "outputs": specs_json(outputs),
                "decoupled": policy.decoupled,
                "unary": policy.unary,
                **metadata_json(own_metadata),
                **routes,
            }
        )

    def apply(self, message: Mapping[str, Any], emit: Emit) -> None:
        op = message.get("op")
        if op == "load":
            overrides = message.get("overrides") or {}
            self.live_load(str(message["path"]), emit, overrides, str(message.get("version", "")))
        elif op == "unload":
            name = str(message["name"])
            self.models.pop(name, None)
            self.examples.pop(name, None)
            self.sources.pop(name, None)
            emit({"event": "unloaded", "name": name})

    def live_load(
        self, path: str, emit: Emit, overrides: Mapping[str, Any], version: str = ""
    ) -> None:
        """Loads the model of a settings file (``version``: that version of a
        model with numbered version folders), with the fields a load's config
        overrode (``max_batch_size``, ``extra``) set over the file's."""
        from dataclasses import replace

        from poolserve.service.contract.repository import parse_model_version
        from poolserve.service.contract.settings import ConfigError

        try:
            settings = parse_model_version(Path(path), version)
        except ConfigError as exc:
            name = Path(path).parent.name
            key = f"{name}:{version}" if version else name
            emit({"event": "model", "name": key, "ok": False, "reason": str(exc)})
            return
        if overrides:
            settings = replace(settings, **overrides)
        self.load_one(settings, emit)

    def handler(self) -> worker.Handler:
        return inference_handler(self.models)

    def warmups(self, skip: Collection[str]) -> list[worker.Warmup]:
        found: list[worker.Warmup] = []
        for name, model in self.models.items():
            example = self.examples.get(name)
            if name not in skip and example is not None:
                found.append((name, functools.partial(_warm_up, model, example)))
        return found

    def start_fresh(self, sock: socket.socket, skip: Collection[str], heartbeat_s: float) -> int:
        if self.start_method != "spawn":
            return 0
        argv = [
            sys.executable,
            *interpreter_flags(),
            "-m",
            "poolserve.service.inference.spawned",
            "--sock-fd",
            str(sock.fileno()),
            "--zygote-pid",
            str(os.getpid()),
            "--heartbeat",
            str(heartbeat_s),
        ]
        for key, path in self.sources.items():
            _, _, version = key.partition(":")
            argv += ["--model", str(path), "--version", version]
        for name in skip:
            argv += ["--skip", name]
        sock.set_inheritable(True)  # the one descriptor the new process gets
        try:
            return os.posix_spawn(sys.executable, argv, os.environ)
        finally:
            sock.set_inheritable(False)

    def close(self) -> None:
        pass


WARMUP_SEQUENCE_ID = 0  # never a client's sequence: Triton's clients use 0 for "none"


def _warm_up(model: Model, example: Mapping[str, Array]) -> None:
    """The warm-up prediction. A sequence model's is a sequence of one request (its
    start and its end, id :data:`WARMUP_SEQUENCE_ID`): the model gets the control
    tensors it declares, as a client's request would fill them in, and is told the
    sequence ended right after, so it keeps no warm-up state."""
    inputs = dict(example)
    parameters: dict[str, object] = {}
    sequence = model.settings.sequence
    if sequence is not None:
        from poolserve.service.inference.controls import add_controls

        parameters = {
            "sequence_id": WARMUP_SEQUENCE_ID,
            "sequence_start": True,
            "sequence_end": True,
        }
        # a model's example may hold some of them already
        missing = [c for c in sequence.controls if c.name not in inputs]
        batched = model.settings.max_batch_size > 0
        add_controls(model.settings.name, inputs, missing, parameters, batched)
    try:
        _predict_once(model, inputs, parameters)
    finally:
        if sequence is not None:
            model.sequence_ended(WARMUP_SEQUENCE_ID, "end")


def _predict_once(model: Model, inputs: dict[str, Array], parameters: dict[str, object]) -> None:
    from poolserve.service.inference.model import check_outputs

    if model.transaction_policy().decoupled:  # its first response, if any
        produced = iter(model.predict_stream(inputs, parameters))
        try:
            first = next(produced, None)
        finally:
            close = getattr(produced, "close", None)
            if close is not None:
                close()
        if first is not None:
            check_outputs(model.settings.name, first)
        return
    check_outputs(model.settings.name, model.predict(inputs, parameters))


class InferenceZygote(ForkedZygote):
    """The pool server's zygote: forked, with the inference cargo built in the child."""

    def __init__(
        self,
        settings: Sequence[ModelSettings],
        heartbeat_s: float = 1.0,
        start_method: str = "fork",
    ) -> None:
        super().__init__(functools.partial(InferenceCargo, settings, start_method), heartbeat_s)

    def load(
        self, settings_path: Path, overrides: Mapping[str, Any] | None = None, version: str = ""
    ) -> None:
        """Asks the zygote to (re)load the model of this settings file (``version``:
        that version of a numbered model), with ``overrides`` (JSON values) set
        over the file's fields."""
        message: dict[str, Any] = {"op": "load", "path": str(settings_path)}
        if version:
            message["version"] = version
        if overrides:
            message["overrides"] = dict(overrides)
        self.command(message)


def custom_routes_json(model: object) -> dict[str, list[list[str]]]:
    """A model's custom REST endpoints in a load report (an MLServer model's
    ``@custom_handler`` methods: ``custom_routes``, (method, path) pairs), if any."""
    routes = getattr(model, "custom_routes", ())
    return {"custom_routes": [list(pair) for pair in routes]} if routes else {}


def metadata_json(own_metadata: object) -> dict[str, str]:
    """A model's own ModelMetadata answer in a load report (base64), if it has one."""
    if not isinstance(own_metadata, bytes):
        return {}
    import base64

    return {"metadata": base64.b64encode(own_metadata).decode("ascii")}
