"""llamir's sampler chains against llama.cpp's (libllama's llama_sampler_*), per sampled token, on
the same logits, in one run.

    python bench/bench_sampling.py [--n-vocab 49152] [--steps 200]

Each chain samples `--steps` rows of random logits (the same rows for both engines), accepting
every pick; the table gives the median milliseconds per token and checks that both engines picked
the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from llamir.sampling import Chain, Dist, Greedy, MinP, Penalties, Temp, TopK, TopP, Typical
from llamir.testing.llama_cpp_samplers import LlamaSamplers


def chains(n_vocab: int) -> dict:
    """name -> (llamir samplers, llama.cpp's llama_sampler_init_* calls)."""
    return {
        "greedy": ([Greedy()], [("greedy",)]),
        "top_k40,top_p,min_p,temp,dist": (
            [TopK(40), TopP(0.95, 1), MinP(0.05, 1), Temp(0.8), Dist(1234)],
            [("top_k", 40), ("top_p", 0.95, 1), ("min_p", 0.05, 1), ("temp", 0.8), ("dist", 1234)]),
        "penalties,top_k40,temp,dist": (
            [Penalties(n_vocab, 64, 1.1, 0.1, 0.1), TopK(40), Temp(0.8), Dist(7)],
            [("penalties", n_vocab, 64, 1.1, 0.1, 0.1), ("top_k", 40), ("temp", 0.8), ("dist", 7)]),
        "typical(full vocab),dist": ([Typical(0.9, 1), Dist(3)], [("typical", 0.9, 1), ("dist", 3)]),
    }


def run(n_vocab: int, steps: int) -> list[tuple[str, float, float, bool]]:
    rows = np.random.default_rng(0).standard_normal((steps, n_vocab)).astype(np.float32) * 3
    oracle = LlamaSamplers()
    out = []
    try:
        for name, (samplers, theirs_spec) in chains(n_vocab).items():
            chain = Chain(samplers)
            handle = oracle.chain([oracle.new(*spec) for spec in theirs_spec])
            ours, theirs, t_ours, t_theirs = [], [], [], []
            for row in rows:
                t0 = time.perf_counter()
                ours.append(chain.sample_logits(row))
                t1 = time.perf_counter()
                theirs.append(oracle.sample_logits(handle, row))
                t2 = time.perf_counter()
                t_ours.append(t1 - t0)
                t_theirs.append(t2 - t1)
            out.append((name, 1e3 * statistics.median(t_ours), 1e3 * statistics.median(t_theirs), ours == theirs))
    finally:
        oracle.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-vocab", type=int, default=49152, dest="n_vocab")
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args(argv)
    print(f"n_vocab {args.n_vocab}, {args.steps} tokens per chain (llama.cpp's time includes building its "
          "candidate array from the row through ctypes)")
    print(f"{'chain':<32} {'llamir ms':>10} {'llama.cpp ms':>13} {'same tokens':>12}")
    for name, ours, theirs, same in run(args.n_vocab, args.steps):
        print(f"{name:<32} {ours:10.3f} {theirs:13.3f} {str(same):>12}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
