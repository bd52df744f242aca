"""State save/load: exact round trips, llama.cpp's byte layout, and bad blobs rejected with the
context left exactly as it was (the next decode gives the logits it would have given)."""

from __future__ import annotations

import numpy as np
import pytest

import llamir
from llamir.context.state import StateError
from llamir.frontend.synth import SynthSpec, write_model

TOKENS = list(range(5, 26))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return llamir.load_model(write_model(tmp_path_factory.mktemp("state") / "m.gguf",
                                         SynthSpec(arch="llama", dtype="q8_0", n_layer=2)))


def _ctx(model, **kw):
    return llamir.Context(model, **{"n_ctx": 256, "n_seq_max": 2, "flash_attn": "off", **kw})


def _decoded(model, tokens=TOKENS, **kw):
    ctx = _ctx(model, **kw)
    assert ctx.decode(llamir.Batch.from_tokens(tokens, logits="all")) == 0
    return ctx


def _next_logits(ctx, token=3):
    assert ctx.decode(llamir.Batch.from_tokens([token], pos0=None)) == 0, ctx.last_error
    return ctx.get_logits_ith(-1).copy()


def test_full_state_round_trip_is_exact(model, tmp_path):
    src = _decoded(model)
    blob = src.state_get_data()
    assert src.state_get_size() == len(blob)
    dst = _ctx(model)
    assert dst.state_set_data(blob) == len(blob)
    assert dst.state_get_data() == blob
    np.testing.assert_array_equal(dst.get_logits(), src.get_logits())
    np.testing.assert_array_equal(_next_logits(dst), _next_logits(src))


def test_session_file_round_trip(model, tmp_path):
    src = _decoded(model)
    path = tmp_path / "session.bin"
    src.state_save_file(path, TOKENS)
    dst = _ctx(model)
    assert dst.state_load_file(path, n_token_capacity=64) == TOKENS
    np.testing.assert_array_equal(_next_logits(dst), _next_logits(src))
    with pytest.raises(StateError, match="exceeded capacity"):
        _ctx(model).state_load_file(path, n_token_capacity=3)


def test_sequence_state_moves_to_another_sequence(model, tmp_path):
    src = _decoded(model)
    blob = src.state_seq_get_data(0)
    dst = _ctx(model)
    assert dst.decode(llamir.Batch.from_tokens([9, 9, 9], seq_id=1)) == 0  # something else stays put
    dst.state_seq_set_data(blob, dest_seq_id=1)
    assert dst.memory.seq_pos_max(1) == len(TOKENS) - 1
    assert dst.decode(llamir.Batch.from_tokens([3], pos0=None, seq_id=1)) == 0
    np.testing.assert_array_equal(dst.get_logits_ith(-1), _next_logits(src))
    path = tmp_path / "seq.bin"
    src.state_seq_save_file(path, 0, TOKENS)
    other = _ctx(model)
    assert other.state_seq_load_file(path, dest_seq_id=0, n_token_capacity=64) == TOKENS


def _corruptions(blob: bytes):
    yield "truncated", blob[: len(blob) // 2], "truncated state"
    yield "empty", b"", "truncated state"
    yield "wrong arch", b"\x05\x00\x00\x00qwen3" + blob[9:], "wrong model arch"
    yield "trailing bytes", blob + b"\x00", "unexpected bytes"
    arch_len = 4 + 5
    bad_outputs = bytearray(blob)
    bad_outputs[arch_len:arch_len + 4] = (10**6).to_bytes(4, "little")
    yield "n_outputs", bytes(bad_outputs), "too many output rows"


@pytest.mark.parametrize("case", ["truncated", "empty", "wrong arch", "trailing bytes", "n_outputs"])
def test_corrupt_state_is_rejected_and_changes_nothing(model, case):
    blob = dict((name, (data, msg)) for name, data, msg in _corruptions(_decoded(model).state_get_data()))
    data, message = blob[case]
    victim = _decoded(model, tokens=TOKENS[:7])
    witness = _decoded(model, tokens=TOKENS[:7])
    logits_before = victim.get_logits().copy()
    with pytest.raises(StateError, match=message):
        victim.state_set_data(data)
    np.testing.assert_array_equal(victim.get_logits(), logits_before)
    np.testing.assert_array_equal(_next_logits(victim), _next_logits(witness))


def test_state_from_other_dims_is_rejected(model, tmp_path):
    blob = _decoded(model).state_get_data()
    other = llamir.load_model(write_model(tmp_path / "wide.gguf", SynthSpec(arch="llama", dtype="q8_0",
                                                                              n_layer=3)))
    victim = _ctx(other)
    with pytest.raises(StateError, match="mismatched layer count"):
        victim.state_set_data(blob)
    f32_kv = _ctx(model, type_k="f32", type_v="f32")
    with pytest.raises(StateError, match="mismatched key type"):
        f32_kv.state_set_data(blob)
    fa = _ctx(model, flash_attn="on")
    with pytest.raises(StateError, match="V transposition"):
        fa.state_set_data(blob)


def test_bad_session_file_header(model, tmp_path):
    path = tmp_path / "bad.bin"
    path.write_bytes(b"\x00" * 16)
    with pytest.raises(StateError, match="unknown \\(magic, version\\)"):
        _ctx(model).state_load_file(path, 64)


def test_sequence_memory_bytes_equal_llama_cpp(model):
    """The memory section is llama.cpp's byte for byte (this llama.cpp prefixes its sequence
    states with an 8-byte magic + seq id, which the older layout we follow does not have)."""
    oracle = pytest.importorskip("llamir.testing.llama_cpp")
    llama_cpp = pytest.importorskip("llama_cpp")
    import ctypes

    ours = _decoded(model, n_seq_max=1).state_seq_get_data(0)
    with oracle.LlamaCppOracle(model.path, n_ctx=256) as o:
        o.decode(TOKENS, pos0=0)
        n = llama_cpp.llama_state_seq_get_size(o._ctx, 0)
        buf = (ctypes.c_uint8 * n)()
        llama_cpp.llama_state_seq_get_data(o._ctx, buf, n, 0)
    assert ours == bytes(buf)[8:]
