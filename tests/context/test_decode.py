"""Context.decode: status codes, invalid batches, ubatch splits, outputs and the KV cache.

The oracle for logits here is an independent run: a fresh context fed the same tokens in one
batch (itself checked against llama.cpp in test_llama_cpp_conformance.py).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import llamir
from llamir.frontend.synth import SynthSpec, write_model

TOKENS = [5, 17, 99, 3, 250, 42, 7, 311, 64, 128]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("decode") / "m.gguf"
    return llamir.load_model(write_model(path, SynthSpec(arch="llama", n_layer=2, dtype="f32")))


def _ctx(model, **kw):
    kw = {"n_ctx": 256, "n_batch": 64, "n_ubatch": 64, "flash_attn": "off", **kw}
    return llamir.Context(model, **kw)


def _logits(model, tokens, **kw):
    ctx = _ctx(model, **kw)
    assert ctx.decode(llamir.Batch.from_tokens(tokens, logits="all")) == 0, ctx.last_error
    return ctx.get_logits().copy()


def test_prompt_then_one_token_at_a_time_equals_one_batch(model):
    ctx = _ctx(model)
    assert ctx.decode(llamir.Batch.from_tokens(TOKENS[:6], logits="all")) == 0
    rows = [ctx.get_logits()[i].copy() for i in range(6)]
    for t in TOKENS[6:]:
        assert ctx.decode(llamir.Batch.from_tokens([t], pos0=None)) == 0
        rows.append(ctx.get_logits_ith(-1).copy())
    np.testing.assert_allclose(np.stack(rows), _logits(model, TOKENS), rtol=0, atol=1e-4)


def test_batch_larger_than_n_ubatch_is_split(model):
    ctx = _ctx(model, n_ubatch=3)
    assert ctx.decode(llamir.Batch.from_tokens(TOKENS, logits="all")) == 0
    np.testing.assert_allclose(ctx.get_logits(), _logits(model, TOKENS), rtol=0, atol=2e-4)
    assert ctx.memory.seq_pos_max(0) == len(TOKENS) - 1


def test_outputs_follow_the_logits_flags(model):
    ctx = _ctx(model)
    flags = [i % 3 == 0 for i in range(len(TOKENS))]
    assert ctx.decode(llamir.Batch.from_tokens(TOKENS, logits=flags)) == 0
    full = _logits(model, TOKENS)
    assert ctx.get_logits().shape == (sum(flags), model.hparams.n_vocab)
    for i, f in enumerate(flags):
        if f:
            np.testing.assert_allclose(ctx.get_logits_ith(i), full[i], atol=2e-4)
    np.testing.assert_allclose(ctx.get_logits_ith(-1), full[9], atol=2e-4)
    with pytest.raises(llamir.OutputError, match=r"batch.logits\[1\] != true"):
        ctx.get_logits_ith(1)
    with pytest.raises(llamir.OutputError, match="out of range"):
        ctx.get_logits_ith(10_000)
    with pytest.raises(llamir.OutputError, match="negative index"):
        ctx.get_logits_ith(-5)
    for bad in ("1", 1.0, None):
        with pytest.raises(llamir.OutputError, match="output index must be an integer"):
            ctx.get_logits_ith(bad)
    np.testing.assert_array_equal(ctx.get_logits_ith(np.int32(0)), ctx.get_logits_ith(0))


def _assert_untouched(ctx, model, n_done):
    """The memory holds exactly the first n_done tokens and decoding goes on as if nothing happened."""
    assert ctx.memory.seq_pos_max(0) == n_done - 1
    assert ctx.decode(llamir.Batch.from_tokens(TOKENS[n_done:n_done + 1], pos0=None)) == 0
    np.testing.assert_allclose(ctx.get_logits_ith(-1), _logits(model, TOKENS[:n_done + 1])[-1], atol=1e-4)


@pytest.mark.parametrize("make_batch,message", [
    (lambda: llamir.Batch.from_tokens([1, 2, 512], pos0=4), r"invalid token\[2\] = 512 \(n_vocab = 512\)"),
    (lambda: llamir.Batch.from_tokens([-3], pos0=4), r"invalid token\[0\] = -3"),
    (lambda: llamir.Batch(tokens=[1, 2, 3], pos=[4, 5, 4]), r"sequence 0 positions are decreasing"),
    (lambda: llamir.Batch.from_tokens([1, 2], pos0=7), r"memory holds positions up to X = 3.*Y = 7"),
    (lambda: llamir.Batch(tokens=[1, 2], pos=[4, 6]), r"sequence 0 positions are not continuous"),
    (lambda: llamir.Batch(tokens=[1], pos=[4], seq_ids=[(1,)]), r"invalid seq_id\[0\]\[0\] = 1 >= 1"),
    (lambda: llamir.Batch(tokens=[1, 2], pos=[-3, -2]), r"invalid pos\[0\] = -3"),
    (lambda: llamir.Batch(tokens=[1, 2], pos=[4, 2**31 - 1]), r"invalid pos\[1\] = 2147483647 \(positions are 0"),
])
def test_invalid_batch_returns_minus_one_and_keeps_the_cache(model, make_batch, message):
    ctx = _ctx(model)
    assert ctx.decode(llamir.Batch.from_tokens(TOKENS[:4])) == 0
    before = ctx.get_logits_ith(-1).copy()
    assert ctx.decode(make_batch()) == -1
    assert re.search(message, ctx.last_error), ctx.last_error
    np.testing.assert_array_equal(ctx.get_logits_ith(-1), before)  # outputs survive too
    _assert_untouched(ctx, model, 4)


def test_batch_larger_than_n_batch(model):
    ctx = _ctx(model, n_batch=8, n_ubatch=8)
    assert ctx.decode(llamir.Batch.from_tokens(TOKENS)) == -1
    assert "n_batch = 8" in ctx.last_error
    assert ctx.memory.seq_pos_max(0) == -1


def test_batch_constructor_rejects_malformed_input():
    with pytest.raises(llamir.context.BatchError, match="exactly one of tokens and embd"):
        llamir.Batch()
    with pytest.raises(llamir.context.BatchError, match="2 positions for 3 tokens"):
        llamir.Batch(tokens=[1, 2, 3], pos=[0, 1])
    with pytest.raises(llamir.context.BatchError, match="logits must be"):
        llamir.Batch.from_tokens([1], logits="some")


def test_full_cache_returns_one_and_changes_nothing(model):
    ctx = _ctx(model, n_ctx=256, n_batch=256, n_ubatch=256)
    assert ctx.decode(llamir.Batch.from_tokens(list(range(1, 251)))) == 0
    assert ctx.decode(llamir.Batch.from_tokens(list(range(1, 11)), pos0=None)) == 1
    assert ctx.memory.seq_pos_max(0) == 249
    assert ctx.decode(llamir.Batch.from_tokens([1, 2, 3, 4, 5, 6], pos0=None)) == 0
    assert ctx.memory.seq_pos_max(0) == 255


def test_seq_rm_rewinds(model):
    ctx = _ctx(model)
    assert ctx.decode(llamir.Batch.from_tokens(TOKENS)) == 0
    ctx.memory.seq_rm(0, 5, -1)
    assert ctx.memory.seq_pos_max(0) == 4
    assert ctx.decode(llamir.Batch.from_tokens([77, 78], pos0=None, logits="all")) == 0
    np.testing.assert_allclose(ctx.get_logits(), _logits(model, TOKENS[:5] + [77, 78])[5:], atol=1e-4)


def test_f32_kv_cache_and_flash_attention_agree(model):
    base = _logits(model, TOKENS)
    np.testing.assert_allclose(_logits(model, TOKENS, type_k="f32", type_v="f32"), base, atol=2e-2)
    np.testing.assert_allclose(_logits(model, TOKENS, flash_attn="on"), base, atol=2e-2)


def test_abort_callback_returns_two_and_rolls_back_the_ubatch(model):
    ctx = _ctx(model, n_ubatch=4)
    # checked between ubatches and between nodes; fires once the second ubatch is in the cache
    ctx.abort_callback = lambda: ctx.memory.seq_pos_max(0) >= 7
    assert ctx.decode(llamir.Batch.from_tokens(TOKENS)) == 2
    assert ctx.memory.seq_pos_max(0) == 3  # the first ubatch stays, as in llama.cpp


def test_outputs_come_back_in_batch_order_through_lazy_swaps():
    from llamir.context.outputs import Outputs

    out = Outputs(n_vocab=3, n_embd=2, n_batch=8, n_seq_max=1)
    out.reserve(4)
    rows = np.arange(12, dtype=np.float32).reshape(4, 3)  # written in ubatch order
    out.write(0, rows, None)
    out.finish([5, 1, 7, 2], 4)                            # the batch index of each row
    assert out.swaps                                       # recorded, not yet applied
    np.testing.assert_array_equal(out.logits[:4], rows)
    assert out.row(1) == 0 and not out.swaps               # first access reorders
    np.testing.assert_array_equal(out.logits[:4], rows[[1, 3, 0, 2]])   # batch order 1, 2, 5, 7
    assert [out.row(i) for i in (1, 2, 5, 7)] == [0, 1, 2, 3]


# -- issue 9, finding 3: Batch fields of the wrong kind, at construction and replaced later --------

def _memory_state(ctx):
    """Every cell's position, sequences and pending shift, and the search heads, of every cache."""
    caches = ctx.memory.caches
    return [(c.pos.copy(), c.seq.copy(), c.shift.copy(), c.has_shift, list(cache.v_heads))
            for cache in caches for c in cache.v_cells]


