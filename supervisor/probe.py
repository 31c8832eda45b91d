"""``poolserve probe``: a gRPC health check that exits like grpc_health_probe.

Made for exec probes, Docker HEALTHCHECK and scripts. The exit code is the
whole answer, the same codes as grpc_health_probe:

- 0: SERVING (or ready / live);
- 1: bad arguments (including TLS files that cannot be read);
- 2: connection failure: refused, TLS handshake failed, or no HTTP/2
  connection within ``--connect-timeout``;
- 3: the RPC failed or took longer than ``--rpc-timeout`` (a service name
  the server does not know is NOT_FOUND, hence 3);
- 4: the server answered, and the answer is "not serving".

By default it calls grpc.health.v1 ``Check(--service)``; ``--ready`` calls
ServerReady, ``--live`` ServerLive, ``--model NAME`` ModelReady. One line
goes to stderr, like grpc_health_probe's log.

When the answer is "not serving", the line says why: each model that is
not ready, with its state and reason, as ``poolserve status`` shows them
(read with RepositoryIndex on the same connection).

Without ``--addr``, the probe asks the router of the local tree: the
address it wrote in its run directory (``--run-dir``, ``POOLSERVE_RUN_DIR``,
or the default of ``--grpc-port`` or ``POOLSERVE_GRPC_PORT``, as ``poolserve
status`` finds it). Without that file: ``localhost:PORT`` when the run
directory is the port's default (a tree may run as another user, with
another default), and a connection failure when it was named (``--run-dir``,
``POOLSERVE_RUN_DIR``): no tree runs there, and whatever answers on the port
is another one.

The connection is made first (bounded by ``--connect-timeout``), then the
one RPC (bounded by ``--rpc-timeout``), so the exit code says which failed.
"""

# A probe is a short-lived process: it uses the synchronous gRPC API, and
# imports gRPC only once its arguments are valid.

from __future__ import annotations

import argparse
import enum
import os
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, cast

from poolserve.supervisor.helptext import plain

if TYPE_CHECKING:
    import grpc

EXIT_SERVING = 0
EXIT_BAD_ARGUMENTS = 1
EXIT_CONNECTION_FAILURE = 2
EXIT_RPC_FAILURE = 3
EXIT_UNHEALTHY = 4

DEFAULT_TIMEOUT_S = 1.0
USER_AGENT = "poolserve_probe"

_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


class BadArguments(Exception):
    """Arguments that cannot work together; the probe exits with 1."""


class NoTree(Exception):
    """The named run directory has no router address: the probe exits with 2."""


class Check(enum.Enum):
    HEALTH = "health"  # grpc.health.v1.Health/Check(service)
    LIVE = "live"  # ServerLive
    READY = "ready"  # ServerReady
    MODEL = "model"  # ModelReady(name, version)


@dataclass(frozen=True)
class ProbeOptions:
    addr: str
    check: Check = Check.HEALTH
    service: str = ""
    model: str = ""
    model_version: str = ""
    connect_timeout: float = DEFAULT_TIMEOUT_S
    rpc_timeout: float = DEFAULT_TIMEOUT_S
    tls: bool = False
    tls_no_verify: bool = False
    tls_ca_cert: str = ""
    tls_client_cert: str = ""
    tls_client_key: str = ""
    tls_server_name: str = ""
    verbose: bool = False

    @property
    def target(self) -> str:
        """A gRPC target; ``:8081`` means this host, as grpc_health_probe reads it."""
        return f"localhost{self.addr}" if self.addr.startswith(":") else self.addr


@dataclass(frozen=True)
class ProbeResult:
    code: int
    message: str


