"""Timed fuzzing of decode with valid, invalid and failing batches and sequence operations (issue 9).

    python fuzz/fuzz_batch.py --seconds 300                  # five minutes over every memory kind
    python fuzz/fuzz_batch.py --seconds 60 --configs unified,iswa --seed 7 --backend numpy
    python fuzz/fuzz_batch.py --replay fuzz/crashes/batch/*.json   # rerun saved programs

Each case is a random program (llamir.testing.batch_fuzz.random_program) run on a subject and a
witness context: refused decodes and sequence operations must leave the subject exactly as it
was (memory, K/V data, outputs, state bytes), accepted ones must give the witness's logits bit for
bit, and nothing but a status may come out of decode. tests/context/test_batch_fuzz.py runs the
same check, bounded. A failing program is written to the crashes directory as JSON (the config
and the operations, enough to replay it) and the run goes on; the summary line counts the cases,
the operations accepted and refused, the faults that fired and the failures.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import tempfile
import time
import traceback
from hashlib import sha1
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEFAULT_CRASHES = ROOT / "fuzz" / "crashes" / "batch"


def _fuzzers(names: list[str], backend: str, directory: str) -> dict:
    from llamir.testing.batch_fuzz import CONFIGS, BatchFuzzer, write_config_model

    return {name: BatchFuzzer(write_config_model(CONFIGS[name], directory), CONFIGS[name], backend=backend)
            for name in names}


def _keep(crashes: Path, config: str, program: list, error: str) -> Path:
    crashes.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"config": config, "program": program}, default=repr)
    path = crashes / f"crash-{config}-{sha1(text.encode()).hexdigest()[:12]}.json"
    path.write_text(json.dumps({"config": config, "program": program, "error": error}, indent=1, default=repr))
    return path


def fuzz(seconds: float, names: list[str], seed: int, backend: str, crashes: Path, max_ops: int) -> int:
    from llamir.testing.batch_fuzz import random_program

    with tempfile.TemporaryDirectory() as directory:
        fuzzers = _fuzzers(names, backend, directory)
        rng = random.Random(seed)
        cases = failures = 0
        per_config = dict.fromkeys(names, 0)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            name = names[cases % len(names)]
            fuzzer = fuzzers[name]
            program = random_program(rng, fuzzer, max_ops)
            try:
                fuzzer.run(program)
            except Exception as err:  # noqa: BLE001 - every failure is kept, whatever it is
                failures += 1
                error = "".join(traceback.format_exception(err))
                path = _keep(crashes, name, program, error)
                print(f"FAILURE ({name}) kept in {path}:\n{error}", file=sys.stderr)
            cases += 1
            per_config[name] += 1
        totals = {key: sum(f.counts[key] for f in fuzzers.values()) for key in ("accepted", "refused", "faults fired")}
    spread = ", ".join(f"{name} {n}" for name, n in per_config.items())
    print(f"fuzz_batch: {cases} cases ({spread}) in {seconds:g}s, backend {backend}, seed {seed}: "
          f"{totals['accepted']} operations accepted, {totals['refused']} refused, {totals['faults fired']} "
          f"injected faults fired, {failures} failures")
    return 1 if failures else 0


def replay(paths: list[str], backend: str) -> int:
    failed = 0
    with tempfile.TemporaryDirectory() as directory:
        cases = [json.loads(Path(p).read_text()) for p in paths]
        fuzzers = _fuzzers(sorted({c["config"] for c in cases}), backend, directory)
        for path, case in zip(paths, cases, strict=True):
            try:
                fuzzers[case["config"]].run(case["program"])
                print(f"{path}: passes now")
            except Exception as err:  # noqa: BLE001
                failed += 1
                print(f"{path}: {type(err).__name__}: {err}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    from llamir.testing.batch_fuzz import CONFIGS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60.0, help="how long to fuzz")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"memory kinds, of {','.join(CONFIGS)}")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: a new one, printed)")
    p.add_argument("--backend", default="llvm", choices=["llvm", "numpy"])
    p.add_argument("--max-ops", type=int, default=8, dest="max_ops", help="operations per case, at most")
    p.add_argument("--crashes", type=Path, default=DEFAULT_CRASHES, help="where failing programs are kept")
    p.add_argument("--replay", nargs="+", default=None, metavar="FILE", help="rerun kept programs")
    p.add_argument("-v", "--verbose", action="store_true", help="show llamir's log (every refused decode)")
    args = p.parse_args(argv)
    if not args.verbose:   # each refused decode logs an error, each injected internal error a traceback
        logging.getLogger("llamir").setLevel(logging.CRITICAL)
    if args.replay:
        return replay(args.replay, args.backend)
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        p.error(f"unknown config {unknown[0] if unknown else '(none)'}; choose from {', '.join(CONFIGS)}")
    if args.seconds <= 0 or args.max_ops < 1:
        p.error("--seconds must be > 0 and --max-ops >= 1")
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    return fuzz(args.seconds, names, seed, args.backend, args.crashes, args.max_ops)


if __name__ == "__main__":
    sys.exit(main())
