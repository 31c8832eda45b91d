"""The WorkerPool's cargo: user ``load`` callables in the zygote, ``score`` calls in workers.

This module runs on both sides of a :class:`~poolserve.service.workerpool.pool.WorkerPool`:

- in the zygote, started by a clean exec as ``python -m
  poolserve.service.workerpool.scoring`` (:func:`main`): :class:`ScoreCargo` unpickles
  each model's ``(load, score)`` pair, calls ``load()`` once, and keeps the
  model for the workers it forks (copy-on-write);
- in each worker: :class:`ScoreHandler` decodes one call, runs
  ``score(model, *args, **kwargs)``, encodes what it returned or raised;
- in the host: :func:`encode_call` and :func:`decode_outcome`.

The callables are pickled by reference, so they must be importable by name
in a fresh interpreter: module-level functions, or ``functools.partial`` of
them with picklable arguments. Functions defined in the host's main script
work the way they do with multiprocessing's spawn start method: the zygote
imports the script as ``__mp_main__``, so its pool-starting code must sit
under ``if __name__ == "__main__":``.

Wire formats (little-endian; payloads as in :mod:`poolserve.service.workerpool.payload`):
a call is ``u64 job | u16 name length | model name | payload((args, kwargs))``;
an outcome is ``u8 kind | payload``, kind 0 with the returned value, kind 1
with ``{"type", "message", "traceback", "exception"}`` of what was raised.
"""

from __future__ import annotations

import argparse
import base64
import functools
import os
import pickle
import runpy
import socket
import struct
import sys
import time
import traceback
import types
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from poolserve.service.contract.errors import Failure, ModelError, ModelNotReady
from poolserve.service.contract.framing import Payload
from poolserve.service.poolcore.frames import error_frame, reply_frame
from poolserve.service.poolcore.stats import Timings
from poolserve.service.poolcore.worker import FrameOut, Handler, Warmup
from poolserve.service.poolcore.zygote import Emit, exec_arguments, exec_main, truncate_reason
from poolserve.service.workerpool.payload import Encoded, PayloadError, SegmentDir, dumps, loads

_CALL = struct.Struct("<QH")
_KIND = struct.Struct("<B")
RETURNED = 0
RAISED = 1

MAX_CODE = 40 * 1024  # a pickled (load, score) pair, base64'd into one control message

_in_zygote = False  # true in the exec'd zygote and the workers forked from it


def in_zygote() -> bool:
    return _in_zygote


class ScoreError(ModelError):
    """``score`` raised in a worker: the original type name, message and traceback.

    ``type_name`` is the exception's qualified name (``ValueError``,
    ``mypkg.errors.BadInput``), ``remote_message`` its ``str()``,
    ``remote_traceback`` the worker's formatted traceback (also attached as a
    note, so it prints with this exception). ``original`` is the exception
    itself when it could be pickled back, and is then this one's ``__cause__``.
    """

    def __init__(
        self,
        model: str,
        type_name: str,
        message: str,
        remote_traceback: str = "",
        original: BaseException | None = None,
    ) -> None:
        super().__init__(f"model '{model}': score raised {type_name}: {message}")
        self.model = model
        self.type_name = type_name
        self.remote_message = message
        self.remote_traceback = remote_traceback
        self.original = original
        if remote_traceback:
            self.add_note(f"Traceback in the pool worker:\n{remote_traceback.rstrip()}")


class ModelLoadError(ModelNotReady):
    """A model's ``load`` failed in the zygote (or its callables could not be imported)."""

    def __init__(self, model: str, reason: str) -> None:
        super().__init__(f"model '{model}' failed to load: {reason}")
        self.model = model
        self.reason = reason


# -- the host's side ---------------------------------------------------------


def encode_call(
    job: int, model: str, args: tuple[Any, ...], kwargs: dict[str, Any], segments: SegmentDir | None
) -> Encoded:
    name = model.encode()
    head = _CALL.pack(job, len(name)) + name
    return dumps((args, kwargs), segments, prefix=f"{job}-a", head=head)


