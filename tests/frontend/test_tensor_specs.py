"""An architecture's tensor_specs are the one list of its tensors: synth writes a model from them
(every registered architecture, checked against llama.cpp), and the builder reads them through
the typed accessor (g.layer_weights(il).attn_q, g.weights.output_norm), which refuses a tensor
the specs do not declare and one the model lacks."""

from __future__ import annotations

import numpy as np
import pytest

import llamir
from llamir.frontend.arch import ARCHS, ArchError, TensorSpec
from llamir.frontend.arch.base import QK_GAIN
from llamir.frontend.arch.llama import Llama
from llamir.frontend.synth import SynthSpec, synth_hparams, write_model
from llamir.frontend.weights import UndeclaredTensorError, gguf_suffix
from llamir.ir import F32, Q8_0
from llamir.testing.conformance import llama_cpp_logits, llamir_logits

REGISTERED = sorted(ARCHS)


class ScaledQLlama(Llama):
    """llama with two made-up tensors: a learnt per-dimension scale of q (used by the block) and a
    global matrix (declared only): adding them to tensor_specs is all it takes."""

    name = "llama-qscale"

    def tensor_specs(self, hp):
        return super().tensor_specs(hp) + [
            *(TensorSpec(f"blk.{il}.attn_q_scale.weight", (hp.n_embd_head_k,), gain=2.0) for il in range(hp.n_layer)),
            TensorSpec("extra_proj.weight", (hp.n_embd, hp.n_embd)),
            TensorSpec("extra_bias.bias", (hp.n_embd,), required=False),   # optional: synth leaves it out
        ]

    def rope_qk(self, g, L, il: int, q, k):
        return super().rope_qk(g, L, il, g.b.mul(q, L.attn_q_scale), k)            # [T, H, d] * [d]


@pytest.fixture
def qscale_arch(monkeypatch):
    monkeypatch.setitem(ARCHS, ScaledQLlama.name, ScaledQLlama)
    return ScaledQLlama


def _built(model):
    ctx = llamir.Context(model, n_ctx=64)
    return model.build_graph(ctx.graph_config(has_tokens=True))


def test_a_new_spec_is_written_by_synth_and_read_by_the_builder(tmp_path, qscale_arch):
    path = write_model(tmp_path / "q.gguf", SynthSpec(arch=qscale_arch.name, n_layer=2, dtype="q8_0"))
    model = llamir.load_model(path)
    scale, proj = model.tensor("blk.1.attn_q_scale.weight"), model.tensor("extra_proj.weight")
    assert (scale.dtype, scale.shape, proj.dtype, proj.shape) == (F32, (16,), Q8_0, (64, 64))
    values = np.asarray(scale.data, dtype=np.float64)
    assert abs(values.mean() - 2.0) < 0.1 and 0.03 < values.std() < 0.3      # the norm rule: gain + N(0, 0.1)
    assert not model.has_tensor("extra_bias.bias")
    leaves = {leaf.name for leaf in _built(model).graph.leafs}
    assert {"blk.0.attn_q_scale.weight", "blk.1.attn_q_scale.weight"} <= leaves
    logits = llamir_logits(model, "batch", "numpy")
    assert np.isfinite(logits).all() and logits.std() > 0.5


def test_synth_writes_exactly_the_specs_a_model_has(tmp_path):
    for arch in REGISTERED:
        for tied in (False, True):
            # t5's q is shaped by its KV heads: it has no GQA
            spec = SynthSpec(arch=arch, n_layer=2, tied=tied, n_head_kv=4 if arch == "t5" else 2)
            if tied and any(t.name == "output.weight" and t.required
                            for t in ARCHS[arch]().tensor_specs(synth_hparams(spec))):
                continue   # llama.cpp's loader requires this architecture's output.weight: never tied
            model = llamir.load_model(write_model(tmp_path / f"{arch}-{tied}.gguf", spec))
            want = [t.name for t in ARCHS[arch]().tensor_specs(synth_hparams(spec))
                    if t.in_synth and not (tied and t.name == "output.weight")]
            assert list(model.tensors) == want, arch


def _decoders() -> list[str]:
    """The registered architectures with an output head (an encoder's own tests compare embeddings)."""
    return [a for a in REGISTERED if ARCHS[a]().create_memory(synth_hparams(SynthSpec(arch=a))) != "none"]


def _registered_specs() -> list[SynthSpec]:
    """Every decoder-only architecture (an encoder-decoder decodes only after an encode: t5 is
    checked against llama.cpp in tests/context/test_arch_t5.py)."""
    specs = [SynthSpec(arch=arch, n_layer=3, n_embd=64, n_head=4, n_head_kv=2, seed=11) for arch in _decoders()
             if not ARCHS[arch].has_encoder]
    return specs + [SynthSpec(arch=arch, n_layer=3, sliding_window=4, swa_pattern=2, seed=12)
                    for arch in REGISTERED if "sliding_window" in ARCHS[arch].synth_options]


@pytest.mark.llama_cpp
@pytest.mark.parametrize("spec", _registered_specs(), ids=lambda s: s.arch + ("-swa" if s.sliding_window else ""))
def test_every_registered_architecture_synthesizes_a_model_llama_cpp_runs(tmp_path, nmse, spec):
    path = write_model(tmp_path / "m.gguf", spec)
    model = llamir.load_model(path)
    got, want = llamir_logits(model, "batch", "numpy"), llama_cpp_logits(path, "batch")
    assert np.isfinite(want).all() and want.std() > 0.5        # logits that spread, as a trained model's
    assert nmse(got, want) == 0.0


