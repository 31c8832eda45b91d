"""Regenerates the checked-in protobuf and gRPC modules (``make protos``).

protoc names imports after the path of the ``.proto`` file relative to its
include root, so the sources are staged under ``poolserve/protos/`` in a
temporary root; the generated modules then import each other as
``poolserve.protos.<name>_pb2``.

Each ``_pb2`` module builds its messages in a descriptor pool of its own
(:func:`private_pool`), not in protobuf's default pool: poolserve's
``inference`` package then coexists in one process with the other
definitions of the same package (MLServer's ``dataplane.proto``,
tritonclient's ``grpc_service.proto``), which a model hosted by poolserve
may import. The wire format and the gRPC method paths
(``/inference.GRPCInferenceService/...``) do not depend on the pool.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
DEFAULT_POOL = "DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile("
PRIVATE_POOL = (
    "# poolserve: a private pool, so that other definitions of this proto package\n"
    "# (MLServer's, tritonclient's) can be loaded in the same process.\n"
    "_POOL = _descriptor_pool.DescriptorPool()\n"
    "DESCRIPTOR = _POOL.AddSerializedFile("
)


def private_pool(source: str) -> str:
    """A generated ``_pb2`` module's text, its file added to a pool of its own."""
    if source.count(DEFAULT_POOL) != 1:
        raise RuntimeError("generated module does not add its file to the default pool once")
    return source.replace(DEFAULT_POOL, PRIVATE_POOL)


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
            text = (staged / name).read_text()
            if name.endswith("_pb2.py"):
                text = private_pool(text)
            (out_dir / name).write_text(text)
            written.append(out_dir / name)
        return written


def main() -> int:
    for path in generate_into(PROTO_DIR):
        print(f"wrote {path.relative_to(PROTO_DIR.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
