"""GGUFFile against gguf.GGUFReader (an independent reader of the same container)."""

from __future__ import annotations

import dataclasses
import struct

import gguf
import gguf_craft as craft
import numpy as np
import pytest
from llama_cpp_loader import llama_cpp_load

from llamir.frontend.gguf_file import GGUFError, GGUFFile, MetadataError
from llamir.frontend.gguf_meta import GGUFType, Metadata, ValueType
from llamir.frontend.synth import SynthSpec, write_model


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "q8_0", "q4_1"])
def test_metadata_and_tensors_match_gguf_reader(tmp_path, dtype):
    path = write_model(tmp_path / "m.gguf", SynthSpec(dtype=dtype, n_layer=1))
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        want = field.contents()
        got = ours.metadata[key]
        if isinstance(want, list):
            assert list(got) == pytest.approx(want) if not isinstance(want[0], str) else list(got) == want
        else:
            assert got == pytest.approx(want) if isinstance(want, float) else got == want
    assert set(ours.tensors) == {t.name for t in ref.tensors}
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert mine.shape == tuple(int(n) for n in reversed(t.shape.tolist()))
        want = np.asarray(t.data).view(np.uint8).reshape(-1)
        np.testing.assert_array_equal(mine.data.view(np.uint8).reshape(-1), want)


def test_bad_alignment_and_dims_are_named(tmp_path):
    path = write_model(tmp_path / "m.gguf", SynthSpec(n_layer=1))
    data = bytearray(path.read_bytes())
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data[:4]) + (7).to_bytes(4, "little") + bytes(data[8:]))
    with pytest.raises(GGUFError, match="GGUF version 7 is not supported"):
        GGUFFile(bad)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFError, match="too short"):
        GGUFFile(empty)


# ------------------------------------------------------------------ gguf.cpp's rules (issue 9)

@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> craft.Gguf:
    path = write_model(tmp_path_factory.mktemp("m") / "m.gguf", SynthSpec(n_layer=2))
    return craft.parse(path.read_bytes())


def _write(tmp_path, g: craft.Gguf, name: str = "case.gguf"):
    path = tmp_path / name
    path.write_bytes(g.to_bytes())
    return path


def test_values_keep_their_stored_types(tmp_path, llama):
    meta = GGUFFile(_write(tmp_path, llama)).metadata
    assert meta.type_of("llama.block_count") == ValueType(GGUFType.UINT32)
    assert meta.type_of("tokenizer.ggml.tokens") == ValueType(GGUFType.ARRAY, GGUFType.STRING)
    assert meta.get_u32("llama.block_count") == 2 and meta.get_f32("llama.rope.freq_base") == 10000.0
    with pytest.raises(MetadataError, match=r"'llama\.block_count' has type u32 but llama\.cpp reads it as f32 "
                                            r"\(value 2\)"):
        meta.get_f32("llama.block_count")
    with pytest.raises(MetadataError, match=r"required metadata key 'llama\.missing' is missing"):
        meta.get_u32("llama.missing", required=True)


def test_per_layer_arrays_convert_as_llama_cpp_copies_them(tmp_path, llama):
    """get_key_or_arr into std::array<uint32_t>: i32 items are copied bit for bit, bools become 0/1."""
    g = llama.set("a", craft.ARRAY, craft.array(craft.I32, [4, -1])).set("b", craft.ARRAY,
                                                                         craft.array(craft.BOOL, [1, 0]))
    meta = GGUFFile(_write(tmp_path, g.set("c", craft.U32, craft.scalar(craft.U32, 3)))).metadata
    assert meta.get_u32_or_arr("a", 2) == (4, 2**32 - 1)
    assert meta.get_u32_or_arr("b", 2) == (1, 0)
    assert meta.get_u32_or_arr("c", 2) == (3, 3)
    with pytest.raises(MetadataError, match=r"'a' has 2 entries, expected 3 \(one per layer\)"):
        meta.get_u32_or_arr("a", 3)


def test_plain_python_metadata_is_checked_by_kind():
    meta = Metadata({"n": 7, "s": "x", "f": 0.5, "flag": True, "big": 2**40, "ids": [1, 2]})
    assert meta.get_u32("n") == 7 and meta.get_f32("n") == 7.0 and meta.get_bool("flag") is True
    for key, getter in (("s", meta.get_u32), ("big", meta.get_u32), ("flag", meta.get_u32), ("n", meta.get_str)):
        with pytest.raises(MetadataError, match=f"'{key}'"):
            getter(key)
    assert meta.get_u32_or_arr("ids", 2) == (1, 2)
    # `|` keeps the stored types of the keys it does not set
    merged = Metadata({"n": 1}, {"n": ValueType(GGUFType.INT32)}) | {"s": "y"}
    assert merged.type_of("n") == ValueType(GGUFType.INT32) and merged.type_of("s") is None