def test_init_rules_follow_the_name_unless_given():
    hp = synth_hparams(SynthSpec(arch="qwen3", n_layer=1))
    specs = {t.name: t for t in ARCHS["qwen3"]().tensor_specs(hp)}
    rules = {name: (t.init_rule, t.storage_kind, t.gain) for name, t in specs.items()}
    assert rules["token_embd.weight"] == ("embedding", "embd", 1.0)
    assert rules["output_norm.weight"] == ("norm", "f32", 1.0)
    assert rules["blk.0.attn_q_norm.weight"] == ("norm", "f32", QK_GAIN)      # qwen3's score gain is here
    assert rules["blk.0.attn_q.weight"] == ("matrix", "weight", 1.0)
    assert rules["blk.0.attn_q.bias"] == ("bias", "f32", 1.0) and not specs["blk.0.attn_q.bias"].in_synth
    qwen2 = {t.name: t for t in ARCHS["qwen2"]().tensor_specs(hp)}
    assert qwen2["blk.0.attn_q.bias"].in_synth and qwen2["blk.0.attn_q.weight"].gain == QK_GAIN
    with pytest.raises(ValueError, match="init 'xavier' is not one of"):
        TensorSpec("w.weight", (2, 2), init="xavier")
    with pytest.raises(ValueError, match="storage 'q8' is not one of"):
        TensorSpec("w.weight", (2, 2), storage="q8")


def test_attribute_names_stand_for_gguf_names():
    assert gguf_suffix("attn_q") == "attn_q.weight"
    assert gguf_suffix("attn_q_bias") == "attn_q.bias"
    assert gguf_suffix("attn_q.bias") == "attn_q.bias"


@pytest.fixture(scope="module")
def llama_model(tmp_path_factory):
    path = write_model(tmp_path_factory.mktemp("specs") / "tied.gguf", SynthSpec(n_layer=2, tied=True))
    return llamir.load_model(path)


def _build_with(model, arch):
    """Build `model`'s graph with another architecture object (specs and builder), then restore it."""
    ctx = llamir.Context(model, n_ctx=64)
    saved = model.arch
    model.arch = arch
    model.__dict__.pop("tensor_specs", None)
    try:
        return model.build_graph(ctx.graph_config(has_tokens=True))
    finally:
        model.arch = saved
        model.__dict__.pop("tensor_specs", None)


def test_optional_tensors_are_none_when_absent(llama_model):
    seen = {}

    class Probe(Llama):
        def build(self, g):
            L = g.layer_weights(1)
            seen.update(bias=L.attn_output_bias, rope_freqs=g.weights.rope_freqs, output=g.weights.output,
                        q=L.attn_q, q_by_name=L["attn_q.weight"], out=g.output_weight(), embd=g.weights.token_embd)
            super().build(g)

    _build_with(llama_model, Probe())
    assert seen["bias"] is None and seen["rope_freqs"] is None and seen["output"] is None   # tied: no output
    assert seen["q"] is seen["q_by_name"] and seen["q"].name == "blk.1.attn_q.weight"
    assert seen["out"] is seen["embd"]


def test_an_undeclared_tensor_is_refused_naming_what_is_declared(llama_model):
    class ReadsUndeclared(Llama):
        def build(self, g):
            _ = g.layer_weights(0).attn_gate

    with pytest.raises(UndeclaredTensorError, match=r"'blk\.0\.attn_gate\.weight'.*declared under blk\.0\.: "
                                                    r"attn_norm\.weight, attn_q\.weight"):
        _build_with(llama_model, ReadsUndeclared())

    class ReadsUndeclaredGlobal(Llama):
        def build(self, g):
            _ = g.weights.attn_q

    with pytest.raises(UndeclaredTensorError, match=r"'attn_q\.weight'.*declared under the model: token_embd"):
        _build_with(llama_model, ReadsUndeclaredGlobal())


def test_a_required_tensor_the_model_lacks_is_an_arch_error(llama_model):
    class NeedsMore(Llama):
        def tensor_specs(self, hp):
            return super().tensor_specs(hp) + [TensorSpec("blk.0.attn_gate.weight", (hp.n_embd,))]

        def build(self, g):
            _ = g.layer_weights(0).attn_gate

    with pytest.raises(ArchError, match=r"llama needs tensor 'blk\.0\.attn_gate\.weight', which the model lacks"):
        _build_with(llama_model, NeedsMore())


def test_gemma3_hparams_are_its_typed_extras(tmp_path):
    from llamir.frontend.arch.gemma3 import Gemma3HParams
    from llamir.frontend.hparams import ArchHParams

    spec = SynthSpec(arch="gemma3", n_layer=4, sliding_window=8, swa_pattern=2)
    hp = llamir.load_model(write_model(tmp_path / "g.gguf", spec)).hparams
    assert hp.extra == Gemma3HParams(final_logit_softcapping=0.0, rope_freq_base_swa=10000.0,
                                     query_scale=float(np.float32(1 / np.sqrt(np.float32(spec.n_embd_head)))))
    assert (hp.n_swa, hp.swa_type, hp.swa_layers) == (8, "standard", (True, False, True, False))   # generic
    assert "query_scale" in hp.to_dict() and not hasattr(hp, "f_final_logit_softcapping")
    llama = llamir.load_model(write_model(tmp_path / "l.gguf", SynthSpec(n_layer=1))).hparams
    assert type(llama.extra) is ArchHParams and llama.n_swa == 0
    with pytest.raises(ValueError, match=r"sliding_window is a (.*, )?gemma3(, .*)? setting, not llama's"):
        write_model(tmp_path / "bad.gguf", SynthSpec(arch="llama", sliding_window=8))
