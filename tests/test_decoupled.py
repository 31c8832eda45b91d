"""Decoupled models end to end, with real workers behind the router: streams
of 0, 1 and 1,000 responses; Triton's empty final response; a client that
cancels mid-stream frees the worker (the model's generator is closed); a
deadline mid-stream; a slow reader holds the worker within its window; unary
ModelInfer refused; tritonclient's stream API with the repeat_int32 example."""

from __future__ import annotations

import asyncio
import json
import queue
import shutil
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from poolserve.protos import inference_pb2 as pb
from poolserve.protos import inference_pb2_grpc as pbg
from poolserve.service.inference.codec import decode_outputs, encode_inputs

from serving import Serving, wait_serving
from support import copy_example, wait_until, write_model

COUNTER = '''
import os
import time
from pathlib import Path

import numpy as np

from poolserve.service import Model


class Counter(Model):
    """N responses (N < 0: without end), IDX 0, 1, ...; records how far it got."""

    def predict_stream(self, inputs, parameters):
        n = int(inputs["N"].reshape(-1)[0])
        size = int(parameters.get("size", 1))
        delay = float(parameters.get("delay_ms", 0)) / 1000
        tag = parameters.get("tag")
        marks = Path(self.settings.extra["marks"])
        i = 0
        try:
            while n < 0 or i < n:
                if delay:
                    time.sleep(delay)
                if parameters.get("die_at") == i:
                    os._exit(3)
                if tag:
                    (marks / f"{tag}.progress").write_text(str(i + 1))
                yield {"IDX": np.array([i], np.int64), "PAD": np.zeros(size, np.uint8)}
                i += 1
        finally:
            if tag:
                (marks / f"{tag}.closed").write_text(str(i))
'''

STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"


def counter_repo(tmp_path: Path, window: int = 16) -> tuple[Path, Path]:
    repo, marks = tmp_path / "repo", tmp_path / "marks"
    marks.mkdir()
    settings = {
        "name": "counter",
        "implementation": "model.Counter",
        "parameters": {"extra": {"decoupled": True, "marks": str(marks), "stream_window": window}},
        "inputs": [{"name": "N", "datatype": "INT32", "shape": [1]}],
        "outputs": [
            {"name": "IDX", "datatype": "INT64", "shape": [1]},
            {"name": "PAD", "datatype": "UINT8", "shape": [-1]},
        ],
    }
    write_model(repo, "counter", settings, COUNTER)
    return repo, marks


def counter_request(n: int, rid: str = "", final: bool = False, **params: Any) -> bytes:
    req = pb.ModelInferRequest(model_name="counter", id=rid)
    encode_inputs({"N": np.array([n], np.int32)}, req, raw=True)
    for key, value in params.items():
        if isinstance(value, str):
            req.parameters[key].string_param = value
        else:
            req.parameters[key].int64_param = value
    if final:
        req.parameters["triton_enable_empty_final_response"].bool_param = True
    return req.SerializeToString()


def parse(reply: bytes) -> pb.ModelStreamInferResponse:
    return pb.ModelStreamInferResponse.FromString(reply)


def idx(response: pb.ModelInferResponse) -> int:
    return int(decode_outputs(response)["IDX"][0])


