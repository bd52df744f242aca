"""Whole models on the numpy reference against llama.cpp on the same random-weight GGUF files.

The reference runs the numerics profile of the installed llama.cpp build (oracle_numerics(), read
from its llama_print_system_info), so every comparison is exact: NMSE 0 in each of the three
feeding modes, and greedy generation token for token. Every weight type (f32, f16, bf16, q8_0,
q4_0, q4_1, q5_0, q5_1, q2_k..q6_k), llama/qwen2/qwen3/gemma3, f16/f32/quantized KV caches,
flash attention on and off, rope scaling.
"""

from __future__ import annotations

import pytest

import llamir
from llamir.testing.conformance import (
    ATTENTION,
    CASES,
    MODES,
    QUANT_KV_MODELS,
    Case,
    greedy_pair,
    llama_cpp_logits,
    llamir_logits,
)

pytestmark = pytest.mark.llama_cpp

# the shared covering set, plus MHA/GQA/tied corners the shared set does not meet
LOGIT_CASES = CASES + [Case("llama", "q8_0", 4, True), Case("qwen3", "f32", 4, True), Case("qwen2", "q4_1", 1, True)]


def _errors(nmse, model, path, modes=MODES, **settings) -> dict[str, float]:
    """NMSE of the reference against llama.cpp per feeding mode (all modes run, so a failure
    lists every mode that moved)."""
    fa = settings.pop("flash_attn", False)
    return {mode: nmse(llamir_logits(model, mode, "numpy", flash_attn="on" if fa else "off", **settings),
                       llama_cpp_logits(mode=mode, path=path, flash_attn=fa, **settings)) for mode in modes}


def _assert_exact(errors: dict[str, float], what: str) -> None:
    moved = {mode: f"{err:.3g}" for mode, err in errors.items() if err != 0.0}
    assert not moved, f"{what}: not bit-exact with llama.cpp, NMSE per mode {moved}"


@pytest.mark.parametrize("case", LOGIT_CASES, ids=[c.id for c in LOGIT_CASES])
def test_logits_match_llama_cpp_in_every_feeding_mode(conformance_model, nmse, case):
    path = conformance_model(case)
    _assert_exact(_errors(nmse, llamir.load_model(path), path), case.id)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_greedy_generation_is_token_identical(conformance_model, case):
    got, want = greedy_pair(conformance_model(case), "numpy")
    assert got == want


@pytest.mark.parametrize("setting", ATTENTION)
@pytest.mark.parametrize("dtype", ["f32", "q4_1"])
def test_f32_kv_cache_and_flash_attention_match(conformance_model, nmse, dtype, setting):
    path = conformance_model(Case("llama", dtype, 2, False))
    _assert_exact(_errors(nmse, llamir.load_model(path), path, **ATTENTION[setting]), setting)


@pytest.mark.parametrize("type_kv", ["q8_0", "q4_0"])
@pytest.mark.parametrize("name", QUANT_KV_MODELS)
def test_quantized_kv_cache_with_flash_attention_matches(conformance_model, nmse, name, type_kv):
    """K and V stored as q8_0/q4_0 blocks (flash attention is required for a quantized V); with head
    size 64 llama.cpp stores them Hadamard-rotated."""
    path = conformance_model(name)
    errors = _errors(nmse, llamir.load_model(path), path, ("batch", "incremental"), flash_attn=True,
                     type_k=type_kv, type_v=type_kv)
    _assert_exact(errors, f"{type_kv} KV cache")


@pytest.mark.parametrize("scaling", ["yarn", "linear"])
def test_rope_scaling_matches_llama_cpp(conformance_model, nmse, scaling):
    """YaRN (with seed 000's attention-factor correction) and linear scaling from the model's keys."""
    path = conformance_model(f"qwen2-{scaling}")
    model = llamir.load_model(path)
    assert model.hparams.rope_scaling_type_train == scaling and model.hparams.rope_freq_scale_train == 0.25
    _assert_exact(_errors(nmse, model, path), scaling)


@pytest.mark.parametrize("flash_attn", [False, True])
def test_gemma3_sliding_window_matches_llama_cpp(conformance_model, nmse, flash_attn):
    """An iSWA model: window layers use their own cache, mask and rope base."""
    path = conformance_model("gemma3-iswa")
    model = llamir.load_model(path)
    assert model.hparams.swa_layers == (True,) * 5 + (False, True)
    _assert_exact(_errors(nmse, model, path, flash_attn=flash_attn), "gemma3 iSWA")
