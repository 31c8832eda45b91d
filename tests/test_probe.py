"""`poolserve probe`: grpc_health_probe's exit codes against real servers.

0 SERVING, 1 bad arguments, 2 connection failure, 3 RPC failure or timeout,
4 not SERVING; the same codes for --ready (ServerReady), --live (ServerLive)
and --model (ModelReady). Every server here is real: `poolserve serve` trees,
a gRPC server with TLS, a socket that never speaks HTTP/2, and one that does
the HTTP/2 handshake but never answers a call.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from poolserve.supervisor import probe as probe_module
from poolserve.supervisor.probe import (
    EXIT_BAD_ARGUMENTS,
    EXIT_CONNECTION_FAILURE,
    EXIT_RPC_FAILURE,
    EXIT_SERVING,
    EXIT_UNHEALTHY,
    BadArguments,
    build_probe_parser,
    options_from_args,
    parse_duration,
)

from serving import Serving, wait_serving
from support import BIN, copy_example, write_model

NO_LOAD = """
from poolserve.service import Model

class NoLoad(Model):
    def load(self):
        raise RuntimeError("weights file is corrupt")

    def predict(self, inputs, parameters):
        raise AssertionError("never loaded")
"""

# Generous: CI is a loaded 2-core machine. The codes, not the speed, are tested.
SLOW_OK = ("--connect-timeout", "30", "--rpc-timeout", "30")


def run_probe(
    *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The real command line, in its own process, as exec probes run it."""
    return subprocess.run(
        [str(BIN / "poolserve"), "probe", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env,
    )


def assert_code(proc: subprocess.CompletedProcess[str], code: int) -> None:
    assert proc.returncode == code, f"exit {proc.returncode}, expected {code}:\n{proc.stderr}"


async def _wait_health(address: str, service: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        await wait_serving(channel, service, timeout=90)


# -- arguments: exit code 1 ------------------------------------------------------


def _options(*argv: str) -> probe_module.ProbeOptions:
    return options_from_args(build_probe_parser().parse_args(list(argv)))


@pytest.mark.parametrize(
    "argv",
    [
        ["--connect-timeout", "0"],
        ["--addr", "x:1", "--connect-timeout", "0"],
        ["--addr", "x:1", "--rpc-timeout", "-1"],
        ["--addr", "x:1", "--tls-no-verify"],
        ["--addr", "x:1", "--tls-ca-cert", "ca.pem"],
        ["--addr", "x:1", "--tls-server-name", "a"],
        ["--addr", "x:1", "--tls-client-cert", "c.pem"],
        ["--addr", "x:1", "--tls", "--tls-client-cert", "c.pem"],
        ["--addr", "x:1", "--tls", "--tls-client-key", "k.pem"],
        ["--addr", "x:1", "--tls", "--tls-no-verify", "--tls-ca-cert", "ca.pem"],
        ["--addr", "x:1", "--tls", "--tls-no-verify", "--tls-server-name", "a"],
        ["--addr", "x:1", "--ready", "--service", "x"],
        ["--addr", "x:1", "--model", ""],
        ["--addr", "x:1", "--model-version", "1"],
    ],
)
def test_invalid_combinations_are_bad_arguments(argv: list[str]) -> None:
    with pytest.raises(BadArguments):
        _options(*argv)


@pytest.mark.parametrize(
    "argv",
    [
        ["--addr", "127.0.0.1:1", "--bogus"],
        ["--addr", "127.0.0.1:1", "--ready", "--live"],
        ["--addr", "127.0.0.1:1", "--rpc-timeout", "soon"],
        ["--addr", "127.0.0.1:1", "--tls", "--tls-no-verify", "--tls-ca-cert", "x"],
        ["--service", "x", "--connect-timeout", "0"],
        ["--addr", "127.0.0.1:1", "--tls", "--tls-ca-cert", "/nonexistent/ca.pem"],
    ],
)
def test_bad_arguments_exit_1(argv: list[str]) -> None:
    assert_code(run_probe(*argv), EXIT_BAD_ARGUMENTS)


def test_help_exits_0() -> None:
    proc = run_probe("--help")
    assert_code(proc, 0)
    assert "--rpc-timeout" in proc.stdout


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("1", 1.0), ("0.25", 0.25), ("1s", 1.0), ("500ms", 0.5), ("1m30s", 90.0), ("2h", 7200.0)],
)
def test_durations_read_like_grpc_health_probe(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "s", "1x", "1s-"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_duration(text)


def test_port_only_address_means_this_host() -> None:
    assert _options("--addr", ":8081").target == "localhost:8081"
    assert _options("--addr", "unix:/run/x.sock").target == "unix:/run/x.sock"


# -- a serving tree: 0, and 3 for names it does not know -------------------------


@pytest.fixture(scope="module")
def ready_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    root = tmp_path_factory.mktemp("probe-ready")
    repo = root / "repo"
    copy_example(repo, "echo")
    with Serving(repo, root / "run", workers=1) as serving:
        asyncio.run(_wait_health(serving.address, ""))
        yield serving


@pytest.mark.e2e
@pytest.mark.parametrize(
    "check",
    [
        [],
        ["--service", ""],
        ["--service", "inference.GRPCInferenceService"],
        ["--service", "model:echo"],
        ["--ready"],
        ["--live"],
        ["--model", "echo"],
        ["--model", "echo", "--model-version", "1"],
    ],
)
def test_serving_exits_0(ready_server: Serving, check: list[str]) -> None:
    proc = run_probe("--addr", ready_server.address, *check, *SLOW_OK)
    assert_code(proc, EXIT_SERVING)
    assert proc.stderr.startswith("status: ")


@pytest.mark.e2e
def test_port_only_address(ready_server: Serving) -> None:
    port = ready_server.address.rsplit(":", 1)[1]
    assert_code(run_probe("--addr", f":{port}", *SLOW_OK), EXIT_SERVING)


@pytest.mark.e2e
def test_pool_socket_directly(ready_server: Serving) -> None:
    socket_path = ready_server.run_dir / "pool-default.sock"
    assert_code(run_probe("--addr", f"unix:{socket_path}", *SLOW_OK), EXIT_SERVING)


@pytest.mark.e2e
def test_an_unknown_service_is_an_rpc_failure(ready_server: Serving) -> None:
    proc = run_probe("--addr", ready_server.address, "--service", "no-such-service", *SLOW_OK)
    assert_code(proc, EXIT_RPC_FAILURE)
    assert "NOT_FOUND" in proc.stderr


@pytest.mark.e2e
def test_an_unknown_model_is_not_ready(ready_server: Serving) -> None:
    """ModelReady answers ready=false for a model that does not exist, as Triton does."""
    proc = run_probe("--addr", ready_server.address, "--model", "no-such-model", *SLOW_OK)
    assert_code(proc, EXIT_UNHEALTHY)
    assert "NOT_READY" in proc.stderr


# -- a tree with a model whose load() raises: 4 ----------------------------------


@pytest.fixture(scope="module")
def unready_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    root = tmp_path_factory.mktemp("probe-unready")
    repo = root / "repo"
    copy_example(repo, "echo")
    write_model(
        repo,
        "broken",
        {"implementation": "model.NoLoad", "parameters": {"inference_pool_gid": "b"}},
        NO_LOAD,
    )
    with Serving(repo, root / "run", workers=1) as serving:
        asyncio.run(_wait_health(serving.address, "model:echo"))
        yield serving


@pytest.mark.e2e
@pytest.mark.parametrize(
    "check",
    [[], ["--service", "model:broken"], ["--ready"], ["--model", "broken"]],
)
def test_not_serving_exits_4(unready_server: Serving, check: list[str]) -> None:
    proc = run_probe("--addr", unready_server.address, *check, *SLOW_OK)
    assert_code(proc, EXIT_UNHEALTHY)
    assert "unhealthy" in proc.stderr
    # ... and says why: the model's state and the reason its load failed.
    assert "model 'broken' UNAVAILABLE" in proc.stderr, proc.stderr
    assert "weights file is corrupt" in proc.stderr, proc.stderr
    assert "'echo'" not in proc.stderr, "only what is not ready is named"


@pytest.mark.e2e
def test_without_addr_probes_the_local_tree(unready_server: Serving) -> None:
    """No --addr: the router of the tree whose run directory status would use."""
    env = {**os.environ, "POOLSERVE_RUN_DIR": str(unready_server.run_dir)}
    proc = run_probe("--model", "echo", *SLOW_OK, env=env)
    assert_code(proc, EXIT_SERVING)
    proc = run_probe("--run-dir", str(unready_server.run_dir), "--ready", *SLOW_OK)
    assert_code(proc, EXIT_UNHEALTHY)
    assert "weights file is corrupt" in proc.stderr, proc.stderr


def test_default_address_without_a_tree(tmp_path: Path) -> None:
    """A named run directory without an address is no tree: the probe says so (exit
    2) instead of asking whatever answers on the port, which is another tree."""
    env = {"POOLSERVE_RUN_DIR": str(tmp_path / "none"), "POOLSERVE_GRPC_PORT": "9123"}
    with pytest.raises(probe_module.NoTree, match="no tree runs with run directory"):
        probe_module.default_address(None, env)
    with pytest.raises(probe_module.NoTree):
        probe_module.default_address(str(tmp_path), {"POOLSERVE_GRPC_PORT": "9123"})
    (tmp_path / "router.addr").write_text("127.0.0.1:4567\n")
    assert probe_module.default_address(str(tmp_path), env) == "127.0.0.1:4567"
    proc = run_probe("--run-dir", str(tmp_path / "none"), "-v")
    assert_code(proc, EXIT_CONNECTION_FAILURE)
    assert "no tree runs with run directory" in proc.stderr, proc.stderr


def test_grpc_port_finds_that_trees_run_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`probe --grpc-port P` finds the tree on P as `status --grpc-port P` does
    (README's second tree): its run directory's address file, else localhost:P."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    env: dict[str, str] = {}
    assert probe_module.default_address(None, env, grpc_port=9123) == "localhost:9123"
    run_dir = tmp_path / f"poolserve-{os.getuid()}-9123"
    run_dir.mkdir()
    (run_dir / "router.addr").write_text("127.0.0.1:9123\n")
    assert probe_module.default_address(None, env, grpc_port=9123) == "127.0.0.1:9123"
    parser = argparse.ArgumentParser()
    probe_module.add_probe_arguments(parser)
    args = parser.parse_args(["--grpc-port", "9123"])
    monkeypatch.delenv("POOLSERVE_RUN_DIR", raising=False)
    assert probe_module.options_from_args(args).addr == "127.0.0.1:9123"


@pytest.mark.e2e
@pytest.mark.parametrize("check", [["--live"], ["--model", "echo"], ["--service", "model:echo"]])
def test_what_still_works_exits_0(unready_server: Serving, check: list[str]) -> None:
    """Liveness and the healthy model do not depend on the broken one."""
    assert_code(run_probe("--addr", unready_server.address, *check, *SLOW_OK), EXIT_SERVING)


# -- no server: 2 ----------------------------------------------------------------


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_connection_refused_exits_2() -> None:
    proc = run_probe("--addr", f"127.0.0.1:{closed_port()}", *SLOW_OK)
    assert_code(proc, EXIT_CONNECTION_FAILURE)
    assert "failed to connect" in proc.stderr


def test_missing_unix_socket_exits_2(tmp_path: Path) -> None:
    proc = run_probe("--addr", f"unix:{tmp_path / 'nothing.sock'}", *SLOW_OK)
    assert_code(proc, EXIT_CONNECTION_FAILURE)


class SilentServer:
    """Accepts TCP connections; optionally does the HTTP/2 handshake; never answers."""

    # An empty SETTINGS frame (the server preface) and an ACK of the client's.
    SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
    SETTINGS_ACK = b"\x00\x00\x00\x04\x01\x00\x00\x00\x00"

    def __init__(self, http2: bool) -> None:
        self.http2 = http2
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            self.conns.append(conn)
            if self.http2:
                with contextlib.suppress(OSError):
                    conn.sendall(self.SETTINGS + self.SETTINGS_ACK)

    def __enter__(self) -> SilentServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.thread.join(timeout=30)
        for conn in self.conns:
            conn.close()


def test_tcp_without_http2_is_a_connection_failure() -> None:
    """Like grpc_health_probe: no HTTP/2 connection within --connect-timeout is 2."""
    with SilentServer(http2=False) as server:
        proc = run_probe("--addr", f"127.0.0.1:{server.port}", "--connect-timeout", "0.5")
    assert_code(proc, EXIT_CONNECTION_FAILURE)
    assert "timeout: failed to connect" in proc.stderr


def test_http2_without_an_answer_is_an_rpc_timeout() -> None:
    with SilentServer(http2=True) as server:
        proc = run_probe(
            "--addr",
            f"127.0.0.1:{server.port}",
            "--connect-timeout",
            "30",
            "--rpc-timeout",
            "0.5",
        )
    assert_code(proc, EXIT_RPC_FAILURE)
    assert "did not complete within 0.5s" in proc.stderr


# -- plain gRPC servers: no health service, a hanging one, TLS ------------------


@contextlib.contextmanager
def grpc_server(
    *,
    status: int | None = health_pb2.HealthCheckResponse.SERVING,
    credentials: grpc.ServerCredentials | None = None,
    hang: threading.Event | None = None,
) -> Iterator[int]:
    """A real grpc server on 127.0.0.1; status None registers no health service."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    if status is not None:
        servicer = health.HealthServicer()
        servicer.set("", status)
        if hang is not None:
            real_check = servicer.Check

            def hanging_check(request: object, context: grpc.ServicerContext) -> object:
                hang.wait(timeout=60)
                return real_check(request, context)

            servicer.Check = hanging_check  # type: ignore[method-assign]
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        yield port
    finally:
        if hang is not None:
            hang.set()
        server.stop(grace=None).wait(timeout=30)


def test_no_health_service_is_an_rpc_failure() -> None:
    with grpc_server(status=None) as port:
        proc = run_probe("--addr", f"127.0.0.1:{port}", *SLOW_OK)
    assert_code(proc, EXIT_RPC_FAILURE)
    assert "does not implement the grpc health protocol" in proc.stderr


def test_slow_health_check_is_an_rpc_timeout() -> None:
    with grpc_server(hang=threading.Event()) as port:
        proc = run_probe(
            "--addr", f"127.0.0.1:{port}", "--connect-timeout", "30", "--rpc-timeout", "0.3"
        )
    assert_code(proc, EXIT_RPC_FAILURE)


def test_unknown_status_is_unhealthy() -> None:
    with grpc_server(status=health_pb2.HealthCheckResponse.UNKNOWN) as port:
        proc = run_probe("--addr", f"127.0.0.1:{port}", *SLOW_OK)
    assert_code(proc, EXIT_UNHEALTHY)
    assert "UNKNOWN" in proc.stderr


def test_v2_checks_on_a_server_without_v2_are_rpc_failures() -> None:
    with grpc_server() as port:
        proc = run_probe("--addr", f"127.0.0.1:{port}", "--ready", *SLOW_OK)
    assert_code(proc, EXIT_RPC_FAILURE)
    assert "UNIMPLEMENTED" in proc.stderr


class Certificates:
    """A CA, a server certificate it signed for poolserve.test, a client one,
    and a self-signed certificate: made with the openssl command line."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        key = ["-nodes", "-newkey", "rsa:2048"]
        self._openssl("req", "-x509", "-days", "2", *key, "-keyout", "ca.key", "-out", "ca.pem",
                      "-subj", "/CN=poolserve test CA")  # fmt: skip
        for name in ("server", "client"):
            host = f"{name}.poolserve.test"
            (folder / f"{name}.ext").write_text(f"subjectAltName=DNS:{host}\n")
            self._openssl("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                          "-subj", f"/CN={host}")  # fmt: skip
            self._openssl("x509", "-req", "-days", "2", "-in", f"{name}.csr", "-CA", "ca.pem",
                          "-CAkey", "ca.key", "-CAcreateserial", "-out", f"{name}.pem",
                          "-extfile", f"{name}.ext")  # fmt: skip
        self._openssl("req", "-x509", "-days", "2", *key, "-keyout", "self.key", "-out", "self.pem",
                      "-subj", "/CN=self.poolserve.test",
                      "-addext", "subjectAltName=DNS:self.poolserve.test")  # fmt: skip

    def _openssl(self, *args: str) -> None:
        subprocess.run(["openssl", *args], cwd=self.folder, check=True, capture_output=True)

    def path(self, name: str) -> str:
        return str(self.folder / name)

    def read(self, name: str) -> bytes:
        return (self.folder / name).read_bytes()

    def server_credentials(self, name: str, client_auth: bool = False) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.read(f"{name}.key"), self.read(f"{name}.pem"))],
            root_certificates=self.read("ca.pem") if client_auth else None,
            require_client_auth=client_auth,
        )


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command line makes the test certificates")
    return Certificates(tmp_path_factory.mktemp("certs"))