def parse_duration(text: str) -> float:
    """Seconds from ``1.5`` or a Go duration (``1s``, ``500ms``, ``1m30s``)."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    pos = 0
    total = 0.0
    while pos < len(text):
        match = _DURATION_PART.match(text, pos)
        if match is None:
            raise argparse.ArgumentTypeError(f"invalid duration {text!r} (try 1.5 or 500ms)")
        total += float(match.group(1)) * _UNIT_S[match.group(2)]
        pos = match.end()
    if not text:
        raise argparse.ArgumentTypeError("empty duration")
    return total


def add_probe_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``poolserve probe`` (grpc_health_probe's, plus the V2 checks)."""
    parser.add_argument(
        "--addr",
        default="",
        help="host:port, :port or unix:PATH (default: the local tree's router, as status finds it)",
    )
    parser.add_argument(
        "--run-dir", default=None, help="without --addr: the run directory of the tree to probe"
    )
    parser.add_argument(
        "--grpc-port",
        type=int,
        default=None,
        help="without --addr: the tree's port, to find its run directory (as status does)",
    )
    parser.add_argument("--service", default=None, help='health service name (default: "")')
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--ready", action="store_true", help="check ServerReady instead of health")
    what.add_argument("--live", action="store_true", help="check ServerLive instead of health")
    what.add_argument("--model", default=None, help="check ModelReady for this model")
    parser.add_argument("--model-version", default="", help="with --model: the version")
    timeout = f"seconds or a duration such as 500ms (default {DEFAULT_TIMEOUT_S:g})"
    parser.add_argument(
        "--connect-timeout", type=parse_duration, default=DEFAULT_TIMEOUT_S, help=timeout
    )
    parser.add_argument(
        "--rpc-timeout", type=parse_duration, default=DEFAULT_TIMEOUT_S, help=timeout
    )
    parser.add_argument("--tls", action="store_true", help="use TLS (default: plaintext)")
    parser.add_argument(
        "--tls-no-verify",
        action="store_true",
        help="(with --tls) trust whatever certificate the server presents (INSECURE)",
    )
    parser.add_argument("--tls-ca-cert", default="", help="(with --tls) trusted CA certificates")
    parser.add_argument("--tls-client-cert", default="", help="(with --tls) client certificate")
    parser.add_argument("--tls-client-key", default="", help="(with --tls) client private key")
    parser.add_argument(
        "--tls-server-name", default="", help="(with --tls) name to verify the server as"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="say what happens")


def options_from_args(args: argparse.Namespace) -> ProbeOptions:
    """Validates the combination of flags, as grpc_health_probe does."""
    addr = args.addr or default_address(args.run_dir, grpc_port=args.grpc_port)
    for name in ("connect_timeout", "rpc_timeout"):
        if getattr(args, name) <= 0:
            flag = "--" + name.replace("_", "-")
            raise BadArguments(f"{flag} must be greater than zero (got {getattr(args, name)})")
    if not args.tls:
        for flag in ("tls_no_verify", "tls_ca_cert", "tls_client_cert", "tls_server_name"):
            if getattr(args, flag):
                raise BadArguments(f"specified --{flag.replace('_', '-')} without --tls")
    if bool(args.tls_client_cert) != bool(args.tls_client_key):
        raise BadArguments("--tls-client-cert and --tls-client-key go together")
    if args.tls_no_verify and args.tls_ca_cert:
        raise BadArguments("cannot use --tls-ca-cert with --tls-no-verify (it would not be used)")
    if args.tls_no_verify and args.tls_server_name:
        raise BadArguments("cannot use --tls-server-name with --tls-no-verify")
    check = Check.HEALTH
    if args.ready:
        check = Check.READY
    elif args.live:
        check = Check.LIVE
    elif args.model is not None:
        if not args.model:
            raise BadArguments("--model needs a model name")
        check = Check.MODEL
    if check is not Check.HEALTH and args.service is not None:
        raise BadArguments(f"--service is for the health check, not --{check.value}")
    if check is not Check.MODEL and args.model_version:
        raise BadArguments("--model-version goes with --model")
    return ProbeOptions(
        addr=addr,
        check=check,
        service=args.service or "",
        model=args.model or "",
        model_version=args.model_version,
        connect_timeout=args.connect_timeout,
        rpc_timeout=args.rpc_timeout,
        tls=args.tls,
        tls_no_verify=args.tls_no_verify,
        tls_ca_cert=args.tls_ca_cert,
        tls_client_cert=args.tls_client_cert,
        tls_client_key=args.tls_client_key,
        tls_server_name=args.tls_server_name,
        verbose=args.verbose,
    )


