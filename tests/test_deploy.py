"""deploy/ and the Dockerfile agree with the code they deploy.

- systemd: the real `systemd-analyze verify` accepts the unit (with no
  warning about it), and the directives that matter are there;
- Kubernetes and KServe: the manifests parse, and their ports, probe service
  names and commands are what the code serves; the probes from the manifests
  run against real `poolserve serve` trees with the answers Kubernetes needs
  (liveness passes while a model is broken, readiness does not);
- the Dockerfile: it parses, names only files that exist and are not
  dockerignored, and its commands are valid poolserve command lines.

The manifests are read with PyYAML, refusing what YAML readers disagree on
(duplicate keys, plain yes/no/on/off); when `kubectl kustomize` is at hand,
it must read them the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import configparser
import json
import re
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import tomllib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from poolserve.service.contract.settings import ServerSettings, load_server_settings
from poolserve.supervisor.cli import build_parser
from poolserve.supervisor.probe import Check, build_probe_parser, options_from_args

from harness import descendants, kill_pids, pid_alive
from serving import Serving, env_without_notify, wait_serving
from support import BIN, ROOT, copy_example, wait_until, write_model

DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
KSERVE = DEPLOY / "kserve"
UNIT = DEPLOY / "systemd" / "poolserve.service"
ENV_FILE = DEPLOY / "systemd" / "poolserve.env"
SUPERVISORD_CONF = DEPLOY / "supervisord" / "poolserve.conf"
DEFAULT_GRACE = ServerSettings().stop_grace_s


# The shipped timeouts are sized for this many pools (docs/operations.md, "Timeouts").
POOLS_SIZED_FOR = 2


def stop_bound(grace: float, pools: int = POOLS_SIZED_FOR) -> float:
    """The root's stop budget in supervisor/serve.py: the pools stop one after
    another (grace + 5 s each, + 10 s), then the router's grace, the kill
    graces (2 x 5 s), the control service (5 s) and 10 s of margin."""
    return pools * (grace + 5) + 10 + grace + 10 + 5 + 10


# -- a YAML subset reader ------------------------------------------------------------


# YAML 1.1 readers (PyYAML, Kubernetes' go-yaml) take these for booleans or null;
# YAML 1.2 readers take them for strings. A manifest must quote them.
AMBIGUOUS = {
    *("yes", "no", "on", "off", "y", "n", "Yes", "No", "On", "Off", "YES", "NO", "ON", "OFF"),
    *("Y", "N", "True", "TRUE", "False", "FALSE", "Null", "NULL"),
}


def _nodes(node: yaml.Node) -> Iterator[yaml.Node]:
    yield node
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            yield from _nodes(key)
            yield from _nodes(value)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            yield from _nodes(item)


def load_yaml(text: str) -> list[Any]:
    """The documents of a manifest; refuses what YAML readers disagree on
    (a duplicate key, a plain yes/no/on/off)."""
    for document in yaml.compose_all(text, Loader=yaml.SafeLoader):
        for node in _nodes(document) if document is not None else ():
            if isinstance(node, yaml.MappingNode):
                keys = [key.value for key, _ in node.value]
                assert len(keys) == len(set(keys)), f"duplicate key {node.start_mark}"
            elif isinstance(node, yaml.ScalarNode) and node.style is None:
                assert node.value not in AMBIGUOUS, f"quote {node.value!r} {node.start_mark}"
    return [doc for doc in yaml.safe_load_all(text) if doc is not None]


def test_the_manifest_reader_refuses_what_yaml_readers_disagree_on() -> None:
    assert load_yaml("a: 'yes'\nb: [1, on_call]\n---\nc: 1\n") == [
        {"a": "yes", "b": [1, "on_call"]},
        {"c": 1},
    ]
    for bad in ("a: yes\n", "a: [1, off]\n", "a: 1\na: 2\n"):
        with pytest.raises(AssertionError):
            load_yaml(bad)


def manifest_files() -> list[Path]:
    return sorted([*K8S.glob("*.yaml"), *KSERVE.glob("*.yaml")])


def load_manifests() -> dict[tuple[str, str, str], dict[str, Any]]:
    """(file name, kind, metadata.name) -> object, for every manifest."""
    found: dict[tuple[str, str, str], dict[str, Any]] = {}
    for path in manifest_files():
        for doc in load_yaml(path.read_text()):
            assert isinstance(doc, dict), path
            if doc.get("kind") == "Kustomization":
                continue
            found[(path.name, doc["kind"], doc["metadata"]["name"])] = doc
    return found


MANIFESTS = load_manifests()


def objects(kind: str) -> list[tuple[str, dict[str, Any]]]:
    return [(f, doc) for (f, k, _), doc in MANIFESTS.items() if k == kind]


def test_manifests_parse_with_the_expected_kinds() -> None:
    kinds = {(f, k) for (f, k, _) in MANIFESTS}
    assert kinds == {
        ("deployment.yaml", "Deployment"),
        ("deployment-exec-probes.yaml", "Deployment"),
        ("service.yaml", "Service"),
        ("pdb.yaml", "PodDisruptionBudget"),
        ("hpa.yaml", "HorizontalPodAutoscaler"),
        ("servingruntime.yaml", "ServingRuntime"),
        ("inferenceservice.yaml", "InferenceService"),
    }
    for (_, _, _), doc in MANIFESTS.items():
        assert set(doc) >= {"apiVersion", "kind", "metadata", "spec"}


def test_kustomize_builds_the_same_objects() -> None:
    """`kubectl kustomize` (go-yaml, offline) agrees with PyYAML."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    built = subprocess.run(
        [kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=120
    )
    assert built.returncode == 0, built.stderr
    theirs = {(d["kind"], d["metadata"]["name"]): d for d in load_yaml(built.stdout)}
    kustomization = load_yaml((K8S / "kustomization.yaml").read_text())[0]
    ours = {}
    for name in kustomization["resources"]:
        for doc in load_yaml((K8S / name).read_text()):
            ours[(doc["kind"], doc["metadata"]["name"])] = doc
    assert theirs == ours


