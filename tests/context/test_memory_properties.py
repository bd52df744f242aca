"""Property tests: random sequences of decodes and memory operations keep the KV cache consistent
with a plain reference model of sequences (a multiset of positions per sequence)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import llamir
from llamir.context.kv_cache import KVCache, SeqOpError
from llamir.frontend.synth import SynthSpec, write_model

N_SEQ = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return llamir.load_model(write_model(tmp_path_factory.mktemp("props") / "m.gguf",
                                         SynthSpec(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=32)))


class Reference:
    """What the memory should hold: a list of entries (one per stored token), each a position and
    the set of sequences that share it. No slots, heads or streams: only llama.cpp's semantics."""

    def __init__(self):
        self.entries: list[list] = []   # [pos, set(seq ids)]

    def positions(self, s) -> Counter:
        return Counter(pos for pos, seqs in self.entries if s in seqs)

    def pos_min(self, s):
        held = self.positions(s)
        return min(held) if held else -1

    def pos_max(self, s):
        held = self.positions(s)
        return max(held) if held else -1

    def add(self, s, positions):
        self.entries += [[p, {s}] for p in positions]

    @staticmethod
    def _range(p0, p1):
        return max(p0, 0), (1 << 31) if p1 < 0 else p1

    def rm(self, s, p0, p1):
        p0, p1 = self._range(p0, p1)
        for e in self.entries:
            if p0 <= e[0] < p1:
                e[1] = set() if s < 0 else e[1] - {s}
        self.entries = [e for e in self.entries if e[1]]

    def cp(self, src, dst):
        for e in self.entries:
            if src in e[1]:
                e[1].add(dst)

    def keep(self, s):
        self.entries = [[p, {s}] for p, seqs in self.entries if s in seqs]

    def shift(self, s, p0, p1, delta):
        p0, p1 = self._range(p0, p1)
        for e in self.entries:
            if s in e[1] and p0 <= e[0] < p1:
                e[0] += delta          # the cell moves, for every sequence sharing it
        self.entries = [e for e in self.entries if e[0] >= 0]

    def div(self, s, p0, p1, d):
        p0, p1 = self._range(p0, p1)
        for e in self.entries:
            if s in e[1] and p0 <= e[0] < p1:
                e[0] //= d


def check(cache: KVCache, ref: Reference):
    cells = cache.v_cells[0]
    used = cells.pos >= 0
    assert not np.any(used & ~cells.seq.any(axis=1)), "a used cell belongs to no sequence"
    assert not np.any(~used & cells.seq.any(axis=1)), "an empty cell still lists a sequence"
    assert int(used.sum()) == len(ref.entries), f"{int(used.sum())} cells used, {len(ref.entries)} expected"
    assert cells.get_used() == int(used.sum()), "the kept count of used cells drifted"
    assert cells.used_max_p1() == (int(np.flatnonzero(used)[-1]) + 1 if used.any() else 0)
    for s in range(N_SEQ):
        assert cache.seq_pos_min(s) == ref.pos_min(s) and cache.seq_pos_max(s) == ref.pos_max(s), s
        held = Counter(cells.pos[cells.seq[:, s]].tolist())
        want = ref.positions(s)
        assert held == want, f"sequence {s}: cache {sorted(held.elements())} != {sorted(want.elements())}"


