"""CompiledSplit.call_bound: running again on the arrays the last call bound, refilled in place,
gives what a full call gives, and refuses (None, nothing run) once anything else was bound: other
dims, another input or weight array, an input bound through a contiguous copy.

Oracle: the full call on the same values, and the numpy reference interpreter."""

from __future__ import annotations

import numpy as np

from llamir.ir import F16, F32, GraphBuilder, ops, run_graph

rng = np.random.default_rng(11)


def _graph(n: int = 24):
    b = GraphBuilder("g", dims=["T"])
    x, w = b.input("x", ["T", n], F32), b.weight("w", [n], F32)
    h = b.op(ops.RmsNormMul(eps=1e-5), x, w, name="norm")
    b.output("y", b.silu(b.mul_mat(b.weight("m", [16, n], F16), h), name="act"))
    return b.graph


def _values(T: int, n: int = 24):
    return {"x": rng.standard_normal((T, n)).astype(np.float32), "w": rng.standard_normal(n).astype(np.float32),
            "m": rng.standard_normal((16, n)).astype(np.float16)}


def test_call_bound_sees_inputs_refilled_in_place(llvm_backend):
    g = _graph()
    exe = llvm_backend.compile(g)
    values = _values(3)
    exe(values, {"T": 3})
    binding = exe.binding
    for _ in range(3):
        values["x"][...] = rng.standard_normal(values["x"].shape)
        out = exe.call_bound(binding)
        np.testing.assert_array_equal(out["y"], run_graph(g, values, {"T": 3})["y"])
        np.testing.assert_array_equal(out["y"], exe(values, {"T": 3})["y"])
        assert exe.binding == binding          # a full call on the same arrays binds nothing new


def test_call_bound_refuses_after_anything_else_was_bound(llvm_backend):
    g = _graph()
    exe = llvm_backend.compile(g)
    values = _values(3)
    exe(values, {"T": 3})
    binding = exe.binding
    exe(_values(5), {"T": 5})                  # other dims and arrays
    assert exe.call_bound(binding) is None
    exe(values, {"T": 3})
    binding = exe.binding
    exe({**values, "x": values["x"].copy()}, {"T": 3})   # another input array
    assert exe.call_bound(binding) is None
    exe(values, {"T": 3})
    binding = exe.binding
    exe({**values, "m": values["m"].copy()}, {"T": 3})   # another weight array
    assert exe.call_bound(binding) is None


def test_call_bound_refuses_an_input_bound_as_a_copy(llvm_backend):
    g = _graph()
    exe = llvm_backend.compile(g)
    values = _values(4)
    values["x"] = np.asfortranarray(values["x"])          # bound through a contiguous copy
    exe(values, {"T": 4})
    assert exe.call_bound(exe.binding) is None
    values["x"] = np.ascontiguousarray(values["x"])
    exe(values, {"T": 4})
    assert exe.call_bound(exe.binding) is not None

