"""Synthetic GGUF models: llama.cpp loads and runs them, they are deterministic, and gguf_rewrite
cuts and re-types them correctly (checked with GGUFFile and gguf.quants, not with our own code)."""

from __future__ import annotations

import itertools

import gguf
import numpy as np
import pytest

from llamir.frontend.gguf_file import GGUFFile
from llamir.frontend.gguf_rewrite import rewrite
from llamir.frontend.synth import SPECIAL_TOKENS, SynthSpec, write_model
from llamir.ir import quants
from llamir.testing import LlamaCppOracle, nmse

ARCHS = ("llama", "qwen2", "qwen3")
DTYPES = ("f32", "f16", "q8_0", "q4_0", "q4_1")
PROMPT = "The capital of France is Paris. Hello, world! 2024"


def _oracle(path, **kw) -> LlamaCppOracle:
    return LlamaCppOracle(path, n_ctx=128, n_batch=32, **kw)


def _values(t) -> np.ndarray:
    """A GGUFFile tensor as float32, dequantized by gguf.quants."""
    ggml_type = t.dtype.ggml_type
    if ggml_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return np.asarray(t.data, dtype=np.float32).reshape(t.shape)
    return gguf.quants.dequantize(np.asarray(t.data), ggml_type).reshape(t.shape)


@pytest.mark.llama_cpp
@pytest.mark.parametrize("arch,dtype,tied,gqa",
                         list(itertools.product(ARCHS, DTYPES, (False, True), (True, False))))
def test_llama_cpp_runs_every_variant(tmp_path, arch, dtype, tied, gqa):
    spec = SynthSpec(arch=arch, dtype=dtype, tied=tied, n_head=4, n_head_kv=2 if gqa else 4, n_layer=1)
    path = write_model(tmp_path / "m.gguf", spec)
    with _oracle(path) as oracle:
        assert oracle.n_vocab == spec.n_vocab
        tokens = oracle.tokenize(PROMPT)
        logits = oracle.eval_logits(tokens[:12], "batch")
    assert logits.shape == (12, spec.n_vocab)
    assert np.isfinite(logits).all()
    # a healthy spread: neither flat nor exploding
    assert 0.5 < float(logits.std(axis=1).mean()) < 50


@pytest.mark.llama_cpp
@pytest.mark.parametrize("spec", [
    SynthSpec(arch="llama", dtype="bf16"),
    SynthSpec(arch="llama", dtype="q5_0", embd_dtype="q8_0"),
    SynthSpec(arch="qwen2", dtype="q5_1", embd_dtype="f16"),
    SynthSpec(arch="qwen3", n_embd=64, n_head=4, head_dim=32),   # head_dim != n_embd / n_head
    SynthSpec(arch="llama", n_embd=96, n_head=2, n_head_kv=1, head_dim=32, n_ff=64),
    SynthSpec(arch="llama", n_vocab=1000),                       # more tokens than the corpus merges
    *(SynthSpec(arch=arch, dtype=dtype, n_embd=256, n_ff=512)    # K-quants: rows of 256
      for arch, dtype in (("llama", "q2_k"), ("qwen2", "q3_k"), ("qwen3", "q4_k"), ("llama", "q5_k"),
                          ("qwen3", "q6_k"))),
], ids=lambda s: f"{s.arch}-{s.dtype}-{s.embd_dtype}-hd{s.head_dim}-v{s.n_vocab}")
def test_llama_cpp_runs_other_shapes_and_types(tmp_path, spec):
    path = write_model(tmp_path / "m.gguf", spec)
    with _oracle(path) as oracle:
        assert oracle.n_vocab == spec.n_vocab
        logits = oracle.eval_logits(oracle.tokenize(PROMPT)[:8], "incremental")
    assert np.isfinite(logits).all() and logits.std() > 0.5


@pytest.mark.llama_cpp
def test_tokenizer_round_trips_and_knows_its_specials(tmp_path):
    path = write_model(tmp_path / "m.gguf", SynthSpec())
    with _oracle(path) as oracle:
        text = "Good programs are simple and clear; they say what they mean. ünïcødé 12345 \n\t end"
        tokens = oracle.tokenize(text, add_special=False)
        assert oracle.detokenize(tokens) == text
        english = "Good programs are simple and clear; they say what they mean."
        assert len(oracle.tokenize(english, add_special=False)) < len(english) / 2, "merges should compress"
        chat = "<|im_start|>user\nHi<|im_end|>"
        ids = oracle.tokenize(chat, add_special=False, parse_special=True)
        assert ids[0] == SPECIAL_TOKENS.index("<|im_start|>")
        assert ids[-1] == SPECIAL_TOKENS.index("<|im_end|>")
        assert oracle.tokenize("Hi", add_special=True) == oracle.tokenize("Hi", add_special=False)


