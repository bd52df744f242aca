"""The printed IR of a tiny llama graph: golden text, exact round trip, stable fingerprint."""

from __future__ import annotations

import pytest

import llamir
from llamir.frontend.synth import SynthSpec, write_model
from llamir.ir import parse_graph, verify
from llamir.ir.bind import bind_dims


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("golden") / "tiny.gguf"
    spec = SynthSpec(arch="llama", n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, n_vocab=300)
    return llamir.load_model(write_model(path, spec))


def _graph(model, flash_attn="off"):
    ctx = llamir.Context(model, n_ctx=256, flash_attn=flash_attn)
    return model.build_graph(ctx.graph_config(has_tokens=True)).graph


@pytest.mark.parametrize("flash_attn", ["off", "on"])
def test_tiny_llama_ir_is_golden(tiny, golden, flash_attn):
    graph = _graph(tiny, flash_attn)
    verify(graph)
    golden(f"tiny_llama_fa_{flash_attn}.ir", str(graph))


def test_round_trip_and_fingerprint(tiny):
    graph = _graph(tiny)
    text = str(graph)
    again = parse_graph(text)
    assert again == graph and str(again) == text
    assert again.fingerprint() == graph.fingerprint() == _graph(tiny).fingerprint()
    assert _graph(tiny, "on").fingerprint() != graph.fingerprint()


def test_bound_graph_is_concrete_and_verifies(tiny):
    bound = bind_dims(_graph(tiny), {"T": 5, "n_kv": 256, "n_out": 1})
    verify(bound)
    assert bound.dim_names == ()
    assert all(v.type.is_concrete for v in bound.all_values())
    assert parse_graph(str(bound)) == bound
