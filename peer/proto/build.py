"""Generate ``peer/proto/*_pb2.py`` (and their type stubs ``*_pb2.pyi``, for mypy) from ``protos/*.proto``, and
``*_pb2_grpc.py`` for the protos that declare a gRPC ``service`` (the local control API).

Run as ``python -m peer.proto.build`` (``make protos``). ``tests/test_protos.py`` calls
:func:`generate` into a temporary folder and fails when the checked-in modules are stale.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "protos"
OUT_DIR = Path(__file__).resolve().parent


def generate(out_dir: Path = OUT_DIR) -> list[Path]:
    """Compile every ``protos/*.proto`` into ``out_dir``; returns the generated files.

    protoc writes ``import codec_pb2`` for cross-file imports; we rewrite that to a relative import so
    the modules work as the package ``peer.proto``.
    """
    from grpc_tools import protoc  # build-time only

    protos = sorted(PROTO_DIR.glob("*.proto"))
    args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={out_dir}", f"--pyi_out={out_dir}"] + [str(p) for p in protos]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {[p.name for p in protos]}")
    services = [p for p in protos if re.search(r"^service ", p.read_text(), flags=re.M)]
    if services and protoc.main(["protoc", f"-I{PROTO_DIR}", f"--grpc_python_out={out_dir}"]
                                + [str(p) for p in services]) != 0:
        raise RuntimeError(f"protoc (grpc) failed on {[p.name for p in services]}")
    outputs = []
    for proto in protos:
        suffixes = ("_pb2.py", "_pb2.pyi") + (("_pb2_grpc.py",) if proto in services else ())
        for suffix in suffixes:
            path = Path(out_dir) / f"{proto.stem}{suffix}"
            text = re.sub(r"^import (\w+_pb2) as", r"from . import \1 as", path.read_text(), flags=re.M)
            path.write_text(text)
            outputs.append(path)
    return outputs


if __name__ == "__main__":
    for path in generate():
        print(f"generated {path.relative_to(ROOT)}")
    sys.exit(0)
