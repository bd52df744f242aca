"""Whole models on the LLVM backend against llama.cpp, on the same random-weight GGUF files as
the foundation's conformance suite (tests/context/test_llama_cpp_conformance.py): logits in the
three feeding modes within half of llama.cpp's own f16/f32 KV spread, and greedy generation
token for token."""

from __future__ import annotations

import pytest

import llamir
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

pytestmark = [pytest.mark.llama_cpp, pytest.mark.slow]
pytest.importorskip("llama_cpp")
IDS = [case_id(c) for c in CASES]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("conformance_llvm")


@pytest.fixture(scope="module")
def backend():
    from llamir.backends.llvm import LLVMBackend

    b = LLVMBackend(n_threads=2, disk_cache=False)
    yield b
    b.close()


@pytest.mark.parametrize("arch,dtype,n_head_kv,tied", CASES, ids=IDS)
def test_logits_match_llama_cpp(model_dir, backend, nmse, arch, dtype, n_head_kv, tied):
    path = case_model(model_dir, arch, dtype, n_head_kv, tied)
    model = llamir.load_model(path)
    tolerance = 0.5 * llama_cpp_kv_spread(path)
    for mode in MODES:
        err = nmse(llamir_logits(model, mode, backend=backend), llama_cpp_logits(path, mode))
        assert err <= tolerance, f"{mode}: NMSE {err:.3g} > {tolerance:.3g}"


@pytest.mark.parametrize("arch,dtype,n_head_kv,tied", CASES[::2], ids=IDS[::2])
def test_greedy_generation_is_token_identical(model_dir, backend, arch, dtype, n_head_kv, tied):
    got, want = greedy_pair(case_model(model_dir, arch, dtype, n_head_kv, tied), backend=backend)
    assert got == want


@pytest.mark.parametrize("dtype", ["f32", "q4_1"])
def test_f32_kv_cache_and_flash_attention_match(model_dir, backend, nmse, dtype):
    path = case_model(model_dir, "llama", dtype, 2, False)
    model = llamir.load_model(path)
    tolerance = 0.5 * llama_cpp_kv_spread(path)
    err32 = nmse(llamir_logits(model, "batch", type_kv="f32", backend=backend),
                 llama_cpp_logits(path, "batch", type_kv="f32"))
    assert err32 <= tolerance
    for mode in ("batch", "incremental"):
        err = nmse(llamir_logits(model, mode, flash_attn="on", backend=backend),
                   llama_cpp_logits(path, mode, flash_attn=True))
        assert err <= tolerance, f"{mode}: NMSE {err:.3g} > {tolerance:.3g}"
