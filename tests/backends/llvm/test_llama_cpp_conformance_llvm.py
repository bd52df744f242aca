"""Whole models on the LLVM backend against the numpy reference and llama.cpp, on the same
random-weight GGUF files as the reference suite (tests/context/test_llama_cpp_conformance.py).

Both llamir backends run the installed llama.cpp build's numerics profile, so the LLVM logits
must equal the reference's and llama.cpp's bit for bit; each test compares all three, so a
mismatch says which side moved.
"""

from __future__ import annotations

import pytest

import llamir
from llamir.backends.llvm import LLVMBackend
from llamir.testing.conformance import (
    ATTENTION,
    CASES,
    MODES,
    QUANT_KV_MODELS,
    Case,
    greedy_pair,
    llama_cpp_logits,
    llamir_logits,
    mismatch,
)
from llamir.testing.llama_cpp import oracle_numerics

pytestmark = pytest.mark.llama_cpp


@pytest.fixture(scope="module")
def backend():
    b = LLVMBackend(n_threads=2, disk_cache=False, numerics=oracle_numerics())
    yield b
    b.close()


def _check(backend, path, modes=MODES, **settings) -> None:
    """LLVM == numpy == llama.cpp in every mode; every mode runs before the verdict."""
    model = llamir.load_model(path)
    fa = settings.pop("flash_attn", False)
    moved = []
    for mode in modes:
        ours = {side: llamir_logits(model, mode, side, flash_attn="on" if fa else "off", **settings)
                for side in (backend, "numpy")}
        theirs = llama_cpp_logits(path, mode, flash_attn=fa, **settings)
        llvm, numpy = ours[backend], ours["numpy"]
        if not ((llvm == numpy).all() and (llvm == theirs).all()):
            moved.append(mismatch(mode, llvm, numpy, theirs))
    assert not moved, "\n".join(moved)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_logits_equal_numpy_and_llama_cpp(conformance_model, backend, case):
    _check(backend, conformance_model(case))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_greedy_generation_is_token_identical(conformance_model, backend, case):
    got, want = greedy_pair(conformance_model(case), backend)
    assert got == want


@pytest.mark.parametrize("setting", ATTENTION)
@pytest.mark.parametrize("dtype", ["f32", "q4_1"])
def test_f32_kv_cache_and_flash_attention(conformance_model, backend, dtype, setting):
    _check(backend, conformance_model(Case("llama", dtype, 2, False)), **ATTENTION[setting])


@pytest.mark.parametrize("type_kv", ["q8_0", "q4_0"])
@pytest.mark.parametrize("name", QUANT_KV_MODELS)
def test_quantized_kv_cache_with_flash_attention(conformance_model, backend, name, type_kv):
    _check(backend, conformance_model(name), ("batch", "incremental"), flash_attn=True, type_k=type_kv,
           type_v=type_kv)


@pytest.mark.parametrize("scaling", ["yarn", "linear"])
def test_rope_scaling(conformance_model, backend, scaling):
    _check(backend, conformance_model(f"qwen2-{scaling}"))


@pytest.mark.parametrize("flash_attn", [False, True])
def test_gemma3_sliding_window(conformance_model, backend, flash_attn):
    _check(backend, conformance_model("gemma3-iswa"), flash_attn=flash_attn)
