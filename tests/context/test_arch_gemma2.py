"""gemma2 against llama.cpp on random-weight models: attention-logit and final-logit softcapping,
every other layer a sliding window of 8 (the 40-token prompt crosses it), the output tied to the
token embedding; exact on the numpy reference and the LLVM backend, flash attention off and on,
in every feeding mode, and bit for bit through the scheduler on a simulated device."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import llamir
from llamir.context.kv_cache_iswa import KVCacheISWA
from llamir.frontend.arch.gemma2 import Gemma2
from llamir.frontend.arch.gemma_family import query_scale
from llamir.frontend.placement import PlacementParams
from llamir.frontend.synth import SynthSpec, synth_hparams, write_model
from llamir.testing.conformance import MODES, PROMPT, greedy_pair, llama_cpp_logits, llamir_logits

pytestmark = pytest.mark.llama_cpp

# weight type -> KV heads (of 4): GQA, MHA and MQA each met once
DTYPES = {"f32": 2, "q8_0": 4, "q4_0": 1}


def _spec(dtype: str, **kw) -> SynthSpec:
    fields = dict(arch="gemma2", n_layer=2, n_embd=64, n_head=4, n_head_kv=DTYPES[dtype], n_ff=128, n_vocab=512,
                  dtype=dtype, seed=7, sliding_window=8, swa_pattern=2)
    return SynthSpec(**(fields | kw))


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma2")
    return {dtype: write_model(root / f"gemma2-{dtype}.gguf", _spec(dtype)) for dtype in DTYPES}


def _moved(model, path, backend, flash_attn: bool, nmse) -> dict[str, str]:
    """Per feeding mode, the NMSE against llama.cpp where it is not 0 (every mode runs)."""
    errors = {mode: nmse(llamir_logits(model, mode, backend, flash_attn="on" if flash_attn else "off"),
                         llama_cpp_logits(path, mode, flash_attn=flash_attn)) for mode in MODES}
    return {mode: f"{err:.3g}" for mode, err in errors.items() if err != 0.0}


def test_hparams_and_memory(paths):
    model = llamir.load_model(paths["f32"])
    hp = model.hparams
    assert (hp.n_swa, hp.swa_type, hp.swa_layers) == (8, "standard", (True, False))
    assert hp.f_attn_logit_softcapping == Gemma2.SYNTH_CAPS["attn_logit_softcapping"]
    assert hp.extra.final_logit_softcapping == Gemma2.SYNTH_CAPS["final_logit_softcapping"]
    assert hp.extra.query_scale == 0.25                                          # 1/sqrt(head size 16)
    assert "output.weight" not in model.tensor_specs                             # always tied
    assert model.arch.create_memory(hp) == "kv_iswa"
    assert type(llamir.Context(model, n_ctx=64).memory) is KVCacheISWA


def test_the_27b_scales_queries_by_n_embd_over_n_head():
    hp = dataclasses.replace(synth_hparams(SynthSpec(arch="gemma2", head_dim=32)), n_layer=46)   # n_embd/n_head 16
    assert query_scale(None, hp, n_layer_27b=46) == np.float32(0.25)
    assert query_scale(None, hp, n_layer_27b=26) == np.float32(1 / np.sqrt(32))


# flash attention (its softcap is an operand of flash_attn_ext) on f32 here, on every type on LLVM below
@pytest.mark.parametrize("dtype,flash_attn", [(d, False) for d in DTYPES] + [("f32", True)],
                         ids=[*DTYPES, "f32-flash-attn"])
def test_logits_match_llama_cpp_in_every_feeding_mode(paths, nmse, dtype, flash_attn):
    moved = _moved(llamir.load_model(paths[dtype]), paths[dtype], "numpy", flash_attn, nmse)
    assert not moved, f"not bit-exact with llama.cpp, NMSE per mode {moved}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_generation_is_token_identical(paths, dtype):
    got, want = greedy_pair(paths[dtype], "numpy")
    assert got == want


@pytest.mark.parametrize("dtype", DTYPES)
def test_llvm_backend_matches_llama_cpp(paths, conformance_llvm, nmse, dtype):
    model = llamir.load_model(paths[dtype])
    moved = {fa: _moved(model, paths[dtype], conformance_llvm, fa, nmse) for fa in (False, True)}
    assert not any(moved.values()), f"LLVM not bit-exact with llama.cpp: {moved}"
    got, want = greedy_pair(paths[dtype], conformance_llvm)
    assert got == want


def test_a_simulated_device_gives_the_cpu_logits_bit_for_bit(paths):
    model = llamir.load_model(paths["q8_0"])

    def logits(**kw) -> list[np.ndarray]:
        ctx = llamir.Context(model, n_ctx=256, flash_attn="off", **kw)
        assert ctx.decode(llamir.Batch.from_tokens(list(PROMPT), logits="all")) == 0, ctx.last_error
        rows = [ctx.get_logits().copy()]
        assert ctx.decode(llamir.Batch.from_tokens([3], pos0=len(PROMPT))) == 0, ctx.last_error
        return rows + [ctx.get_logits_ith(-1).copy()]

    want = logits()
    got = logits(devices=["sim:gpu0"], placement=PlacementParams(n_gpu_layers=2))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_defaults_pattern_and_swa_rope_base_follow_llama_cpp(tmp_path, monkeypatch, nmse):
    """No softcap or window keys: caps 50 and 30 and a window of 4096; a pattern of 3 and a rope
    base of its own on the window layers; the window of 8 changes the logits of a 40-token prompt."""
    monkeypatch.setattr(Gemma2, "synth_metadata", lambda self, w, spec: None)
    plain = write_model(tmp_path / "plain.gguf", _spec("f32", sliding_window=None))
    hp = llamir.load_model(plain).hparams
    assert (hp.f_attn_logit_softcapping, hp.extra.final_logit_softcapping, hp.n_swa) == (50.0, 30.0, 4096)
    windowed = write_model(tmp_path / "windowed.gguf", _spec("f32"))
    assert nmse(llama_cpp_logits(windowed, "batch"), llama_cpp_logits(plain, "batch")) > 1e-4
    other = write_model(tmp_path / "p3.gguf", _spec("f32", n_layer=3, swa_pattern=3, rope_base=50000.0))
    model = llamir.load_model(other)
    assert model.hparams.swa_layers == (True, True, False) and model.hparams.extra.rope_freq_base_swa == 10000.0
    for path in (plain, other):
        assert nmse(llamir_logits(llamir.load_model(path), "batch", "numpy"), llama_cpp_logits(path, "batch")) == 0


@pytest.mark.parametrize("key", ["attn_logit_softcapping", "final_logit_softcapping", "attention.sliding_window"])
def test_a_zero_cap_or_window_is_refused(tmp_path, monkeypatch, key):
    """llama.cpp divides by a cap of 0 and masks every key with a window of 0 (NaN logits without
    flash attention), so llamir refuses the file."""
    monkeypatch.setattr(Gemma2, "synth_metadata", lambda self, w, spec: w.add_uint32(f"gemma2.{key}", 0)
                        if key.startswith("attention") else w.add_float32(f"gemma2.{key}", 0.0))
    path = write_model(tmp_path / "zero.gguf", _spec("f32", sliding_window=None))
    with pytest.raises(llamir.ModelError, match=f"gemma2.{key} = 0"):
        llamir.load_model(path)
