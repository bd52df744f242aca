"""The driver the coverage-guided fuzz scripts share (fuzz/fuzz_gguf.py, fuzz/fuzz_ir.py): run a
script's libFuzzer worker in a child process for a given time, restart it after findings with
--keep-going, summarise cases, seeds, corpus and new finding files; replay kept inputs."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

FINDING_PREFIXES = ("crash-", "timeout-", "oom-", "leak-", "slow-unit-")


def findings(crashes: Path) -> set[Path]:
    return {p for p in crashes.iterdir() if p.name.startswith(FINDING_PREFIXES)} if crashes.exists() else set()


def run_once(script: Path, args, seconds: int) -> tuple[int, int, str]:
    """One libFuzzer run of `script --worker` for at most `seconds`: (exit status, cases run, its log)."""
    libfuzzer = [f"-max_total_time={seconds}", f"-timeout={args.timeout}", f"-rss_limit_mb={args.rss_limit_mb}",
                 f"-max_len={args.max_len}", f"-artifact_prefix={args.crashes}/", "-print_final_stats=1",
                 str(args.corpus)]
    if args.seed is not None:
        libfuzzer.insert(0, f"-seed={args.seed}")
    cmd = [sys.executable, str(script), "--worker", "--", *libfuzzer]
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", cwd=script.parents[1])
    log = proc.stdout + proc.stderr
    runs = re.findall(r"stat::number_of_executed_units: (\d+)", log) or re.findall(r"^#(\d+)", log, re.M)
    return proc.returncode, int(runs[-1]) if runs else 0, log


def drive(name: str, script: Path, args, seed_corpus: Callable[[Path], int]) -> int:
    """Fuzz for args.seconds; 0 when nothing was found, 1 on findings, 2 without atheris."""
    args.crashes.mkdir(parents=True, exist_ok=True)
    n_seeds = seed_corpus(args.corpus)
    before = findings(args.crashes)
    deadline = time.monotonic() + args.seconds
    total_runs, restarts, logs, seeds = 0, 0, [], []
    while (left := int(deadline - time.monotonic())) > 0:
        status, runs, log = run_once(script, args, left)
        total_runs += runs
        seeds += re.findall(r"INFO: Seed: (\d+)", log)
        if status == 0:
            break
        logs.append(log)
        if "ModuleNotFoundError: No module named 'atheris'" in log:
            print(f"{name}: atheris is not installed (pip install atheris)", file=sys.stderr)
            return 2
        if not args.keep_going:
            break
        restarts += 1
    new = sorted(findings(args.crashes) - before)
    corpus_size = sum(1 for p in args.corpus.iterdir() if p.is_file())
    print(f"{name}: {total_runs} cases in {args.seconds}s, seed {','.join(seeds) or '?'} ({restarts} restarts "
          f"after findings); corpus {args.corpus}: {corpus_size} files ({n_seeds} at the start); {len(new)} new "
          "findings" + (f" in {args.crashes}" if new else ""))
    for path in new:
        print(f"  {path}")
    for log in logs:
        print(f"---\n{_traceback(log)}")
    if logs and not new:
        print(f"{name}: the fuzzer stopped with no finding file; its log ends:\n" + logs[-1][-3000:])
    return 1 if new or logs else 0


def _traceback(log: str) -> str:
    start = log.find("=== Uncaught Python exception: ===")
    return log[start:start + 4000] if start >= 0 else log[-3000:]


def replay(paths: list[str], check: Callable[[bytes], object]) -> int:
    """Run `check` on each kept input; 1 if any fails (each failure is shown, the rest still run)."""
    failed = 0
    for name in paths:
        data = Path(name).read_bytes()
        try:
            print(f"{name}: {check(data)}")
        except Exception as err:   # a finding: show it, go on with the next file
            failed += 1
            print(f"{name}: FAILS with {type(err).__name__}: {err}")
            traceback.print_exc()
    return 1 if failed else 0
