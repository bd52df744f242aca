"""Timed fuzzing of state loads with mutated state blobs and files (issue 9).

    python fuzz/fuzz_state.py --seconds 300                      # five minutes over every layout
    python fuzz/fuzz_state.py --seconds 60 --envs gemma3-iswa --seed 7
    python fuzz/fuzz_state.py --replay fuzz/crashes/state/*.json   # rerun saved cases

Each case (llamir.testing.state_fuzz.draw_case) mutates a good whole-context blob, sequence blob,
session file or sequence file and loads it into a victim context: a refused load must leave the
victim bit for bit as it was and decode as a witness does; an accepted one must be accepted by
llama.cpp too, with the same state bytes, sequence ranges and next logits. tests/context/
test_state_fuzz.py runs the same check, bounded. A failing case is kept in the crashes directory
(its bytes, and a JSON file naming the layout, the kind, the destination sequence and the
mutations) and the run goes on. The case being run is written there first as in-progress.json,
so a case that kills the process (an abort inside llama.cpp) is kept too. The summary counts the
cases per layout and outcome.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import traceback
from collections import Counter
from hashlib import sha1
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEFAULT_CRASHES = ROOT / "fuzz" / "crashes" / "state"


def _write_case(crashes: Path, stem: str, env: str, case, error: str = "") -> Path:
    crashes.mkdir(parents=True, exist_ok=True)
    (crashes / f"{stem}.bin").write_bytes(case.data)
    meta = {"env": env, "kind": case.kind, "dest_seq_id": case.dest_seq_id, "steps": case.steps,
            "data": f"{stem}.bin", "error": error}
    path = crashes / f"{stem}.json"
    path.write_text(json.dumps(meta, indent=1))
    return path


def _run(env, case) -> tuple[str, str]:
    """(outcome, error): 'refused', 'loaded', 'loaded, NaN in KV', or 'FAILED' with its message."""
    from llamir.testing.state_fuzz import CheckFailure

    try:
        return env.check(case), ""
    except CheckFailure as err:
        return "FAILED", str(err)
    except Exception:   # noqa: BLE001 - an escaping exception is exactly what the fuzzer looks for
        return "FAILED", traceback.format_exc()


def fuzz(seconds: float, names: list[str], seed: int, crashes: Path) -> int:
    from llamir.testing.state_fuzz import RandomChooser, draw_case, standard_envs

    with tempfile.TemporaryDirectory() as directory:
        makers = standard_envs(Path(directory))
        envs = {name: makers[name]() for name in names}
        rng = random.Random(seed)
        counts: dict[str, Counter] = {name: Counter() for name in names}
        cases = failures = 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            name = names[cases % len(names)]
            env = envs[name]
            case = draw_case(RandomChooser(rng), env.good, env.fields)
            _write_case(crashes, "in-progress", name, case)
            outcome, error = _run(env, case)
            counts[name][outcome] += 1
            cases += 1
            if error:
                failures += 1
                stem = f"crash-{name}-{sha1(case.data).hexdigest()[:12]}"
                kept = _write_case(crashes, stem, name, case, error)
                print(f"FAILED ({kept}): {error.strip().splitlines()[-1][:300]}", flush=True)
        for stem in ("in-progress.json", "in-progress.bin"):
            (crashes / stem).unlink(missing_ok=True)
        for env in envs.values():
            env.close()
    for name in names:
        print(f"{name}: {sum(counts[name].values())} cases, " +
              ", ".join(f"{k} {v}" for k, v in sorted(counts[name].items())))
    print(f"{cases} cases in {seconds:.0f} s (seed {seed}), {failures} failed")
    return 1 if failures else 0


def replay(paths: list[Path]) -> int:
    from llamir.testing.state_fuzz import Case, standard_envs

    failures = 0
    with tempfile.TemporaryDirectory() as directory:
        makers, envs = standard_envs(Path(directory)), {}
        for path in paths:
            meta = json.loads(path.read_text())
            env = envs.get(meta["env"]) or envs.setdefault(meta["env"], makers[meta["env"]]())
            case = Case(meta["kind"], meta["dest_seq_id"], (path.parent / meta["data"]).read_bytes(), meta["steps"])
            outcome, error = _run(env, case)
            failures += bool(error)
            print(f"{path}: {outcome}" + (f"\n{error}" if error else ""))
        for env in envs.values():
            env.close()
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    from llamir.testing.state_fuzz import standard_envs

    names = list(standard_envs(Path(tempfile.gettempdir())))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--envs", default=",".join(names), help=f"comma-separated, of {', '.join(names)}")
    parser.add_argument("--crashes", type=Path, default=DEFAULT_CRASHES)
    parser.add_argument("--replay", type=Path, nargs="*")
    args = parser.parse_args(argv)
    if args.replay:
        return replay(args.replay)
    chosen = [n.strip() for n in args.envs.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in names]
    if unknown:
        parser.error(f"unknown layouts {unknown}; choose from {names}")
    return fuzz(args.seconds, chosen, args.seed, args.crashes)


if __name__ == "__main__":
    sys.exit(main())
