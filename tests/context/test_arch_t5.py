"""t5 (encoder-decoder) against llama.cpp on random-weight GGUFs: llama_encode of a source, then
decoder logits from the decoder start token, through ctx.encode / ctx.decode / ctx.get_logits."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import llamir
from llamir.context.graph_inputs import relative_position_bucket
from llamir.frontend.arch.t5 import T5, T5HParams
from llamir.frontend.synth import SynthSpec, write_model
from llamir.testing.llama_cpp import LlamaCppOracle, oracle_numerics
from llamir.testing.llama_cpp import relative_position_bucket as llama_cpp_bucket

# 24 source tokens: bidirectional distances from 8 (max_exact of 32 buckets) take the log buckets
SRC_A = [(7 * i + 20) % 400 + 10 for i in range(24)]
SRC_B = [(11 * i + 3) % 300 + 40 for i in range(13)]   # a second source, of another length
# 18 decoder tokens after the start token: causal distances from 16 take the log buckets
DEC = [(13 * i + 5) % 450 + 20 for i in range(17)]
N_CTX = 64

MODELS = {
    "f32": SynthSpec(arch="t5", n_head=4, n_head_kv=4),
    "q8_0-tied": SynthSpec(arch="t5", n_head=4, n_head_kv=4, dtype="q8_0", tied=True, seed=1),
    "dkv": SynthSpec(arch="t5", n_head=4, n_head_kv=4, head_dim=32, seed=2),   # d_kv 32 != n_embd / n_head
    # the original T5's relu ffn (no ffn_gate), and fewer decoder blocks than encoder blocks
    "relu": SynthSpec(arch="t5", n_layer=3, n_dec_layer=2, n_head=4, n_head_kv=4, gated_ffn=False, seed=3),
}


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("t5")
    return {name: write_model(root / f"{name}.gguf", spec) for name, spec in MODELS.items()}


def _scenario(encode, decode, logits, clear, start: int) -> dict[str, np.ndarray]:
    """The same calls on either side: encode SRC_A, decode the decoder tokens in one batch, again
    one at a time; encode SRC_B (the cross input is replaced) and decode from the start again;
    encode SRC_A again and continue the decoder's cells. An encode's positions are checked against
    the decoder's cells (llama.cpp passes the context's memory), so the memory is cleared first, or
    the source continues the sequence's positions (the buckets read only their differences)."""
    dec = [start, *DEC]
    out = {}
    assert encode(SRC_A, 0) == 0
    assert decode(dec, 0, True) == 0
    out["batch"] = logits(len(dec))
    clear()
    rows = []
    for i, token in enumerate(dec):
        assert decode([token], i, True) == 0
        rows.append(logits(1)[0])
    out["one_at_a_time"] = np.stack(rows)
    clear()
    assert encode(SRC_B, 0) == 0
    assert decode(dec[:9], 0, True) == 0
    out["second_source"] = logits(9)
    assert encode(SRC_A, 9) == 0
    assert decode(dec[9:], 9, False) == 0
    out["continued"] = logits(1)
    return out


_ORACLE_RUNS: dict[tuple, dict[str, np.ndarray]] = {}


def _llama_cpp(path, flash_attn: bool) -> dict[str, np.ndarray]:
    key = (str(path), flash_attn)
    if key not in _ORACLE_RUNS:
        with LlamaCppOracle(path, n_ctx=N_CTX, flash_attn=flash_attn) as o:
            start = o.decoder_start_token()

            def decode(tokens, pos0, all_logits):
                return o.decode(tokens, pos0=pos0, logits="all" if all_logits else "last")

            def logits(n):
                return np.stack([o.logits_ith(-n + i) for i in range(n)])

            def encode(tokens, pos0):
                return o.encode_batch(tokens, range(pos0, pos0 + len(tokens)))

            _ORACLE_RUNS[key] = _scenario(encode, decode, logits, o.clear, start)
    return _ORACLE_RUNS[key]