def _assert_same_memory(ctx, before):
    for (pos, seq, shift, has_shift, heads), now in zip(before, _memory_state(ctx), strict=True):
        np.testing.assert_array_equal(now[0], pos)
        np.testing.assert_array_equal(now[1], seq)
        np.testing.assert_array_equal(now[2], shift)
        assert (now[3], now[4]) == (has_shift, heads)


@pytest.mark.parametrize("kwargs,message", [
    (dict(tokens=[2**63]), r"tokens\[0\] = 9223372036854775808 is out of range"),
    (dict(tokens=[1, 2**31]), r"tokens\[1\] = 2147483648 is out of range"),
    (dict(tokens=np.array([2**63], dtype=np.uint64)), r"tokens\[0\] = 9223372036854775808 is out of range"),
    (dict(tokens=[1, 2.0]), r"tokens\[1\] = 2.0 is not an integer"),
    (dict(tokens=np.array([1.7, 2.2])), r"tokens\[0\] = 1.7 is not an integer"),
    (dict(tokens=[True]), r"tokens\[0\] = True is not an integer"),
    (dict(tokens="12"), r"tokens must be a list, got str"),
    (dict(tokens=[1], pos=[2**31]), r"pos\[0\] = 2147483648 is out of range"),
    (dict(tokens=[1], pos=[0.5]), r"pos\[0\] = 0.5 is not an integer"),
    (dict(tokens=[1], seq_ids=[(0, 2**63)]), r"seq_ids\[0\]\[1\] = 9223372036854775808 is out of range"),
    (dict(tokens=[1], seq_ids=["0"]), r"seq_ids\[0\] must be a list, got str"),
    (dict(tokens=[1], seq_ids=[(0.0,)]), r"seq_ids\[0\]\[0\] = 0.0 is not an integer"),
    (dict(tokens=[1], seq_ids=[()]), r"seq_ids\[0\] is empty"),
    (dict(tokens=[1, 2], logits=["False", "False"]), r"logits\[0\] = 'False' is not a flag"),
    (dict(tokens=[1], logits=[2]), r"logits\[0\] = 2 is not a flag"),
    (dict(tokens=[1], logits=np.array([0.0])), r"logits\[0\] = 0.0 is not a flag"),
    (dict(tokens=[1], logits="all"), r"logits must be a list of flags, got the string 'all'"),
    (dict(embd=[[1.0, 2.0], [3.0]]), r"embd is not a rectangular array"),
    (dict(embd=np.array([["a"]])), r"embd must hold real numbers"),
])
def test_batch_constructor_refuses_wrong_kinds_with_batch_error(kwargs, message):
    with pytest.raises(llamir.context.BatchError, match=message):
        llamir.Batch(**kwargs)


