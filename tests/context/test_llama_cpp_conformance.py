"""Whole models against llama.cpp on the same random-weight GGUF files.

Each case compares llamir's logits with llama.cpp's (llama-cpp-python, every position an output)
in three feeding modes, and greedy generation token for token. The tolerance is set from
llama.cpp's own spread on the same file: the NMSE between its f16 and f32 KV caches, which
llama.cpp treats as equivalent. Quantized models usually match bit for bit, because the
reference emulates ggml's activation quantization and x86 accumulation order.
"""

from __future__ import annotations

import numpy as np
import pytest

import llamir
from llamir.frontend.synth import SynthSpec, write_model

pytestmark = pytest.mark.llama_cpp
llama_cpp_oracle = pytest.importorskip("llamir.testing.llama_cpp")
pytest.importorskip("llama_cpp")

N_CTX, N_BATCH = 256, 64
# llamir's numpy reference follows the AVX-512 build of ggml's CPU kernels bit for bit; where
# llama.cpp was built for that ISA (this machine and CI), the logits are expected to be identical.
EXACT = "avx512f" in open("/proc/cpuinfo").read() if __import__("os").path.exists("/proc/cpuinfo") else False
PROMPT = [int(t) for t in np.random.RandomState(0).randint(3, 500, size=40)]

# A covering set: every arch with every weight type; GQA/MHA and tied/untied alternate so each
# meets every arch and several types.
CASES = [
    (arch, dtype, n_head_kv, tied)
    for arch in ("llama", "qwen2", "qwen3")
    for dtype, n_head_kv, tied in (("f32", 2, False), ("f16", 4, True), ("q8_0", 2, False),
                                   ("q4_0", 4, True), ("q4_1", 2, False))
]
CASES += [("llama", "q8_0", 4, True), ("qwen3", "f32", 4, True), ("qwen2", "q4_1", 1, True)]
IDS = [f"{a}-{d}-{'gqa' if h < 4 else 'mha'}{h}-{'tied' if t else 'untied'}" for a, d, h, t in CASES]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("conformance")


def _model(model_dir, arch, dtype, n_head_kv, tied):
    spec = SynthSpec(arch=arch, n_layer=2, n_embd=64, n_head=4, n_head_kv=n_head_kv, n_ff=128,
                     n_vocab=512, dtype=dtype, tied=tied, seed=7)
    path = model_dir / f"{arch}-{dtype}-{n_head_kv}-{int(tied)}.gguf"
    if not path.exists():
        write_model(path, spec)
    return path


def _ours(model, mode: str, flash_attn: str = "off", type_kv: str = "f16") -> np.ndarray:
    n_ubatch = 16 if mode == "ubatch" else N_BATCH
    ctx = llamir.Context(model, n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=n_ubatch, flash_attn=flash_attn,
                         type_k=type_kv, type_v=type_kv)
    if mode == "incremental":
        rows = []
        for i, token in enumerate(PROMPT):
            assert ctx.decode(llamir.Batch.from_tokens([token], pos0=i, logits="all")) == 0, ctx.last_error
            rows.append(ctx.get_logits_ith(-1).copy())
        return np.stack(rows)
    assert ctx.decode(llamir.Batch.from_tokens(PROMPT, logits="all")) == 0, ctx.last_error
    return ctx.get_logits().copy()


def _theirs(path, mode: str, flash_attn: bool = False, type_kv: str = "f16") -> np.ndarray:
    n_ubatch = 16 if mode == "ubatch" else N_BATCH
    with llama_cpp_oracle.LlamaCppOracle(path, n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=n_ubatch,
                                         flash_attn=flash_attn, type_k=type_kv, type_v=type_kv) as o:
        return o.eval_logits(PROMPT, mode)


def _llama_cpp_spread(path) -> float:
    """llama.cpp's own NMSE between its f16 and f32 KV caches on this file and prompt."""
    return llama_cpp_oracle.nmse(_theirs(path, "batch", type_kv="f16"), _theirs(path, "batch", type_kv="f32"))


