"""Graph inputs that fill themselves from a ubatch (llm_graph_input_*), and the graph result
that ties a compiled graph to them (llm_graph_result) with llama.cpp's reuse test."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import numpy as np

from llamir.context.batch import UBatch
from llamir.context.kv_cache import KVCacheContext, is_masked_swa
from llamir.frontend.built import InputSpec
from llamir.frontend.graph_rs import RS_INPUTS


class GraphParams(NamedTuple):
    """The subset of llm_graph_params that decides whether a graph can be reused (a tuple: one is
    made per ubatch)."""

    equal_seqs: bool
    n_tokens: int
    n_seq_tokens: int
    n_seqs: int
    n_seqs_unq: int
    has_tokens: bool
    seq_id_unq: tuple[int, ...]
    embeddings: bool
    causal_attn: bool
    n_outputs: int
    gtype: str = "decoder"

    @classmethod
    def of(cls, ubatch: UBatch, n_outputs: int, embeddings: bool, causal: bool, gtype: str = "decoder"):
        return cls(ubatch.equal_seqs, ubatch.n_tokens, ubatch.n_seq_tokens, ubatch.n_seqs, ubatch.n_seqs_unq,
                   ubatch.tokens is not None, tuple(ubatch.seq_id_unq), embeddings, causal, n_outputs, gtype)

    def allow_reuse(self, other: GraphParams) -> bool:
        """llm_graph_params::allow_reuse."""
        same_seqs = not self.equal_seqs or self.seq_id_unq == other.seq_id_unq
        return (self.equal_seqs == other.equal_seqs and self.n_tokens == other.n_tokens
                and self.n_seq_tokens == other.n_seq_tokens and self.n_seqs == other.n_seqs
                and self.n_seqs_unq == other.n_seqs_unq and self.has_tokens == other.has_tokens and same_seqs
                and self.embeddings == other.embeddings and self.causal_attn == other.causal_attn
                and self.n_outputs == other.n_outputs and self.gtype == other.gtype)


def put_input(values: dict[str, np.ndarray], name: str, data: np.ndarray, dtype) -> None:
    """values[name] = data as `dtype`, written into the array already there when the shape and
    dtype match: a reused graph then finds its inputs where it bound them (ggml_backend_tensor_set
    into the same tensor), and no array is allocated per token."""
    cur = values.get(name)
    if cur is not None and cur.shape == data.shape and cur.dtype == dtype:
        np.copyto(cur, data, casting="unsafe")
    else:
        values[name] = np.array(data, dtype=dtype)


_I32, _I64, _F32 = np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.float32)
_IOTA = np.arange(0, dtype=np.int32)


def _iota(n: int) -> np.ndarray:
    """0..n-1 as a read-only int32 view of one array kept across calls."""
    global _IOTA
    if len(_IOTA) < n:
        _IOTA = np.arange(max(n, 2 * len(_IOTA)), dtype=np.int32)
        _IOTA.flags.writeable = False
    return _IOTA[:n]


class GraphInput(ABC):
    """One input object: the leaves it owns, how to fill them, and whether a graph may be reused."""

    leaf_names: tuple[str, ...] = ()

    @abstractmethod
    def set_input(self, ubatch: UBatch, values: dict[str, np.ndarray]) -> None:
        """Fill this input's leaves in `values` from the ubatch."""

    def can_reuse(self, params: GraphParams) -> bool:
        return False


@dataclass
class InputEmbd(GraphInput):
    """inp_tokens i32 [T] or inp_embd f32 [T, n_embd]."""

    has_tokens: bool
    n_tokens: int = 0

    @property
    def leaf_names(self):
        return ("inp_tokens",) if self.has_tokens else ("inp_embd",)

    def set_input(self, ubatch, values):
        self.n_tokens = ubatch.n_tokens
        if self.has_tokens:
            put_input(values, "inp_tokens", ubatch.tokens, _I32)
        else:
            put_input(values, "inp_embd", ubatch.embd, _F32)

    def can_reuse(self, params):
        return params.has_tokens == self.has_tokens and params.n_tokens == self.n_tokens


