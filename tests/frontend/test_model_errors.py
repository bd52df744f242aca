"""Loading GGUF models: hparams as llama.cpp reads them, and a clear error for every bad file."""

from __future__ import annotations

import math
import struct

import gguf
import gguf_craft as craft
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
    graph = model.build_graph(llamir.Context(model, n_ctx=256).graph_config(True)).graph
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


# ------------------------------------------------------------------ issue 9, findings 4, 5 and 6
# Each case rewrites one thing of a valid llama file (gguf_craft, independent of llamir's reader)
# and states what llama.cpp does with it, checked by loading it with llama.cpp in a subprocess:
# "refuses" (its loader fails), "aborts" (it loads, then a GGML_ASSERT kills it at the first
# decode: llamir refuses at load, since the file cannot be decoded), or "loads" (llamir loads
# and decodes it too).

def _set(key, vtype, raw):
    return lambda g: g.set(key, vtype, raw)


def _nested(depth: int, gguf_py_layout: bool):
    """An array of arrays `depth` deep: gguf-py writes inner arrays without their type id."""
    inner = craft.array(craft.U32, [7])
    for _ in range(depth):
        inner = struct.pack("<iQ", craft.ARRAY, 1) + (b"" if gguf_py_layout else struct.pack("<i", craft.ARRAY)) + inner
    return _set("llama.nested", craft.ARRAY, inner)


def _duplicate_key(g):
    g.kvs.append(g.kv("llama.block_count"))
    return g


def _duplicate_tensor(g):
    t = g.tensors[-1]
    g.tensors.append(craft.TensorInfo(t.name, list(t.ne), t.ggml_type, t.offset))
    return g


def _overlapping_data(g):
    g.tensors[2].offset = g.tensors[1].offset   # the third tensor's data starts inside the second's
    return g


def _data_past_the_end(g):
    g.blob = g.blob[:-64]
    return g


def _extra_tensor(name: str):
    def edit(g):
        g.tensors.append(craft.TensorInfo(name.encode(), [8], 0, len(g.blob)))   # ggml f32
        g.blob += bytes(32)
        return g
    return edit