def test_batch_constructor_accepts_numpy_integers_and_0_1_flags(model):
    plain = llamir.Batch(tokens=TOKENS[:3], pos=[0, 1, 2], seq_ids=[(0,)] * 3, logits=[False, True, True])
    numpy_kinds = llamir.Batch(tokens=np.array(TOKENS[:3], dtype=np.int16), pos=[np.int64(0), np.uint8(1), 2],
                               seq_ids=[np.int64(0), [np.int32(0)], (np.uint64(0),)], logits=[0, 1, np.bool_(True)])
    assert numpy_kinds.seq_ids == [(0,), (0,), (0,)] and type(numpy_kinds.seq_ids[0][0]) is int
    for a, b in ((plain.tokens, numpy_kinds.tokens), (plain.pos, numpy_kinds.pos), (plain.logits, numpy_kinds.logits)):
        np.testing.assert_array_equal(a, b)
    ctx, witness = _ctx(model), _ctx(model)
    assert ctx.decode(llamir.Batch.from_tokens(TOKENS[:3], seq_id=np.int64(0), pos0=np.int32(0), logits="all")) == 0
    assert witness.decode(plain) == 0
    np.testing.assert_array_equal(ctx.get_logits()[1:], witness.get_logits())


def _replace(**fields):
    def make():
        batch = llamir.Batch.from_tokens(TOKENS[4:6], pos0=4)
        for name, value in fields.items():
            setattr(batch, name, value)
        return batch
    return make


