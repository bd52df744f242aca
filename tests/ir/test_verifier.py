"""verify(): accepts well-formed graphs and names the value at fault for each kind of corruption."""

from __future__ import annotations

import pytest

from llamir.ir import F16, F32, I32, GraphBuilder, TensorType, VerifyError, ops, parse_graph, verify
from llamir.ir.ops import IRError


def block() -> GraphBuilder:
    """A small llama-like attention block with symbolic T and n_kv."""
    b = GraphBuilder("block", dims=["T", "n_kv"])
    T, n_kv = b.dim("T"), b.dim("n_kv")
    x = b.input("x", ["T", 16], F32)
    pos = b.input("pos", ["T"], I32)
    cache = b.state("cache_k", [32, 2, 8], F16)
    h = b.rms_norm(x, 1e-6, name="attn_norm")
    h = b.mul(h, b.weight("attn_norm.weight", [16], F32))
    q = b.reshape(b.mul_mat(b.weight("wq", [16, 16], F16), h), T, 2, 8)          # [T, 2, 8]
    q = b.rope_ext(q, pos, n_dims=8, mode=ops.ROPE_NEOX, n_ctx_orig=512, freq_base=1e4)
    b.set_rows(b.view(cache, [32, 16], [32, 2]), b.reshape(q, T, 16), b.input("kv_idx", ["T"], I32))
    k = b.view(cache, [n_kv, 2, 8], [32, 16, 2])                                  # [n_kv, 2, 8]
    kq = b.mul_mat(b.permute(k, 1, 0, 2), b.permute(q, 1, 0, 2))                 # [2, T, n_kv]
    b.output("probs", b.soft_max_ext(kq, b.input("mask", ["T", "n_kv"], F32), 0.35))
    b.output("inner", b.view(b.view(cache, [2, 8], [16, 2], offset=32), [8], [2], offset=4))
    return b


def test_accepts_well_formed_graphs():
    g = block().graph
    verify(g)
    verify(parse_graph(str(g)))
    empty = GraphBuilder("empty").graph
    verify(empty)
    b = GraphBuilder("edge")
    x = b.input("x", [3, 4], F32)
    b.view(x, [3, 4], [16, 4])                                     # the whole buffer
    b.view(x, [1, 4], [16, 4], offset=32)                          # the last row exactly
    b.view(x, [0, 4], [16, 4], offset=48)                          # empty views read nothing
    verify(b.graph)


def test_rejects_broken_topological_order():
    g = block().graph
    g.nodes[0], g.nodes[1] = g.nodes[1], g.nodes[0]                # the mul moves before its rms_norm
    with pytest.raises(VerifyError, match=r"node 0 \(<mul f32\[T,16\]>\) uses <rms_norm .*\"attn_norm\"> "
                                          r"before it is defined"):
        verify(g)


def test_rejects_a_wrong_type():
    g = block().graph
    norm = g.find("attn_norm")
    norm.type = TensorType(norm.type.shape, F16)
    with pytest.raises(VerifyError, match=r"node 0 .* is typed f16\[T,16\] but its op infers f32\[T,16\]"):
        verify(g)


def test_rejects_a_changed_attribute_that_no_longer_type_checks():
    g = block().graph
    permute = next(n for n in g.nodes if n.is_op(ops.Permute))
    permute.op = ops.Permute(axes=(0, 0, 1))
    with pytest.raises(VerifyError, match=r"permute: axes \(0, 0, 1\) do not permute rank 3"):
        verify(g)


def test_rejects_swapped_inputs():
    g = block().graph
    mm = next(n for n in g.nodes if n.is_op(ops.MulMat))
    mm.inputs = mm.inputs[::-1]
    with pytest.raises(VerifyError, match=r"is typed f32\[T,16\] but its op infers f32\[16,T\]"):
        verify(g)


@pytest.mark.parametrize("corrupt", ["extra", "missing", "cleared"])
def test_rejects_stale_users_lists(corrupt):
    g = block().graph
    x = g.leaf("x")
    if corrupt == "extra":
        x.users.append(g.nodes[-1])
    elif corrupt == "missing":
        g.find("attn_norm").users.pop()
    else:
        g.leaf("cache_k").users.clear()
    with pytest.raises(VerifyError, match=r"lists \d+ users but \d+ nodes use it"):
        verify(g)
    g.rebuild_users()
    verify(g)


