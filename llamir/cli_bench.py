"""`llamir bench MODEL [-p 512] [-n 128] [--backend B] [--threads N] [--json]`: prompt processing
and generation speed of one model, measured like llama-bench.

pp: one decode of P tokens into an empty cache (n_batch = n_ubatch = P), the median of `reps`
runs after a warm-up. tg: N single-token decodes from an empty cache, each timed, the rate of
the median. The same functions time llama.cpp (bench/bench_llvm.py runs both on one file).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

FLASH_ATTN_DEFAULT = "on"   # llama.cpp's CPU default (auto) resolves to flash attention


@dataclass
class BenchResult:
    """Tokens per second for one model and engine, plus what helps read them."""

    engine: str
    model: str
    threads: int
    pp_tokens: int
    tg_tokens: int
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
                 reps: int = 3, flash_attn: str = FLASH_ATTN_DEFAULT, numerics: str | None = None) -> BenchResult:
    """Time llamir on one GGUF: prompt processing and generation, plus compile and overheads."""
    import llamir
    from llamir.backends import get_backend

    model = llamir.load_model(path)
    options = {"n_threads": threads} if threads else {}
    if numerics is not None:
        options["numerics"] = numerics
    be = get_backend(backend, **options)
    n_threads = getattr(be, "n_threads", threads)
    result = BenchResult(f"llamir-{backend}", Path(path).name, n_threads, n_prompt, n_gen)
    n_ctx = max(n_prompt, n_gen) + 16
    batch = max(n_prompt, 1)
    t0 = time.perf_counter()
    ctx = llamir.Context(model, n_ctx=n_ctx, n_batch=batch, n_ubatch=batch, flash_attn=flash_attn, backend=be)
    clear = _clear(ctx)
    prompt = _tokens(n_prompt, model.hparams.n_vocab)
    if n_prompt:
        first = time.perf_counter()
        _ok(ctx, llamir.Batch.from_tokens(prompt, logits="last"))
        result.extra["first_pp_s"] = time.perf_counter() - first
        result.pp_runs_s = time_pp(lambda t: _ok(ctx, llamir.Batch.from_tokens(t, logits="last")), clear, prompt,
                                   reps)
        result.pp_tps = n_prompt / _median(result.pp_runs_s)
    result.extra["setup_s"] = time.perf_counter() - t0
    if n_gen:
        gen = _tokens(n_gen, model.hparams.n_vocab, seed=1)
        times = time_tg(lambda tok, pos: _ok(ctx, llamir.Batch.from_tokens([tok], pos0=pos)), clear, gen)
        result.tg_token_ms = [t * 1e3 for t in times]
        result.tg_tps = 1.0 / _median(times)
        result.extra["tg_mean_tps"] = n_gen / sum(times)
        result.extra.update(_token_breakdown(ctx, be, gen))
    stats = getattr(be, "compile_stats", None)
    if stats is not None:
        result.extra["compile"] = [{"graph": g, "cache": c, "seconds": s} for g, c, s in stats.history]
    return result


def _clear(ctx) -> Callable[[], None]:
    def clear() -> None:
        ctx.memory.seq_rm(-1, -1, -1)
    return clear


def _ok(ctx, batch) -> None:
    status = ctx.decode(batch)
    if status != 0:
        raise RuntimeError(f"decode failed with status {status}: {ctx.last_error}")


def _token_breakdown(ctx, be, gen: list[int]) -> dict:
    """Where one generated token's time goes: native compute (kernels + barriers, seen from thread
    0), the executable's Python binding, and the context's Python work around it."""
    from llamir.backends.llvm import executable as X

    if not hasattr(be, "compile_stats"):
        return {}
    import llamir

    spent = {"call": 0.0}
    orig = X.CompiledSplit.__call__
    captured = {}

    def call(self, leaf_values, bindings, observe=None):
        t0 = time.perf_counter()
        out = orig(self, leaf_values, bindings, observe)
        spent["call"] += time.perf_counter() - t0
        captured["args"] = (self, leaf_values, bindings)
        return out

    X.CompiledSplit.__call__ = call
    try:
        ctx.memory.seq_rm(-1, -1, -1)
        n = min(len(gen), 32)
        t0 = time.perf_counter()
        for pos in range(n):
            _ok(ctx, llamir.Batch.from_tokens([gen[pos]], pos0=pos))
        total = (time.perf_counter() - t0) / n
    finally:
        X.CompiledSplit.__call__ = orig
    exe, leaves, bindings = captured["args"]
    prof = exe.profile(dict(leaves), dict(bindings), runs=10)
    call = spent["call"] / n
    return {"token_ms": total * 1e3, "executable_call_ms": call * 1e3, "native_ms": prof.total * 1e3,
            "barrier_ms": prof.barriers * 1e3, "python_in_executable_ms": max(0.0, call - prof.total) * 1e3,
            "python_in_context_ms": max(0.0, total - call) * 1e3,
            "kernels_ms": {k: v * 1e3 for k, v in prof.by_kernel().items()}}


def bench_llama_cpp(path: str | Path, threads: int = 2, n_prompt: int = 512, n_gen: int = 128, reps: int = 3,
                    flash_attn: str = FLASH_ATTN_DEFAULT) -> BenchResult:
    """Time llama.cpp (llama-cpp-python) the same way on the same file."""
    from llamir.testing.llama_cpp import LlamaCppOracle

    result = BenchResult("llama.cpp", Path(path).name, threads, n_prompt, n_gen)
    n_ctx = max(n_prompt, n_gen) + 16
    batch = max(n_prompt, 1)
    with LlamaCppOracle(path, n_ctx=n_ctx, n_batch=batch, n_ubatch=batch, n_threads=threads,
                        flash_attn=flash_attn == "on") as o:
        def clear() -> None:
            o._lib.llama_memory_seq_rm(o._mem, -1, -1, -1)

        def decode(tokens, pos0=0, logits="last"):
            status = o.decode(tokens, pos0=pos0, logits=logits)
            if status != 0:
                raise RuntimeError(f"llama.cpp decode failed with status {status}")

        if n_prompt:
            prompt = _tokens(n_prompt, o.n_vocab)
            result.pp_runs_s = time_pp(decode, clear, prompt, reps)
            result.pp_tps = n_prompt / _median(result.pp_runs_s)
        if n_gen:
            gen = _tokens(n_gen, o.n_vocab, seed=1)
            times = time_tg(lambda tok, pos: decode([tok], pos0=pos), clear, gen)
            result.tg_token_ms = [t * 1e3 for t in times]
            result.tg_tps = 1.0 / _median(times)
            result.extra["tg_mean_tps"] = n_gen / sum(times)
    return result


def cmd_bench(args) -> int:
    from llamir.cli import CliError, _model_path

    path = _model_path(args.model)
    if args.backend == "llama.cpp":
        result = bench_llama_cpp(path, threads=args.threads or 2, n_prompt=args.n_prompt, n_gen=args.n_gen,
                                 reps=args.reps, flash_attn=args.flash_attn)
    else:
        try:
            result = bench_llamir(path, backend=args.backend, threads=args.threads, n_prompt=args.n_prompt,
                                  n_gen=args.n_gen, reps=args.reps, flash_attn=args.flash_attn,
                                  numerics=args.numerics)
        except RuntimeError as err:
            raise CliError(str(err)) from None
    if args.json:
        print(json.dumps(result.as_dict()))
        return 0
    print(f"{result.engine}  {result.model}  threads={result.threads}")
    if result.pp_tokens:
        print(f"  pp{result.pp_tokens:<5d} {result.pp_tps:10.1f} tok/s")
    if result.tg_tokens:
        print(f"  tg{result.tg_tokens:<5d} {result.tg_tps:10.1f} tok/s")
    for key in ("token_ms", "native_ms", "python_in_executable_ms", "python_in_context_ms"):
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
    p.add_argument("--backend", default="llvm", help="llvm (default), numpy, ..., or llama.cpp")
    p.add_argument("--threads", type=int, default=0, help="threads (default: all cores)")
    p.add_argument("--reps", type=int, default=3, help="prompt runs to take the median of")
    p.add_argument("--flash-attn", choices=["on", "off"], default=FLASH_ATTN_DEFAULT, dest="flash_attn")
    p.add_argument("--json", action="store_true", help="print one JSON object (pp_tps, tg_tps, ...)")
    add_numerics_option(p)
    p.set_defaults(func=cmd_bench)