REPLACED = [  # fields replaced after the Batch was made: each was an IndexError/TypeError/AttributeError
    (_replace(tokens=7), r"tokens must be a list, got int 7"),
    (_replace(tokens=None), r"exactly one of tokens and embd"),
    (_replace(tokens=[[1, 2], [3, 4]]), r"tokens\[0\] = \[1, 2\] is not an integer"),
    (_replace(tokens=np.array([1.5, 2.5])), r"tokens\[0\] = 1.5 is not an integer"),
    (_replace(tokens=np.array([1, 2**40])), r"tokens\[1\] = 1099511627776 is out of range"),
    (_replace(tokens=[]), r"2 positions for 0 tokens"),
    (_replace(pos=4), r"pos must be a list, got int 4"),
    (_replace(pos=[4]), r"1 positions for 2 tokens"),
    (_replace(pos=["4", "5"]), r"pos\[0\] = '4' is not an integer"),
    (_replace(seq_ids=[(0,)]), r"1 seq_id lists for 2 tokens"),      # once an orphan cell after apply()
    (_replace(seq_ids=[(0,), None]), r"seq_ids\[1\] must be a list, got NoneType"),
    (_replace(seq_ids=[(0,), ()]), r"seq_ids\[1\] is empty"),
    (_replace(seq_ids=0), r"seq_ids must be a list, got int 0"),
    (_replace(logits=[True]), r"1 logits flags for 2 tokens"),
    (_replace(logits="last"), r"logits must be a list of flags"),
    (_replace(logits=["False", "True"]), r"logits\[0\] = 'False' is not a flag"),
    (_replace(logits=None, tokens=None, embd="x"), r"embd must be \[n_tokens, n_embd\] numbers, got str"),
    (_replace(embd=np.zeros((2, 64), np.float32)), r"exactly one of tokens and embd"),
    (lambda: None, r"decode needs a llamir.Batch, got NoneType"),
    (lambda: [5, 17], r"decode needs a llamir.Batch, got list"),
]


