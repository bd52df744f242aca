"""GraphContext: what an architecture file builds with (llama.cpp's llm_graph_context).

It owns the GraphBuilder, resolves weights by their GGUF names, creates the graph inputs
(tokens, positions, output ids, KV indices and mask) and offers the shared building blocks:
norm, qkv, rope, attention over the KV cache, ffn. Per-batch sizes stay symbolic:
T (tokens in the ubatch), n_kv (KV cells attended) and n_out (rows that produce outputs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llamir.frontend.adapter import AdapterSet, LoraAdapter, LoraWeight, cvec_leaf_name
from llamir.frontend.arch.base import ArchError
from llamir.frontend.built import INPUT_LAYER, BuiltGraph, InputSpec, LayerMap
from llamir.frontend.graph_kv import CrossGraph, KVGraph, KVLayout, NoCacheGraph, TokenDims
from llamir.frontend.graph_rs import RS_DIM_NAMES, RSGraph, RSLayout
from llamir.frontend.hparams import HParams
from llamir.frontend.weights import UndeclaredTensorError, Weights
from llamir.ir import F16, F32, I32, GraphBuilder, Node, dims, ops, sym
from llamir.ir.builder import Name

DIM_NAMES = ("T", "n_kv", "n_out")
STREAM_DIM_NAMES = ("T_s", "ns", "s0", "n_kv", "n_out")


@dataclass(frozen=True)
class RopeParams:
    """The context-level rope settings (llama_cparams) a graph is built with."""

    n_ctx_orig: int
    freq_base: float
    freq_scale: float
    ext_factor: float = 0.0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    @classmethod
    def resolve(cls, hp: HParams, freq_base: float = 0.0, freq_scale: float = 0.0, scaling_type: str = "",
                ext_factor: float = -1.0, attn_factor: float = -1.0, beta_fast: float = -1.0,
                beta_slow: float = -1.0, n_ctx_orig: int = 0) -> RopeParams:
        """llama_context's resolution of the rope cparams: 0 / negative / "" mean "the model's"."""
        import math

        freq_base = freq_base or hp.rope_freq_base_train
        freq_scale = freq_scale or hp.rope_freq_scale_train
        scaling_type = scaling_type or hp.rope_scaling_type_train
        ext = ext_factor if ext_factor >= 0 else hp.yarn_ext_factor
        attn = attn_factor if attn_factor >= 0 else hp.yarn_attn_factor
        if scaling_type == "none":
            freq_scale = 1.0  # never scale if scaling type is none
        if ext < 0:
            ext = 1.0 if scaling_type == "yarn" else 0.0
        if ext != 0:
            def get_mscale(scale: float, mscale: float) -> float:
                return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0

            factor = 1.0 / freq_scale
            if hp.yarn_log_mul != 0.0:
                mscale = hp.yarn_log_mul if hp.arch == "deepseek2" and hp.yarn_log_mul != 1.0 else 1.0
                attn = get_mscale(factor, mscale) / get_mscale(factor, hp.yarn_log_mul)
            else:
                attn = get_mscale(factor, 1.0)
            attn *= 1.0 / (1.0 + 0.1 * math.log(factor))  # cancels the kernel's own mscale
        attn *= hp.rope_attn_factor
        return cls(n_ctx_orig=n_ctx_orig or hp.n_ctx_orig_yarn or hp.n_ctx_train, freq_base=freq_base,
                   freq_scale=freq_scale, ext_factor=ext, attn_factor=attn,
                   beta_fast=beta_fast if beta_fast >= 0 else hp.yarn_beta_fast,
                   beta_slow=beta_slow if beta_slow >= 0 else hp.yarn_beta_slow)


