"""Generate the Python gRPC stubs from proto/ (the one documented way).

    python -m tulip.protogen [--out DIR]

writes trellis/tulip/v1/tulip_pb2.py, tulip_pb2.pyi and tulip_pb2_grpc.py under
DIR (default: the repository root). The generator is grpcio-tools, pinned in
pyproject.toml so that the stubs import with the oldest runtime we deploy on.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
PROTOS = ["trellis/tulip/v1/tulip.proto"]


def generate(out: Path) -> list[Path]:
    """Run protoc on every proto under proto/ into `out`; return the files written."""
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *[str(PROTO_DIR / p) for p in PROTOS],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    written = []
    for p in PROTOS:
        stem = out / p[: -len(".proto")]
        written += [Path(f"{stem}_pb2.py"), Path(f"{stem}_pb2.pyi"), Path(f"{stem}_pb2_grpc.py")]
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT)
    args = ap.parse_args(argv)
    for f in generate(args.out):
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