# -- what the manifests run, against what the code serves ----------------------------


def pod_containers() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(file, pod spec, container) for every container the manifests run."""
    found = []
    for name, deployment in objects("Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        found += [(name, pod, c) for c in pod["containers"]]
    for name, runtime in objects("ServingRuntime"):
        found += [(name, runtime["spec"], c) for c in runtime["spec"]["containers"]]
    return found


def parse_cli(argv: Sequence[str]) -> argparse.Namespace:
    try:
        return build_parser().parse_args(list(argv))
    except SystemExit as exc:  # argparse's way to reject a command line
        raise AssertionError(f"not a valid poolserve command line: {argv}") from exc


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def container_port(container: dict[str, Any]) -> int:
    """The router's gRPC port; the container's ports are it and, when one is
    named ``metrics`` or ``http``, the metrics or REST port its settings set."""
    args = parse_cli(container["args"])
    env = env_of(container)
    port = args.grpc_port or int(env.get("POOLSERVE_GRPC_PORT", ServerSettings().grpc_port))
    ports = container["ports"]
    assert [p["containerPort"] for p in ports if p.get("name") not in ("metrics", "http")] == [port]
    for metrics in (p for p in ports if p.get("name") == "metrics"):
        assert metrics["containerPort"] == metrics_port(container)
    for http in (p for p in ports if p.get("name") == "http"):
        assert http["containerPort"] == http_port(container)
    return int(port)


def http_port(container: dict[str, Any]) -> int:
    args = parse_cli(container["args"])
    env = env_of(container)
    if args.http_port is not None:
        return int(args.http_port)
    return int(env.get("POOLSERVE_HTTP_PORT", ServerSettings().http_port))


def metrics_port(container: dict[str, Any]) -> int:
    args = parse_cli(container["args"])
    env = env_of(container)
    if args.metrics_port is not None:
        return int(args.metrics_port)
    return int(env.get("POOLSERVE_METRICS_PORT", ServerSettings().metrics_port))


def exec_probe_options(command: Sequence[str]) -> Any:
    assert command[:2] == ["poolserve", "probe"], command
    return options_from_args(build_probe_parser().parse_args(list(command[2:])))


def test_containers_run_valid_serve_command_lines(tmp_path: Path) -> None:
    for name, _, container in pod_containers():
        args = parse_cli(container["args"])
        assert args.command == "serve", name
        assert args.host == "0.0.0.0", f"{name}: the router must listen beyond the pod"
        env = env_of(container)
        unknown = {k for k in env if k.startswith("POOLSERVE_")} - {
            "POOLSERVE_" + f.upper() for f in ServerSettings.__dataclass_fields__
        }
        assert not unknown, f"{name}: not poolserve settings: {unknown}"
        settings = load_server_settings(tmp_path, environ=env)  # values are valid
        assert settings.run_dir.startswith("/tmp/"), name
        container_port(container)


def probes_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        kind: container[kind]
        for kind in ("startupProbe", "readinessProbe", "livenessProbe")
        if kind in container
    }


def test_probes_target_the_routers_port_and_known_services() -> None:
    served = {"", "inference.GRPCInferenceService"}  # the router's health names
    for name, _, container in pod_containers():
        port = container_port(container)
        probes = probes_of(container)
        assert {"readinessProbe", "livenessProbe"} <= set(probes), name
        for kind, spec in probes.items():
            if "grpc" in spec:
                assert spec["grpc"]["port"] == port, (name, kind)
                assert spec["grpc"].get("service", "") in served, (name, kind)
            else:
                options = exec_probe_options(spec["exec"]["command"])
                assert options.addr == f"127.0.0.1:{port}", (name, kind)
                assert spec["timeoutSeconds"] > options.rpc_timeout, (name, kind)
        # Liveness must not depend on the models: ServerLive, not health "".
        live = probes["livenessProbe"]
        assert "exec" in live, name
        assert exec_probe_options(live["exec"]["command"]).check is Check.LIVE, name
        # Readiness is the whole server: every model ready.
        ready = probes["readinessProbe"]
        if "grpc" in ready:
            assert ready["grpc"].get("service", "") == "", name
        else:
            options = exec_probe_options(ready["exec"]["command"])
            assert (options.check, options.service) == (Check.HEALTH, ""), name


def test_native_and_exec_deployments_differ_only_in_probes() -> None:
    def without_probes(doc: dict[str, Any]) -> dict[str, Any]:
        clone = json.loads(json.dumps(doc))
        for container in clone["spec"]["template"]["spec"]["containers"]:
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                container.pop(kind, None)
        return clone

    deployments = dict(objects("Deployment"))
    native = deployments["deployment.yaml"]
    exec_only = deployments["deployment-exec-probes.yaml"]
    assert without_probes(native) == without_probes(exec_only)
    native_probes = probes_of(native["spec"]["template"]["spec"]["containers"][0])
    assert "grpc" in native_probes["readinessProbe"]
    assert "grpc" in native_probes["startupProbe"]
    for spec in probes_of(exec_only["spec"]["template"]["spec"]["containers"][0]).values():
        assert "exec" in spec


def test_termination_grace_is_above_pre_stop_and_the_drain() -> None:
    (_, isvc) = objects("InferenceService")[0]
    isvc_grace = isvc["spec"]["predictor"]["terminationGracePeriodSeconds"]
    for name, pod, container in pod_containers():
        grace = float(env_of(container).get("POOLSERVE_STOP_GRACE_S", DEFAULT_GRACE))
        pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep", name
        total = float(pre_stop[1]) + stop_bound(grace)
        # A ServingRuntime's pods get the InferenceService's grace period.
        period = pod.get("terminationGracePeriodSeconds", isvc_grace)
        assert period > total, name


def test_startup_probe_allows_slow_model_loads() -> None:
    for name, _, container in pod_containers():
        startup = container.get("startupProbe")
        if startup is not None:
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, name


def test_resources_follow_the_workers_setting() -> None:
    for name, _, container in pod_containers():
        workers = int(env_of(container)["POOLSERVE_PARALLEL_WORKERS"])
        cpu = container["resources"]["requests"]["cpu"]
        cores = float(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)
        assert cores >= workers, f"{name}: {workers} workers need {workers} cores"


def test_service_pdb_and_hpa_point_at_the_deployment() -> None:
    deployment = dict(objects("Deployment"))["deployment.yaml"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items()
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    ((_, service),) = objects("Service")
    assert service["spec"]["selector"] == selector
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert set(ports) == {"grpc", "http", "metrics"}
    assert ports["http"]["targetPort"] == "http"
    assert ports["http"]["port"] == http_port(container)
    assert ports["grpc"]["targetPort"] in ("grpc", container_port(container))
    assert ports["grpc"]["port"] == container_port(container)
    assert ports["metrics"]["targetPort"] == "metrics"  # the name a ServiceMonitor uses
    assert ports["metrics"]["port"] == metrics_port(container)
    ((_, pdb),) = objects("PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == selector
    ((_, hpa),) = objects("HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert hpa["spec"]["minReplicas"] >= 2, "the PDB keeps one pod when there are two"
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"


def test_kserve_runtime_speaks_v2_over_grpc() -> None:
    ((_, runtime),) = objects("ServingRuntime")
    ((_, isvc),) = objects("InferenceService")
    assert runtime["spec"]["protocolVersions"] == ["grpc-v2"]
    (container,) = runtime["spec"]["containers"]
    (port,) = container["ports"]
    assert port["name"] == "h2c", "KServe and Knative route HTTP/2 cleartext to 'h2c'"
    args = parse_cli(container["args"])
    assert args.repo == Path("/mnt/models"), "KServe's storage initializer writes there"
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
    formats = {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert model["modelFormat"]["name"] in formats


def test_images_match_the_dockerfile_user() -> None:
    user = dockerfile_value("USER").split(":")[0]
    for name, pod, container in pod_containers():
        security = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
        assert security.get("runAsNonRoot") is True, name
        if "runAsUser" in security:
            assert str(security["runAsUser"]) == user, name
        assert container["securityContext"]["allowPrivilegeEscalation"] is False, name


# -- the manifests' probes, run against real servers ---------------------------------

NO_LOAD = """
from poolserve.service import Model