def read_int(path: Path) -> int:
    try:
        return int(path.read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


async def success_count(channel: grpc.aio.Channel) -> tuple[int, int]:
    stats = await pbg.GRPCInferenceServiceStub(channel).ModelStatistics(
        pb.ModelStatisticsRequest(name="counter"), timeout=10
    )
    inference = stats.model_stats[0].inference_stats
    return inference.success.count, inference.fail.count


def open_stream(
    channel: grpc.aio.Channel, timeout: float = 60
) -> tuple[asyncio.Queue[bytes | None], Any]:
    """A ModelStreamInfer whose requests are what the queue is given (None ends them)."""
    outgoing: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def requests() -> Any:
        while (item := await outgoing.get()) is not None:
            yield item

    return outgoing, channel.stream_stream(STREAM)(requests(), timeout=timeout)


def test_streams_of_0_1_and_1000_responses_final_flag_and_unary_refused(tmp_path: Path) -> None:
    repo, _ = counter_repo(tmp_path)

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            outgoing, call = open_stream(channel)
            replies = call.__aiter__()

            async def take(count: int) -> list[pb.ModelStreamInferResponse]:
                return [parse(await anext(replies)) for _ in range(count)]

            # 1 response, then 1,000: in order, each a ModelInferResponse of its request
            await outgoing.put(counter_request(1, rid="one"))
            (one,) = await take(1)
            assert not one.error_message and one.infer_response.id == "one"
            assert idx(one.infer_response) == 0
            await outgoing.put(counter_request(1000, rid="many"))
            many = await take(1000)
            assert [idx(r.infer_response) for r in many] == list(range(1000))
            assert {r.infer_response.id for r in many} == {"many"}
            # 0 responses: nothing at all, unless the client asked for the final one
            await outgoing.put(counter_request(0, rid="none"))
            await outgoing.put(counter_request(0, rid="none-final", final=True))
            (final,) = await take(1)
            assert final.infer_response.id == "none-final"
            assert final.infer_response.parameters["triton_final_response"].bool_param
            assert not final.infer_response.outputs
            # with the flag, every response says whether it is the final one
            await outgoing.put(counter_request(2, rid="two", final=True))
            two = await take(3)
            flags = [r.infer_response.parameters["triton_final_response"].bool_param for r in two]
            assert flags == [False, False, True]
            assert [len(r.infer_response.outputs) for r in two] == [2, 2, 0]
            await outgoing.put(None)
            assert await anext(replies, None) is None
            # each request counted once, however many responses it had
            assert await success_count(channel) == (5, 0)

            # unary ModelInfer to a decoupled model: refused, as Triton does
            infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await infer(counter_request(1), timeout=30)
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert "decoupled" in (info.value.details() or "")

    with Serving(repo, tmp_path / "run", workers=1) as serving:
        asyncio.run(main(serving))


def test_cancel_mid_stream_closes_the_generator_and_frees_the_worker(tmp_path: Path) -> None:
    repo, marks = counter_repo(tmp_path)

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            stream = channel.stream_stream(STREAM)

            async def one(request: bytes) -> Any:
                yield request
                await asyncio.Event().wait()  # the stream stays open

            call = stream(one(counter_request(-1, tag="endless", delay_ms=5)), timeout=60)
            replies = call.__aiter__()
            for k in range(3):
                assert idx(parse(await anext(replies)).infer_response) == k
            call.cancel()
            # the worker saw the cancel: the model's generator was closed ...
            closed = marks / "endless.closed"
            assert await asyncio.to_thread(wait_until, closed.exists, 60)
            # ... and the one worker serves the next stream
            call = stream(one(counter_request(2, rid="next")), timeout=60)
            replies = call.__aiter__()
            got = [parse(await anext(replies)) for _ in range(2)]
            assert [idx(r.infer_response) for r in got] == [0, 1]
            call.cancel()

            # a deadline mid-stream (the request's timeout) ends it with DEADLINE_EXCEEDED
            call = stream(
                one(counter_request(-1, tag="late", delay_ms=5, timeout=2_000_000)), timeout=60
            )
            seen = 0
            async for reply in call:
                message = parse(reply)
                if message.error_message:
                    assert message.error_message.startswith("DEADLINE_EXCEEDED"), message
                    break
                seen += 1
            assert seen > 0
            call.cancel()
            assert await asyncio.to_thread(wait_until, (marks / "late.closed").exists, 60)
            assert (await success_count(channel))[1] == 1  # the late one failed, once

            # the worker dies mid-stream: the stream ends with an error saying so
            call = stream(one(counter_request(-1, die_at=5)), timeout=60)
            got = [parse(reply) async for reply in _until_error(call)]
            assert [idx(r.infer_response) for r in got[:-1]] == list(range(5))
            assert got[-1].error_message.startswith("UNAVAILABLE"), got[-1]
            assert "died" in got[-1].error_message
            call.cancel()
            # its replacement serves the next stream
            call = stream(one(counter_request(1)), timeout=60)
            assert idx(parse(await anext(call.__aiter__())).infer_response) == 0
            call.cancel()

    with Serving(repo, tmp_path / "run", workers=1) as serving:
        asyncio.run(main(serving))


async def _until_error(call: Any) -> Any:
    async for reply in call:
        yield reply
        if parse(reply).error_message:
            return


def test_slow_reader_holds_the_worker_within_its_window(tmp_path: Path) -> None:
    """The model runs ``stream_window`` responses ahead of what the pool has
    passed on, and no further while the client reads nothing: at least the
    window (a model given 16, the default, or 4 stops well short of it), at
    most the window plus what the pipes hold (one given none runs to 1,000)."""
    window = 100
    repo, marks = counter_repo(tmp_path, window=window)
    size = 256 * 1024  # large enough that gRPC's own buffers hold few responses
    progress = marks / "slow.progress"

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)

            async def one() -> Any:
                yield counter_request(1000, tag="slow", size=size)
                await asyncio.Event().wait()

            call = channel.stream_stream(STREAM)(one(), timeout=60)
            replies = call.__aiter__()
            taken = 3
            for _ in range(taken):
                await anext(replies)
            # the model gets as far as the window lets it: the worker sends a
            # window's responses before it needs the pool's first ACK (a window
            # of 16 measured 41 here, one of 100 measured 101) ...
            assert await asyncio.to_thread(wait_until, lambda: read_int(progress) >= window, 60)
            # ... and no further while we do not read (without a window it would
            # run through all 1,000 in this time)
            # gRPC's flow-control windows on the way (pool, router, client) grow to
            # a few MB each: about 50 of these responses measured, well under 1,000
            slack = 150
            end = time.monotonic() + 3.0
            while time.monotonic() < end:
                assert read_int(progress) <= taken + window + slack, read_int(progress)
                await asyncio.sleep(0.05)
            # reading on, the whole stream comes
            rest = [parse(await anext(replies)) for _ in range(1000 - taken)]
            assert idx(rest[-1].infer_response) == 999
            call.cancel()

    # a reader that pauses is what this is about: no stall limit (stream_stall_s 0)
    never = {"POOLSERVE_STREAM_STALL_S": "0"}
    with Serving(repo, tmp_path / "run", workers=1, env=never) as serving:
        asyncio.run(main(serving))


