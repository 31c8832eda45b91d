"""Installs the bench's peers under bench/.peers, never in the project's .venv.

- one virtual environment per peer server (MLServer, KServe; each one
  :class:`VenvSpec` in :data:`PEER_VENVS`), plus a ``tools`` environment with matplotlib,
  py-spy and the CUDA runtime library that perf_analyzer links against;
- Triton's ``perf_analyzer`` binary, taken from the tritonclient 2.51.0
  wheel (the pip package ``perf-analyzer`` has no binary for this glibc),
  with Debian's ``libb64-0d`` unpacked beside it. Nothing outside
  bench/.peers is changed.

Each step is skipped when its stamp says it is already done with the same
requirements.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

BENCH = Path(__file__).resolve().parent
PEERS = BENCH / ".peers"
PERF_ANALYZER_TRITONCLIENT = "2.51.0"
CUDA_RUNTIME = "nvidia-cuda-runtime-cu12==12.9.79"


def project_grpcio() -> str:
    """The project's grpcio version: the peers get the same one, so gRPC is not a variable."""
    return metadata.version("grpcio")


def project_protobuf() -> str:
    return metadata.version("protobuf")


@dataclass(frozen=True)
class VenvSpec:
    name: str
    packages: tuple[str, ...]
    no_deps: tuple[str, ...] = ()  # installed after, without their dependencies
    # name==version, without dependencies, into the venv as it is when missing (no rebuild:
    # the stamp, and so the other packages, stay as they were)
    additions: tuple[str, ...] = ()

    def wanted(self) -> str:
        return "\n".join(self.packages + tuple(f"--no-deps {p}" for p in self.no_deps))

    @property
    def path(self) -> Path:
        return PEERS / self.name

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"


def project_xgboost() -> str:
    """The project's xgboost-cpu (test extra): every server runs the same XGBoost."""
    return f"xgboost-cpu=={metadata.version('xgboost-cpu')}"


def mlserver_venv() -> VenvSpec:
    """MLServer 1.7.1, its XGBoost runtime, mlserver-xgboost 1.7.1, and its
    scikit-learn runtime, mlserver-sklearn 1.7.1 (needs only mlserver,
    scikit-learn and joblib, all there; the batching bench's peer and
    tests/test_mlserver.py's side-by-side).

    mlserver-xgboost asks for ``xgboost[scikit-learn]``, whose Linux wheel is
    the GPU build (with NCCL, hundreds of MB): it is installed without
    dependencies, beside the CPU build of the project's XGBoost release
    (``xgboost-cpu``, the same library and ``xgboost`` module) and the
    project's scikit-learn, so every server runs the same XGBoost.
    """
    sklearn = f"scikit-learn=={metadata.version('scikit-learn')}"  # xgboost[scikit-learn]
    return VenvSpec(
        "mlserver",
        ("mlserver==1.7.1", "uvloop==0.21.0", f"grpcio=={project_grpcio()}", project_xgboost(),
         sklearn),
        no_deps=("mlserver-xgboost==1.7.1",),
        additions=("mlserver-sklearn==1.7.1",),  # installed when missing, stamp unchanged
    )  # fmt: skip


def kserve_venv() -> VenvSpec:
    """KServe 0.21.0 with the project's gRPC and protobuf.

    kserve 0.21.0 asks for grpcio>=1.73 and grpcio-tools>=1.73 (unpinned, so a
    newer grpcio would come with them), protobuf>=6.33.5,<7: pin grpcio to the
    project's, grpcio-tools to the same release (each grpcio-tools needs its own
    grpcio), protobuf to the project's. Its gRPC server runs on asyncio's own
    loop (asyncio.run; uvloop is only for its REST server), so uvloop is not pinned.
    """
    grpc = project_grpcio()
    return VenvSpec(
        "kserve",
        ("kserve==0.21.0", f"grpcio=={grpc}", f"grpcio-tools=={grpc}",
         f"protobuf=={project_protobuf()}", project_xgboost()),
    )  # fmt: skip


# Peer environments by name (ServerSpec.venv names one).
PEER_VENVS = {"mlserver": mlserver_venv, "kserve": kserve_venv}


def tools_venv() -> VenvSpec:
    return VenvSpec("tools", ("matplotlib", "py-spy", CUDA_RUNTIME))