class NoLoad(Model):
    def load(self):
        raise RuntimeError("weights file is corrupt")
"""


def _repo(root: Path, broken: bool) -> Path:
    repo = root / "repo"
    copy_example(repo, "echo")
    if broken:
        write_model(
            repo,
            "broken",
            {"implementation": "model.NoLoad", "parameters": {"inference_pool_gid": "b"}},
            NO_LOAD,
        )
    return repo


async def _wait(address: str, service: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        await wait_serving(channel, service, timeout=90)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Serving]]:
    """A ready tree, and one whose second model cannot load."""
    ready_root = tmp_path_factory.mktemp("deploy-ready")
    broken_root = tmp_path_factory.mktemp("deploy-broken")
    with (
        Serving(_repo(ready_root, False), ready_root / "run", workers=1) as ready,
        Serving(_repo(broken_root, True), broken_root / "run", workers=1) as broken,
    ):
        asyncio.run(_wait(ready.address, ""))
        asyncio.run(_wait(broken.address, "model:echo"))
        yield {"ready": ready, "broken": broken}


def run_manifest_probe(spec: dict[str, Any], address: str) -> bool:
    """Runs one probe as the kubelet would, against ``address``; True if it passes."""
    if "grpc" in spec:
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest(service=spec["grpc"].get("service", ""))
            try:
                reply = stub.Check(request, timeout=60, wait_for_ready=True)
            except grpc.RpcError:
                return False
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
    command = list(spec["exec"]["command"])
    command[command.index("--addr") + 1] = address
    command[0] = str(BIN / "poolserve")
    command += ["--connect-timeout", "30", "--rpc-timeout", "30"]  # loaded CI, not speed
    return subprocess.run(command, capture_output=True, timeout=120).returncode == 0


@pytest.mark.e2e
def test_manifest_probes_against_real_servers(servers: dict[str, Serving]) -> None:
    for name, _, container in pod_containers():
        for kind, spec in probes_of(container).items():
            assert run_manifest_probe(spec, servers["ready"].address), (name, kind)
            passes_when_broken = run_manifest_probe(spec, servers["broken"].address)
            # A model that cannot load keeps the pod out of the Service and
            # never ready, but it is not a reason to kill the pod.
            assert passes_when_broken == (kind == "livenessProbe"), (name, kind)


@pytest.mark.e2e
def test_dockerfile_healthcheck_against_real_servers(servers: dict[str, Serving]) -> None:
    command = json.loads(dockerfile_value("HEALTHCHECK").split("CMD", 1)[1])
    spec = {"exec": {"command": ["poolserve", *command[1:]]}}
    assert run_manifest_probe(spec, servers["ready"].address)
    assert not run_manifest_probe(spec, servers["broken"].address)


# -- systemd -------------------------------------------------------------------------


def unit_directives(text: str) -> dict[str, dict[str, list[str]]]:
    """[Section] -> key -> values (systemd allows a key more than once)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        assert current is not None, f"directive outside a section: {line}"
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def systemd_seconds(value: str) -> float:
    units = {"ms": 0.001, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value):
        total += float(number) * units[unit or "s"]
    return total


