"""The contract a model builder hands the context: the graph, its inputs as typed specs, the
memory layouts it uses and the layer of every value (recorded while building, not parsed
from names)."""

from __future__ import annotations

import re

import pytest

import llamir
from llamir.context.graph_inputs import INPUT_KINDS, build_inputs
from llamir.frontend.built import INPUT_LAYER, InputSpec
from llamir.frontend.synth import SynthSpec, write_model
from llamir.ir.bind import bind_dims


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request, tmp_path_factory):
    extra = {"sliding_window": 8, "swa_pattern": 2, "n_embd": 64, "n_head": 2, "n_head_kv": 1} \
        if request.param == "gemma3" else {}
    path = write_model(tmp_path_factory.mktemp("built") / f"{request.param}.gguf",
                       SynthSpec(arch=request.param, n_layer=3, **extra))
    return llamir.load_model(path)


def _built(model, **kw):
    ctx = llamir.Context(model, n_ctx=128, **kw)
    return ctx, model.build_graph(ctx.graph_config(has_tokens=True))


def test_inputs_are_typed_specs(model):
    ctx, built = _built(model, flash_attn="off")
    kinds = [spec.kind for spec in built.inputs]
    assert set(kinds) >= {"embd", "pos", "out_ids"} and kinds.count("attn_kv") == len(built.memory)
    leaves = {leaf.name for leaf in built.graph.leafs_of_kind("input")}
    assert {name for spec in built.inputs for name in spec.leaves} == leaves   # every input has its spec
    assert built.input("embd").param("has_tokens") is True
    suffixes = sorted(spec.param("suffix") for spec in built.inputs if spec.kind == "attn_kv")
    assert suffixes == sorted(layout.suffix for layout in built.memory)
    assert set(kinds) <= set(INPUT_KINDS)


def test_every_value_has_the_layer_it_was_built_in(model):
    _, built = _built(model, flash_attn="off")
    graph, layers, n_layer = built.graph, built.layers, model.hparams.n_layer
    layer_of = layers.of(graph)
    for node in graph.nodes:
        m = re.fullmatch(r".+-(\d+)", node.name or "")
        if m:   # llama.cpp's cb(cur, name, il) names agree with the recorded layer
            assert layer_of[id(node)] == int(m.group(1)), node.name
    for leaf in graph.leafs:
        m = re.match(r"blk\.(\d+)\.|cache_[kv]_l(\d+)", leaf.name)
        if leaf.kind == "input" or leaf.name == "token_embd.weight":
            assert layer_of[id(leaf)] == INPUT_LAYER, leaf.name
        elif m:
            assert layer_of[id(leaf)] == int(m.group(1) or m.group(2)), leaf.name
    assert layer_of[id(graph.outputs["logits"])] == n_layer == layers.output
    bound = bind_dims(graph, {d: 4 for d in graph.dim_names})
    assert [layers.of(bound)[id(n)] for n in bound.nodes] == [layer_of[id(n)] for n in graph.nodes]


def test_an_input_kind_the_context_does_not_know_is_a_clear_error(model):
    ctx, built = _built(model)
    with pytest.raises(ValueError, match="input of kind 'frobnicate' \\(x\\) that the context cannot fill"):
        build_inputs(ctx, (InputSpec("frobnicate", ("x",)), *built.inputs), None, None, None, False)


def test_a_graph_without_memory_reads_the_ubatch_mask(model):
    from dataclasses import replace

    ctx, _ = _built(model)
    built = model.build_graph(replace(ctx.graph_config(has_tokens=True), memory=()))
    assert "attn_no_cache" in [s.kind for s in built.inputs] and not built.memory
    assert "attn_kv" not in [s.kind for s in built.inputs]