def log(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


def ensure_venv(spec: VenvSpec) -> Path:
    stamp = spec.path / ".bench-installed"
    wanted = spec.wanted()
    if stamp.exists() and stamp.read_text() == wanted and spec.python.exists():
        _add_missing(spec)
        return spec.python
    log(f"installing {', '.join(spec.packages)} into {spec.path} (once)")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(spec.path)], check=True)
    pip = [str(spec.python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, *spec.packages], check=True)
    if spec.no_deps:
        subprocess.run([*pip, "--no-deps", *spec.no_deps], check=True)
    stamp.write_text(wanted)
    _add_missing(spec)
    return spec.python


def _add_missing(spec: VenvSpec) -> None:
    for requirement in spec.additions:
        name, _, version = requirement.partition("==")
        if package_version(spec.python, name) != version:
            log(f"installing {requirement} into {spec.path} (once)")
            pip = [str(spec.python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
            subprocess.run([*pip, "--no-deps", requirement], check=True)


@dataclass(frozen=True)
class PerfAnalyzer:
    binary: Path
    env: dict[str, str]
    version: str = PERF_ANALYZER_TRITONCLIENT


def _site_packages(venv: Path) -> Path:
    return Path(glob.glob(str(venv / "lib" / "python*" / "site-packages"))[0])


def _apt_download(package: str, into: Path) -> Path:
    def download() -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(["apt-get", "download", package], cwd=into, capture_output=True)

    if download().returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], check=True)
        done = download()
        if done.returncode != 0:
            raise RuntimeError(f"apt-get download {package}: {done.stderr.decode()}")
    return Path(sorted(glob.glob(str(into / f"{package}_*.deb")))[-1])


def ensure_perf_analyzer(tools: VenvSpec) -> PerfAnalyzer:
    home = PEERS / "perf_analyzer"
    binary = home / "bin" / "perf_analyzer"
    libb64 = home / "lib" / "libb64.so.0d"
    cudart = _site_packages(tools.path) / "nvidia" / "cuda_runtime" / "lib"
    env = {"LD_LIBRARY_PATH": f"{home / 'lib'}:{cudart}"}
    if binary.exists() and libb64.exists():
        return PerfAnalyzer(binary, env)
    log(f"installing perf_analyzer from tritonclient {PERF_ANALYZER_TRITONCLIENT} (once)")
    dl = home / "dl"
    for d in (home / "bin", home / "lib", dl):
        d.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            str(tools.python),
            "-m",
            "pip",
            "download",
            "-q",
            "--disable-pip-version-check",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            str(dl),
            f"tritonclient=={PERF_ANALYZER_TRITONCLIENT}",
        ],
        check=True,
    )
    wheel = glob.glob(str(dl / f"tritonclient-{PERF_ANALYZER_TRITONCLIENT}-*.whl"))[0]
    with zipfile.ZipFile(wheel) as z:
        data = z.read(f"tritonclient-{PERF_ANALYZER_TRITONCLIENT}.data/data/bin/perf_analyzer")
    binary.write_bytes(data)
    binary.chmod(0o755)
    deb = _apt_download("libb64-0d", dl)
    subprocess.run(["dpkg-deb", "-x", str(deb), str(dl / "deb")], check=True)
    found = glob.glob(str(dl / "deb" / "usr" / "lib" / "*" / "libb64.so.0d"))
    libb64.write_bytes(Path(found[0]).read_bytes())
    return PerfAnalyzer(binary, env)


@dataclass(frozen=True)
class Installed:
    venvs: dict[str, Path]
    tools_python: Path
    perf_analyzer: PerfAnalyzer


def ensure_all(peer_venvs: list[VenvSpec]) -> Installed:
    PEERS.mkdir(parents=True, exist_ok=True)
    tools = tools_venv()
    tools_python = ensure_venv(tools)
    venvs = {spec.name: ensure_venv(spec) for spec in peer_venvs}
    return Installed(venvs, tools_python, ensure_perf_analyzer(tools))


def package_version(python: Path, package: str) -> str:
    code = f"from importlib.metadata import version; print(version({package!r}))"
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return done.stdout.strip() or "?"


if __name__ == "__main__":  # install only: python bench/install.py
    installed = ensure_all([make() for make in PEER_VENVS.values()])
    print(installed)
    os.environ.update(installed.perf_analyzer.env)
