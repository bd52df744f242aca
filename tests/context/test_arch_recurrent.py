"""mamba (Mamba-1, recurrent memory) and jamba (Mamba-1 and attention layers, hybrid memory)
against llama.cpp on random-weight GGUFs: a prompt in one batch, one token at a time, in ubatches,
two interleaved sequences; the memories' sequence operations, state save/load and rollback."""

from __future__ import annotations

import numpy as np
import pytest

import llamir
from llamir.context.memory_hybrid import HybridMemory
from llamir.context.memory_recurrent import RecurrentMemory
from llamir.context.state_io import StateError
from llamir.frontend.synth import SynthSpec, write_model
from llamir.testing.conformance import PROMPT, llama_cpp_logits, llamir_logits
from llamir.testing.llama_cpp import LlamaCppOracle, oracle_numerics

SPECS = {
    "mamba-f32": SynthSpec(arch="mamba", n_layer=2, n_embd=64, seed=3),
    "mamba-q8_0": SynthSpec(arch="mamba", n_layer=2, n_embd=64, dtype="q8_0", seed=4),
    "jamba-f32": SynthSpec(arch="jamba", n_layer=3, n_embd=64, n_head=4, n_head_kv=2, seed=5),
    "jamba-q8_0-moe": SynthSpec(arch="jamba", n_layer=4, n_embd=64, n_head=4, n_head_kv=2, dtype="q8_0",
                                n_expert=4, n_expert_used=2, seed=6),
}
ARCHS = ("mamba-f32", "jamba-f32")   # one model of each memory kind for the memory tests
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
    params.setdefault("flash_attn", "off")   # as the oracle runs
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
@pytest.mark.parametrize("name", ARCHS)
def test_two_interleaved_sequences_match_llama_cpp(paths, models, nmse, backend, name):
    ctx = _context(models[name], backend, n_seq_max=2, n_batch=64, n_ubatch=64)

    def ours(tokens, pos, seqs, logits):
        return ctx.decode(llamir.Batch(tokens=tokens, pos=pos, seq_ids=seqs, logits=logits))

    got = _interleaved(ours, lambda i: ctx.get_logits_ith(i).copy())
    with LlamaCppOracle(paths[name], n_ctx=256, n_batch=64, n_seq_max=2) as o:
        want = _interleaved(o.decode_batch, o.logits_ith)
    assert nmse(got, want) == 0.0


def test_memory_is_recurrent_with_a_cell_per_sequence(models):
    ctx = _context(models["mamba-f32"], n_seq_max=3)
    mem = ctx.memory
    assert isinstance(mem, RecurrentMemory) and mem.size == 3 and mem.get_can_shift()
    hp = models["mamba-f32"].hparams.extra
    assert mem.layout.n_embd_r == (hp.d_conv - 1) * hp.d_inner and mem.layout.n_embd_s == hp.d_state * hp.d_inner
    assert mem.total_bytes() == 2 * 3 * 4 * (mem.layout.n_embd_r + mem.layout.n_embd_s)


def test_jamba_memory_is_hybrid(models):
    """Layers 0 and 2 are Mamba blocks (recurrent cells), layer 1 attends (a KV cache)."""
    ctx = _context(models["jamba-f32"], n_seq_max=2)
    mem = ctx.memory
    assert isinstance(mem, HybridMemory)
    assert mem.recr.layout.layers == (0, 2) and mem.attn.layout.layers == (1,)
    assert set(mem.buffers) == {"cache_r_l0", "cache_s_l0", "cache_r_l2", "cache_s_l2", "cache_k_l1", "cache_v_l1"}
    assert mem.total_bytes() == mem.attn.total_bytes() + mem.recr.total_bytes()


@pytest.mark.llama_cpp
def test_partial_state_holds_only_the_recurrent_part(models):
    """LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY: a hybrid memory writes only its recurrent cells."""
    ctx = _context(models["jamba-f32"])
    _feed(ctx, TOKENS_A[:6])
    whole, partial = ctx.state_seq_get_data(0), ctx.state_seq_get_data(0, flags=1)
    recurrent = ctx.memory.recr
    assert len(partial) < len(whole) and len(partial) == 8 + len(_recurrent_blob(recurrent))
    after = _feed(ctx, TOKENS_A[6:8], pos0=6)
    ctx.memory.recr.clear()
    ctx.memory.attn.seq_rm(0, 6, -1)                     # the KV cache back to positions 0..5
    ctx.state_seq_set_data(partial, 0, flags=1)          # the recurrent part alone
    assert np.array_equal(_feed(ctx, TOKENS_A[6:8], pos0=6), after)


