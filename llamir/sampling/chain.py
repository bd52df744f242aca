"""llama_sampler_chain: samplers applied one after another, with llama_perf_sampler's counters."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from llamir.sampling.basic import Dist
from llamir.sampling.candidates import TokenDataArray
from llamir.sampling.mirostat import Mirostat, MirostatV2
from llamir.sampling.rng import LLAMA_DEFAULT_SEED
from llamir.sampling.sampler import SAMPLER_METHODS, is_sampler


@dataclass(frozen=True)
class PerfSamplerData:
    """llama_perf_sampler_data: time spent in apply/accept (ms) and tokens accepted."""

    t_sample_ms: float
    n_sample: int


def _check_sampler(smpl, where: str):
    if not is_sampler(smpl):
        missing = [m for m in ("name", *SAMPLER_METHODS) if not hasattr(smpl, m)]
        raise TypeError(f"{where}: {smpl!r} is not a sampler (it lacks {', '.join(missing) or 'a str name'})")
    return smpl


class Chain:
    """Samplers applied in order to one TokenDataArray; accept() passes the picked token to each.

    `no_perf` is llama_sampler_chain_params.no_perf (llama.cpp's default, True, skips the timing;
    tokens are counted either way). Any object with name/apply/accept/reset/clone is a sampler."""

    name = "chain"

    def __init__(self, samplers: Iterable = (), no_perf: bool = True):
        if not isinstance(no_perf, bool):
            raise ValueError(f"Chain: no_perf must be a bool, got {no_perf!r}")
        self.no_perf = no_perf
        self.samplers = [_check_sampler(s, f"Chain sampler {i}") for i, s in enumerate(samplers)]
        self.t_sample_us = 0
        self.n_sample = 0
        self.n_backend = 0   # the leading samplers a context runs in its graph (Context.set_sampler)

    # -- the chain's own list (llama_sampler_chain_add / _get / _remove / _n) --------------------
    def add(self, smpl) -> None:
        self.samplers.append(_check_sampler(smpl, "Chain.add"))

    def get(self, i: int):
        return self.samplers[i]

    def remove(self, i: int):
        return self.samplers.pop(i)

    def __len__(self) -> int:
        return len(self.samplers)

    def __iter__(self) -> Iterator:
        return iter(self.samplers)

    def __repr__(self) -> str:
        return "Chain(" + " -> ".join(s.name for s in self.samplers) + ")"

    # -- the sampler interface -----------------------------------------------------------------------
    def apply(self, cur: TokenDataArray, skip: int = 0) -> None:
        """Each sampler in turn; `skip` leading ones already ran (in a graph)."""
        start = time.perf_counter_ns()
        for smpl in self.samplers[skip:]:
            smpl.apply(cur)
        self._timed(start)

    def backend_attach(self, n_backend: int) -> None:
        """A context runs the first n_backend samplers in its decode graph from now on
        (llama_sampler_chain_backend_init marks them is_backend)."""
        self.n_backend = n_backend

    def accept(self, token: int) -> None:
        start = time.perf_counter_ns()
        for smpl in self.samplers:
            smpl.accept(int(token))
        self.n_sample += 1
        self._timed(start)

    def reset(self) -> None:
        for smpl in self.samplers:
            smpl.reset()

    def clone(self) -> Chain:
        """The samplers cloned (same state); the perf counters start from zero, as in llama.cpp."""
        return Chain([s.clone() for s in self.samplers], no_perf=self.no_perf)

    def _timed(self, start_ns: int) -> None:
        if not self.no_perf:
            self.t_sample_us += (time.perf_counter_ns() - start_ns) // 1000

    # -- sampling ------------------------------------------------------------------------------------
    def sample_logits(self, row) -> int:
        """llama_sampler_sample on one row of logits [n_vocab]: every token a candidate, the chain
        applied, the selected token accepted and returned."""
        cur = TokenDataArray.from_logits(row)
        self.apply(cur)
        token = cur.selected_token
        self.accept(token)
        return token

    def sample(self, ctx, idx: int = -1) -> int:
        """llama_sampler_sample from a context's output row `idx` (-1 is the last): a token a
        backend sampler drew is accepted and returned; else the chain continues from what the
        graph left (its probabilities, or its logits, over the candidates it kept), skipping the
        samplers that ran there; else it runs on the row's logits."""
        sampled = getattr(ctx, "get_sampled_token_ith", None)
        if sampled is not None and self.n_backend:
            token = sampled(idx)
            if token != -1:
                self.accept(token)
                return token
            probs, logits = ctx.get_sampled_probs_ith(idx), ctx.get_sampled_logits_ith(idx)
            if probs is not None or logits is not None:
                n = len(probs) if probs is not None else len(logits)
                ids = ctx.get_sampled_candidates_ith(idx)[:n]
                p = probs if probs is not None else np.zeros(n, dtype=np.float32)
                if logits is None:
                    logits = np.zeros(n, dtype=np.float32)
                return self._pick(TokenDataArray(ids, logits[:n], p[:n]), self.n_backend)
        return self._pick(TokenDataArray.from_logits(np.asarray(ctx.get_logits_ith(idx), dtype=np.float32)), 0)

    def _pick(self, cur: TokenDataArray, skip: int) -> int:
        self.apply(cur, skip)
        token = cur.selected_token
        self.accept(token)
        return token

    # -- perf and seed -------------------------------------------------------------------------------
    def perf(self) -> PerfSamplerData:
        return PerfSamplerData(t_sample_ms=1e-3 * self.t_sample_us, n_sample=max(0, self.n_sample))

    def perf_reset(self) -> None:
        self.t_sample_us = 0
        self.n_sample = 0

    def perf_print(self, file=None) -> None:
        import sys

        data = self.perf()
        print(f"llama_perf_sampler_print:    samplers time = {data.t_sample_ms:10.2f} ms / {data.n_sample:5d} runs",
              file=file or sys.stderr)

    @property
    def seed(self) -> int:
        """llama_sampler_get_seed: the seed in use by the last Dist/Mirostat/MirostatV2 that has one."""
        for smpl in reversed(self.samplers):
            seed = smpl.seed if isinstance(smpl, Chain) else _sampler_seed(smpl)
            if seed != LLAMA_DEFAULT_SEED:
                return seed
        return LLAMA_DEFAULT_SEED


def _sampler_seed(smpl) -> int:
    return smpl.seed_cur if isinstance(smpl, Dist | Mirostat | MirostatV2) else LLAMA_DEFAULT_SEED
