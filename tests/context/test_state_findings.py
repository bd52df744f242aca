"""Regression tests for issue 9's state findings, each against llama.cpp 0.3.36 (llama-cpp-python)
or a witness context that never saw the bad input:

1. a negative cell position, in any of the four load paths (and either cache of an iSWA memory),
   raises StateError and leaves the context exactly as it was, with and without `python -O`;
2. a context without output rows saves its state (fresh, after logits="none", after an aborted
   or a failed decode), and what it saves is what llama.cpp saves and loads;
7. state_seq_set_data(data, dest_seq_id) takes a dest_seq_id in [0, n_seq_max) only: -1 would
   replace every sequence and larger ids would make an unusable sequence or abort llama.cpp.

Also the checks where llamir refuses what llama.cpp accepts and then misbehaves (repeated or
misplaced seq ids, a sequence split over streams, the int32 maximum as a position), and a
sequence restore that fits one iSWA cache but not the other.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import llamir
from llamir.context.state import StateError
from llamir.frontend.synth import SynthSpec, write_model
from llamir.testing.llama_cpp import LlamaCppOracle, oracle_numerics
from llamir.testing.state_fuzz import fields_of, snapshot

pytestmark = pytest.mark.llama_cpp

SOURCE = list(range(5, 26))      # the source's sequence 0
OTHER = [60, 61, 62, 63, 64, 65]  # the source's sequence 1
BASE = list(range(100, 107))     # the victim's sequence 0
HELD = [40, 41, 42, 43]          # the victim's sequence 1
N_CTX = 512
KINDS = ["state", "seq", "session file", "seq file"]
LLAMIR_ROOT = str(Path(llamir.__file__).resolve().parent.parent)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("state_findings")
    return {"llama": write_model(d / "llama.gguf", SynthSpec(arch="llama", dtype="q8_0", n_layer=2)),
            "gemma3": write_model(d / "gemma3.gguf", SynthSpec(arch="gemma3", n_layer=2, swa_pattern=2,
                                                               sliding_window=8, seed=3))}


def _ctx(path, **kw):
    return llamir.Context(llamir.load_model(path),
                          **{"backend": "numpy", "n_ctx": N_CTX, "n_seq_max": 2, "flash_attn": "off", **kw})


def _oracle(path, **kw) -> LlamaCppOracle:
    return LlamaCppOracle(path, **{"n_ctx": N_CTX, "n_seq_max": 2, **kw})


def _decode(ctx, tokens, seq_id, logits="all") -> None:
    assert ctx.decode(llamir.Batch.from_tokens(tokens, pos0=None, seq_id=seq_id, logits=logits)) == 0, ctx.last_error


def _source(path, **kw):
    ctx = _ctx(path, **kw)
    _decode(ctx, SOURCE, 0)
    _decode(ctx, OTHER, 1)
    return ctx


def _victim(path, **kw):
    ctx = _ctx(path, **kw)
    _decode(ctx, BASE, 0)
    _decode(ctx, HELD, 1)
    return ctx


def _next_logits(ctx, seq_id) -> np.ndarray:
    _decode(ctx, [3], seq_id, logits="last")
    return ctx.get_logits_ith(-1).copy()


def _assert_untouched(victim, witness) -> None:
    """Bit for bit as the witness: KV buffers, cells, heads, outputs, state; then the same next logits."""
    assert snapshot(victim) == snapshot(witness)
    for seq_id in (0, 1):
        np.testing.assert_array_equal(_next_logits(victim, seq_id), _next_logits(witness, seq_id))


def _good(kind: str, src, tmp_path: Path) -> bytes:
    if kind == "state":
        return src.state_get_data()
    if kind == "seq":
        return src.state_seq_get_data(0)
    path = tmp_path / "good.bin"
    if kind == "session file":
        src.state_save_file(path, SOURCE)
    else:
        src.state_seq_save_file(path, 0, SOURCE)
    return path.read_bytes()


def _load(engine, kind: str, data: bytes, tmp_path: Path, dest: int = 1):
    """Load `data` of `kind` into a llamir context or a LlamaCppOracle (which answers 0 or None when
    it refuses)."""
    path = tmp_path / "case.bin"
    if kind == "state":
        return engine.state_set_data(data)
    if kind == "seq":
        return engine.state_seq_set_data(data, dest)
    path.write_bytes(data)
    if kind == "session file":
        return engine.state_load_file(path, 64)
    return engine.state_seq_load_file(path, dest, 64)


def _patched(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into("<" + fmt, out, offset, value)
    return bytes(out)


def _n_caches(path) -> int:
    return 2 if "gemma3" in str(path) else 1


def _first(kind: str, data: bytes, path, name: str, cache: int = 0):
    return next(f for f in fields_of(kind, data, _n_caches(path)) if f.name == name and f.cache == cache)


# -- finding 1: a negative cell position -----------------------------------------------------------
@pytest.mark.parametrize("model,cache", [("llama", 0), ("gemma3", 0), ("gemma3", 1)],
                         ids=["llama", "gemma3-base", "gemma3-swa"])
@pytest.mark.parametrize("kind", KINDS)
def test_negative_position_is_refused_and_changes_nothing(models, tmp_path, kind, model, cache):
    path = models[model]
    good = _good(kind, _source(path), tmp_path)
    field = _first(kind, good, path, "pos", cache)
    data = _patched(good, field.offset, "i", -5)
    victim, witness = _victim(path), _victim(path)
    with pytest.raises(StateError, match=r"position -5 is out of range \[0, 2147483647\)"):
        _load(victim, kind, data, tmp_path)
    _assert_untouched(victim, witness)
    # llama.cpp takes the position as it is, and the sequence then starts at -5 (seq_pos_min of an
    # iSWA memory reads the SWA cache)
    with _oracle(path) as o:
        assert _load(o, kind, data, tmp_path) not in (0, None)
        if cache == _n_caches(path) - 1:
            assert -5 in [o.seq_pos_min(s) for s in (0, 1)]


_OPTIMIZED = """
import json, struct, sys
import llamir
from llamir.context.state import StateError
from llamir.testing.state_fuzz import fields_of
if sys.flags.optimize != 1:      # no asserts in here: -O would strip them
    raise SystemExit("not running under -O")
