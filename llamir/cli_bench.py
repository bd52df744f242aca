"""`llamir bench MODEL [-p 512] [-n 128] [--backend B] [--threads N] [--isa host|avx2] [--json]`:
prompt processing and generation speed of one model, measured like llama-bench.

pp: one decode of P tokens into an empty cache (n_batch = n_ubatch = P), the median of `reps`
runs after a warm-up. tg: N single-token decodes from an empty cache, each timed, the rate of
the median. The same functions time llama.cpp (bench/bench_llvm.py runs both on one file).

`--isa avx2` emulates an AVX2-only CPU (AMD Zen 3) on an AVX-512 host: llamir's LLVM code is
generated without AVX-512, AVX-VNNI and GFNI (target.avx2_only_target), with the avx2 numerics
profile, and llama.cpp runs from an AVX2-only build of llama-cpp-python (`--llama-cpp-path`, a directory put first on
PYTHONPATH) in a subprocess, since one process can import only one llama_cpp.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

FLASH_ATTN_DEFAULT = "on"   # llama.cpp's CPU default (auto) resolves to flash attention
ISAS = ("host", "avx2")
AVX2_LLAMA_CPP = "/work/build/avx2"         # llama-cpp-python built with GGML_AVX512=OFF (see bench/README.md)
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16",
             "avx_vnni", "amx_tile")


# -- the ISA a bench runs on --------------------------------------------------------------------
def cpu_isa() -> str:
    """This CPU as /proc/cpuinfo describes it: model name and the vector flags that matter."""
    name, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and name == "unknown CPU":
                    name = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return f"{name}: " + " ".join(f for f in CPU_FLAGS if f in flags)


def llvm_options(isa: str) -> dict:
    """LLVMBackend options for `isa`: host (this CPU, its default profile) or avx2 (what Zen 3
    has: no AVX-512, AVX-VNNI or GFNI; the avx2 numerics profile of an AVX2 llama.cpp build)."""
    if isa == "host":
        return {}
    if isa == "avx2":
        from llamir.backends.llvm.target import avx2_only_target

        return {"target": avx2_only_target(), "numerics": "avx2"}
    raise ValueError(f"unknown isa {isa!r}; choose one of {', '.join(ISAS)}")


def llama_cpp_system_info() -> str:
    """llama_print_system_info() of the llama_cpp this process imports."""
    import llama_cpp

    return llama_cpp.llama_print_system_info().decode().strip()


def llama_cpp_build(isa: str, path: str | None = None) -> str | None:
    """The directory to put first on PYTHONPATH for the llama.cpp build of `isa`, or None for the
    installed one (host; or avx2 when the installed build is itself AVX2-only)."""
    if isa == "host":
        return path
    if isa != "avx2":
        raise ValueError(f"unknown isa {isa!r}; choose one of {', '.join(ISAS)}")
    build = path or AVX2_LLAMA_CPP
    if os.path.isdir(os.path.join(build, "llama_cpp")):
        return build
    if "AVX512 = 1" not in llama_cpp_system_info():
        return None
    raise RuntimeError(f"--isa avx2 needs an AVX2-only llama-cpp-python build: {build}/llama_cpp not found "
                       "(build one with CMAKE_ARGS=-DGGML_AVX512=OFF, see bench/README.md)")


@dataclass
class BenchResult:
    """Tokens per second for one model and engine, plus what helps read them."""

    engine: str
    model: str
    threads: int
    pp_tokens: int
    tg_tokens: int
    depth: int = 0                  # tokens already in the cache before each timed decode (llama-bench -d)
    pp_tps: float = 0.0
    tg_tps: float = 0.0
    pp_runs_s: list[float] = field(default_factory=list)
    tg_token_ms: list[float] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def time_pp(decode_prompt: Callable[[list[int]], None], clear: Callable[[], None], tokens: list[int],
            reps: int) -> list[float]:
    """Seconds of each of `reps` prompt decodes (after one warm-up), the cache cleared before each."""
    clear()
    decode_prompt(tokens)
    times = []
    for _ in range(reps):
        clear()
        t0 = time.perf_counter()
        decode_prompt(tokens)
        times.append(time.perf_counter() - t0)
    return times


def time_tg(decode_one: Callable[[int, int], None], clear: Callable[[], None], tokens: list[int]) -> list[float]:
    """Seconds of each single-token decode, positions 0.. (after a one-token warm-up)."""
    clear()
    decode_one(tokens[0], 0)
    clear()
    times = []
    for pos, token in enumerate(tokens):
        t0 = time.perf_counter()
        decode_one(token, pos)
        times.append(time.perf_counter() - t0)
    return times


def _tokens(n: int, n_vocab: int, seed: int = 0) -> list[int]:
    import numpy as np

    return [int(t) for t in np.random.RandomState(seed).randint(3, min(n_vocab, 30000), size=n)]


def bench_llamir(path: str | Path, backend: str = "llvm", threads: int = 0, n_prompt: int = 512, n_gen: int = 128,
                 reps: int = 3, flash_attn: str = FLASH_ATTN_DEFAULT, numerics: str | None = None,
                 isa: str = "host", devices: list | None = None, placement=None, depth: int = 0) -> BenchResult:
    """Time llamir on one GGUF: prompt processing and generation, plus compile and overheads.
    `devices` (backends in priority order) and `placement` run the model split over them; `depth`
    tokens fill the cache (untimed) before each timed prompt and generation."""
    import llamir
    from llamir.backends import get_backend

    model = llamir.load_model(path)
    options = {"n_threads": threads} if threads else {}
    if backend == "llvm":
        options.update(llvm_options(isa))
    elif isa != "host":
        raise ValueError(f"--isa {isa} applies to the llvm backend, not {backend}")
    if numerics is not None:
        options["numerics"] = numerics
    be = get_backend(backend, **options)
    n_threads = getattr(be, "n_threads", threads)
    result = BenchResult(f"llamir-{backend}", Path(path).name, n_threads, n_prompt, n_gen, depth)
    if hasattr(be, "target"):
        result.extra["isa"] = f"{be.target.describe()}, numerics {be.numerics}"
    n_ctx, batch = _context_sizes(n_prompt, n_gen, depth)
    t0 = time.perf_counter()
    ctx = llamir.Context(model, n_ctx=n_ctx, n_batch=batch, n_ubatch=batch, flash_attn=flash_attn, backend=be,
                         devices=devices or (), placement=placement)
    if devices:
        result.extra["devices"] = ", ".join(d.label for d in devices) + f" (splits: {ctx.n_splits})"
    filled = _tokens(depth, model.hparams.n_vocab, seed=2)

    def clear() -> None:
        ctx.memory.clear(False)
        if depth:
            _ok(ctx, llamir.Batch.from_tokens(filled, logits="last"))

    prompt = _tokens(n_prompt, model.hparams.n_vocab)
    if n_prompt:
        first = time.perf_counter()
        clear()
        _ok(ctx, llamir.Batch.from_tokens(prompt, pos0=depth, logits="last"))
        result.extra["first_pp_s"] = time.perf_counter() - first
        result.pp_runs_s = time_pp(lambda t: _ok(ctx, llamir.Batch.from_tokens(t, pos0=depth, logits="last")), clear,
                                   prompt, reps)
        result.pp_tps = n_prompt / _median(result.pp_runs_s)
    result.extra["setup_s"] = time.perf_counter() - t0
    if n_gen:
        gen = _tokens(n_gen, model.hparams.n_vocab, seed=1)
        times = time_tg(lambda tok, pos: _ok(ctx, llamir.Batch.from_tokens([tok], pos0=depth + pos)), clear, gen)
        result.tg_token_ms = [t * 1e3 for t in times]
        result.tg_tps = 1.0 / _median(times)
        result.extra["tg_mean_tps"] = n_gen / sum(times)
        result.extra.update(_token_breakdown(ctx, be, gen, clear, depth))
    stats = getattr(be, "compile_stats", None)
    if stats is not None:
        result.extra["compile"] = [record._asdict() for record in stats.history]
    return result


def _context_sizes(n_prompt: int, n_gen: int, depth: int) -> tuple[int, int]:
    """(n_ctx, n_batch) for a bench run: room for the depth and the longer test, a batch that
    takes the prompt or the depth's fill in one decode."""
    if depth < 0 or n_prompt < 0 or n_gen < 0:
        raise ValueError(f"token counts must be >= 0 (prompt {n_prompt}, generation {n_gen}, depth {depth})")
    return depth + max(n_prompt, n_gen) + 16, max(n_prompt, depth, 1)