def _recurrent_blob(memory) -> bytes:
    from llamir.context.state_io import Writer

    w = Writer()
    memory.state_write(w, 0)
    return w.getvalue()


def _feed(ctx, tokens, pos0=0, seq=0):
    assert ctx.decode(llamir.Batch.from_tokens(tokens, pos0=pos0, seq_id=seq, logits="last")) == 0, ctx.last_error
    return ctx.get_logits_ith(-1).copy()


@pytest.mark.llama_cpp
@pytest.mark.parametrize("name", ARCHS)
def test_seq_rm_of_a_middle_range_fails_and_changes_nothing(paths, models, name):
    """A state cannot lose its last positions: a range from the middle through the last position
    fails and changes nothing; one past the end or the whole sequence succeeds (as llama.cpp)."""
    ctx = _context(models[name])
    _feed(ctx, TOKENS_A[:8])                          # the state is at position 7
    before = ctx.state_get_data()
    refused = [(0, 4, 8), (0, 4, -1), (-1, 3, 5), (-1, -1, -1)]   # llama.cpp refuses seq_id -1 too
    assert [ctx.memory.seq_rm(*call) for call in refused] == [False] * 4
    assert ctx.state_get_data() == before                # nothing changed, in either memory
    calls = [*refused, (0, 2, 5), (0, 20, -1)]           # before the state: a hybrid's KV cells go
    ours = [False] * 4 + [ctx.memory.seq_rm(*call) for call in calls[4:]]
    with LlamaCppOracle(paths[name], n_ctx=256) as o:
        assert o.decode(TOKENS_A[:8]) == 0
        theirs = [o.seq_rm(*call) for call in calls]
        assert o.state_get_data() == ctx.state_get_data()
        assert o.seq_rm(0, 0, -1) is True and o.seq_pos_max(0) == -1
    assert ours == theirs and ours[:4] == [False] * 4
    assert ctx.memory.seq_pos_max(0) == 7
    assert ctx.memory.seq_rm(0, 0, -1) is True and ctx.memory.seq_pos_max(0) == -1


@pytest.mark.llama_cpp
@pytest.mark.parametrize("name", ARCHS)
def test_state_saves_and_loads_exactly_and_matches_llama_cpps_layout(paths, models, nmse, name):
    ctx = _context(models[name])
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
    with LlamaCppOracle(paths[name], n_ctx=256) as o:
        assert o.decode(TOKENS_A[:8]) == 0
        assert o.state_get_data() == data                # the same layout and bytes
        assert o.state_seq_get_data(0) == seq_data
        o.clear()
        assert o.state_set_data(data) == len(data)     # and llama.cpp restores llamir's state
        assert o.decode(TOKENS_A[8:10], pos0=8) == 0
        assert np.array_equal(o.logits_ith(-1), next_logits)


@pytest.mark.parametrize("name", ARCHS)
def test_sequence_state_copies_into_another_sequence(models, name):
    ctx = _context(models[name], n_seq_max=2)
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


@pytest.mark.parametrize("name", ARCHS)
def test_a_corrupted_state_changes_nothing(models, name):
    ctx = _context(models[name])
    _feed(ctx, TOKENS_A[:5])
    good = ctx.state_get_data()
    arch = name.split("-")[0].encode()
    for bad in (good[:-3], good[:20], good[:-1] + b"\x00\x00", good.replace(arch, b"x" * len(arch))):
        with pytest.raises(StateError):
            ctx.state_set_data(bad)
        assert ctx.state_get_data() == good


@pytest.mark.parametrize("name", ARCHS)
def test_a_failed_decode_rolls_the_state_back(models, name):
    ctx = _context(models[name])
    _feed(ctx, TOKENS_A[:5])
    before = ctx.state_get_data()
    ctx.abort_callback = lambda: True
    assert ctx.decode(llamir.Batch.from_tokens(TOKENS_A[5:8], pos0=5)) == 2
    ctx.abort_callback = None
    assert ctx.state_get_data() == before
    bad = llamir.Batch.from_tokens([models[name].hparams.n_vocab + 5], pos0=5)
    assert ctx.decode(bad) == -1 and "token" in ctx.last_error
    assert ctx.state_get_data() == before


@pytest.mark.parametrize("name", ARCHS)
def test_a_sequence_id_past_the_cells_is_refused(models, name):
    ctx = _context(models[name], n_seq_max=2)
    status = ctx.decode(llamir.Batch.from_tokens(TOKENS_A[:3], seq_id=2))
    assert status == -1 and "seq_id" in ctx.last_error