def test_streams_nobody_reads_are_ended_and_free_their_workers(tmp_path: Path) -> None:
    """One client opens a stream per worker, each asking for 200,000 responses,
    with an hour's deadline, and reads none. Within stream_stall_s of their
    windows filling, the streams are ended and their workers freed: another
    model of the pool (echo) and a stream that reads are answered well before
    their deadlines, and a stalled stream, read at last, ends with
    RESOURCE_EXHAUSTED naming stream_stall_s (issue 28, item 5)."""
    repo, marks = counter_repo(tmp_path)
    copy_example(repo, "echo")  # the same pool (default), the same 2 workers
    asked, tags = 200_000, ("stall0", "stall1")

    async def echo(stub: pbg.GRPCInferenceServiceStub, value: float) -> None:
        req = pb.ModelInferRequest(model_name="echo")
        encode_inputs({"INPUT0": np.full((1, 16), value, np.float32)}, req, raw=True)
        reply = await stub.ModelInfer(req, timeout=30)  # generous: a loaded 2-core CI
        assert np.frombuffer(reply.raw_output_contents[0], np.float32)[0] == value

    async def polite(channel: grpc.aio.Channel) -> list[int]:
        outgoing, call = open_stream(channel, timeout=30)
        await outgoing.put(counter_request(500, rid="polite"))
        await outgoing.put(None)
        got = [parse(reply) async for reply in call]
        assert not any(r.error_message for r in got), [r.error_message for r in got][-1]
        return [idx(r.infer_response) for r in got]

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            stub = pbg.GRPCInferenceServiceStub(channel)
            stalled = []
            for tag in tags:
                outgoing, call = open_stream(channel, timeout=3600)
                await outgoing.put(counter_request(asked, tag=tag, size=16 * 1024))
                stalled.append(call)
            for tag in tags:  # both streams hold a worker: the pool has no other
                progress = marks / f"{tag}.progress"
                assert await asyncio.to_thread(wait_until, progress.exists, 60)
            began = time.monotonic()
            answered = await asyncio.gather(polite(channel), *(echo(stub, v) for v in range(5)))
            print(f"echo 5/5 and a polite stream answered in {time.monotonic() - began:.2f} s")
            assert answered[0] == list(range(500))
            # the models' generators were closed: the workers left the streams
            for tag in tags:
                closed = marks / f"{tag}.closed"
                assert await asyncio.to_thread(wait_until, closed.exists, 60)
                assert read_int(closed) < asked
            # read at last, a stalled stream has what gRPC held, then its status
            for call in stalled:
                got: list[bytes] = []
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await drain(call, got)
                assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
                assert "stream_stall_s" in (info.value.details() or "")
                assert len(got) < asked
        assert "Traceback" not in serving.log()
        # the router says why each stream ended, for operators
        freed = serving.log().count("(stream_stall_s); its worker is freed")
        assert freed == len(stalled), serving.log()[-3000:]

    # small for the test (default 10); every worker may hold a stream (unary_workers
    # 0), as before that setting: the stall limit alone frees them here
    stall = {"POOLSERVE_STREAM_STALL_S": "1", "POOLSERVE_UNARY_WORKERS": "0"}
    with Serving(repo, tmp_path / "run", workers=2, env=stall) as serving:
        asyncio.run(main(serving))
        # and counts them, by model, in /metrics
        address = (serving.run_dir / "metrics.addr").read_text().strip()
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as reply:
            text = reply.read().decode()
        assert 'poolserve_streams_stalled_total{model="counter"} 2.0' in text, text[-3000:]
        assert 'poolserve_streams_stalled_total{model="echo"}' not in text