def _llamir(path, backend: str, flash_attn: bool, **params) -> dict[str, np.ndarray]:
    model = llamir.load_model(path)
    ctx = llamir.Context(model, n_ctx=N_CTX, backend=backend, numerics=oracle_numerics(),
                         flash_attn="on" if flash_attn else "off", **params)

    def decode(tokens, pos0, all_logits):
        status = ctx.decode(llamir.Batch.from_tokens(tokens, pos0=pos0, logits="all" if all_logits else "last"))
        assert status == 0, ctx.last_error
        return status

    def logits(n):
        assert ctx.n_outputs == n
        return ctx.get_logits().copy()

    def encode(tokens, pos0):
        status = ctx.encode(llamir.Batch.from_tokens(tokens, pos0=pos0))
        assert status == 0, ctx.last_error
        return status

    return _scenario(encode, decode, logits, ctx.memory.clear, model.hparams.extra.dec_start_token_id)


@pytest.mark.llama_cpp
@pytest.mark.parametrize("flash_attn", [False, True], ids=["fa-off", "fa-on"])
@pytest.mark.parametrize("backend", ["numpy", "llvm"])
@pytest.mark.parametrize("name", list(MODELS))
def test_decoder_logits_match_llama_cpp(model_paths, nmse, name, backend, flash_attn):
    """Self-attention takes the position bias, so it never runs as flash attention (llama.cpp's
    neither); with flash attention on, the cross-attention does, on k/v cast to f16."""
    theirs = _llama_cpp(model_paths[name], flash_attn)
    ours = _llamir(model_paths[name], backend, flash_attn)
    for case, want in theirs.items():
        assert ours[case].shape == want.shape, case
        assert nmse(ours[case], want) == 0.0, case


@pytest.mark.llama_cpp
@pytest.mark.parametrize("backend", ["numpy", "llvm"])
def test_two_sequences_attend_to_their_own_source(model_paths, nmse, backend):
    """One encode of two sources (seq 0 and 1), one decode of both sequences' tokens: the cross
    mask lets each token see its own sequence's encoder tokens only."""
    path, start = model_paths["f32"], 0
    src_seqs = [(0,)] * len(SRC_A) + [(1,)] * len(SRC_B)
    src_pos = [*range(len(SRC_A)), *range(len(SRC_B))]
    dec = [start, *DEC[:5], start, *DEC[5:9]]
    dec_pos, dec_seqs = [*range(6), *range(5)], [(0,)] * 6 + [(1,)] * 5
    with LlamaCppOracle(path, n_ctx=N_CTX, n_seq_max=2, kv_unified=True) as o:
        assert o.encode_batch(SRC_A + SRC_B, src_pos, src_seqs) == 0
        assert o.decode_batch(dec, dec_pos, dec_seqs, [True] * len(dec)) == 0
        theirs = np.stack([o.logits_ith(i) for i in range(len(dec))])
    ctx = llamir.Context(llamir.load_model(path), n_ctx=N_CTX, n_seq_max=2, kv_unified=True, backend=backend,
                         numerics=oracle_numerics(), flash_attn="off")
    assert ctx.encode(llamir.Batch(tokens=SRC_A + SRC_B, pos=src_pos, seq_ids=src_seqs)) == 0, ctx.last_error
    batch = llamir.Batch(tokens=dec, pos=dec_pos, seq_ids=dec_seqs, logits=[True] * len(dec))
    assert ctx.decode(batch) == 0, ctx.last_error
    assert nmse(ctx.get_logits(), theirs) == 0.0