def test_same_spec_gives_identical_bytes(tmp_path):
    spec = SynthSpec(arch="qwen2", dtype="q4_1")
    a = write_model(tmp_path / "a.gguf", spec).read_bytes()
    b = write_model(tmp_path / "b.gguf", spec).read_bytes()
    c = write_model(tmp_path / "c.gguf", SynthSpec(arch="qwen2", dtype="q4_1", seed=1)).read_bytes()
    assert a == b
    assert a != c


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_file_reads_back_the_hparams(tmp_path, arch):
    head_dim = 32 if arch == "qwen3" else None
    spec = SynthSpec(arch=arch, n_layer=3, n_embd=64, n_head=4, n_head_kv=1, n_ff=96, n_vocab=300,
                     n_ctx_train=777, head_dim=head_dim, dtype="q8_0", embd_dtype="f16", tied=True,
                     rope_base=5e5, rms_eps=1e-6)
    f = GGUFFile(write_model(tmp_path / "m.gguf", spec))
    hd = head_dim or 16
    expected = {
        "general.architecture": arch, f"{arch}.block_count": 3, f"{arch}.embedding_length": 64,
        f"{arch}.context_length": 777, f"{arch}.feed_forward_length": 96,
        f"{arch}.attention.head_count": 4, f"{arch}.attention.head_count_kv": 1,
        f"{arch}.rope.dimension_count": hd, "general.file_type": int(gguf.LlamaFileType.MOSTLY_Q8_0),
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
    }
    for key, value in expected.items():
        assert f.metadata[key] == value, key
    assert f.metadata[f"{arch}.rope.freq_base"] == pytest.approx(5e5)
    assert f.metadata[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert (f.metadata.get(f"{arch}.attention.key_length") == hd) == (head_dim is not None)
    assert len(f.metadata["tokenizer.ggml.tokens"]) == 300
    assert "<|im_start|>" in f.metadata["tokenizer.chat_template"]
    assert "output.weight" not in f.tensors
    assert f.tensors["token_embd.weight"].dtype.name == "f16"
    assert f.tensors["token_embd.weight"].shape == (300, 64)
    assert f.tensors["blk.2.attn_q.weight"].shape == (4 * hd, 64)
    assert f.tensors["blk.2.attn_k.weight"].dtype.name == "q8_0"
    assert f.tensors["blk.2.attn_k.weight"].shape == (hd, 64)
    assert ("blk.0.attn_q.bias" in f.tensors) == (arch == "qwen2")
    assert ("blk.0.attn_q_norm.weight" in f.tensors) == (arch == "qwen3")


def test_invalid_specs_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="arch"):
        write_model(tmp_path / "m.gguf", SynthSpec(arch="no-such-arch"))
    with pytest.raises(ValueError, match="multiples of 32"):
        write_model(tmp_path / "m.gguf", SynthSpec(dtype="q4_0", n_embd=48, n_head=4, n_head_kv=2))
    with pytest.raises(ValueError, match="qwen2"):
        write_model(tmp_path / "m.gguf", SynthSpec(arch="qwen2", head_dim=32))
    with pytest.raises(ValueError, match=r"sliding_window is a (.*, )?gemma3(, .*)? setting"):
        write_model(tmp_path / "m.gguf", SynthSpec(sliding_window=64))


