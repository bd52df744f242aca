"""The one-token fast lane (llamir.context.token_step) does what the general decode path does.

Oracle: the general path itself. Two contexts on one model take the same random script of
generated tokens (good and bad: wrong positions, unknown sequences, tokens outside the vocab, no
logits), prompts, sequence operations, K-shifts, state loads, clears and failed computes; one
serves tokens through the fast lane, the other never does. After every step both must hold the
same cells, heads, outputs, logits, perf counters and status, and the fast lane must have served
most of the tokens.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

import llamir
from llamir.backends import BackendError
from llamir.backends.llvm.executable import CompiledSplit
from llamir.frontend.synth import SynthSpec, write_model

N_SEQ = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("token_step") / "m.gguf"
    return llamir.load_model(write_model(path, SynthSpec(n_layer=2, n_embd=32, n_head=2, n_head_kv=1, n_ff=48,
                                                         n_vocab=300, seed=3)))


class Failing:
    """Makes the LLVM executables' native run raise while `fail` is set (a compute that fails),
    whichever way the run was reached."""

    def __init__(self, monkeypatch):
        self.fail = False
        run = CompiledSplit._run

        def failing_run(exe):
            if self.fail:
                raise BackendError("injected failure")
            return run(exe)
        monkeypatch.setattr(CompiledSplit, "_run", failing_run)


class Counted:
    """Counts the batches that reach the general path (BatchAllocator.init)."""

    def __init__(self, ctx):
        self.init, self.n = ctx.balloc.init, 0
        ctx.balloc.init = self

    def __call__(self, *args, **kwargs):
        self.n += 1
        return self.init(*args, **kwargs)


def snapshot(ctx) -> dict:
    mem = ctx.memory
    out = {"heads": list(mem.v_heads), "n_outputs": ctx.n_outputs, "error": ctx.last_error,
           "perf": {k: v for k, v in ctx.perf().items() if k.startswith("n_")}}
    for i, cells in enumerate(mem.v_cells):
        out[f"cells{i}"] = (cells.pos.tolist(), cells.seq[:, :N_SEQ].tolist(), cells.shift.tolist(), cells.has_shift,
                            cells.get_used(), cells.used_max_p1(), [cells.seq_pos_max(s) for s in range(N_SEQ)])
    out["logits"] = ctx.get_logits().copy() if ctx.n_outputs else None
    out["output_ids"] = ctx.outputs.output_ids.tolist()
    return out


def step(ctx, rng: random.Random, failing: Failing, saved: list):
    """One random operation; what it returned."""
    op = rng.choices(["token", "prompt", "seq_rm", "seq_cp", "seq_keep", "seq_add", "seq_div", "state", "clear",
                      "fail"], weights=[60, 4, 4, 3, 1, 2, 1, 2, 1, 3])[0]
    s = rng.randrange(N_SEQ)
    mem = ctx.memory
    if op == "token":
        kind = rng.choices(["next", "none", "wrong", "vocab", "no_logits", "seq"], weights=[50, 20, 4, 2, 3, 2])[0]
        token = rng.randrange(300) if kind != "vocab" else 300 + rng.randrange(3)
        pos0 = mem.seq_pos_max(s) + 1
        pos0 = {"none": None, "wrong": pos0 + rng.choice([-1, 1, 2])}.get(kind, pos0)
        seq = N_SEQ + 5 if kind == "seq" else s
        logits = "none" if kind == "no_logits" else "last"
        return ctx.decode(llamir.Batch.from_tokens([token], pos0=pos0, seq_id=seq, logits=logits))
    if op == "prompt":
        n = rng.randrange(2, 6)
        return ctx.decode(llamir.Batch.from_tokens([rng.randrange(300) for _ in range(n)], pos0=None, seq_id=s))
    if op == "seq_rm":
        p0 = rng.randrange(-1, 20)
        return mem.seq_rm(s, p0, -1 if rng.random() < 0.5 else p0 + rng.randrange(1, 5))
    if op == "seq_cp":
        return mem.seq_cp(s, (s + 1) % N_SEQ, -1, -1)
    if op == "seq_keep":
        return mem.seq_keep(s)
    if op == "seq_add":
        return mem.seq_add(s, rng.randrange(0, 10), -1, rng.randrange(-3, 4))
    if op == "seq_div":
        return mem.seq_div(s, 0, -1, 2)
    if op == "state":
        if saved and rng.random() < 0.5:
            return ctx.state_set_data(saved[-1])
        saved.append(ctx.state_get_data())
        return len(saved[-1])
    if op == "clear":
        return mem.clear()
    failing.fail = True       # the next token's compute fails: cells, head and outputs stay
    try:
        return ctx.decode(llamir.Batch.from_tokens([rng.randrange(300)], pos0=None, seq_id=s))
    finally:
        failing.fail = False


@pytest.mark.parametrize("flash_attn, unified", [("off", True), ("on", True), ("off", False)])
@pytest.mark.parametrize("seed", [0, 1])
def test_fast_lane_matches_the_general_path(model, seed, flash_attn, unified, monkeypatch):
    """One stream shared by the sequences (kv_unified), with and without flash attention (an f16
    mask, V not transposed); a stream per sequence is the general path's alone."""
    # 40 cells per stream: the cache fills, wraps and runs out of slots; n_kv stays 40
    contexts = [llamir.Context(model, n_ctx=40 * (1 if unified else N_SEQ), n_batch=8, n_ubatch=8, n_seq_max=N_SEQ,
                               kv_unified=unified, flash_attn=flash_attn) for _ in range(2)]
    fast, general = contexts
    general.fast_token_decode = False
    failing = Failing(monkeypatch)
    counted = [Counted(ctx) for ctx in contexts]
    saved = [[], []]
    n_tokens = 0
    for i in range(300):
        results = []
        for k, ctx in enumerate(contexts):
            rng = random.Random(seed * 1000 + i)
            results.append(step(ctx, rng, failing, saved[k]))
        n_tokens += 1
        assert results[0] == results[1], f"step {i}"
        a, b = snapshot(fast), snapshot(general)
        for key in a:
            assert np.array_equal(a[key], b[key]) if key == "logits" and a[key] is not None else a[key] == b[key], \
                f"step {i}: {key} differs"
    # most of the tokens took the fast lane; the general context saw every batch
    if unified:
        assert counted[0].n < counted[1].n / 2, (counted[0].n, counted[1].n)
    else:
        assert counted[0].n == counted[1].n


