"""phi3 (llamir/frontend/arch/phi3.py) against llama.cpp on random-weight GGUF files: the fused qkv
projection, the fused gate|up ffn, q scaled before attention and LongRoPE, whose short factors apply
at a context up to the original one (256 in synth's models) and the long ones beyond it, with the
attention factor from the model's keys. Logits bit-exact in the three feeding modes on the numpy
reference and the LLVM backend, at both factor choices, greedy generation token for token, and the
CPU's logits on a simulated device."""

from __future__ import annotations

import math

import numpy as np
import pytest

import llamir
from llamir.testing.conformance import (
    N_BATCH,
    PROMPT,
    Case,
    assert_device_matches_cpu,
    greedy_pair,
    llama_cpp_logits,
    llvm_mismatches,
    make_context,
    numpy_errors,
)
from llamir.testing.llama_cpp import LlamaCppOracle

pytestmark = pytest.mark.llama_cpp

CASES = [Case("phi3", "f32", 2, False), Case("phi3", "q8_0", 4, True), Case("phi3", "q4_0", 1, False)]
IDS = [c.id for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_numpy_logits_equal_llama_cpp_in_every_feeding_mode(conformance_model, nmse, case):
    errors = numpy_errors(conformance_model(case))
    assert all(err == 0.0 for err in errors.values()), f"{case.id}: NMSE per mode {errors}"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_llvm_logits_equal_numpy_and_llama_cpp(conformance_model, conformance_llvm, case):
    moved = llvm_mismatches(conformance_model(case), conformance_llvm)
    assert not moved, "\n".join(moved)


def test_longrope_keys_are_read(conformance_model):
    hp = llamir.load_model(conformance_model(CASES[0])).hparams
    assert (hp.n_ctx_train, hp.n_ctx_orig_yarn) == (2048, 256)
    assert hp.rope_attn_factor == pytest.approx(math.sqrt(1 + math.log(8) / math.log(256)), rel=1e-6)


@pytest.mark.parametrize("side", ["numpy", "llvm"])
def test_long_factors_beyond_the_original_context_match_llama_cpp(conformance_model, conformance_llvm, side):
    """n_ctx 512 > 256 picks rope_factors_long (n_ctx 256, the other tests, the short ones): the
    logits move, and llamir's move with llama.cpp's bit for bit."""
    path = conformance_model(CASES[0])
    prompt = list(PROMPT)
    with LlamaCppOracle(path, n_ctx=512, n_batch=N_BATCH, n_ubatch=N_BATCH) as oracle:
        want = oracle.eval_logits(prompt, "batch")
    ctx = make_context(llamir.load_model(path), conformance_llvm if side == "llvm" else "numpy", n_ctx=512,
                       n_batch=N_BATCH, n_ubatch=N_BATCH, flash_attn="off")
    assert ctx.decode(llamir.Batch.from_tokens(prompt, logits="all")) == 0, ctx.last_error
    np.testing.assert_array_equal(ctx.get_logits(), want)
    short = llama_cpp_logits(path, "batch")
    assert not np.allclose(want[1:], short[1:], atol=1e-3)   # position 0 is not rotated


@pytest.mark.parametrize("side", ["numpy", "llvm"])
def test_greedy_generation_is_token_identical(conformance_model, conformance_llvm, side):
    got, want = greedy_pair(conformance_model(CASES[1]), conformance_llvm if side == "llvm" else "numpy", n_gen=16)
    assert got == want


def test_simulated_device_gives_the_cpu_logits_bit_for_bit(conformance_model):
    model = llamir.load_model(conformance_model(CASES[2]))
    assert_device_matches_cpu(model)