seq_ids = st.integers(0, N_SEQ - 1)
positions = st.integers(-1, 40)
bad_seq_ids = st.one_of(st.integers(-2**40, -2), st.integers(256, 2**70), st.sampled_from(["0", 1.0, None, True]))
bad_ints = st.one_of(st.integers(2**31, 2**70), st.integers(-2**70, -2**31 - 1), st.sampled_from([0.5, "3", None]))
refused = st.one_of(    # each raises SeqOpError and changes nothing (llama.cpp asserts, crashes or overflows)
    st.tuples(st.just("seq_rm"), bad_seq_ids, positions, positions),
    st.tuples(st.just("seq_rm"), seq_ids, bad_ints, positions),
    st.tuples(st.just("seq_cp"), bad_seq_ids, seq_ids),
    st.tuples(st.just("seq_cp"), seq_ids, st.one_of(bad_seq_ids, st.just(-1))),
    st.tuples(st.just("seq_keep"), st.one_of(bad_seq_ids, st.just(-1))),
    st.tuples(st.just("seq_add"), st.one_of(bad_seq_ids, st.just(-1)), positions, positions, st.integers(-8, 8)),
    st.tuples(st.just("seq_add"), seq_ids, positions, positions, bad_ints),
    st.tuples(st.just("seq_add"), seq_ids, st.just(0), st.just(-1), st.just(2**31 - 1)),   # positions past int32
    st.tuples(st.just("seq_div"), seq_ids, positions, positions, st.integers(-3, 0)),
    st.tuples(st.just("seq_div"), st.one_of(bad_seq_ids, st.just(-1)), positions, positions, st.just(2)),
    st.tuples(st.just("seq_pos_min"), st.one_of(bad_seq_ids, st.just(-1))),
    st.tuples(st.just("seq_pos_max"), st.one_of(bad_seq_ids, st.just(-1))),
).map(lambda op: ("refused", *op))
ops = st.one_of(
    st.tuples(st.just("decode"), seq_ids, st.integers(1, 12)),
    st.tuples(st.just("decode2"), st.integers(1, 6)),
    st.tuples(st.just("seq_rm"), st.integers(-1, N_SEQ - 1), positions, positions),
    st.tuples(st.just("seq_cp"), seq_ids, seq_ids),
    st.tuples(st.just("seq_keep"), seq_ids),
    st.tuples(st.just("seq_add"), seq_ids, positions, positions, st.integers(-8, 8)),
    st.tuples(st.just("seq_div"), seq_ids, positions, positions, st.integers(1, 3)),
    refused,
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(ops, min_size=1, max_size=12))
def test_random_operations_keep_memory_consistent(model, program):
    ctx = llamir.Context(model, n_ctx=256, n_batch=64, n_ubatch=16, n_seq_max=N_SEQ, kv_unified=True,
                         flash_attn="off")
    ref = Reference()
    for op, *args in program:
        if op == "decode":
            s, n = args
            start = ref.pos_max(s) + 1
            status = ctx.decode(llamir.Batch(tokens=[7] * n, pos=list(range(start, start + n)), seq_ids=[(s,)] * n))
            if status == 0:
                ref.add(s, range(start, start + n))
            else:
                assert status == 1, ctx.last_error  # only a full cache may refuse
        elif op == "decode2":  # two sequences in one batch, interleaved
            (n,) = args
            tokens, pos, ids = [], [], []
            nxt = {s: ref.pos_max(s) + 1 for s in (0, 1)}
            for i in range(2 * n):
                s = i % 2
                tokens.append(9)
                pos.append(nxt[s])
                ids.append((s,))
                nxt[s] += 1
            status = ctx.decode(llamir.Batch(tokens=tokens, pos=pos, seq_ids=ids))
            if status == 0:
                for s in (0, 1):
                    ref.add(s, range(ref.pos_max(s) + 1, nxt[s]))
            else:
                assert status == 1, ctx.last_error  # only a full cache may refuse
        elif op == "seq_rm":
            s, p0, p1 = args
            assert ctx.memory.seq_rm(s, p0, p1) is True
            ref.rm(s, p0, p1)
        elif op == "seq_cp":
            src, dst = args
            ctx.memory.seq_cp(src, dst, -1, -1)
            if src != dst:
                ref.cp(src, dst)
        elif op == "seq_keep":
            ctx.memory.seq_keep(*args)
            ref.keep(*args)
        elif op == "seq_add":
            s, p0, p1, d = args
            ctx.memory.seq_add(s, p0, p1, d)
            if d and p0 != p1:
                ref.shift(s, p0, p1, d)
        elif op == "seq_div":
            s, p0, p1, d = args
            ctx.memory.seq_div(s, p0, p1, d)
            if d != 1 and p0 != p1:
                ref.div(s, p0, p1, d)
        elif op == "refused":
            name, *call = args
            if name == "seq_add" and call[3] == 2**31 - 1 and ref.pos_max(call[0]) < 0:
                continue    # nothing to move: a no-op, not an overflow
            with pytest.raises(SeqOpError, match=name):
                getattr(ctx.memory, name)(*call)
        check(ctx.memory, ref)
    # the K-shift runs lazily on the next decode; whatever happened, a decode that continues a
    # sequence must still work and see exactly its cells
    s = 0
    start = ref.pos_max(s) + 1
    if ctx.decode(llamir.Batch(tokens=[5], pos=[start], seq_ids=[(s,)])) == 0:
        ref.add(s, [start])
        check(ctx.memory, ref)
        assert not any(c.has_shift for c in ctx.memory.v_cells)


# -- sequence operations against llama.cpp (llama-cpp-python 0.3.36) ------------------------------

_ORACLE_CALLS = """
import json, os, sys
from llamir.testing.llama_cpp import LlamaCppOracle
path, cases = sys.argv[1], json.loads(sys.argv[2])
oracles = {}
for unified in (False, True):
    oracles[unified] = LlamaCppOracle(path, n_ctx=256, n_batch=64, n_seq_max=2, kv_unified=unified)
    oracles[unified].decode([1, 2, 3], pos0=0, seq_id=0)
outcomes = []
for unified, (name, *args) in cases:     # each call in a child process: llama.cpp may abort it
    pid = os.fork()
    if pid == 0:
        getattr(oracles[unified], name)(*args)
        os._exit(0)
    outcomes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
print(json.dumps(outcomes))
"""

