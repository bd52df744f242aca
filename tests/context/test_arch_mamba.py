"""mamba (Mamba-1) over the recurrent memory, against llama.cpp on random-weight GGUFs: a prompt
in one batch, one token at a time, in ubatches, two interleaved sequences; the recurrent memory's
sequence operations, state save/load and rollback."""

from __future__ import annotations

import numpy as np
import pytest

import llamir
from llamir.context.memory_recurrent import RecurrentMemory
from llamir.context.state_io import StateError
from llamir.frontend.synth import SynthSpec, write_model
from llamir.testing.conformance import PROMPT, llama_cpp_logits, llamir_logits
from llamir.testing.llama_cpp import LlamaCppOracle, oracle_numerics

SPECS = {
    "f32": SynthSpec(arch="mamba", n_layer=2, n_embd=64, seed=3),
    "q8_0": SynthSpec(arch="mamba", n_layer=2, n_embd=64, dtype="q8_0", seed=4),
}
TOKENS_A = [int(t) for t in PROMPT[:12]]
TOKENS_B = [int(t) for t in PROMPT[12:21]]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("mamba")
    return {name: write_model(root / f"{name}.gguf", spec) for name, spec in SPECS.items()}


@pytest.fixture(scope="module")
def models(paths):
    return {name: llamir.load_model(p) for name, p in paths.items()}


def _context(model, backend="numpy", **params):
    params.setdefault("n_ctx", 256)
    return llamir.Context(model, backend=backend, numerics=oracle_numerics(), **params)


@pytest.mark.llama_cpp
@pytest.mark.parametrize("backend", ["numpy", "llvm"])
@pytest.mark.parametrize("mode", ["batch", "incremental", "ubatch"])
@pytest.mark.parametrize("name", list(SPECS))
def test_logits_match_llama_cpp(paths, models, nmse, name, mode, backend):
    got = llamir_logits(models[name], mode, backend)
    want = llama_cpp_logits(paths[name], mode)
    assert np.isfinite(want).all() and want.std() > 0.5
    assert nmse(got, want) == 0.0


def _interleaved(decode, logits_ith):
    """Two sequences fed in alternating batches of 3 tokens (both in each batch) and alone; the
    logits of every output."""
    out = []
    for start in range(0, 9, 3):
        tokens = TOKENS_A[start:start + 3] + TOKENS_B[start:start + 3]
        pos = list(range(start, start + 3)) * 2
        seqs = [(0,)] * 3 + [(1,)] * 3
        assert decode(tokens, pos, seqs, [True] * 6) == 0
        out += [logits_ith(i) for i in range(6)]
    assert decode(TOKENS_A[9:12], [9, 10, 11], [(0,)] * 3, [True] * 3) == 0
    out += [logits_ith(i) for i in range(3)]
    return np.stack(out)


@pytest.mark.llama_cpp
@pytest.mark.parametrize("backend", ["numpy", "llvm"])
def test_two_interleaved_sequences_match_llama_cpp(paths, models, nmse, backend):
    ctx = _context(models["f32"], backend, n_seq_max=2, n_batch=64, n_ubatch=64)

    def ours(tokens, pos, seqs, logits):
        return ctx.decode(llamir.Batch(tokens=tokens, pos=pos, seq_ids=seqs, logits=logits))

    got = _interleaved(ours, lambda i: ctx.get_logits_ith(i).copy())
    with LlamaCppOracle(paths["f32"], n_ctx=256, n_batch=64, n_seq_max=2) as o:
        want = _interleaved(o.decode_batch, o.logits_ith)
    assert nmse(got, want) == 0.0


def test_memory_is_recurrent_with_a_cell_per_sequence(models):
    ctx = _context(models["f32"], n_seq_max=3)
    mem = ctx.memory
    assert isinstance(mem, RecurrentMemory) and mem.size == 3 and mem.get_can_shift()
    hp = models["f32"].hparams.extra
    assert mem.layout.n_embd_r == (hp.d_conv - 1) * hp.d_inner and mem.layout.n_embd_s == hp.d_state * hp.d_inner
    assert mem.total_bytes() == 2 * 3 * 4 * (mem.layout.n_embd_r + mem.layout.n_embd_s)


def _feed(ctx, tokens, pos0=0, seq=0):
    assert ctx.decode(llamir.Batch.from_tokens(tokens, pos0=pos0, seq_id=seq, logits="last")) == 0, ctx.last_error
    return ctx.get_logits_ith(-1).copy()


