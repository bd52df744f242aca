"""The cases of test-backend-ops (llamir.testing.backend_ops): one small graph per op and
parameter set, with ggml's input ranges and per-op NMSE bounds (tests/test-backend-ops.cpp).

Each case builds a graph around the op under test: non-contiguous inputs come from permute /
transpose / view nodes in front of it (as ggml builds them), view ops are followed by a cont.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from llamir.ir import BF16, F16, F32, Graph, GraphBuilder, Node, bind_dims, ops, quants
from llamir.ir.dtypes import Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, QUANT_DTYPES, DType
from llamir.ir.interp_kernels import f32_to_bf16

# ggml's all_types minus the vec_dot-only q8_1 / q8_K (ggml's list leaves them out too)
WEIGHT_TYPES: tuple[DType, ...] = (F32, F16, BF16) + tuple(q for q in QUANT_DTYPES if q.name not in ("q8_1", "q8_k"))
LEGACY_QUANTS = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)
UNARY = ("neg", "abs", "sgn", "step", "tanh", "elu", "relu", "sigmoid", "gelu", "gelu_erf", "gelu_quick", "silu",
         "hardsigmoid", "hardswish", "exp", "log", "sqr", "sqrt", "sin", "cos", "softplus")
GLU = ("swiglu", "geglu", "reglu", "geglu_erf", "geglu_quick")

# ops no case runs directly, and why (tests/testing checks every other op has a case)
UNCOVERED: dict[str, str] = {
    "leaf": "a graph input, not a computation: every case feeds its inputs through leaves",
}

Values = Callable[[np.random.Generator, tuple[int, ...]], np.ndarray]


@dataclass
class Case:
    """One graph around one op: `values` overrides the uniform [lo, hi] inputs of some leaves
    (float32 values, stored in the leaf's dtype); `state` names leaves the op writes."""

    op: str
    params: str
    graph: Graph
    max_nmse: float = 1e-7
    lo: float = -1.0
    hi: float = 1.0
    values: dict[str, Values] = field(default_factory=dict)
    bindings: dict[str, int] = field(default_factory=dict)
    state: tuple[str, ...] = ()
    flops: int = 0

    @property
    def name(self) -> str:
        return f"{self.op.upper()}({self.params})"

    def inputs(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Deterministic leaf values (in storage form) drawn from `rng`."""
        out = {}
        for leaf in self.graph.leafs:
            shape = leaf.type.evaluate(self.bindings)
            make = self.values.get(leaf.name)
            if leaf.kind == "state" and make is None:
                out[leaf.name] = store(np.zeros(shape, np.float32), leaf.dtype)
                continue
            raw = make(rng, shape) if make is not None else rng.uniform(self.lo, self.hi, shape)
            out[leaf.name] = raw if raw.dtype.kind in "iu" and leaf.dtype.is_int else store(raw, leaf.dtype)
        return out

    def tested_nodes(self) -> list[Node]:
        """The nodes a backend must support to run the case (views excepted), with the case's
        dims bound: a backend is asked about the tensors it will run, as ggml asks."""
        graph = bind_dims(self.graph, dict(self.bindings)) if self.bindings else self.graph
        return [n for n in graph.nodes if not n.op.is_view]


def store(x: np.ndarray, dtype: DType) -> np.ndarray:
    """float values -> the storage of `dtype` (quantized with llamir's reference quantizers)."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == F32:
        return np.ascontiguousarray(x)
    if dtype == F16:
        return x.astype(np.float16)
    if dtype == BF16:
        return f32_to_bf16(x)
    if dtype.is_int:
        return np.rint(x).astype(dtype.np_dtype)
    return quants.quantize(x, dtype)


def uniform(lo: float, hi: float) -> Values:
    return lambda rng, shape: rng.uniform(lo, hi, shape)


def integers(lo: int, hi: int, dtype=np.int32) -> Values:
    return lambda rng, shape: rng.integers(lo, hi, shape).astype(dtype)


def fixed(array) -> Values:
    return lambda rng, shape: np.asarray(array).reshape(shape)


def _fmt(v) -> str:
    if isinstance(v, (tuple, list)):
        return "[" + ",".join(str(x) for x in v) + "]"
    return str(v)


def params(**kv) -> str:
    return ",".join(f"{k}={_fmt(v)}" for k, v in kv.items())


def build(op: str, text: str, fn: Callable[[GraphBuilder], None], dims_: tuple[str, ...] = (), **kw) -> Case:
    b = GraphBuilder(f"test_{op}", dims=dims_)
    fn(b)
    return Case(op, text, b.graph, **kw)


def quant_nmse_estimate(dtype: DType, n_elements: int, value_range: float) -> float:
    """ggml's bound for float -> legacy-quant copies: one quantum off in one value, over the
    reference's mean square (values uniform in [-value_range, value_range])."""
    err = value_range / 8.0
    if dtype in (Q5_0, Q5_1):
        err /= 2.0
    if dtype == Q8_0:
        err /= 8.0
    return err * err / (value_range * value_range * 0.25 * n_elements)


# -- element-wise ---------------------------------------------------------------------------------
BINARY_SHAPES = [((1, 1), (1, 1)), ((7, 33), (33,)), ((7, 33), (7, 33)), ((3, 5, 17), (1, 5, 1)),
                 ((2, 3, 4, 19), (2, 1, 4, 19)), ((4, 6), (2, 3)), ((5, 40), (1, 40)), ((2, 3, 10, 10), (1, 1, 10, 10))]


def binary_cases() -> Iterator[Case]:
    for op in ("add", "sub", "mul", "div"):
        values = {"b": uniform(0.5, 2.0)} if op == "div" else {}      # ggml keeps divisors off zero
        for a_shape, b_shape in BINARY_SHAPES:
            def fn(g, op=op, a_shape=a_shape, b_shape=b_shape):
                g.output("out", getattr(g, op)(g.input("a", a_shape, F32), g.input("b", b_shape, F32)))
            yield build(op, params(type="f32", ne_a=a_shape, ne_b=b_shape), fn, values=values)

        def permuted(g, op=op):      # a non-contiguous a (ggml's perm=[0,2,1,3])
            a = g.permute(g.input("a", (2, 5, 3, 16), F32), 0, 2, 1, 3)       # [2, 3, 5, 16]
            g.output("out", getattr(g, op)(a, g.input("b", (3, 1, 16), F32)))
        yield build(op, params(type="f32", ne_a=(2, 3, 5, 16), ne_b=(3, 1, 16), perm=(0, 2, 1, 3)), permuted,
                    values=values)
        for dtype in (F16, BF16):
            def storage(g, op=op, dtype=dtype):
                g.output("out", getattr(g, op)(g.input("a", (5, 21), dtype), g.input("b", (21,), F32)))
            yield build(op, params(type=dtype, ne_a=(5, 21), ne_b=(21,)), storage, values=values,
                        max_nmse=1e-7 if dtype == F16 else 5e-3)


def _unary_range(name: str, dtype: DType) -> tuple[float, float]:
    if name in ("log", "sqrt"):
        return 0.01, 100.0
    if name in ("sin", "cos"):
        return -6.5, 6.5
    if name == "exp" and dtype == F16:
        return -10.0, 10.0
    return -150.0, 150.0


def unary_cases() -> Iterator[Case]:
    for name in UNARY:
        for dtype in (F32, F16):
            lo, hi = _unary_range(name, dtype)

            def fn(g, name=name, dtype=dtype):
                g.output("out", g.unary(name, g.input("x", ("T", 37), dtype)))
            yield build(name, params(type=dtype, ne=(3, 37)), fn, ("T",), lo=lo, hi=hi, bindings={"T": 3})
        lo, hi = _unary_range(name, F32)

        def transposed(g, name=name):
            g.output("out", g.unary(name, g.transpose(g.input("x", (2, 19, 6), F32))))
        yield build(name, params(type="f32", ne=(2, 6, 19), v="transposed"), transposed, lo=lo, hi=hi)


def glu_cases() -> Iterator[Case]:
    for kind in GLU:
        for form in ("split", "fused", "swapped"):
            def fn(g, kind=kind, form=form):
                if form == "split":
                    g.output("out", g.glu(kind, g.input("a", (3, 45), F32), g.input("b", (3, 45), F32)))
                else:
                    g.output("out", g.glu(kind, g.input("a", (3, 90), F32), swapped=form == "swapped"))
            yield build(kind, params(type="f32", ne=(3, 45), form=form), fn, lo=-150.0, hi=150.0)


def scalar_cases() -> Iterator[Case]:
    for s, bias in ((0.5, 0.25), (2.0, 0.0)):
        yield build("scale", params(type="f32", ne=(4, 19), s=s, b=bias),
                    lambda g, s=s, bias=bias: g.output("out", g.scale(g.input("x", (4, 19), F32), s, bias)))
    yield build("scale", params(type="f32", ne=(6, 4), s=3.0, v="transposed"),
                lambda g: g.output("out", g.scale(g.transpose(g.input("x", (4, 6), F32)), 3.0)))
    for lo, hi in ((-0.5, 0.5), (-1.0, 10.0)):
        yield build("clamp", params(type="f32", ne=(4, 19), min=lo, max=hi),
                    lambda g, lo=lo, hi=hi: g.output("out", g.clamp(g.input("x", (4, 19), F32), lo, hi)), lo=-2, hi=2)
    yield build("fill", params(type="f32", ne=(4, 19), c=2.5),
                lambda g: g.output("out", g.op(ops.Fill(c=2.5), g.input("x", (4, 19), F32))))


# -- norms and reductions --------------------------------------------------------------------------
def norm_cases() -> Iterator[Case]:
    plain = {"rms_norm": ops.RmsNorm(eps=1e-5), "norm": ops.Norm(eps=1e-5), "l2_norm": ops.L2Norm(eps=1e-12)}
    for name, op in plain.items():
        for n in (1, 16, 37, 576):
            yield build(name, params(type="f32", ne=(3, n), eps=op.eps),
                        lambda g, op=op, n=n: g.output("out", g.op(op, g.input("x", ("T", n), F32))), ("T",),
                        lo=-10.0, hi=10.0, bindings={"T": 3})

        def permuted(g, op=op):
            g.output("out", g.op(op, g.permute(g.input("x", (4, 3, 5, 16), F32), 0, 2, 1, 3)))
        yield build(name, params(type="f32", ne=(4, 5, 3, 16), eps=op.eps, perm=(0, 2, 1, 3)), permuted,
                    lo=-10.0, hi=10.0)
    yield build("group_norm", params(type="f32", ne=(2, 6, 3, 5), n_groups=4, eps=1e-5),
                lambda g: g.output("out", g.op(ops.GroupNorm(n_groups=4, eps=1e-5), g.input("x", (2, 6, 3, 5), F32))))
    for n in (1, 16, 37, 576):
        yield build("rms_norm_mul", params(type="f32", ne=(3, n), eps=1e-6), lambda g, n=n: g.output(
            "out", g.op(ops.RmsNormMul(eps=1e-6), g.input("x", (3, n), F32), g.weight("w", (n,), F32))),
            lo=-10.0, hi=10.0)
        for bias in (True, False):
            def layer_norm(g, n=n, bias=bias):
                x, w = g.input("x", (3, n), F32), g.weight("w", (n,), F32)
                extra = (g.weight("b", (n,), F32),) if bias else ()
                g.output("out", g.op(ops.NormMulAdd(eps=1e-5, bias=bias), x, w, *extra))
            yield build("norm_mul_add", params(type="f32", ne=(3, n), eps=1e-5, bias=int(bias)), layer_norm)


def reduce_cases() -> Iterator[Case]:
    for name, op in (("sum_rows", ops.SumRows()), ("mean", ops.Mean()), ("sum", ops.Sum())):
        for n in (1, 16, 37, 576):
            yield build(name, params(type="f32", ne=(3, n)),
                        lambda g, op=op, n=n: g.output("out", g.op(op, g.input("x", (3, n), F32))), lo=-0.9, hi=1.1)
        yield build(name, params(type="f32", ne=(2, 7, 5), v="transposed"), lambda g, op=op: g.output(
            "out", g.op(op, g.transpose(g.input("x", (2, 5, 7), F32)))), lo=-0.9, hi=1.1)
    ties = lambda rng, shape: np.round(rng.uniform(-3, 3, shape), 1)     # noqa: E731  (the sort must be stable)
    for descending in (False, True):
        for n in (45, 300):
            yield build("argsort", params(type="f32", ne=(3, n), order="desc" if descending else "asc"),
                        lambda g, d=descending, n=n: g.output("out", g.argsort(g.input("x", (3, n), F32), d)),
                        max_nmse=0.0, values={"x": ties})
    for k in (1, 7):
        yield build("top_k", params(type="f32", ne=(3, 45), k=k),
                    lambda g, k=k: g.output("out", g.top_k(g.input("x", (3, 45), F32), k)), max_nmse=0.0,
                    values={"x": ties})


# -- argmax and cumsum (greedy and top-p sampling in the graph) -------------------------------------
def _shuffled_ranks(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """ggml's argmax inputs: each row a shuffle of 0..n-1 (no ties)."""
    return rng.permuted(np.broadcast_to(np.arange(shape[-1], dtype=np.float32), shape), axis=-1)


def _ties_and_infinities(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Few distinct values (ties everywhere), -inf as masked logits are, one all -inf row and
    NaNs in the last rows (argmax takes the last maximum of the last NaN-free run)."""
    x = np.round(rng.uniform(-2, 2, shape), 0).astype(np.float32)
    x[rng.uniform(size=shape) < 0.3] = -np.inf
    x[0] = -np.inf
    x[-2:][rng.uniform(size=x[-2:].shape) < 0.2] = np.nan
    return x


def argmax_cases() -> Iterator[Case]:
    for rows, n in ((1, 32), (513, 32), (10, 100), (10, 1024), (12, 1024), (10, 2000), (3, 5438)):
        yield build("argmax", params(type="f32", ne=(rows, n)),
                    lambda g, rows=rows, n=n: g.output("out", g.argmax(g.input("x", (rows, n), F32))),
                    max_nmse=0.0, values={"x": _shuffled_ranks})
    yield build("argmax", params(type="f32", ne=(7, 301), v="ties,-inf,nan"),
                lambda g: g.output("out", g.argmax(g.input("x", ("T", 301), F32))), ("T",),
                max_nmse=0.0, values={"x": _ties_and_infinities}, bindings={"T": 7})
    yield build("argmax", params(type="f32", ne=(45,)), lambda g: g.output("out", g.argmax(g.input("x", (45,), F32))),
                max_nmse=0.0, values={"x": _shuffled_ranks})
    yield build("argmax", params(type="f32", ne=(9, 6), v="transposed"),
                lambda g: g.output("out", g.argmax(g.transpose(g.input("x", (6, 9), F32)))),
                max_nmse=0.0, values={"x": _ties_and_infinities})


def cumsum_cases() -> Iterator[Case]:
    for shape in ((3, 4, 5, 10), (3, 4, 5, 127), (3, 4, 5, 128), (3, 4, 5, 1023), (4, 20481), (201 * 1204,)):
        yield build("cumsum", params(type="f32", ne=shape),
                    lambda g, shape=shape: g.output("out", g.cumsum(g.input("x", shape, F32))))
    yield build("cumsum", params(type="f32", ne=(6, 300)),
                lambda g: g.output("out", g.cumsum(g.input("x", ("T", 300), F32))), ("T",), bindings={"T": 6})
    yield build("cumsum", params(type="f32", ne=(2, 7, 5), v="transposed"),
                lambda g: g.output("out", g.cumsum(g.transpose(g.input("x", (2, 5, 7), F32)))))