path, tmp = sys.argv[1], sys.argv[2]
def ctx(tokens):
    c = llamir.Context(llamir.load_model(path), backend="numpy", n_ctx=512, n_seq_max=2, flash_attn="off")
    for seq_id, t in enumerate(tokens):
        if c.decode(llamir.Batch.from_tokens(t, seq_id=seq_id, logits="all")) != 0:
            raise SystemExit(c.last_error)
    return c
src = ctx([list(range(5, 26)), [60, 61]])
goods = {"state": src.state_get_data(), "seq": src.state_seq_get_data(0)}
src.state_save_file(tmp + "/s.bin", [1, 2]); src.state_seq_save_file(tmp + "/q.bin", 0, [1, 2])
goods["session file"] = open(tmp + "/s.bin", "rb").read(); goods["seq file"] = open(tmp + "/q.bin", "rb").read()
out = {}
for kind, good in goods.items():
    f = next(f for f in fields_of(kind, good, 1) if f.name == "pos")
    data = bytearray(good); struct.pack_into("<i", data, f.offset, -5); data = bytes(data)
    victim = ctx([list(range(100, 107)), [40, 41, 42, 43]])
    before = victim.state_get_data()
    try:
        if kind == "state": victim.state_set_data(data)
        elif kind == "seq": victim.state_seq_set_data(data, 1)
        else:
            open(tmp + "/bad.bin", "wb").write(data)
            (victim.state_load_file(tmp + "/bad.bin", 64) if kind == "session file"
             else victim.state_seq_load_file(tmp + "/bad.bin", 1, 64))
        error = None
    except StateError as err:
        error = str(err)
    out[kind] = {"error": error, "unchanged": victim.state_get_data() == before,
                 "pos_min": [victim.memory.seq_pos_min(s) for s in (0, 1)]}
