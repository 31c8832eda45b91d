"""Floods a server with RepositoryModelLoad calls for names that do not exist.

Runs in its own process, so that the flood does not share the measuring
client's event loop or GIL. Each of CONCURRENCY threads sends loads one after
another, each for a new name, until it reads a line on stdin (or EOF). Prints
one JSON line: the calls made, and the status codes and one message seen.
usage: load_flood.py HOST:PORT CONCURRENCY
"""

import json
import sys
import threading

import grpc

METHOD = "/inference.GRPCInferenceService/RepositoryModelLoad"


def request(name):
    # RepositoryModelLoadRequest: field 2 (model_name), length-delimited
    data = name.encode()
    return b"\x12" + bytes([len(data)]) + data


def flood(call, k, stop, seen, lock):
    n = 0
    while not stop.is_set():
        n += 1
        try:
            call(request(f"no-such-model-{k}-{n}"), timeout=60)
            code, details = "OK", ""
        except grpc.RpcError as exc:
            code, details = exc.code().name, exc.details()
        with lock:
            seen["calls"] += 1
            seen["codes"][code] = seen["codes"].get(code, 0) + 1
            seen["details"] = details


def main():
    address, concurrency = sys.argv[1], int(sys.argv[2])
    channel = grpc.insecure_channel(address)
    call = channel.unary_unary(METHOD)
    stop = threading.Event()
    lock = threading.Lock()
    seen = {"calls": 0, "codes": {}, "details": ""}
    threads = [
        threading.Thread(target=flood, args=(call, k, stop, seen, lock)) for k in range(concurrency)
    ]
    for thread in threads:
        thread.start()
    print("flooding", flush=True)
    sys.stdin.readline()
    stop.set()
    for thread in threads:
        thread.join()
    print(json.dumps(seen), flush=True)


if __name__ == "__main__":
    main()
