"""Perplexity the way llama-perplexity computes it (tools/perplexity/perplexity.cpp).

The text is tokenized with BOS (if the vocab adds one) and cut into chunks of n_ctx tokens; each
chunk starts from an empty memory with its first token replaced by BOS, and only the second half
of each chunk is scored. n_batch / n_ctx chunks are decoded together as parallel sequences, so the
context has n_seq * n_ctx cells, like llama-perplexity's n_parallel.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from llamir.context.batch import Batch


@dataclass
class PerplexityResult:
    ppl: float
    stderr: float                      # of the perplexity estimate
    n_chunks: int
    n_tokens: int
    running: list[float] = field(default_factory=list)  # ppl after each chunk


def log_softmax_at(logits: np.ndarray, token: int) -> float:
    """llama-perplexity's log_softmax: max in f32, sum of expf in double."""
    logits = np.asarray(logits, dtype=np.float32)
    max_logit = logits.max()
    sum_exp = np.sum(np.exp((logits - max_logit).astype(np.float32)).astype(np.float32), dtype=np.float64)
    return float(np.float32(logits[token] - max_logit)) - math.log(sum_exp)


def chunk_plan(n_tokens: int, n_ctx: int, n_batch: int, n_chunks: int = -1) -> tuple[int, int]:
    """(number of chunks, chunks decoded together), with llama-perplexity's checks."""
    if n_ctx <= 0:
        raise ValueError("perplexity needs a context size > 0")
    if n_tokens < 2 * n_ctx:
        raise ValueError(f"you need at least {2 * n_ctx} tokens to evaluate perplexity with a context of {n_ctx}; "
                         f"the text tokenizes to only {n_tokens}")
    n_chunk = n_tokens // n_ctx if n_chunks < 0 else min(n_chunks, n_tokens // n_ctx)
    n_seq = max(1, n_batch // n_ctx)
    return n_chunk, n_seq


def perplexity(ctx_factory: Callable[[int, int, int], object], tokens: list[int], bos: int | None, n_ctx: int,
               n_batch: int = 2048, n_chunks: int = -1, on_chunk: Callable[[int, float], None] | None = None
               ) -> PerplexityResult:
    """Run llama-perplexity's loop. ctx_factory(n_ctx_total, n_batch, n_seq) makes the context."""
    n_chunk, n_seq = chunk_plan(len(tokens), n_ctx, n_batch, n_chunks)
    n_batch = min(n_batch, n_seq * n_ctx)
    if not (n_batch < n_ctx or n_batch % n_ctx == 0):
        raise ValueError(f"n_batch {n_batch} must be below n_ctx {n_ctx} or a multiple of it")
    ctx = ctx_factory(n_seq * n_ctx, n_batch, n_seq)
    first = n_ctx // 2
    num_batches = (n_ctx + n_batch - 1) // n_batch
    nll = nll2 = 0.0
    count = 0
    running = []
    for i in range(0, n_chunk, n_seq):
        start = i * n_ctx
        n_seq_batch = min(n_seq, n_chunk - i)
        ctx.memory.clear(True)
        chunk_logits: dict[int, list[np.ndarray]] = {s: [] for s in range(n_seq_batch)}
        for j in range(num_batches):
            batch_start = start + j * n_batch
            batch_size = min(start + n_ctx - batch_start, n_batch)
            toks, pos, ids, flags = [], [], [], []
            for s in range(n_seq_batch):
                seq_start = batch_start + s * n_ctx
                for k in range(batch_size):
                    t = tokens[seq_start + k]
                    if bos is not None and j == 0 and k == 0:
                        t = bos
                    p = j * n_batch + k
                    toks.append(t)
                    pos.append(p)
                    ids.append((s,))
                    flags.append(p >= first)
            status = ctx.decode(Batch(tokens=toks, pos=pos, seq_ids=ids, logits=flags))
            if status != 0:
                raise RuntimeError(f"failed to decode chunk {i} (status {status}): {ctx.last_error}")
            rows = ctx.get_logits()
            row = 0
            for s in range(n_seq_batch):
                n_out = sum(flags[s * batch_size:(s + 1) * batch_size])
                chunk_logits[s].append(rows[row:row + n_out])
                row += n_out
        for s in range(n_seq_batch):
            logits = np.concatenate(chunk_logits[s])
            base = start + s * n_ctx + first
            for t in range(n_ctx - 1 - first):
                lp = log_softmax_at(logits[t], tokens[base + t + 1])
                nll -= lp
                nll2 += lp * lp
            count += n_ctx - 1 - first
            running.append(math.exp(nll / count))
            if on_chunk is not None:
                on_chunk(i + s + 1, running[-1])
    mean = nll / count
    var = nll2 / count - mean * mean
    ppl = math.exp(mean)
    err = math.sqrt(var / (count - 1)) * ppl if var > 0 and count > 1 else float("nan")
    return PerplexityResult(ppl, err, n_chunk, count, running)
