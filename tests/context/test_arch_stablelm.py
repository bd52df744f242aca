"""stablelm (llamir/frontend/arch/stablelm.py) against llama.cpp on random-weight GGUF files: LayerNorms
with biases, q/k/v biases and a partial NEOX rope (a quarter of each head); and StableLM 2 12B's
per-head q/k LayerNorms with the parallel residual (no ffn norms). Logits bit-exact in the three
feeding modes on the numpy reference and the LLVM backend, greedy generation token for token, the
CPU's logits on a simulated device, and the loader's reading of the LayerNorm epsilon."""

from __future__ import annotations

import dataclasses

import pytest

import llamir
from llamir.frontend.arch.stablelm import StableLM
from llamir.frontend.model import ModelError
from llamir.frontend.synth import SynthSpec, write_model
from llamir.testing.conformance import Case, assert_device_matches_cpu, greedy_pair, llvm_mismatches, numpy_errors

pytestmark = pytest.mark.llama_cpp

# stablelm's loader requires output.weight, so no case is tied
CASES = [Case("stablelm", "f32", 2, False), Case("stablelm", "q8_0", 4, False), Case("stablelm", "q4_0", 1, False)]
IDS = [c.id for c in CASES]


@pytest.fixture(scope="module")
def model_12b(tmp_path_factory):
    """A StableLM 2 12B-shaped model: q/k norms written, ffn norms left out (the parallel residual)."""
    base = StableLM.tensor_specs

    def specs(self, hp):
        return [dataclasses.replace(t, synth=not t.name.split(".")[2].startswith("ffn_norm"))
                if t.name.startswith("blk.") and "_norm" in t.name and "attn_norm" not in t.name else t
                for t in base(self, hp)]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StableLM, "tensor_specs", specs)
        return write_model(tmp_path_factory.mktemp("stablelm") / "12b.gguf",
                           SynthSpec(arch="stablelm", n_head_kv=2, seed=11))


@pytest.fixture(params=[*CASES, "12b"], ids=[*IDS, "stablelm-12b-qk-norm-parallel"])
def path(request, conformance_model, model_12b):
    return model_12b if request.param == "12b" else conformance_model(request.param)


def test_numpy_logits_equal_llama_cpp_in_every_feeding_mode(nmse, path):
    errors = numpy_errors(path)
    assert all(err == 0.0 for err in errors.values()), f"NMSE per mode {errors}"


def test_llvm_logits_equal_numpy_and_llama_cpp(conformance_llvm, path):
    moved = llvm_mismatches(path, conformance_llvm)
    assert not moved, "\n".join(moved)


def test_the_12b_variant_has_qk_norms_and_no_ffn_norm(model_12b):
    names = set(llamir.load_model(model_12b).tensors)
    assert {"blk.1.attn_q_norm.weight", "blk.1.attn_k_norm.weight"} <= names
    assert not any("ffn_norm" in n for n in names)


@pytest.mark.parametrize("side", ["numpy", "llvm"])
def test_greedy_generation_is_token_identical(conformance_model, conformance_llvm, side):
    got, want = greedy_pair(conformance_model(CASES[1]), conformance_llvm if side == "llvm" else "numpy", n_gen=16)
    assert got == want


def test_simulated_device_gives_the_cpu_logits_bit_for_bit(conformance_model):
    model = llamir.load_model(conformance_model(CASES[2]))
    assert_device_matches_cpu(model)


def test_partial_rope_and_layer_norm_eps_are_read_and_a_negative_eps_refused(tmp_path):
    good = llamir.load_model(write_model(tmp_path / "good.gguf", SynthSpec(arch="stablelm", norm_eps=1e-3)))
    assert good.hparams.f_norm_eps == pytest.approx(1e-3)
    assert (good.hparams.n_rot, good.hparams.n_embd_head_k) == (4, 16)
    with pytest.raises(ModelError, match="layer_norm_epsilon = -1"):
        llamir.load_model(write_model(tmp_path / "bad.gguf", SynthSpec(arch="stablelm", norm_eps=-1.0)))
