"""Backend sampling: a sequence's sampler chain lowered into the decode graph after the logits, as
llama.cpp's llm_graph_context::build_sampling and the samplers' backend_apply build it.

The context attaches a chain to a sequence (Context.set_sampler); the chain's longest prefix of
samplers that can run in a graph becomes a tuple of specs (below) in GraphConfig.samplers, so a
graph is rebuilt only when the attached chains' shapes change. Per attached sequence the graph
reads one logits row (`smpl{s}_row`, the sequence's output row in the ubatch; a sequence without
an output in the ubatch reads the padding row, and its results are dropped, as llama.cpp's
inactive samplers work on a dummy row) and produces, as graph outputs:

    smpl{s}_token       i32 [1]    the sampled token, when the chain samples one (greedy, dist)
    smpl{s}_probs       f32 [1, m] the probabilities dist drew from
    smpl{s}_logits      f32 [1, m] the logits after the prefix
    smpl{s}_candidates  i32 [m]    the vocabulary ids of those m entries (absent: all of them)

Each spec's `lower` is the sampler's backend_apply, op for op: top_k through top_k and get_rows;
top_p through argsort, softmax, cumsum and a step mask made inclusive; min_p through argmax and a
step mask; temp as a scale (argmax for t <= 0); dist through softmax, cumsum, one uniform input
(`smpl{s}_u{k}`, drawn by the context from the sampler's RNG for every graph run) and the count
of the cumulative probabilities past it; greedy through argmax; logit_bias as a dense bias input
over the vocabulary (`smpl{s}_bias{k}`), gathered through the candidates when some sampler
before it narrowed them (where llama.cpp's set_rows would index past the narrowed row).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from llamir.frontend.built import InputSpec
from llamir.ir import F32, I32, GraphBuilder, Node, dims


@dataclass
class SamplingData:
    """llama_sampler_data for one row: logits [1, m], then what the samplers add."""

    logits: Node
    probs: Node | None = None
    sampled: Node | None = None
    candidates: Node | None = None     # i32 [m]: vocabulary ids of the logits' entries

    @property
    def width(self) -> int:
        return int(self.logits.shape[-1])


@dataclass
class Lowering:
    """What a spec's lower() builds with: the builder, the sequence, and input registration."""

    b: GraphBuilder
    seq: int
    inputs: list[str] = field(default_factory=list)

    def input(self, suffix: str, shape, dtype) -> Node:
        name = f"smpl{self.seq}_{suffix}"
        self.inputs.append(name)
        return self.b.input(name, shape, dtype)


def _rows(b: GraphBuilder, x: Node) -> Node:
    """[1, m] (or [m]) as m rows of one value, for get_rows / set_rows by index."""
    return b.reshape(x, int(dims.prod(x.shape)), 1)


def _gather(b: GraphBuilder, x: Node, idx: Node, dtype_i32: bool = False) -> Node:
    """x's entries at idx (i32 [k]): [1, k] (i32 [k] for candidates)."""
    out = b.get_rows(_rows(b, x), idx)                                              # [k, 1]
    k = idx.shape[-1]
    return b.reshape(out, k) if dtype_i32 else b.reshape(out, 1, k)


def _candidates_at(lw: Lowering, data: SamplingData, idx: Node) -> Node:
    """The vocabulary ids at positions idx: through the candidates, or idx itself."""
    if data.candidates is None:
        return lw.b.reshape(idx, idx.shape[-1])
    return _gather(lw.b, data.candidates, idx, dtype_i32=True)


@dataclass(frozen=True)
class SampleGreedy:
    """llama_sampler_greedy: the argmax (mapped back to a vocabulary id through the candidates)."""

    def lower(self, lw: Lowering, data: SamplingData) -> None:
        idx = lw.b.argmax(data.logits)                                                # i32 [1]
        data.sampled = _candidates_at(lw, data, idx)


@dataclass(frozen=True)
class SampleTopK:
    k: int

    def lower(self, lw: Lowering, data: SamplingData) -> None:
        b = lw.b
        k = min(self.k, data.width)
        top = b.top_k(data.logits, k)                                                 # i32 [1, k]
        idx = b.reshape(top, k)
        data.candidates = _candidates_at(lw, data, idx)
        data.logits = _gather(b, data.logits, idx)


