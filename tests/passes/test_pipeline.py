"""Pipelines from strings, verification after each pass, and the Rewriter's invariants."""

from __future__ import annotations

import pytest

from llamir.ir import F32, GraphBuilder, IRError, ops, verify
from llamir.passes.base import GraphPass, Rewriter
from llamir.passes.pipeline import PassPipeline, PipelineError, run_pipeline


def _graph():
    b = GraphBuilder("g")
    x = b.input("x", [2, 4], F32)
    b.output("y", b.silu(b.scale(x, 2.0)))
    return b.graph


def test_pipeline_parses_names_and_prints_back():
    p = PassPipeline(" dce , cse,fuse-rms-norm ")
    assert str(p) == "dce,cse,fuse-rms-norm"


def test_unknown_pass_is_named_with_the_known_ones():
    with pytest.raises(PipelineError, match=r"unknown pass 'nope'.*known: .*dce"):
        PassPipeline("dce,nope")


def test_verify_each_names_the_pass_that_broke_the_graph():
    class Breaker(GraphPass):
        name = "breaker"

        def run(self, graph):
            graph.nodes.reverse()                 # users before their inputs
            return True

    g = _graph()
    with pytest.raises(IRError, match="after pass breaker"):
        PassPipeline([Breaker()]).run(g, verify_each=True)


def test_rewriter_refuses_a_type_changing_replacement_and_erasing_used_nodes():
    g = _graph()
    scale, silu = g.nodes
    rw = Rewriter(g)
    with pytest.raises(IRError, match="would change"):
        rw.replace(scale, ops.SumRows(), scale.inputs[0])
    with pytest.raises(IRError, match="still used"):
        rw.erase(scale)
    verify(g)


def test_replace_uses_reorders_users_after_a_later_value():
    b = GraphBuilder("g")
    x = b.input("x", [2, 4], F32)
    early = b.silu(x)
    user = b.scale(early, 3.0)
    late = b.unary("relu", x)
    b.output("y", b.add(user, late))
    g = b.graph
    Rewriter(g).replace_uses(early, late)
    verify(g)                                     # user now comes after late
    assert run_pipeline(g, "dce", verify_each=True)
    assert [n.op.name for n in g.nodes] == ["relu", "scale", "add"]