print(json.dumps(out))
"""


def test_negative_position_is_refused_under_python_O(models, tmp_path):
    """`python -O` strips asserts; the checks are not asserts, so nothing changes."""
    env = {**os.environ, "PYTHONPATH": LLAMIR_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, "-O", "-c", _OPTIMIZED, str(models["llama"]), str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(out) == set(KINDS)
    for kind, result in out.items():
        assert result["error"] and "position -5 is out of range" in result["error"], (kind, result)
        assert result["unchanged"] and result["pos_min"] == [0, 0], (kind, result)


# -- finding 2: no output rows ---------------------------------------------------------------------
def _situation(path, situation: str):
    """A context (and, where llama.cpp can be put in the same situation, the oracle's answer to
    the same calls) without output rows."""
    ctx = _ctx(path)
    if situation == "logits none":
        assert ctx.decode(llamir.Batch.from_tokens(BASE, logits="none")) == 0
    elif situation == "aborted decode":
        _decode(ctx, HELD, 1, logits="none")
        ctx.abort_callback = lambda: True
        assert ctx.decode(llamir.Batch.from_tokens(BASE, logits="all")) == 2
        ctx.abort_callback = None
    elif situation == "failed decode":
        _decode(ctx, HELD, 1, logits="none")
        assert ctx.decode(llamir.Batch.from_tokens(BASE, pos0=9, seq_id=1, logits="all")) == -1  # a gap
    return ctx


def _oracle_situation(o: LlamaCppOracle, situation: str) -> None:
    if situation == "logits none":
        assert o.decode(BASE, logits=[False] * len(BASE)) == 0
    elif situation in ("aborted decode", "failed decode"):
        # llama.cpp's answer to an abort before any ubatch ran, or to the invalid batch: HELD alone
        assert o.decode(HELD, seq_id=1, logits=[False] * len(HELD)) == 0
        if situation == "failed decode":
            assert o.decode(BASE, pos0=9, seq_id=1) == -1


@pytest.mark.parametrize("situation", ["fresh", "logits none", "aborted decode", "failed decode"])
def test_state_saves_without_outputs(models, tmp_path, situation):
    path = models["llama"]
    ctx = _situation(path, situation)
    assert ctx.outputs.n_outputs == 0
    blob, seq_blob = ctx.state_get_data(), ctx.state_seq_get_data(1)
    session, seq_file, empty = tmp_path / "s.bin", tmp_path / "q.bin", tmp_path / "e.bin"
    assert ctx.state_save_file(session, BASE) == session.stat().st_size
    assert ctx.state_seq_save_file(seq_file, 1, HELD) == seq_file.stat().st_size
    assert ctx.state_save_file(empty, []) == empty.stat().st_size    # no tokens either
    exact = ctx.backend.interp.numerics == oracle_numerics()
    with _oracle(path) as o:
        _oracle_situation(o, situation)
        if exact:
            assert blob == o.state_get_data()
            assert seq_blob == o.state_seq_get_data(1)
        else:
            assert len(blob) == len(o.state_get_data())
        # what llamir saved, llama.cpp loads
        assert o.state_load_file(session, 64) == BASE
        assert o.state_seq_load_file(seq_file, 0, 64) == HELD
        assert o.state_load_file(empty, 64) == []
    again = _ctx(path)
    assert again.state_load_file(session, 64) == BASE
    assert again.state_get_data() == blob


# -- finding 7: dest_seq_id --------------------------------------------------------------------------
UNIFIED = {"unified": {"kv_unified": True}, "streams": {}}


@pytest.mark.parametrize("layout", list(UNIFIED))
@pytest.mark.parametrize("kind", ["seq", "seq file"])
def test_dest_seq_id_minus_one_is_refused(models, tmp_path, layout, kind):
    """llama.cpp reads dest_seq_id -1 as a whole restore: every sequence is replaced by the blob's."""
    path, kw = models["llama"], UNIFIED[layout]
    good = _good(kind, _source(path, **kw), tmp_path)
    victim, witness = _victim(path, **kw), _victim(path, **kw)
    with pytest.raises(StateError, match="dest_seq_id -1: a sequence state is of one sequence"):
        _load(victim, kind, good, tmp_path, dest=-1)
    _assert_untouched(victim, witness)
    with _oracle(path, **kw) as o:
        assert o.decode(HELD, seq_id=1) == 0
        assert _load(o, kind, good, tmp_path, dest=-1) not in (0, None)
        assert (o.seq_pos_max(0), o.seq_pos_max(1)) == (len(SOURCE) - 1, -1)   # sequence 1 is gone


