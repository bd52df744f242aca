"""python -m llamir_cuda emit-ptx MODEL --arch sm_90 --out DIR [--ptxas]"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llamir_cuda", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    emit = sub.add_parser("emit-ptx", help="write the PTX of every kernel a model's decode graphs need")
    emit.add_argument("model", help="a GGUF file")
    emit.add_argument("--arch", default="sm_90", help="the GPU architecture (sm_80, sm_86, sm_89, sm_90)")
    emit.add_argument("--out", required=True, help="the folder for the .ptx files and index.json")
    emit.add_argument("--n-ubatch", type=int, default=512, help="tokens of the prompt graph (default 512)")
    emit.add_argument("--ptxas", action="store_true", help="assemble each file with ptxas and print its report")
    args = parser.parse_args(argv)

    from llamir_cuda.driver import DriverError
    from llamir_cuda.emit import emit_ptx

    try:
        rows = emit_ptx(args.model, args.arch, args.out, check=args.ptxas, n_ubatch=args.n_ubatch)
    except (DriverError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for row in rows:
        report = (f"  regs {row['registers']:3d}  spills {row['spill_stores'] + row['spill_loads']:4d} B  "
                  f"smem {row['shared_bytes']:6d} B" if args.ptxas else "")
        print(f"{row['file']:56s}{report}")
    print(f"{len(rows)} kernels for {args.arch} in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