def test_rejects_undeclared_dims():
    g = block().graph
    g.dim_names = ("T",)
    with pytest.raises(VerifyError, match=r"uses undeclared dim 'n_kv'"):
        verify(g)


@pytest.mark.parametrize("shape,strides,offset,message", [
    ([3, 4], [16, 4], 4, r"reads bytes \[4, 52\) of a 48-byte f32\[3,4\]"),
    ([4, 4], [16, 4], 0, r"reads bytes \[0, 64\) of a 48-byte"),
    ([2, 4], [32, 4], 16, r"reads bytes \[16, 64\) of a 48-byte"),
    ([1, 4], [16, 4], -4, r"reads bytes \[-4, 12\)"),
])
def test_rejects_out_of_bounds_concrete_views(shape, strides, offset, message):
    b = GraphBuilder("t")
    b.view(b.input("x", [3, 4], F32), shape, strides, offset=offset)    # the builder does not check bounds
    with pytest.raises(VerifyError, match=message):
        verify(b.graph)


def test_rejects_leaves_and_nodes_in_the_wrong_list():
    g = block().graph
    g.nodes.insert(0, g.leafs.pop(0))
    with pytest.raises(VerifyError, match=r"leaf <leaf f32\[T,16\] \"x\"> is in the node list"):
        verify(g)
    g = block().graph
    g.leafs.append(g.nodes.pop(0))
    with pytest.raises(VerifyError, match=r"<rms_norm .*> is in the leaf list but is an op node"):
        verify(g)


def test_rejects_values_and_outputs_from_elsewhere():
    g = block().graph
    other = block().graph
    g.nodes[0].inputs = (other.leaf("x"),)
    with pytest.raises(VerifyError, match=r"node 0 .* uses <leaf f32\[T,16\] \"x\">"):
        verify(g)
    g = block().graph
    g.set_output("stray", other.nodes[0])
    with pytest.raises(VerifyError, match=r"output 'stray' is not a value of the graph"):
        verify(g)


def test_verify_error_is_an_ir_error():
    assert issubclass(VerifyError, IRError)


def test_rejects_duplicate_leaf_names():
    b = GraphBuilder("t")
    b.add(b.input("x", [4], F32), b.weight("x", [4], F32))
    with pytest.raises(VerifyError, match="x"):
        verify(b.graph)


def test_rejects_unnamed_leaves():
    b = GraphBuilder("t")
    b.silu(b.input("x", [4], F32))
    b.graph.leafs[0].name = None
    with pytest.raises(VerifyError, match=r"leaf <leaf f32\[4\]> has no name; leaves are bound by name"):
        verify(b.graph)


def test_rejects_undeclared_dims_in_attributes():
    """A view's offset or strides may be symbolic; the dims they name must be the graph's."""
    from llamir.ir import dims

    g = block().graph
    inner = g.outputs["inner"]
    inner.op = ops.View(shape=inner.op.shape, strides=inner.op.strides, offset=dims.mul(4, dims.sym("T")))
    verify(g)
    inner.op = ops.View(shape=inner.op.shape, strides=inner.op.strides, offset=dims.mul(4, dims.sym("S")))
    with pytest.raises(VerifyError, match=r"<view f16\[8\]>: attribute offset=4\*S uses undeclared dim 'S'"):
        verify(g)


def test_rejects_types_no_tensor_can_have():
    """ggml_new_tensor asserts whole quantized blocks per row; sizes must fit ggml's int64 counts."""
    from llamir.ir import Q4_0

    for shape, message in [([4, 48], r"a q4_0 row of 48 elements is not a whole number of 32-element blocks"),
                           ([4, "T"], r"a q4_0 row needs a concrete length, got T")]:
        b = GraphBuilder("t", dims=["T"])
        b.weight("w", shape, Q4_0)                                   # the builder does not check
        with pytest.raises(VerifyError, match=message):
            verify(b.graph)
    b = GraphBuilder("t", dims=["T"])
    b.input("x", ["T", 2**61, 2], F32)
    with pytest.raises(VerifyError, match=r"f32\[T,2305843009213693952,2\] takes 18446744073709551616 bytes"):
        verify(b.graph)