@dataclass
class InputPos(GraphInput):
    """inp_pos i32 [T]."""

    leaf_names = ("inp_pos",)
    n_tokens: int = 0

    def set_input(self, ubatch, values):
        self.n_tokens = len(ubatch.pos)
        put_input(values, "inp_pos", ubatch.pos, _I32)

    def can_reuse(self, params):
        return params.n_tokens == self.n_tokens


@dataclass
class InputOutIds(GraphInput):
    """inp_out_ids i32 [n_out]: the ubatch rows that produce outputs."""

    leaf_names = ("inp_out_ids",)
    n_outputs: int = 0

    def set_input(self, ubatch, values):
        ids = _iota(ubatch.n_tokens) if self.n_outputs == ubatch.n_tokens else np.flatnonzero(ubatch.output)
        if len(ids) != self.n_outputs:
            raise ValueError(f"{len(ids)} output rows but the graph expects {self.n_outputs}")
        put_input(values, "inp_out_ids", ids, _I32)

    def can_reuse(self, params):
        return params.n_outputs == self.n_outputs


@dataclass
class InputAttnKV(GraphInput):
    """attn_inp_k_idxs, attn_inp_v_idxs and attn_inp_kq_mask (+ suffix) from one cache's context."""

    mctx: KVCacheContext
    n_embd_v_gqa: int
    causal: bool
    mask_dtype: np.dtype
    alibi: bool = False
    suffix: str = ""
    n_tokens: int = 0
    n_kv: int = 0

    @cached_property
    def leaf_names(self):
        return tuple(n + self.suffix for n in ("attn_inp_k_idxs", "attn_inp_v_idxs", "attn_inp_kq_mask"))

    def set_input(self, ubatch, values):
        mctx = self.mctx
        cache, sinfo = mctx.cache, mctx.slot()
        self.n_tokens, self.n_kv = len(ubatch.pos), mctx.n_kv
        k_name, v_name, mask_name = self.leaf_names
        k_idxs = cache.k_idxs(ubatch, sinfo)
        put_input(values, k_name, k_idxs, _I64)
        put_input(values, v_name, k_idxs if not cache.layout.v_trans else
                  cache.v_idxs(ubatch, sinfo, self.n_embd_v_gqa), _I64)
        values[mask_name] = cache.kq_mask(ubatch, sinfo, self.n_kv, self.causal, self.alibi, self.mask_dtype,
                                          out=values.get(mask_name))

    def rebind(self, mctx) -> None:
        self.rebind_to(mctx.contexts())

    def rebind_to(self, contexts: list) -> None:
        """Fill from the matching one of a new batch's per-cache contexts."""
        self.mctx = contexts[1] if self.suffix and len(contexts) > 1 else contexts[0]

    def can_reuse(self, params):
        # mask ne[0] == n_kv and ne[1] == n_tokens, as llama.cpp checks (fails with several streams)
        n_streams = self.mctx.slot().n_stream if self.mctx.slots else 1
        return (params.n_tokens == self.n_tokens and self.mctx.n_kv == self.n_kv
                and self.n_tokens // n_streams == params.n_tokens)


@dataclass
class InputAttnNoCache(GraphInput):
    """attn_inp_kq_mask [1, 1, T, T] (+ "_swa") over the ubatch itself: same first sequence,
    causal if asked, the sliding window if any (llm_graph_input_attn_no_cache)."""

    causal: bool
    mask_dtype: np.dtype
    alibi: bool = False
    n_swa: int = 0
    swa_type: str = "none"
    suffix: str = ""

    @property
    def leaf_names(self):
        return ("attn_inp_kq_mask" + self.suffix,)

    def set_input(self, ubatch, values):
        seq = np.array([ids[0] for ids in ubatch.seq_ids])
        p = ubatch.pos.astype(np.int64)
        p0, p1 = p[None, :], p[:, None]
        allowed = seq[None, :] == seq[:, None]
        if self.causal:
            allowed &= p0 <= p1
        if self.swa_type != "none":
            allowed &= ~is_masked_swa(self.n_swa, self.swa_type, p0, p1)
        fill = -np.abs(p0 - p1).astype(np.float32) if self.alibi else np.float32(0)
        mask = np.where(allowed, fill, -np.inf).astype(np.float32)
        values[self.leaf_names[0]] = mask[None, None].astype(self.mask_dtype)


@dataclass
class InputMean(GraphInput):
    """inp_mean [n_seqs, T]: 1/len(seq) at the rows of each sequence's tokens (mean pooling)."""

    leaf_names = ("inp_mean",)

    def set_input(self, ubatch, values):
        n, step = ubatch.n_tokens, ubatch.n_seq_tokens
        sums = np.zeros(ubatch.n_seqs_unq, dtype=np.int64)
        for i in range(0, n, step):
            for seq_id in ubatch.seq_ids[i]:
                sums[ubatch.seq_idx(seq_id)] += step
        div = np.where(sums > 0, 1.0 / np.maximum(sums, 1), 0).astype(np.float32)
        data = np.zeros((ubatch.n_seqs_unq, n), dtype=np.float32)
        for i in range(0, n, step):
            for seq_id in ubatch.seq_ids[i]:
                s = ubatch.seq_idx(seq_id)
                data[s, i:i + step] = div[s]
        values["inp_mean"] = data


@dataclass
class InputCls(GraphInput):
    """inp_cls i32 [n_seqs]: per sequence, the row of its first (cls) or last token."""

    last: bool
    leaf_names = ("inp_cls",)

    def set_input(self, ubatch, values):
        target_pos = [-1] * ubatch.n_seqs_unq
        target_row = [0] * ubatch.n_seqs_unq
        for i, ids in enumerate(ubatch.seq_ids):
            pos = int(ubatch.pos[i])
            for seq_id in ids:
                s = ubatch.seq_idx(seq_id)
                if target_pos[s] == -1 or (self.last and pos >= target_pos[s]) or \
                        (not self.last and pos < target_pos[s]):
                    target_pos[s], target_row[s] = pos, i
        values["inp_cls"] = np.asarray(target_row, dtype=np.int32)


@dataclass
class InputRS(GraphInput):
    """rs_s_copy i32 [n_rs] (the row each cell's state is in), rs_keep f32 [n_rs, 1] (0 for a cell
    starting from the zero state) and rs_dst i32 [n_rs] (the cells' own rows, head + i) from the
    recurrent memory's context (llm_graph_input_rs)."""

    mctx: object
    leaf_names = RS_INPUTS

    def set_input(self, ubatch, values):
        mctx = self.mctx
        s_copy = mctx.s_copy()
        put_input(values, "rs_s_copy", s_copy, _I32)
        put_input(values, "rs_keep", (s_copy != mctx.rs_z).astype(np.float32)[:, None], _F32)
        put_input(values, "rs_dst", mctx.head + _iota(mctx.n_rs), _I32)

    def rebind(self, mctx) -> None:
        self.mctx = mctx.recurrent

    def can_reuse(self, params):
        return True   # the cell range is an input and a bound dim, not part of the graph


def _rs(spec, env) -> GraphInput:
    recurrent = getattr(env.mctx, "recurrent", None)
    if recurrent is None:
        raise ValueError("the graph reads recurrent state, but the context's memory keeps none")
    return InputRS(recurrent)


# llama_relative_position_bucket's max_distance: distances from here on share the last bucket
REL_POS_MAX_DISTANCE = 128


def relative_position_bucket(rel: np.ndarray, n_buckets: int, bidirectional: bool) -> np.ndarray:
    """llama_relative_position_bucket of rel = key position - query position (t5): bidirectional,
    half the buckets for keys after the query; causal, keys after it share bucket 0. Distances
    below max_exact = n/2 (n the buckets of one side) are their own bucket, longer ones go on a log
    scale up to max_distance:
        max_exact + floor(log(dist / max_exact) * (n - max_exact) / log(max_distance / max_exact)),
    capped at n - 1, in llama.cpp's arithmetic (logf of the f32 ratio, the product in f32, the
    division by the f64 log, the sum rounded to f32 before the floor)."""
    rel = np.asarray(rel, dtype=np.int64)
    n = n_buckets >> 1 if bidirectional else n_buckets
    max_exact = n >> 1
    if bidirectional:
        bucket, dist = np.where(rel > 0, n, 0), np.abs(rel)
    else:
        bucket, dist = np.zeros_like(rel), np.maximum(-rel, 0)
    far = np.maximum(dist, max_exact)   # the log branch, taken only where dist >= max_exact
    ratio = (far / max_exact).astype(np.float32)
    scaled = np.log(ratio) * np.float32(n - max_exact)                                 # f32
    total = (max_exact + scaled.astype(np.float64) / math.log(REL_POS_MAX_DISTANCE / max_exact)).astype(np.float32)
    large = np.minimum(np.floor(total).astype(np.int64), n - 1)
    return (bucket + np.where(dist < max_exact, dist, large)).astype(np.int32)


@dataclass
class InputPosBucket(GraphInput):
    """pos_bucket_enc i32 [T, T]: the bidirectional bucket of key i for query j over the ubatch
    (llm_graph_input_pos_bucket)."""

    n_buckets: int
    leaf_names = ("pos_bucket_enc",)

    def set_input(self, ubatch, values):
        pos = ubatch.pos.astype(np.int64)
        values["pos_bucket_enc"] = relative_position_bucket(pos[None, :] - pos[:, None], self.n_buckets, True)


@dataclass
class InputPosBucketKV(GraphInput):
    """pos_bucket_dec i32 [T, n_kv]: the causal bucket of cell j for token i, an empty cell at
    position -1 (masked anyway) (llm_graph_input_pos_bucket_kv, stream 0's cells)."""

    mctx: KVCacheContext
    n_buckets: int
    leaf_names = ("pos_bucket_dec",)

    def set_input(self, ubatch, values):
        cells_pos = self.mctx.cache.v_cells[0].pos[:self.mctx.n_kv].astype(np.int64)   # -1 when empty
        rel = cells_pos[None, :] - ubatch.pos.astype(np.int64)[:, None]
        values["pos_bucket_dec"] = relative_position_bucket(rel, self.n_buckets, False)


@dataclass(frozen=True)
class CrossState:
    """llama_cross: what encode() of an encoder-decoder keeps for the decoder's cross-attention,
    the encoder output and each encoder token's sequences."""

    embd: np.ndarray                          # [n_enc, n_embd] f32
    seq_ids: tuple[frozenset[int], ...]       # per encoder token

    @classmethod
    def of(cls, embd: np.ndarray, seq_ids: Sequence[Sequence[int]]) -> CrossState:
        embd = np.array(embd, dtype=np.float32)
        embd.flags.writeable = False
        return cls(embd, tuple(frozenset(int(s) for s in ids) for ids in seq_ids))

    @property
    def n_enc(self) -> int:
        return self.embd.shape[0]

    def allowed(self, seq_ids: Sequence[int]) -> np.ndarray:
        """[n_enc] bool: the encoder tokens a token of `seq_ids` may attend (a sequence in common)."""
        ids = set(seq_ids)
        return np.fromiter((not ids.isdisjoint(enc) for enc in self.seq_ids), dtype=bool, count=self.n_enc)


@dataclass
class InputCrossEmbd(GraphInput):
    """cross_embd f32 [n_enc, n_embd]: the stored encoder output (llm_graph_input_cross_embd)."""

    cross: CrossState
    leaf_names = ("cross_embd",)

    def set_input(self, ubatch, values):
        put_input(values, "cross_embd", self.cross.embd, _F32)


@dataclass
class InputAttnCross(GraphInput):
    """cross_kq_mask [1, 1, T, n_enc]: 0 where the token shares a sequence with the encoder token,
    -inf elsewhere (llm_graph_input_attn_cross)."""

    cross: CrossState
    mask_dtype: np.dtype
    leaf_names = ("cross_kq_mask",)

    def set_input(self, ubatch, values):
        allowed = np.stack([self.cross.allowed(ids) for ids in ubatch.seq_ids])          # [T, n_enc]
        mask = np.where(allowed, np.float32(0), np.float32(-np.inf))
        values["cross_kq_mask"] = mask[None, None].astype(self.mask_dtype)


@dataclass(frozen=True)
class InputEnv:
    """What an input object is made from besides its spec: the context's settings, the ubatch's
    graph params, the memory context of this ubatch (None without memory) and the encoder output
    the last encode() kept (None before one, or for a model without an encoder)."""

    hp: object
    cparams: object
    params: GraphParams
    mctx: object
    causal: bool
    cross: CrossState | None = None
    samplers: dict | None = None    # seq_id -> [(graph_sampling spec, sampler)]: the backend samplers

    @property
    def mask_dtype(self) -> np.dtype:
        return np.dtype(np.float16 if self.cparams.flash_attn else np.float32)

    @property
    def alibi(self) -> bool:
        return self.hp.f_max_alibi_bias > 0


def _attn_kv(spec, env: InputEnv) -> GraphInput:
    suffix = spec.param("suffix", "")
    if env.mctx is None:
        raise ValueError(f"the graph reads the KV cache{' ' + suffix if suffix else ''}, but the context has no memory")
    for sub in env.mctx.contexts():
        if sub.cache.layout.suffix == suffix:
            layers = sub.cache.layout.layers   # (a hybrid model's first layers may have no attention)
            n_embd_v_gqa = env.hp.n_embd_v_gqa(layers[0] if layers else 0)
            return InputAttnKV(sub, n_embd_v_gqa, env.causal, env.mask_dtype, env.alibi, suffix)
    raise ValueError(f"the graph reads a KV cache with suffix {suffix!r} that the memory does not have")


def _attn_no_cache(spec, env: InputEnv) -> GraphInput:
    swa = bool(spec.param("suffix", ""))
    return InputAttnNoCache(env.causal, env.mask_dtype, env.alibi, env.hp.n_swa if swa else 0,
                            env.hp.swa_type if swa else "none", spec.param("suffix", ""))


def _pos_bucket_kv(spec, env: InputEnv) -> GraphInput:
    if env.mctx is None:
        raise ValueError("the graph reads the KV cells' positions (pos_bucket_dec), but the context has no memory")
    return InputPosBucketKV(env.mctx.contexts()[0], int(spec.param("n_buckets")))


def _cross(make: Callable[[CrossState, InputEnv], GraphInput]) -> Callable[[InputSpec, InputEnv], GraphInput]:
    """A filler of an input that reads the encoder output: refused before any encode."""
    def fill(spec, env: InputEnv) -> GraphInput:
        if env.cross is None:
            raise ValueError(f"the graph reads the encoder output ({', '.join(spec.leaves)}): call encode() "
                             "before decode()")
        return make(env.cross, env)
    return fill


def _cls(spec, env: InputEnv) -> GraphInput:
    pooling = env.cparams.pooling_type
    return InputCls(last=pooling == "last" or (pooling == "rank" and env.causal))


@dataclass
class InputSampling(GraphInput):
    """llm_graph_input_sampling: per sequence with a backend sampler, the logits row it samples
    (its output in the ubatch; the zero padding row when it has none), one uniform draw per dist
    sampler from that sampler's RNG (llama_sampler_dist's backend_set_input, every graph run),
    and each logit_bias sampler's biases as a dense row over the vocabulary."""

    samplers: dict
    leaf_names: tuple[str, ...] = ()
    n_vocab: int = 0

    def set_input(self, ubatch, values):
        from llamir.frontend.graph_sampling import SampleDist, SampleLogitBias

        if "smpl_pad" not in values:
            values["smpl_pad"] = np.zeros((1, self.n_vocab), dtype=np.float32)
        rows: dict[int, int] = {}
        n_rows = 0
        for i in np.flatnonzero(ubatch.output):
            rows.setdefault(ubatch.seq_ids[i][0], n_rows)
            n_rows += 1
        for seq, entries in self.samplers.items():
            put_input(values, f"smpl{seq}_row", np.array([rows.get(seq, n_rows)]), _I32)
            for spec, sampler in entries:
                if isinstance(spec, SampleDist):
                    put_input(values, f"smpl{seq}_u{spec.index}", np.array([[sampler.backend_uniform()]]), _F32)
                elif isinstance(spec, SampleLogitBias):
                    dense = np.zeros((1, self.n_vocab), dtype=np.float32)
                    for token, bias in sampler.biases:   # set_rows: a repeated token's last bias stands
                        dense[0, token] = bias
                    put_input(values, f"smpl{seq}_bias{spec.index}", dense, _F32)

    def can_reuse(self, params):
        return True   # rows, draws and biases are inputs; which chains run is in the graph's config


def _sampling(spec, env: InputEnv) -> GraphInput:
    seqs = spec.param("seqs", ())
    samplers = {seq: env.samplers[seq] for seq in seqs} if env.samplers else {}
    if set(samplers) != set(seqs):
        raise ValueError(f"the graph samples sequences {seqs} in the graph, but the context has backend samplers "
                         f"for {tuple(sorted(env.samplers or {}))}")
    return InputSampling(samplers, tuple(spec.leaves), env.hp.n_vocab)


# llm_graph_input_* by the kind of the builder's InputSpec (llamir.frontend.built)
INPUT_KINDS: dict[str, Callable[[InputSpec, InputEnv], GraphInput]] = {
    "embd": lambda spec, env: InputEmbd(bool(spec.param("has_tokens"))),
    "pos": lambda spec, env: InputPos(),
    "out_ids": lambda spec, env: InputOutIds(n_outputs=env.params.n_outputs),
    "attn_kv": _attn_kv,
    "attn_no_cache": _attn_no_cache,
    "mean": lambda spec, env: InputMean(),
    "cls": _cls,
    "rs": _rs,
    "sampling": _sampling,
    "pos_bucket": lambda spec, env: InputPosBucket(int(spec.param("n_buckets"))),
    "pos_bucket_kv": _pos_bucket_kv,
    "cross_embd": _cross(lambda cross, env: InputCrossEmbd(cross)),
    "attn_cross": _cross(lambda cross, env: InputAttnCross(cross, env.mask_dtype)),
}


def build_inputs(ctx, specs, ubatch: UBatch, mctx, params: GraphParams, encoder: bool) -> list[GraphInput]:
    """The input objects of a built graph's input specs, each made by its kind (INPUT_KINDS)."""
    env = InputEnv(ctx.model.hparams, ctx.cparams, params, mctx, ctx.cparams.causal_attn and not encoder,
                   ctx.cross, getattr(ctx, "backend_samplers", None))
    inputs = []
    for spec in specs:
        make = INPUT_KINDS.get(spec.kind)
        if make is None:
            raise ValueError(f"the graph declares an input of kind {spec.kind!r} ({', '.join(spec.leaves)}) that "
                             f"the context cannot fill (kinds: {', '.join(sorted(INPUT_KINDS))})")
        inp = make(spec, env)
        if tuple(inp.leaf_names) != tuple(spec.leaves) and spec.kind != "attn_kv":
            raise ValueError(f"input {spec.kind}: the graph's leaves {spec.leaves} are not the input's "
                             f"{tuple(inp.leaf_names)}")
        inputs.append(inp)
    return inputs


@dataclass
class GraphResult:
    """A built graph with its executable, its inputs and the params it was built for."""

    graph: object
    executable: object
    params: GraphParams
    inputs: list[GraphInput] = field(default_factory=list)
    values: dict = field(default_factory=dict)   # leaf values kept across calls: weights, state

    def __post_init__(self) -> None:
        self._memory_inputs = [inp for inp in self.inputs if hasattr(inp, "rebind")]

    def can_reuse(self, params: GraphParams, mctx: KVCacheContext | None) -> bool:
        if self.params != params and not self.params.allow_reuse(params):
            return False
        if self._memory_inputs:
            if mctx is None:
                return False
            for inp in self._memory_inputs:
                inp.rebind(mctx)
        return all(inp.can_reuse(params) for inp in self.inputs)

    def set_inputs(self, ubatch: UBatch, values: dict | None = None) -> dict[str, np.ndarray]:
        """Fill every input; `values` (kept across calls) may already hold the weights and state."""
        values = {} if values is None else values
        for inp in self.inputs:
            inp.set_input(ubatch, values)
        return values
