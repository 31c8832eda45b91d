"""One batch in a worker: several ModelInferRequests, one ``predict``.

Each request is parsed and decoded on its own (a malformed one gets its own
error and leaves the batch). The rest are grouped by what makes them
compatible, checked again here on the decoded tensors (model, input names in
order, datatypes, dimensions past the first, input parameters, request
parameters other than the model's batch-safe ones): a group is concatenated
along dimension 0 (no copy for a group of one), predicted once, every output
is checked to hold the group's total rows, and split back. Each request gets
its own id, its own requested outputs and only those. An error of the
model's predict (an InvalidInput it raised, an exception, outputs with the
wrong number of rows) goes to every request of its group.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.errors import (
    Failure,
    ModelError,
    ServingError,
)
from poolserve.service.contract.rest import is_rest
from poolserve.service.contract.wire import SCHEDULING_KEYS, Wire, peek_model
from poolserve.service.inference import rest
from poolserve.service.inference.codec import decode_inputs, encode_outputs, parameters_to_dict
from poolserve.service.inference.infer import parse_request
from poolserve.service.inference.model import Array, Model, check_outputs, declared_inputs
from poolserve.service.inference.named import model_named
from poolserve.service.inference.rest import Encoder
from poolserve.service.poolcore.frames import Frame, error_frame, reply_frame
from poolserve.service.poolcore.stats import Timings

_SCHEDULING = frozenset(k.decode() for k in SCHEDULING_KEYS)


@dataclass(slots=True)
class _Member:
    index: int
    request: pb.ModelInferRequest
    inputs: dict[str, Array]
    parameters: dict[str, object]
    rows: int
    decode_ns: int
    encode: Encoder | None = None  # a REST call's reply encoder (None: protobuf)


class BatchFailure(ServingError):
    """A batch's outputs cannot be split back: INTERNAL to every request of it."""

    failure = Failure.INTERNAL


def run_batch(models: Mapping[str, Model], bodies: Sequence[Wire]) -> list[Frame]:
    """One REPLY or ERROR frame per body, each with its index as sequence number.
    A body may be a view (an inline model's batch holds its lane frames' views)."""
    frames: list[Frame] = [b""] * len(bodies)
    groups: dict[tuple[str, Any], list[_Member]] = {}
    chosen: dict[str, Model] = {}  # by key: the model each group runs on
    for index, body in enumerate(bodies):
        t0 = time.perf_counter_ns()
        try:
            name, version = peek_model(body)
            model = model_named(models, name, version)
            name = model.settings.key
            chosen[name] = model
            encode: Encoder | None = None
            if is_rest(body):  # an HTTP/REST body: its JSON and binary tensors
                request, raw, encode = rest.decode(body, model)
                inputs = decode_inputs(request, raw=list(raw), declared=declared_inputs(model))
            else:
                request = parse_request(body)
                inputs = decode_inputs(request, declared=declared_inputs(model))
            parameters = parameters_to_dict(request.parameters)
        except ServingError as exc:
            frames[index] = error_frame(index, Timings(), exc.failure, exc.message)
            continue
        except Exception as exc:  # a bug in our own path: that request only
            frames[index] = error_frame(
                index, Timings(), Failure.INTERNAL, f"{type(exc).__name__}: {exc}"
            )
            continue
        decode_ns = time.perf_counter_ns() - t0
        member = _Member(index, request, inputs, parameters, 0, decode_ns, encode)
        key = _compatibility(model, member)
        groups.setdefault((name, key if key is not None else ("alone", index)), []).append(member)
    for (name, _), members in groups.items():
        for index, frame in _run_group(chosen[name], members):
            frames[index] = frame
    return frames


def _compatibility(model: Model, member: _Member) -> tuple[Any, ...] | None:
    """What must be equal for two requests to share a batch; None: it runs alone."""
    rows = {arr.shape[0] if arr.ndim else None for arr in member.inputs.values()}
    if len(rows) != 1 or None in rows:
        return None
    member.rows = int(rows.pop() or 0)
    if member.rows < 1 or member.rows > max(1, model.settings.max_batch_size):
        return None
    safe = model.settings.batch_safe_parameters | _SCHEDULING
    tensors = tuple(
        (
            t.name,
            t.datatype,
            tuple(t.shape[1:]),
            tuple((k, v.SerializeToString()) for k, v in sorted(t.parameters.items())),
        )
        for t in member.request.inputs
    )
    params = tuple(sorted((k, repr(v)) for k, v in member.parameters.items() if k not in safe))
    return tensors, params


def _run_group(model: Model, members: list[_Member]) -> list[tuple[int, Frame]]:
    name = model.settings.name
    total = sum(m.rows for m in members)
    t1 = time.perf_counter_ns()
    try:
        if len(members) == 1:
            inputs = members[0].inputs  # one request holds the whole batch: no copy
        else:
            inputs = {
                key: np.concatenate([m.inputs[key] for m in members], axis=0)
                for key in members[0].inputs
            }
        outputs = check_outputs(name, model.predict(inputs, dict(members[0].parameters)))
        if len(members) > 1:
            _check_rows(name, inputs, outputs, total)
    except ServingError as exc:
        return [(m.index, _error(m, exc, 0)) for m in members]
    except Exception as exc:
        error = ModelError.from_exception(name, exc)
        return [(m.index, _error(m, error, 0)) for m in members]
    compute_ns = time.perf_counter_ns() - t1
    out: list[tuple[int, Frame]] = []
    start = 0
    for m in members:
        part = (
            outputs
            if len(members) == 1
            else {k: v[start : start + m.rows] for k, v in outputs.items()}
        )
        start += m.rows
        t2 = time.perf_counter_ns()
        try:
            response = pb.ModelInferResponse(
                model_name=name, model_version=model.settings.version, id=m.request.id
            )
            if m.encode is None:
                encode_outputs(m.request, part, response)
                body = response.SerializeToString()
            else:
                views: list[Any] = []
                encode_outputs(m.request, part, response, raw=views)
                body = b"".join(m.encode(response, views))
        except ServingError as exc:
            out.append((m.index, _error(m, exc, compute_ns)))
            continue
        timings = Timings(m.decode_ns, compute_ns, time.perf_counter_ns() - t2)
        out.append((m.index, reply_frame(m.index, timings, body)))
    return out


def _check_rows(
    name: str, inputs: Mapping[str, Array], outputs: Mapping[str, Array], total: int
) -> None:
    wrong = {k: v.shape for k, v in outputs.items() if v.ndim == 0 or v.shape[0] != total}
    if wrong:
        shapes = ", ".join(f"'{k}' {list(s)}" for k, s in wrong.items())
        given = ", ".join(f"'{k}' {list(v.shape)}" for k, v in inputs.items())
        raise BatchFailure(
            f"model '{name}' returned outputs {shapes} for a batch of {total} rows "
            f"(inputs {given}): every output of a batched model must have the batch's "
            f"rows along dimension 0"
        )


def _error(member: _Member, exc: ServingError, compute_ns: int) -> bytes:
    return error_frame(
        member.index, Timings(member.decode_ns, compute_ns, 0), exc.failure, exc.message
    )
