"""CPU per request of a 9.2 MiB echo at concurrency 8, summed over every
process of the server (issue 20 §4): what a 2-core host pays per request.

    python bench/large_cpu.py poolserve [--requests 160]
    python bench/large_cpu.py kserve    [--requests 160]

Starts the server on a free port (poolserve serve with 2 workers from this
checkout's .venv; KServe from the bench's peers with bench/peers/
kserve_server.py's echo model, as bench/servers.py starts it; 64 MiB message
limits), sends FP32 [16,3,224,224] echoes from 8 grpc.aio callers in this
process after 16 to warm up, and reads the user + system CPU
time of the server's session (every process) from /proc before and after.
Prints ms of CPU per request by process name, and the request rate (the
rate depends on the host's other load; the CPU per request much less).
Run with the project's venv (numpy, grpc, poolserve importable).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from poolserve.protos import inference_pb2 as pb
from poolserve.protos import inference_pb2_grpc as pbg
from poolserve.service.inference.codec import encode_inputs

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
LIMIT = 64 * 1024 * 1024
SHAPE = (16, 3, 224, 224)
ECHO = """import numpy as np
from poolserve.service import Model

class Echo(Model):
    def predict(self, inputs, parameters):
        return {"OUTPUT0": inputs["INPUT0"]}
"""
SETTINGS = (
    '{"name": "echo", "implementation": "model.Echo",'
    ' "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 3, 224, 224]}],'
    ' "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1, 3, 224, 224]}]}'
)
KSERVE_SETTINGS = SETTINGS.replace('"model.Echo"', '"kserve_server.EchoModel"').replace(
    '"inputs"', '"parameters": {"extra": {}}, "inputs"'
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(server: str, work: Path, port: int) -> subprocess.Popen[bytes]:
    log = (work / "server.log").open("wb")
    if server == "poolserve":
        repo = work / "repo" / "echo"
        repo.mkdir(parents=True)
        (repo / "model.py").write_text(ECHO)
        (repo / "model-settings.json").write_text(SETTINGS)
        argv = [str(ROOT / ".venv" / "bin" / "poolserve"), "serve", str(work / "repo")]
        argv += ["--grpc-port", str(port), "--workers", "2", "--run-dir", str(work / "run")]
        env = dict(os.environ)
    else:
        repo = work / "repo" / "echo"  # the bench's own KServe launcher and echo model
        repo.mkdir(parents=True)
        (repo / "model-settings.json").write_text(KSERVE_SETTINGS)
        python = BENCH / ".peers" / "kserve" / "bin" / "python"
        argv = [str(python), str(BENCH / "peers" / "kserve_server.py"), str(work / "repo")]
        argv += ["--grpc_port", str(port), "--http_port", str(free_port())]
        argv += ["--grpc_max_send_message_length", str(LIMIT)]
        argv += ["--grpc_max_receive_message_length", str(LIMIT)]
        env = dict(os.environ, KSERVE_LOGLEVEL="WARNING", PYTHONPATH=str(BENCH / "peers"))
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)  # fmt: skip


def session_cpu(sid: int) -> dict[int, tuple[str, float]]:
    """(name, CPU seconds) of every process of the session ``sid``."""
    tick = os.sysconf("SC_CLK_TCK")
    found: dict[int, tuple[str, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[3]) == sid:  # field 6 of stat: the session
            found[int(entry.name)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return found


async def measure(address: str, requests: int, sid: int) -> None:
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    request = pb.ModelInferRequest(model_name="echo")
    data = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
    encode_inputs({"INPUT0": data}, request, raw=True)
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        stub = pbg.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        deadline = time.monotonic() + 180
        while True:
            try:
                await stub.ModelInfer(request, timeout=30)
                break
            except grpc.aio.AioRpcError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
        for _ in range(16):
            await stub.ModelInfer(request, timeout=60)
        before = session_cpu(sid)
        left = [requests]

        async def caller() -> None:
            while left[0] > 0:
                left[0] -= 1
                reply = await stub.ModelInfer(request, timeout=120)
                assert len(reply.raw_output_contents[0]) == data.nbytes

        began = time.monotonic()
        await asyncio.gather(*(caller() for _ in range(8)))
        wall = time.monotonic() - began
        after = session_cpu(sid)
    by_name: dict[str, float] = {}
    for pid, (name, cpu) in after.items():
        by_name[name] = by_name.get(name, 0.0) + cpu - before.get(pid, (name, 0.0))[1]
    total = sum(by_name.values())
    parts = " ".join(f"{name}={1000 * cpu / requests:.1f}" for name, cpu in sorted(by_name.items()))
    per = 1000 * total / requests
    print(f"{requests / wall:.1f} requests/s; CPU ms per request: total {per:.1f} ({parts})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("server", choices=("poolserve", "kserve"))
    parser.add_argument("--requests", type=int, default=160)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="large-cpu-") as folder:
        port = free_port()
        proc = start(args.server, Path(folder), port)
        try:
            asyncio.run(measure(f"127.0.0.1:{port}", args.requests, proc.pid))
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


if __name__ == "__main__":
    sys.exit(main())