@pytest.mark.llama_cpp
def test_seq_rm_of_a_middle_range_fails_and_changes_nothing(paths, models):
    """A state cannot lose its last positions: a range from the middle through the last position
    fails and changes nothing; one past the end or the whole sequence succeeds (as llama.cpp)."""
    ctx = _context(models["f32"])
    _feed(ctx, TOKENS_A[:8])                          # the state is at position 7
    before = ctx.state_get_data()
    calls = [(0, 4, 8), (0, 4, -1), (-1, 3, 5), (0, 2, 5), (0, 20, -1)]
    ours = [ctx.memory.seq_rm(*call) for call in calls]
    with LlamaCppOracle(paths["f32"], n_ctx=256) as o:
        assert o.decode(TOKENS_A[:8]) == 0
        theirs = [o.seq_rm(*call) for call in calls]
        assert o.state_get_data() == ctx.state_get_data() == before
        assert o.seq_rm(0, 0, -1) is True and o.seq_pos_max(0) == -1
    assert ours == theirs and ours[:3] == [False, False, False]
    assert ctx.memory.seq_pos_max(0) == 7
    assert ctx.memory.seq_rm(0, 0, -1) is True and ctx.memory.seq_pos_max(0) == -1


@pytest.mark.llama_cpp
def test_state_saves_and_loads_exactly_and_matches_llama_cpps_layout(paths, models, nmse):
    ctx = _context(models["f32"])
    _feed(ctx, TOKENS_A[:8])
    data, seq_data = ctx.state_get_data(), ctx.state_seq_get_data(0)
    next_logits = _feed(ctx, TOKENS_A[8:10], pos0=8)
    ctx.memory.clear()
    assert ctx.state_set_data(data) == len(data)
    assert ctx.state_get_data() == data
    assert np.array_equal(_feed(ctx, TOKENS_A[8:10], pos0=8), next_logits)
    ctx.memory.clear()
    ctx.state_seq_set_data(seq_data, 0)
    assert np.array_equal(_feed(ctx, TOKENS_A[8:10], pos0=8), next_logits)
    with LlamaCppOracle(paths["f32"], n_ctx=256) as o:
        assert o.decode(TOKENS_A[:8]) == 0
        assert o.state_get_data() == data                # the same layout and bytes
        assert o.state_seq_get_data(0) == seq_data
        o.clear()
        assert o.state_set_data(data) == len(data)     # and llama.cpp restores llamir's state
        assert o.decode(TOKENS_A[8:10], pos0=8) == 0
        assert np.array_equal(o.logits_ith(-1), next_logits)


def test_sequence_state_copies_into_another_sequence(models):
    ctx = _context(models["f32"], n_seq_max=2)
    _feed(ctx, TOKENS_A[:6])
    blob = ctx.state_seq_get_data(0)
    ctx.state_seq_set_data(blob, 1)
    a = _feed(ctx, TOKENS_A[6:8], pos0=6, seq=0)
    b = _feed(ctx, TOKENS_A[6:8], pos0=6, seq=1)
    assert np.array_equal(a, b)
    ctx.memory.seq_cp(0, 1)      # dst shares src's cell, then owns a copy once it decodes
    c = _feed(ctx, TOKENS_A[8:9], pos0=8, seq=1)
    d = _feed(ctx, TOKENS_A[8:9], pos0=8, seq=0)
    assert np.array_equal(c, d)


def test_a_corrupted_state_changes_nothing(models):
    ctx = _context(models["f32"])
    _feed(ctx, TOKENS_A[:5])
    good = ctx.state_get_data()
    for bad in (good[:-3], good[:20], good[:-1] + b"\x00\x00", good.replace(b"mamba", b"mambo")):
        with pytest.raises(StateError):
            ctx.state_set_data(bad)
        assert ctx.state_get_data() == good


def test_a_failed_decode_rolls_the_state_back(models):
    ctx = _context(models["f32"])
    _feed(ctx, TOKENS_A[:5])
    before = ctx.state_get_data()
    ctx.abort_callback = lambda: True
    assert ctx.decode(llamir.Batch.from_tokens(TOKENS_A[5:8], pos0=5)) == 2
    ctx.abort_callback = None
    assert ctx.state_get_data() == before
    bad = llamir.Batch.from_tokens([models["f32"].hparams.n_vocab + 5], pos0=5)
    assert ctx.decode(bad) == -1 and "token" in ctx.last_error
    assert ctx.state_get_data() == before


def test_a_sequence_id_past_the_cells_is_refused(models):
    ctx = _context(models["f32"], n_seq_max=2)
    status = ctx.decode(llamir.Batch.from_tokens(TOKENS_A[:3], seq_id=2))
    assert status == -1 and "seq_id" in ctx.last_error
