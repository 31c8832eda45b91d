"""The REST floor: one uvicorn process (httptools), a bare ASGI app, no framework.

It answers what perf_analyzer ``-i http`` asks (server and model metadata,
readiness, the model's config and statistics as perf_handlers.py writes them)
and ``POST /v2/models/echo/infer``: it decodes the request (JSON ``data``, or
Triton's binary tensor extension: the ``Inference-Header-Content-Length``
header, the JSON header, then the raw bytes) into a NumPy array and encodes
the same tensor back as ``OUTPUT0``, binary if the request asked for binary
outputs, JSON otherwise. The floor of one Python HTTP hop that decodes and
encodes, as the bare grpc.aio server is the gRPC part's.
usage: python rest_floor.py --port P [--dims 1,16]
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import orjson
import uvicorn
from perf_handlers import ADDON_VERSION, rest_config, rest_stats

NAME = "echo"
Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]


def settings(dims: list[int]) -> dict[str, Any]:
    tensor = {"datatype": "FP32", "shape": dims}
    return {"inputs": [{"name": "INPUT0", **tensor}], "outputs": [{"name": "OUTPUT0", **tensor}]}


def echo(body: bytes, header_length: int | None) -> tuple[bytes, int | None]:
    """The reply body and its JSON header's length (None: a JSON reply)."""
    if header_length is None:
        request = orjson.loads(body)
        raw = None
    else:
        request = orjson.loads(body[:header_length])
        raw = body[header_length:]
    tensor = request["inputs"][0]
    shape = [int(d) for d in tensor["shape"]]
    size = tensor.get("parameters", {}).get("binary_data_size")
    if raw is not None and size is not None:  # perf_analyzer sends the header with JSON too
        array = np.frombuffer(raw[: int(size)], dtype=np.float32).reshape(shape)
    else:
        array = np.asarray(tensor["data"], dtype=np.float32).reshape(shape)
    wanted = request.get("outputs") or []
    binary = bool(request.get("parameters", {}).get("binary_data_output")) or any(
        o.get("parameters", {}).get("binary_data") for o in wanted
    )
    output: dict[str, Any] = {"name": "OUTPUT0", "datatype": "FP32", "shape": shape}
    reply: dict[str, Any] = {"model_name": NAME, "model_version": ADDON_VERSION}
    if not binary:
        output["data"] = array.ravel()
        reply["outputs"] = [output]
        return orjson.dumps(reply, option=orjson.OPT_SERIALIZE_NUMPY), None
    data = array.tobytes()
    output["parameters"] = {"binary_data_size": len(data)}
    reply["outputs"] = [output]
    head = orjson.dumps(reply)
    return head + data, len(head)


def app_for(dims: list[int]) -> Callable[[dict[str, Any], Receive, Send], Awaitable[None]]:
    model = settings(dims)
    metadata = orjson.dumps({"name": NAME, "versions": [ADDON_VERSION], "platform": "floor",
                             **model})  # fmt: skip
    answers = {
        "/v2": orjson.dumps({"name": "rest-floor", "version": "1", "extensions": []}),
        "/v2/health/live": b"",
        "/v2/health/ready": b"",
        f"/v2/models/{NAME}": metadata,
        f"/v2/models/{NAME}/versions/{ADDON_VERSION}": metadata,
        f"/v2/models/{NAME}/ready": b"",
        f"/v2/models/{NAME}/config": orjson.dumps(rest_config(NAME, model, "floor")),
        f"/v2/models/{NAME}/stats": orjson.dumps(rest_stats([NAME])),
        f"/v2/models/{NAME}/versions/{ADDON_VERSION}/stats": orjson.dumps(rest_stats([NAME])),
    }
    infer = {f"/v2/models/{NAME}/infer", f"/v2/models/{NAME}/versions/{ADDON_VERSION}/infer"}

    async def app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        status, headers, body = 404, [(b"content-type", b"application/json")], b'{"error":"?"}'
        if path in infer and scope["method"] == "POST":
            length = None
            for key, value in scope["headers"]:
                if key == b"inference-header-content-length":
                    length = int(value)
            try:
                body, head = echo(b"".join(chunks), length)
                status = 200
                if head is not None:
                    headers = [(b"content-type", b"application/octet-stream"),
                               (b"inference-header-content-length", b"%d" % head)]  # fmt: skip
            except (ValueError, KeyError, TypeError) as exc:
                status, body = 400, orjson.dumps({"error": str(exc)})
        elif path in answers:
            status, body = 200, answers[path]
        headers.append((b"content-length", b"%d" % len(body)))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dims", default="1,16")
    args = parser.parse_args()
    dims = [int(d) for d in args.dims.split(",")]
    print("rest-floor: ready", flush=True)  # uvicorn binds before it serves; the bench polls
    uvicorn.run(app_for(dims), host="127.0.0.1", port=args.port, http="httptools", loop="asyncio",
                lifespan="off", access_log=False, log_level="warning")  # fmt: skip


if __name__ == "__main__":
    main()
