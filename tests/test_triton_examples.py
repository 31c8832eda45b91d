"""Programs of the kind Triton ships as its Python gRPC examples, written for
poolserve, run unchanged against a real ``poolserve serve`` tree (issue 20).

Each program in tests/triton_examples/ is a client a Triton user would write:
tritonclient.grpc (and its raw stubs), its own checks, ``PASS`` on stdout and
exit status 0, or ``FAIL: why`` and 1. They run in their own processes:
tritonclient registers protobuf package ``inference`` as poolserve does. The
models (tests/triton_examples/models) are Triton's "simple" and
"simple_string", and a 1000-class image classifier with an NCHW input and a
labels file, on workers, plus an inline copy of it with fewer labels.
Shared-memory examples are in test_triton_shm.py.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from serving import Serving, wait_serving

pytestmark = pytest.mark.e2e

EXAMPLES = Path(__file__).resolve().parent / "triton_examples"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    root = tmp_path_factory.mktemp("triton_examples")
    repo = root / "repo"
    shutil.copytree(EXAMPLES / "models", repo, ignore=shutil.ignore_patterns("__pycache__"))
    labels = [f"class_{i:03d}" for i in range(1000)]
    (repo / "classifier" / "labels.txt").write_text("\n".join(labels) + "\n")
    inline = repo / "classifier_inline"
    shutil.copytree(repo / "classifier", inline)
    (inline / "labels.txt").write_text("\n".join(labels[:100]) + "\n")
    settings = json.loads((inline / "model-settings.json").read_text())
    settings.update(name="classifier_inline", parallel_workers=0)
    (inline / "model-settings.json").write_text(json.dumps(settings))
    with Serving(repo, root / "run", workers=2) as serving:
        asyncio.run(_wait(serving.address))
        yield serving


async def _wait(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        await wait_serving(channel, timeout=90)


def run_example(served: Serving, program: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / program), served.address, *args],
        capture_output=True,
        text=True,
        timeout=110,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "PASS" in done.stdout, output
    return done.stdout


def test_raw_and_typed_inputs_read_back_with_as_numpy(served: Serving) -> None:
    out = run_example(served, "infer_client.py")
    assert f"OUTPUT0 = {[i + 1 for i in range(16)]}" in out


def test_string_tensors(served: Serving) -> None:
    run_example(served, "string_infer_client.py")


def test_callbacks_and_asyncio_clients(served: Serving) -> None:
    out = run_example(served, "async_infer_client.py")
    assert "16 callbacks answered" in out
    assert "16 aio calls answered" in out


def test_health_metadata_config_and_statistics(served: Serving) -> None:
    out = run_example(served, "health_metadata_client.py")
    assert "'classification'" in out


@pytest.mark.parametrize("how", ["tritonclient", "--raw-grpc"])
def test_an_image_client_classifies_a_batch_on_workers(served: Serving, how: str) -> None:
    out = run_example(served, "image_client.py", "classifier", "3", how)
    assert "Image of mean 200:" in out
    assert "(200) = class_200" in out


def test_classification_edges(served: Serving) -> None:
    out = run_example(served, "classification_client.py")
    assert "5000 of 1000 classes: (1, 1000)" in out
    assert "BYTES output refused" in out


def test_model_control_with_a_config_override(served: Serving) -> None:
    out = run_example(served, "model_control_client.py")
    assert "loaded with max_batch_size 4" in out
    assert "refused: failed to load 'simple'" in out
