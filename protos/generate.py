"""Regenerates the checked-in protobuf and gRPC modules (``make protos``).

protoc names imports after the path of the ``.proto`` file relative to its
include root, so the sources are staged under ``poolserve/protos/`` in a
temporary root; the generated modules then import each other as
``poolserve.protos.<name>_pb2``.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_sources() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def generated_names() -> list[str]:
    return [p.stem + s for p in proto_sources() for s in SUFFIXES]


def generate_into(out_dir: Path) -> list[Path]:
    """Runs protoc on every source and writes the modules into ``out_dir``."""
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        staged = root / "poolserve" / "protos"
        staged.mkdir(parents=True)
        for src in proto_sources():
            shutil.copy(src, staged / src.name)
        args = [
            "protoc",
            f"-I{root}",
            f"--python_out={root}",
            f"--pyi_out={root}",
            f"--grpc_python_out={root}",
            *(f"poolserve/protos/{p.name}" for p in proto_sources()),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed: " + " ".join(args))
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in generated_names():
            shutil.copy(staged / name, out_dir / name)
            written.append(out_dir / name)
        return written


def main() -> int:
    for path in generate_into(PROTO_DIR):
        print(f"wrote {path.relative_to(PROTO_DIR.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
