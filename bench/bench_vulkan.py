"""llamir's Vulkan backend against llamir's LLVM CPU backend and llama.cpp (CPU), in one run.

    python bench/bench_vulkan.py [--models small-q4_0,smollm2-q4_1] [--n-prompt 64] [--n-gen 32] [--json out.json]

Each engine runs a prompt (pp) and token generation (tg) on the same GGUF files, timed by the same
functions (llamir.cli_bench): llamir with every layer on the first Vulkan device (`devices=["vulkan"]`,
n_gpu_layers=99), llamir on the CPU (LLVM), llama.cpp on the CPU. Two kernel rows time the
shaders alone: a 4096x4096 q4_0 mat-vec (GB/s of weights read, the token-generation roof) and a
512x512x512 f32 tiled matmul (GFLOP/s). The table's header names the Vulkan device and llama.cpp's
build.

On a discrete GPU the roof of the tg row is the device's memory bandwidth (weight bytes per token
/ bandwidth); on lavapipe the "device" is this CPU running SPIR-V through LLVM, whose roof is the
host's memory bandwidth (bench_llvm.py measures it), so lavapipe's figures say what the plugin's
overhead is, not what a GPU would do.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
from bench_llvm import model_paths  # the same files bench_llvm.py writes and times

from llamir.backends import get_backend
from llamir.cli_bench import bench_llama_cpp, bench_llamir, llama_cpp_system_info
from llamir.frontend.placement import PlacementParams

MODELS = ("small-f16", "small-q8_0", "small-q4_0", "small-q4_k", "smollm2-q4_1")


def kernel_rows(vulkan) -> list[dict]:
    """The shaders alone, through the backend's whole-graph path (recorded once, replayed)."""
    from llamir.ir import F32, Q4_0, GraphBuilder, quants

    rows = []
    rng = np.random.default_rng(0)
    for name, m, k, n, dtype in (("mat-vec q4_0 4096x4096", 4096, 4096, 1, Q4_0),
                                 ("tiled f32 512x512x512", 512, 512, 512, F32)):
        g = GraphBuilder("kernel")
        a = g.weight("a", (m, k), dtype)
        b = g.input("b", (n, k), F32)
        g.output("y", g.mul_mat(a, b))
        graph = g.graph
        w = rng.standard_normal((m, k)).astype(np.float32)
        values = {"a": quants.quantize(w, dtype) if dtype.is_quantized else w,
                  "b": rng.standard_normal((n, k)).astype(np.float32)}
        run = vulkan.compile(graph)
        run(values, {})   # records
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            run(values, {})
            times.append(time.perf_counter() - t0)
        best = min(times)
        row = {"kernel": name, "ms": best * 1e3}
        if dtype.is_quantized:
            row["GB/s"] = values["a"].nbytes / best / 1e9
        else:
            row["GFLOP/s"] = 2 * m * n * k / best / 1e9
        rows.append(row)
    return rows


def run(models: dict[str, Path], threads: int, n_prompt: int, n_gen: int, reps: int) -> dict:
    vulkan = get_backend("vulkan")
    report = {"host": platform.processor() or platform.machine(), "threads": threads,
              "vulkan": vulkan.device.description, "llama_cpp": llama_cpp_system_info(),
              "n_prompt": n_prompt, "n_gen": n_gen, "models": {}}
    for name, path in models.items():
        entry = report["models"][name] = {}
        for label, kwargs in (("llamir-vulkan", {"devices": [vulkan], "placement": PlacementParams(n_gpu_layers=99)}),
                              ("llamir-llvm", {})):
            r = bench_llamir(path, backend="llvm", threads=threads, n_prompt=n_prompt, n_gen=n_gen, reps=reps,
                             flash_attn="on", **kwargs)
            entry[label] = {"pp_tps": r.pp_tps, "tg_tps": r.tg_tps}
            print(f"  {name:14s} {label:14s} pp{n_prompt} {r.pp_tps:9.1f} t/s  tg{n_gen} {r.tg_tps:8.1f} t/s",
                  flush=True)
        r = bench_llama_cpp(path, threads=threads, n_prompt=n_prompt, n_gen=n_gen, reps=reps, flash_attn="on")
        entry["llama.cpp"] = {"pp_tps": r.pp_tps, "tg_tps": r.tg_tps}
        print(f"  {name:14s} {'llama.cpp':14s} pp{n_prompt} {r.pp_tps:9.1f} t/s  tg{n_gen} {r.tg_tps:8.1f} t/s",
              flush=True)
    report["kernels"] = kernel_rows(vulkan)
    return report


def table(report: dict) -> str:
    pp, tg = f"pp{report['n_prompt']}", f"tg{report['n_gen']}"
    lines = [f"Vulkan device: {report['vulkan']}", f"llama.cpp: {report['llama_cpp']}",
             f"threads: {report['threads']}", "",
             f"| model | engine | {pp} t/s | {tg} t/s | vs llama.cpp ({pp} / {tg}) |", "|---|---|---:|---:|---|"]
    for name, entry in report["models"].items():
        ref = entry["llama.cpp"]
        for engine, r in entry.items():
            rel = "" if engine == "llama.cpp" else \
                f"{r['pp_tps'] / ref['pp_tps']:.2f}x / {r['tg_tps'] / ref['tg_tps']:.2f}x"
            lines.append(f"| {name} | {engine} | {r['pp_tps']:.1f} | {r['tg_tps']:.1f} | {rel} |")
    lines += ["", "| kernel (vulkan) | ms | rate |", "|---|---:|---|"]
    for k in report["kernels"]:
        rate = f"{k['GB/s']:.2f} GB/s" if "GB/s" in k else f"{k['GFLOP/s']:.2f} GFLOP/s"
        lines.append(f"| {k['kernel']} | {k['ms']:.2f} | {rate} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--models", default="", help="comma-separated subset of small-f16,small-q8_0,small-q4_0,"
                                                "small-q4_k,smollm2-q4_1")
    p.add_argument("--n-prompt", type=int, default=64)
    p.add_argument("--n-gen", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", default=None, help="write the report here (default bench/results/bench_vulkan.json)")
    args = p.parse_args(argv)
    selected = [m for m in args.models.split(",") if m]
    report = run(model_paths(selected or list(MODELS)), args.threads, args.n_prompt, args.n_gen, args.reps)
    print(table(report))
    out = Path(args.json) if args.json else Path(__file__).parent / "results" / "bench_vulkan.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
