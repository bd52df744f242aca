"""Fusion passes: golden IR before/after on a real model graph, and the numbers: the numpy
interpreter gives identical outputs for the fused and the unfused graph."""

from __future__ import annotations

import numpy as np
import pytest

import llamir
from llamir.frontend.synth import SynthSpec, write_model
from llamir.ir import F16, F32, GraphBuilder, ops, parse_graph, print_graph, run_graph
from llamir.passes.pipeline import run_pipeline

rng = np.random.default_rng(0)


def _close_to_reference(fused, original, values, bindings=None):
    want = run_graph(original, values, bindings)
    got = run_graph(fused, values, bindings)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])


def test_rms_norm_times_weight():
    b = GraphBuilder("g", dims=["T"])
    x, w = b.input("x", ["T", 64], F32), b.weight("w", [64], F32)
    b.output("y", b.mul(b.rms_norm(x, 1e-5), w, name="norm"))
    g = b.graph
    original = parse_graph(print_graph(g))
    assert run_pipeline(g, "fuse-rms-norm,dce", verify_each=True)
    assert [(n.op.name, n.name) for n in g.nodes] == [("rms_norm_mul", "norm")]
    values = {"x": rng.standard_normal((3, 64)).astype(np.float32),
              "w": rng.standard_normal(64).astype(np.float32)}
    _close_to_reference(g, original, values, {"T": 3})


def test_rms_norm_with_two_users_is_not_fused():
    b = GraphBuilder("g")
    x, w = b.input("x", [2, 16], F32), b.weight("w", [16], F32)
    n = b.rms_norm(x, 1e-5)
    b.output("y", b.add(b.mul(n, w), n))
    assert not run_pipeline(b.graph, "fuse-rms-norm")


def test_layer_norm_with_bias():
    b = GraphBuilder("g")
    x, w, bias = b.input("x", [5, 32], F32), b.weight("w", [32], F32), b.weight("b", [32], F32)
    b.output("y", b.add(b.mul(b.norm(x, 1e-5), w), bias))
    g = b.graph
    original = parse_graph(print_graph(g))
    assert run_pipeline(g, "fuse-norm,dce", verify_each=True)
    assert [n.op for n in g.nodes] == [ops.NormMulAdd(eps=1e-5, bias=True)]
    values = {"x": rng.standard_normal((5, 32)).astype(np.float32),
              "w": rng.standard_normal(32).astype(np.float32),
              "b": rng.standard_normal(32).astype(np.float32)}
    _close_to_reference(g, original, values)


def test_softmax_attention_over_a_transposed_f16_cache():
    b = GraphBuilder("g", dims=["T", "n"])
    q = b.input("q", [1, 4, "T", 16], F32)
    k = b.input("k", [1, 2, "n", 16], F16)
    v = b.input("v", [1, 2, 16, "n"], F16)
    mask = b.input("mask", [1, 1, "T", "n"], F32)
    kq = b.mul_mat(k, q)
    b.output("y", b.mul_mat(v, b.soft_max_ext(kq, mask, 0.25)))
    g = b.graph
    original = parse_graph(print_graph(g))
    assert run_pipeline(g, "fuse-attention,dce", verify_each=True)
    assert [n.op.name for n in g.nodes] == ["soft_max_attn"]
    T, n = 3, 7
    m = np.zeros((1, 1, T, n), np.float32)
    m[..., 5:] = -np.inf
    values = {"q": rng.standard_normal((1, 4, T, 16)).astype(np.float32),
              "k": rng.standard_normal((1, 2, n, 16)).astype(np.float16),
              "v": rng.standard_normal((1, 2, 16, n)).astype(np.float16), "mask": m}
    _close_to_reference(g, original, values, {"T": T, "n": n})


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("fusion") / "tiny.gguf"
    write_model(path, SynthSpec(arch="llama", n_layer=1, n_embd=64, n_head=4, n_head_kv=2, n_ff=128,
                                n_vocab=512, dtype="q4_0", seed=3))
    return llamir.load_model(path)


def test_model_graph_golden_and_numbers(tiny_model, golden):
    ctx = llamir.Context(tiny_model, n_ctx=64, n_batch=16, n_ubatch=16, flash_attn="off")
    graph = ctx.compiled_graph(ctx.graph_config(True)).graph
    fused = parse_graph(print_graph(graph))
    assert run_pipeline(fused, "cse,fuse,dce", verify_each=True)
    golden("passes/fuse_llama_q4_0.ir", print_graph(fused))
    counts = {name: sum(n.op.name == name for n in fused.nodes) for name in
              ("rms_norm_mul", "soft_max_attn", "rms_norm", "soft_max_ext")}
    assert counts == {"rms_norm_mul": 3, "soft_max_attn": 1, "rms_norm": 0, "soft_max_ext": 0}
    T = 5
    kv_size = graph.leaf("cache_k_l0").type.shape[1]
    values = {x.name: tiny_model.weight_array(x.name) for x in graph.leafs_of_kind("weight")}
    mask = np.triu(np.full((T, T), -np.inf, np.float32), 1)
    values.update({"inp_tokens": np.arange(1, T + 1, dtype=np.int32), "inp_pos": np.arange(T, dtype=np.int32),
                   "inp_out_ids": np.arange(T, dtype=np.int32),
                   "attn_inp_k_idxs": np.arange(T, dtype=np.int64),
                   "attn_inp_v_idxs": (np.arange(32)[:, None] * kv_size + np.arange(T)).reshape(-1),
                   "attn_inp_kq_mask": mask.reshape(1, 1, T, T)})
    bindings = {"T": T, "n_kv": T, "n_out": T}

    def fresh():
        out = dict(values)
        out["cache_k_l0"] = np.zeros((1, kv_size, 32), np.float16)
        out["cache_v_l0"] = np.zeros((1, 32, kv_size), np.float16)
        return out

    want = run_graph(graph, fresh(), bindings)["logits"]
    got = run_graph(fused, fresh(), bindings)["logits"]
    np.testing.assert_array_equal(got, want)