def env_file() -> dict[str, str]:
    values = {}
    for raw in ENV_FILE.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key] = value
    return values


def verifiable_unit(folder: Path, text: str) -> Path:
    """The unit with ExecStart's binary pointed at this environment's poolserve
    (systemd-analyze checks that it exists) and the environment file at ours."""
    text = text.replace("/opt/poolserve/bin/poolserve", str(BIN / "poolserve"))
    text = re.sub(r"(?m)^EnvironmentFile=.*$", f"EnvironmentFile={ENV_FILE}", text)
    path = folder / "poolserve.service"
    path.write_text(text)
    return path


def systemd_analyze_verify(unit: Path) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("systemd-analyze")
    assert tool is not None, "systemd-analyze is needed (Debian package systemd)"
    return subprocess.run(
        [tool, "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    unit = verifiable_unit(tmp_path, UNIT.read_text())
    result = systemd_analyze_verify(unit)
    assert result.returncode == 0, result.stderr
    # verify exits 0 even for unknown keys: any line about our file is a finding.
    findings = [line for line in result.stderr.splitlines() if unit.name in line]
    assert not findings, "\n".join(findings)


def test_systemd_analyze_verify_would_catch_a_mistake(tmp_path: Path) -> None:
    """The check above can fail: a misspelled directive shows up."""
    text = UNIT.read_text().replace("NotifyAccess=main", "NotifyAcess=main")
    result = systemd_analyze_verify(verifiable_unit(tmp_path, text))
    assert "NotifyAcess" in result.stderr


def test_unit_directives() -> None:
    unit = unit_directives(UNIT.read_text())
    service, start = unit["Service"], unit["Unit"]

    def one(key: str, section: dict[str, list[str]] | None = None) -> str:
        values = (section or service).get(key)
        assert values is not None and len(values) == 1, f"{key}: {values}"
        return values[0]

    assert one("Type") == "notify"
    assert one("NotifyAccess") == "main"
    assert systemd_seconds(one("WatchdogSec")) > 0
    assert one("Restart") == "on-failure"
    assert int(one("StartLimitBurst", start)) >= 1
    assert systemd_seconds(one("StartLimitIntervalSec", start)) > 0
    assert one("RestartPreventExitStatus") == "2", "exit 2 is an invalid configuration"
    assert int(one("LimitNOFILE")) >= 65536, "every client connection is a descriptor"
    assert one("KillMode") in ("mixed", "control-group")
    grace = float(env_file().get("POOLSERVE_STOP_GRACE_S", DEFAULT_GRACE))
    assert systemd_seconds(one("TimeoutStopSec")) > stop_bound(grace)
    assert one("User") not in ("root", "0")
    assert one("RuntimeDirectory") == "poolserve"
    assert one("RuntimeDirectoryMode") == "0700"
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
    }.items():
        assert one(key) == value, key
    assert "%t/poolserve" in one("ReadWritePaths").split()
    assert one("EnvironmentFile") == "/etc/poolserve/poolserve.env"


def test_unit_execstart_is_a_valid_serve_command() -> None:
    unit = unit_directives(UNIT.read_text())
    (exec_start,) = unit["Service"]["ExecStart"]
    argv = shlex.split(exec_start)
    assert argv[0] == "/opt/poolserve/bin/poolserve"
    env = env_file()
    argv = [a.replace("${POOLSERVE_REPOSITORY}", env["POOLSERVE_REPOSITORY"]) for a in argv]
    args = parse_cli([a.replace("%t", "/run") for a in argv[1:]])
    assert args.command == "serve"
    assert args.run_dir == "/run/poolserve", "the RuntimeDirectory"


def receive_notify(sock: socket.socket) -> tuple[int, list[str]]:
    """One notify datagram: (the sender's pid from SCM_CREDENTIALS, its lines)."""
    data, ancillary, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(struct.calcsize("3i")))
    pid = 0
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            pid = struct.unpack("3i", payload[: struct.calcsize("3i")])[0]
    return pid, data.decode().splitlines()


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_unit_execstart_speaks_notify_from_the_main_process(tmp_path: Path) -> None:
    """What the unit promises systemd, checked on the unit's own ExecStart:
    READY=1 (Type=notify), WATCHDOG=1 pings (WatchdogSec) and STOPPING=1,
    all sent by the main process itself (NotifyAccess=main drops the rest),
    and exit code 0 on SIGTERM."""
    (exec_start,) = unit_directives(UNIT.read_text())["Service"]["ExecStart"]
    repo = tmp_path / "repo"
    copy_example(repo, "echo")
    runtime = tmp_path / "rt"
    runtime.mkdir()
    argv = [
        a.replace("${POOLSERVE_REPOSITORY}", str(repo)).replace("%t", str(runtime))
        for a in shlex.split(exec_start)
    ]
    argv[0] = str(BIN / "poolserve")
    env = {**env_without_notify(), **env_file()}
    env.update(POOLSERVE_HOST="127.0.0.1", POOLSERVE_GRPC_PORT="0", POOLSERVE_PARALLEL_WORKERS="1")
    env.update(NOTIFY_SOCKET=str(tmp_path / "notify.sock"), WATCHDOG_USEC="1000000")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(env["NOTIFY_SOCKET"])
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        sock.settimeout(120)  # a bound for a loaded CI machine, not a speed
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        seen: set[int] = set()
        try:
            received: list[tuple[int, str]] = []

            def until(line: str) -> None:
                while not any(text == line for _, text in received):
                    pid, lines = receive_notify(sock)
                    received.extend((pid, text) for text in lines)
                    seen.update(descendants(proc.pid))

            until("READY=1")
            until("WATCHDOG=1")
            assert (runtime / "poolserve" / "router.addr").exists(), "--run-dir %t/poolserve"
            seen.update(descendants(proc.pid))
            proc.send_signal(signal.SIGTERM)
            until("STOPPING=1")
            assert proc.wait(timeout=120) == 0
            senders = {pid for pid, _ in received}
            assert senders == {proc.pid}, f"main pid {proc.pid}, senders {senders}"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
            kill_pids(sorted(seen))
            wait_until(lambda: not any(pid_alive(p) for p in seen), timeout=30)