@dataclass(frozen=True)
class GraphConfig:
    """Everything besides the model that shapes the graph (a subset of llm_graph_params)."""

    memory: tuple[KVLayout, ...]   # the caches the graph reads and writes; () attends over the ubatch
    rope: RopeParams
    flash_attn: bool = False
    causal_attn: bool = True
    input_kind: str = "tokens"   # "tokens" or "embd"
    embeddings: bool = False     # also output the final hidden state (t_embd)
    pooling: str = "none"        # none | mean | cls | last | rank (applied when embeddings)
    recurrent: RSLayout | None = None   # the recurrent state the graph reads and writes, if any
    gtype: str = "decoder"       # llm_graph_type: "encoder" for encode(), "decoder" otherwise; an
                                 # encoder-decoder (t5) builds a different graph for each
    adapters: AdapterSet = AdapterSet()   # the LoRA adapters (with scales) and control vector layers
    # backend samplers: per sequence, its chain's in-graph prefix (llamir.frontend.graph_sampling specs)
    samplers: tuple[tuple[int, tuple], ...] = ()

    @property
    def n_stream(self) -> int:
        return self.memory[0].n_stream if self.memory else 1

    def dim_names(self) -> tuple[str, ...]:
        """The graph's symbolic dims. With recurrent state a ubatch is rs_seqs equal runs of
        rs_seq_tokens tokens (T is their product) over n_rs cells."""
        if self.recurrent is not None and self.n_stream > 1:   # a hybrid's streams: one per sequence
            names = (*STREAM_DIM_NAMES, "n_rs")
        elif self.recurrent is not None:
            names = ("n_out", *RS_DIM_NAMES)
        elif not self.memory:   # attention over the ubatch: no KV cells to count
            return tuple(n for n in DIM_NAMES if n != "n_kv")
        else:
            names = DIM_NAMES if self.n_stream == 1 else STREAM_DIM_NAMES
        return names + tuple(lay.n_kv_dim for lay in self.memory if lay.n_kv_dim not in names)


@dataclass
class GraphOutputs:
    logits: Node | None = None
    embd: Node | None = None
    extra: dict[str, Node] = field(default_factory=dict)


