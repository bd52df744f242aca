"""The shortcuts of the per-token path keep the behaviour of the general one.

Oracles: a brute-force recomputation from the cells' arrays (seq_pos_max kept across mutations),
the general per-token path of BatchAllocator (batches whose tokens share one sequence-set tuple take
a shortcut; the same batch with equal but distinct tuples takes the general loops), and a fresh
context fed the same tokens in one batch (itself checked against llama.cpp elsewhere).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

import llamir
from llamir.backends import BackendError
from llamir.context.batch import Batch, BatchAllocator, BatchError, check_fields
from llamir.context.kv_cells import KVCells
from llamir.frontend.synth import SynthSpec, write_model

N_SEQ = 4


def _brute_pos_max(cells: KVCells, s: int) -> int:
    held = cells.pos[(cells.pos >= 0) & cells.seq[:, s]]
    return int(held.max()) if len(held) else -1


def _mutate(cells: KVCells, rng: random.Random) -> None:
    i = rng.randrange(cells.size)
    s = rng.randrange(N_SEQ)
    op = rng.choice(["set", "set", "add", "rm", "seq_rm", "keep", "shift", "div", "occupy", "restore", "direct"])
    if op == "set" and cells.is_empty(i):
        cells.pos_set(i, rng.randrange(50))
        cells.seq_add(i, s)
    elif op == "add" and not cells.is_empty(i):
        cells.seq_add(i, s)
    elif op == "rm":
        cells.rm(i)
    elif op == "seq_rm" and not cells.is_empty(i) and cells.seq_has(i, s):
        cells.seq_rm(i, s)
    elif op == "keep":
        cells.seq_keep(i, s)
    elif op == "shift" and not cells.is_empty(i):
        cells.pos_add(i, rng.randrange(-5, 6))
    elif op == "div" and not cells.is_empty(i):
        cells.pos_div(i, rng.randrange(1, 4))
    elif op == "occupy":
        free = np.flatnonzero(cells.pos < 0)[:rng.randrange(1, 12)]
        ids = [(s,)] * len(free) if rng.random() < 0.5 else [(rng.randrange(N_SEQ), s) for _ in free]
        cells.occupy(free, np.array([rng.randrange(60) for _ in free], dtype=np.int32), ids)
    elif op == "restore":
        snap = cells.snapshot()
        cells.reset()
        cells.restore(snap)
    elif op == "direct":   # what KVCache.undo does: write the arrays, then recount
        cells.pos[i], cells.seq[i] = -1, False
        cells.recount()


@pytest.mark.parametrize("seed", range(8))
def test_seq_pos_max_follows_every_mutation(seed):
    rng = random.Random(seed)
    cells = KVCells(64, N_SEQ)
    for _ in range(400):
        _mutate(cells, rng)
        for s in range(N_SEQ):
            assert cells.seq_pos_max(s) == _brute_pos_max(cells, s)
        assert cells.get_used() == int((cells.pos >= 0).sum())


def test_occupy_sets_what_pos_set_and_seq_add_set():
    a, b = KVCells(16, N_SEQ), KVCells(16, N_SEQ)
    idxs, pos, ids = np.array([3, 4, 9]), np.array([7, 8, 2], dtype=np.int32), [(0,), (1, 2), (3,)]
    a.occupy(idxs, pos, ids)
    for i, p, sids in zip(idxs, pos, ids):
        b.pos_set(int(i), int(p))
        for s in sids:
            b.seq_add(int(i), s)
    np.testing.assert_array_equal(a.pos, b.pos)
    np.testing.assert_array_equal(a.seq, b.seq)
    assert (a.get_used(), a.used_max_p1()) == (b.get_used(), b.used_max_p1()) == (3, 10)
    with pytest.raises(ValueError):
        a.occupy(np.array([4]), np.array([1], dtype=np.int32), [(0,)])


class _Memory:
    """seq_pos_min/max of a memory holding positions 0..held[s] of each sequence."""

    def __init__(self, held: dict[int, int]):
        self.held = held

    def seq_pos_max(self, s: int) -> int:
        return self.held.get(s, -1)

    def seq_pos_min(self, s: int) -> int:
        return 0 if s in self.held else -1


def _outcome(tokens, pos, ids, memory):
    """What BatchAllocator.init made of a batch: its error, or its state."""
    balloc = BatchAllocator()
    batch = Batch(tokens=tokens, pos=pos, seq_ids=ids)
    try:
        balloc.init(batch, 100, memory, 8, 8, False)
    except BatchError as err:
        return "error", str(err)
    return ("ok", balloc.pos.tolist(), balloc.seq_ids, balloc.seq_id_unq, sorted(balloc.seq_pos.items()),
            sorted(balloc.seq_cpl), balloc.seq_sets, sorted(balloc.seq_set_map.items(), key=str),
            balloc.output.tolist(), balloc.n_outputs)


CASES = [
    ([1, 2, 3], [0, 1, 2], (0,), {}),
    ([1, 2, 3], None, (2,), {2: 4}),
    ([1, 2, 3], [5, 6, 7], (0,), {0: 4}),
    ([1, 2, 3], [6, 7, 8], (0,), {0: 4}),          # does not continue the memory
    ([1, 2, 3], [0, 2, 3], (1,), {}),              # a gap
    ([1, 2, 3], [0, 1, 0], (1,), {}),              # decreasing
    ([1, 2, 3], [0, 1, 1], (1,), {}),
    ([1, 2, 3], [0, 1, 2], (1, 0), {}),            # coupled
    ([1, 2, 3], [3, 4, 5], (1, 0), {0: 2, 1: 2}),
    ([1, 2, 3], [3, 4, 5], (1, 0), {0: 2, 1: 1}),  # coupled but diverged
    ([1, 2, 3], [0, 1, 2], (0, 0, 3), {}),         # a repeated id
    ([1, 2, 3], [0, 1, 2], (9,), {}),              # out of range
    ([1, 200, 3], [0, 1, 2], (0,), {}),            # token out of range
    ([7], [4], (0,), {0: 3}),
    ([7], [9], (0,), {0: 3}),
    ([7], None, (3,), {}),
]


@pytest.mark.parametrize("tokens,pos,ids,held", CASES)
def test_one_sequence_set_shortcut_matches_the_general_path(tokens, pos, ids, held):
    memory = _Memory(held)
    shared = [ids] * len(tokens)                     # one tuple object: the shortcut
    distinct = [tuple(list(ids)) for _ in tokens]    # equal tuples, distinct objects: the general loops
    assert len({id(t) for t in distinct}) == len(tokens)
    assert _outcome(tokens, pos, shared, memory) == _outcome(tokens, pos, distinct, memory)


def test_from_tokens_fields_are_those_the_checks_give():
    batch = Batch.from_tokens([5, 6, 7], pos0=3, seq_id=[1, 2], logits="all")
    fields = check_fields([5, 6, 7], None, np.array([3, 4, 5]), [(1, 2)] * 3, [True] * 3)
    assert batch.tokens.dtype == fields.tokens.dtype == np.int64
    np.testing.assert_array_equal(batch.tokens, fields.tokens)
    np.testing.assert_array_equal(batch.pos, fields.pos)
    assert batch.seq_ids == fields.seq_ids
    np.testing.assert_array_equal(batch.logits, fields.logits)
    with pytest.raises(BatchError, match="2 logits flags for 3 tokens"):
        Batch.from_tokens([5, 6, 7], logits=[True, False])


@pytest.mark.parametrize("token, pos0, seq_id", [(5, 3, 0), (0, None, 2), (2**31 - 1, 0, 7), (9, -4, 1)])
def test_one_token_from_tokens_equals_the_checked_fields(token, pos0, seq_id):
    """from_tokens' one-token shortcut gives what the general construction (Batch(...)) gives."""
    batch = Batch.from_tokens([token], pos0=pos0, seq_id=seq_id)
    general = Batch(tokens=[token], pos=None if pos0 is None else [pos0], seq_ids=[seq_id], logits=[True])
    for name in ("tokens", "pos", "logits"):
        a, b = getattr(batch, name), getattr(general, name)
        assert (a is None and b is None) or (a.dtype == b.dtype and a.tolist() == b.tolist()), name
    assert batch.seq_ids == general.seq_ids and batch.embd is None