@pytest.mark.parametrize("arch,dtype,n_head_kv,tied", CASES, ids=IDS)
def test_logits_match_llama_cpp_in_every_feeding_mode(model_dir, nmse, arch, dtype, n_head_kv, tied):
    path = _model(model_dir, arch, dtype, n_head_kv, tied)
    model = llamir.load_model(path)
    spread = _llama_cpp_spread(path)
    assert spread > 0  # the oracle's own variation is real, so the bound below means something
    tolerance = 0.5 * spread
    for mode in ("batch", "incremental", "ubatch"):
        err = nmse(_ours(model, mode), _theirs(path, mode))
        assert err <= tolerance, (f"{mode}: NMSE {err:.3g} > {tolerance:.3g} "
                                  f"(llama.cpp's f16/f32 KV spread {spread:.3g})")
        if EXACT:
            assert err == 0.0, f"{mode}: NMSE {err:.3g}: not bit-exact with llama.cpp"


@pytest.mark.parametrize("arch,dtype,n_head_kv,tied", CASES[:15], ids=IDS[:15])
def test_greedy_generation_is_token_identical(model_dir, arch, dtype, n_head_kv, tied):
    path = _model(model_dir, arch, dtype, n_head_kv, tied)
    prompt = PROMPT[:8]
    with llama_cpp_oracle.LlamaCppOracle(path, n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_BATCH) as o:
        want = o.greedy(prompt, 32)
    model = llamir.load_model(path)
    ctx = llamir.Context(model, n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_BATCH, flash_attn="off")
    assert ctx.decode(llamir.Batch.from_tokens(prompt, logits="last")) == 0
    got = []
    for i in range(32):
        token = int(np.argmax(ctx.get_logits_ith(-1)))
        got.append(token)
        assert ctx.decode(llamir.Batch.from_tokens([token], pos0=len(prompt) + i)) == 0
    assert got == want


@pytest.mark.parametrize("dtype", ["f32", "q4_1"])
def test_f32_kv_cache_and_flash_attention_match(model_dir, nmse, dtype):
    path = _model(model_dir, "llama", dtype, 2, False)
    model = llamir.load_model(path)
    tolerance = 0.5 * _llama_cpp_spread(path)
    err32 = nmse(_ours(model, "batch", type_kv="f32"), _theirs(path, "batch", type_kv="f32"))
    assert err32 <= tolerance
    err_fa = nmse(_ours(model, "batch", flash_attn="on"), _theirs(path, "batch", flash_attn=True))
    assert err_fa <= tolerance


@pytest.mark.parametrize("scaling", ["yarn", "linear"])
def test_rope_scaling_matches_llama_cpp(tmp_path, nmse, scaling):
    """YaRN (with seed 000's attention-factor correction) and linear scaling from the model's keys."""
    path = write_model(tmp_path / f"{scaling}.gguf", SynthSpec(arch="qwen2", rope_scaling=scaling, n_ctx_train=8192))
    model = llamir.load_model(path)
    assert model.hparams.rope_scaling_type_train == scaling and model.hparams.rope_freq_scale_train == 0.25
    err = nmse(_ours(model, "batch"), _theirs(path, "batch"))
    assert err <= 0.5 * _llama_cpp_spread(path)
    if EXACT:
        assert err == 0.0


def test_gemma3_sliding_window_matches_llama_cpp(tmp_path, nmse):
    """An iSWA model: window layers use their own cache, mask and rope base."""
    path = write_model(tmp_path / "g3.gguf", SynthSpec(arch="gemma3", n_layer=7, sliding_window=8))
    model = llamir.load_model(path)
    assert model.hparams.swa_layers == (True,) * 5 + (False, True)
    for mode in ("batch", "incremental"):
        err = nmse(_ours(model, mode), _theirs(path, mode))
        assert err <= 0.5 * _llama_cpp_spread(path), mode