@pytest.mark.llama_cpp
def test_a_layer_with_its_own_bias_table_reads_it(tmp_path, monkeypatch, nmse):
    """synth writes layer 0's tables only (as HF's T5 has them); here every layer has its own,
    which llama.cpp reads instead of layer 0's."""
    block_specs = T5._block_specs

    def every_table(hp, t5, p, il, cross):
        return [replace(t, synth=True) if t.name.endswith(".attn_rel_b.weight") else t
                for t in block_specs(hp, t5, p, il, cross)]

    monkeypatch.setattr(T5, "_block_specs", staticmethod(every_table))
    path = write_model(tmp_path / "tables.gguf", SynthSpec(arch="t5", n_head=4, n_head_kv=4, seed=4))
    monkeypatch.undo()
    assert llamir.load_model(path).has_tensor("dec.blk.1.attn_rel_b.weight")
    theirs = _llama_cpp(path, False)
    ours = _llamir(path, "numpy", False)
    for case, want in theirs.items():
        assert nmse(ours[case], want) == 0.0, case


@pytest.mark.llama_cpp
def test_buckets_are_llama_cpps():
    """relative_position_bucket (every distance the context fills) against llama.cpp's own function,
    through the log branch's rounding-sensitive distances (16, 32, 64, 128: exact powers)."""
    rel = np.arange(-300, 301)
    for n_buckets in (4, 8, 32, 64, 128):
        for bidirectional in (True, False):
            ours = relative_position_bucket(rel, n_buckets, bidirectional)
            theirs = [llama_cpp_bucket(int(r), 0, n_buckets, bidirectional) for r in rel]
            assert ours.tolist() == theirs, (n_buckets, bidirectional)


@pytest.mark.llama_cpp
def test_hparams_are_llama_cpps(model_paths):
    for name, path in model_paths.items():
        model = llamir.load_model(path)
        hp = model.hparams
        with LlamaCppOracle(path, n_ctx=N_CTX) as o:
            assert o.has_encoder() and model.has_encoder
            assert hp.extra.dec_start_token_id == model.decoder_start_token() == o.decoder_start_token() == 0
        assert hp.extra.n_rel_attn_bkts == 32
        assert hp.extra.dec_n_layer == (MODELS[name].n_dec_layer or MODELS[name].n_layer)


def _encoded(path, backend="numpy"):
    ctx = llamir.Context(llamir.load_model(path), n_ctx=N_CTX, backend=backend, numerics=oracle_numerics(),
                         flash_attn="off")
    assert ctx.encode(llamir.Batch.from_tokens(SRC_A)) == 0, ctx.last_error
    return ctx


def test_decode_before_encode_is_refused_and_changes_nothing(model_paths):
    ctx = llamir.Context(llamir.load_model(model_paths["f32"]), n_ctx=N_CTX, backend="numpy")
    assert ctx.decode(llamir.Batch.from_tokens([0, *DEC[:3]])) == -1
    assert "call encode() before decode()" in ctx.last_error
    assert ctx.memory.seq_pos_max(0) == -1 and ctx.n_outputs == 0 and ctx.cross is None


@pytest.mark.llama_cpp
def test_the_encoder_output_survives_failed_calls(model_paths, nmse):
    """A refused decode, a refused encode and a failed compute keep the stored encoder output:
    the decode after them gives llama.cpp's logits for SRC_A."""
    ctx = _encoded(model_paths["f32"])
    cross = ctx.cross
    n_vocab = ctx.model.hparams.n_vocab
    assert ctx.decode(llamir.Batch.from_tokens([0, n_vocab])) == -1
    assert ctx.encode(llamir.Batch.from_tokens([5, n_vocab])) == -1
    real_run = ctx.runner.run

    def broken(*args, **kwargs):
        raise RuntimeError("injected compute failure")

    ctx.runner.run = broken
    assert ctx.encode(llamir.Batch.from_tokens(SRC_B)) == -3
    assert ctx.decode(llamir.Batch.from_tokens([0, *DEC[:3]])) == -3
    ctx.runner.run = real_run
    assert ctx.cross is cross and ctx.memory.seq_pos_max(0) == -1
    dec = [0, *DEC]
    assert ctx.decode(llamir.Batch.from_tokens(dec, logits="all")) == 0, ctx.last_error
    assert nmse(ctx.get_logits(), _llama_cpp(model_paths["f32"], False)["batch"]) == 0.0