def _ok(ctx, batch) -> None:
    status = ctx.decode(batch)
    if status != 0:
        raise RuntimeError(f"decode failed with status {status}: {ctx.last_error}")


def _token_breakdown(ctx, be, gen: list[int], clear: Callable[[], None], depth: int) -> dict:
    """Where one generated token's time goes: native compute (kernels + barriers, seen from thread
    0), the executable's Python (binding, outputs) and the context's Python around it; through
    the token lane (what decode takes for a generated token) and through the general path."""
    from llamir.backends.llvm.executable import CompiledSplit

    if not hasattr(be, "compile_stats"):
        return {}
    import llamir

    spent = {"call": 0.0}
    captured = {}
    full_call, bound_call = CompiledSplit.__call__, CompiledSplit.call_bound

    def call(self, leaf_values, bindings, observe=None):
        t0 = time.perf_counter()
        out = full_call(self, leaf_values, bindings, observe)
        spent["call"] += time.perf_counter() - t0
        captured["args"] = (self, leaf_values, bindings)
        return out

    def call_bound(self, binding):
        t0 = time.perf_counter()
        out = bound_call(self, binding)
        spent["call"] += time.perf_counter() - t0
        return out

    def per_token(lane: bool) -> tuple[float, float]:
        """Seconds per token, and of them in the executable's call."""
        ctx.fast_token_decode = lane
        clear()
        _ok(ctx, llamir.Batch.from_tokens([gen[0]], pos0=depth))     # arms the lane
        clear()
        spent["call"] = 0.0
        n = min(len(gen), 32)
        t0 = time.perf_counter()
        for pos in range(n):
            _ok(ctx, llamir.Batch.from_tokens([gen[pos]], pos0=depth + pos))
        return (time.perf_counter() - t0) / n, spent["call"] / n

    CompiledSplit.__call__, CompiledSplit.call_bound = call, call_bound
    try:
        general, general_call = per_token(False)
        total, call_s = per_token(True)
    finally:
        CompiledSplit.__call__, CompiledSplit.call_bound = full_call, bound_call
        ctx.fast_token_decode = True
    exe, leaves, bindings = captured["args"]
    prof = exe.profile(dict(leaves), dict(bindings), runs=10)
    return {"token_ms": total * 1e3, "executable_call_ms": call_s * 1e3, "native_ms": prof.total * 1e3,
            "barrier_ms": prof.barriers * 1e3, "python_in_executable_ms": max(0.0, call_s - prof.total) * 1e3,
            "python_in_context_ms": max(0.0, total - call_s) * 1e3, "token_general_ms": general * 1e3,
            "python_in_context_general_ms": max(0.0, general - general_call) * 1e3,
            "kernels_ms": {k: v * 1e3 for k, v in prof.by_kernel().items()}}


