"""GraphBuilder: ggml-named functions that append typed nodes to a Graph.

    b = GraphBuilder("llama", dims=["T"])
    tokens = b.input("inp_tokens", ["T"], I32)                       # [T]
    x = b.get_rows(b.weight("token_embd.weight", [V, E], F32), tokens)  # [T, E]

Names follow llama.cpp's callback convention: name=("attn_norm", 3) gives "attn_norm-3".
"""

from __future__ import annotations

from collections.abc import Sequence

from llamir.ir import dims, ops
from llamir.ir.dims import Dim
from llamir.ir.dtypes import DType
from llamir.ir.graph import Graph, Node
from llamir.ir.types import TensorType

Name = str | tuple[str, int] | None


def layer_name(name: Name) -> str | None:
    """llama.cpp's tensor naming: ("norm", il) -> "norm-il" (il < 0 -> "norm")."""
    if name is None or isinstance(name, str):
        return name
    base, il = name
    return base if il < 0 else f"{base}-{il}"


class GraphBuilder:
    """Builds one Graph; every method returns the new Node."""

    def __init__(self, name: str = "graph", dims: Sequence[str] = ()):
        self.graph = Graph(name, dims)

    # -- leaves and outputs -------------------------------------------------------------------
    def dim(self, name: str) -> dims.Sym:
        if name not in self.graph.dim_names:
            raise KeyError(f"graph {self.graph.name} declares no dim {name!r}")
        return dims.sym(name)

    def _type(self, shape: Sequence[Dim | str], dtype: DType) -> TensorType:
        return TensorType(tuple(dims.sym(d) if isinstance(d, str) else d for d in shape), dtype)

    def input(self, name: str, shape: Sequence[Dim | str], dtype: DType) -> Node:
        return self.graph.add_leaf("input", self._type(shape, dtype), name)

    def weight(self, name: str, shape: Sequence[Dim | str], dtype: DType) -> Node:
        return self.graph.add_leaf("weight", self._type(shape, dtype), name)

    def state(self, name: str, shape: Sequence[Dim | str], dtype: DType) -> Node:
        return self.graph.add_leaf("state", self._type(shape, dtype), name)

    def output(self, name: str, node: Node) -> Node:
        self.graph.set_output(name, node)
        return node

    def op(self, op: ops.Op, *inputs: Node, name: Name = None) -> Node:
        return self.graph.add_node(op, inputs, layer_name(name))

    def name(self, node: Node, name: Name) -> Node:
        """Name an existing node (llama.cpp's cb(cur, name, il))."""
        node.name = layer_name(name)
        return node

    # -- arithmetic ---------------------------------------------------------------------------
    def add(self, a: Node, b: Node, name: Name = None) -> Node:
        return self.op(ops.Add(), a, b, name=name)

    def sub(self, a: Node, b: Node, name: Name = None) -> Node:
        return self.op(ops.Sub(), a, b, name=name)

    def mul(self, a: Node, b: Node, name: Name = None) -> Node:
        return self.op(ops.Mul(), a, b, name=name)

    def div(self, a: Node, b: Node, name: Name = None) -> Node:
        return self.op(ops.Div(), a, b, name=name)

    def scale(self, x: Node, s: float, b: float = 0.0, name: Name = None) -> Node:
        return self.op(ops.Scale(s=float(s), b=float(b)), x, name=name)

    def clamp(self, x: Node, lo: float, hi: float, name: Name = None) -> Node:
        return self.op(ops.Clamp(min=float(lo), max=float(hi)), x, name=name)

    def unary(self, op_name: str, x: Node, name: Name = None) -> Node:
        """Any element-wise unary op by its ggml name: "silu", "gelu", "tanh", ..."""
        cls = ops.OPS[op_name]
        if not issubclass(cls, ops.Unary):
            raise ValueError(f"{op_name} is not a unary op")
        return self.op(cls(), x, name=name)

    def silu(self, x: Node, name: Name = None) -> Node:
        return self.unary("silu", x, name)

    def gelu(self, x: Node, name: Name = None) -> Node:
        return self.unary("gelu", x, name)

    def glu(self, kind: str, a: Node, b: Node | None = None, swapped: bool = False, name: Name = None) -> Node:
        """kind in swiglu/geglu/reglu/...; split form act(a)*b, or fused halves of a."""
        cls = ops.OPS[kind]
        if b is None:
            return self.op(cls(split=False, swapped=swapped), a, name=name)
        return self.op(cls(split=True, swapped=swapped), a, b, name=name)

    def swiglu(self, gate: Node, up: Node, name: Name = None) -> Node:
        return self.glu("swiglu", gate, up, name=name)

    # -- normalisation ------------------------------------------------------------------------
    def rms_norm(self, x: Node, eps: float, name: Name = None) -> Node:
        return self.op(ops.RmsNorm(eps=float(eps)), x, name=name)

    def norm(self, x: Node, eps: float, name: Name = None) -> Node:
        return self.op(ops.Norm(eps=float(eps)), x, name=name)

    # -- products and rows --------------------------------------------------------------------
    def mul_mat(self, a: Node, b: Node, name: Name = None) -> Node:
        """y = b @ a.T: a is the weight [.., M, K], b the activations [.., N, K] -> [.., N, M]."""
        return self.op(ops.MulMat(), a, b, name=name)

    def mul_mat_id(self, experts: Node, b: Node, ids: Node, name: Name = None) -> Node:
        return self.op(ops.MulMatId(), experts, b, ids, name=name)

    def get_rows(self, a: Node, idx: Node, name: Name = None) -> Node:
        return self.op(ops.GetRows(), a, idx, name=name)

    def set_rows(self, dst: Node, src: Node, idx: Node, name: Name = None) -> Node:
        return self.op(ops.SetRows(), dst, src, idx, name=name)

    # -- attention ----------------------------------------------------------------------------
    def rope_ext(self, x: Node, pos: Node, freq_factors: Node | None = None, *, n_dims: int, mode: int,
                 n_ctx_orig: int, freq_base: float, freq_scale: float = 1.0, ext_factor: float = 0.0,
                 attn_factor: float = 1.0, beta_fast: float = 32.0, beta_slow: float = 1.0,
                 name: Name = None) -> Node:
        op = ops.RopeExt(n_dims=n_dims, mode=mode, n_ctx_orig=n_ctx_orig, freq_base=float(freq_base),
                         freq_scale=float(freq_scale), ext_factor=float(ext_factor),
                         attn_factor=float(attn_factor), beta_fast=float(beta_fast),
                         beta_slow=float(beta_slow), freq_factors=freq_factors is not None)
        inputs = (x, pos) if freq_factors is None else (x, pos, freq_factors)
        return self.op(op, *inputs, name=name)

    def soft_max_ext(self, x: Node, mask: Node | None, scale: float, max_bias: float = 0.0,
                     sinks: Node | None = None, name: Name = None) -> Node:
        op = ops.SoftMaxExt(scale=float(scale), max_bias=float(max_bias), mask=mask is not None,
                            sinks=sinks is not None)
        inputs = [x] + [t for t in (mask, sinks) if t is not None]
        return self.op(op, *inputs, name=name)

    def flash_attn_ext(self, q: Node, k: Node, v: Node, mask: Node | None, scale: float,
                       max_bias: float = 0.0, logit_softcap: float = 0.0, sinks: Node | None = None,
                       name: Name = None) -> Node:
        op = ops.FlashAttnExt(scale=float(scale), max_bias=float(max_bias),
                              logit_softcap=float(logit_softcap), mask=mask is not None,
                              sinks=sinks is not None)
        inputs = [q, k, v] + [t for t in (mask, sinks) if t is not None]
        return self.op(op, *inputs, name=name)

    # -- state-space models -------------------------------------------------------------------
    def ssm_conv(self, sx: Node, c: Node, name: Name = None) -> Node:
        """ggml_ssm_conv: sx [n_s, d_inner, d_conv - 1 + n_t], c [d_inner, d_conv] -> [n_s, n_t, d_inner]."""
        return self.op(ops.SsmConv(), sx, c, name=name)

    def ssm_scan(self, s: Node, x: Node, dt: Node, A: Node, B: Node, C: Node, ids: Node, K: int = 1,
                 name: Name = None) -> Node:
        """ggml_ssm_scan: states s [n_rs, H, hd, ds], x [n_s, n_t, H, hd], dt [n_s, n_t, H], A [H, ds] or
        [H, 1], B and C [n_s, n_t, G, ds], ids i32 [n_s] -> 1-D: y (x's elements), then K*n_s states."""
        return self.op(ops.SsmScan(K=int(K)), s, x, dt, A, B, C, ids, name=name)

    # -- layout -------------------------------------------------------------------------------
    def view(self, x: Node, shape: Sequence[Dim], strides: Sequence[Dim], offset: Dim = 0,
             name: Name = None) -> Node:
        """ggml_view_*: byte strides (outermost first, the last is the element size)."""
        return self.op(ops.View(shape=tuple(shape), strides=tuple(strides), offset=offset), x, name=name)

    def reshape(self, x: Node, *shape: Dim, name: Name = None) -> Node:
        return self.op(ops.Reshape(shape=tuple(shape)), x, name=name)

    def permute(self, x: Node, *axes: int, name: Name = None) -> Node:
        return self.op(ops.Permute(axes=tuple(axes)), x, name=name)

    def transpose(self, x: Node, name: Name = None) -> Node:
        return self.op(ops.Transpose(), x, name=name)

    def cont(self, x: Node, *shape: Dim, name: Name = None) -> Node:
        return self.op(ops.Cont(shape=tuple(shape)), x, name=name)

    def cast(self, x: Node, dtype: DType, name: Name = None) -> Node:
        """ggml_cast (op name cpy): x converted to `dtype`."""
        return self.op(ops.Cpy(dtype=dtype), x, name=name)

    def concat(self, a: Node, b: Node, axis: int, name: Name = None) -> Node:
        return self.op(ops.Concat(axis=axis), a, b, name=name)

    def repeat(self, x: Node, *shape: Dim, name: Name = None) -> Node:
        return self.op(ops.Repeat(shape=tuple(shape)), x, name=name)

    # -- reductions ---------------------------------------------------------------------------
    def sum_rows(self, x: Node, name: Name = None) -> Node:
        return self.op(ops.SumRows(), x, name=name)

    def mean(self, x: Node, name: Name = None) -> Node:
        return self.op(ops.Mean(), x, name=name)

    def argmax(self, x: Node, name: Name = None) -> Node:
        """ggml_argmax: x f32 [rows, n] (or [n]) -> i32 [rows] (or [1]), the last of equal maxima."""
        return self.op(ops.Argmax(), x, name=name)

    def cumsum(self, x: Node, name: Name = None) -> Node:
        """ggml_cumsum: running f32 sums of x's rows, same shape."""
        return self.op(ops.Cumsum(), x, name=name)

    def argsort(self, x: Node, descending: bool = False, name: Name = None) -> Node:
        return self.op(ops.Argsort(descending=descending), x, name=name)

    def top_k(self, x: Node, k: int, name: Name = None) -> Node:
        return self.op(ops.TopK(k=k), x, name=name)
