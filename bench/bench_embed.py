"""Sentence embeddings with the built-in all-MiniLM-L6-v2: llamir's LLVM backend against llama.cpp on
the same GGUF, in one run.

    python bench/bench_embed.py [--threads 2] [--n-texts 64] [--reps 5]

Both engines embed the same texts in batches of up to --batch-texts sequences (one llama_decode per
batch, mean pooling, every token an output, as llama-embedding batches them) and report the median
texts per second and tokens per second over --reps repetitions, after one warm-up. The cosine
between the two engines' embeddings is printed as a check.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import llamir
from llamir.cli_embed import cosine, embd_normalize
from llamir.frontend.default_model import default_embedding_model_path
from llamir.testing.llama_cpp import LlamaCppOracle

WORDS = ("the quick brown fox jumps over a lazy dog while people walk to work and children run to school "
         "in the morning a baker opens the small shop on the corner of the street").split()


def texts(n: int) -> list[str]:
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(8, 24)))) for _ in range(n)]


def batches(tokens: list[list[int]], n_seq: int) -> list[list[list[int]]]:
    return [tokens[i:i + n_seq] for i in range(0, len(tokens), n_seq)]


def flat(batch: list[list[int]]):
    toks = [t for inp in batch for t in inp]
    pos = [p for inp in batch for p in range(len(inp))]
    seqs = [(s,) for s, inp in enumerate(batch) for _ in inp]
    return toks, pos, seqs


def run_llamir(model, tokens, n_seq: int, threads: int, reps: int) -> tuple[list[float], np.ndarray]:
    ctx = llamir.Context(model, n_ctx=512 * n_seq, n_batch=512 * n_seq, n_ubatch=512 * n_seq, n_seq_max=n_seq,
                         embeddings=True, pooling_type="mean", n_threads=threads)
    out = []

    def once() -> None:
        out.clear()
        for batch in batches(tokens, n_seq):
            toks, pos, seqs = flat(batch)
            assert ctx.decode(llamir.Batch(tokens=toks, pos=pos, seq_ids=seqs, logits=[True] * len(toks))) == 0
            out.extend(embd_normalize(ctx.get_embeddings_seq(s), 2) for s in range(len(batch)))

    return _time(once, reps), np.stack(out)


def run_llama_cpp(path, tokens, n_seq: int, threads: int, reps: int) -> tuple[list[float], np.ndarray]:
    out = []
    with LlamaCppOracle(path, n_ctx=512 * n_seq, n_batch=512 * n_seq, n_seq_max=n_seq, n_threads=threads,
                        embeddings=True, pooling="mean", kv_unified=True) as o:
        def once() -> None:
            out.clear()
            for batch in batches(tokens, n_seq):
                toks, pos, seqs = flat(batch)
                assert o.decode_batch(toks, pos, seqs, [True] * len(toks)) == 0
                out.extend(embd_normalize(o.embeddings_seq(s), 2) for s in range(len(batch)))

        return _time(once, reps), np.stack(out)


def _time(fn, reps: int) -> list[float]:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-texts", type=int, default=64, dest="n_texts")
    p.add_argument("--batch-texts", type=int, default=8, dest="batch_texts")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    path = default_embedding_model_path(progress=True)
    model = llamir.load_model(path)
    tokens = [model.vocab.tokenize(t.encode(), add_special=True, parse_special=True) for t in texts(args.n_texts)]
    n_tokens = sum(map(len, tokens))
    ours, a = run_llamir(model, tokens, args.batch_texts, args.threads, args.reps)
    theirs, b = run_llama_cpp(path, tokens, args.batch_texts, args.threads, args.reps)
    worst = min(cosine(x, y) for x, y in zip(a, b, strict=True))
    print(f"all-MiniLM-L6-v2 f32, {args.n_texts} texts ({n_tokens} tokens), {args.batch_texts} per batch, "
          f"{args.threads} threads; worst cosine llamir/llama.cpp {worst:.7f}")
    print(f"{'engine':<10} {'texts/s':>9} {'tokens/s':>9}")
    for name, times in (("llamir", ours), ("llama.cpp", theirs)):
        t = statistics.median(times)
        print(f"{name:<10} {args.n_texts / t:9.1f} {n_tokens / t:9.1f}")
    print(f"ratio      {statistics.median(theirs) / statistics.median(ours):9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
