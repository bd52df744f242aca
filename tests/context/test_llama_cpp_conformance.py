"""Whole models against llama.cpp on the same random-weight GGUF files.

Each case compares llamir's logits with llama.cpp's (llama-cpp-python, every position an output)
in three feeding modes, and greedy generation token for token. The tolerance is set from
llama.cpp's own spread on the same file: the NMSE between its f16 and f32 KV caches, which
llama.cpp treats as equivalent. Quantized models usually match bit for bit, because the
reference emulates ggml's activation quantization and x86 accumulation order.
"""

from __future__ import annotations

import pytest

import llamir
from llamir.frontend.synth import SynthSpec, write_model
from llamir.testing.conformance import (
    CASES,
    MODES,
    case_id,
    case_model,
    greedy_pair,
    llama_cpp_kv_spread,
    llama_cpp_logits,
    llamir_logits,
)

pytestmark = pytest.mark.llama_cpp
pytest.importorskip("llama_cpp")

# llamir's numpy reference follows the AVX-512 build of ggml's CPU kernels bit for bit; where
# llama.cpp was built for that ISA (this machine and CI), the logits are expected to be identical.
EXACT = "avx512f" in open("/proc/cpuinfo").read() if __import__("os").path.exists("/proc/cpuinfo") else False

# the shared covering set, plus MHA/GQA/tied corners the shared set does not meet
CASES = CASES + [("llama", "q8_0", 4, True), ("qwen3", "f32", 4, True), ("qwen2", "q4_1", 1, True)]
IDS = [case_id(c) for c in CASES]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("conformance")


@pytest.mark.parametrize("arch,dtype,n_head_kv,tied", CASES, ids=IDS)
def test_logits_match_llama_cpp_in_every_feeding_mode(model_dir, nmse, arch, dtype, n_head_kv, tied):
    path = case_model(model_dir, arch, dtype, n_head_kv, tied)
    model = llamir.load_model(path)
    spread = llama_cpp_kv_spread(path)
    assert spread > 0  # the oracle's own variation is real, so the bound below means something
    tolerance = 0.5 * spread
    for mode in MODES:
        err = nmse(llamir_logits(model, mode), llama_cpp_logits(path, mode))
        assert err <= tolerance, (f"{mode}: NMSE {err:.3g} > {tolerance:.3g} "
                                  f"(llama.cpp's f16/f32 KV spread {spread:.3g})")
        if EXACT:
            assert err == 0.0, f"{mode}: NMSE {err:.3g}: not bit-exact with llama.cpp"


@pytest.mark.parametrize("arch,dtype,n_head_kv,tied", CASES[:15], ids=IDS[:15])
def test_greedy_generation_is_token_identical(model_dir, arch, dtype, n_head_kv, tied):
    got, want = greedy_pair(case_model(model_dir, arch, dtype, n_head_kv, tied))
    assert got == want


@pytest.mark.parametrize("dtype", ["f32", "q4_1"])
def test_f32_kv_cache_and_flash_attention_match(model_dir, nmse, dtype):
    path = case_model(model_dir, "llama", dtype, 2, False)
    model = llamir.load_model(path)
    tolerance = 0.5 * llama_cpp_kv_spread(path)
    err32 = nmse(llamir_logits(model, "batch", type_kv="f32"), llama_cpp_logits(path, "batch", type_kv="f32"))
    assert err32 <= tolerance
    err_fa = nmse(llamir_logits(model, "batch", flash_attn="on"), llama_cpp_logits(path, "batch", flash_attn=True))
    assert err_fa <= tolerance


@pytest.mark.parametrize("scaling", ["yarn", "linear"])
def test_rope_scaling_matches_llama_cpp(tmp_path, nmse, scaling):
    """YaRN (with seed 000's attention-factor correction) and linear scaling from the model's keys."""
    path = write_model(tmp_path / f"{scaling}.gguf", SynthSpec(arch="qwen2", rope_scaling=scaling, n_ctx_train=8192))
    model = llamir.load_model(path)
    assert model.hparams.rope_scaling_type_train == scaling and model.hparams.rope_freq_scale_train == 0.25
    err = nmse(llamir_logits(model, "batch"), llama_cpp_logits(path, "batch"))
    assert err <= 0.5 * llama_cpp_kv_spread(path)
    if EXACT:
        assert err == 0.0


def test_gemma3_sliding_window_matches_llama_cpp(tmp_path, nmse):
    """An iSWA model: window layers use their own cache, mask and rope base."""
    path = write_model(tmp_path / "g3.gguf", SynthSpec(arch="gemma3", n_layer=7, sliding_window=8))
    model = llamir.load_model(path)
    assert model.hparams.swa_layers == (True,) * 5 + (False, True)
    for mode in ("batch", "incremental"):
        err = nmse(llamir_logits(model, mode), llama_cpp_logits(path, mode))
        assert err <= 0.5 * llama_cpp_kv_spread(path), mode