@pytest.mark.parametrize("name,n_gpu_layers", [("mamba-f32", 2), ("jamba-q8_0-moe", 3)])
def test_split_over_a_device_gives_the_cpus_logits(models, name, n_gpu_layers):
    """Some layers (and their recurrent state) on a simulated device, the rest on the CPU: the same
    logits bit for bit, in several splits."""
    from llamir.frontend.placement import PlacementParams
    from llamir.testing.conformance import assert_device_matches_cpu

    ctx = assert_device_matches_cpu(models[name], placement=PlacementParams(n_gpu_layers=n_gpu_layers))
    breakdown = ctx.memory_breakdown()
    device = next(label for label in breakdown if label != "cpu")
    assert breakdown[device]["context"] > 0     # the offloaded layers' state lives in the device's memory


def _positions_scenario(decode, memory_op, logits_last, pos_max):
    """Sequence operations on a state, then decodes that continue it; the positions and logits."""
    out = []
    assert decode(TOKENS_A[:6], 0, 0) == 0
    memory_op("seq_add", 0, 0, -1, 4)                 # the state's position moves 5 -> 9
    out.append(pos_max(0))
    assert decode(TOKENS_A[6:8], 10, 0) == 0
    out.append(logits_last())
    memory_op("seq_div", 0, 0, -1, 2)                 # 11 -> 5
    memory_op("seq_cp", 0, 1, -1, -1)                 # 1 shares 0's cell
    out += [pos_max(0), pos_max(1)]
    assert decode(TOKENS_A[8:10], 6, 1) == 0          # 1 gets its own cell, 0 keeps its state
    out.append(logits_last())
    assert decode(TOKENS_A[8:10], 6, 0) == 0
    out.append(logits_last())
    memory_op("seq_keep", 1)
    out += [pos_max(0), pos_max(1)]
    return out


@pytest.mark.llama_cpp
@pytest.mark.parametrize("name", ARCHS)
def test_sequence_operations_match_llama_cpp(paths, models, name):
    """seq_add and seq_div move a state's position, seq_cp shares it until one side decodes,
    seq_keep drops the others: the positions and the logits that follow are llama.cpp's."""
    ctx = _context(models[name], n_seq_max=2, kv_unified=True)

    def decode(tokens, pos0, seq):
        return ctx.decode(llamir.Batch.from_tokens(tokens, pos0=pos0, seq_id=seq, logits="last"))

    ours = _positions_scenario(decode, lambda op, *a: getattr(ctx.memory, op)(*a),
                               lambda: ctx.get_logits_ith(-1).copy(), ctx.memory.seq_pos_max)
    with LlamaCppOracle(paths[name], n_ctx=256, n_seq_max=2, kv_unified=True) as o:
        theirs = _positions_scenario(lambda t, p, s: o.decode(t, pos0=p, seq_id=s), lambda op, *a: getattr(o, op)(*a),
                                     lambda: o.logits_ith(-1), o.seq_pos_max)
    for a, b in zip(ours, theirs, strict=True):
        assert np.array_equal(a, b)


@pytest.mark.llama_cpp
@pytest.mark.parametrize("pooling", ["none", "last"])
@pytest.mark.parametrize("name", ARCHS)
def test_embeddings_split_by_sequence_match_llama_cpp(paths, models, nmse, name, pooling):
    """embeddings=True makes every token an output, so the batch splits by sequence (split_seq);
    the per-token and pooled embeddings of two sequences are llama.cpp's."""
    tokens, pos = TOKENS_A[:5] + TOKENS_B[:4], [0, 1, 2, 3, 4, 0, 1, 2, 3]
    seqs = [(0,)] * 5 + [(1,)] * 4
    ctx = _context(models[name], n_seq_max=2, kv_unified=True, embeddings=True, pooling_type=pooling)
    assert ctx.decode(llamir.Batch(tokens=tokens, pos=pos, seq_ids=seqs)) == 0, ctx.last_error
    with LlamaCppOracle(paths[name], n_ctx=256, n_seq_max=2, kv_unified=True, embeddings=True,
                        pooling=pooling) as o:
        assert o.decode_batch(tokens, pos, seqs, [True] * len(tokens)) == 0
        if pooling == "none":
            got = np.stack([ctx.get_embeddings_ith(i) for i in range(len(tokens))])
            want = np.stack([o.embeddings_ith(i) for i in range(len(tokens))])
        else:
            got = np.stack([ctx.get_embeddings_seq(s) for s in (0, 1)])
            want = np.stack([o.embeddings_seq(s) for s in (0, 1)])
    assert nmse(got, want) == 0.0