def test_fast_lane_crosses_n_kv_and_follows_a_new_graph(model):
    """Past 256 cells n_kv grows: the general path builds the new graph and the lane follows it."""
    contexts = [llamir.Context(model, n_ctx=300, n_batch=4, n_ubatch=4) for _ in range(2)]
    contexts[1].fast_token_decode = False
    counted = [Counted(ctx) for ctx in contexts]
    for ctx in contexts:
        assert ctx.decode(llamir.Batch.from_tokens([1, 2, 3])) == 0
    for pos in range(3, 290):
        rows = []
        for ctx in contexts:
            assert ctx.decode(llamir.Batch.from_tokens([pos % 300], pos0=pos)) == 0, ctx.last_error
            rows.append(ctx.get_logits_ith(-1))
        assert np.array_equal(rows[0], rows[1]), pos
    assert [c.memory.v_cells[0].pos.tolist() for c in contexts][0] == contexts[1].memory.v_cells[0].pos.tolist()
    assert counted[0].n == 3    # the prompt, the first token, the first token past 256 cells
    assert counted[1].n == 288


def test_fast_lane_keeps_callbacks_and_interrupts(model, monkeypatch):
    """An abort callback or eval callback sends the token down the general path (which calls it
    once); an exception out of the compute leaves the cell free and re-raises."""
    ctx = llamir.Context(model, n_ctx=40, n_batch=4, n_ubatch=4)
    counted = Counted(ctx)
    assert ctx.decode(llamir.Batch.from_tokens([1, 2])) == 0
    assert ctx.decode(llamir.Batch.from_tokens([3], pos0=None)) == 0
    assert counted.n == 2
    calls = []
    ctx.abort_callback = lambda: calls.append(1) or True
    assert ctx.decode(llamir.Batch.from_tokens([4], pos0=None)) == 2
    assert calls == [1] and counted.n == 3 and ctx.memory.seq_pos_max(0) == 2
    ctx.abort_callback = None
    assert ctx.decode(llamir.Batch.from_tokens([4], pos0=None)) == 0
    assert counted.n == 3          # the abort changed no graph: the lane is still armed
    ctx.cb_eval = lambda name, value, ask: False
    assert ctx.decode(llamir.Batch.from_tokens([5], pos0=None)) == 0
    assert counted.n == 4
    ctx.cb_eval = None

    def interrupted(exe):
        raise KeyboardInterrupt
    run = CompiledSplit._run
    monkeypatch.setattr(CompiledSplit, "_run", interrupted)
    cells = ctx.memory.v_cells[0].pos.copy()
    with pytest.raises(KeyboardInterrupt):
        ctx._decode(llamir.Batch.from_tokens([6], pos0=None))
    monkeypatch.setattr(CompiledSplit, "_run", run)
    assert np.array_equal(ctx.memory.v_cells[0].pos, cells) and ctx.memory.seq_pos_max(0) == 4
    assert ctx.decode(llamir.Batch.from_tokens([6], pos0=None)) == 0 and ctx.memory.seq_pos_max(0) == 5
    assert counted.n == 4
