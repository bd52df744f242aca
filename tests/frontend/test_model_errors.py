"""Loading GGUF models: hparams as llama.cpp reads them, and a clear error for every bad file."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from llama_cpp_loader import llama_cpp_load

import llamir
from llamir.frontend.gguf_rewrite import rewrite
from llamir.frontend.model import ModelError, load_model
from llamir.frontend.synth import SynthSpec, write_model


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "good.gguf"
    return write_model(path, SynthSpec(arch="qwen2", n_layer=2, n_head=4, n_head_kv=2, dtype="q8_0"))


def _copy_with(src, dst, *, drop_tensor=None, reshape_tensor=None, arch=None, drop_key=None):
    """Rewrite a GGUF with one thing broken (the writer is gguf's own)."""
    reader = gguf.GGUFReader(src)
    old_arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch or old_arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", drop_key):
            continue
        value = field.contents()
        vtype = field.types[0]
        if arch and key.startswith(old_arch + "."):
            key = arch + key[len(old_arch):]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, vtype)
    for t in reader.tensors:
        if t.name == drop_tensor:
            continue
        data = np.array(t.data)
        shape = list(data.shape)  # numpy order; bytes per row for quantized types
        if t.name == reshape_tensor:
            shape = [shape[0] // 2, shape[1] * 2]
        writer.add_tensor(t.name, data, raw_shape=shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_hparams_follow_llama_cpp_keys(good):
    hp = load_model(good).hparams
    assert (hp.arch, hp.n_layer, hp.n_embd, hp.n_head(), hp.n_head_kv(), hp.n_vocab) == ("qwen2", 2, 64, 4, 2, 512)
    assert hp.n_embd_head_k == hp.n_rot == 16 and hp.n_gqa() == 2
    assert hp.rope_freq_base_train == 10000.0 and hp.rope_scaling_type_train == "linear"
    assert hp.n_ctx_orig_yarn == hp.n_ctx_train


def test_weights_are_memory_mapped_not_copied(good):
    model = load_model(good)
    arr = model.weight_array("blk.0.attn_q.weight")
    assert isinstance(arr, np.memmap) or isinstance(arr.base, np.memmap)


def test_tied_output_reuses_token_embd(tmp_path):
    path = write_model(tmp_path / "tied.gguf", SynthSpec(tied=True))
    model = load_model(path)
    assert not model.has_tensor("output.weight")
    graph = model.build_graph(llamir.Context(model, n_ctx=256).graph_config(True))
    logits = graph.outputs["logits"]
    assert logits.inputs[0].name == "token_embd.weight"


def test_truncated_file(good, tmp_path):
    data = good.read_bytes()
    cut = tmp_path / "truncated.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelError, match="truncated|malformed|holds"):
        load_model(cut)
    tiny = tmp_path / "tiny.gguf"
    tiny.write_bytes(data[:5])
    with pytest.raises(ModelError, match="too short"):
        load_model(tiny)


def test_wrong_magic(good, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + good.read_bytes()[4:])
    with pytest.raises(ModelError, match="bad magic b'GGML'"):
        load_model(bad)


def test_missing_file(tmp_path):
    with pytest.raises(ModelError, match="cannot open"):
        load_model(tmp_path / "nope.gguf")


def test_missing_tensor(good, tmp_path):
    bad = _copy_with(good, tmp_path / "missing.gguf", drop_tensor="blk.1.ffn_up.weight")
    with pytest.raises(ModelError, match=r"missing tensor 'blk\.1\.ffn_up\.weight'"):
        load_model(bad)


def test_qkv_biases_are_optional_as_in_llama_cpp(good, tmp_path):
    """create_tensor_qkv makes the q/k/v biases optional for every architecture, qwen2's included."""
    path = _copy_with(good, tmp_path / "nobias.gguf", drop_tensor="blk.0.attn_k.bias")
    assert llama_cpp_load(path).loaded
    model = load_model(path)
    ctx = llamir.Context(model, n_ctx=64, n_batch=8, backend="numpy")
    assert ctx.decode(llamir.Batch.from_tokens([1, 2, 3])) == 0, ctx.last_error
    assert np.isfinite(ctx.get_logits()).all()


def test_wrong_tensor_shape(tmp_path):
    src = write_model(tmp_path / "f32.gguf", SynthSpec(dtype="f32"))
    bad = _copy_with(src, tmp_path / "shape.gguf", reshape_tensor="blk.0.attn_q.weight")
    with pytest.raises(ModelError, match=r"'blk\.0\.attn_q\.weight' has wrong shape \[32, 128\]; expected \[64, 64\]"):
        load_model(bad)


def test_unknown_architecture(good, tmp_path):
    bad = _copy_with(good, tmp_path / "arch.gguf", arch="mamba9")
    with pytest.raises(ModelError, match="unknown model architecture 'mamba9'.*supports.*llama"):
        load_model(bad)


def test_missing_required_key(good, tmp_path):
    bad = _copy_with(good, tmp_path / "key.gguf", drop_key="qwen2.embedding_length")
    with pytest.raises(ModelError, match="qwen2.embedding_length"):
        load_model(bad)


def test_cut_model_loads_with_fewer_layers(good, tmp_path):
    cut = rewrite(good, tmp_path / "cut.gguf", n_layer=1)
    assert load_model(cut).hparams.n_layer == 1
