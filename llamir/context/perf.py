"""Perf counters (llama_perf_context): load, prompt-eval and eval times and counts, graph reuses."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field


@dataclass
class Perf:
    """A decode of exactly one token counts as eval, a larger one as prompt eval."""

    enabled: bool = True
    t_load_ms: float = 0.0
    t_start: float = field(default_factory=time.perf_counter)
    t_p_eval_ms: float = 0.0
    t_eval_ms: float = 0.0
    n_p_eval: int = 0
    n_eval: int = 0
    n_reused: int = 0
    _t0: float | None = None
    _n_queued: int = 0

    def start(self, n_tokens: int) -> None:
        if self.enabled:
            self._t0, self._n_queued = time.perf_counter(), n_tokens

    def stop(self) -> None:
        if self._t0 is None:
            return
        elapsed = (time.perf_counter() - self._t0) * 1e3
        if self._n_queued == 1:
            self.t_eval_ms += elapsed
            self.n_eval += 1
        else:
            self.t_p_eval_ms += elapsed
            self.n_p_eval += self._n_queued
        self._t0 = None

    def data(self) -> dict[str, float]:
        return {"t_start_ms": self.t_start * 1e3, "t_load_ms": self.t_load_ms, "t_p_eval_ms": self.t_p_eval_ms,
                "t_eval_ms": self.t_eval_ms, "n_p_eval": max(1, self.n_p_eval), "n_eval": max(1, self.n_eval),
                "n_reused": self.n_reused}

    def reset(self) -> None:
        self.t_p_eval_ms = self.t_eval_ms = 0.0
        self.n_p_eval = self.n_eval = self.n_reused = 0

    def print(self, file=None) -> None:
        """llama_perf_context_print's lines."""
        out = file or sys.stderr
        d = self.data()
        t_end = time.perf_counter() * 1e3
        p_ms, e_ms = d["t_p_eval_ms"], d["t_eval_ms"]
        n_p, n_e = int(d["n_p_eval"]), int(d["n_eval"])
        print(f"llamir_perf_context_print:        load time = {d['t_load_ms']:10.2f} ms", file=out)
        print(f"llamir_perf_context_print: prompt eval time = {p_ms:10.2f} ms / {n_p:5d} tokens "
              f"({p_ms / n_p:8.2f} ms per token, {1e3 * n_p / p_ms if p_ms else 0:8.2f} tokens per second)",
              file=out)
        print(f"llamir_perf_context_print:        eval time = {e_ms:10.2f} ms / {n_e:5d} runs   "
              f"({e_ms / n_e:8.2f} ms per token, {1e3 * n_e / e_ms if e_ms else 0:8.2f} tokens per second)",
              file=out)
        print(f"llamir_perf_context_print:       total time = {t_end - d['t_start_ms']:10.2f} ms / "
              f"{n_p + n_e:5d} tokens", file=out)
        print(f"llamir_perf_context_print:    graphs reused = {d['n_reused']:10d}", file=out)
