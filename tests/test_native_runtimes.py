"""Real native runtimes in pre-forked workers, under the defaults.

XGBoost, LightGBM, ONNX Runtime, scikit-learn (n_jobs=-1), numpy BLAS and,
where it is installed, PyTorch: each model is trained or built at test time
(tests/native_models.py, in a process of its own), loaded and warmed up in
``load()`` (so in the zygote, before the fork), and served by 2 forked
workers with default settings. 40 concurrent calls per model, each with its
own rows, and every reply must be the model's local prediction. Before
threads_per_worker, XGBoost and LightGBM hung forever in their first predict
after the fork (libgomp's thread pool does not survive it).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from poolserve.protos import inference_pb2 as pb
from poolserve.protos import inference_pb2_grpc as pbg
from poolserve.service.inference.codec import decode_outputs, encode_inputs

from native_models import CLASSES, KINDS, MODEL_CODE, available
from serving import Serving, wait_serving

pytestmark = pytest.mark.e2e

HERE = Path(__file__).resolve().parent
SERVED = [k for k in KINDS if available(k)]


def _kind_param(kind: str) -> object:
    if kind == "torch" and not available(kind):
        reason = "torch is not installed (the CPU wheel: pip install torch); not in the test extra"
        return pytest.param(kind, marks=pytest.mark.skip(reason=reason))
    return kind


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Serving, Path]]:
    """One tree, one pool of 2 workers (the defaults) holding every runtime."""
    root = tmp_path_factory.mktemp("native")
    repo = root / "repo"
    repo.mkdir()
    subprocess.run(
        [sys.executable, str(HERE / "native_models.py"), str(repo), *SERVED],
        check=True,
        capture_output=True,
        timeout=300,
    )
    for kind in SERVED:
        settings = {
            "name": kind,
            "implementation": f"model.{CLASSES[kind]}",
            "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 20]}],
        }
        (repo / kind / "model-settings.json").write_text(json.dumps(settings))
        (repo / kind / "model.py").write_text(MODEL_CODE)
    with Serving(repo, root / "run", workers=2) as serving:
        yield serving, repo


@pytest.mark.parametrize("kind", [_kind_param(k) for k in KINDS])
def test_runtime_serves_correct_answers_from_forked_workers(
    served: tuple[Serving, Path], kind: str
) -> None:
    serving, repo = served
    inputs = np.load(repo / kind / "inputs.npy")
    expected = np.load(repo / kind / "expected.npy")

    async def main() -> list[np.ndarray]:
        async with grpc.aio.insecure_channel(serving.address) as channel:
            await wait_serving(channel)
            stub = pbg.GRPCInferenceServiceStub(channel)

            async def call(rows: np.ndarray) -> np.ndarray:
                request = pb.ModelInferRequest(model_name=kind)
                encode_inputs({"INPUT0": rows}, request, raw=True)
                reply = await stub.ModelInfer(request, timeout=30)
                return decode_outputs(reply)["OUTPUT0"]

            return await asyncio.gather(*(call(rows) for rows in inputs))

    replies = asyncio.run(main())
    assert len(replies) == len(inputs) == 40
    for got, want in zip(replies, expected, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        # a thread count other than the trainer's may change a float sum's order
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
