"""`llamir test-backend-ops -b BACKEND [-o OP] [--mode eval|perf]`: every op on a backend against the
numpy reference (ggml's test-backend-ops), one line per case, then `N/M tests passed`.

llamir test-backend-ops -b llvm
llamir test-backend-ops -b sim:gpu0 -o mul_mat -o get_rows
llamir test-backend-ops -b llvm --mode perf -o mul_mat
"""

from __future__ import annotations

import argparse
import sys


def cmd_test_backend_ops(args) -> int:
    from llamir.backends import BackendError
    from llamir.testing.backend_ops import all_cases, resolve_backend, run_backend_ops

    try:
        cases = all_cases(args.ops or None)
    except ValueError as err:
        print(f"llamir: error: {err}", file=sys.stderr)
        return 2
    try:
        backend = resolve_backend(args.backend)
    except (BackendError, ValueError) as err:
        print(f"llamir: error: backend {args.backend!r}: {err}", file=sys.stderr)
        return 2
    print(f"Testing {len(cases)} cases on backend {args.backend} ({backend.device.description}), mode {args.mode}")
    report = run_backend_ops(backend, mode=args.mode, cases=cases, seed=args.seed, perf_seconds=args.perf_time,
                             on_result=lambda result: print(result.line(), flush=True))
    close = getattr(backend, "close", None)
    if callable(close):
        close()
    print(f"  {report.summary()} ({report.seconds:.1f} s)")
    status = "OK" if report.ok else "FAIL"
    print(f"Backend {args.backend}: {status}")
    return 0 if report.ok else 1


def add_parser(subparsers) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "test-backend-ops", help="every op on a backend against the numpy reference (like ggml's test-backend-ops)")
    p.add_argument("-b", "--backend", required=True, help="a backend name (llvm, numpy, ...) or device spec (sim:gpu0)")
    p.add_argument("-o", "--op", action="append", dest="ops", default=[], help="only this op (repeatable)")
    p.add_argument("--mode", choices=["eval", "perf"], default="eval", help="eval: check results; perf: time them")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--perf-time", type=float, default=0.25, dest="perf_time",
                   help="seconds of runs per case in perf mode")
    p.set_defaults(func=cmd_test_backend_ops)