class GraphContext:
    """One graph under construction for one model and one GraphConfig."""

    def __init__(self, model, config: GraphConfig):
        self.model = model
        self.hp: HParams = model.hparams
        self.config = config
        self.b = GraphBuilder(model.hparams.arch, config.dim_names())
        self.rs = None
        if config.recurrent is not None and config.n_stream > 1:
            # a hybrid over KV streams: its rs_seqs sequences are the ns streams of T_s tokens
            self.rs = RSGraph(self.b, config.recurrent, n_seqs=sym("ns"), n_seq_tokens=sym("T_s"))
            tokens = TokenDims(T=dims.mul(sym("ns"), sym("T_s")), T_s=sym("T_s"), ns=sym("ns"), s0=sym("s0"))
            self.T = tokens.T
        elif config.recurrent is not None:
            self.rs = RSGraph(self.b, config.recurrent)
            self.T = dims.mul(self.rs.n_seqs, self.rs.n_seq_tokens)
            tokens = TokenDims(T=self.T, T_s=self.T, ns=1, s0=0)
        elif config.n_stream == 1:
            self.T = sym("T")
            tokens = TokenDims(T=self.T, T_s=self.T, ns=1, s0=0)
        else:
            tokens = TokenDims(T=dims.mul(sym("ns"), sym("T_s")), T_s=sym("T_s"), ns=sym("ns"), s0=sym("s0"))
            self.T = tokens.T
        self.tokens = tokens
        self.n_kv, self.n_out = sym("n_kv"), sym("n_out")
        self._weights: dict[str, Node] = {}
        self._pos: Node | None = None
        self._out_ids: Node | None = None
        self._layer_attn: dict[int, object] = {}
        self._cross_embd: Node | None = None
        self._pos_bucket: Node | None = None
        self.cross: CrossGraph | None = None
        self._inputs: list[InputSpec] = []
        self._marks: list[tuple[int, int, int]] = []   # (layer, first node, first leaf) as blocks begin
        if not config.memory:
            self.kv = NoCacheGraph(self.b, tokens, config.flash_attn)
            self.kv_swa = NoCacheGraph(self.b, tokens, config.flash_attn, "_swa") if self.hp.n_swa else None
        else:
            iswa = len(config.memory) > 1
            caches = {lay.suffix: KVGraph(self.b, self.hp, lay, tokens, sym(lay.n_kv_dim), config.flash_attn, iswa)
                      for lay in config.memory}
            self.kv, self.kv_swa = caches.get(""), caches.get("_swa")

    # -- layers -------------------------------------------------------------------------------
    def layers(self, n_layer: int | None = None):
        """The block indices, each entered in turn: what is built inside block il is in layer il,
        what comes after the last block in the output layer (hp.n_layer). `n_layer` blocks (a
        decoder with fewer blocks than its encoder), or hp.n_layer."""
        for il in range(self.hp.n_layer if n_layer is None else n_layer):
            self._enter(il)
            yield il
        self._enter(self.hp.n_layer)

    def _enter(self, layer: int) -> None:
        graph = self.b.graph
        self._marks.append((layer, len(graph.nodes), len(graph.leafs)))

    def built(self) -> BuiltGraph:
        """The graph with its input specs, memory layouts and layer map."""
        graph = self.b.graph
        marks = [(INPUT_LAYER, 0, 0), *self._marks]

        def layer_at(index: int, which: int) -> int:
            layer = INPUT_LAYER
            for mark in marks:
                if mark[which] <= index:
                    layer = mark[0]
            return layer

        nodes = tuple(layer_at(i, 1) for i in range(len(graph.nodes)))
        leafs = {leaf.name: INPUT_LAYER if leaf.kind == "input" else layer_at(i, 2)
                 for i, leaf in enumerate(graph.leafs)}
        inputs = list(self._inputs)
        for memory in (self.kv, self.kv_swa, self.cross, self.rs):
            spec = memory.input_spec() if memory is not None else None
            if spec is not None:
                inputs.append(spec)
        return BuiltGraph(graph, tuple(inputs), self.config.memory, LayerMap(nodes, leafs, self.hp.n_layer))

    def _declare(self, spec: InputSpec) -> None:
        self._inputs.append(spec)

    # -- weights ------------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return self.model.has_tensor(name)

    def w(self, name: str) -> Node:
        """The weight leaf of GGUF tensor `name` (created on first use)."""
        if name not in self._weights:
            t = self.model.tensor(name)
            self._weights[name] = self.b.weight(name, t.shape, t.dtype)
        return self._weights[name]

    def w_opt(self, name: str) -> Node | None:
        return self.w(name) if self.has(name) else None

    def output_weight(self) -> Node:
        """output.weight, or token_embd.weight when the output is tied (llama.cpp duplicates it)."""
        output = self.weights.output
        return output if output is not None else self.weights.token_embd

    @property
    def weights(self) -> Weights:
        """The model's own weights by their specs: `g.weights.token_embd`, `.output_norm`, `.output`."""
        return Weights(self)

    def layer_weights(self, il: int) -> Weights:
        """Block il's weights by their specs: `L.attn_q`, `L.attn_q_bias` (None when optional and absent)."""
        return Weights(self, f"blk.{il}.")

    def declared_weight(self, name: str) -> Node | None:
        """The weight of a tensor the architecture's specs declare: required -> its leaf (an ArchError
        when the model lacks it), optional -> its leaf or None; undeclared -> UndeclaredTensorError."""
        spec = self.model.tensor_specs.get(name)
        if spec is None:
            parts = name.split(".")
            block = f"blk.{parts[1]}." if parts[0] == "blk" and len(parts) > 2 else ""
            declared = ", ".join(Weights(self, block).names())
            raise UndeclaredTensorError(f"{self.hp.arch}: the builder reads tensor {name!r}, which the "
                                        f"architecture's tensor_specs does not declare (declared under "
                                        f"{block or 'the model'}: {declared})")
        if self.has(name):
            return self.w(name)
        if spec.required:
            raise ArchError(f"{self.model.path}: {self.hp.arch} needs tensor {name!r}, which the model lacks")
        return None

    # -- inputs -------------------------------------------------------------------------------
    def inp_embd(self) -> Node:
        """Token embeddings [T, n_embd]: get_rows of token_embd, or the caller's vectors."""
        if self.config.input_kind == "embd":
            self._declare(InputSpec("embd", ("inp_embd",), {"has_tokens": False}))
            return self.b.input("inp_embd", [self.T, self.hp.n_embd], F32)
        self._declare(InputSpec("embd", ("inp_tokens",), {"has_tokens": True}))
        tokens = self.b.input("inp_tokens", [self.T], I32)
        tok_embd = self.weights.token_embd
        if not self.config.adapters.pairs_for(tok_embd.name):
            return self.b.get_rows(tok_embd, tokens, name="inp_embd")
        cur = self.b.get_rows(tok_embd, tokens)                                       # [T, n_embd]
        for adapter, lw, scale in self.config.adapters.pairs_for(tok_embd.name):
            rows = self.b.get_rows(self._lora_leaf(adapter, lw, "a"), tokens)          # [T, rank]
            delta = self.b.mul_mat(self._lora_leaf(adapter, lw, "b"), rows)           # [T, n_embd]
            cur = self.b.add(cur, self.b.scale(delta, scale))
        return self.b.name(cur, "inp_embd")

    def inp_pos(self) -> Node:
        if self._pos is None:
            self._declare(InputSpec("pos", ("inp_pos",)))
            self._pos = self.b.input("inp_pos", [self.T], I32)
        return self._pos

    def _dim(self, name: str):
        """A per-batch size the graph gains as an input needs it (n_seqs, n_enc)."""
        if name not in self.b.graph.dim_names:
            self.b.graph.dim_names = self.b.graph.dim_names + (name,)
        return sym(name)

    def inp_cross_embd(self) -> Node:
        """The encoder output [n_enc, n_embd] that the last encode() stored (llm_graph_input_cross_embd)."""
        if self._cross_embd is None:
            self._declare(InputSpec("cross_embd", ("cross_embd",)))
            self._cross_embd = self.b.input("cross_embd", [self._dim("n_enc"), self.hp.n_embd], F32)
        return self._cross_embd

    def inp_pos_bucket(self, n_buckets: int) -> Node:
        """Relative-position buckets (t5), i32: [T, T] bidirectional over the ubatch when the graph
        has no memory (build_inp_pos_bucket_enc), [T, n_kv] causal over the KV cells otherwise
        (build_inp_pos_bucket_dec, which reads one stream only: llama.cpp asserts n_stream == 1)."""
        if self._pos_bucket is not None:
            return self._pos_bucket
        if not self.config.memory:
            self._declare(InputSpec("pos_bucket", ("pos_bucket_enc",), {"n_buckets": n_buckets}))
            self._pos_bucket = self.b.input("pos_bucket_enc", [self.T, self.T], I32)
        else:
            if self.config.n_stream != 1 or len(self.config.memory) != 1:
                raise ArchError(f"{self.hp.arch}: relative-position buckets read one KV stream; this context has "
                                f"{self.config.n_stream} (llama.cpp asserts n_stream == 1): use kv_unified=True "
                                f"or n_seq_max=1")
            self._declare(InputSpec("pos_bucket_kv", ("pos_bucket_dec",), {"n_buckets": n_buckets}))
            self._pos_bucket = self.b.input("pos_bucket_dec", [self.T, self.n_kv], I32)
        return self._pos_bucket

    def inp_out_ids(self) -> Node:
        """Always present (even when every token outputs) so the topology never changes."""
        if self._out_ids is None:
            self._declare(InputSpec("out_ids", ("inp_out_ids",)))
            self._out_ids = self.b.input("inp_out_ids", [self.n_out], I32)
        return self._out_ids

    # -- blocks -------------------------------------------------------------------------------
    def norm(self, x: Node, weight: Node | None, bias: Node | None = None, kind: str = "rms",
             il: int = -1, name: Name = None) -> Node:
        """build_norm: rms_norm or norm, then * weight, + bias."""
        if kind == "rms":
            cur = self.b.rms_norm(x, self.hp.f_norm_rms_eps)
        else:
            cur = self.b.norm(x, self.hp.f_norm_eps)
        if weight is not None:
            cur = self.b.mul(cur, weight)
        if bias is not None:
            cur = self.b.add(cur, bias)
        return self.b.name(cur, name) if name else cur

    def linear(self, weight: Node, x: Node, bias: Node | None = None, name: Name = None) -> Node:
        """build_lora_mm, then + bias: x @ weight.T, plus s * (x @ a.T) @ b.T for each active LoRA
        adapter that pairs the weight (s its scale * alpha / rank), added in the adapters' order. A
        1-D weight [n_in] is one row [1, n_in], as ggml reads it."""
        b = self.b
        w = weight if len(weight.shape) > 1 else b.reshape(weight, 1, weight.shape[0])
        cur = b.mul_mat(w, x)                                                           # [..., n_out]
        for adapter, lw, scale in self.config.adapters.pairs_for(weight.name):
            if lw.base.endswith("token_embd.weight"):
                raise ArchError(f"LoRA adapter {adapter.path}: its token_embd.weight pair is an embedding's "
                                f"(a [n_vocab, rank]) and cannot adapt the tied output projection (llama.cpp "
                                f"aborts on it)")
            ax = b.mul_mat(self._lora_leaf(adapter, lw, "a"), x)                       # [..., rank]
            bax = b.mul_mat(self._lora_leaf(adapter, lw, "b"), ax)                     # [..., n_out]
            cur = b.add(cur, b.scale(bax, scale))
        if bias is not None:
            cur = b.add(cur, bias)
        return b.name(cur, name) if name else cur

    def linear_id(self, weight: Node, x: Node, ids: Node, name: Name = None) -> Node:
        """build_lora_mm_id: mul_mat_id(weight, x, ids) [T, k, n_out], plus s * mul_mat_id(b,
        mul_mat_id(a, x, ids), ids) for each active adapter that pairs the expert weight."""
        b = self.b
        cur = b.mul_mat_id(weight, x, ids)                                            # [T, k, n_out]
        for adapter, lw, scale in self.config.adapters.pairs_for(weight.name):
            ax = b.mul_mat_id(self._lora_leaf(adapter, lw, "a"), x, ids)              # [T, k, rank]
            bax = b.mul_mat_id(self._lora_leaf(adapter, lw, "b"), ax, ids)            # [T, k, n_out]
            cur = b.add(cur, b.scale(bax, scale))
        return b.name(cur, name) if name else cur

    def _lora_leaf(self, adapter: LoraAdapter, lw: LoraWeight, part: str) -> Node:
        """The weight leaf of an adapter's lora_a or lora_b (created on first use, in the layer that
        uses it, so it is placed with its base weight's layer)."""
        name = adapter.leaf_name(lw, part)
        if name not in self._weights:
            t = getattr(lw, part)
            self._weights[name] = self.b.weight(name, t.shape, t.dtype)
        return self._weights[name]

    def cvec(self, cur: Node, il: int, name: Name = None) -> Node:
        """build_cvec: cur + the control vector of layer il [n_embd] when the context applies one
        there; `name` goes on the result (llama.cpp's l_out)."""
        if il in self.config.adapters.cvec_layers:
            cur = self.b.add(cur, self.b.weight(cvec_leaf_name(il), [self.hp.n_embd], F32))
        return self.b.name(cur, name) if name else cur

    def qkv(self, il: int, x: Node) -> tuple[Node, Node, Node]:
        """build_qkv: separate q/k/v projections (+ optional biases), as [T, heads, head_dim]."""
        hp, L = self.hp, self.layer_weights(il)
        q = self.linear(L.attn_q, x, L.attn_q_bias)
        k = self.linear(L.attn_k, x, L.attn_k_bias)
        v = self.linear(L.attn_v, x, L.attn_v_bias)
        q = self.b.reshape(q, self.T, hp.n_head(il), hp.n_embd_head_k, name=("Qcur", il))        # [T, H, d]
        k = self.b.reshape(k, self.T, hp.n_head_kv(il), hp.n_embd_head_k, name=("Kcur", il))     # [T, Hkv, d]
        v = self.b.reshape(v, self.T, hp.n_head_kv(il), hp.n_embd_head_v, name=("Vcur", il))     # [T, Hkv, dv]
        return q, k, v

    def rope(self, x: Node, mode: int, il: int, freq_factors: Node | None = None, name: Name = None) -> Node:
        r = self.config.rope
        base = self.model.arch.rope_freq_base(self.hp, r, il)
        return self.b.rope_ext(x, self.inp_pos(), freq_factors, n_dims=self.hp.n_rot, mode=mode,
                               n_ctx_orig=r.n_ctx_orig, freq_base=base, freq_scale=r.freq_scale,
                               ext_factor=r.ext_factor, attn_factor=r.attn_factor, beta_fast=r.beta_fast,
                               beta_slow=r.beta_slow, name=name)

    def attn(self, il: int, q: Node, k: Node, v: Node, wo: Node | None, wo_b: Node | None,
             kq_scale: float, kq_b: Node | None = None) -> Node:
        """build_attn: store k/v in the layer's cache (the SWA one for sliding-window layers, or none
        for encoders), attend (with the position bias kq_b [H, T, n] added to the scores, if
        any), and project with wo."""
        memory = self.kv_swa if self.kv_swa is not None and self.hp.is_swa(il) else self.kv
        cur = memory.attend(il, q, k, v, kq_scale, max_bias=self.hp.f_max_alibi_bias,
                            softcap=self.hp.f_attn_logit_softcapping, kq_b=kq_b)         # [T, H*dv]
        return self.linear(wo, cur, wo_b) if wo is not None else cur

    def attn_cross(self, il: int, q: Node, k: Node, v: Node, wo: Node | None, kq_scale: float) -> Node:
        """build_attn over the cross input: q [T, H, d] attends k/v [n_enc, Hkv, d] (made from the
        encoder output) under the cross mask, projected with wo."""
        if self.cross is None:
            self.cross = CrossGraph(self.b, self.tokens, self.config.flash_attn, self._dim("n_enc"))
        cur = self.cross.attend(il, q, k, v, kq_scale)                                    # [T, H*dv]
        return self.linear(wo, cur) if wo is not None else cur

    def pos_bias(self, pos_bucket: Node, attn_rel_b: Node, il: int = -1) -> Node:
        """build_pos_bias: the bias of each head for each (token, key) bucket, [H, T, n] =
        attn_rel_b[pos_bucket] with the head axis first."""
        b = self.b
        n_tok, n_key = pos_bucket.shape
        rows = b.get_rows(attn_rel_b, b.reshape(pos_bucket, dims.mul(n_tok, n_key)))     # [T*n, H]
        bias = b.reshape(rows, n_tok, n_key, attn_rel_b.shape[-1])                      # [T, n, H]
        return b.cont(b.permute(bias, 2, 0, 1), name=("pos_bias", il))                  # [H, T, n]

    def ffn(self, x: Node, up: Node, gate: Node | None, down: Node, act: str = "silu",
            il: int = -1, up_b: Node | None = None, gate_b: Node | None = None,
            down_b: Node | None = None) -> Node:
        """build_ffn with a parallel gate: down(act(gate(x)) * up(x)); no gate: down(act(up(x)))."""
        tmp = self.linear(up, x, up_b, name=("ffn_up", il))
        if gate is not None:
            g = self.linear(gate, x, gate_b, name=("ffn_gate", il))
            glu = {"silu": "swiglu", "gelu": "geglu", "relu": "reglu"}[act]
            cur = self.b.glu(glu, g, tmp, name=("ffn_" + glu, il))
        else:
            cur = self.b.unary(act, tmp, name=("ffn_" + act, il))
        return self.linear(down, cur, down_b, name=("ffn_out", il))

    def qkv_fused(self, il: int, x: Node, wqkv: Node, bqkv: Node | None = None) -> tuple[Node, Node, Node]:
        """build_qkv with one fused attn_qkv projection: [T, n_embd + 2 n_embd_gqa] (+ bias), cut
        into q, k and v (each made contiguous, then [T, heads, head_dim])."""
        hp, b, T = self.hp, self.b, self.T
        qkv = self.linear(wqkv, x, bqkv, name=("wqkv", il))
        n_q, n_k, n_v = hp.n_embd_head_k * hp.n_head(il), hp.n_embd_k_gqa(il), hp.n_embd_v_gqa(il)
        row = 4 * (n_q + n_k + n_v)                                                            # f32 bytes

        def part(width: int, offset: int, heads: int, d: int, name: str) -> Node:
            cut = b.cont(b.view(qkv, [T, width], [row, 4], 4 * offset))
            return b.reshape(cut, T, heads, d, name=(name, il))

        return (part(n_q, 0, hp.n_head(il), hp.n_embd_head_k, "Qcur"),
                part(n_k, n_q, hp.n_head_kv(il), hp.n_embd_head_k, "Kcur"),
                part(n_v, n_q + n_k, hp.n_head_kv(il), hp.n_embd_head_v, "Vcur"))

    def inp_pos_embd(self, x: Node, position_embd: Node) -> Node:
        """Learned absolute positions (gpt2, starcoder): x + position_embd[inp_pos]."""
        return self.b.add(x, self.b.get_rows(position_embd, self.inp_pos(), name="pos_embd"), name="inp_pos_embd")

    def moe_ffn(self, x: Node, gate_inp: Node, up_exps: Node, gate_exps: Node | None, down_exps: Node,
                n_expert_used: int, act: str = "silu", gating: str = "softmax", norm_w: bool = False,
                w_scale: float | None = None, gate_inp_b: Node | None = None, il: int = -1) -> Node:
        """build_moe_ffn: route each token [T, E] to its top n_expert_used experts and sum their
        weighted ffn outputs. `gating`: softmax (weights from the softmax over every expert),
        sigmoid, or softmax_weight (softmax over the selected logits only); `norm_w` divides the
        selected weights by their sum (at least the smallest f16 normal); `w_scale` scales them."""
        b, T = self.b, x.shape[0]
        n_expert, n_embd, k = gate_inp.shape[0], x.shape[-1], n_expert_used
        logits = self.linear(gate_inp, x, gate_inp_b, name=("ffn_moe_logits", il))          # [T, n_expert]
        if gating == "softmax":
            probs = b.soft_max_ext(logits, None, 1.0, name=("ffn_moe_probs", il))
        elif gating == "sigmoid":
            probs = b.unary("sigmoid", logits, name=("ffn_moe_probs", il))
        elif gating == "softmax_weight":
            probs = logits
        else:
            raise ValueError(f"moe gating {gating!r} (softmax, sigmoid, softmax_weight)")
        selected = b.top_k(probs, k, name=("ffn_moe_topk", il))                              # [T, k] i32
        weights = b.get_rows(b.reshape(probs, T, n_expert, 1), selected,
                             name=("ffn_moe_weights", il))                                  # [T, k, 1]
        if gating == "softmax_weight":
            weights = b.reshape(b.soft_max_ext(b.reshape(weights, T, k), None, 1.0), T, k, 1)
        if norm_w:
            total = b.sum_rows(b.reshape(weights, T, k))                                     # [T, 1]
            total = b.clamp(total, 6.103515625e-5, float("inf"))
            weights = b.reshape(b.div(b.reshape(weights, T, k), total, name=("ffn_moe_weights_norm", il)),
                                T, k, 1)
        if w_scale is not None:
            weights = b.scale(weights, w_scale, name=("ffn_moe_weights_scaled", il))
        cur = b.reshape(x, T, 1, n_embd)                                                     # [T, 1, n_embd]
        up = self.linear_id(up_exps, cur, selected, name=("ffn_moe_up", il))                # [T, k, n_ff]
        if gate_exps is not None:
            gate = self.linear_id(gate_exps, cur, selected, name=("ffn_moe_gate", il))
            glu = {"silu": "swiglu", "gelu": "geglu", "relu": "reglu"}[act]
            cur = b.glu(glu, gate, up, name=("ffn_moe_" + glu, il))
        else:
            cur = b.unary(act, up, name=("ffn_moe_" + act, il))
        experts = self.linear_id(down_exps, cur, selected, name=("ffn_moe_down", il))       # [T, k, n_embd]
        experts = b.mul(experts, weights, name=("ffn_moe_weighted", il))
        row = 4 * n_embd                                                                      # f32 bytes
        out = b.view(experts, [T, n_embd], [k * row, 4], 0)
        for i in range(1, k):   # the k slices summed by a chain of adds, as llama.cpp does
            out = b.add(out, b.view(experts, [T, n_embd], [k * row, 4], i * row))
        return b.cont(out) if k == 1 else out                                               # [T, n_embd]

    def softcap(self, x: Node, cap: float, name: Name = None) -> Node:
        """cap * tanh(x / cap): gemma2's attention-logit and final-logit softcapping."""
        return self.b.scale(self.b.unary("tanh", self.b.scale(x, 1.0 / cap)), cap, name=name)

    def finish(self, hidden: Node, logits: Node | None, embd: bool = False) -> GraphOutputs:
        """Register the outputs: t_embd ("result_norm"; with `embd` whatever the context asks, as
        an encoder whose output feeds a decoder needs), the pooled embeddings and t_logits
        ("result_output")."""
        self.b.name(hidden, "result_norm")
        if self.config.embeddings or embd:
            self.b.output("embd", hidden)
            pooled = self.pool(hidden)
            if pooled is not None:
                self.b.output("embd_pooled", pooled)
        if logits is not None:
            self.b.name(logits, "result_output")
            self.b.output("logits", logits)
            if self.config.samplers:
                from llamir.frontend.graph_sampling import build_sampling

                build_sampling(self, logits)
        return GraphOutputs(logits=logits, embd=hidden)

    def pool(self, embd: Node) -> Node | None:
        """build_pooling: mean (a matmul with the inp_mean weights), cls/last (get_rows), or none."""
        kind = self.config.pooling
        if kind == "none":
            return None
        n_seqs = sym("n_seqs") if "n_seqs" in self.b.graph.dim_names else None
        if n_seqs is None:
            self.b.graph.dim_names = self.b.graph.dim_names + ("n_seqs",)
            n_seqs = sym("n_seqs")
        if kind == "mean":
            self._declare(InputSpec("mean", ("inp_mean",)))
            weights = self.b.input("inp_mean", [n_seqs, self.n_out], F32)                  # [n_seqs, T]
            pooled = self.b.mul_mat(self.b.cont(self.b.transpose(embd)), weights)          # [n_seqs, E]
        elif kind in ("cls", "last", "rank"):
            self._declare(InputSpec("cls", ("inp_cls",), {"pooling": kind}))
            rows = self.b.input("inp_cls", [n_seqs], I32)
            pooled = self.b.get_rows(embd, rows)                                           # [n_seqs, E]
            if kind == "rank":
                pooled = self._classifier(pooled)
        else:
            raise ValueError(f"pooling type {kind!r} is not supported")
        return self.b.name(pooled, "result_embd_pooled")

    def _classifier(self, x: Node) -> Node:
        """RANK pooling's head: tanh(cls x + b), then cls_out x + b, when the model has them (plain
        matmuls: llama.cpp applies no LoRA here)."""
        def dense(w: Node, x: Node, bias: Node | None) -> Node:
            cur = self.b.mul_mat(w, x)
            return self.b.add(cur, bias) if bias is not None else cur

        if self.has("cls.weight"):
            x = self.b.unary("tanh", dense(self.w("cls.weight"), x, self.w_opt("cls.bias")))
        if self.has("cls.output.weight"):
            x = dense(self.w("cls.output.weight"), x, self.w_opt("cls.output.bias"))
        return x


def mask_dtype(flash_attn: bool):
    """Flash attention takes an f16 mask; the soft_max path an f32 one."""
    return F16 if flash_attn else F32


__all__ = ["DIM_NAMES", "BuiltGraph", "GraphConfig", "GraphContext", "GraphOutputs", "InputSpec", "KVLayout",
           "LayerMap", "RopeParams", "mask_dtype", "ops"]