def test_tls_with_ca_and_server_name(certs: Certificates) -> None:
    with grpc_server(credentials=certs.server_credentials("server")) as port:
        addr = f"127.0.0.1:{port}"
        ca = ("--tls", "--tls-ca-cert", certs.path("ca.pem"))
        ok = run_probe("--addr", addr, *ca, "--tls-server-name", "server.poolserve.test", *SLOW_OK)
        wrong_name = run_probe("--addr", addr, *ca, *SLOW_OK)
        system_roots = run_probe("--addr", addr, "--tls", *SLOW_OK)
        plaintext = run_probe("--addr", addr, *SLOW_OK)
    assert_code(ok, EXIT_SERVING)
    assert_code(wrong_name, EXIT_CONNECTION_FAILURE)
    assert_code(system_roots, EXIT_CONNECTION_FAILURE)
    assert_code(plaintext, EXIT_CONNECTION_FAILURE)


@pytest.mark.parametrize("name", ["server", "self"])
def test_tls_no_verify_trusts_what_the_server_presents(certs: Certificates, name: str) -> None:
    with grpc_server(credentials=certs.server_credentials(name)) as port:
        proc = run_probe("--addr", f"127.0.0.1:{port}", "--tls", "--tls-no-verify", *SLOW_OK)
    assert_code(proc, EXIT_SERVING)


