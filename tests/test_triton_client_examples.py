"""Triton's own Python gRPC client examples, run unchanged against one real
``poolserve serve`` tree (issue 20).

The 24 programs in tests/triton_examples/programs are copied byte for byte
from triton-inference-server/client (src/python/examples, branch r24.10,
commit f50fc7ad: see the README there). The tree serves
tests/triton_examples/models (without the classifier that
test_triton_examples.py uses) plus examples/models/repeat_int32: eight models
with the names, datatypes and shapes the programs expect, and a settings.json
with ``"server_name": "triton"`` (simple_grpc_health_metadata.py checks it).
Each program passes when it prints its own PASS line; each one out of scope is
listed with its reason and asserted to fail the documented way, so the list
stays honest. The tally is in the README (Triton compatibility).

The three sequence programs run again in their ``-d`` (dyna) mode against a
second tree serving tests/triton_examples/dyna_models (the first one must
serve exactly eight models: simple_grpc_model_control.py counts them): Triton's
dyna_sequence models, which compute their outputs from the START, END, READY
and CORRID control tensors, CORRID UINT64 for integer sequence ids and BYTES
for the string id (issue 19).
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import tritonclient.grpc as grpcclient

from serving import Serving, wait_serving

pytestmark = pytest.mark.e2e

HERE = Path(__file__).resolve().parent
PROGRAMS = HERE / "triton_examples" / "programs"
MODELS = HERE / "triton_examples" / "models"
DYNA_MODELS = HERE / "triton_examples" / "dyna_models"
REPEAT = HERE.parent / "examples" / "models" / "repeat_int32"
IMAGE = "image"  # replaced by the path of a grey image file

# program -> (its arguments besides -u, its own PASS line); each exits with status 0
PASSING: dict[str, tuple[list[str], str]] = {
    "ensemble_image_client.py": (["-i", "grpc", "-c", "3", IMAGE], "PASS"),
    "grpc_client.py": ([], "PASS"),
    "grpc_explicit_byte_content_client.py": ([], "PASS: explicit string"),
    "grpc_explicit_int8_content_client.py": ([], "PASS: explicit int8"),
    "grpc_explicit_int_content_client.py": ([], "PASS: explicit int"),
    "grpc_image_client.py": (["-m", "inception_graphdef", "-c", "3", IMAGE], "PASS"),
    "image_client.py": (["-i", "grpc", "-m", "inception_graphdef", "-c", "3", IMAGE], "PASS"),
    "reuse_infer_objects_client.py": (["-i", "grpc"], "======== NO_SHARED_MEMORY"),  # no PASS
    "simple_grpc_aio_infer_client.py": ([], "PASS: grpc aio infer"),
    "simple_grpc_aio_sequence_stream_infer_client.py": ([], "PASS: grpc aio sequence stream"),
    "simple_grpc_async_infer_client.py": ([], "PASS: Async infer"),
    "simple_grpc_custom_args_client.py": ([], "PASS: CustomArgs"),
    "simple_grpc_custom_repeat.py": ([], "PASS: Decoupled API"),
    "simple_grpc_health_metadata.py": ([], 'name: "triton"'),  # no PASS line: its status
    "simple_grpc_infer_client.py": ([], "PASS: infer"),
    "simple_grpc_keepalive_client.py": ([], "PASS: KeepAlive"),
    "simple_grpc_model_control.py": ([], "PASS: model control"),
    "simple_grpc_sequence_stream_infer_client.py": ([], "PASS: Sequence"),
    "simple_grpc_sequence_sync_infer_client.py": ([], "PASS: Sequence"),
    "simple_grpc_shm_client.py": ([], "PASS: system shared memory"),
    "simple_grpc_shm_string_client.py": ([], "PASS: system shared memory"),
    "simple_grpc_string_infer_client.py": ([], "PASS: string"),
}

# program -> its own PASS line in its -d (dyna) mode, against the dyna tree
DYNA: dict[str, str] = {
    "simple_grpc_aio_sequence_stream_infer_client.py": "PASS: grpc aio sequence stream",
    "simple_grpc_sequence_stream_infer_client.py": "PASS: Sequence",
    "simple_grpc_sequence_sync_infer_client.py": "PASS: Sequence",
}

# program -> (its arguments, why it is out of scope, what it prints when it fails)
OUT_OF_SCOPE: dict[str, tuple[list[str], str, tuple[str, ...]]] = {
    "simple_grpc_cudashm_client.py": (
        [],
        "CUDA shared memory: tritonclient's CUDA utilities need cuda-python and a GPU",
        ("CUDA shared memory utilities require Python package 'cuda-python'",),
    ),
    "memory_growth_test.py": (
        ["-i", "grpc", "-r", "5"],
        "hard-codes localhost:8001 (no -u flag): a test tree listens on a free port",
        # nothing on 8001 (connection refused), or some other server there
        ("127.0.0.1:8001", "custom_identity_int32"),
    ),
}


def test_every_vendored_program_is_listed() -> None:
    programs = {p.name for p in PROGRAMS.glob("*.py") if p.name != "conftest.py"}
    assert programs == set(PASSING) | set(OUT_OF_SCOPE)
    assert len(programs) == 24


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Serving, Path]]:
    from PIL import Image

    root = tmp_path_factory.mktemp("triton_client_examples")
    repo = root / "repo"
    ignore = shutil.ignore_patterns("__pycache__", "classifier")
    shutil.copytree(MODELS, repo, ignore=ignore)
    shutil.copytree(REPEAT, repo / "repeat_int32", ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "settings.json").write_text('{"server_name": "triton"}\n')
    image = root / "grey200.png"
    Image.new("RGB", (40, 30), (200, 200, 200)).save(image)
    with Serving(repo, root / "run", workers=2) as serving:
        asyncio.run(_wait(serving.address))
        yield serving, image


@pytest.fixture(scope="module")
def served_dyna(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    root = tmp_path_factory.mktemp("triton_dyna_examples")
    repo = root / "repo"
    shutil.copytree(DYNA_MODELS, repo, ignore=shutil.ignore_patterns("__pycache__"))
    with Serving(repo, root / "run", workers=2) as serving:
        asyncio.run(_wait(serving.address))
        yield serving


async def _wait(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        await wait_serving(channel, timeout=90)


def run_program(program: str, args: list[str], url: list[str]) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, str(PROGRAMS / program), *args, *url],
        capture_output=True,
        text=True,
        timeout=110,
    )
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize("program", sorted(PASSING))
def test_triton_example_passes(served: tuple[Serving, Path], program: str) -> None:
    serving, image = served
    args, passed = PASSING[program]
    args = [str(image) if a == IMAGE else a for a in args]
    try:
        code, output = run_program(program, args, ["-u", serving.address])
    finally:
        if program == "simple_grpc_model_control.py":  # it ends with 'simple' unloaded
            with grpcclient.InferenceServerClient(serving.address) as client:
                client.load_model("simple", config='{"max_batch_size": 8}')
    assert code == 0, output
    assert passed in output, output


@pytest.mark.parametrize("program", sorted(OUT_OF_SCOPE))
def test_triton_example_out_of_scope_fails_as_documented(
    served: tuple[Serving, Path], program: str
) -> None:
    serving, _ = served
    args, _why, printed = OUT_OF_SCOPE[program]
    url = [] if program == "memory_growth_test.py" else ["-u", serving.address]
    code, output = run_program(program, args, url)
    assert code != 0, output
    assert any(text in output for text in printed), output


@pytest.mark.parametrize("program", sorted(DYNA))
def test_triton_sequence_example_passes_in_dyna_mode(served_dyna: Serving, program: str) -> None:
    assert program in PASSING  # the same program, the other mode
    code, output = run_program(program, ["-d"], ["-u", served_dyna.address])
    assert code == 0, output
    assert DYNA[program] in output, output