@pytest.mark.parametrize("dest", [2, 255])
def test_dest_seq_id_beyond_n_seq_max_is_refused(models, tmp_path, dest):
    """A unified llama.cpp cache takes ids up to 255 and restores a sequence no batch may name."""
    path, kw = models["llama"], UNIFIED["unified"]
    good = _good("seq", _source(path, **kw), tmp_path)
    victim, witness = _victim(path, **kw), _victim(path, **kw)
    for kind, data in [("seq", good), ("seq file", _good("seq file", _source(path, **kw), tmp_path))]:
        with pytest.raises(StateError, match=rf"dest_seq_id {dest} is out of range \[0, 2\)"):
            _load(victim, kind, data, tmp_path, dest=dest)
    _assert_untouched(victim, witness)
    with _oracle(path, **kw) as o:
        assert o.state_seq_set_data(good, dest) == len(good)
        assert o.decode([3], pos0=len(SOURCE), seq_id=dest) == -1     # the sequence cannot be used


_ABORTS = """
import sys
from llamir.testing.llama_cpp import LlamaCppOracle
path, unified, dest = sys.argv[1], sys.argv[2] == "unified", int(sys.argv[3])
with LlamaCppOracle(path, n_ctx=512, n_seq_max=2, kv_unified=unified) as o:
    assert o.decode(list(range(5, 26)), seq_id=0) == 0
    blob = o.state_seq_get_data(0)
    print("returned", o.state_seq_set_data(blob, dest), flush=True)
"""


@pytest.mark.parametrize("layout,dest", [("unified", 256), ("unified", -2), ("streams", 2), ("streams", -2)])
def test_dest_seq_id_that_aborts_llama_cpp_is_refused(models, tmp_path, layout, dest):
    path, kw = models["llama"], UNIFIED[layout]
    good = _good("seq", _source(path, **kw), tmp_path)
    victim, witness = _victim(path, **kw), _victim(path, **kw)
    with pytest.raises(StateError, match=rf"dest_seq_id {dest} is out of range"):
        victim.state_seq_set_data(good, dest)
    with pytest.raises(StateError, match=rf"dest_seq_id {dest} is out of range"):
        _load(victim, "seq file", _good("seq file", _source(path, **kw), tmp_path), tmp_path, dest=dest)
    with pytest.raises(StateError, match=rf"seq_id {dest} is out of range"):
        victim.state_seq_get_data(dest)
    _assert_untouched(victim, witness)
    env = {**os.environ, "GGML_NO_BACKTRACE": "1",
           "PYTHONPATH": LLAMIR_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, "-c", _ABORTS, str(path), layout, str(dest)], capture_output=True,
                         text=True, env=env, timeout=120)
    assert run.returncode != 0 and "returned" not in run.stdout
    assert "GGML_ASSERT(seq_id == -1 || (seq_id >= 0" in run.stderr