@pytest.mark.parametrize("make_batch,message", REPLACED)
def test_replaced_batch_fields_are_checked_again_before_any_cell_is_taken(model, make_batch, message):
    ctx = _ctx(model)
    assert ctx.decode(llamir.Batch.from_tokens(TOKENS[:4])) == 0
    before, memory = ctx.get_logits_ith(-1).copy(), _memory_state(ctx)
    assert ctx.decode(make_batch()) == -1
    assert re.search(message, ctx.last_error), ctx.last_error
    _assert_same_memory(ctx, memory)
    np.testing.assert_array_equal(ctx.get_logits_ith(-1), before)
    _assert_untouched(ctx, model, 4)


def test_encode_checks_replaced_fields_too(model):
    ctx = _ctx(model)
    batch = llamir.Batch.from_tokens(TOKENS[:2])
    batch.seq_ids = [(0,)]
    assert ctx.encode(batch) == -1 and "1 seq_id lists for 2 tokens" in ctx.last_error


# -- a failure after cells were taken rolls the whole batch back ----------------------------------

def _witness_next_logits(model, tokens, nxt):
    witness = _ctx(model)
    assert witness.decode(llamir.Batch.from_tokens(tokens)) == 0
    assert witness.decode(llamir.Batch.from_tokens([nxt], pos0=None)) == 0
    return witness.get_logits_ith(-1)


def test_compute_failure_in_a_later_ubatch_rolls_back_every_ubatch_and_the_outputs(model, monkeypatch):
    ctx = _ctx(model, n_ubatch=3)
    assert ctx.decode(llamir.Batch.from_tokens(TOKENS[:6], logits="all")) == 0
    logits, memory = ctx.get_logits().copy(), _memory_state(ctx)
    run, calls = ctx.runner.run, []

    def failing_run(*args):
        calls.append(1)
        if len(calls) == 2:
            raise llamir.backends.BackendError("kernel get_rows: row index 9 is out of range")
        return run(*args)

    monkeypatch.setattr(ctx.runner, "run", failing_run)
    # 4 tokens: ubatch 0 (3 tokens) is computed and its rows written over the previous ones, ubatch 1 fails
    assert ctx.decode(llamir.Batch.from_tokens(TOKENS[6:10], pos0=None, logits="all")) == -3
    assert "row index 9" in ctx.last_error and len(calls) == 2
    _assert_same_memory(ctx, memory)
    np.testing.assert_array_equal(ctx.get_logits(), logits)      # the previous batch's outputs, all 6 rows
    monkeypatch.setattr(ctx.runner, "run", run)
    assert ctx.decode(llamir.Batch.from_tokens([TOKENS[6]], pos0=None)) == 0
    np.testing.assert_array_equal(ctx.get_logits_ith(-1), _witness_next_logits(model, TOKENS[:6], TOKENS[6]))


def test_an_internal_error_is_a_status_not_an_exception_and_rolls_back(model, monkeypatch):
    import llamir.context.context as context_module

    ctx = _ctx(model)
    assert ctx.decode(llamir.Batch.from_tokens(TOKENS[:4])) == 0
    memory = _memory_state(ctx)
    ctx.runner.graphs.clear()
    ctx._prev = None

    def broken(*args, **kwargs):
        raise TypeError("'NoneType' object is not subscriptable")

    monkeypatch.setattr(context_module, "build_inputs", broken)
    assert ctx.decode(llamir.Batch.from_tokens(TOKENS[4:6], pos0=None)) == -3
    assert "internal error: TypeError" in ctx.last_error
    _assert_same_memory(ctx, memory)
    monkeypatch.undo()
    assert ctx.decode(llamir.Batch.from_tokens([TOKENS[4]], pos0=None)) == 0
    np.testing.assert_array_equal(ctx.get_logits_ith(-1), _witness_next_logits(model, TOKENS[:4], TOKENS[4]))


# -- issue 9, finding 6: compile errors on the LLVM backend, NaN attributes -----------------------