async def drain(call: Any, into: list[bytes]) -> None:
    async for reply in call:
        into.append(reply)


async def echo_once(stub: pbg.GRPCInferenceServiceStub, value: float, timeout: float) -> float:
    """One echo call; its latency in seconds (it fails past ``timeout``)."""
    req = pb.ModelInferRequest(model_name="echo")
    encode_inputs({"INPUT0": np.full((1, 16), value, np.float32)}, req, raw=True)
    began = time.monotonic()
    reply = await stub.ModelInfer(req, timeout=timeout)
    assert np.frombuffer(reply.raw_output_contents[0], np.float32)[0] == value
    return time.monotonic() - began


async def unread_streams(
    channel: grpc.aio.Channel, tags: tuple[str, ...], asked: int = 200_000
) -> list[Any]:
    """One stream per tag, each asking for ``asked`` responses, none ever read."""
    calls = []
    for tag in tags:
        outgoing, call = open_stream(channel, timeout=3600)
        await outgoing.put(counter_request(asked, tag=tag, size=16 * 1024))
        calls.append(call)
    return calls


def test_unread_streams_leave_a_worker_for_the_pools_other_calls(tmp_path: Path) -> None:
    """A pool of 2 workers serves a decoupled model and echo. A client opens
    one stream per worker and reads none, with stream_stall_s at 60 s: the
    streams hold one worker (``unary_workers``, default 1, keeps the other for
    the pool's other calls), so echo calls are answered within their 10 s
    deadline, not after stream_stall_s; the second stream waits in the queue
    and starts once the first ends (issue 42, item 5)."""
    repo, marks = counter_repo(tmp_path)
    copy_example(repo, "echo")  # the same pool (default), the same 2 workers
    tags = ("unread0", "unread1")

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            stub = pbg.GRPCInferenceServiceStub(channel)
            await echo_once(stub, -1.0, 30)  # warm: the pool has served echo
            calls = await unread_streams(channel, tags)
            progress = [marks / f"{tag}.progress" for tag in tags]
            assert await asyncio.to_thread(
                wait_until, lambda: any(p.exists() for p in progress), 60
            )
            first = next(i for i, p in enumerate(progress) if p.exists())
            latencies = [await echo_once(stub, float(v), 10) for v in range(5)]
            print(f"echo with {len(tags)} unread streams: {max(latencies) * 1000:.1f} ms at most")
            assert not progress[1 - first].exists()  # the other stream waits its turn
            calls[first].cancel()  # its worker is freed: the waiting stream starts
            assert await asyncio.to_thread(wait_until, progress[1 - first].exists, 60)
            for v in range(5):  # and the other worker still serves echo
                await echo_once(stub, float(v), 10)
            calls[1 - first].cancel()
        assert "Traceback" not in serving.log()

    never = {"POOLSERVE_STREAM_STALL_S": "60"}  # the bound is not stream_stall_s
    with Serving(repo, tmp_path / "run", workers=2, env=never) as serving:
        asyncio.run(main(serving))