@pytest.mark.parametrize("call", ["blob", "file", "get", "flags"])
def test_bad_arguments_are_state_errors(models, tmp_path, call):
    path = models["llama"]
    victim, witness = _victim(path), _victim(path)
    good = victim.state_seq_get_data(0)
    bad = {
        "blob": [lambda: victim.state_set_data("not bytes"), lambda: victim.state_set_data(5),
                 lambda: victim.state_seq_set_data(good, 1.0), lambda: victim.state_seq_set_data(None, 1)],
        "file": [lambda: victim.state_save_file(None, [1]), lambda: victim.state_save_file(tmp_path / "a", [1.5]),
                 lambda: victim.state_save_file(tmp_path / "b", [2**31]),
                 lambda: victim.state_save_file(tmp_path / "c", [[1, 2], [3, 4]]),
                 lambda: victim.state_load_file(tmp_path / "missing.bin", 64),
                 lambda: victim.state_load_file(tmp_path, 64),
                 lambda: victim.state_load_file(tmp_path / "a", "64"),
                 lambda: victim.state_load_file(tmp_path / "a", -1),
                 lambda: victim.state_load_file("nul\0byte", 64), lambda: victim.state_save_file("nul\0byte", [1])],
        "get": [lambda: victim.state_seq_get_data(-1), lambda: victim.state_seq_get_data("0"),
                lambda: victim.state_seq_save_file(tmp_path / "d", 2, [1])],
        "flags": [lambda: victim.state_seq_get_data(0, flags=-1), lambda: victim.state_seq_set_data(good, 1, "1")],
    }[call]
    for attempt in bad:
        with pytest.raises(StateError):
            attempt()
    _assert_untouched(victim, witness)


# -- stricter than llama.cpp ------------------------------------------------------------------------
def _two_stream_seq_blob(src) -> bytes:
    """Sequence 0's blob with sequence 1's cells (retagged as 0) in the second stream."""
    s0, s1 = src.state_seq_get_data(0), src.state_seq_get_data(1)
    # both: prefix (8), n_stream (4); s0 = [count0, cells+rows] [0]; s1 = [0] [count1, cells+rows]
    part1 = bytearray(s1[16:])
    for i in range(len(OTHER)):
        struct.pack_into("<i", part1, 4 + 12 * i + 8, 0)
    return s0[:-4] + bytes(part1)


def _with_repeated_id(blob: bytes, offset: int) -> bytes:
    """The cell at `offset` lists its sequence twice (n_seq_id 2, the id repeated)."""
    n_ids, sid = struct.unpack_from("<Ii", blob, offset + 4)
    assert n_ids == 1
    return blob[:offset + 4] + struct.pack("<Iii", 2, sid, sid) + blob[offset + 12:]


STRICTER = {  # name: (layout, kind, make the data from the source, llamir's message)
    "repeated seq id": ("unified", "state", lambda src, path: _with_repeated_id(
        src.state_get_data(), _first("state", src.state_get_data(), path, "pos").offset), "lists a sequence twice"),
    "sequence in another's stream": ("streams", "state", lambda src, path: _patched(
        src.state_get_data(), _first("state", src.state_get_data(), path, "seq_id").offset, "i", 1),
        "holds sequence 1, but stream 0 of a non-unified cache holds only sequence 0"),
    "sequence over two streams": ("streams", "seq", lambda src, path: _two_stream_seq_blob(src),
                                  r"cells in streams \[0, 1\]"),
    "cell of another sequence": ("unified", "seq", lambda src, path: _patched(src.state_seq_get_data(0), 4, "i", 1),
                                 "holds sequence 0, but this is the state of sequence 1"),
    "int32 max position": ("unified", "state", lambda src, path: _patched(
        src.state_get_data(), _first("state", src.state_get_data(), path, "pos").offset, "i", 2**31 - 1),
        r"position 2147483647 is out of range"),
}


