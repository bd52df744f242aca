"""Which samplers of a chain run in the decode graph (llama_sampler_chain_backend_init): the
longest prefix whose samplers have a graph form (llamir.frontend.graph_sampling), each as a spec
that shapes the graph (a top_k's k, a temperature, which uniform a dist draws) and the sampler
object that fills its inputs (dist's draws, logit_bias's biases)."""

from __future__ import annotations

from llamir.frontend.graph_sampling import (
    SampleDist,
    SampleGreedy,
    SampleLogitBias,
    SampleMinP,
    SampleTemp,
    SampleTopK,
    SampleTopP,
)


def _spec(sampler, n_vocab: int, counts: dict[str, int]):
    """The graph spec of one sampler, or None when it has none (llama.cpp: no backend_init)."""
    kind = type(sampler).__name__
    if kind == "Greedy":
        return SampleGreedy()
    if kind == "TopK":
        return SampleTopK(int(sampler.k)) if sampler.k > 0 else None   # k <= 0: a no-op llama.cpp keeps on the CPU
    if kind == "TopP":
        return SampleTopP(float(sampler.p))
    if kind == "MinP":
        return SampleMinP(float(sampler.p))
    if kind == "Temp":
        return SampleTemp(float(sampler.t))
    if kind == "Dist":
        counts["dist"] = counts.get("dist", 0) + 1
        return SampleDist(counts["dist"] - 1)
    if kind == "LogitBias":
        counts["bias"] = counts.get("bias", 0) + 1
        return SampleLogitBias(counts["bias"] - 1, n_vocab)
    return None


def backend_prefix(chain, n_vocab: int) -> list[tuple[object, object]]:
    """[(spec, sampler)] for the chain's samplers up to the first that cannot run in a graph; the
    prefix ends after the first sampler that picks a token (nothing after it sees candidates)."""
    out: list[tuple[object, object]] = []
    counts: dict[str, int] = {}
    for sampler in chain.samplers:
        spec = _spec(sampler, n_vocab, counts)
        if spec is None:
            break
        out.append((spec, sampler))
        if isinstance(spec, (SampleGreedy, SampleDist)):
            break
    return out


__all__ = ["backend_prefix"]
