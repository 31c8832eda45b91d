"""Bad configuration (issue 9.5): a clear error naming the file and the problem,
and never a half-started tree.

Server-level problems (settings.json, the repository itself, the router's
port) stop ``poolserve serve`` with exit code 2 before or instead of a tree,
leaving no process behind. Model-level problems leave the model UNAVAILABLE
with the reason in RepositoryIndex (ServerReady false) while the rest of the
tree serves, as the README describes.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from poolserve.protos import inference_pb2 as pb
from poolserve.protos import inference_pb2_grpc as pbg

from harness import (
    BIN,
    LISTENING_PREFIX,
    Tree,
    free_port,
    infer_bytes,
    kill_pids,
    make_repo,
    payload,
    pids_with_arg,
    wait_gone,
    wait_serving,
)

pytestmark = pytest.mark.e2e


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def serve(
    repo: Path, run_dir: Path, *extra: str, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    argv = [
        str(BIN / "poolserve"),
        "serve",
        str(repo),
        "--grpc-port",
        "0",
        "--run-dir",
        str(run_dir),
        *extra,
    ]
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    finally:
        stray = pids_with_arg(str(run_dir))
        kill_pids(stray)
        wait_gone(stray, 10)


# (what to break, words the error must contain besides the file)
SERVER_CASES: dict[str, tuple[Callable[[Path], Path], list[str]]] = {
    "settings.json is not JSON": (
        lambda repo: _settings(repo, "{nope"),
        ["invalid JSON", "line 1"],
    ),
    "settings.json is a list": (lambda repo: _settings(repo, "[1, 2]"), ["expected a JSON object"]),
    "settings.json has an unknown field": (
        lambda repo: _settings(repo, json.dumps({"wrokers": 3})),
        ["wrokers", "unknown field"],
    ),
    "settings.json has a wrong type": (
        lambda repo: _settings(repo, json.dumps({"max_queue": "big"})),
        ["max_queue", "integer"],
    ),
    "settings.json has an unsafe pool id": (
        lambda repo: _settings(repo, json.dumps({"pools": {"../x": {"workers": 1}}})),
        ["pools.../x", "unsafe pool id"],
    ),
    # Issue 21, section 5: accepted once, and then every call or worker failed.
    "default_timeout_s is NaN": (
        lambda repo: _settings(repo, '{"default_timeout_s": NaN}'),
        ["default_timeout_s", "finite"],
    ),
    "default_timeout_s is infinite": (
        lambda repo: _settings(repo, '{"default_timeout_s": Infinity}'),
        ["default_timeout_s", "finite"],
    ),
    "heartbeat_timeout_s is 0": (
        lambda repo: _settings(repo, json.dumps({"heartbeat_timeout_s": 0})),
        ["heartbeat_timeout_s", "above 0"],
    ),
    "heartbeat_timeout_s is below the interval": (
        lambda repo: _settings(
            repo, json.dumps({"heartbeat_timeout_s": 1, "heartbeat_interval_s": 2})
        ),
        ["heartbeat_timeout_s", "heartbeat_interval_s"],
    ),
    "a TLS file that does not exist": (
        lambda repo: _settings(
            repo,
            json.dumps({"tls_cert_file": "/nonexistent.pem", "tls_key_file": "/nonexistent.key"}),
        ),
        ["tls_cert_file", "/nonexistent.pem"],
    ),
}


def _settings(repo: Path, text: str) -> Path:
    write(repo / "settings.json", text)
    return repo / "settings.json"


@pytest.mark.parametrize("case", sorted(SERVER_CASES))
def test_bad_server_settings_exit_2_naming_file_and_field(tmp_path: Path, case: str) -> None:
    repo = make_repo(tmp_path / "repo", {"echo": None})
    breaker, words = SERVER_CASES[case]
    source = breaker(repo)
    run_dir = tmp_path / "run"
    done = serve(repo, run_dir)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert str(source) in done.stderr, done.stderr
    for word in words:
        assert word in done.stderr, (word, done.stderr)
    assert LISTENING_PREFIX not in done.stdout
    assert "Traceback" not in done.stderr
    assert not run_dir.exists() or not any(run_dir.iterdir())  # no socket, no half tree


@pytest.mark.parametrize(
    ("layout", "words"),
    [
        ("missing", ["not a directory"]),
        ("file", ["not a directory"]),
        ("empty", ["no model-settings.json found"]),
    ],
)
def test_bad_repository_path_exits_2(tmp_path: Path, layout: str, words: list[str]) -> None:
    repo = tmp_path / "repo"
    if layout == "file":
        repo.write_text("not a folder")
    elif layout == "empty":
        repo.mkdir()
    done = serve(repo, tmp_path / "run")
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert str(repo) in done.stderr
    for word in words:
        assert word in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_router_port_in_use_exits_2_with_nothing_left(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", {"echo": None})
    run_dir = tmp_path / "run"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [
            str(BIN / "poolserve"),
            "serve",
            str(repo),
            "--grpc-port",
            str(port),
            "--run-dir",
            str(run_dir),
        ]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"still running 10 s later, never ready:\n{err[-1500:]}") from None
        finally:
            stray = pids_with_arg(str(run_dir))
            kill_pids(stray)
            wait_gone(stray, 10)
    assert proc.returncode == 2, err
    assert str(port) in err and "Traceback" not in err, err
    assert LISTENING_PREFIX not in out
    assert stray == []


MARKS_ITS_LOAD = """
from pathlib import Path

