"""Regenerate the committed gRPC stubs in gateeng/v1 from proto/gateeng/v1/engine.proto.

  python proto/generate.py          write the stubs
  python proto/generate.py --check  fail (exit 1) if the committed stubs are stale
"""
from __future__ import annotations

import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = "gateeng/v1/engine.proto"
OUTPUTS = ["engine_pb2.py", "engine_pb2.pyi", "engine_pb2_grpc.py"]


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc
    import grpc_tools
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = ["protoc", f"-I{ROOT / 'proto'}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", str(ROOT / "proto" / PROTO)]
    if protoc.main(args) != 0:
        sys.exit("protoc failed")


def main() -> int:
    check = "--check" in sys.argv[1:]
    target = ROOT / "gateeng" / "v1"
    if not check:
        generate(ROOT)
        print(f"wrote {', '.join(OUTPUTS)} to {target}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = [f for f in OUTPUTS
                 if not (target / f).exists() or not filecmp.cmp(Path(tmp) / "gateeng/v1" / f, target / f, shallow=False)]
    if stale:
        print(f"generated stubs are stale: {', '.join(stale)}; run `make proto` and commit", file=sys.stderr)
        return 1
    print("proto stubs up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
