"""llamir's CUDA backend: the register/spill report of every kernel a model needs (ptxas, no GPU
needed), and on a GPU, pp/tg against the memory-bandwidth roof (and llama.cpp on the CPU, where
llama-cpp-python is installed), in one run.

    python bench/bench_cuda.py [--models smollm2-q4_1,small-q8_0] [--arch sm_90] [--bandwidth 4800] [--no-kernels]

The kernel table comes from emit-ptx's recording driver: the kernels of the prompt and one-token
graphs (flash attention on and off), each assembled by ptxas for --arch, with its registers,
spilled bytes and static shared memory. With a usable CUDA device (NVIDIA's driver), each model
then runs with every layer on it (`devices=["cuda"]`, n_gpu_layers=99): prompt (pp) and
generation (tg) tokens per second, and tg against its roof: the weight bytes a token reads
(bench_llvm's count) at --bandwidth GB/s (4800 for an H200, its datasheet's figure) and at the
device-to-device copy bandwidth measured here first (bytes read plus written); and the device's
own time for a token (its replays timed by events on the stream), against the same roof. Without a
device the second part prints why and is skipped.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import tempfile
import time
from pathlib import Path

from bench_llvm import model_paths, weight_bytes_per_token  # the same files bench_llvm.py writes and times
from llamir_cuda.emit import emit_ptx

from llamir.backends import backend_from_spec, get_registry
from llamir.cli_bench import bench_llama_cpp, bench_llamir, llama_cpp_system_info
from llamir.frontend.placement import PlacementParams

MODELS = ("smollm2-q4_1", "small-q8_0", "small-q4_k")


def kernel_report(path: Path, arch: str) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="llamir-ptx-") as out:
        return emit_ptx(path, arch, out, check=True, n_ubatch=512)


def copy_bandwidth(device, nbytes: int = 2 << 30, reps: int = 10) -> float:
    """The device's memory bandwidth as a device-to-device copy sees it (GB/s, bytes read plus
    written): the best of `reps` timed copies of `nbytes`, after one untimed."""
    ctx = device.ctx
    src, dst = ctx.alloc(nbytes), ctx.alloc(nbytes)
    try:
        ctx.memset_async(src, 7, nbytes)
        best = float("inf")
        for _ in range(reps + 1):
            ctx.stream_synchronize()
            t0 = time.perf_counter()
            ctx.memcpy_dtod_async(dst, src, nbytes)
            ctx.stream_synchronize()
            best = min(best, time.perf_counter() - t0)
        return 2 * nbytes / best / 1e9
    finally:
        ctx.free(src)
        ctx.free(dst)


def device_token_seconds(path: Path, n_prompt: int, n_tokens: int = 32) -> float:
    """The device's own time for a generated token (its kernels and copies, not the host's work):
    a context like the bench's takes a prompt and four tokens (the one-token sequence is a CUDA
    graph from its second run), then `n_tokens` more with the backend's timing events on."""
    import llamir

    model = llamir.load_model(path)
    cuda = backend_from_spec("cuda")
    ctx = llamir.Context(model, n_ctx=n_prompt + n_tokens + 16, n_batch=n_prompt, n_ubatch=n_prompt,
                         flash_attn="on", devices=[cuda], placement=PlacementParams(n_gpu_layers=99))
    tokens = [t % model.hparams.n_vocab for t in range(1, n_prompt + n_tokens + 5)]
    for i, batch in enumerate([tokens[:n_prompt]] + [[t] for t in tokens[n_prompt:]]):
        if i == 5:
            cuda.timing = True
        if ctx.decode(llamir.Batch.from_tokens(batch, pos0=0 if i == 0 else n_prompt + i - 1)) != 0:
            raise RuntimeError(f"decode failed: {ctx.last_error}")
    seconds = cuda.device_time() / n_tokens
    cuda.close()
    return seconds


