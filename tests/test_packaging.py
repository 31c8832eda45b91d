"""The package layout: namespaces, console scripts, generated code in sync."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

from poolserve.protos import generate

from support import BIN, ROOT


def test_supervisord_still_runs_beside_our_supervisor_package() -> None:
    version = subprocess.run(
        [str(BIN / "supervisord"), "--version"], capture_output=True, text=True, cwd=ROOT
    )
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip()[0].isdigit()
    ctl = subprocess.run(
        [str(BIN / "supervisorctl"), "--help"], capture_output=True, text=True, cwd=ROOT
    )
    assert ctl.returncode == 0, ctl.stderr
    assert "supervisorctl" in ctl.stdout


def test_bare_supervisor_import_is_supervisord() -> None:
    probe = (
        "import supervisor, poolserve.supervisor as ours; print(supervisor.__file__, ours.__file__)"
    )
    out = subprocess.run(
        [sys.executable, "-P", "-c", probe], capture_output=True, text=True, cwd="/"
    )
    assert out.returncode == 0, out.stderr
    theirs, ours = out.stdout.split()
    assert "site-packages" in theirs
    assert Path(ours).resolve() == (ROOT / "supervisor" / "__init__.py").resolve()


def test_console_script_runs() -> None:
    out = subprocess.run([str(BIN / "poolserve"), "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    assert "serve" in out.stdout


def test_generated_protos_are_fresh(tmp_path: Path) -> None:
    """Fails when someone edits a .proto without `make protos`."""
    for fresh in generate.generate_into(tmp_path):
        committed = generate.PROTO_DIR / fresh.name
        assert committed.exists(), f"{fresh.name} is not checked in: run `make protos`"
        assert committed.read_bytes() == fresh.read_bytes(), (
            f"{committed.name} is stale against its .proto: run `make protos`"
        )


def test_field_numbers_match_the_protocol() -> None:
    from poolserve.protos import inference_pb2 as pb

    def numbers(message: type) -> dict[str, int]:
        return {f.name: f.number for f in message.DESCRIPTOR.fields}  # type: ignore[attr-defined]

    assert numbers(pb.ModelInferRequest) == {
        "model_name": 1,
        "model_version": 2,
        "id": 3,
        "parameters": 4,
        "inputs": 5,
        "outputs": 6,
        "raw_input_contents": 7,
    }
    assert numbers(pb.ModelInferResponse)["raw_output_contents"] == 6
    assert numbers(pb.InferParameter) == {
        "bool_param": 1,
        "int64_param": 2,
        "string_param": 3,
        "double_param": 4,
        "uint64_param": 5,
    }
    assert numbers(pb.ModelConfig)["input"] == 5
    assert numbers(pb.ModelInput)["dims"] == 4
    assert numbers(pb.ModelOutput)["dims"] == 3
    assert numbers(pb.ModelStatistics)["inference_stats"] == 6
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert service.full_name == "inference.GRPCInferenceService"
    assert {m.name for m in service.methods} >= {
        "ServerLive",
        "ServerReady",
        "ModelReady",
        "ServerMetadata",
        "ModelMetadata",
        "ModelInfer",
        "ModelStreamInfer",
        "ModelConfig",
        "ModelStatistics",
        "RepositoryIndex",
        "RepositoryModelLoad",
        "RepositoryModelUnload",
    }


def test_pool_server_has_no_thread_when_it_forks_its_zygote() -> None:
    """No process forks after it created a thread: the pool's imports start none."""
    probe = (
        "import os, poolserve.service.poolserver.server, poolserve.service.poolserver.main, sys; "
        "print(len(os.listdir('/proc/self/task')), 'numpy' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-P", "-c", probe], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "False"]


def test_every_source_folder_is_a_listed_package() -> None:
    """An editable install finds any subfolder; a wheel only the listed ones."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    config = pyproject["tool"]["setuptools"]
    roots = {folder: name for name, folder in config["package-dir"].items()}
    found = set()
    for folder in roots:
        for init in (ROOT / folder).rglob("__init__.py"):
            top, *rest = init.parent.relative_to(ROOT).parts
            found.add(".".join([roots[top], *rest]))
    assert found == set(config["packages"])


def test_old_module_paths_are_the_new_modules_with_a_deprecation_warning() -> None:
    """poolserve.service.{model,errors,codec} keep working for one release (issue 15)."""
    probe = (
        "import warnings; warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    from poolserve.service.model import Array\n"
        "    import poolserve.service.errors as old_errors, poolserve.service.codec as old_codec\n"
        "from poolserve.service.inference import codec, model\n"
        "from poolserve.service.contract import errors\n"
        "import poolserve.service as service\n"
        "assert old_errors is errors and old_codec is codec and Array is model.Array\n"
        "assert service.model is model and model.__spec__.name.endswith('inference.model')\n"
        "assert service.QueueFull is errors.QueueFull and service.Array is model.Array\n"
        "print(sorted((w.category.__name__, w.filename) for w in seen))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == str([("DeprecationWarning", "<string>")] * 3)


def test_zygotes_and_spawned_workers_get_the_host_interpreter_flags() -> None:
    """ExecZygote and start_method spawn pass -O, -X ... on, as multiprocessing does."""
    probe = "from poolserve.service.lifecycle.procutil import interpreter_flags as f; print(f())"
    out = subprocess.run(
        [sys.executable, "-O", "-X", "dev", "-c", probe], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "'-O'" in out.stdout and "'dev'" in out.stdout


def test_every_source_folder_says_what_lives_there_and_imports_nothing() -> None:
    """A folder's __init__ is its docstring (what lives there, what it may import)
    and no import, so that `python -m` of a module inside it starts light.
    runtimes/ is the exception: its import path is public (model-settings.json)."""
    folders = [init.parent for init in (ROOT / "service").glob("*/__init__.py")]
    assert {f.name for f in folders} >= {"contract", "lifecycle", "poolcore", "workerpool"}
    for folder in folders:
        tree = ast.parse((folder / "__init__.py").read_text())
        doc = ast.get_docstring(tree) or ""
        assert "May import" in doc or "may import" in doc, f"{folder.name}: no import rule"
        imports = [
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom)
            and not (isinstance(node, ast.ImportFrom) and node.module == "__future__")
        ]
        assert folder.name == "runtimes" or imports == [], f"{folder.name} imports"


def test_architecture_document_names_every_folder() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    for init in (ROOT / "service").glob("*/__init__.py"):
        assert f"**{init.parent.name}/**" in text, init.parent.name
    assert "(docs/architecture.md)" in (ROOT / "README.md").read_text()
