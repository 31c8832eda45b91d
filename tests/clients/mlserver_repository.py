"""MLServer 1.7.1's own generated stub of its model repository service
(``mlserver.grpc.model_repository_pb2_grpc``) against an address, in its own
process (MLServer's generated modules register protobuf package
``inference``, as tritonclient's do). Runs the calls given and prints one
JSON line: per call, its answer (the index as a list of [name, version,
state, reason]) or its status [code name, details].
usage: mlserver_repository.py HOST:PORT CALL [CALL ...]
  CALL: index | ready-index | load:NAME | unload:NAME
"""

import asyncio
import json
import sys

import grpc
from mlserver.grpc import model_repository_pb2 as mr
from mlserver.grpc import model_repository_pb2_grpc as mrg


async def main(address: str, calls: list[str]) -> list[object]:
    answers: list[object] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = mrg.ModelRepositoryServiceStub(channel)
        for call in calls:
            what, _, name = call.partition(":")
            try:
                if what in ("index", "ready-index"):
                    index = await stub.RepositoryIndex(
                        mr.RepositoryIndexRequest(ready=what == "ready-index"), timeout=60
                    )
                    answers.append([[m.name, m.version, m.state, m.reason] for m in index.models])
                elif what == "load":
                    await stub.RepositoryModelLoad(
                        mr.RepositoryModelLoadRequest(model_name=name), timeout=120
                    )
                    answers.append("loaded")
                elif what == "unload":
                    await stub.RepositoryModelUnload(
                        mr.RepositoryModelUnloadRequest(model_name=name), timeout=120
                    )
                    answers.append("unloaded")
                else:
                    raise SystemExit(f"unknown call {call!r}")
            except grpc.aio.AioRpcError as exc:
                answers.append([exc.code().name, exc.details()])
    return answers


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2:]))))