def test_env_file_holds_valid_settings(tmp_path: Path) -> None:
    env = env_file()
    fields = {"POOLSERVE_" + f.upper() for f in ServerSettings.__dataclass_fields__}
    settings_vars = {k: v for k, v in env.items() if k != "POOLSERVE_REPOSITORY"}
    assert set(settings_vars) <= fields, set(settings_vars) - fields
    assert "POOLSERVE_RUN_DIR" not in env, "the unit passes its RuntimeDirectory"
    settings = load_server_settings(tmp_path, environ=settings_vars)
    assert settings.host == "0.0.0.0"


# -- supervisord (static; test_supervisord.py runs the real one) ----------------------


def test_supervisord_program_directives() -> None:
    parser = configparser.RawConfigParser()
    parser.read_string(SUPERVISORD_CONF.read_text())
    assert parser.sections() == ["program:poolserve"]
    program = parser["program:poolserve"]
    assert program["stopasgroup"] == "true"
    assert program["killasgroup"] == "true"
    assert program["stopsignal"] == "TERM"
    assert program["autorestart"] in ("true", "unexpected")
    assert set(program["exitcodes"].split(",")) == {"0", "2"}
    assert int(program["startsecs"]) > 0
    env = dict(item.split("=", 1) for item in program["environment"].split(",") if "=" in item)
    grace = float(env.get("POOLSERVE_STOP_GRACE_S", str(DEFAULT_GRACE)).strip('"'))
    assert int(program["stopwaitsecs"]) > stop_bound(grace)
    args = parse_cli(shlex.split(program["command"])[1:])
    assert args.command == "serve"