def default_address(
    run_dir: str | None,
    environ: Mapping[str, str] | None = None,
    grpc_port: int | None = None,
) -> str:
    """The router address of the local tree, as ``poolserve status`` finds its run
    directory (``--run-dir``, ``POOLSERVE_RUN_DIR``, the default of ``--grpc-port``
    or ``POOLSERVE_GRPC_PORT``). When the tree wrote none: ``localhost:PORT`` for
    the port's default run directory, NoTree for a named one."""
    from poolserve.service.contract.rundir import ADDRESS_FILE
    from poolserve.supervisor.status_cli import default_grpc_port, resolve_run_dir

    env = os.environ if environ is None else environ
    folder = resolve_run_dir(run_dir, grpc_port, env)
    try:
        written = (folder / ADDRESS_FILE).read_text().strip()
    except OSError:
        written = ""
    if written:
        return written
    if run_dir or env.get("POOLSERVE_RUN_DIR"):
        raise NoTree(
            f"error: no tree runs with run directory {folder} (no {ADDRESS_FILE} there); "
            "name the server with --addr, or start the tree"
        )
    port = default_grpc_port(env) if grpc_port is None else grpc_port
    return f"localhost:{port}"


class ProbeArgumentParser(argparse.ArgumentParser):
    """Usage errors exit with 1, grpc_health_probe's code for bad arguments."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_BAD_ARGUMENTS, f"{self.prog}: error: {message}\n")


def build_probe_parser(prog: str = "poolserve probe") -> ProbeArgumentParser:
    parser = ProbeArgumentParser(
        prog=prog,
        description=plain(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_probe_arguments(parser)
    return parser


def main(argv: Sequence[str]) -> int:
    """``poolserve probe ARGS``: parses, probes, prints one line, returns the code."""
    args = build_probe_parser().parse_args(argv)
    try:
        options = options_from_args(args)
    except BadArguments as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_ARGUMENTS
    except NoTree as exc:
        print(exc, file=sys.stderr)
        return EXIT_CONNECTION_FAILURE
    if options.verbose:
        print(f"address: {options.addr}", file=sys.stderr)
    result = probe(options)
    print(result.message, file=sys.stderr)
    return result.code


# -- the probe -----------------------------------------------------------------


def probe(options: ProbeOptions) -> ProbeResult:
    # gRPC's own log lines (handshake failures...) would bury the one line
    # this probe prints; the user's GRPC_VERBOSITY wins.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    import grpc

    try:
        channel = _open_channel(options)
    except BadArguments as exc:
        return ProbeResult(EXIT_BAD_ARGUMENTS, f"error: {exc}")
    except OSError as exc:  # --tls-no-verify could not fetch the certificate
        return ProbeResult(
            EXIT_CONNECTION_FAILURE, f"error: failed to connect service at {options.addr!r}: {exc}"
        )
    with channel:
        began = time.monotonic()
        state = _wait_connected(channel, options.connect_timeout)
        if state is None:
            return ProbeResult(
                EXIT_CONNECTION_FAILURE,
                f"timeout: failed to connect service {options.addr!r} "
                f"within {options.connect_timeout:g}s",
            )
        if options.verbose:
            print(
                f"connection: {state.name} after {time.monotonic() - began:.3f}s", file=sys.stderr
            )
        call = _rpc(options, channel)
        try:
            healthy, status = call(options.rpc_timeout)
        except grpc.RpcError as exc:
            return _rpc_failure(options, state, exc)
        why = _why_not_ready(options, channel) if not healthy else ""
    if not healthy:
        return ProbeResult(EXIT_UNHEALTHY, f"service unhealthy (responded with {status}){why}")
    return ProbeResult(EXIT_SERVING, f"status: {status}")


def _why_not_ready(options: ProbeOptions, channel: grpc.Channel) -> str:
    """``: model 'm' UNAVAILABLE: reason; ...`` for the models the failed check
    covers that are not READY; empty when the server cannot say."""
    import grpc

    from poolserve.protos import inference_pb2 as pb
    from poolserve.protos import inference_pb2_grpc as pbg

    wanted = options.model if options.check is Check.MODEL else ""
    if options.check is Check.HEALTH and options.service.startswith("model:"):
        wanted = options.service.removeprefix("model:")
    elif options.check is Check.HEALTH and options.service:
        return ""  # a pool's or another service's health: no model to name
    stub = pbg.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
    try:
        index = stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=options.rpc_timeout)
    except grpc.RpcError:
        return ""
    reasons = [
        f"model {model.name!r} {model.state or 'UNKNOWN'}"
        + (f": {model.reason}" if model.reason else "")
        for model in index.models
        if model.state != "READY" and (not wanted or model.name == wanted)
    ]
    if wanted and not reasons and all(model.name != wanted for model in index.models):
        reasons = [f"model {wanted!r} is not in the repository"]
    return ": " + "; ".join(reasons) if reasons else ""


def _rpc_failure(
    options: ProbeOptions, state: grpc.ChannelConnectivity, exc: grpc.RpcError
) -> ProbeResult:
    import grpc

    call = cast("grpc.Call", exc)  # what the sync stubs raise is both
    code = call.code()
    details = call.details() or ""
    if state is not grpc.ChannelConnectivity.READY and code is grpc.StatusCode.UNAVAILABLE:
        return ProbeResult(
            EXIT_CONNECTION_FAILURE,
            f"error: failed to connect service at {options.addr!r}: {details}",
        )
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return ProbeResult(
            EXIT_RPC_FAILURE,
            f"timeout: {_describe(options)} did not complete within {options.rpc_timeout:g}s",
        )
    if code is grpc.StatusCode.UNIMPLEMENTED and options.check is Check.HEALTH:
        return ProbeResult(
            EXIT_RPC_FAILURE,
            "error: this server does not implement the grpc health protocol "
            "(grpc.health.v1.Health)",
        )
    return ProbeResult(
        EXIT_RPC_FAILURE, f"error: {_describe(options)} failed: {code.name}: {details}"
    )


def _describe(options: ProbeOptions) -> str:
    if options.check is Check.HEALTH:
        return f"health rpc (service {options.service!r})"
    if options.check is Check.MODEL:
        return f"ModelReady rpc (model {options.model!r})"
    return "ServerReady rpc" if options.check is Check.READY else "ServerLive rpc"


def _rpc(options: ProbeOptions, channel: grpc.Channel) -> Callable[[float], tuple[bool, str]]:
    """The one call of this probe: returns (healthy, status as printed)."""
    if options.check is Check.HEALTH:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        health = health_pb2_grpc.HealthStub(channel)

        def check(timeout: float) -> tuple[bool, str]:
            request = health_pb2.HealthCheckRequest(service=options.service)
            reply = health.Check(request, timeout=timeout)
            name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            return reply.status == health_pb2.HealthCheckResponse.SERVING, name

        return check

    from poolserve.protos import inference_pb2 as pb
    from poolserve.protos import inference_pb2_grpc as pbg

    stub = pbg.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]

    def v2(timeout: float) -> tuple[bool, str]:
        if options.check is Check.READY:
            ok = bool(stub.ServerReady(pb.ServerReadyRequest(), timeout=timeout).ready)
            return ok, "READY" if ok else "NOT_READY"
        if options.check is Check.LIVE:
            ok = bool(stub.ServerLive(pb.ServerLiveRequest(), timeout=timeout).live)
            return ok, "LIVE" if ok else "NOT_LIVE"
        request = pb.ModelReadyRequest(name=options.model, version=options.model_version)
        ok = bool(stub.ModelReady(request, timeout=timeout).ready)
        return ok, f"model {options.model!r} {'READY' if ok else 'NOT_READY'}"

    return v2


def _wait_connected(channel: grpc.Channel, timeout: float) -> grpc.ChannelConnectivity | None:
    """READY, or TRANSIENT_FAILURE on the first failed attempt; None on timeout.

    Failing on the first failed attempt makes a refused connection a prompt
    exit 2 instead of retrying until ``--connect-timeout``.
    """
    import queue

    import grpc

    states: queue.SimpleQueue[grpc.ChannelConnectivity] = queue.SimpleQueue()
    record = states.put
    channel.subscribe(record, try_to_connect=True)
    deadline = time.monotonic() + timeout
    try:
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                state = states.get(timeout=remaining)
            except queue.Empty:
                return None
            if state in (
                grpc.ChannelConnectivity.READY,
                grpc.ChannelConnectivity.TRANSIENT_FAILURE,
                grpc.ChannelConnectivity.SHUTDOWN,
            ):
                return state
        return None
    finally:
        channel.unsubscribe(record)


def _open_channel(options: ProbeOptions) -> grpc.Channel:
    import grpc

    channel_options: list[tuple[str, str | int]] = [
        ("grpc.primary_user_agent", USER_AGENT),
        ("grpc.enable_retries", 0),
    ]
    if not options.tls:
        return grpc.insecure_channel(options.target, options=channel_options)
    root: bytes | None = None
    server_name = options.tls_server_name
    if options.tls_no_verify:
        root, server_name = _pin_presented_certificate(options)
    elif options.tls_ca_cert:
        root = _read(options.tls_ca_cert, "--tls-ca-cert")
    key = _read(options.tls_client_key, "--tls-client-key") if options.tls_client_key else None
    chain = _read(options.tls_client_cert, "--tls-client-cert") if options.tls_client_cert else None
    if server_name:
        channel_options.append(("grpc.ssl_target_name_override", server_name))
    credentials = grpc.ssl_channel_credentials(
        root_certificates=root, private_key=key, certificate_chain=chain
    )
    return grpc.secure_channel(options.target, credentials, options=channel_options)


def _read(path: str, flag: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise BadArguments(f"{flag}: cannot read {path}: {exc.strerror}") from None
    if b"-----BEGIN" not in data:
        raise BadArguments(f"{flag}: {path} is not a PEM file")
    return data


def _pin_presented_certificate(options: ProbeOptions) -> tuple[bytes, str]:
    """--tls-no-verify: trusts the certificate the server presents, by name.

    gRPC's Python API cannot skip verification, so the probe fetches the
    server's certificate first (no verification), then hands it to gRPC as
    the only root and verifies against the name it carries. That covers
    self-signed certificates, the usual reason for --tls-no-verify.
    """
    import socket
    import ssl

    host, port = _host_port(options.target)
    deadline = time.monotonic() + options.connect_timeout
    loose = ssl.create_default_context()
    loose.check_hostname = False
    loose.verify_mode = ssl.CERT_NONE
    with (
        socket.create_connection((host, port), timeout=options.connect_timeout) as raw,
        loose.wrap_socket(raw, server_hostname=host) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    if not der:
        raise OSError("the server presented no certificate")
    pem = ssl.DER_cert_to_PEM_cert(der)
    # Read the names in the certificate through a verifying handshake that
    # trusts exactly this certificate (the ssl module decodes only verified ones).
    pinned = ssl.create_default_context(cadata=pem)
    pinned.check_hostname = False
    pinned.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    remaining = max(0.05, deadline - time.monotonic())
    with (
        socket.create_connection((host, port), timeout=remaining) as raw,
        pinned.wrap_socket(raw, server_hostname=host) as tls,
    ):
        decoded = tls.getpeercert() or {}
    return pem.encode(), _certificate_name(decoded) or host


def _certificate_name(decoded: Mapping[str, object]) -> str:
    """The first DNS name of a decoded certificate, else an IP, else its CN."""
    pairs = decoded.get("subjectAltName", ())
    alt = [pair for pair in pairs if isinstance(pair, tuple)] if isinstance(pairs, tuple) else []
    for kind in ("DNS", "IP Address"):
        for entry_kind, value in alt:
            if entry_kind == kind:
                return str(value).strip()
    subject = decoded.get("subject", ())
    for rdn in subject if isinstance(subject, tuple) else ():
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return ""


def _host_port(target: str) -> tuple[str, int]:
    if target.startswith("unix:"):
        raise BadArguments("--tls-no-verify needs a host:port address")
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        raise BadArguments(f"--addr {target!r}: expected host:port")
    return host.strip("[]") or "localhost", int(port)