REFUSED_BY_BOTH = [   # llama.cpp GGML_ASSERTs (SIGABRT) or divides by zero (SIGFPE) on each
    (False, ("seq_rm", -2, 0, -1)),
    (False, ("seq_rm", 2, 0, -1)),       # non-unified: the ids are [0, n_seq_max)
    (False, ("seq_keep", 2)),
    (False, ("seq_cp", 0, 2, -1, -1)),
    (False, ("seq_cp", 0, 1, 1, -1)),    # across streams, only whole sequences
    (False, ("seq_add", -1, 0, -1, 1)),
    (False, ("seq_div", 0, 0, -1, 0)),
    (False, ("seq_pos_max", -1)),
    (True, ("seq_pos_min", 256)),        # unified: the ids are [0, 256)
    (True, ("seq_pos_max", 1)),          # control: a valid call, llama.cpp survives it (-1)
]


@pytest.fixture(scope="module")
def oracle_outcomes(model):
    """The exit code of llama.cpp making each REFUSED_BY_BOTH call (negative: killed by a signal)."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _ORACLE_CALLS, str(model.path), json.dumps(REFUSED_BY_BOTH)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", range(len(REFUSED_BY_BOTH)), ids=lambda i: str(REFUSED_BY_BOTH[i]))
def test_what_llama_cpp_aborts_on_is_a_seq_op_error_that_changes_nothing(model, oracle_outcomes, case):
    unified, (name, *args) = REFUSED_BY_BOTH[case]
    ctx = llamir.Context(model, n_ctx=256, n_batch=64, n_seq_max=2, kv_unified=unified, flash_attn="off")
    assert ctx.decode(llamir.Batch.from_tokens([1, 2, 3])) == 0
    if oracle_outcomes[case] == 0:                  # the control: both answer
        assert getattr(ctx.memory, name)(*args) == -1
        return
    assert oracle_outcomes[case] < 0, f"llama.cpp exited with {oracle_outcomes[case]}, not a signal"
    caches = [(c.pos.copy(), c.seq.copy(), list(ctx.memory.v_heads)) for c in ctx.memory.v_cells]
    with pytest.raises(SeqOpError, match=name):
        getattr(ctx.memory, name)(*args)
    for (pos, seq, heads), cells in zip(caches, ctx.memory.v_cells, strict=True):
        np.testing.assert_array_equal(cells.pos, pos)
        np.testing.assert_array_equal(cells.seq, seq)
        assert ctx.memory.v_heads == heads
    assert ctx.decode(llamir.Batch.from_tokens([4], pos0=None)) == 0


def test_edge_arguments_llama_cpp_accepts_give_its_answers(model):
    from llamir.testing.llama_cpp import LlamaCppOracle

    ctx = llamir.Context(model, n_ctx=256, n_batch=64, n_seq_max=2, kv_unified=True, flash_attn="off")
    calls = [("seq_cp", 0, 255, -1, -1), ("seq_add", 255, -5, -1, 3), ("seq_rm", 0, -7, 2), ("seq_div", 255, 4, -1, 1),
             ("seq_div", 255, 0, 1000, 2), ("seq_rm", -1, 5, -1), ("seq_keep", 200), ("seq_add", 0, 0, 0, 9)]
    ids = (0, 1, 200, 255)
    with LlamaCppOracle(model.path, n_ctx=256, n_batch=64, n_seq_max=2, kv_unified=True) as oracle:
        oracle.decode([1, 2, 3, 4, 5, 6], pos0=0, seq_id=0)
        assert ctx.decode(llamir.Batch.from_tokens([1, 2, 3, 4, 5, 6])) == 0
        for name, *args in calls:
            assert getattr(ctx.memory, name)(*map(np.int64, args)) == getattr(oracle, name)(*args)
            got = [(ctx.memory.seq_pos_min(s), ctx.memory.seq_pos_max(s)) for s in ids]
            assert got == [(oracle.seq_pos_min(s), oracle.seq_pos_max(s)) for s in ids], (name, args)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_free_cells_is_the_single_cell_scan(model, data):
    """KVCache.free_cells (vectorised, used by find_slot and the token lane) takes the cells the
    cell-by-cell scan (llama_kv_cache::find_slot without cont) takes, from any head and occupancy."""
    size = data.draw(st.sampled_from([8, 33, 256]))
    kv = KVCache(model.hparams, size, 1)
    cells = kv.v_cells[0]
    for idx in data.draw(st.lists(st.integers(0, size - 1), max_size=size, unique=True)):
        cells.pos_set(idx, idx)
        cells.seq_add(idx, 0)
    kv.v_heads[0] = data.draw(st.integers(0, size))
    n_tokens = data.draw(st.integers(1, size))
    head = kv.v_heads[0]
    if head > cells.get_used() + 2 * n_tokens:
        head = 0
    want = kv._scan(cells, head, n_tokens, False)
    got = kv.free_cells(0, n_tokens)
    assert (got is None) == (want is None)
    if want is not None:
        assert got.tolist() == want