# -- the Dockerfile -------------------------------------------------------------------

DOCKERFILE = ROOT / "Dockerfile"
INSTRUCTIONS = {
    "FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME",
    "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL",
}  # fmt: skip


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuations joined and comments dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue  # a comment inside a continued instruction
        pending += line[:-1] + " " if line.endswith("\\") else line
        if line.endswith("\\"):
            continue
        word, _, rest = pending.partition(" ")
        result.append((word, rest.strip()))
        pending = ""
    assert not pending, "the last instruction ends with a continuation"
    return result


def dockerfile_value(instruction: str) -> str:
    values = [rest for word, rest in dockerfile_instructions() if word == instruction]
    return values[-1]


def final_stage() -> list[tuple[str, str]]:
    instructions = dockerfile_instructions()
    last_from = max(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    return instructions[last_from:]


def test_dockerfile_parses() -> None:
    instructions = dockerfile_instructions()
    words = [word for word, _ in instructions]
    assert set(words) <= INSTRUCTIONS, set(words) - INSTRUCTIONS
    assert all(word.isupper() for word in words)
    assert next(w for w in words if w != "ARG") == "FROM", "only ARG may come before FROM"
    for word, rest in instructions:
        if word in ("CMD", "ENTRYPOINT") or (word == "HEALTHCHECK" and "CMD [" in rest):
            exec_form = rest.split("CMD", 1)[1] if word == "HEALTHCHECK" else rest
            assert isinstance(json.loads(exec_form), list), f"{word}: exec form expected"


def _build_args() -> dict[str, str]:
    args = {}
    for word, rest in dockerfile_instructions():
        if word == "ARG" and "=" in rest:
            key, _, value = rest.partition("=")
            args[key] = value
    return args


def test_dockerfile_base_is_slim_python_the_project_supports() -> None:
    args = _build_args()
    bases = [rest.split()[0] for word, rest in dockerfile_instructions() if word == "FROM"]
    for base in bases:
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
        match = re.fullmatch(r"python:(\d+)\.(\d+)-slim(-\w+)?", image)
        assert match, image
        pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
        low = re.search(r">=\s*(\d+)\.(\d+)", pyproject["project"]["requires-python"])
        assert low is not None
        assert (int(match[1]), int(match[2])) >= (int(low[1]), int(low[2]))


def _dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _ignored(path: str, patterns: Sequence[str]) -> bool:
    import fnmatch

    parts = Path(path).parts
    for pattern in patterns:
        pattern = pattern.removeprefix("**/").rstrip("/")
        for depth in range(1, len(parts) + 1):
            prefix = "/".join(parts[:depth])
            if fnmatch.fnmatch(prefix, pattern) or fnmatch.fnmatch(parts[depth - 1], pattern):
                return True
    return False


def test_dockerfile_copies_only_files_that_exist_and_are_in_the_context() -> None:
    patterns = _dockerignore_patterns()
    stages = {
        rest.split()[-1] for w, rest in dockerfile_instructions() if w == "FROM" and " AS " in rest
    }
    copied = []
    for word, rest in dockerfile_instructions():
        if word not in ("COPY", "ADD"):
            continue
        parts = rest.split()
        flags = [p for p in parts if p.startswith("--")]
        sources = [p for p in parts if not p.startswith("--")][:-1]
        stage = next((f.split("=", 1)[1] for f in flags if f.startswith("--from=")), None)
        if stage is not None:
            assert stage in stages, f"COPY --from={stage}: no such stage"
            continue
        for source in sources:
            assert (ROOT / source).exists(), f"{word} {source}: no such file in the repository"
            assert not _ignored(source.rstrip("/"), patterns), f"{source} is in .dockerignore"
            copied.append(source.rstrip("/"))
    # `pip install .` needs the project file, its readme and every package folder.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = {"pyproject.toml", pyproject["project"]["readme"]}
    needed |= {d.split("/")[0] for d in pyproject["tool"]["setuptools"]["package-dir"].values()}
    assert needed <= set(copied), needed - set(copied)


def test_dockerfile_user_entrypoint_and_healthcheck() -> None:
    stage = final_stage()
    words = [w for w, _ in stage]
    user = dockerfile_value("USER")
    assert user.split(":")[0] not in ("root", "0"), "the image runs as a non-root user"
    assert words.index("USER") < words.index("ENTRYPOINT")
    entrypoint = json.loads(dockerfile_value("ENTRYPOINT"))
    assert Path(entrypoint[0]).name == "tini" and entrypoint[1] == "--"
    assert Path(entrypoint[2]).name == "poolserve"
    cmd = json.loads(dockerfile_value("CMD"))
    args = parse_cli(cmd)
    assert args.command == "serve"
    destinations = [rest.split()[-1] for w, rest in stage if w == "COPY"]
    assert any(d.startswith(f"{args.repo}/") for d in destinations), "CMD serves what it ships"
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(r for w, r in stage if w == "ENV")))
    port = int(env["POOLSERVE_GRPC_PORT"])
    http = int(env.get("POOLSERVE_HTTP_PORT", ServerSettings().http_port))
    assert dockerfile_value("EXPOSE") == f"{port} {http}"  # gRPC and REST
    health = dockerfile_value("HEALTHCHECK")
    command = json.loads(health.split("CMD", 1)[1])
    assert Path(command[0]).name == "poolserve" and command[1] == "probe"
    options = options_from_args(build_probe_parser().parse_args(command[2:]))
    assert options.addr == f"127.0.0.1:{port}"
    timeout = systemd_seconds(re.search(r"--timeout=(\S+)", health)[1])  # type: ignore[index]
    assert timeout > options.rpc_timeout
    assert "--start-period=" in health, "models take time to load"
    assert dockerfile_value("STOPSIGNAL") == "SIGTERM"


