"""dce and cse: what they remove, what they must keep (side effects, outputs, names), and that
the numpy interpreter gives the same outputs before and after."""

from __future__ import annotations

import numpy as np

from llamir.ir import F32, I64, GraphBuilder, parse_graph, print_graph, run_graph, verify
from llamir.passes.pipeline import run_pipeline


def _values(seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((3, 8)).astype(np.float32),
            "w": rng.standard_normal(8).astype(np.float32)}


def test_dce_removes_unused_nodes_and_keeps_outputs():
    b = GraphBuilder("g")
    x, w = b.input("x", [3, 8], F32), b.weight("w", [8], F32)
    y = b.mul(x, w)
    b.silu(y)                                     # dead
    b.output("y", b.add(y, x))
    g = b.graph
    assert run_pipeline(g, "dce", verify_each=True)
    assert [n.op.name for n in g.nodes] == ["mul", "add"]
    assert not run_pipeline(g, "dce")             # a fixed point reports no change


def test_dce_keeps_set_rows_into_state():
    b = GraphBuilder("g")
    cache = b.state("cache", [4, 8], F32)
    src, idx = b.input("x", [2, 8], F32), b.input("idx", [2], I64)
    b.set_rows(cache, src, idx)                   # no output reads it: its write is the point
    b.output("y", b.scale(src, 2.0))
    g = b.graph
    run_pipeline(g, "dce", verify_each=True)
    assert [n.op.name for n in g.nodes] == ["set_rows", "scale"]


def test_cse_merges_equal_ops_and_their_users():
    b = GraphBuilder("g")
    x, w = b.input("x", [3, 8], F32), b.weight("w", [8], F32)
    a1, a2 = b.mul(x, w), b.mul(x, w)
    s1, s2 = b.silu(a1), b.silu(a2)               # equal only once a1 and a2 are merged
    b.output("y", b.add(s1, s2))
    g = b.graph
    before = run_graph(parse_graph(print_graph(g)), _values())
    assert run_pipeline(g, "cse,dce", verify_each=True)
    assert [n.op.name for n in g.nodes] == ["mul", "silu", "add"]
    np.testing.assert_array_equal(run_graph(g, _values())["y"], before["y"])


def test_cse_keeps_differently_named_values_and_distinct_attributes():
    b = GraphBuilder("g")
    x = b.input("x", [3, 8], F32)
    b.output("a", b.scale(x, 2.0, name="first"))
    b.output("b", b.scale(x, 2.0, name="second"))
    b.output("c", b.scale(x, 3.0))
    g = b.graph
    assert not run_pipeline(g, "cse")
    verify(g)


def test_cse_moves_an_output_to_the_kept_node():
    b = GraphBuilder("g")
    x = b.input("x", [3, 8], F32)
    keep = b.silu(x)
    b.output("y", b.silu(x))
    g = b.graph
    assert run_pipeline(g, "cse,dce", verify_each=True)
    assert g.outputs["y"] is keep and len(g.nodes) == 1
