"""Shared helpers for tests: repositories, clients, process bookkeeping."""

from __future__ import annotations

import contextlib
import gc
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np

from poolserve.protos import inference_pb2 as pb
from poolserve.service.inference.codec import encode_inputs

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "models"
BIN = Path(sys.executable).parent
CLIENTS = Path(__file__).resolve().parent / "clients"


def write_model(
    repo: Path,
    folder: str,
    settings: dict[str, Any],
    code: str | None = None,
) -> Path:
    path = repo / folder
    path.mkdir(parents=True, exist_ok=True)
    (path / "model-settings.json").write_text(json.dumps(settings))
    if code is not None:
        (path / "model.py").write_text(code)
    return path


def copy_example(repo: Path, name: str, gid: str | None = None) -> Path:
    target = repo / name
    source = EXAMPLES / name
    if not source.exists():  # the MLServer runtime's folder (it needs the mlserver extra)
        source = ROOT / "examples" / "mlserver" / name
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    if gid is not None:
        settings_path = target / "model-settings.json"
        settings = json.loads(settings_path.read_text())
        settings.setdefault("parameters", {})["inference_pool_gid"] = gid
        settings_path.write_text(json.dumps(settings))
    return target


def copy_echo_any(repo: Path, name: str = "echo_any", gid: str | None = None) -> Path:
    """The example echo as ``name``, declaring no inputs or outputs: it takes any
    tensors (a model that declares none is not checked), for tests that send
    every datatype and shape through the codec."""
    target = repo / name
    shutil.copytree(EXAMPLES / "echo", target, ignore=shutil.ignore_patterns("__pycache__"))
    settings_path = target / "model-settings.json"
    settings = json.loads(settings_path.read_text())
    settings["name"] = name
    del settings["inputs"], settings["outputs"]
    if gid is not None:
        settings.setdefault("parameters", {})["inference_pool_gid"] = gid
    settings_path.write_text(json.dumps(settings))
    return target


def train_iris(folder: Path) -> None:
    subprocess.run([sys.executable, str(folder / "train.py")], check=True, capture_output=True)


def infer_request(
    model: str, array: np.ndarray, *, raw: bool = True, ident: str = "", **params: int | str
) -> bytes:
    request = pb.ModelInferRequest(model_name=model, id=ident)
    encode_inputs({"INPUT0": array}, request, raw=raw)
    for key, value in params.items():
        if isinstance(value, str):
            request.parameters[key].string_param = value
        else:
            request.parameters[key].int64_param = value
    return request.SerializeToString()


def run_client(script: str, *args: str, timeout: float = 120) -> Any:
    """Runs a third-party client script in its own process; returns its JSON output."""
    proc = subprocess.run(
        [sys.executable, "-P", str(CLIENTS / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def wait_until(predicate: Any, timeout: float, interval: float = 0.02) -> bool:
    """Polls a condition that has no event to wait on (e.g. /proc); True if it held."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def iter_lines(stream: Any, deadline: float) -> Iterator[str]:
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            return
        yield line


@contextlib.contextmanager
def no_collector() -> Iterator[None]:
    """The cyclic garbage collector off (what only it would free stays until
    :func:`held_in_cycles` looks), on again after."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def held_in_cycles(min_size: int = 1 << 20) -> list[str]:
    """The frames (function and local) that only the cyclic garbage collector
    would free while they hold a buffer of ``min_size`` bytes or more (a
    request's body kept alive by a reference cycle); collects them."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = [
            f"{obj.f_code.co_qualname}: {name}"
            for obj in gc.garbage
            if isinstance(obj, FrameType)
            for name, value in obj.f_locals.items()
            if isinstance(value, bytes | bytearray | memoryview) and len(value) >= min_size
        ]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.collect()
    return found