# -- metrics: Prometheus, Grafana ------------------------------------------------------

PROMETHEUS_DIR = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "poolserve-dashboard.json"


def test_deployments_expose_and_annotate_the_metrics_port() -> None:
    for name, deployment in objects("Deployment"):
        template = deployment["spec"]["template"]
        (container,) = template["spec"]["containers"]
        port = metrics_port(container)
        assert port > 0, f"{name}: metrics are on"
        names = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert names["metrics"] == port, name
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true", name
        assert annotations["prometheus.io/port"] == str(port), name
        assert annotations["prometheus.io/path"] == "/metrics", name


def test_systemd_and_supervisord_set_the_metrics_port(tmp_path: Path) -> None:
    env = dict(
        line.split("=", 1)
        for line in ENV_FILE.read_text().splitlines()
        if line and not line.startswith("#")
    )
    settings = load_server_settings(tmp_path, environ=env)
    assert settings.metrics_port == 8082 and settings.host == "0.0.0.0"
    parser = configparser.ConfigParser(interpolation=None)
    parser.read_string(SUPERVISORD_CONF.read_text())
    command = shlex.split(parser["program:poolserve"]["command"])
    args = parse_cli(command[1:])
    assert args.metrics_port == settings.metrics_port


def _scrape_configs(path: Path) -> dict[str, dict[str, Any]]:
    (config,) = load_yaml(path.read_text())
    scrape = config["global"]
    assert scrape["scrape_timeout"] <= scrape["scrape_interval"]
    return {job["job_name"]: job for job in config["scrape_configs"]}