def bench_llama_cpp(path: str | Path, threads: int = 2, n_prompt: int = 512, n_gen: int = 128, reps: int = 3,
                    flash_attn: str = FLASH_ATTN_DEFAULT, build: str | None = None, depth: int = 0) -> BenchResult:
    """Time llama.cpp (llama-cpp-python) the same way on the same file; from the build in
    directory `build` (run in a subprocess with it first on PYTHONPATH) when one is given."""
    if build is not None:
        return _bench_llama_cpp_in(build, dict(path=str(path), threads=threads, n_prompt=n_prompt, n_gen=n_gen,
                                               reps=reps, flash_attn=flash_attn, depth=depth))
    from llamir.testing.llama_cpp import LlamaCppOracle

    result = BenchResult("llama.cpp", Path(path).name, threads, n_prompt, n_gen, depth)
    result.extra["system_info"] = llama_cpp_system_info()
    n_ctx, batch = _context_sizes(n_prompt, n_gen, depth)
    with LlamaCppOracle(path, n_ctx=n_ctx, n_batch=batch, n_ubatch=batch, n_threads=threads,
                        flash_attn=flash_attn == "on") as o:
        filled = _tokens(depth, o.n_vocab, seed=2)

        def decode(tokens, pos0=0, logits="last"):
            status = o.decode(tokens, pos0=pos0, logits=logits)
            if status != 0:
                raise RuntimeError(f"llama.cpp decode failed with status {status}")

        def clear() -> None:
            o.clear()   # llama_memory_clear: a recurrent memory refuses seq_rm of every sequence (-1)
            if depth:
                decode(filled)

        if n_prompt:
            prompt = _tokens(n_prompt, o.n_vocab)
            result.pp_runs_s = time_pp(lambda t: decode(t, pos0=depth), clear, prompt, reps)
            result.pp_tps = n_prompt / _median(result.pp_runs_s)
        if n_gen:
            gen = _tokens(n_gen, o.n_vocab, seed=1)
            times = time_tg(lambda tok, pos: decode([tok], pos0=depth + pos), clear, gen)
            result.tg_token_ms = [t * 1e3 for t in times]
            result.tg_tps = 1.0 / _median(times)
            result.extra["tg_mean_tps"] = n_gen / sum(times)
    return result