F32_NAN, F32_INF = craft.scalar(craft.F32, math.nan), craft.scalar(craft.F32, math.inf)
BAD_FILES = {
    # finding 4: metadata values of the wrong type, NaN, arrays, nesting
    "str-for-u32": (_set("llama.context_length", craft.STRING, craft.string("abc")), "refuses",
                    r"'llama\.context_length' has type str but llama\.cpp reads it as u32 \(value 'abc'\)"),
    "i32-for-u32": (_set("llama.embedding_length", craft.I32, craft.scalar(craft.I32, 64)), "refuses",
                    r"'llama\.embedding_length' has type i32 but llama\.cpp reads it as u32"),
    "u64-for-u32": (_set("llama.block_count", craft.U64, craft.scalar(craft.U64, 2)), "refuses",
                    r"'llama\.block_count' has type u64"),
    "array-for-u32": (_set("llama.context_length", craft.ARRAY, craft.array(craft.U32, [1, 2])), "refuses",
                      r"'llama\.context_length' has type arr\[u32\] but llama\.cpp reads it as u32"),
    "f64-for-f32": (_set("llama.rope.freq_base", craft.F64, craft.scalar(craft.F64, 1e4)), "refuses",
                    r"'llama\.rope\.freq_base' has type f64 but llama\.cpp reads it as f32"),
    "str-for-f32": (_set("llama.attention.layer_norm_rms_epsilon", craft.STRING, craft.string("1e-5")), "refuses",
                    r"layer_norm_rms_epsilon' has type str"),
    "u8-for-bool": (_set("tokenizer.ggml.add_bos_token", craft.U8, craft.scalar(craft.U8, 1)), "refuses",
                    r"'tokenizer\.ggml\.add_bos_token' has type u8 but llama\.cpp reads it as bool"),
    "i32-token-id": (_set("tokenizer.ggml.bos_token_id", craft.I32, craft.scalar(craft.I32, 1)), "refuses",
                     r"'tokenizer\.ggml\.bos_token_id' has type i32 but llama\.cpp reads it as u32"),
    "u32-for-string": (_set("general.name", craft.U32, craft.scalar(craft.U32, 5)), "refuses",
                       r"'general\.name' has type u32 but llama\.cpp reads it as str"),
    "u32-token-types": (_set("tokenizer.ggml.token_type", craft.ARRAY, craft.array(craft.U32, [1] * 512)), "refuses",
                        r"invalid gguf type for tokenizer\.ggml\.token_type: arr\[u32\], expected arr\[i32\]"),
    "u8-head-counts": (_set("llama.attention.head_count", craft.ARRAY, craft.array(craft.U8, [4, 4])), "refuses",
                       r"'llama\.attention\.head_count' has type arr\[u8\]"),
    "head-counts-for-3-layers": (_set("llama.attention.head_count", craft.ARRAY, craft.array(craft.U32, [4] * 3)),
                                 "refuses", r"'llama\.attention\.head_count' has 3 entries, expected 2"),
    "nested-gguf-py-layout": (_nested(1, gguf_py_layout=True), "refuses",
                              r"key 'llama\.nested' is an array of arrays.*\(at byte \d+\)"),
    "nested-10000-deep": (_nested(10000, gguf_py_layout=False), "refuses",
                          r"key 'llama\.nested' is an array of arrays"),
    "unknown-value-type": (_set("llama.odd", 13, b""), "refuses", r"key 'llama\.odd' has invalid GGUF type 13"),
    "nan-rms-eps": (_set("llama.attention.layer_norm_rms_epsilon", craft.F32, F32_NAN), "aborts",
                    r"layer_norm_rms_epsilon = nan: ggml's rms_norm needs eps >= 0"),
    "negative-rms-eps": (_set("llama.attention.layer_norm_rms_epsilon", craft.F32, craft.scalar(craft.F32, -1)),
                         "aborts", r"layer_norm_rms_epsilon = -1\.0"),
    "odd-rope-dims": (_set("qwen2.rope.dimension_count", craft.U32, craft.scalar(craft.U32, 15)), "aborts",
                      r"qwen2\.rope\.dimension_count = 15: rope needs an even count"),
    # finding 5: what gguf.cpp and llama-model-loader refuse
    "duplicate-key": (_duplicate_key, "refuses", r"duplicate key 'llama\.block_count' \(key/value pair 24\) \(at byte"),
    "duplicate-tensor": (_duplicate_tensor, "refuses", r"duplicate tensor name 'blk\.1\.ffn_down\.weight'.*\(at byte"),
    "overlapping-data": (_overlapping_data, "refuses", r"tensor 'output\.weight' \(info at byte \d+\) has "
                         r"data offset 131072, expected 131328: overlapping the data of tensor 'output_norm\.weight'"),
    "data-past-the-end": (_data_past_the_end, "refuses", r"'blk\.1\.ffn_down\.weight' data is not within the file"),
    "extra-tensor": (_extra_tensor("foo.weight"), "refuses", r"tensor 'foo\.weight' is not one the llama "
                     r"architecture loads; llama\.cpp refuses the file \(done_getting_tensors: wrong number of "
                     r"tensors; expected 22, got 21\)"),
    "tensor-of-a-third-layer": (_extra_tensor("blk.2.attn_norm.weight"), "refuses",
                                r"'blk\.2\.attn_norm\.weight' is not"),
    "alignment-bool": (_set("general.alignment", craft.BOOL, b"\1"), "refuses",
                       r"'general\.alignment' must be of type u32 but is bool \(value True\)"),
    "alignment-f32": (_set("general.alignment", craft.F32, craft.scalar(craft.F32, 32)), "refuses",
                      r"'general\.alignment' must be of type u32 but is f32"),
    "alignment-u8": (_set("general.alignment", craft.U8, craft.scalar(craft.U8, 32)), "refuses",
                     r"'general\.alignment' must be of type u32 but is u8"),
    "alignment-string": (_set("general.alignment", craft.STRING, craft.string("32")), "refuses",
                         r"'general\.alignment' must be of type u32 but is str"),
    "alignment-48": (_set("general.alignment", craft.U32, craft.scalar(craft.U32, 48)), "refuses",
                     r"general\.alignment = 48 is not a power of 2"),
    # what llama.cpp accepts, llamir accepts (and decodes) too
    "i32-head-counts": (_set("llama.attention.head_count", craft.ARRAY, craft.array(craft.I32, [4, 4])), "loads", None),
    "i32-scores": (_set("tokenizer.ggml.scores", craft.ARRAY, craft.array(craft.I32, range(512))), "loads", None),
    "misread-key-of-other-arch": (_set("llama.attention.scale", craft.STRING, craft.string("x")), "loads", None),
    "alignment-u32-32": (_set("general.alignment", craft.U32, craft.scalar(craft.U32, 32)), "loads", None),
    "inf-rms-eps": (_set("llama.attention.layer_norm_rms_epsilon", craft.F32, F32_INF), "loads", None),
}


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    folder = tmp_path_factory.mktemp("seeds")
    return {arch: craft.parse(write_model(folder / f"{arch}.gguf", SynthSpec(arch=arch, n_layer=2)).read_bytes())
            for arch in ("llama", "qwen2")}