def test_k_quant_matrices_are_ggml_quantized(tmp_path):
    """K-quant files hold what ggml's reference quantizer makes of the float weights."""
    path = write_model(tmp_path / "k.gguf", SynthSpec(dtype="q4_k", embd_dtype="q6_k", n_embd=256, n_ff=512))
    f32 = GGUFFile(write_model(tmp_path / "f.gguf", SynthSpec(dtype="f32", n_embd=256, n_ff=512)))
    k = GGUFFile(path)
    assert k.metadata["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_Q4_K_S)
    for name, t in k.tensors.items():
        ref = f32.tensors[name]
        if len(t.shape) == 2:
            assert t.dtype.name == ("q6_k" if name == "token_embd.weight" else "q4_k"), name
            want = quants.quantize(np.asarray(ref.data, dtype=np.float32), t.dtype)
            assert np.array_equal(np.asarray(t.data).view(np.uint8).reshape(want.shape), want), name


def test_k_quants_need_rows_of_256():
    with pytest.raises(ValueError, match="multiples of 256"):
        write_model("/nonexistent/never.gguf", SynthSpec(dtype="q4_k"))


def test_rewrite_cuts_blocks(tmp_path):
    src = write_model(tmp_path / "src.gguf", SynthSpec(n_layer=3, dtype="q4_0"))
    dst = rewrite(src, tmp_path / "cut.gguf", n_layer=2)
    a, b = GGUFFile(src), GGUFFile(dst)
    assert b.metadata["llama.block_count"] == 2
    assert {k: v for k, v in b.metadata.items() if k != "llama.block_count"}.keys() == \
        {k for k in a.metadata if k != "llama.block_count"}
    assert set(b.tensors) == {n for n in a.tensors if not n.startswith("blk.2.")}
    for name, t in b.tensors.items():
        assert t.dtype == a.tensors[name].dtype
        assert np.array_equal(np.asarray(t.data), np.asarray(a.tensors[name].data)), name


def test_rewrite_without_changes_copies_the_file_exactly(tmp_path):
    src = write_model(tmp_path / "src.gguf", SynthSpec(arch="qwen3", dtype="q8_0"))
    assert rewrite(src, tmp_path / "copy.gguf").read_bytes() == src.read_bytes()


def test_rewrite_copies_nested_metadata_arrays_exactly(tmp_path, monkeypatch):
    from llamir.frontend import synth

    add_hparams = synth._add_hparams
    array = gguf.GGUFValueType.ARRAY

    def with_nested_arrays(writer, spec):
        add_hparams(writer, spec)
        writer.add_key_value("test.nested_ints", [[1, 2, 3], [4], [5, 6]], array, sub_type=array)
        writer.add_key_value("test.nested_strings", [["a", "bc"], ["d"]], array, sub_type=array)

    monkeypatch.setattr(synth, "_add_hparams", with_nested_arrays)
    src = write_model(tmp_path / "src.gguf", SynthSpec())
    assert rewrite(src, tmp_path / "copy.gguf").read_bytes() == src.read_bytes()
    cut = gguf.GGUFReader(rewrite(src, tmp_path / "cut.gguf", n_layer=1))
    assert [int(cut.fields["test.nested_ints"].parts[i][0]) for i in cut.fields["test.nested_ints"].data] == \
        [1, 2, 3, 4, 5, 6]


def test_rewrite_refuses_a_big_endian_file(tmp_path):
    path = tmp_path / "be.gguf"
    writer = gguf.GGUFWriter(path, "llama", endianess=gguf.GGUFEndian.BIG)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="big-endian"):
        rewrite(path, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


@pytest.mark.parametrize("src_dtype,dst_dtype",
                         [("q4_1", "f32"), ("q4_0", "f16"), ("f32", "q8_0"), ("q8_0", "q4_0")])
def test_rewrite_retypes_every_matrix(tmp_path, src_dtype, dst_dtype):
    src = write_model(tmp_path / "src.gguf", SynthSpec(arch="qwen2", dtype=src_dtype, embd_dtype="q8_0"))
    dst = rewrite(src, tmp_path / "dst.gguf", dtype=dst_dtype)
    a, b = GGUFFile(src), GGUFFile(dst)
    file_type = getattr(gguf.LlamaFileType, f"MOSTLY_{dst_dtype.upper()}", gguf.LlamaFileType.ALL_F32)
    assert b.metadata["general.file_type"] == int(file_type)
    qtype = gguf.GGMLQuantizationType[dst_dtype.upper()]
    for name, t in a.tensors.items():
        out = b.tensors[name]
        assert out.shape == t.shape
        if len(t.shape) != 2:
            assert out.dtype == t.dtype and np.array_equal(np.asarray(out.data), np.asarray(t.data))
            continue
        assert out.dtype.name == dst_dtype, name
        # what gguf.quants makes of the dequantized source, byte for byte
        expected = gguf.quants.quantize(_values(t), qtype)
        got = np.asarray(out.data).view(np.uint8).ravel()
        assert np.array_equal(got, expected.view(np.uint8).ravel()), name


@pytest.mark.llama_cpp
def test_dequantized_rewrite_runs_in_llama_cpp_close_to_the_original(tmp_path):
    src = write_model(tmp_path / "src.gguf", SynthSpec(dtype="q4_0"))
    dst = rewrite(src, tmp_path / "f32.gguf", dtype="f32")
    out = []
    for path in (src, dst):
        with _oracle(path) as oracle:
            out.append(oracle.eval_logits(oracle.tokenize(PROMPT)[:10], "batch"))
    assert nmse(out[0], out[1]) < 1e-2