@dataclass(frozen=True)
class SampleTopP:
    p: float

    def lower(self, lw: Lowering, data: SamplingData) -> None:
        b, n = lw.b, data.width
        order = b.reshape(b.argsort(data.logits, descending=True), n)                # i32 [n]
        logits = _gather(b, data.logits, order)                                       # sorted, [1, n]
        probs = b.soft_max_ext(logits, None, 1.0)
        data.candidates = _candidates_at(lw, data, order)
        cdf = b.cumsum(probs)
        mask = b.unary("step", b.scale(cdf, -1.0, self.p))                           # 1 where cdf < p
        if n > 1:   # inclusive: the first entry reaching p stays (ggml's set_rows of a one at sum(mask))
            head = b.scale(b.view(mask, [1, 1], [4 * n, 4], 0), 0.0, 1.0)             # a one
            mask = b.concat(head, b.view(mask, [1, n - 1], [4 * n, 4], 0), axis=1)
        else:
            mask = b.scale(mask, 0.0, 1.0)
        data.logits = b.add(logits, b.unary("log", mask))


@dataclass(frozen=True)
class SampleMinP:
    p: float

    def lower(self, lw: Lowering, data: SamplingData) -> None:
        b = lw.b
        top = _gather(b, data.logits, b.argmax(data.logits))                        # [1, 1]
        threshold = b.scale(top, 1.0, float(np.log(np.float32(self.p))))              # max + logf(p)
        mask = b.unary("step", b.sub(data.logits, threshold))
        data.logits = b.add(data.logits, b.unary("log", mask))


@dataclass(frozen=True)
class SampleTemp:
    t: float

    def lower(self, lw: Lowering, data: SamplingData) -> None:
        b = lw.b
        if self.t <= 0.0:
            idx = b.argmax(data.logits)
            data.candidates = _candidates_at(lw, data, idx)
            data.logits = _gather(b, data.logits, idx)
            return
        data.logits = b.scale(data.logits, float(np.float32(1.0) / np.float32(self.t)))


@dataclass(frozen=True)
class SampleDist:
    """dist: the first entry whose cumulative probability passes a uniform draw u in [0, 1)."""

    index: int   # which uniform input of the sequence (a chain may hold several dist samplers)

    def lower(self, lw: Lowering, data: SamplingData) -> None:
        b, n = lw.b, data.width
        u = lw.input(f"u{self.index}", [1, 1], F32)
        probs = b.soft_max_ext(data.logits, None, 1.0)                                # [1, n]
        past = b.unary("step", b.sub(b.cumsum(probs), u))                            # 1 from the pick on
        count = b.clamp(b.sum_rows(past), 1.0, float(n))                              # [1, 1]
        idx = b.reshape(b.cast(b.scale(count, -1.0, float(n)), I32), 1)              # n - count
        data.sampled = _candidates_at(lw, data, idx)
        data.probs = probs


@dataclass(frozen=True)
class SampleLogitBias:
    index: int
    n_vocab: int

    def lower(self, lw: Lowering, data: SamplingData) -> None:
        b = lw.b
        bias = lw.input(f"bias{self.index}", [1, self.n_vocab], F32)                  # dense over the vocab
        if data.candidates is not None:
            bias = _gather(b, bias, data.candidates)
        data.logits = b.add(data.logits, bias)


SAMPLER_SPECS = (SampleGreedy, SampleTopK, SampleTopP, SampleMinP, SampleTemp, SampleDist, SampleLogitBias)


def build_sampling(g, logits: Node) -> None:
    """Append each attached sequence's sampler prefix (g.config.samplers) after the logits
    [n_out, n_vocab]; declare the "sampling" input and the outputs."""
    b = g.b
    n_vocab = int(logits.shape[-1])
    pad = b.input("smpl_pad", [1, n_vocab], F32)                                      # a zero row
    padded = b.concat(logits, pad, axis=0)                                            # [n_out+1, V]
    leaves = ["smpl_pad"]
    for seq, specs in g.config.samplers:
        lw = Lowering(b, seq)
        row = lw.input("row", [1], I32)
        data = SamplingData(b.get_rows(padded, row))                                  # [1, V]
        for spec in specs:
            spec.lower(lw, data)
        b.output(f"smpl{seq}_logits", data.logits)
        if data.probs is not None:
            b.output(f"smpl{seq}_probs", data.probs)
        if data.sampled is not None:
            b.output(f"smpl{seq}_token", data.sampled)
        if data.candidates is not None:
            b.output(f"smpl{seq}_candidates", data.candidates)
        leaves += lw.inputs
    g._declare(InputSpec("sampling", tuple(leaves), {"seqs": tuple(s for s, _ in g.config.samplers)}))


__all__ = ["SAMPLER_SPECS", "SampleDist", "SampleGreedy", "SampleLogitBias", "SampleMinP", "SampleTemp",
           "SampleTopK", "SampleTopP", "SamplingData", "build_sampling"]
