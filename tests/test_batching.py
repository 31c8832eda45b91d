"""Adaptive batching end to end, with real workers: every caller gets exactly
its own rows back, whatever else shares its batch; a batch fails as a whole
only for what the batch did (wrong row count), never for one caller's bad
input; deadlines and cancellations of a forming batch, a worker killed in a
batch; batch_stats. Properties, never timings: a blocker call holds the one
worker while the calls under test queue, so they must form batches."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest

from poolserve.protos import inference_pb2 as pb
from poolserve.protos import inference_pb2_grpc as pbg
from poolserve.service.contract.batching import BatchPolicy, batch_settings, peek_batch
from poolserve.service.contract.settings import ConfigError
from poolserve.service.inference.codec import decode_outputs, encode_inputs

from batch_models import rows_model
from serving import Serving, pool_status, wait_serving

INFER = "/inference.GRPCInferenceService/ModelInfer"
OUTPUTS = ("DOUBLE", "ROWSUM", "BATCH", "NAME")


def request(
    model: str,
    rows: np.ndarray,
    outputs: tuple[str, ...] = (),
    rid: str = "",
    **params: int,
) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name=model, id=rid)
    encode_inputs({"INPUT0": rows}, req, raw=True)
    for name in outputs:
        req.outputs.add(name=name)
    for key, value in params.items():
        req.parameters[key].int64_param = value
    return req


def logged(log: Path) -> list[dict[str, object]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def ran_rows(log: Path) -> set[float]:
    return {float(v) for line in logged(log) for v in line["rows"]}  # type: ignore[attr-defined]


async def wait_for(predicate: object, what: str, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < end, what
        await asyncio.sleep(0.02)  # polling a status, not a readiness handshake


async def queued(serving: Serving, depth: int) -> None:
    end = time.monotonic() + 60
    while (await pool_status(serving)).queue_depth < depth:  # the status has no event
        assert time.monotonic() < end, f"the queue never held {depth} calls"
        await asyncio.sleep(0.02)


async def hold_worker(serving: Serving, call: grpc.aio.UnaryUnaryMultiCallable) -> asyncio.Future:
    """The one worker runs model 'blocker' for 5 s (its own model: the service
    time of 'rows' stays short); returns once the worker is busy."""
    body = request("blocker", np.full((1, 4), -1.0, np.float32), hold_ms=5000)
    blocker = asyncio.ensure_future(call(body.SerializeToString(), timeout=60))
    end = time.monotonic() + 60
    while not any(w.state == "busy" for w in (await pool_status(serving)).workers):
        assert time.monotonic() < end, "the blocker never reached the worker"
        await asyncio.sleep(0.01)
    return blocker


@dataclass
class Caller:
    """One concurrent caller and what it must get back."""

    number: int
    rows: np.ndarray
    outputs: tuple[str, ...]
    kind: str = "ok"  # ok | expire | cancel | malformed | wrongtype
    future: asyncio.Future | None = field(default=None, repr=False)

    @property
    def tags(self) -> set[float]:
        return {float(v) for v in self.rows[:, 0]}


def make_callers(rng: random.Random, count: int, kinds: list[str]) -> list[Caller]:
    callers = []
    for n in range(count):
        size = rng.choice([1, 1, 2, 3])
        first = 1000.0 * (n + 1) + np.arange(size, dtype=np.float32)  # distinct in all callers
        rows = np.column_stack([first] + [first * (k + 2) for k in range(3)]).astype(np.float32)
        outputs = tuple(o for o in OUTPUTS if rng.random() < 0.5)
        callers.append(Caller(n, rows, outputs, kinds[n % len(kinds)]))
    rng.shuffle(callers)
    return callers


def body_of(caller: Caller) -> bytes:
    rid = f"caller-{caller.number}"
    if caller.kind == "wrongtype":
        wrong = caller.rows.astype(np.int32)
        return request("rows", wrong, caller.outputs, rid).SerializeToString()
    req = request("rows", caller.rows, caller.outputs, rid)
    if caller.kind == "malformed":  # same shape and datatype, too few bytes
        req.raw_input_contents[0] = req.raw_input_contents[0][:-4]
    return req.SerializeToString()


def check_own_rows(caller: Caller, reply: bytes, model: str = "rows") -> int:
    """Asserts the reply holds exactly this caller's rows, outputs and id;
    returns the size of the batch it ran in."""
    response = pb.ModelInferResponse.FromString(reply)
    assert response.id == f"caller-{caller.number}"
    assert response.model_name == model
    got = decode_outputs(response)
    wanted = caller.outputs or OUTPUTS
    assert [o.name for o in response.outputs] == list(wanted), (caller, response.outputs)
    x = caller.rows
    expect = {
        "DOUBLE": x * 2,
        "ROWSUM": x.sum(axis=1),
        "NAME": np.array([f"row {v:g}".encode() for v in x[:, 0]], dtype=object),
    }
    for name in wanted:
        if name in expect:
            np.testing.assert_array_equal(got[name], expect[name], err_msg=f"{caller} {name}")
    batch = (
        int(got["BATCH"][0]) if "BATCH" in got else 0  # not requested: the caller does not learn it
    )
    if "BATCH" in got:
        assert got["BATCH"].shape == (len(x),) and batch >= len(x)
    return batch


def test_concurrent_callers_get_exactly_their_own_rows(tmp_path: Path) -> None:
    """Rounds of concurrent callers queued behind a blocker: distinct rows,
    different requested outputs, some expiring in the queue, some cancelled,
    some with bad input. Each good caller gets its own rows only; the expired
    and cancelled never run; bad input fails only its sender; batches formed;
    batch_stats count them."""
    repo = tmp_path / "repo"
    log = tmp_path / "rows.log"
    rows_model(repo, "rows", log)
    rows_model(repo, "blocker", tmp_path / "blocker.log")
    kinds = ["ok", "ok", "expire", "ok", "cancel", "ok", "malformed", "ok", "wrongtype"]

    async def round_(serving: Serving, call: grpc.aio.UnaryUnaryMultiCallable, seed: int) -> int:
        callers = make_callers(random.Random(seed), 27, kinds)
        blocker = await hold_worker(serving, call)
        for caller in callers:
            timeout = 1.0 if caller.kind == "expire" else 60
            caller.future = asyncio.ensure_future(call(body_of(caller), timeout=timeout))
        # all but the expiring ones, which may have left already
        await queued(serving, sum(c.kind != "expire" for c in callers))
        for caller in callers:
            if caller.kind == "cancel":
                assert caller.future is not None
                caller.future.cancel()
        assert not blocker.done(), "the blocker ended before the calls were queued"
        await blocker
        biggest = 0
        for caller in callers:
            assert caller.future is not None
            if caller.kind == "cancel":
                continue
            if caller.kind == "ok":
                biggest = max(biggest, check_own_rows(caller, await caller.future))
                continue
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await caller.future
            code = info.value.code()
            if caller.kind == "expire":
                assert code == grpc.StatusCode.DEADLINE_EXCEEDED, info.value
            else:
                assert code == grpc.StatusCode.INVALID_ARGUMENT, info.value
        ran = ran_rows(log)
        for caller in callers:
            if caller.kind in ("expire", "cancel"):
                assert not caller.tags & ran, f"{caller.kind} caller {caller.number} ran"
        return biggest

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            call = channel.unary_unary(INFER)
            biggest = [await round_(serving, call, seed) for seed in (1, 2, 3)]
            assert max(biggest) > 3, f"no batch formed behind the blocker: {biggest}"
            # natural concurrency, no blocker: still each caller's own rows
            callers = make_callers(random.Random(9), 40, ["ok"])
            replies = await asyncio.gather(*(call(body_of(c), timeout=60) for c in callers))
            for caller, reply in zip(callers, replies, strict=True):
                check_own_rows(caller, reply)
            stats = await pbg.GRPCInferenceServiceStub(channel).ModelStatistics(
                pb.ModelStatisticsRequest(name="rows")
            )
            model = stats.model_stats[0]
            sizes = {b.batch_size: b.compute_infer.count for b in model.batch_stats}
            assert max(sizes) > 3, sizes
            assert sum(sizes.values()) == model.execution_count, (sizes, model.execution_count)
            assert model.execution_count < model.inference_count
            assert all(b.compute_infer.ns > 0 for b in model.batch_stats)

    with Serving(repo, tmp_path / "run", workers=1) as serving:
        asyncio.run(main(serving))


def test_wrong_row_count_fails_the_whole_batch_clearly(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    rows_model(repo, "short", tmp_path / "short.log", short=1)
    rows_model(repo, "blocker", tmp_path / "blocker.log")

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            call = channel.unary_unary(INFER)
            blocker = await hold_worker(serving, call)
            calls = [
                asyncio.ensure_future(
                    call(
                        request("short", np.full((2, 4), n, np.float32)).SerializeToString(),
                        timeout=60,
                    )
                )
                for n in range(4)
            ]
            await queued(serving, 4)
            assert not blocker.done(), "the blocker ended before the calls were queued"
            for future in calls:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await future
                assert info.value.code() == grpc.StatusCode.INTERNAL, info.value
                details = info.value.details() or ""
                assert "model 'short'" in details and "batch of 8 rows" in details, details
                assert "'DOUBLE' [7, 4]" in details and "'INPUT0' [8, 4]" in details, details

    with Serving(repo, tmp_path / "run", workers=1) as serving:
        asyncio.run(main(serving))


def test_worker_killed_during_a_batch_retries_it_once(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    log = tmp_path / "rows.log"
    rows_model(repo, "rows", log)
    rows_model(repo, "blocker", tmp_path / "blocker.log")

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            call = channel.unary_unary(INFER)
            blocker = await hold_worker(serving, call)
            callers = make_callers(random.Random(5), 6, ["ok"])
            for caller in callers:
                body = request("rows", caller.rows, caller.outputs, f"caller-{caller.number}")
                body.parameters["hold_ms"].int64_param = 1500  # the same in all: one batch
                caller.future = asyncio.ensure_future(call(body.SerializeToString(), timeout=90))
            await queued(serving, len(callers))
            assert not blocker.done(), "the blocker ended before the calls were queued"

            def batch_lines() -> list[dict[str, object]]:
                return [line for line in logged(log) if len(line["rows"]) > 1]  # type: ignore[arg-type]

            await wait_for(lambda: batch_lines(), "the batch never started")
            first = batch_lines()[0]
            os.kill(int(first["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
            for caller in callers:
                assert caller.future is not None
                check_own_rows(caller, await caller.future)
            assert blocker.done()
            pids = {line["pid"] for line in batch_lines()}
            assert len(pids) >= 2, "the batch was not run again on another worker"
            # every predict is logged before it holds: the killed batch's callers
            # ran exactly twice (the killed run, one retry), the others once
            killed = set(first["rows"])  # type: ignore[call-overload]
            runs = logged(log)
            for caller in callers:
                tag = float(caller.rows[0, 0])
                ran = [line for line in runs if tag in line["rows"]]  # type: ignore[operator]
                assert len(ran) == (2 if tag in killed else 1), (caller.number, ran)
                if tag in killed:
                    assert ran[1]["pid"] != first["pid"], ran

    with Serving(repo, tmp_path / "run", workers=1) as serving:
        asyncio.run(main(serving))


def test_inline_model_batches_the_same_way(tmp_path: Path) -> None:
    """parallel_workers 0: calls queued while the model's thread is busy run
    as one batch, each caller with its own rows and outputs."""
    repo = tmp_path / "repo"
    log = tmp_path / "rows.log"
    folder = rows_model(repo, "rows", log)
    settings = json.loads((folder / "model-settings.json").read_text())
    (folder / "model-settings.json").write_text(json.dumps({**settings, "parallel_workers": 0}))

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            call = channel.unary_unary(INFER)
            hold = request("rows", np.full((1, 4), -1.0, np.float32), hold_ms=4000)
            blocker = asyncio.ensure_future(call(hold.SerializeToString(), timeout=60))
            await wait_for(lambda: -1.0 in ran_rows(log), "the blocker never ran")
            callers = make_callers(random.Random(7), 12, ["ok"])
            futures = [asyncio.ensure_future(call(body_of(c), timeout=60)) for c in callers]
            await queued(serving, len(callers))
            assert not blocker.done(), "the blocker ended before the calls were queued"
            sizes = [check_own_rows(c, await f) for c, f in zip(callers, futures, strict=True)]
            batches = [line for line in logged(log) if len(line["rows"]) > 1]  # type: ignore[arg-type]
            assert any(len(line["rows"]) > 3 for line in batches), (sizes, batches)  # type: ignore[arg-type]
            assert not any(-1.0 in line["rows"] for line in batches)  # type: ignore[operator]

    with Serving(repo, tmp_path / "run", workers=1) as serving:
        asyncio.run(main(serving))


# -- the batch key and the settings, without processes -----------------------


def serialized(rows: np.ndarray, **params: int) -> bytes:
    return request("m", rows, **params).SerializeToString()


def test_batch_key_separates_what_cannot_share_a_batch() -> None:
    base = peek_batch(serialized(np.zeros((3, 4), np.float32)))
    assert base is not None and base[0] == 3
    same = peek_batch(serialized(np.ones((1, 4), np.float32), priority=2))
    assert same is not None and same == (1, base[1])  # scheduling parameters aside
    for other in (
        serialized(np.zeros((3, 5), np.float32)),
        serialized(np.zeros((3, 4), np.float64)),
        serialized(np.zeros((3, 4), np.float32), scale=2),
    ):
        peeked = peek_batch(other)
        assert peeked is not None and peeked[1] != base[1]
    safe = peek_batch(serialized(np.zeros((3, 4), np.float32), scale=2), frozenset({"scale"}))
    assert safe == (3, base[1])
    assert peek_batch(serialized(np.float32(1.0).reshape(()))) is None  # a scalar runs alone
    req = request("m", np.zeros((2, 4), np.float32))
    encode_inputs({"INPUT1": np.zeros((3, 4), np.float32)}, req, raw=True)
    assert peek_batch(req.SerializeToString()) is None  # inputs disagree on dimension 0


def test_batch_settings_are_validated_with_clear_errors() -> None:
    assert batch_settings("s", 32, 0.002, {"preferred_batch_sizes": [8, 16]}) == (
        32,
        0.002,
        (8, 16),
        frozenset(),
    )
    for size, wait, extra, words in (
        (-1, 0, {}, "max_batch_size"),
        ("8", 0, {}, "max_batch_size"),
        (8, -0.1, {}, "max_batch_time"),
        (8, "fast", {}, "max_batch_time"),
        (8, 0, {"preferred_batch_sizes": [9]}, "preferred_batch_sizes"),
        (1, 0, {"preferred_batch_sizes": [1]}, "preferred_batch_sizes"),
        (8, 0, {"batch_safe_parameters": "x"}, "batch_safe_parameters"),
    ):
        with pytest.raises(ConfigError) as info:
            batch_settings("s", size, wait, extra)
        assert words in str(info.value)
    policy = BatchPolicy(32, 0.002, (8,))
    assert policy.full(8) and policy.full(32) and not policy.full(9)


def test_peeks_read_a_request_given_as_a_view_of_its_frame() -> None:
    """A large request reaches the pool as a memoryview of its lane frame: the
    batch key and the sequence controls peeked from it are those of its bytes
    (a view's slices have no .decode and are no ``bytes``)."""
    from poolserve.service.contract.sequence import peek_sequence

    request = pb.ModelInferRequest(model_name="m")
    request.parameters["sequence_id"].string_param = "abc"
    request.parameters["sequence_start"].bool_param = True
    request.parameters["tenant"].string_param = "t1"
    request.inputs.add(name="x", datatype="FP32", shape=[2, 3])
    data = request.SerializeToString()
    view = memoryview(bytearray(b"head" + data))[4:]
    assert peek_batch(view) == peek_batch(data) is not None
    assert peek_batch(view, frozenset({"tenant"})) == peek_batch(data, frozenset({"tenant"}))
    control = peek_sequence(view)
    assert (control.id, control.start, control.end) == ("abc", True, False)
    assert control == peek_sequence(data)
