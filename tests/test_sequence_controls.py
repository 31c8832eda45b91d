"""Triton's sequence control inputs (START, END, READY, CORRID) declared by a
sequence model, filled in by the worker from each request's controls, and
reported in ModelConfig's sequence_batching; real workers behind the router."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from test_sequences import INFER, outputs, step

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.repository import parse_model_settings
from poolserve.service.contract.sequence import ControlInput, sequence_policy
from poolserve.service.contract.settings import ConfigError
from poolserve.service.inference.cargo import WARMUP_SEQUENCE_ID, _warm_up
from poolserve.service.inference.controls import add_controls
from poolserve.service.inference.model import load_model

from serving import Serving, wait_serving
from support import write_model

CONTROLS = '''
import numpy as np

from poolserve.service import Model


class Controls(Model):
    """Answers the control tensors it was given, and the sum of its INPUT."""

    def predict(self, inputs, parameters):
        names = [n for n in inputs if n != "INPUT"]
        out = {"OUT_" + n: inputs[n] for n in names}
        out["SUM"] = np.array([int(inputs["INPUT"].sum())], np.int64)
        return out
'''


def controls_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    flat = {
        "START": "START",
        "END": {"name": "END", "datatype": "BOOL"},
        "READY": {"name": "READY", "datatype": "FP32"},
        "CORRID": {"name": "CORRID", "datatype": "UINT64"},
    }
    for name, controls, batch in (
        ("ctl", flat, 0),
        ("ctlb", {"START": "S", "CORRID": {"name": "ID", "datatype": "BYTES"}}, 4),
        ("ctl32", {"CORRID": {"name": "ID", "datatype": "INT32"}}, 0),
    ):
        settings = {
            "name": name,
            "implementation": "model.Controls",
            "max_batch_size": batch,
            "parameters": {"extra": {"sequence": {"control_inputs": controls}}},
            "inputs": [{"name": "INPUT", "datatype": "INT32", "shape": [-1, 1]}],
            "outputs": [{"name": "SUM", "datatype": "INT64", "shape": [1]}],
        }
        write_model(repo, name, settings, CONTROLS)
    return repo


def test_control_tensors_reach_predict_and_model_config_reports_them(tmp_path: Path) -> None:
    repo = controls_repo(tmp_path)

    async def main(serving: Serving) -> None:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            infer = channel.unary_unary(INFER)

            async def run(model: str, **kw: Any) -> dict[str, np.ndarray]:
                return outputs(await infer(step(model, 2, **kw), timeout=60))

            first = await run("ctl", sequence=41, start=True)
            assert first["OUT_START"].dtype == np.int32 and first["OUT_START"].tolist() == [1]
            assert first["OUT_END"].dtype == np.bool_ and first["OUT_END"].tolist() == [False]
            assert first["OUT_READY"].dtype == np.float32 and first["OUT_READY"].tolist() == [1.0]
            assert first["OUT_CORRID"].dtype == np.uint64 and first["OUT_CORRID"].tolist() == [41]
            middle = await run("ctl", sequence=41)
            assert middle["OUT_START"].tolist() == [0] and middle["OUT_END"].tolist() == [False]
            last = await run("ctl", sequence=41, end=True)
            assert last["OUT_START"].tolist() == [0] and last["OUT_END"].tolist() == [True]
            # a batching model: [batch, 1]; a string id in a BYTES CORRID
            batched = await run("ctlb", sequence="abc", start=True)
            assert batched["OUT_S"].shape == (1, 1) and batched["OUT_S"].tolist() == [[1]]
            assert batched["OUT_ID"].tolist() == [[b"abc"]]
            # a 32-bit CORRID keeps the id's low-order 32 bits
            big = (1 << 32) + 7
            low = await run("ctl32", sequence=big, start=True)
            assert low["OUT_ID"].dtype == np.int32 and low["OUT_ID"].tolist() == [7]
            # a string id does not fit a numeric CORRID; a request may not send a control
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await run("ctl", sequence="text", start=True)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "BYTES CORRID" in (info.value.details() or "")
            forged = pb.ModelInferRequest.FromString(step("ctl", 1, 43, start=True))
            forged.inputs.add(name="START", datatype="INT32", shape=[1])
            forged.raw_input_contents.append(np.array([0], np.int32).tobytes())
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await infer(forged.SerializeToString(), timeout=60)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "server fills it in" in (info.value.details() or "")

            config = channel.unary_unary(
                "/inference.GRPCInferenceService/ModelConfig",
                request_serializer=pb.ModelConfigRequest.SerializeToString,
                response_deserializer=pb.ModelConfigResponse.FromString,
            )
            got = (await config(pb.ModelConfigRequest(name="ctl"), timeout=60)).config
            Control = pb.ModelSequenceBatching.Control
            by_name = {c.name: c.control[0] for c in got.sequence_batching.control_input}
            assert by_name["START"].kind == Control.CONTROL_SEQUENCE_START
            assert list(by_name["START"].int32_false_true) == [0, 1]
            assert by_name["END"].kind == Control.CONTROL_SEQUENCE_END
            assert list(by_name["END"].bool_false_true) == [False, True]
            assert by_name["READY"].kind == Control.CONTROL_SEQUENCE_READY
            assert list(by_name["READY"].fp32_false_true) == [0.0, 1.0]
            assert by_name["CORRID"].kind == Control.CONTROL_SEQUENCE_CORRID
            assert by_name["CORRID"].data_type == pb.TYPE_UINT64
            assert got.sequence_batching.max_sequence_idle_microseconds == 60_000_000
            assert [i.name for i in got.input] == ["INPUT"]  # controls are not client inputs

            metadata = channel.unary_unary(
                "/inference.GRPCInferenceService/ServerMetadata",
                request_serializer=pb.ServerMetadataRequest.SerializeToString,
                response_deserializer=pb.ServerMetadataResponse.FromString,
            )
            assert "sequence" in (await metadata(pb.ServerMetadataRequest(), timeout=60)).extensions

    with Serving(repo, tmp_path / "run", workers=2) as serving:
        asyncio.run(main(serving))


def test_control_inputs_settings_are_validated() -> None:
    def policy(controls: object, declared: dict[str, str] | None = None) -> Any:
        return sequence_policy("m", {"sequence": {"control_inputs": controls}}, declared)

    assert policy({"START": "S"}).controls == (ControlInput("START", "S", "INT32"),)
    assert policy({"CORRID": "C"}).controls == (ControlInput("CORRID", "C", "UINT64"),)
    # without a datatype, a declared input's own
    assert policy({"CORRID": "C"}, {"C": "BYTES"}).controls[0].datatype == "BYTES"
    for bad in (
        {"BEGIN": "S"},  # not a kind
        {"START": {"name": "S", "datatype": "UINT64"}},  # a flag is INT32, FP32 or BOOL
        {"CORRID": {"name": "C", "datatype": "FP32"}},
        {"START": "S", "END": "S"},  # one input twice
        {"START": ""},
        {"START": {"nom": "S"}},
        ["START"],
    ):
        with pytest.raises(ConfigError):
            policy(bad)


def test_add_controls_fills_shapes_and_values() -> None:
    controls = (ControlInput("READY", "R", "BOOL"), ControlInput("CORRID", "C", "INT64"))
    inputs = {"X": np.zeros((3, 2), np.float32)}
    add_controls("m", inputs, controls, {"sequence_id": -5}, batched=True)
    assert inputs["R"].shape == (3, 1) and inputs["R"].all()
    assert inputs["C"].tolist() == [[-5]] * 3 and inputs["C"].dtype == np.int64


STRICT = """
import numpy as np

