"""An ensemble run in one worker: the *chain* envelope the router sends a pool.

When every step of an ensemble is a model of one pool that a worker runs
alone (no dynamic batching, no sequence, no response cache, not inline, not
decoupled, not an MLServer adapter), the router does not forward each step:
it sends the pool one INFER whose body is the ensemble's request in a chain
envelope (:func:`wrap`): :data:`MARK`, the plan's length, the plan
(:class:`ChainPlan` as JSON), then the client's ModelInferRequest. The pool
schedules it as one job of the first step's model (every step's model must
be ready there), and the worker that takes it runs every step on the models
it already holds, the tensors passed between them in its memory
(:mod:`poolserve.service.inference.chain`). One round trip router -> pool ->
worker instead of one per step.

The mark starts with a zero byte, which no serialized protobuf message does:
a front door refuses a client's request that starts with one
(``contract.shm.forged``), so only the router sends chains.
Standard library only: the router, the pool and the worker read it.
"""

from __future__ import annotations

import functools
import json
import struct
from dataclasses import dataclass
from typing import Any

from poolserve.service.contract.errors import InvalidInput
from poolserve.service.contract.wire import Wire

MARK = b"\x00chain"
REFUSED = "this pool does not run the ensemble in one worker"
"""How a pool's refusal to run a chain begins (a step's model runs inline,
batched, in a sequence, decoupled or cached there): the router then runs the
steps itself, and remembers."""
_LENGTH = struct.Struct("<I")


@dataclass(frozen=True)
class ChainStep:
    model: str
    version: str
    input_map: tuple[tuple[str, str], ...]  # (step input, ensemble tensor)
    output_map: tuple[tuple[str, str], ...]  # (step output, ensemble tensor)


@dataclass(frozen=True)
class ChainPlan:
    """What a worker needs to run an ensemble: its name and version (the
    reply's), its inputs and outputs, and its steps in an order that runs
    each after the steps it needs."""

    name: str
    version: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    steps: tuple[ChainStep, ...]

    def step_name(self, index: int) -> str:
        """How messages name a step, as the router names one: its number (from 1) and its model."""
        return f"ensemble '{self.name}' step {index + 1} (model '{self.steps[index].model}')"

    def encode(self) -> bytes:
        return json.dumps(
            {
                "name": self.name,
                "version": self.version,
                "inputs": list(self.inputs),
                "outputs": list(self.outputs),
                "steps": [
                    [
                        s.model,
                        s.version,
                        [list(p) for p in s.input_map],
                        [list(p) for p in s.output_map],
                    ]
                    for s in self.steps
                ],
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> ChainPlan:
        try:
            raw: Any = json.loads(data)
            plan = cls(
                name=str(raw["name"]),
                version=str(raw["version"]),
                inputs=tuple(str(n) for n in raw["inputs"]),
                outputs=tuple(str(n) for n in raw["outputs"]),
                steps=tuple(
                    ChainStep(
                        str(model),
                        str(version),
                        tuple((str(a), str(b)) for a, b in ins),
                        tuple((str(a), str(b)) for a, b in outs),
                    )
                    for model, version, ins, outs in raw["steps"]
                ),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidInput(f"malformed ensemble chain: {exc}") from None
        if not plan.steps:
            raise InvalidInput("malformed ensemble chain: no steps")
        return plan


def wrap(plan: bytes, request: bytes) -> bytes:
    """The request in a chain envelope, ``plan`` being :meth:`ChainPlan.encode`'s bytes."""
    return b"".join((MARK, _LENGTH.pack(len(plan)), plan, request))


def is_chain(data: Wire) -> bool:
    return data[: len(MARK)] == MARK


def unwrap(data: Wire) -> tuple[ChainPlan, Wire]:
    """The plan and the ensemble's request of a chain envelope."""
    start = len(MARK) + _LENGTH.size
    if len(data) < start:
        raise InvalidInput("malformed ensemble chain: truncated")
    (length,) = _LENGTH.unpack_from(data, len(MARK))
    if start + length > len(data):
        raise InvalidInput("malformed ensemble chain: truncated")
    return _decoded(bytes(data[start : start + length])), data[start + length :]


@functools.lru_cache(maxsize=256)
def _decoded(plan: bytes) -> ChainPlan:
    """A plan read once per process: a router sends the same bytes on every call
    of an ensemble (a malformed one raises, and is not kept)."""
    return ChainPlan.decode(plan)