def run(models: dict[str, Path], arch: str, bandwidth: float, threads: int, n_prompt: int, n_gen: int,
        reps: int, kernels: bool = True) -> dict:
    device = get_registry("cuda").devices()[0]
    with_llama_cpp = importlib.util.find_spec("llama_cpp") is not None
    report = {"host": platform.processor() or platform.machine(), "arch": arch, "bandwidth_gbps": bandwidth,
              "cuda": device.description, "unusable": device.unusable,
              "llama_cpp": llama_cpp_system_info() if with_llama_cpp else None,
              "n_prompt": n_prompt, "n_gen": n_gen, "models": {}}
    if not device.unusable:
        report["copy_gbps"] = copy_bandwidth(device)
    for name, path in models.items():
        entry = report["models"][name] = {"kernels": kernel_report(path, arch) if kernels else []}
        if device.unusable:
            continue
        cuda = backend_from_spec("cuda")
        r = bench_llamir(path, backend="llvm", threads=threads, n_prompt=n_prompt, n_gen=n_gen, reps=reps,
                         flash_attn="on", devices=[cuda], placement=PlacementParams(n_gpu_layers=99))
        token_bytes = weight_bytes_per_token(path)
        entry["llamir-cuda"] = {"pp_tps": r.pp_tps, "tg_tps": r.tg_tps, "token_bytes": token_bytes,
                                "tg_roof_tps": bandwidth * 1e9 / token_bytes,
                                "tg_copy_roof_tps": report["copy_gbps"] * 1e9 / token_bytes,
                                "tg_device_s": device_token_seconds(path, n_prompt), "run": r.as_dict()}
        cuda.close()
        if with_llama_cpp:
            ref = bench_llama_cpp(path, threads=threads, n_prompt=n_prompt, n_gen=n_gen, reps=reps, flash_attn="on")
            entry["llama.cpp"] = {"pp_tps": ref.pp_tps, "tg_tps": ref.tg_tps}
    return report


def table(report: dict) -> str:
    lines = [f"CUDA device: {report['cuda']}" + (f" (not usable: {report['unusable']})" if report["unusable"] else ""),
             f"ptxas target: {report['arch']}"]
    if "copy_gbps" in report:
        lines.append(f"copy bandwidth: {report['copy_gbps']:.0f} GB/s measured (device-to-device, read + write); "
                     f"roof {report['bandwidth_gbps']:.0f} GB/s")
    lines.append("")
    for name, entry in report["models"].items():
        if entry["kernels"]:
            lines += [f"{name}: {len(entry['kernels'])} kernels", "",
                      "| kernel | block | regs | spills B | smem B |", "|---|---|---:|---:|---:|"]
            for k in entry["kernels"]:
                lines.append(f"| {k['kernel']} | {'x'.join(map(str, k['block']))} | {k['registers']} | "
                             f"{k['spill_stores'] + k['spill_loads']} | {k['shared_bytes']} |")
            lines.append("")
        if "llamir-cuda" in entry:
            c = entry["llamir-cuda"]
            pp, tg = f"pp{report['n_prompt']}", f"tg{report['n_gen']}"
            lines += [f"{name}: {c['token_bytes'] / 1e6:.1f} MB of weights a token", "",
                      f"| engine | {pp} t/s | {tg} t/s | {tg} roof t/s | share of roof | share of copy roof |",
                      "|---|---:|---:|---:|---:|---:|",
                      f"| llamir-cuda | {c['pp_tps']:.1f} | {c['tg_tps']:.1f} | {c['tg_roof_tps']:.0f} | "
                      f"{c['tg_tps'] / c['tg_roof_tps']:.2%} | {c['tg_tps'] / c['tg_copy_roof_tps']:.2%} |"]
            if "llama.cpp" in entry:
                ref = entry["llama.cpp"]
                lines.append(f"| llama.cpp (CPU) | {ref['pp_tps']:.1f} | {ref['tg_tps']:.1f} | | | |")
            if c["tg_device_s"]:
                lines += ["", f"{name} {tg}: {1e3 / c['tg_tps']:.2f} ms a token, of which the device's own "
                          f"{c['tg_device_s'] * 1e6:.0f} us ({1 / c['tg_device_s']:.0f} t/s: "
                          f"{1 / c['tg_device_s'] / c['tg_copy_roof_tps']:.1%} of the copy roof)"]
            lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="", help=f"comma-separated subset of {','.join(MODELS)}")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--bandwidth", type=float, default=4800.0, help="the GPU's memory bandwidth in GB/s")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-prompt", type=int, default=512)
    p.add_argument("--n-gen", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-kernels", dest="kernels", action="store_false", help="skip the ptxas kernel report")
    p.add_argument("--json", default=None, help="write the report here (default bench/results/bench_cuda.json)")
    args = p.parse_args(argv)
    selected = [m for m in args.models.split(",") if m]
    report = run(model_paths(selected or list(MODELS)), args.arch, args.bandwidth, args.threads, args.n_prompt,
                 args.n_gen, args.reps, args.kernels)
    print(table(report))
    out = Path(args.json) if args.json else Path(__file__).parent / "results" / "bench_cuda.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