from poolserve.service import Model


class Strict(Model):
    \"\"\"Refuses a request without its control tensors; keeps a state per sequence.\"\"\"

    def load(self):
        self.state = {}
        self.ended = []

    def predict(self, inputs, parameters):
        start, ident = int(inputs["START"][0]), int(inputs["CORRID"][0])
        self.state[ident] = (0 if start else self.state[ident]) + int(inputs["INPUT"].sum())
        return {"SUM": np.array([self.state[ident]], np.int64)}

    def sequence_ended(self, sequence_id, reason):
        self.ended.append((sequence_id, reason))
        del self.state[sequence_id]
"""


def test_the_warm_up_of_a_sequence_model_is_a_sequence_of_one_request(tmp_path: Path) -> None:
    """A fresh worker's warm-up gives a sequence model its control tensors (a
    model that reads them must not fail its self-test) and ends that sequence."""
    folder = write_model(
        tmp_path,
        "strict",
        {
            "name": "strict",
            "implementation": "model.Strict",
            "parameters": {
                "extra": {"sequence": {"control_inputs": {"START": "START", "CORRID": "CORRID"}}}
            },
            "inputs": [{"name": "INPUT", "datatype": "INT32", "shape": [-1, 1]}],
            "outputs": [{"name": "SUM", "datatype": "INT64", "shape": [1]}],
        },
        STRICT,
    )
    model: Any = load_model(parse_model_settings(folder / "model-settings.json"))
    _warm_up(model, {"INPUT": np.ones((3, 1), np.int32)})
    assert model.ended == [(WARMUP_SEQUENCE_ID, "end")]
    assert model.state == {}  # no warm-up state left behind
