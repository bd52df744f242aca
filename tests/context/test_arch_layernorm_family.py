"""gpt2 and starcoder2 (the LayerNorm block: llamir/frontend/arch/layernorm_family.py) against
llama.cpp on random-weight GGUF files: logits bit-exact in the three feeding modes on the numpy
reference and the LLVM backend, greedy generation token for token, the same logits on a simulated
device, and the loader's refusals."""

from __future__ import annotations

import numpy as np
import pytest

import llamir
from llamir.frontend.synth import SynthSpec, write_model
from llamir.testing.conformance import Case, assert_device_matches_cpu, greedy_pair, llvm_mismatches, numpy_errors
from llamir.testing.llama_cpp import LlamaCppOracle, oracle_numerics

pytestmark = pytest.mark.llama_cpp

# gpt2 is MHA in every release, but its loader takes GQA (n_embd_gqa), so one case has it
CASES = [Case("gpt2", "f32", 4, False), Case("gpt2", "q8_0", 2, False), Case("gpt2", "q4_0", 4, True),
         Case("starcoder2", "f32", 2, False), Case("starcoder2", "q8_0", 4, True), Case("starcoder2", "q4_0", 1, False)]
IDS = [c.id for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_numpy_logits_equal_llama_cpp_in_every_feeding_mode(conformance_model, nmse, case):
    errors = numpy_errors(conformance_model(case))
    assert all(err == 0.0 for err in errors.values()), f"{case.id}: NMSE per mode {errors}"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_llvm_logits_equal_numpy_and_llama_cpp(conformance_model, conformance_llvm, case):
    moved = llvm_mismatches(conformance_model(case), conformance_llvm)
    assert not moved, "\n".join(moved)


@pytest.mark.parametrize("side", ["numpy", "llvm"])
@pytest.mark.parametrize("case", CASES[::3], ids=IDS[::3])
def test_greedy_generation_is_token_identical(conformance_model, conformance_llvm, case, side):
    got, want = greedy_pair(conformance_model(case), conformance_llvm if side == "llvm" else "numpy")
    assert got == want


@pytest.mark.parametrize("case", CASES[1::3], ids=IDS[1::3])
def test_simulated_device_gives_the_cpu_logits_bit_for_bit(conformance_model, case):
    model = llamir.load_model(conformance_model(case))
    assert_device_matches_cpu(model)


@pytest.mark.parametrize("case", CASES[::3], ids=IDS[::3])
def test_context_shift_matches_llama_cpp(conformance_model, case):
    """seq_rm + seq_add: starcoder2 re-ropes the cached keys; gpt2 has no rope (llama.cpp builds no
    shift graph, the positions move alone), so its keys stay as they are."""
    path, tokens = conformance_model(case), list(range(5, 25))
    with LlamaCppOracle(path, n_ctx=128, n_batch=64, n_ubatch=64) as oracle:
        oracle.decode(tokens)
        oracle.seq_rm(0, 4, 12)
        oracle.seq_add(0, 12, -1, -8)
        oracle.decode([7], pos0=12)
        want = oracle.logits_ith(-1)
    ctx = llamir.Context(llamir.load_model(path), n_ctx=128, n_batch=64, n_ubatch=64, flash_attn="off",
                         numerics=oracle_numerics())
    assert ctx.decode(llamir.Batch.from_tokens(tokens)) == 0, ctx.last_error
    ctx.memory.seq_rm(0, 4, 12)
    ctx.memory.seq_add(0, 12, -1, -8)
    assert ctx.decode(llamir.Batch.from_tokens([7], pos0=12)) == 0, ctx.last_error
    np.testing.assert_array_equal(ctx.get_logits_ith(-1), want)


@pytest.mark.parametrize("arch", ["gpt2", "starcoder2"])
def test_layer_norm_eps_is_read_and_a_negative_one_refused(tmp_path, arch):
    good = llamir.load_model(write_model(tmp_path / "good.gguf", SynthSpec(arch=arch, n_head_kv=4, norm_eps=1e-3)))
    assert good.hparams.f_norm_eps == pytest.approx(1e-3)
    with pytest.raises(llamir.ModelError, match="layer_norm_epsilon = -1"):
        llamir.load_model(write_model(tmp_path / "bad.gguf", SynthSpec(arch=arch, n_head_kv=4, norm_eps=-1.0)))