def test_streams_hold_every_worker_of_a_pool_that_serves_only_streams(tmp_path: Path) -> None:
    """A pool whose every model is decoupled keeps no worker back: one unread
    stream per worker, and each of them runs (``unary_workers`` applies only
    where the pool's other calls share its workers)."""
    repo, marks = counter_repo(tmp_path)
    tags = ("only0", "only1")

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            calls = await unread_streams(channel, tags)
            for tag in tags:
                assert await asyncio.to_thread(wait_until, (marks / f"{tag}.progress").exists, 60)
            for call in calls:
                call.cancel()

    with Serving(repo, tmp_path / "run", workers=2) as serving:
        asyncio.run(main(serving))


def test_tritonclient_stream_api_with_the_repeat_example(tmp_path: Path) -> None:
    import tritonclient.grpc as grpcclient

    repo = tmp_path / "repo"
    copy_example(repo, "repeat_int32")
    with Serving(repo, tmp_path / "run", workers=1) as serving:
        asyncio.run(ready(serving.address))
        results: queue.Queue[Any] = queue.Queue()
        client = grpcclient.InferenceServerClient(serving.address)
        try:
            client.start_stream(callback=lambda result, error: results.put((result, error)))
            values = np.array([4, 2, 0, 1], dtype=np.int32)
            inputs = [
                grpcclient.InferInput("IN", [4], "INT32"),
                grpcclient.InferInput("DELAY", [4], "UINT32"),
                grpcclient.InferInput("WAIT", [1], "UINT32"),
            ]
            inputs[0].set_data_from_numpy(values)
            inputs[1].set_data_from_numpy(np.array([1, 2, 3, 4], dtype=np.uint32))
            inputs[2].set_data_from_numpy(np.array([5], dtype=np.uint32))
            outputs = [
                grpcclient.InferRequestedOutput("OUT"),
                grpcclient.InferRequestedOutput("IDX"),
            ]
            client.async_stream_infer(
                "repeat_int32",
                inputs,
                request_id="7",
                outputs=outputs,
                enable_empty_final_response=True,
            )
            got = []
            while True:
                result, error = results.get(timeout=60)
                assert error is None, error
                response = result.get_response()
                assert response.id == "7"
                if response.parameters["triton_final_response"].bool_param:
                    assert not response.outputs
                    break
                got.append((int(result.as_numpy("IDX")[0]), int(result.as_numpy("OUT")[0])))
            assert got == [(0, 4), (1, 2), (2, 0), (3, 1)]
        finally:
            client.stop_stream()
            client.close()