def _bench_llama_cpp_in(build: str, kwargs: dict) -> BenchResult:
    """bench_llama_cpp(**kwargs) in a new Python whose llama_cpp comes from `build`."""
    result = BenchResult(**_run_worker({"job": "llama.cpp"} | kwargs, pythonpath=build))
    if not str(result.extra.get("llama_cpp", "")).startswith(os.path.abspath(build)):
        raise RuntimeError(f"the subprocess imported llama_cpp from {result.extra.get('llama_cpp')}, not {build}")
    return result


def compile_times(path: str | Path, threads: int, isa: str = "host") -> dict:
    """Seconds from a new Context to the first logits of one token. cold: a new process with an
    empty llamir cache dir; warm: a second Context on the same model in that process; disk: a new
    process with the disk cache the first one filled. `*_detail`: the backend's compiles."""
    with tempfile.TemporaryDirectory(prefix="llamir-compile-") as tmp:
        job = {"job": "compile", "path": str(path), "threads": threads, "isa": isa}
        first = _run_worker(job | {"contexts": 2}, cache_dir=tmp)
        second = _run_worker(job | {"contexts": 1}, cache_dir=tmp)
    out = {}
    for label, run in (("cold", first["runs"][0]), ("warm", first["runs"][1]), ("disk", second["runs"][0])):
        out[label] = run["seconds"]
        out[f"{label}_detail"] = run["compiles"]
    return out


def _compile_job(path: str, threads: int, isa: str, contexts: int) -> dict:
    import llamir
    from llamir.backends.llvm import LLVMBackend

    model = llamir.load_model(path)
    runs = []
    for _ in range(contexts):
        be = LLVMBackend(n_threads=threads, **llvm_options(isa))
        t0 = time.perf_counter()
        ctx = llamir.Context(model, n_ctx=256, n_batch=64, n_ubatch=64, backend=be, flash_attn="on")
        _ok(ctx, llamir.Batch.from_tokens([1], logits="last"))
        seconds = time.perf_counter() - t0
        runs.append({"seconds": seconds, "compiles": [record._asdict() for record in be.compile_stats.history]})
        be.close()
    return {"runs": runs}


