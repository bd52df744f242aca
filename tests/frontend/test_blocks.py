"""Shared building blocks of the architectures, against plain numpy: the MoE ffn
(build_moe_ffn: router, top-k, weights, experts, sum) and softcapping."""

from __future__ import annotations

import numpy as np
import pytest

import llamir
from llamir.frontend.graph_context import GraphContext
from llamir.frontend.synth import SynthSpec, write_model
from llamir.ir import F32, Interpreter


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    model = llamir.load_model(write_model(tmp_path_factory.mktemp("blocks") / "m.gguf", SynthSpec(n_layer=1)))
    return llamir.Context(model, n_ctx=64)


def _silu(x):
    return x / (1 + np.exp(-x))


def moe_reference(x, gate_inp, up, gate, down, k, gating, norm_w, w_scale):
    logits = x.astype(np.float64) @ gate_inp.T.astype(np.float64)                      # [T, E]
    if gating == "softmax":
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
    elif gating == "sigmoid":
        probs = 1 / (1 + np.exp(-logits))
    else:
        probs = logits
    out = np.zeros((x.shape[0], down.shape[1]))
    for t in range(x.shape[0]):
        sel = np.argsort(-probs[t], kind="stable")[:k]
        w = probs[t, sel]
        if gating == "softmax_weight":
            w = np.exp(w - w.max())
            w /= w.sum()
        if norm_w:
            w = w / max(w.sum(), 6.103515625e-5)
        if w_scale is not None:
            w = w * w_scale
        for j, e in enumerate(sel):
            h = _silu(gate[e] @ x[t]) * (up[e] @ x[t])
            out[t] += w[j] * (down[e] @ h)
    return out


@pytest.mark.parametrize("gating,norm_w,w_scale,k", [
    ("softmax", False, None, 2), ("softmax", True, None, 2), ("sigmoid", True, 2.5, 3),
    ("softmax_weight", False, None, 2), ("softmax", False, None, 1),
])
def test_moe_ffn(ctx, gating, norm_w, w_scale, k):
    rng = np.random.default_rng(7)
    T, E, n_embd, n_ff = 5, 4, 16, 24
    g = GraphContext(ctx.model, ctx.graph_config(True))
    b = g.b
    x = b.input("x", [T, n_embd], F32)
    gate_inp = b.weight("gate_inp", [E, n_embd], F32)
    up, gate = b.weight("up", [E, n_ff, n_embd], F32), b.weight("gate", [E, n_ff, n_embd], F32)
    down = b.weight("down", [E, n_embd, n_ff], F32)
    b.output("y", g.moe_ffn(x, gate_inp, up, gate, down, k, gating=gating, norm_w=norm_w, w_scale=w_scale))
    values = {"x": rng.standard_normal((T, n_embd)), "gate_inp": rng.standard_normal((E, n_embd)),
              "up": rng.standard_normal((E, n_ff, n_embd)) * 0.3, "gate": rng.standard_normal((E, n_ff, n_embd)) * 0.3,
              "down": rng.standard_normal((E, n_embd, n_ff)) * 0.3}
    values = {name: v.astype(np.float32) for name, v in values.items()}
    got = Interpreter(exact=False).run(b.graph, values)["y"]
    want = moe_reference(values["x"], values["gate_inp"], values["up"], values["gate"], values["down"], k, gating,
                         norm_w, w_scale)
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)


def test_softcap(ctx):
    g = GraphContext(ctx.model, ctx.graph_config(True))
    x = g.b.input("x", [3, 8], F32)
    g.b.output("y", g.softcap(x, 30.0))
    xs = np.linspace(-200, 200, 24, dtype=np.float32).reshape(3, 8)
    np.testing.assert_allclose(Interpreter().run(g.b.graph, {"x": xs})["y"], 30 * np.tanh(xs / 30), rtol=1e-5)


def test_fused_qkv_cuts_q_k_v(ctx):
    hp = ctx.model.hparams
    g = GraphContext(ctx.model, ctx.graph_config(True))
    T, n_q, n_kv = 3, hp.n_embd_head_k * hp.n_head(0), hp.n_embd_k_gqa(0)
    x = g.b.input("x", [g.T, hp.n_embd], F32)
    w = g.b.weight("wqkv", [n_q + 2 * n_kv, hp.n_embd], F32)
    bias = g.b.weight("bqkv", [n_q + 2 * n_kv], F32)
    q, k, v = g.qkv_fused(0, x, w, bias)
    for name, node in (("q", q), ("k", k), ("v", v)):
        g.b.output(name, node)
    rng = np.random.default_rng(3)
    vals = {"x": rng.standard_normal((T, hp.n_embd)).astype(np.float32),
            "wqkv": rng.standard_normal((n_q + 2 * n_kv, hp.n_embd)).astype(np.float32),
            "bqkv": rng.standard_normal(n_q + 2 * n_kv).astype(np.float32)}
    out = Interpreter(exact=False).run(g.b.graph, vals, {"T": T})
    full = vals["x"] @ vals["wqkv"].T + vals["bqkv"]
    np.testing.assert_allclose(out["q"].reshape(T, -1), full[:, :n_q], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out["k"].reshape(T, -1), full[:, n_q:n_q + n_kv], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out["v"].reshape(T, -1), full[:, n_q + n_kv:], rtol=1e-4, atol=1e-4)
    assert q.shape[1:] == (hp.n_head(0), hp.n_embd_head_k) and v.shape[1:] == (hp.n_head_kv(0), hp.n_embd_head_v)
