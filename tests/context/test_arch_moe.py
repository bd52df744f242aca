"""Mixture-of-experts architectures against llama.cpp on random-weight GGUF files: Mixtral-style llama
(softmax router, top-k, renormalised weights), qwen2moe (no renormalisation, a sigmoid-gated shared
expert) and qwen3moe (q/k norms, renormalised). The numpy reference and the LLVM backend run the
oracle build's numerics profile, so logits are bit-exact in every feeding mode and greedy tokens are
identical; on a simulated device, with or without the experts overridden to the CPU, the logits are
the CPU's bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

import llamir
from llamir.cli import main
from llamir.frontend.placement import PlacementParams
from llamir.frontend.synth import SynthSpec, write_model
from llamir.testing.conformance import (
    MODES,
    device_logits,
    greedy_pair,
    llama_cpp_logits,
    llamir_logits,
    llvm_mismatches,
)

pytestmark = pytest.mark.llama_cpp

MOE = {"n_expert": 4, "n_expert_used": 2}
# the LLVM backend runs mul_mat_id on f32, f16, q8_0 and q4_0 experts (not bf16 or K-quants)
MODELS = {
    "llama-moe-f32": SynthSpec(arch="llama", dtype="f32", seed=7, **MOE),
    "llama-moe-q4_0-tied": SynthSpec(arch="llama", dtype="q4_0", n_head_kv=4, tied=True, seed=8, **MOE),
    "qwen2moe-f32": SynthSpec(arch="qwen2moe", dtype="f32", n_ff_exp=64, n_ff_shexp=96, seed=7),
    "qwen2moe-q8_0": SynthSpec(arch="qwen2moe", dtype="q8_0", seed=9, n_expert=8, n_expert_used=2),
    "qwen3moe-f16": SynthSpec(arch="qwen3moe", dtype="f16", n_ff_exp=64, seed=7),
    "qwen3moe-q4_0": SynthSpec(arch="qwen3moe", dtype="q4_0", n_head_kv=4, seed=10),
}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    root, paths = tmp_path_factory.mktemp("moe"), {}

    def get(name: str):
        if name not in paths:
            paths[name] = write_model(root / f"{name}.gguf", MODELS[name])
        return paths[name]

    return get


def test_experts_replace_the_dense_ffn(model_path):
    llama = llamir.load_model(model_path("llama-moe-f32"))
    assert llama.hparams.n_expert == 4 and not llama.has_tensor("blk.0.ffn_gate.weight")
    assert llama.tensor("blk.1.ffn_up_exps.weight").shape == (4, 128, 64)     # n_ff wide
    qwen2 = llamir.load_model(model_path("qwen2moe-f32"))
    assert (qwen2.hparams.n_ff_exp, qwen2.hparams.n_ff_shexp) == (64, 96)
    assert qwen2.tensor("blk.0.ffn_down_exps.weight").shape == (4, 64, 64)
    assert qwen2.tensor("blk.0.ffn_gate_inp_shexp.weight").shape == (64,)
    qwen2_default = llamir.load_model(model_path("qwen2moe-q8_0"))            # no width keys: llama.cpp's defaults
    assert qwen2_default.tensor("blk.0.ffn_up_exps.weight").shape == (8, 128 // 2, 64)
    assert qwen2_default.tensor("blk.0.ffn_up_shexp.weight").shape == (128, 64)


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_llama_cpp_exactly_in_every_feeding_mode(model_path, nmse, name):
    path = model_path(name)
    model = llamir.load_model(path)
    errors = {mode: nmse(llamir_logits(model, mode, "numpy"), llama_cpp_logits(path=path, mode=mode))
              for mode in MODES}
    assert all(err == 0.0 for err in errors.values()), f"{name}: NMSE per mode {errors}"
    assert llama_cpp_logits(path=path, mode="batch").std() > 0.5


@pytest.mark.parametrize("name", ["llama-moe-f32", "qwen2moe-f32", "qwen3moe-q4_0"])
def test_greedy_generation_is_token_identical(model_path, name):
    got, want = greedy_pair(model_path(name), "numpy")
    assert got == want


@pytest.mark.parametrize("name", MODELS)
def test_llvm_logits_equal_numpy_and_llama_cpp(model_path, conformance_llvm, name):
    moved = llvm_mismatches(model_path(name), conformance_llvm)
    assert not moved, "\n".join(moved)


@pytest.mark.parametrize("name", ["llama-moe-q4_0-tied", "qwen2moe-q8_0", "qwen3moe-f16"])
def test_llvm_greedy_generation_is_token_identical(model_path, conformance_llvm, name):
    got, want = greedy_pair(model_path(name), conformance_llvm)
    assert got == want


@pytest.mark.parametrize("name,backend", [("llama-moe-q4_0-tied", "llvm"), ("qwen2moe-q8_0", "numpy"),
                                          ("qwen2moe-q8_0", "llvm"), ("qwen3moe-f16", "numpy")])
def test_a_simulated_device_gives_the_cpu_logits_with_experts_on_either(model_path, backend, name):
    model = llamir.load_model(model_path(name))
    _, want = device_logits(model, backend=backend)
    offloaded, got = device_logits(model, ["sim:gpu0"], PlacementParams(n_gpu_layers=2), backend)
    experts_on_cpu, got_cpu_experts = device_logits(
        model, ["sim:gpu0"], PlacementParams(overrides=((r"ffn_.*_exps", "cpu"),)), backend)
    for rows in (got, got_cpu_experts):
        for g, w in zip(rows, want, strict=True):
            np.testing.assert_array_equal(g, w)
    # each layer's experts leave the device and come back: two more splits per layer
    assert experts_on_cpu.n_splits["tg"] >= offloaded.n_splits["tg"] + 2 * model.hparams.n_layer


def test_splits_cli_runs_with_experts_overridden_to_the_cpu(model_path, capsys):
    assert main(["splits", str(model_path("qwen2moe-q8_0")), "--device", "sim:gpu0", "-ot", "ffn_.*_exps=cpu",
                 "--n-ctx", "64"]) == 0
    out = capsys.readouterr().out
    assert "input ffn_moe_topk-0 from gpu0 -> cpu" in out and "input ffn_moe_down-1 from cpu -> gpu0" in out