from poolserve.service import Model

class M(Model):
    def load(self):
        Path(__file__).with_name("loaded").write_text("a pool loaded me")

    def predict(self, inputs, parameters):
        return {}
"""


@pytest.mark.parametrize(
    ("flag", "field", "address_file"),
    [
        ("--metrics-port", "metrics_port", "metrics.addr"),
        ("--http-port", "http_port", "http.addr"),
        ("--grpc-port", "grpc_port", "router.addr"),
    ],
)
def test_second_tree_on_the_same_port_exits_2_before_any_pool(
    tmp_path: Path, flag: str, field: str, address_file: str
) -> None:
    """The metrics (8082) and REST (8080) ports stay when --grpc-port changes;
    a second tree found the clash only in its router, after its pools had
    loaded, leaving a socket in its run_dir. It must fail before any pool; so
    must one on the same gRPC port (a fleet holds its ports; one router did not)."""
    port = free_port()
    first = Tree(make_repo(tmp_path / "repo1", {"echo": None}), tmp_path / "run1",
                 workers=1, extra=(flag, str(port)))  # fmt: skip
    with first:
        assert (first.run_dir / address_file).read_text().strip().endswith(f":{port}")
        repo = tmp_path / "repo2"
        write(repo / "marker" / "model-settings.json",
              json.dumps({"name": "marker", "implementation": "model.M"}))  # fmt: skip
        write(repo / "marker" / "model.py", MARKS_ITS_LOAD)
        run_dir = tmp_path / "run2"
        done = serve(repo, run_dir, flag, str(port), timeout=60)
        assert first.proc is not None and first.proc.poll() is None  # the first tree serves on
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert flag in done.stderr and field in done.stderr, done.stderr
    assert str(port) in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert LISTENING_PREFIX not in done.stdout
    assert not (repo / "marker" / "loaded").exists(), "a pool loaded a model first"
    assert not run_dir.exists() or not any(run_dir.iterdir()), list(run_dir.iterdir())


def test_a_host_that_is_not_this_machines_exits_2_before_any_pool(tmp_path: Path) -> None:
    """192.0.2.1 (TEST-NET-1: numeric, no lookup) is no address here: the error names
    `host`, not the gRPC port the router could not bind after the pools loaded."""
    repo = tmp_path / "repo"
    write(repo / "marker" / "model-settings.json",
          json.dumps({"name": "marker", "implementation": "model.M"}))  # fmt: skip
    write(repo / "marker" / "model.py", MARKS_ITS_LOAD)
    done = serve(repo, tmp_path / "run", "--host", "192.0.2.1", "--http-port", "0",
                 "--metrics-port", "0")  # fmt: skip
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "--host: field 'host'" in done.stderr, done.stderr
    assert "192.0.2.1" in done.stderr and "no address of this machine" in done.stderr
    assert "grpc_port" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (repo / "marker" / "loaded").exists(), "a pool loaded a model first"


# --- model-level problems: one tree holding every kind of broken model -------

MODEL = """
from poolserve.service import Model

class M(Model):
    def predict(self, inputs, parameters):
        return {}