@pytest.mark.parametrize("case", list(STRICTER))
def test_what_llama_cpp_accepts_and_misplaces_is_refused(models, tmp_path, case):
    layout, kind, make, message = STRICTER[case]
    path, kw = models["llama"], UNIFIED[layout]
    data = make(_source(path, **kw), path)
    victim, witness = _victim(path, **kw), _victim(path, **kw)
    with pytest.raises(StateError, match=message):
        _load(victim, kind, data, tmp_path, dest=1)
    _assert_untouched(victim, witness)
    with _oracle(path, **kw) as o:
        assert _load(o, kind, data, tmp_path, dest=1) == len(data)   # llama.cpp takes every one of them
        if case == "sequence over two streams":     # each stream's cells replace the last's
            assert o.seq_pos_max(1) == len(OTHER) - 1
        if case == "sequence in another's stream":  # a cell that sequence 1's operations never see
            assert o.seq_pos_max(1) == len(OTHER) - 1 and o.seq_pos_min(1) == 0


def test_sequence_without_room_in_the_swa_cache_changes_neither_cache(models, tmp_path):
    """The sequence fits the base cache (1024 cells) but not the SWA one (256, nearly all held by
    cells two sequences share, which find_slot may not reuse): both caches stay as they were, as
    in a witness. (llama.cpp restores the base cache before it finds no room in the SWA one; the
    oracle harness makes no small SWA cache, so the witness is the oracle here.)"""
    path = models["gemma3"]
    kw = {"n_ctx": 1024, "n_seq_max": 3, "kv_unified": True, "n_ubatch": 64, "swa_full": False}
    src = _ctx(path, **kw)
    _decode(src, SOURCE, 0)
    blob = src.state_seq_get_data(0)

    def victim():
        ctx = _ctx(path, **kw)
        assert ctx.memory.swa.kv_size == 256 and ctx.memory.base.kv_size == 1024
        _decode(ctx, list(range(3, 253)), (1, 2), logits="last")
        _decode(ctx, BASE[:5], 0)
        return ctx

    ours, witness = victim(), victim()
    with pytest.raises(StateError, match="failed to find .* available cells"):
        ours.state_seq_set_data(blob, 0)
    assert snapshot(ours) == snapshot(witness)
    np.testing.assert_array_equal(_next_logits(ours, 0), _next_logits(witness, 0))   # takes the last free cell


def test_sequence_state_without_cells_empties_the_destination(models):
    """A choice, not llama.cpp's behaviour: llama.cpp skips a stream with no cells before its
    seq_rm, so loading an empty sequence leaves what dest_seq_id held; llamir empties it, as a
    restore of that (empty) sequence should."""
    path = models["llama"]
    empty = _ctx(path).state_seq_get_data(0)
    assert empty == struct.pack("<IiIII", 0xAF143CD8, 0, 2, 0, 0)
    ours = _victim(path)
    assert ours.state_seq_set_data(empty, 1) == len(empty)
    assert (ours.memory.seq_pos_max(0), ours.memory.seq_pos_max(1)) == (len(BASE) - 1, -1)
    with _oracle(path) as o:
        assert o.decode(BASE, seq_id=0) == 0 and o.decode(HELD, seq_id=1) == 0
        assert o.state_seq_set_data(empty, 1) == len(empty)
        assert o.seq_pos_max(1) == len(HELD) - 1
        o.seq_rm(1)                      # then the two engines hold the same
        if ours.backend.interp.numerics == oracle_numerics():
            assert ours.state_get_data() == o.state_get_data()


def test_memory_state_read_and_write(models):
    """The Memory interface's state_write/state_read (the memory part alone, no arch)."""
    from llamir.context.state_io import Reader, Writer

    path = models["gemma3"]
    src, dst = _source(path), _victim(path)
    w = Writer()
    src.memory.state_write(w, 0)
    part = w.getvalue()
    assert part == src.state_seq_get_data(0)[8:]
    for bad in (-2, 2, 256, "0"):
        with pytest.raises(StateError, match="is neither -1"):
            dst.memory.state_read(Reader(part), bad)
    with pytest.raises(StateError, match="truncated state"):
        dst.memory.state_read(Reader(part[:-1]), 1)
    assert dst.state_get_data() == _victim(path).state_get_data()
    dst.memory.state_read(Reader(part), 1)
    assert (dst.memory.seq_pos_max(0), dst.memory.seq_pos_max(1)) == (len(BASE) - 1, len(SOURCE) - 1)