def test_prometheus_configs_scrape_the_metrics_port() -> None:
    (job,) = _scrape_configs(PROMETHEUS_DIR / "prometheus.yml").values()
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == [f"127.0.0.1:{ServerSettings().metrics_port}"]
    (pods,) = _scrape_configs(PROMETHEUS_DIR / "prometheus-kubernetes.yml").values()
    assert pods["kubernetes_sd_configs"] == [{"role": "pod"}]
    sources = {tuple(r["source_labels"]) for r in pods["relabel_configs"]}
    assert ("__meta_kubernetes_pod_annotation_prometheus_io_scrape",) in sources
    promtool = shutil.which("promtool")
    if promtool is not None:  # Debian's build has no Kubernetes discovery: the static one
        done = subprocess.run(
            [promtool, "check", "config", str(PROMETHEUS_DIR / "prometheus.yml")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stdout + done.stderr


def exported_metric_names() -> set[str]:
    """Every sample name the router's exposition holds for a pool with one model."""
    from prometheus_client.parser import text_string_to_metric_families

    from poolserve.protos import control_pb2 as cpb
    from poolserve.service.poolcore.stats import BUCKETS_S
    from poolserve.service.router.metrics import (
        Continuity,
        RouterCounts,
        Snapshot,
        pool_counters,
        render,
    )

    answer = cpb.PoolMetrics(
        gid="a",
        instance="1",
        models=[cpb.ModelMetrics(name="m", version="1", request=cpb.Histogram(buckets=[0] * 16))],
        processes=[cpb.ProcessMetrics(pid=1, kind="worker")],
        bucket_bounds_s=BUCKETS_S,
    )
    answer.models[0].queue.buckets.extend([0] * 16)
    answer.models[0].compute.buckets.extend([0] * 16)
    state = Continuity()
    state.update("1", pool_counters(answer))
    counts = RouterCounts({}, requests={"0": 1}, stalled={"m": 1})
    text, _ = render(Snapshot({"a": answer}, {"a": state}, counts))
    names = {s.name for f in text_string_to_metric_families(text.decode()) for s in f.samples}
    return names | {n.removesuffix("_total") for n in names}  # Triton's counters keep theirs


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]


def test_grafana_dashboard_queries_only_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "poolserve"
    exported = exported_metric_names()
    used: set[str] = set()
    for expr in dashboard_exprs():
        names = set(re.findall(r"\b(?:nv|poolserve)_[a-z_]+\b", expr))
        assert names, expr
        assert names <= exported, f"{expr}: {names - exported} not exported"
        used |= names
    titles = " ".join(panel["title"].lower() for panel in dashboard["panels"])
    topics = (
        "throughput",
        "p50",
        "p99",
        "queue",
        "busy",
        "restarts",
        "deadline",
        "router",
        "stalled",
    )
    for topic in topics:
        assert topic in titles, topic
    assert {
        "nv_inference_request_success",
        "poolserve_deadline_exceeded_total",
        "poolserve_router_requests_total",
        "poolserve_streams_stalled_total",
    } <= used
