"""Errors of graph construction and evaluation: each names what was wrong and with which value."""

from __future__ import annotations

import numpy as np
import pytest

from llamir.ir import BF16, F16, F32, I32, Q4_0, GraphBuilder, IRError, ops, run_graph
from llamir.ir.interp import InterpError, Interpreter
from llamir.ir.interp_kernels import KERNELS


def test_every_op_can_be_evaluated():
    missing = [name for name, cls in ops.OPS.items()
               if not cls.is_leaf and not cls.is_view and cls not in KERNELS]
    assert missing == []


def _silu_graph(dims=("T",), shape=("T", 4), dtype=F32):
    g = GraphBuilder("t", dims=list(dims))
    g.output("y", g.silu(g.input("x", list(shape), dtype)))
    return g.graph


def test_missing_leaf_value():
    with pytest.raises(InterpError, match=r"no value for input 'x' \(f32\[T,4\]\)"):
        run_graph(_silu_graph(), {}, {"T": 2})


@pytest.mark.parametrize("value,bindings", [
    (np.zeros((3, 4), np.float32), {"T": 2}),          # wrong row count for T
    (np.zeros((2, 5), np.float32), {"T": 2}),          # wrong row length
    (np.zeros((8,), np.float32), {"T": 2}),            # wrong rank
    (np.zeros((2, 4), np.float64), {"T": 2}),          # wrong dtype
    (np.zeros((2, 4), np.float16), {"T": 2}),
])
def test_wrong_leaf_value(value, bindings):
    want = r"input 'x': expected f32\[T,4\] \(storage \(2, 4\) float32\), got"
    with pytest.raises(InterpError, match=want):
        run_graph(_silu_graph(), {"x": value}, bindings)


@pytest.mark.parametrize("dtype,storage", [(F16, (3, 32)), (BF16, (3, 32)), (Q4_0, (3, 18))])
def test_leaf_storage_forms(dtype, storage):
    """f16 as float16, bf16 as uint16 bits, quantized rows as bytes."""
    g = GraphBuilder("t")
    g.output("y", g.cast(g.weight("w", [3, 32], dtype), F32))
    good = np.zeros(storage, dtype=np.float16 if dtype == F16 else np.uint16 if dtype == BF16 else np.uint8)
    assert run_graph(g.graph, {"w": good})["y"].shape == (3, 32)
    with pytest.raises(InterpError, match=rf"weight 'w': expected {dtype.name}\[3,32\]"):
        run_graph(g.graph, {"w": np.zeros((3, 32), np.float32)})


def test_unbound_dim_is_named():
    with pytest.raises(InterpError, match=r"dim 'T' has no value"):
        run_graph(_silu_graph(), {"x": np.zeros((2, 4), np.float32)})


def test_undeclared_dim_is_rejected_at_build_time():
    g = GraphBuilder("t", dims=["T"])
    with pytest.raises(IRError, match=r"dim 'n_kv' of f32\[n_kv,4\] is not declared by graph t"):
        g.input("x", ["n_kv", 4], F32)
    with pytest.raises(KeyError, match="declares no dim 'S'"):
        g.dim("S")


def test_an_input_from_another_graph_is_rejected():
    a, b = GraphBuilder("a"), GraphBuilder("b")
    x = a.input("x", [4], F32)
    with pytest.raises(IRError, match=r"silu: input <leaf f32\[4\] \"x\"> belongs to another graph"):
        b.silu(x)


def test_arity_is_checked():
    g = GraphBuilder("t")
    x = g.input("x", [4], F32)
    with pytest.raises(IRError, match="add takes 2 inputs, got 1"):
        g.op(ops.Add(), x)
    with pytest.raises(IRError, match="soft_max_ext takes 2 inputs, got 1"):
        g.op(ops.SoftMaxExt(mask=True), x)


@pytest.mark.parametrize("op", [ops.RmsNorm, ops.Norm, ops.L2Norm, ops.OPS["rms_norm_mul"], ops.OPS["norm_mul_add"]])
@pytest.mark.parametrize("eps", [float("nan"), -1e-6])
def test_norm_eps_must_be_non_negative(op, eps):
    """ggml's norm kernels GGML_ASSERT(eps >= 0.0f); a NaN eps (from a corrupt GGUF) fails it too."""
    g = GraphBuilder("t")
    x = g.input("x", [2, 4], F32)
    weights = [g.weight(f"w{i}", [4], F32) for i in range(op(eps=eps).n_inputs() - 1)]
    with pytest.raises(IRError, match=rf"{op.name}: eps must be >= 0 \(not NaN\), got {eps}"):
        g.op(op(eps=eps), x, *weights)
    g.op(op(eps=0.0), x, *weights)


def test_group_norm_needs_a_group():
    g = GraphBuilder("t")
    x = g.input("x", [2, 4, 3, 2], F32)
    with pytest.raises(IRError, match=r"group_norm: n_groups must be >= 1, got 0"):
        g.op(ops.GroupNorm(n_groups=0), x)


def test_bad_leaf_kind():
    with pytest.raises(IRError, match="leaf kind must be one of"):
        ops.Leaf("constant")


def test_run_time_errors_name_the_node():
    g = GraphBuilder("t")
    rows = g.get_rows(g.weight("emb", [4, 2], F32), g.input("tok", [3], I32), name="inp_embd")
    g.output("y", rows)
    with pytest.raises(InterpError, match=r"get_rows inp_embd \(f32\[3,2\]\): get_rows index 7 at \[2\]"):
        run_graph(g.graph, {"emb": np.zeros((4, 2), np.float32), "tok": np.array([0, 1, 7], np.int32)})


def test_observe_sees_named_nodes_in_order():
    g = GraphBuilder("t")
    a = g.silu(g.input("x", [2], F32), name="a")
    b = g.scale(a, 2.0)                                    # unnamed: not observed
    g.output("y", g.unary("exp", b, name="c"))
    seen = []
    Interpreter().run(g.graph, {"x": np.ones(2, np.float32)},
                      observe=lambda n, v: seen.append((n.name, v.copy())))
    assert [name for name, _ in seen] == ["a", "c"]
    np.testing.assert_allclose(seen[0][1], 1 / (1 + np.exp(-1.0)), rtol=1e-6)


def test_observe_stop_does_not_crash_on_unevaluated_outputs():
    g = GraphBuilder("t")
    a = g.silu(g.input("x", [2], F32), name="a")
    g.output("a", a)
    g.output("y", g.unary("exp", a, name="c"))
    # as ggml_backend_sched_compute_splits: a callback returning false ends the computation, which
    # still succeeds; the outputs computed so far come back
    out = Interpreter().run(g.graph, {"x": np.ones(2, np.float32)}, observe=lambda n, v: n.name != "a")
    assert "y" not in out and "a" in out


def test_soft_max_of_a_vector_with_a_mask_infers_one_row():
    """A 1-D x has one row (ggml's ne[1] = 1); reading its shape[-2] raised IndexError."""
    b = GraphBuilder("g")
    x, m = b.input("x", [8], F32), b.input("m", [8], F32)
    y = b.op(ops.SoftMaxExt(scale=1.0, max_bias=0.0, mask=True, sinks=False), x, m)
    assert y.type.shape == (8,)