@pytest.mark.llama_cpp
@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_is_refused_as_llama_cpp_refuses_it(case, seeds, tmp_path):
    edit, llama_cpp_does, message = BAD_FILES[case]
    path = tmp_path / f"{case}.gguf"
    path.write_bytes(edit(seeds["qwen2" if case == "odd-rope-dims" else "llama"].copy()).to_bytes())
    oracle = llama_cpp_load(path, decode=llama_cpp_does != "refuses")
    if llama_cpp_does == "refuses":
        assert not oracle.loaded and not oracle.crashed, oracle
    elif llama_cpp_does == "aborts":
        assert oracle.loaded and oracle.crashed, oracle
    else:
        assert oracle.loaded and oracle.decode_rc == 0, oracle
    if message is None:
        ctx = llamir.Context(load_model(path), n_ctx=64, n_batch=8, backend="numpy")
        assert ctx.decode(llamir.Batch.from_tokens([1, 2, 3])) == 0, ctx.last_error
        assert np.isfinite(ctx.get_logits()).all() == oracle.finite_logits
    else:
        with pytest.raises(ModelError, match=message):
            load_model(path)


@pytest.mark.llama_cpp
def test_nan_rope_freq_base_loads_and_decodes_to_nan_as_in_llama_cpp(seeds, tmp_path):
    """Finding 6, the hparams half: llama.cpp loads a NaN rope.freq_base and decodes (every logit
    NaN), so llamir may not refuse it: it loads, and decodes on numpy to NaN logits as well."""
    path = tmp_path / "nan_base.gguf"
    path.write_bytes(_set("llama.rope.freq_base", craft.F32, F32_NAN)(seeds["llama"].copy()).to_bytes())
    oracle = llama_cpp_load(path, decode=True)
    assert oracle.loaded and oracle.decode_rc == 0 and oracle.finite_logits is False, oracle
    model = load_model(path)
    assert math.isnan(model.hparams.rope_freq_base_train)
    ctx = llamir.Context(model, n_ctx=64, n_batch=8, backend="numpy")
    with np.errstate(invalid="ignore"):
        assert ctx.decode(llamir.Batch.from_tokens([1, 2, 3])) == 0, ctx.last_error
    assert np.isnan(ctx.get_logits()).all()


@pytest.mark.llama_cpp
@pytest.mark.parametrize("edit", ["base-1", "base-0.5", "orig-ctx-0"])
def test_degenerate_yarn_hparams_decode_as_in_llama_cpp(edit, tmp_path):
    """YaRN with a rope base <= 1 or an original context of 0: ggml's corr dims take logf(1) = 0 as
    a divisor, or logf(0) = -inf, and decode on (C's infinities, NaN through its MAX/MIN macros);
    llamir computed them with math.log and raised ValueError / ZeroDivisionError inside decode."""
    spec = SynthSpec(arch="llama", n_layer=1, rope_scaling="yarn",
                     rope_base={"base-1": 1.0, "base-0.5": 0.5}.get(edit, 10000.0))
    path = write_model(tmp_path / "seed.gguf", spec)
    if edit == "orig-ctx-0":
        g = craft.parse(path.read_bytes())
        g.set("llama.rope.scaling.original_context_length", craft.U32, struct.pack("<I", 0))
        path.write_bytes(g.to_bytes())
    oracle = llama_cpp_load(path, decode=True)
    assert oracle.loaded and oracle.decode_rc == 0, oracle
    model = load_model(path)
    for backend in ("numpy", "llvm"):
        ctx = llamir.Context(model, n_ctx=64, n_batch=8, backend=backend)
        with np.errstate(all="ignore"):
            assert ctx.decode(llamir.Batch.from_tokens([1, 2, 3])) == 0, ctx.last_error
        assert np.isfinite(ctx.get_logits()).all() == oracle.finite_logits, backend