def test_mutual_tls(certs: Certificates) -> None:
    with grpc_server(credentials=certs.server_credentials("server", client_auth=True)) as port:
        base = ["--addr", f"127.0.0.1:{port}", "--tls", "--tls-ca-cert", certs.path("ca.pem")]
        base += ["--tls-server-name", "server.poolserve.test", *SLOW_OK]
        with_cert = run_probe(
            *base,
            "--tls-client-cert",
            certs.path("client.pem"),
            "--tls-client-key",
            certs.path("client.key"),
        )
        without = run_probe(*base)
    assert_code(with_cert, EXIT_SERVING)
    assert_code(without, EXIT_CONNECTION_FAILURE)


def test_not_a_pem_file_is_a_bad_argument(certs: Certificates, tmp_path: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    proc = run_probe("--addr", "127.0.0.1:1", "--tls", "--tls-ca-cert", str(junk))
    assert_code(proc, EXIT_BAD_ARGUMENTS)


def test_refused_fails_fast_without_waiting_for_the_connect_timeout() -> None:
    """A refused connection is reported at the first failed attempt (exit 2),
    not when a one-hour --connect-timeout ends: the probe says it saw the
    connection fail (TRANSIENT_FAILURE), not that it timed out, and it is done
    well inside this test's time (a probe that waited would be killed at 90 s
    and fail the test); no speed is asserted."""
    proc = run_probe(
        "--addr", f"127.0.0.1:{closed_port()}", "--connect-timeout", "3600", "--verbose",
        timeout=90,
    )  # fmt: skip
    assert_code(proc, EXIT_CONNECTION_FAILURE)
    assert "connection: TRANSIENT_FAILURE after" in proc.stderr, proc.stderr
    assert "error: failed to connect service at" in proc.stderr, proc.stderr
    assert "timeout:" not in proc.stderr, proc.stderr
