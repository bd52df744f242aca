"""llamir's LLVM backend against llama.cpp on the same GGUF files, in one run.

    python bench/bench_llvm.py [--threads 2] [--models small-f32,big-q4_0,...] [--json out.json]

Models: a ~5M and a ~110M random-weight llama (12 layers, n_embd 768, vocab 32000) in f32, f16,
q8_0, q4_0, q4_k and q6_k, written once into the llamir cache, plus SmolLM2-135M-Instruct Q4_1.
Each engine runs pp128, pp512 and tg128 with the same thread count, timed the same way (llamir.cli_bench:
median of the prompt runs, generation rate from the median token). Also reported: the memory
bandwidth measured here and the token-generation roofline it implies (weight bytes per token /
bandwidth), llamir's compile times (cold: empty code cache; warm: from the disk cache) and where a
generated token's time goes (kernels, barriers, Python).

Shared machines are noisy: each test alternates the two engines `--rounds` times (default 3) and
reports the best measurement of each (all rounds are in the JSON); rerun when the load is high.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from llamir.cli_bench import BenchResult, bench_llama_cpp, bench_llamir
from llamir.frontend.synth import SynthSpec, write_model
from llamir.paths import cache_dir

SMALL = dict(n_layer=4, n_embd=256, n_head=4, n_head_kv=4, n_ff=768, n_vocab=4096, tied=True)
BIG = dict(n_layer=12, n_embd=768, n_head=12, n_head_kv=12, n_ff=2048, n_vocab=32000, tied=True)
DTYPES = ("f32", "f16", "q8_0", "q4_0", "q4_k", "q6_k")
TESTS = (("pp128", 128, 0), ("pp512", 512, 0), ("tg128", 0, 128))


def model_paths(selected: list[str] | None) -> dict[str, Path]:
    out = {}
    root = cache_dir() / "bench"
    root.mkdir(parents=True, exist_ok=True)
    for size, spec in (("small", SMALL), ("big", BIG)):
        for dtype in DTYPES:
            name = f"{size}-{dtype}"
            if selected and name not in selected:
                continue
            path = root / f"llama-{name}.gguf"
            if not path.exists():
                write_model(path, SynthSpec(arch="llama", dtype=dtype, seed=1, **spec))
            out[name] = path
    if not selected or "smollm2-q4_1" in selected:
        from llamir.frontend.default_model import default_model_path

        out["smollm2-q4_1"] = default_model_path(progress=True)
    return out


def weight_bytes_per_token(path: Path) -> int:
    """Bytes of the weights a token reads: every matrix, the output one included (tied: the
    embedding table), but only one row of the token embeddings."""
    import llamir

    model = llamir.load_model(path)
    total = 0
    tied = "output.weight" not in model.tensors
    for name, tensor in model.tensors.items():
        if name == "token_embd.weight" and not tied:
            total += tensor.n_bytes // tensor.shape[0]
        else:
            total += tensor.n_bytes
    return total


def memory_bandwidth(n_bytes: int = 1 << 29) -> float:
    """Read bandwidth of this machine (bytes/s), single process: a large array summed by a dot
    product with itself, best of three."""
    a = np.ones(n_bytes // 4, dtype=np.float32)
    a.dot(a)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        a.dot(a)
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best


def compile_times(path: Path, threads: int) -> dict:
    """Seconds from a new Context to the first logits of one token: with an empty code cache
    (cold), then with a new backend over the same (disk) cache (warm)."""
    import llamir
    from llamir.backends.llvm import LLVMBackend

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label in ("cold", "warm"):
            LLVMBackend._shared_caches.clear()
            be = LLVMBackend(n_threads=threads, cache_dir=tmp)
            model = llamir.load_model(path)
            t0 = time.perf_counter()
            ctx = llamir.Context(model, n_ctx=256, n_batch=64, n_ubatch=64, backend=be, flash_attn="on")
            assert ctx.decode(llamir.Batch.from_tokens([1], logits="last")) == 0, ctx.last_error
            out[label] = time.perf_counter() - t0
            out[f"{label}_detail"] = [{"graph": g, "cache": c, "seconds": s} for g, c, s in be.compile_stats.history]
            be.close()
    LLVMBackend._shared_caches.clear()
    return out


def run(models: dict[str, Path], threads: int, reps: int, rounds: int) -> dict:
    bandwidth = memory_bandwidth()
    report = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": threads, "rounds": rounds,
                          "memory_bandwidth_GBps": bandwidth / 1e9, "python": sys.version.split()[0],
                          "load_average": os.getloadavg()}, "models": {}}
    for name, path in models.items():
        entry = {"file": str(path), "weight_bytes_per_token": weight_bytes_per_token(path)}
        entry["roofline_tg_tps"] = bandwidth / entry["weight_bytes_per_token"]
        entry["compile_s"] = compile_times(path, threads)
        for label, n_prompt, n_gen in TESTS:
            key = "pp_tps" if label.startswith("pp") else "tg_tps"
            runs: dict[str, list[BenchResult]] = {"llamir": [], "llama.cpp": []}
            for _ in range(rounds):   # alternating, so that a slow spell of the machine hits both
                runs["llamir"].append(bench_llamir(path, "llvm", threads, n_prompt, n_gen, reps))
                runs["llama.cpp"].append(bench_llama_cpp(path, threads, n_prompt, n_gen, reps))
            entry[label] = {}
            for engine, results in runs.items():
                best = max(results, key=lambda r: getattr(r, key))
                entry[label][engine] = best.as_dict() | {"rounds_" + key: [getattr(r, key) for r in results]}
            _progress(name, label, entry[label], key)
        report["models"][name] = entry
    return report


def _progress(name: str, label: str, entry: dict, key: str) -> None:
    a, b = entry["llamir"][key], entry["llama.cpp"][key]
    print(f"  {name:14s} {label:6s} llamir {a:9.1f}  llama.cpp {b:9.1f}  x{a / b:5.2f}", file=sys.stderr)


def table(report: dict) -> str:
    lines = [f"threads={report['machine']['threads']}  memory bandwidth "
             f"{report['machine']['memory_bandwidth_GBps']:.1f} GB/s  load {report['machine']['load_average'][0]:.2f}",
             "",
             f"{'model':14s} {'test':6s} {'llamir tok/s':>13s} {'llama.cpp':>10s} {'ratio':>6s}   "
             f"{'roofline tg':>11s}",
             "-" * 70]
    for name, entry in report["models"].items():
        for label, _, _ in TESTS:
            key = "pp_tps" if label.startswith("pp") else "tg_tps"
            ours, theirs = entry[label]["llamir"][key], entry[label]["llama.cpp"][key]
            roof = f"{entry['roofline_tg_tps']:11.1f}" if label.startswith("tg") else ""
            lines.append(f"{name:14s} {label:6s} {ours:13.1f} {theirs:10.1f} {ours / theirs:6.2f}   {roof}")
    lines += ["", "compile (s, first token of a new context):  cold (empty cache) / warm (disk cache)"]
    for name, entry in report["models"].items():
        lines.append(f"  {name:14s} {entry['compile_s']['cold']:6.2f} / {entry['compile_s']['warm']:5.2f}")
    lines += ["", "one generated token (ms): total = native (kernels + barriers) + Python (executable, context)"]
    for name, entry in report["models"].items():
        x = entry["tg128"]["llamir"]["extra"]
        if "token_ms" in x:
            lines.append(f"  {name:14s} {x['token_ms']:7.3f} = {x['native_ms']:7.3f} (barriers {x['barrier_ms']:.3f})"
                         f" + {x['python_in_executable_ms']:.3f} + {x['python_in_context_ms']:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--models", default="", help="comma-separated subset, e.g. small-f32,big-q4_0,smollm2-q4_1")
    p.add_argument("--reps", type=int, default=3, help="prompt runs per measurement (median)")
    p.add_argument("--rounds", type=int, default=3,
                   help="alternating measurements of each engine per test; the best of each is reported")
    p.add_argument("--json", default="bench/results/bench_llvm.json", help="where to write the JSON report")
    args = p.parse_args(argv)
    selected = [m.strip() for m in args.models.split(",") if m.strip()] or None
    report = run(model_paths(selected), args.threads, args.reps, args.rounds)
    text = table(report)
    print(text)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    report["table"] = text
    out.write_text(json.dumps(report, indent=1))
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