def test_a_key_is_found_as_gguf_find_key_finds_it(tmp_path, llama):
    """gguf.cpp compares keys as C strings and returns the first match, so a key with a NUL in it
    shadows a later one with the same prefix (llama.cpp then reads 1 layer and refuses the file)."""
    g = llama.copy()
    g.kvs.insert(3, craft.KV(b"llama.block_count\0junk", craft.U32, craft.scalar(craft.U32, 1)))
    path = _write(tmp_path, g)
    assert GGUFFile(path).metadata["llama.block_count"] == 1
    assert not llama_cpp_load(path).loaded


def test_the_alignment_places_the_data(tmp_path, llama):
    g = llama.set("general.alignment", craft.U32, craft.scalar(craft.U32, 256))
    g.alignment = 256
    f = GGUFFile(_write(tmp_path, g))
    assert f.alignment == 256 and f.data_offset % 256 == 0
    np.testing.assert_array_equal(f.tensors["output_norm.weight"].data,
                                  GGUFFile(_write(tmp_path, llama, "plain.gguf")).tensors["output_norm.weight"].data)


def test_empty_and_scalar_tensors_are_valid_containers(tmp_path, llama):
    """gguf.cpp allows n_dims = 0 and zero-sized dims; llama.cpp's loader then counts them as extra."""
    g = llama.copy()
    g.tensors += [craft.TensorInfo(b"scalar", [], 0, len(g.blob)), craft.TensorInfo(b"empty", [0, 4], 0,
                                                                                       len(g.blob) + 32)]
    g.blob += bytes(32)
    f = GGUFFile(_write(tmp_path, g))
    assert f.tensors["scalar"].shape == (1,) and f.tensors["empty"].shape == (4, 0)


def test_a_nested_array_is_refused_without_recursion(tmp_path, llama):
    inner = craft.array(craft.U32, [1])
    for _ in range(50_000):
        inner = struct.pack("<iQ", craft.ARRAY, 1) + inner
    with pytest.raises(GGUFError, match=r"key 'deep' is an array of arrays, which gguf\.cpp refuses.*at byte \d+"):
        GGUFFile(_write(tmp_path, llama.set("deep", craft.ARRAY, inner)))


@pytest.mark.parametrize("edit, message", [
    (lambda g: g.set("", craft.U32, craft.scalar(craft.U32, 1)), r"key 24 is empty \(at byte \d+\)"),
    (lambda g: g.set("k", craft.ARRAY, struct.pack("<iQ", craft.U8, 2**31)), r"key 'k': array of 2147483648 items "
                                                                              r"exceeds the maximum 1073741824"),
    (lambda g: g.set("k", craft.ARRAY, struct.pack("<iQ", craft.U32, 2**20)), r"key 'k': array of 1048576 u32 items "
                                                                              r"runs past the end of the file"),
    (lambda g: g.set("k", craft.STRING, struct.pack("<Q", 2**58)), r"key 'k': string length \d+ exceeds the maximum"),
    (lambda g: g.set("k", craft.ARRAY, struct.pack("<iQ", 99, 1)), r"key 'k' has invalid GGUF type 99 for array"),
    (lambda g: dataclasses.replace(g, n_tensors=-1), r"negative count in the header: -1 tensors"),
    (lambda g: dataclasses.replace(g, version=1), r"GGUF version 1 is no longer supported"),
    (lambda g: dataclasses.replace(g, version=3 << 24), r"bad GGUF version 50331648 \(a file of the other "
                                                        r"endianness\?\)"),
])
def test_gguf_cpp_refusals_name_what_and_where(tmp_path, llama, edit, message):
    with pytest.raises(GGUFError, match=message):
        GGUFFile(_write(tmp_path, edit(llama.copy())))


@pytest.mark.parametrize("edit, message", [
    (lambda t: setattr(t[0], "name", b"x" * 64), r"tensor 0 name 'x{64}' is too long: 64 >= 64 bytes"),
    (lambda t: setattr(t[0], "ne", [64, 512, 1, 1, 1]), r"has 5 dims \(ggml allows at most 4\)"),
    (lambda t: setattr(t[0], "ne", [64, -1]), r"has a negative dim in ne = \[64, -1\]"),
    (lambda t: setattr(t[0], "ggml_type", 4), r"tensor 'token_embd\.weight' has invalid ggml type 4"),
    (lambda t: (setattr(t[0], "ggml_type", 8), setattr(t[0], "ne", [48, 512])),
     r"tensor 'token_embd\.weight': ne\[0\] = 48 is not a multiple of the block size 32 of ggml type 8"),
    (lambda t: setattr(t[1], "name", t[0].name + b"\0tail"), r"tensor 1: invalid model: tensor 'token_embd\.weight' "
                                                             r"is duplicated"),
])
def test_tensor_info_refusals_name_the_tensor(tmp_path, llama, edit, message):
    g = llama.copy()
    edit(g.tensors)
    with pytest.raises(GGUFError, match=message):
        GGUFFile(_write(tmp_path, g))