@pytest.mark.llama_cpp
def test_an_encode_that_does_not_continue_the_decoders_cells_is_refused(model_paths):
    """llama.cpp checks an encode's positions against the context's memory: a source of sequence 0
    from position 0 while the decoder's cells hold sequence 0 up to 3 is an invalid batch."""
    path = model_paths["f32"]
    with LlamaCppOracle(path, n_ctx=N_CTX) as o:
        assert o.encode_batch(SRC_A) == 0 and o.decode([0, *DEC[:3]]) == 0
        assert o.encode_batch(SRC_B) == -1
    ctx = _encoded(path)
    cross = ctx.cross
    assert ctx.decode(llamir.Batch.from_tokens([0, *DEC[:3]])) == 0
    assert ctx.encode(llamir.Batch.from_tokens(SRC_B)) == -1 and ctx.cross is cross
    assert ctx.memory.seq_pos_max(0) == 3


def test_several_kv_streams_are_refused_clearly(model_paths):
    """The decoder's position buckets read one stream's cells (llama.cpp asserts n_stream == 1)."""
    ctx = llamir.Context(llamir.load_model(model_paths["f32"]), n_ctx=N_CTX, n_seq_max=2, kv_unified=False,
                         backend="numpy", flash_attn="off")
    assert ctx.encode(llamir.Batch.from_tokens(SRC_A)) == 0
    assert ctx.decode(llamir.Batch.from_tokens([0, 7])) == -3
    assert "use kv_unified=True or n_seq_max=1" in ctx.last_error


def _bad_file(tmp_path, monkeypatch, spec: SynthSpec, **keys) -> Path:
    """A synthetic t5 file with `keys` (u32 t5 keys: relative_buckets_count, decoder_block_count)
    written over synth's, and synth's own check skipped."""
    monkeypatch.setattr(T5, "synth_check", lambda self, spec: None)

    def metadata(self, w, spec):
        w.add_relative_attn_buckets_count(keys.get("relative_buckets_count", 32))
        w.add_decoder_start_token_id(0)
        if "decoder_block_count" in keys:
            w.add_decoder_block_count(keys["decoder_block_count"])

    monkeypatch.setattr(T5, "synth_metadata", metadata)
    if "relative_buckets_count" in keys:   # the tables' shapes follow the count
        extra = T5HParams(n_rel_attn_bkts=keys["relative_buckets_count"], dec_start_token_id=0, dec_n_layer=2)
        monkeypatch.setattr(T5, "synth_extra", lambda self, spec: extra)
    path = write_model(tmp_path / "bad.gguf", spec)
    monkeypatch.undo()
    return path


@pytest.mark.parametrize("n_head_kv,keys,message", [
    (2, {}, "head_count_kv == head_count"),
    (4, {"relative_buckets_count": 2}, "need 4 <= count < 256"),
    (4, {"relative_buckets_count": 256}, "need 4 <= count < 256"),
    (4, {"decoder_block_count": 3}, "so the decoder needs 1..2"),
])
def test_files_llama_cpp_would_abort_on_are_refused(tmp_path, monkeypatch, n_head_kv, keys, message):
    path = _bad_file(tmp_path, monkeypatch, SynthSpec(arch="t5", n_head=4, n_head_kv=n_head_kv), **keys)
    with pytest.raises(llamir.ModelError, match=message):
        llamir.load_model(path)


@pytest.mark.parametrize("n_gpu_layers", [1, 2, 99])
def test_split_over_a_device_gives_the_cpus_logits(model_paths, n_gpu_layers):
    """Some decoder layers (and the encoder's) on a simulated device: the same logits bit for bit
    (the encoder output and transposed activations cross between the splits)."""
    from llamir.frontend.placement import PlacementParams

    want = _llamir(model_paths["relu"], "llvm", False)
    got = _llamir(model_paths["relu"], "llvm", False, devices=["sim:gpu0"],
                  placement=PlacementParams(n_gpu_layers=n_gpu_layers))
    for case, rows in want.items():
        np.testing.assert_array_equal(got[case], rows, err_msg=case)