def batch_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, bytes]:
    """(rows, key) of a call to a batching model; rows 0: it cannot batch (it
    has keyword arguments, or a positional argument that is not an array with
    a first dimension, or arrays that disagree on it)."""
    if kwargs or not args:
        return 0, b""
    rows: set[int] = set()
    parts: list[str] = []
    for arg in args:
        shape = getattr(arg, "shape", None)
        dtype = getattr(arg, "dtype", None)
        if not isinstance(shape, tuple) or not shape or dtype is None:
            return 0, b""
        rows.add(int(shape[0]))
        parts.append(f"{type(arg).__module__}.{type(arg).__qualname__}:{dtype.str}:{shape[1:]}")
    if len(rows) != 1:
        return 0, b""
    return rows.pop(), "|".join(parts).encode()


def decode_outcome(model: str, body: Payload, segments: SegmentDir | None) -> Any:
    """The value ``score`` returned; raises :class:`ScoreError` for what it raised."""
    try:
        (kind,) = _KIND.unpack_from(body)
        value = loads(memoryview(body)[_KIND.size :], segments, unlink=True)
    except Exception as exc:
        raise ModelError(
            f"model '{model}': the result of score cannot be unpickled in this process: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if kind == RETURNED:
        return value
    if kind != RAISED or not isinstance(value, dict):
        raise ModelError(f"model '{model}': the worker sent an outcome of unknown kind {kind}")
    original: BaseException | None = None
    if value.get("exception"):
        try:
            loaded = pickle.loads(value["exception"])
            original = loaded if isinstance(loaded, BaseException) else None
        except Exception:  # a custom exception that does not unpickle: the text is enough
            original = None
    error = ScoreError(
        model, str(value["type"]), str(value["message"]), str(value["traceback"]), original
    )
    raise error from original


def job_of_segment(name: str) -> int:
    """The job a segment belongs to (its name starts with the job number)."""
    head, _, _ = name.partition("-")
    return int(head) if head.isdigit() else -1


# -- the worker's side -------------------------------------------------------


@dataclass(frozen=True)
class Loaded:
    model: Any
    score: Callable[..., Any]


def _type_name(exc: BaseException) -> str:
    cls = type(exc)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def _raised(exc: BaseException) -> dict[str, Any]:
    try:
        original = pickle.dumps(exc, protocol=5)
    except Exception:
        original = b""
    return {
        "type": _type_name(exc),
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
        "exception": original,
    }


class ScoreHandler:
    """A worker's request handler: one pickled call in, one outcome out; or a
    batch of calls to one model (:meth:`batch`), its arrays stacked for one
    ``score``."""

    def __init__(self, models: Mapping[str, Loaded], segments: SegmentDir | None) -> None:
        self.models = models
        self.segments = segments

    def batch(self, bodies: list[bytes]) -> list[FrameOut]:
        """One frame per call: the calls' positional arrays concatenated along
        dimension 0, ``score`` once, its result split back by rows. A call that
        cannot be decoded, or does not fit the first one's key, runs alone."""
        import numpy as np  # the calls hold arrays: numpy is loaded already

        frames: list[FrameOut] = [b""] * len(bodies)
        members: list[tuple[int, int, tuple[Any, ...]]] = []  # index, job, args
        name, key = "", b""
        t0 = time.perf_counter_ns()
        for i, body in enumerate(bodies):
            try:
                job, name_len = _CALL.unpack_from(body)
                called = body[_CALL.size : _CALL.size + name_len].decode()
                args, kwargs = loads(memoryview(body)[_CALL.size + name_len :], self.segments)
            except Exception:
                frames[i] = self(body, i)  # says what is wrong with it
                continue
            rows, its_key = batch_key(args, kwargs)
            if not members:
                name, key = called, its_key
            if rows == 0 or called != name or its_key != key or called not in self.models:
                del args, kwargs
                frames[i] = self(body, i)
                continue
            members.append((i, job, args))
        args = kwargs = None  # the members hold what they need
        if not members:
            return frames
        loaded = self.models[name]
        sizes = [len(args[0]) for _, _, args in members]
        t1 = time.perf_counter_ns()
        try:
            stacked = [
                np.concatenate([args[k] for _, _, args in members])
                for k in range(len(members[0][2]))
            ]
            value = loaded.score(loaded.model, *stacked)
            del stacked
            parts = _split(value, sizes)
        except BaseException as exc:  # the model's own code may raise anything
            raised = _raised(exc)
            t2 = time.perf_counter_ns()
            for i, job, _ in members:
                timings = Timings(t1 - t0, t2 - t1, 0)
                frames[i] = reply_frame(i, timings, self._encode(job, RAISED, raised))
            return frames
        members_jobs = [(i, job) for i, job, _ in members]
        del members
        t2 = time.perf_counter_ns()
        for (i, job), part in zip(members_jobs, parts, strict=True):
            t3 = time.perf_counter_ns()
            encoded = self._encode(job, RETURNED, part)
            frames[i] = reply_frame(
                i, Timings(t1 - t0, t2 - t1, time.perf_counter_ns() - t3), encoded
            )
        return frames

    def __call__(self, body: bytes, seq: int) -> FrameOut:
        t0 = time.perf_counter_ns()
        try:
            job, name_len = _CALL.unpack_from(body)
            name = body[_CALL.size : _CALL.size + name_len].decode()
            args, kwargs = loads(memoryview(body)[_CALL.size + name_len :], self.segments)
        except (PayloadError, struct.error, UnicodeDecodeError) as exc:
            return error_frame(seq, Timings(), Failure.INVALID_INPUT, f"malformed call: {exc}")
        except Exception as exc:
            message = (
                f"the arguments cannot be unpickled in the pool worker: {type(exc).__name__}: "
                f"{exc} (their classes must be importable by name in the pool's processes)"
            )
            return error_frame(seq, Timings(), Failure.INVALID_INPUT, message)
        loaded = self.models.get(name)
        if loaded is None:
            return error_frame(
                seq, Timings(), Failure.NOT_FOUND, f"model '{name}' is not loaded in this worker"
            )
        t1 = time.perf_counter_ns()
        kind, value = RETURNED, None
        try:
            value = loaded.score(loaded.model, *args, **kwargs)
        except BaseException as exc:  # the model's own code may raise anything
            kind, value = RAISED, _raised(exc)
        del args, kwargs  # arguments mapped from shared memory are released now
        t2 = time.perf_counter_ns()
        encoded = self._encode(job, kind, value)
        t3 = time.perf_counter_ns()
        return reply_frame(seq, Timings(t1 - t0, t2 - t1, t3 - t2), encoded)

    def _encode(self, job: int, kind: int, value: Any) -> bytes:
        prefix = f"{job}-{os.getpid()}-r"
        try:
            try:
                return dumps(value, self.segments, prefix, head=_KIND.pack(kind)).data
            except OSError:  # shared memory unusable (its folder gone...): inline instead
                return dumps(value, None, head=_KIND.pack(kind)).data
        except Exception as exc:
            failure = TypeError(f"the value score returned cannot be pickled: {exc}")
            return dumps(_raised(failure), None, head=_KIND.pack(RAISED)).data


def _split(value: Any, sizes: list[int]) -> list[Any]:
    """A batched score's result back per call: an array, or a tuple, list or
    dict of arrays, each with the batch's rows along dimension 0."""
    total = sum(sizes)
    if isinstance(value, tuple | list):
        columns = [_split(v, sizes) for v in value]
        return [type(value)(column[i] for column in columns) for i in range(len(sizes))]
    if isinstance(value, dict):
        split = {k: _split(v, sizes) for k, v in value.items()}
        return [{k: parts[i] for k, parts in split.items()} for i in range(len(sizes))]
    shape = getattr(value, "shape", None)
    if not isinstance(shape, tuple) or not shape or shape[0] != total:
        raise ValueError(
            f"score of a batched model returned {type(value).__name__} of shape {shape} for a "
            f"batch of {total} rows: it must return arrays (or a tuple, list or dict of "
            "arrays) with the batch's rows along dimension 0"
        )
    out, start = [], 0
    for size in sizes:
        out.append(value[start : start + size].copy())  # a caller's own rows, not a view
        start += size
    return out


# -- the zygote's side ---------------------------------------------------------


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


class ScoreCargo:
    """The zygote's models: what each ``load()`` returned, with its ``score``."""

    def __init__(self, segments: SegmentDir | None) -> None:
        self.segments = segments
        self.models: dict[str, Loaded] = {}
        self.examples: dict[str, tuple[Any, ...]] = {}
        self.main_path: str | None = None
        self.main_name: str | None = None
        self.main_imported = False

    def load_initial(self, emit: Emit) -> None:
        pass  # the host sends its models as load ops, after "prepare"

    def apply(self, message: Mapping[str, Any], emit: Emit) -> None:
        op = message.get("op")
        if op == "prepare":
            self.prepare(message)
        elif op == "load":
            example = message.get("example")
            self.load(
                str(message["name"]),
                base64.b64decode(message["code"]),
                emit,
                base64.b64decode(example) if example else None,
            )
        elif op == "unload":
            name = str(message["name"])
            self.models.pop(name, None)
            self.examples.pop(name, None)
            emit({"event": "unloaded", "name": name})

    def prepare(self, message: Mapping[str, Any]) -> None:
        """Takes the host's import path, so the user's modules import here too."""
        sys.path[:] = [str(p) for p in message.get("sys_path", [])]
        self.main_path = message.get("main_path")
        self.main_name = message.get("main_name")

    def import_main(self) -> None:
        """Imports the host's main script as ``__mp_main__`` (as multiprocessing's spawn does)."""
        if self.main_imported:
            return
        self.main_imported = True
        if self.main_name and not self.main_name.endswith("__main__"):
            namespace = runpy.run_module(self.main_name, run_name="__mp_main__", alter_sys=True)
        elif self.main_path:
            namespace = runpy.run_path(self.main_path, run_name="__mp_main__")
        else:
            return
        module = types.ModuleType("__mp_main__")
        module.__dict__.update(namespace)
        sys.modules["__main__"] = sys.modules["__mp_main__"] = module

    def load(self, name: str, code: bytes, emit: Emit, example: bytes | None = None) -> None:
        try:
            if b"__main__" in code or (example is not None and b"__main__" in example):
                self.import_main()
            load, score = pickle.loads(code)
            args = pickle.loads(example) if example is not None else None
        except BaseException as exc:
            reason = (
                "its load/score callables cannot be imported in the pool's zygote (a fresh "
                "interpreter): they must be importable module-level functions or partials of "
                f"them. {type(exc).__name__}: {exc}"
            )
            emit({"event": "model", "name": name, "ok": False, "reason": truncate_reason(reason)})
            return
        threads = _threads()  # after the imports: numpy's OpenBLAS threads are fork-safe
        try:
            model = load()
        except BaseException as exc:  # a user's load may raise anything, even SystemExit
            reason = f"load raised {_type_name(exc)}: {exc}\n" + "".join(
                traceback.format_exception(exc)
            )
            emit({"event": "model", "name": name, "ok": False, "reason": truncate_reason(reason)})
            return
        self.models[name] = Loaded(model, score)
        if args is not None:
            self.examples[name] = tuple(args)
        else:
            self.examples.pop(name, None)
        warning = ""
        extra = _threads() - threads
        if extra > 0:
            warning = (
                f"load left {extra} new thread(s) running in the zygote; workers are forked "
                "from it and get only the forking thread, so the library must be fork-safe"
            )
        emit({"event": "model", "name": name, "ok": True, "reason": warning})

    def handler(self) -> Handler:
        return ScoreHandler(self.models, self.segments)

    def start_fresh(self, sock: socket.socket, skip: Collection[str], heartbeat_s: float) -> int:
        return 0  # WorkerPool workers are always forked from this zygote

    def warmups(self, skip: Collection[str]) -> list[Warmup]:
        found: list[Warmup] = []
        for name, args in self.examples.items():
            loaded = self.models.get(name)
            if loaded is not None and name not in skip:
                found.append((name, functools.partial(loaded.score, loaded.model, *args)))
        return found

    def close(self) -> None:
        if self.segments is not None:
            self.segments.remove()  # our host is gone or done: nobody reads them any more


def main(argv: list[str]) -> NoReturn:
    global _in_zygote
    _in_zygote = True
    common = exec_arguments(argv)
    parser = argparse.ArgumentParser(prog="poolserve-zygote", add_help=False)
    parser.add_argument("--shm-dir", default="")
    parser.add_argument("--shm-threshold", type=int, default=0)
    own, _ = parser.parse_known_args(argv)
    segments = SegmentDir(Path(own.shm_dir), own.shm_threshold) if own.shm_dir else None
    exec_main(common.ctrl_fd, common.parent_pid, common.heartbeat, ScoreCargo(segments))


if __name__ == "__main__":
    # Run as a script, this file is ``__main__``; the zygote runs the module
    # under its real name, so that there is one copy of its classes and state.
    from poolserve.service.workerpool import scoring

    scoring.main(sys.argv[1:])
