"""llamir's LLVM backend against llama.cpp on the same GGUF files, in one run.

    python bench/bench_llvm.py [--threads 2] [--models small-f32,big-q4_0,...] [--isa host|avx2] [--depth N]
                               [--json out.json]

Models: a ~5M and a ~110M random-weight llama (12 layers, n_embd 768, vocab 32000) in f32, f16,
q8_0, q4_0, q4_k and q6_k, written once into the llamir cache, plus SmolLM2-135M-Instruct Q4_1.
Named in --models only: a 1.03B one of TinyLlama's shape (large-f16, large-q8_0, large-q4_0,
large-q6_k; the q6_k one takes minutes to write), whose weights no L3 here holds: its tg128 row
is the memory-bound roofline test; and the recurrent models mamba130m-f32, mamba130m-q8_0 (Mamba-130M's
shape) and jamba-q8_0 (hybrid).
Each engine runs pp128, pp512 and tg128 with the same thread count, timed the same way (llamir.cli_bench:
median of the prompt runs, generation rate from the median token). Also reported: the memory
bandwidth measured here and the token-generation roofline it implies (weight bytes per token /
bandwidth, with the bandwidth measured again before each tg round, beside the row: the highest
of those, since the best rounds are reported), llamir's compile times (cold: empty code cache;
warm: from the disk cache) and where a generated token's time goes (kernels, barriers, Python).

`--depth N` runs every test with N tokens already in the cache (llama-bench -d): the rows say
`@dN`, and the generation rows read that many cached cells more per token than the roofline counts.

`--isa avx2` emulates an AVX2-only machine on an AVX-512 host: llamir generates code without
AVX-512/AVX-VNNI with the avx2 numerics profile, and llama.cpp runs from an AVX2-only build
(`--llama-cpp-path`, default llamir.cli_bench.AVX2_LLAMA_CPP) in subprocesses. The table's header
names the CPU (/proc/cpuinfo), llamir's LLVM target and llama.cpp's llama_print_system_info().

Shared machines are noisy: each test alternates the two engines `--rounds` times (default 3) and
reports the best measurement of each (all rounds are in the JSON); rerun when the load is high.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from llamir.cli_bench import (
    ISAS,
    BenchResult,
    bench_llama_cpp,
    bench_llamir,
    compile_times,
    cpu_isa,
    llama_cpp_build,
    llama_cpp_system_info,
    llvm_options,
)
from llamir.frontend.synth import SynthSpec, write_model
from llamir.paths import cache_dir

SMALL = dict(n_layer=4, n_embd=256, n_head=4, n_head_kv=4, n_ff=768, n_vocab=4096, tied=True)
BIG = dict(n_layer=12, n_embd=768, n_head=12, n_head_kv=12, n_ff=2048, n_vocab=32000, tied=True)
# TinyLlama-1.1B's shape (1.03B params with tied embeddings): weights that no L3 here holds, for
# the token-generation roofline where memory bandwidth is the limit. Only when named in --models.
LARGE = dict(n_layer=22, n_embd=2048, n_head=32, n_head_kv=4, n_ff=5632, n_vocab=32000, tied=True)
# Mamba-130M's shape (24 Mamba-1 blocks of 768, d_state 16, dt_rank 48) and a jamba of 8 blocks (every
# other one attention), random weights: the recurrent and hybrid memories. Only when named in --models.
MAMBA = dict(n_layer=24, n_embd=768, n_vocab=32000, tied=True, ssm_dt_rank=48, seed=1)
RECURRENT = {
    "mamba130m-f32": SynthSpec(arch="mamba", dtype="f32", **MAMBA),
    "mamba130m-q8_0": SynthSpec(arch="mamba", dtype="q8_0", **MAMBA),
    "jamba-q8_0": SynthSpec(arch="jamba", dtype="q8_0", n_layer=8, n_embd=768, n_head=12, n_head_kv=4, n_ff=2048,
                            n_vocab=32000, tied=True, ssm_dt_rank=48, seed=1),
}
DTYPES = ("f32", "f16", "q8_0", "q4_0", "q4_k", "q6_k")
LARGE_DTYPES = ("f16", "q8_0", "q4_0", "q6_k")
TESTS = (("pp128", 128, 0), ("pp512", 512, 0), ("tg128", 0, 128))


def tests(depth: int) -> tuple:
    """(label, prompt tokens, generated tokens) of each test; at a depth (--depth: tokens in the
    cache before each timed decode, llama-bench's -d) the labels say it: tg128@d512."""
    return tuple((f"{label}@d{depth}" if depth else label, n_prompt, n_gen) for label, n_prompt, n_gen in TESTS)


def model_paths(selected: list[str] | None) -> dict[str, Path]:
    out = {}
    root = cache_dir() / "bench"
    root.mkdir(parents=True, exist_ok=True)
    for size, spec, dtypes in (("small", SMALL, DTYPES), ("big", BIG, DTYPES), ("large", LARGE, LARGE_DTYPES)):
        for dtype in dtypes:
            name = f"{size}-{dtype}"
            if (selected and name not in selected) or (size == "large" and not selected):
                continue
            path = root / f"llama-{name}.gguf"
            if not path.exists():
                write_model(path, SynthSpec(arch="llama", dtype=dtype, seed=1, **spec))
            out[name] = path
    for name, arch_spec in RECURRENT.items():   # only when named in --models
        if selected and name in selected:
            path = root / f"{name}.gguf"
            if not path.exists():
                write_model(path, arch_spec)
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


def l3_bytes() -> int:
    """The largest cache this CPU reports (sysfs), 32 MiB when it says nothing."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=32 << 20)


def memory_bandwidth(threads: int, n_bytes: int | None = None) -> tuple[float, int]:
    """DRAM read bandwidth of this machine with `threads` threads reading (bytes/s), and the
    buffer it was read from: a numpy streaming read (a float32 array dotted with itself, a slice
    per thread; numpy lets go of the GIL) over 4x the L3 (at least 1 GiB, at most a quarter of the
    free memory), best of three. One thread alone reads far less than two do."""
    if n_bytes is None:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        n_bytes = min(max(4 * l3_bytes(), 1 << 30), free // 4)
    a = np.ones(n_bytes // 4, dtype=np.float32)
    parts = np.array_split(a, max(threads, 1))
    best = float("inf")
    with ThreadPoolExecutor(len(parts)) as pool:
        for i in range(4):   # the first pass faults the pages in
            t0 = time.perf_counter()
            list(pool.map(lambda part: part.dot(part), parts))
            if i:
                best = min(best, time.perf_counter() - t0)
    return a.nbytes / best, a.nbytes


def isa_report(isa: str, threads: int, build: str | None) -> dict:
    """What each engine runs on: the CPU, llamir's LLVM target and profile, llama.cpp's build."""
    from llamir.backends.llvm import LLVMBackend

    be = LLVMBackend(n_threads=threads, disk_cache=False, **llvm_options(isa))
    llamir_isa = f"LLVM target {be.target.describe()}, numerics {be.numerics}"
    be.close()
    if build is None:
        info = llama_cpp_system_info()
    else:   # asked of the build itself, in a subprocess with it on the path
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (build, os.environ.get("PYTHONPATH")) if p))
        info = subprocess.run([sys.executable, "-c", "import llama_cpp; "
                               "print(llama_cpp.llama_print_system_info().decode().strip())"],
                              env=env, capture_output=True, text=True, check=True).stdout.strip()
    return {"isa": isa, "cpu": cpu_isa(), "llamir": llamir_isa, "llama.cpp": info,
            "llama.cpp_build": build or "installed"}


def run(models: dict[str, Path], threads: int, reps: int, rounds: int, isa: str = "host",
        llama_cpp_path: str | None = None, depth: int = 0) -> dict:
    build = llama_cpp_build(isa, llama_cpp_path)
    bandwidth, buffer = memory_bandwidth(threads)
    report = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": threads, "rounds": rounds,
                          "memory_bandwidth_GBps": bandwidth / 1e9, "bandwidth_buffer_bytes": buffer,
                          "l3_bytes": l3_bytes(), "python": sys.version.split()[0],
                          "load_average": os.getloadavg(), "depth": depth},
              "isa": isa_report(isa, threads, build), "models": {}}
    for name, path in models.items():
        entry = {"file": str(path), "weight_bytes_per_token": weight_bytes_per_token(path), "tg_bandwidth_GBps": []}
        entry["compile_s"] = compile_times(path, threads, isa)
        for label, n_prompt, n_gen in tests(depth):
            key = "pp_tps" if label.startswith("pp") else "tg_tps"
            runs: dict[str, list[BenchResult]] = {"llamir": [], "llama.cpp": []}
            for _ in range(rounds):   # alternating, so that a slow spell of the machine hits both
                if n_gen:   # the bandwidth drifts with the machine's neighbours: measured beside each tg round
                    entry["tg_bandwidth_GBps"].append(memory_bandwidth(threads, buffer)[0] / 1e9)
                runs["llamir"].append(bench_llamir(path, "llvm", threads, n_prompt, n_gen, reps, isa=isa, depth=depth))
                runs["llama.cpp"].append(bench_llama_cpp(path, threads, n_prompt, n_gen, reps, build=build,
                                                         depth=depth))
            entry[label] = {}
            for engine, results in runs.items():
                best = max(results, key=lambda r: getattr(r, key))
                entry[label][engine] = best.as_dict() | {"rounds_" + key: [getattr(r, key) for r in results]}
            _progress(name, label, entry[label], key)
        # the best rounds are reported, so the roofline takes the best bandwidth measured beside them
        entry["roofline_tg_tps"] = max(entry["tg_bandwidth_GBps"]) * 1e9 / entry["weight_bytes_per_token"]
        report["models"][name] = entry
    return report


def _progress(name: str, label: str, entry: dict, key: str) -> None:
    a, b = entry["llamir"][key], entry["llama.cpp"][key]
    print(f"  {name:14s} {label:6s} llamir {a:9.1f}  llama.cpp {b:9.1f}  x{a / b:5.2f}", file=sys.stderr)


def table(report: dict) -> str:
    m, isa = report["machine"], report["isa"]
    lines = [f"isa {isa['isa']}  cpu {isa['cpu']}",
             f"  llamir    {isa['llamir']}",
             f"  llama.cpp {isa['llama.cpp_build']}: {isa['llama.cpp']}",
             f"threads={m['threads']}  memory bandwidth {m['memory_bandwidth_GBps']:.1f} GB/s "
             f"({m['threads']} threads' numpy read of "
             f"{m['bandwidth_buffer_bytes'] / 2**30:.1f} GiB, L3 {m['l3_bytes'] / 2**20:.0f} MiB)  "
             f"load {m['load_average'][0]:.2f}",
             "",
             f"{'model':14s} {'test':6s} {'llamir tok/s':>13s} {'llama.cpp':>10s} {'ratio':>6s}   "
             f"{'roofline tg':>11s} {'llamir %':>8s} {'llama.cpp %':>11s}",
             "-" * 88]
    depth = m.get("depth", 0)
    for name, entry in report["models"].items():
        for label, _, _ in tests(depth):
            key = "pp_tps" if label.startswith("pp") else "tg_tps"
            ours, theirs = entry[label]["llamir"][key], entry[label]["llama.cpp"][key]
            row = f"{name:14s} {label:6s} {ours:13.1f} {theirs:10.1f} {ours / theirs:6.2f}"
            if label.startswith("tg"):
                roof = entry["roofline_tg_tps"]
                row += f"   {roof:11.1f} {100 * ours / roof:7.0f}% {100 * theirs / roof:10.0f}%"
                row += "  at " + "/".join(f"{gbps:.1f}" for gbps in entry["tg_bandwidth_GBps"]) + " GB/s"
            lines.append(row)
    lines += ["", f"compile (s, new Context to the first token's logits, isa {isa['isa']}); in brackets the "
              "backend's compile alone, wall and CPU (this process + compile workers):",
              "  cold (new process, empty cache dir) / warm (second Context, same process) / disk (new process, "
              "cache on disk)"]
    for name, entry in report["models"].items():
        c = entry["compile_s"]
        parts = []
        for k in ("cold", "warm", "disk"):
            wall, cpu = (sum(d[f] for d in c[k + "_detail"]) for f in ("seconds", "cpu_seconds"))
            parts.append(f"{c[k]:5.2f} ({wall:4.2f}, cpu {cpu:4.2f})")
        lines.append(f"  {name:14s} " + " / ".join(parts))
    lines += ["", "one generated token (ms): total = native (kernels + barriers) + Python (executable, context); "
              "then the same token through the general decode path instead of the token lane"]
    for name, entry in report["models"].items():
        x = entry[tests(depth)[-1][0]]["llamir"]["extra"]
        if "token_ms" in x:
            line = (f"  {name:14s} {x['token_ms']:7.3f} = {x['native_ms']:7.3f} (barriers {x['barrier_ms']:.3f})"
                    f" + {x['python_in_executable_ms']:.3f} + {x['python_in_context_ms']:.3f}")
            if "token_general_ms" in x:
                general, context = x["token_general_ms"], x["python_in_context_general_ms"]
                line += f"   general path {general:7.3f} (context {context:.3f})"
            lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--models", default="", help="comma-separated subset, e.g. small-f32,big-q4_0,smollm2-q4_1")
    p.add_argument("--reps", type=int, default=3, help="prompt runs per measurement (median)")
    p.add_argument("--rounds", type=int, default=3,
                   help="alternating measurements of each engine per test; the best of each is reported")
    p.add_argument("--isa", choices=ISAS, default="host",
                   help="host: this CPU; avx2: emulate an AVX2-only CPU (llamir without AVX-512/AVX-VNNI, avx2 "
                        "numerics; llama.cpp from the AVX2 build)")
    p.add_argument("--llama-cpp-path", default=None,
                   help="directory holding the llama_cpp package to compare with (default for --isa avx2: "
                        "llamir.cli_bench.AVX2_LLAMA_CPP)")
    p.add_argument("--json", default=None,
                   help="where to write the JSON report (default bench/results/bench_llvm[_ISA].json)")
    p.add_argument("--depth", type=int, default=0,
                   help="tokens in the cache before each timed prompt and generation (llama-bench -d)")
    args = p.parse_args(argv)
    if args.depth < 0:
        p.error(f"--depth must be >= 0, not {args.depth}")
    selected = [m.strip() for m in args.models.split(",") if m.strip()] or None
    report = run(model_paths(selected), args.threads, args.reps, args.rounds, args.isa, args.llama_cpp_path,
                 args.depth)
    text = table(report)
    print(text)
    suffix = ("" if args.isa == "host" else "_" + args.isa) + (f"_d{args.depth}" if args.depth else "")
    out = Path(args.json or f"bench/results/bench_llvm{suffix}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    report["table"] = text
    out.write_text(json.dumps(report, indent=1))
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