"""

BROKEN: dict[str, tuple[dict[str, object] | str, str | None, list[str]]] = {
    # folder: (model-settings.json, model.py, words the reason must contain)
    "not-json": ("{nope", None, ["model-settings.json", "invalid JSON"]),
    "unknown-field": ({"name": "unknown-field", "implementation": "model.M", "colour": 1}, MODEL,
                      ["model-settings.json", "colour", "unknown field"]),
    "no-implementation": ({"name": "no-implementation"}, None,
                          ["model-settings.json", "implementation"]),
    "missing-module": ({"name": "missing-module", "implementation": "nomodule.M"}, None,
                       ["nomodule", "No module named"]),
    "missing-class": ({"name": "missing-class", "implementation": "model.Nope"}, MODEL,
                      ["model.Nope"]),
    "raises-on-import": ({"name": "raises-on-import", "implementation": "model.M"},
                         "raise RuntimeError('boom at import')\n",
                         ["RuntimeError", "boom at import"]),
    "raises-in-load": ({"name": "raises-in-load", "implementation": "model.M"},
                       MODEL + "    def load(self):\n        raise OSError('weights missing')\n",
                       ["OSError", "weights missing"]),
    "unsafe-gid": ({"name": "unsafe-gid", "implementation": "model.M",
                    "parameters": {"inference_pool_gid": "../../etc"}}, MODEL,
                   ["model-settings.json", "inference_pool_gid", "unsafe pool id"]),
    "echo-again": ("DUPLICATE", None, ["model-settings.json", "duplicate", "echo"]),
    # a built-in runtime's file not made yet, as in a fresh clone's examples/models:
    # the one log line (and the reason) names the command that trains it
    "untrained": ({"name": "untrained", "implementation": "poolserve.service.runtimes.SKLearnModel",
                   "parameters": {"uri": "model.joblib"}}, None,
                  ["model.joblib does not exist", "train.py beside", "untrained/train.py"]),
}  # fmt: skip
# other files a broken folder holds (name: text)
EXTRA_FILES = {"untrained": {"train.py": "raise SystemExit('not run by the test')\n"}}
LOAD_FAILURES = (
    "missing-module",
    "missing-class",
    "raises-on-import",
    "raises-in-load",
    "untrained",
)


def broken_repo(root: Path) -> Path:
    repo = make_repo(root, {"echo": None})
    for folder, (settings, code, _) in BROKEN.items():
        if settings == "DUPLICATE":
            text = (repo / "echo" / "model-settings.json").read_text()
        else:
            text = settings if isinstance(settings, str) else json.dumps(settings)
        write(repo / folder / "model-settings.json", text)
        if code is not None:
            write(repo / folder / "model.py", code)
        for name, text in EXTRA_FILES.get(folder, {}).items():
            write(repo / folder / name, text)
    return repo


@pytest.fixture(scope="module")
def broken_tree(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Tree, dict[str, str], bool]]:
    root = tmp_path_factory.mktemp("broken")
    with Tree(broken_repo(root / "repo"), root / "run", workers=1) as tree:

        async def look() -> tuple[dict[str, str], bool]:
            pool = f"unix:{tree.run_dir / 'pool-default.sock'}"
            async with grpc.aio.insecure_channel(pool) as direct:
                # The router reports echo not ready: a duplicate of it is broken.
                await wait_serving(direct, "model:echo")
            async with grpc.aio.insecure_channel(tree.address) as channel:
                stub = pbg.GRPCInferenceServiceStub(channel)
                index = await stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=10)
                ready = await stub.ServerReady(pb.ServerReadyRequest(), timeout=10)
                reasons = {m.name: m.reason for m in index.models if m.state == "UNAVAILABLE"}
                # the good model still serves, exactly
                call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
                reply = await call(infer_bytes("echo", payload(5)), timeout=30)
                assert (
                    pb.ModelInferResponse.FromString(reply).raw_output_contents[0]
                    == payload(5).tobytes()
                )
                return reasons, ready.ready

        reasons, ready = asyncio.run(look())
        yield tree, reasons, ready


@pytest.mark.parametrize("folder", sorted(BROKEN))
def test_broken_model_is_unavailable_with_its_reason(
    broken_tree: tuple[Tree, dict[str, str], bool], folder: str
) -> None:
    _, reasons, _ = broken_tree
    key = "echo" if folder == "echo-again" else folder
    assert key in reasons, reasons
    for word in BROKEN[folder][2]:
        assert word in reasons[key], (word, reasons[key])


def test_broken_models_keep_server_not_ready_and_the_tree_whole(
    broken_tree: tuple[Tree, dict[str, str], bool],
) -> None:
    tree, _, ready = broken_tree
    assert ready is False
    census = tree.census({"default": 1})
    assert census.ok, census.summary()
    assert "Traceback" not in tree.log()


def test_load_failures_name_the_file(broken_tree: tuple[Tree, dict[str, str], bool]) -> None:
    _, reasons, _ = broken_tree
    for folder in LOAD_FAILURES:
        assert f"{folder}/model" in reasons[folder], reasons[folder]
