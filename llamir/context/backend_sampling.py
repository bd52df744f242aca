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

NO_OP = object()   # a sampler that runs in the graph as nothing (its parameters switch it off)
GRAPH_SAMPLERS = ("Greedy", "Dist", "TopK", "TopP", "MinP", "Temp", "LogitBias")


def _spec(sampler, n_vocab: int, counts: dict[str, int]):
    """The graph spec of one sampler, NO_OP when it changes nothing (the CPU sampler's `empty`:
    top_k with k <= 0, top_p with p >= 1, min_p with p <= 0, temp 1, no biases), or None when it
    has no graph form (llama.cpp: no backend_init)."""
    kind = type(sampler).__name__
    if kind not in GRAPH_SAMPLERS:
        return None
    if getattr(sampler, "empty", False):
        return NO_OP
    if kind == "Greedy":
        return SampleGreedy()
    if kind == "TopK":
        return SampleTopK(int(sampler.k))
    if kind == "TopP":
        return SampleTopP(float(sampler.p))
    if kind == "MinP":
        return SampleMinP(float(sampler.p))
    if kind == "Temp":
        return SampleTemp(float(sampler.t))
    if kind == "Dist":
        counts["dist"] = counts.get("dist", 0) + 1
        return SampleDist(counts["dist"] - 1)
    counts["bias"] = counts.get("bias", 0) + 1
    return SampleLogitBias(counts["bias"] - 1, n_vocab)


def backend_prefix(chain, n_vocab: int) -> list[tuple[object, object]]:
    """[(spec, sampler)] for the chain's samplers up to the first that cannot run in a graph (a
    NO_OP spec builds nothing but counts); the prefix ends after the first sampler that picks a
    token."""
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


def graph_specs(prefix) -> tuple:
    """The specs that build something, for GraphConfig.samplers."""
    return tuple(spec for spec, _ in prefix if spec is not NO_OP)


__all__ = ["GRAPH_SAMPLERS", "NO_OP", "backend_prefix", "graph_specs"]
