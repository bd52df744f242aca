"""State save/load within llamir: exact round trips, and bad states rejected with the context left
exactly as it was (its state serialises as before and the next decode gives the logits it would
have given). Each bad input is also handed to llama.cpp, which must refuse it as well, except
where noted: llamir also refuses trailing bytes after a blob, which llama.cpp ignores."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

import llamir
from llamir.context.state import StateError
from llamir.frontend.synth import SynthSpec, write_model
from llamir.testing.llama_cpp import LlamaCppOracle

pytestmark = pytest.mark.llama_cpp

TOKENS = list(range(5, 26))
HELD = [40, 41, 42, 43]      # what a victim holds in sequence 1
N_CTX = 512                  # two streams of 256 cells
ARCH = struct.pack("<I", 5) + b"llama"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return llamir.load_model(write_model(tmp_path_factory.mktemp("state") / "m.gguf",
                                         SynthSpec(arch="llama", dtype="q8_0", n_layer=2)))


def _ctx(model, **kw):
    return llamir.Context(model, **{"backend": "numpy", "n_ctx": N_CTX, "n_seq_max": 2, "flash_attn": "off", **kw})


def _decoded(model, tokens=TOKENS, **kw):
    ctx = _ctx(model, **kw)
    assert ctx.decode(llamir.Batch.from_tokens(tokens, logits="all")) == 0
    return ctx


def _next_logits(ctx, token=3, seq_id=0):
    assert ctx.decode(llamir.Batch.from_tokens([token], pos0=None, seq_id=seq_id)) == 0, ctx.last_error
    return ctx.get_logits_ith(-1).copy()


def _oracle(model, **kw) -> LlamaCppOracle:
    return LlamaCppOracle(model.path, **{"n_ctx": N_CTX, "n_seq_max": 2, **kw})


def test_full_state_round_trip_is_exact(model):
    src = _decoded(model)
    blob = src.state_get_data()
    assert src.state_get_size() == len(blob)
    dst = _decoded(model, tokens=HELD)
    assert dst.state_set_data(blob) == len(blob)
    assert dst.state_get_data() == blob
    assert dst.get_logits().shape == (0, model.hparams.n_vocab)   # a state has no outputs: they are dropped
    with pytest.raises(llamir.OutputError, match="no outputs"):
        dst.get_logits_ith(-1)
    np.testing.assert_array_equal(_next_logits(dst), _next_logits(src))


def test_state_of_a_context_without_outputs(model):
    fresh = _ctx(model)
    blob = fresh.state_get_data()
    assert blob == ARCH + struct.pack("<III", 2, 0, 0)         # n_stream, then two empty streams
    dst = _decoded(model)
    assert dst.state_set_data(blob) == len(blob)
    assert dst.memory.seq_pos_max(0) == -1


def test_session_file_round_trip(model, tmp_path):
    src = _decoded(model)
    path = tmp_path / "session.bin"
    assert src.state_save_file(path, TOKENS) == path.stat().st_size
    dst = _ctx(model)
    assert dst.state_load_file(path, n_token_capacity=64) == TOKENS
    np.testing.assert_array_equal(_next_logits(dst), _next_logits(src))


def test_sequence_state_moves_to_another_sequence(model, tmp_path):
    src = _decoded(model)
    blob = src.state_seq_get_data(0)
    assert src.state_seq_get_size(0) == len(blob)
    dst = _ctx(model)
    assert dst.decode(llamir.Batch.from_tokens([9, 9, 9], seq_id=0)) == 0  # something else stays put
    assert dst.state_seq_set_data(blob, dest_seq_id=1) == len(blob)
    assert (dst.memory.seq_pos_max(0), dst.memory.seq_pos_max(1)) == (2, len(TOKENS) - 1)
    np.testing.assert_array_equal(_next_logits(dst, seq_id=1), _next_logits(src))
    path = tmp_path / "seq.bin"
    src.state_seq_save_file(path, 0, TOKENS)
    other = _ctx(model)
    assert other.state_seq_load_file(path, dest_seq_id=0, n_token_capacity=64) == TOKENS
    assert other.state_seq_get_data(0) == src.state_seq_get_data(0)


# -- bad states ------------------------------------------------------------------------------------
def _victim_and_witness(model):
    """Two contexts holding the same thing: TOKENS[:7] in sequence 0, HELD in sequence 1."""
    pair = []
    for _ in range(2):
        ctx = _decoded(model, tokens=TOKENS[:7])
        assert ctx.decode(llamir.Batch.from_tokens(HELD, seq_id=1, logits="all")) == 0
        pair.append(ctx)
    return pair


def _assert_untouched(victim, witness) -> None:
    np.testing.assert_array_equal(victim.get_logits(), witness.get_logits())
    assert victim.state_get_data() == witness.state_get_data()
    for seq_id in (0, 1):
        np.testing.assert_array_equal(_next_logits(victim, seq_id=seq_id), _next_logits(witness, seq_id=seq_id))


def _patched(data: bytes, offset: int, fmt: str, *values) -> bytes:
    out = bytearray(data)
    struct.pack_into("<" + fmt, out, offset, *values)
    return bytes(out)


CELLS = len(ARCH) + 8                     # after n_stream and the first stream's cell count
LAYERS = CELLS + 12 * len(TOKENS)         # after the cells (pos, n_seq_id, one id each): v_trans, n_layer
IGNORED = True                            # llama.cpp reads the state and ignores what follows
STATE_CORRUPTIONS = {  # name: (make the blob from a good one, llamir's message, llama.cpp ignores the fault)
    "truncated": (lambda b: b[: len(b) // 2], "truncated state", False),
    "empty": (lambda b: b"", "truncated state", False),
    "truncated values": (lambda b: b[:-1], "truncated state", False),
    "wrong arch": (lambda b: struct.pack("<I", 5) + b"qwen3" + b[len(ARCH):], "wrong model arch", False),
    "trailing bytes": (lambda b: b + b"\x00", "unexpected bytes", IGNORED),
    "n_stream": (lambda b: _patched(b, len(ARCH), "I", 3), "n_stream mismatch", False),
    "cell count": (lambda b: _patched(b, len(ARCH) + 4, "I", 10**6), "not enough cells", False),
    "seq id": (lambda b: _patched(b, CELLS + 8, "i", 5), "invalid seq_id", False),
    "layer count": (lambda b: _patched(b, LAYERS + 4, "I", 3), "mismatched layer count", False),
    "key type": (lambda b: _patched(b, LAYERS + 8, "i", 0), "mismatched key type", False),
}


@pytest.mark.parametrize("case", list(STATE_CORRUPTIONS))
def test_corrupt_state_is_rejected_and_changes_nothing(model, case):
    corrupt, message, llama_cpp_ignores = STATE_CORRUPTIONS[case]
    blob = _decoded(model).state_get_data()
    assert blob.startswith(ARCH) and struct.unpack_from("<IIiIi", blob, len(ARCH)) == (2, len(TOKENS), 0, 1, 0)
    data = corrupt(blob)
    victim, witness = _victim_and_witness(model)
    with pytest.raises(StateError, match=message):
        victim.state_set_data(data)
    _assert_untouched(victim, witness)
    with _oracle(model) as o:
        assert o.state_set_data(data) == (len(blob) if llama_cpp_ignores else 0)


SEQ_CORRUPTIONS = {
    "magic": (lambda b: _patched(b, 0, "I", 0x12345678), "wrong sequence state magic", False),
    "prefix only": (lambda b: b[:8], "truncated state", False),
    "truncated": (lambda b: b[:-3], "truncated state", False),
    "trailing bytes": (lambda b: b + b"\x00", "unexpected bytes", IGNORED),
    "n_stream": (lambda b: _patched(b, 8, "I", 1), "n_stream mismatch", False),
    "shared cell": (lambda b: _patched(b, 20, "I", 2), "invalid seq_id-agnostic kv cell", False),
}


@pytest.mark.parametrize("case", list(SEQ_CORRUPTIONS))
def test_corrupt_sequence_state_is_rejected_and_changes_nothing(model, case):
    corrupt, message, llama_cpp_ignores = SEQ_CORRUPTIONS[case]
    blob = _decoded(model).state_seq_get_data(0)
    assert struct.unpack_from("<IiIIiI", blob) == (0xAF143CD8, 0, 2, len(TOKENS), 0, 1)
    data = corrupt(blob)
    victim, witness = _victim_and_witness(model)
    with pytest.raises(StateError, match=message):
        victim.state_seq_set_data(data, dest_seq_id=1)
    _assert_untouched(victim, witness)
    with _oracle(model) as o:
        assert o.state_seq_set_data(data, 1) == (len(blob) if llama_cpp_ignores else 0)


def _session_cases(data: bytes) -> dict[str, tuple[bytes, int, str]]:
    """name: (file bytes, token capacity, llamir's message); llama.cpp refuses every one."""
    return {
        "magic": (_patched(data, 0, "I", 0x6767736F), 64, r"unknown \(magic, version\)"),
        "version 11": (_patched(data, 4, "I", 11), 64, r"unknown \(magic, version\)"),
        "capacity": (data, 3, "exceeded capacity"),
        "truncated tokens": (data[:20], 64, "truncated state"),
        "truncated state": (data[:-5], 64, "truncated state"),
        "trailing bytes": (data + b"\x00", 64, "unexpected bytes"),
    }


@pytest.mark.parametrize("case", ["magic", "version 11", "capacity", "truncated tokens", "truncated state",
                                  "trailing bytes"])
def test_corrupt_session_file_is_rejected_and_changes_nothing(model, tmp_path, case):
    good = tmp_path / "good.bin"
    _decoded(model).state_save_file(good, TOKENS)
    data, capacity, message = _session_cases(good.read_bytes())[case]
    path = tmp_path / "bad.bin"
    path.write_bytes(data)
    victim, witness = _victim_and_witness(model)
    with pytest.raises(StateError, match=message):
        victim.state_load_file(path, capacity)
    _assert_untouched(victim, witness)
    with _oracle(model) as o:
        assert o.state_load_file(path, capacity) is None


@pytest.mark.parametrize("case", ["version 4", "capacity", "truncated", "trailing bytes"])
def test_corrupt_sequence_file_is_rejected_and_changes_nothing(model, tmp_path, case):
    good = tmp_path / "good.bin"
    _decoded(model).state_seq_save_file(good, 0, TOKENS)
    data = good.read_bytes()
    data, capacity, message, llama_cpp_loads = {   # llama.cpp's answer: the tokens, or None (refused)
        "version 4": (_patched(data, 4, "I", 4), 64, r"unknown \(magic, version\)", None),
        "capacity": (data, 3, "exceeded capacity", None),
        "truncated": (data[:-7], 64, "truncated state", None),
        "trailing bytes": (data + b"\x00", 64, "unexpected bytes", TOKENS),   # llama.cpp reads what it needs
    }[case]
    path = tmp_path / "bad.bin"
    path.write_bytes(data)
    victim, witness = _victim_and_witness(model)
    with pytest.raises(StateError, match=message):
        victim.state_seq_load_file(path, 1, capacity)
    _assert_untouched(victim, witness)
    with _oracle(model) as o:
        assert o.state_seq_load_file(path, 1, capacity) == llama_cpp_loads


def _v9_file(path: Path, n_outputs: int, positions: list[int], n_logits: int, memory: bytes) -> None:
    """llamir's older session layout: tokens, arch, then the outputs before the memory."""
    path.write_bytes(struct.pack("<III", 0x6767736E, 9, len(TOKENS)) + np.asarray(TOKENS, "<i4").tobytes()
                     + ARCH + struct.pack("<I", n_outputs) + np.asarray(positions, "<i4").tobytes()
                     + struct.pack("<Q", n_logits) + np.zeros(n_logits, "<f4").tobytes()
                     + struct.pack("<Q", 0) + memory)


@pytest.mark.parametrize("case,n_outputs,positions,n_logits,message", [
    ("n_outputs", 10**6, [], 0, "too many output rows"),
    ("output position", 1, [N_CTX], 0, "invalid output id"),
    ("logits size", 1, [20], 7, "logits size 7 does not match"),
    ("truncated memory", 1, [20], 512, "truncated state"),
])
def test_corrupt_v9_session_file_is_rejected_and_changes_nothing(model, tmp_path, case, n_outputs, positions,
                                                                   n_logits, message):
    memory = _decoded(model).state_get_data()[len(ARCH):]
    path = tmp_path / "v9.bin"
    _v9_file(path, n_outputs, positions, n_logits, memory[:-1] if case == "truncated memory" else memory)
    victim, witness = _victim_and_witness(model)
    with pytest.raises(StateError, match=message):
        victim.state_load_file(path, 64)
    _assert_untouched(victim, witness)
    good = tmp_path / "v9-good.bin"
    _v9_file(good, 1, [20], model.hparams.n_vocab, memory)          # the same file, uncorrupted, loads
    assert _ctx(model).state_load_file(good, 64) == TOKENS


def test_state_from_another_context_is_rejected(model, tmp_path):
    """Files from other layer counts, KV types, V layouts and architectures: llamir and llama.cpp
    both refuse them, and llamir's context is unchanged."""
    sources = {
        "mismatched layer count": (write_model(tmp_path / "3.gguf", SynthSpec(arch="llama", dtype="q8_0", n_layer=3)),
                                   {}),
        "mismatched key type": (model.path, {"type_k": "f32", "type_v": "f32"}),
        "V transposition": (model.path, {"flash_attn": "on"}),
        "wrong model arch": (write_model(tmp_path / "q3.gguf", SynthSpec(arch="qwen3", dtype="q8_0")), {}),
    }
    for message, (path, kw) in sources.items():
        session = tmp_path / f"{message}.bin"
        _decoded(llamir.load_model(path), **kw).state_save_file(session, TOKENS)
        victim, witness = _victim_and_witness(model)
        with pytest.raises(StateError, match=message):
            victim.state_load_file(session, 64)
        _assert_untouched(victim, witness)
        with _oracle(model) as o:
            assert o.state_load_file(session, 64) is None, message