@pytest.mark.parametrize("kwargs, message", [({"tokens": [2**31]}, "out of range"),
                                             ({"tokens": [True]}, "is not an integer"),
                                             ({"tokens": [1], "seq_id": 2**31}, "out of range"),
                                             ({"tokens": [1], "pos0": 2**31}, "out of the int32 range"),
                                             ({"tokens": [1], "pos0": 1.5}, "is not an integer")])
def test_one_token_from_tokens_still_refuses_bad_values(kwargs, message):
    with pytest.raises(BatchError, match=message):
        Batch.from_tokens(**kwargs)


@pytest.mark.parametrize("value,message", [([1, True], r"tokens\[1\] = True is not an integer"),
                                           ([1, 2**31], r"tokens\[1\] = 2147483648 is out of range"),
                                           (np.array([1, 2**40]), r"tokens\[1\] = 1099511627776 is out of range")])
def test_plain_int_lists_and_small_arrays_are_still_checked(value, message):
    with pytest.raises(BatchError, match=message):
        Batch(tokens=value)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("fastpath") / "m.gguf"
    return llamir.load_model(write_model(path, SynthSpec(arch="llama", n_layer=2, dtype="f32")))


def test_generated_tokens_equal_one_batch_and_bad_ones_change_nothing(model):
    tokens = [5, 17, 99, 3, 250, 42, 7, 311]
    ctx = llamir.Context(model, n_ctx=64, n_batch=16, n_ubatch=16, flash_attn="off")
    rows = []
    for pos, t in enumerate(tokens):
        assert ctx.decode(Batch.from_tokens([t], pos0=pos)) == 0, ctx.last_error
        rows.append(ctx.get_logits_ith(-1).copy())
        if pos == 3:   # a bad token, a gap, a wrong sequence, then a batch mutated after it was made
            assert ctx.decode(Batch.from_tokens([model.hparams.n_vocab], pos0=4)) == -1
            assert ctx.decode(Batch.from_tokens([1], pos0=6)) == -1
            assert ctx.decode(Batch.from_tokens([1], pos0=4, seq_id=99)) == -1
            bad = Batch.from_tokens([1], pos0=4)
            bad.pos = np.array([-3])
            assert ctx.decode(bad) == -1
            assert ctx.memory.seq_pos_max(0) == 3
            np.testing.assert_array_equal(ctx.get_logits_ith(-1), rows[-1])
    one = llamir.Context(model, n_ctx=64, n_batch=16, n_ubatch=16, flash_attn="off")
    assert one.decode(Batch.from_tokens(tokens, logits="all")) == 0
    np.testing.assert_allclose(np.stack(rows), one.get_logits(), rtol=0, atol=1e-4)


def test_executable_checks_dims_that_change_after_a_call(model):
    ctx = llamir.Context(model, n_ctx=64, n_batch=16, n_ubatch=16, flash_attn="off")
    assert ctx.decode(Batch.from_tokens([5], pos0=0)) == 0
    exe = ctx._prev.graph.executable
    last = dict(zip((name for name, _ in exe._dims), exe._dims_key))
    assert last["T"] == 1
    with pytest.raises(BackendError, match="T = -1 is negative"):
        exe(ctx._prev.values, {**last, "T": -1})
    with pytest.raises(BackendError, match="has no value"):
        exe(ctx._prev.values, {k: v for k, v in last.items() if k != "T"})
    assert ctx.decode(Batch.from_tokens([6], pos0=1)) == 0, ctx.last_error