def test_an_llvm_compile_error_returns_minus_three_and_rolls_back(model, monkeypatch):
    from llvmlite.ir._utils import DuplicatedNameError

    from llamir.backends.llvm import LLVMBackend

    ctx = _ctx(model, backend="llvm")
    assert ctx.decode(llamir.Batch.from_tokens(TOKENS[:4])) == 0
    memory = _memory_state(ctx)
    ctx.runner.graphs.clear()                       # the next ubatch compiles again, and fails
    ctx._prev = None

    def duplicated(self, graph, observe_variant=False):
        raise DuplicatedNameError("Duplicated name 'llamir_RowNorm_ecc650aec54d75bae08b3fdb'")

    monkeypatch.setattr(LLVMBackend, "_compile", duplicated)
    assert ctx.decode(llamir.Batch.from_tokens(TOKENS[4:6], pos0=None)) == -3
    assert "DuplicatedNameError" in ctx.last_error and "failed to build the graph" in ctx.last_error
    _assert_same_memory(ctx, memory)                # the batch is not left in the KV cache
    monkeypatch.undo()
    assert ctx.decode(llamir.Batch.from_tokens([TOKENS[4]], pos0=None)) == 0
    np.testing.assert_array_equal(ctx.get_logits_ith(-1), _witness_next_logits(model, TOKENS[:4], TOKENS[4]))


def _model_with(model, **hparams):
    """The same GGUF loaded again, with hparams replaced (as a model built by hand could have)."""
    from dataclasses import replace

    copy = llamir.load_model(model.path)
    copy.hparams = replace(copy.hparams, **hparams)
    return copy


def test_nan_rope_freq_base_compiles_on_llvm_and_gives_the_references_logits(model):
    nan_model = _model_with(model, rope_freq_base_train=float("nan"))
    logits = {}
    for backend in ("llvm", "numpy"):
        ctx = _ctx(nan_model, backend=backend)
        assert ctx.decode(llamir.Batch.from_tokens(TOKENS[:3], logits="all")) == 0, ctx.last_error
        logits[backend] = ctx.get_logits().copy()
    assert np.isnan(logits["numpy"]).all()          # NaN angles: the reference's logits are NaN too
    np.testing.assert_array_equal(logits["llvm"], logits["numpy"])


def test_nan_rms_eps_is_refused_at_graph_build_and_leaves_the_cache_empty(model):
    ctx = _ctx(_model_with(model, f_norm_rms_eps=float("nan")), backend="llvm")
    assert ctx.decode(llamir.Batch.from_tokens(TOKENS[:3])) == -3
    assert "eps" in ctx.last_error
    assert ctx.memory.seq_pos_max(0) == -1 and ctx.memory.v_cells[0].get_used() == 0


def test_k_shift_of_an_iswa_cache_with_a_smaller_window_cache_is_llama_cpps(tmp_path):
    """swa_full=False makes the window cache smaller than the base one; llama.cpp still shifts each
    cache on its own (llama_kv_cache::update asks each cache, not the iSWA, whether it can), so a
    seq_add is applied at the next decode, not refused there (-2, every decode after) as it was."""
    from llamir.testing.llama_cpp import LlamaCppOracle, oracle_numerics

    path = write_model(tmp_path / "g3.gguf", SynthSpec(arch="gemma3", n_layer=2, n_embd=64, n_head=2, n_head_kv=1,
                                                         n_ff=64, sliding_window=8, swa_pattern=2))
    ctx = _ctx(llamir.load_model(path), n_ctx=512, swa_full=False, backend="numpy", numerics=oracle_numerics())
    assert ctx.memory.swa.kv_size < ctx.memory.base.kv_size
    tokens = list(range(5, 45))
    with LlamaCppOracle(path, n_ctx=512, n_batch=64, swa_full=False) as oracle:
        assert oracle.decode(tokens, pos0=0) == 0
        assert ctx.decode(llamir.Batch.from_tokens(tokens)) == 0
        for memory in (oracle, ctx.memory):
            memory.seq_rm(0, 4, 14)
            memory.seq_add(0, 14, -1, -10)
        assert oracle.decode([7], pos0=30) == 0
        assert ctx.decode(llamir.Batch.from_tokens([7], pos0=30)) == 0, ctx.last_error
        np.testing.assert_array_equal(ctx.get_logits_ith(-1), oracle.logits_ith(0))