def _run_worker(job: dict, pythonpath: str | None = None, cache_dir: str | None = None) -> dict:
    """`job` run by _worker in a new Python (`pythonpath` first on its path, `cache_dir` as its
    LLAMIR_CACHE_DIR); its JSON answer."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([pythonpath] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                             if p])
    if cache_dir:
        from llamir.paths import CACHE_DIR_ENV

        env[CACHE_DIR_ENV] = cache_dir
    proc = subprocess.run([sys.executable, "-m", "llamir.cli_bench", json.dumps(job)], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"bench job {job['job']} failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _worker(job_json: str) -> int:
    """The subprocess side of _run_worker: one JSON object on stdout."""
    job = json.loads(job_json)
    kind = job.pop("job")
    if kind == "llama.cpp":
        import llama_cpp

        result = bench_llama_cpp(**job)
        result.extra["llama_cpp"] = os.path.abspath(llama_cpp.__file__)
        answer = result.as_dict()
    elif kind == "compile":
        answer = _compile_job(**job)
    else:
        raise ValueError(f"unknown bench job {kind!r}")
    print(json.dumps(answer))
    return 0


def cmd_bench(args) -> int:
    from llamir.cli import CliError, _model_path

    path = _model_path(args.model)
    try:
        if args.backend == "llama.cpp":
            result = bench_llama_cpp(path, threads=args.threads or 2, n_prompt=args.n_prompt, n_gen=args.n_gen,
                                     reps=args.reps, flash_attn=args.flash_attn,
                                     build=llama_cpp_build(args.isa, args.llama_cpp_path), depth=args.depth)
        else:
            from llamir.cli_devices import device_backends, placement_params

            devices = device_backends(args)
            result = bench_llamir(path, backend=args.backend, threads=args.threads, n_prompt=args.n_prompt,
                                  n_gen=args.n_gen, reps=args.reps, flash_attn=args.flash_attn,
                                  numerics=args.numerics, isa=args.isa, devices=devices,
                                  placement=placement_params(args) if devices else None, depth=args.depth)
    except (RuntimeError, ValueError) as err:
        raise CliError(str(err)) from None
    if args.json:
        print(json.dumps(result.as_dict()))
        return 0
    print(f"{result.engine}  {result.model}  threads={result.threads}")
    print(f"  cpu    {cpu_isa()}")
    for key in ("isa", "system_info", "devices"):
        if key in result.extra:
            print(f"  {dict(system_info='build', isa='target').get(key, key):6s} {result.extra[key]}")
    at = f" @ d{result.depth}" if result.depth else ""
    if result.pp_tokens:
        print(f"  pp{result.pp_tokens:<5d} {result.pp_tps:10.1f} tok/s{at}")
    if result.tg_tokens:
        print(f"  tg{result.tg_tokens:<5d} {result.tg_tps:10.1f} tok/s{at}")
    for key in ("token_ms", "native_ms", "python_in_executable_ms", "python_in_context_ms", "token_general_ms"):
        if key in result.extra:
            print(f"  {key:24s} {result.extra[key]:8.3f}")
    return 0


def add_parser(subparsers) -> None:
    from llamir.cli import add_numerics_option

    p: argparse.ArgumentParser = subparsers.add_parser(
        "bench", help="prompt-processing and generation speed of a model (like llama-bench)")
    p.add_argument("model", nargs="?", default=None, help="GGUF file (default: SmolLM2-135M Q4_1)")
    p.add_argument("-p", "--n-prompt", type=int, default=512, dest="n_prompt", help="prompt tokens (0: skip)")
    p.add_argument("-n", "--n-gen", type=int, default=128, dest="n_gen", help="generated tokens (0: skip)")
    p.add_argument("-d", "--n-depth", type=int, default=0, dest="depth",
                   help="tokens in the cache before each timed prompt and generation (llama-bench -d)")
    p.add_argument("--backend", default="llvm", help="llvm (default), numpy, ..., or llama.cpp")
    p.add_argument("--threads", type=int, default=0, help="threads (default: all cores)")
    p.add_argument("--reps", type=int, default=3, help="prompt runs to take the median of")
    p.add_argument("--flash-attn", choices=["on", "off"], default=FLASH_ATTN_DEFAULT, dest="flash_attn")
    p.add_argument("--json", action="store_true", help="print one JSON object (pp_tps, tg_tps, ...)")
    p.add_argument("--isa", choices=ISAS, default="host",
                   help="host: this CPU; avx2: emulate an AVX2-only CPU (llvm without AVX-512/AVX-VNNI, avx2 "
                        "numerics; llama.cpp from the AVX2 build)")
    p.add_argument("--llama-cpp-path", default=None, dest="llama_cpp_path",
                   help=f"directory of the llama_cpp package to bench (default for --isa avx2: {AVX2_LLAMA_CPP})")
    add_numerics_option(p)
    from llamir.cli_devices import add_device_args

    add_device_args(p)
    p.set_defaults(func=cmd_bench)


if __name__ == "__main__":     # the worker of _run_worker
    sys.exit(_worker(sys.argv[1]))