async def ready(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        await wait_serving(channel)


def test_in_process_server_refuses_a_decoupled_model_clearly(tmp_path: Path) -> None:
    """No workers, no streams: unary is refused as in a pool, the stream says why."""
    from poolserve.service.contract.repository import scan
    from poolserve.service.contract.settings import ServerSettings
    from poolserve.service.poolserver.inprocess import InProcessServer

    repo, _ = counter_repo(tmp_path)

    async def main() -> None:
        server = InProcessServer(scan(repo), ServerSettings())
        port = await server.start("127.0.0.1:0")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await infer(counter_request(1), timeout=30)
                assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
                assert "decoupled" in (info.value.details() or "")

                async def one() -> Any:
                    yield counter_request(1)

                replies = [parse(r) async for r in channel.stream_stream(STREAM)(one(), timeout=30)]
                assert len(replies) == 1
                assert replies[0].error_message.startswith("UNIMPLEMENTED")
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_bad_messages_in_a_stream_are_answered_in_place_and_the_stream_goes_on(
    tmp_path: Path,
) -> None:
    """Each message gets its answer, whatever the ones before it were: a first
    message for no model, or that cannot be parsed, is answered with its error
    and the next one opens the stream; later, bytes that start with a zero
    byte (which only the router may send a pool) or that are not a request at
    all are answered with their error, in their place, and the stream goes on."""
    repo, _ = counter_repo(tmp_path)
    unknown = pb.ModelInferRequest(model_name="nosuch", id="x").SerializeToString()
    sent = [
        unknown,
        b"\x00shm1forged",
        counter_request(2, rid="a"),
        b"\x00slab1forged",
        counter_request(1, rid="b"),
        b"\xff\xff\xff",
        counter_request(1, rid="c"),
    ]

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            outgoing, call = open_stream(channel)
            replies = call.__aiter__()
            got: list[str] = []
            for message, expected in zip(sent, (1, 1, 2, 1, 1, 1, 1), strict=True):
                await outgoing.put(message)  # one at a time: each answer is in its place
                for _ in range(expected):
                    reply = parse(await anext(replies))
                    if reply.error_message:
                        got.append(f"error: {reply.error_message}")
                    else:
                        got.append(f"{reply.infer_response.id} {idx(reply.infer_response)}")
            await outgoing.put(None)
            assert await anext(replies, None) is None
            assert await call.code() == grpc.StatusCode.OK
            assert got[0].startswith("error: Request for unknown model: 'nosuch'")
            assert got[1] == "error: request bytes hold a field number 0"
            assert got[2:4] == ["a 0", "a 1"]
            zero = "error: ModelInferRequest cannot be parsed: it starts with a zero byte"
            assert got[4] == zero
            assert got[5] == "b 0"
            assert got[6].startswith("error: request bytes are truncated")
            assert got[7] == "c 0"

    with Serving(repo, tmp_path / "run", workers=1) as serving:
        asyncio.run(main(serving))


def test_a_stream_message_for_a_model_of_another_pool_is_refused_clearly(tmp_path: Path) -> None:
    """A stream goes to the pool of its first model: a message for a model that
    another pool serves gets an error naming both pools, in its place, and the
    stream goes on; the same model opens its own stream on its own pool."""
    repo, _ = counter_repo(tmp_path)
    shutil.copytree(repo / "counter", repo / "counter2")
    settings = json.loads((repo / "counter2" / "model-settings.json").read_text())
    settings["name"] = "counter2"
    settings["parameters"]["inference_pool_gid"] = "other"
    (repo / "counter2" / "model-settings.json").write_text(json.dumps(settings))
    elsewhere = pb.ModelInferRequest.FromString(counter_request(1, rid="z"))
    elsewhere.model_name = "counter2"

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            stream = channel.stream_stream(STREAM)

            async def listed(*messages: bytes) -> Any:
                for message in messages:
                    yield message

            sent = listed(counter_request(1, rid="a"), elsewhere.SerializeToString(),
                          counter_request(1, rid="c"))  # fmt: skip
            got = [parse(r) async for r in stream(sent, timeout=60)]
            assert [r.infer_response.id for r in got] == ["a", "", "c"]
            assert got[1].error_message == (
                "model 'counter2' is served by pool 'other', not by this stream's pool "
                "'default': a ModelStreamInfer goes to the pool of its first request's model "
                "(open one stream per pool)"
            )
            alone = [parse(r) async for r in stream(listed(elsewhere.SerializeToString()),
                                                     timeout=60)]  # fmt: skip
            assert [(r.error_message, r.infer_response.id) for r in alone] == [("", "z")]

    with Serving(repo, tmp_path / "run", workers=1) as serving:
        asyncio.run(main(serving))
