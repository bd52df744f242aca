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
    with pytest.raises(IndexError, match=r"batch.logits\[1\] != true"):
        ctx.get_logits_ith(1)
    with pytest.raises(IndexError, match="out of range"):
        ctx.get_logits_ith(10_000)
    with pytest.raises(IndexError, match="negative index"):
        ctx.get_logits_ith(-5)


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
