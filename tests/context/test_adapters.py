"""LoRA adapters and control vectors against llama.cpp on the same random-weight files: the logits
with adapters applied (one, two with scales, in llama.cpp's adding order), a control vector over a
layer range, back to the base logits when they are removed, in every architecture where llama.cpp
applies them; graphs rebuilt only when the set changes; bad files refused as llama.cpp refuses
them, with nothing in the context changed."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

import llamir
from llamir.cli import main
from llamir.frontend.adapter import AdapterError, load_control_vectors
from llamir.frontend.synth import SynthSpec, write_control_vector, write_gguf, write_lora, write_model
from llamir.testing.llama_cpp import LlamaCppOracle, oracle_numerics

TOKENS = [5, 6, 7, 8, 9, 10, 11]
N_CTX, N_BATCH = 256, 64
MODELS = {
    "llama-f32": SynthSpec(arch="llama", n_layer=3, seed=1),
    "llama-q8_0": SynthSpec(arch="llama", n_layer=3, seed=2, dtype="q8_0"),
    "llama-moe-f32": SynthSpec(arch="llama", n_expert=4, n_expert_used=2, seed=7),     # mul_mat_id
    "qwen2moe-q8_0": SynthSpec(arch="qwen2moe", n_ff_exp=64, n_ff_shexp=96, seed=7, dtype="q8_0"),
}
# the second adapter of each model: a larger rank, alpha != rank, the output, the embedding rows
# (llama), the router and the shared expert's gate row (the MoE models)
SECOND = {"llama-f32": ("attn_q", "ffn_down", "output", "token_embd"),
          "llama-q8_0": ("attn_q", "ffn_down", "output", "token_embd"),
          "llama-moe-f32": ("ffn_gate_inp", "ffn_up_exps", "ffn_down_exps", "attn_v"),
          "qwen2moe-q8_0": ("ffn_gate_inp_shexp", "ffn_up_exps", "ffn_down_shexp", "attn_output")}
pytestmark = pytest.mark.llama_cpp


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """name -> (model, first LoRA, second LoRA, control vector) paths, written once."""
    root, out = tmp_path_factory.mktemp("adapters"), {}

    def get(name: str):
        if name not in out:
            model = write_model(root / f"{name}.gguf", MODELS[name])
            out[name] = (model, write_lora(root / f"{name}-a.gguf", model, rank=8, seed=1),
                         write_lora(root / f"{name}-b.gguf", model, rank=16, alpha=4, seed=2, targets=SECOND[name]),
                         write_control_vector(root / f"{name}-cv.gguf", model, seed=3))
        return out[name]

    return get


def _context(model, backend: str = "numpy", **params) -> llamir.Context:
    return llamir.Context(model, n_ctx=N_CTX, n_batch=N_BATCH, flash_attn="off", backend=backend,
                          numerics=oracle_numerics(), **params)


def _logits(ctx: llamir.Context, tokens=TOKENS) -> np.ndarray:
    ctx.memory.clear()
    assert ctx.decode(llamir.Batch.from_tokens(tokens, logits="all")) == 0, ctx.last_error
    return ctx.get_logits().copy()


def _oracle(path) -> LlamaCppOracle:
    return LlamaCppOracle(path, n_ctx=N_CTX, n_batch=N_BATCH)


# -- LoRA -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["numpy", "llvm"])
@pytest.mark.parametrize("name", list(MODELS))
def test_lora_logits_match_llama_cpp_and_removing_them_gives_the_base_again(files, nmse, name, backend):
    model_path, first, second, _ = files(name)
    with _oracle(model_path) as o:
        base = o.eval_logits(TOKENS)
        a, b = o.lora_init(first), o.lora_init(second)
        o.set_adapters_lora([a], [0.8])
        one = o.eval_logits(TOKENS)
        o.set_adapters_lora([a, b], [0.8, 1.5])
        two = o.eval_logits(TOKENS)
    model = llamir.load_model(model_path)
    ctx = _context(model, backend)
    assert nmse(_logits(ctx), base) == 0.0
    adapter_a, adapter_b = llamir.load_adapter_lora(model, first), llamir.load_adapter_lora(model, second)
    assert ctx.set_adapters_lora([adapter_a], [0.8]) == 0
    assert nmse(_logits(ctx), one) == 0.0
    ctx.set_adapters_lora([adapter_a, adapter_b], [0.8, 1.5])
    assert nmse(_logits(ctx), two) == 0.0
    ctx.set_adapters_lora([adapter_a, adapter_b], [0.0, 0.0])   # a zero scale leaves an adapter out
    assert nmse(_logits(ctx), base) == 0.0
    ctx.set_adapters_lora([adapter_b], [1.5])
    ctx.set_adapters_lora([], [])
    assert nmse(_logits(ctx), base) == 0.0
    assert nmse(one, base) > 1e-3 and nmse(two, one) > 1e-4    # each adapter changes the logits


def test_two_adapters_are_added_in_llama_cpps_order(files):
    """llama.cpp's adapter map lists two adapters in the reverse of their insertion; the sums differ
    by rounding between the two orders, and each matches llama.cpp's bit for bit."""
    model_path, first, second, _ = files("llama-f32")
    model = llamir.load_model(model_path)
    ours = {name: llamir.load_adapter_lora(model, path) for name, path in (("a", first), ("b", second))}
    ctx = _context(model)
    got = {}
    with _oracle(model_path) as o:
        theirs = {"a": o.lora_init(first), "b": o.lora_init(second)}
        for order in (("a", "b"), ("b", "a")):
            scales = [{"a": 3.0, "b": 2.1}[n] for n in order]
            o.set_adapters_lora([], [])   # (the same set in another order is no change)
            o.set_adapters_lora([theirs[n] for n in order], scales)
            want = o.eval_logits(TOKENS)
            ctx.set_adapters_lora([], [])
            ctx.set_adapters_lora([ours[n] for n in order], scales)
            got[order] = _logits(ctx)
            assert np.array_equal(got[order], want), order
    assert not np.array_equal(got["a", "b"], got["b", "a"]), "the two orders should round differently"


def test_graphs_are_rebuilt_only_when_the_set_or_scales_change(files):
    """One token at a time: each decode reuses the graph until the adapters change; the same set
    again changes nothing; clearing them finds the base graph that was compiled first."""
    model_path, first, second, _ = files("llama-f32")
    model = llamir.load_model(model_path)
    adapter = llamir.load_adapter_lora(model, first)
    ctx = _context(model)
    base_graph = ctx.compiled_graph(ctx.graph_config(True))

    def step(pos: int) -> int:
        before = ctx.perf()["n_reused"]
        assert ctx.decode(llamir.Batch.from_tokens([5 + pos], pos0=pos)) == 0, ctx.last_error
        return ctx.perf()["n_reused"] - before

    assert [step(0), step(1)] == [0, 1]
    ctx.set_adapters_lora([adapter], [0.5])
    assert [step(2), step(3)] == [0, 1]
    ctx.set_adapters_lora([adapter], [0.5])   # the same set: the graph stands
    assert step(4) == 1
    ctx.set_adapters_lora([adapter], [0.25])  # another scale: another graph
    assert [step(5), step(6)] == [0, 1]
    assert len([c for c in ctx.runner.graphs if c.adapters]) == 1   # the old scale's graph is dropped
    ctx.set_adapters_lora([], [])
    assert step(7) == 0
    assert ctx.compiled_graph(ctx.graph_config(True)) is base_graph


def test_adapters_on_a_simulated_device_give_the_cpus_logits(files):
    """Each pair is placed with its base weight's layer (the control vector too); new control vector
    data reaches the device copy."""
    from llamir.frontend.placement import PlacementParams

    model_path, first, _, cvec_path = files("llama-moe-f32")
    model = llamir.load_model(model_path)
    adapter = llamir.load_adapter_lora(model, first)
    n_embd, data = load_control_vectors([(cvec_path, 1.0)])
    got = {}
    for where, kw in (("cpu", {}), ("gpu", dict(devices=["sim:gpu0"], placement=PlacementParams(n_gpu_layers=2)))):
        ctx = _context(model, **kw)
        ctx.set_adapters_lora([adapter], [0.8])
        got[where] = [_logits(ctx)]
        for scale in (1.0, -2.0):
            ctx.set_adapter_cvec(data * scale, n_embd, 1, 2)
            got[where].append(_logits(ctx))
    assert all(np.array_equal(a, b) for a, b in zip(got["cpu"], got["gpu"], strict=True))
    placed = ctx.compiled_graph(ctx.graph_config(True)).placement.weights
    assert placed[f"{adapter.tag}.blk.1.ffn_up_exps.weight.lora_a"].device == "gpu0" == placed["cvec.1"].device
    assert placed[f"{adapter.tag}.blk.0.ffn_up_exps.weight.lora_a"].device == "cpu"


# -- control vectors ---------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["numpy", "llvm"])
def test_control_vector_over_a_layer_range_matches_llama_cpp(files, nmse, backend):
    model_path, _, _, cvec_path = files("llama-f32")
    n_embd, data = load_control_vectors([(cvec_path, 0.8)])
    short = -data[:n_embd]   # layer 1 only: layer 2 keeps the vector it had, as in llama.cpp
    with _oracle(model_path) as o:
        base = o.eval_logits(TOKENS)
        want = {}
        for key, values, il_start, il_end in (("2", data, 2, 2), ("1-3", data, 1, 3), ("short", short, 1, 2)):
            assert o.set_adapter_cvec(values, n_embd, il_start, il_end) == 0
            want[key] = o.eval_logits(TOKENS)
        o.set_adapter_cvec(None)
        want["off"] = o.eval_logits(TOKENS)
    ctx = _context(llamir.load_model(model_path), backend)
    for key, values, il_start, il_end in (("2", data, 2, 2), ("1-3", data, 1, 3), ("short", short, 1, 2)):
        assert ctx.set_adapter_cvec(values, n_embd, il_start, il_end) == 0
        assert nmse(_logits(ctx), want[key]) == 0.0, key
    ctx.set_adapter_cvec(None)
    assert nmse(_logits(ctx), base) == 0.0
    assert nmse(want["off"], base) == 0.0 and nmse(want["2"], base) > 1e-3 and nmse(want["1-3"], want["2"]) > 1e-3


def test_control_vector_files_are_summed_with_their_strengths(tmp_path):
    """common_control_vector_load: each file's directions times its strength, summed per layer; a
    layer a file lacks is zeros."""
    one = write_control_vector(tmp_path / "one.gguf", directions={1: np.ones(4), 3: np.full(4, 2.0)})
    two = write_control_vector(tmp_path / "two.gguf", directions={2: np.arange(4.0)})
    n_embd, data = load_control_vectors([(one, 0.5), (two, -1.0)])
    assert n_embd == 4
    np.testing.assert_array_equal(data, [0.5] * 4 + [-0.0, -1, -2, -3] + [1.0] * 4)


@pytest.mark.parametrize("directions,message", [
    ({0: np.ones(4)}, "invalid \\(zero\\) direction tensor layer index"),
    ({1: np.ones(4), 2: np.ones(6)}, "does not match previous dimensions"),
    ({}, "no direction tensors found"),
])
def test_bad_control_vector_files_are_refused(tmp_path, directions, message):
    path = write_control_vector(tmp_path / "bad.gguf", directions=directions)
    with pytest.raises(AdapterError, match=message):
        load_control_vectors([(path, 1.0)])


def test_a_control_vector_of_another_width_changes_nothing(files, nmse):
    model_path, _, _, cvec_path = files("llama-f32")
    n_embd, data = load_control_vectors([(cvec_path, 1.0)])
    ctx = _context(llamir.load_model(model_path))
    ctx.set_adapter_cvec(data, n_embd, 1, 3)
    before = _logits(ctx)
    with _oracle(model_path) as o:
        assert o.set_adapter_cvec(data[:-2], n_embd - 2, 1, 3) == -1    # llama.cpp refuses it too
    with pytest.raises(AdapterError, match="control vector n_embd does not match model: 62, the model's is 64"):
        ctx.set_adapter_cvec(data[:-2], n_embd - 2, 1, 3)
    assert nmse(_logits(ctx), before) == 0.0


# -- every architecture applies them where llama.cpp does -------------------------------------------
ARCH_SPECS = {
    "qwen2": SynthSpec(arch="qwen2", seed=3), "qwen3": SynthSpec(arch="qwen3", seed=3),
    "qwen3moe": SynthSpec(arch="qwen3moe", seed=3), "gemma2": SynthSpec(arch="gemma2", seed=3),
    "gemma3": SynthSpec(arch="gemma3", seed=3), "phi3": SynthSpec(arch="phi3", seed=3),
    "stablelm": SynthSpec(arch="stablelm", seed=3, partial_rotary=0.25),
    "starcoder2": SynthSpec(arch="starcoder2", seed=3), "gpt2": SynthSpec(arch="gpt2", seed=3),
    "mamba": SynthSpec(arch="mamba", seed=3), "jamba": SynthSpec(arch="jamba", n_layer=4, seed=3),
}
EXTRA_TARGETS = {"mamba": ("ssm_in", "ssm_x", "ssm_dt", "ssm_out", "output"),
                 "jamba": ("ssm_in", "ssm_x", "ssm_dt", "ssm_out", "attn_q", "ffn_down", "output")}


@pytest.mark.parametrize("arch", list(ARCH_SPECS))
def test_every_architecture_applies_lora_and_control_vectors_as_llama_cpp(tmp_path, nmse, arch):
    spec = ARCH_SPECS[arch]
    model_path = write_model(tmp_path / "m.gguf", spec)
    lora = write_lora(tmp_path / "l.gguf", model_path, seed=1, targets=EXTRA_TARGETS.get(arch))
    n_embd, data = load_control_vectors([(write_control_vector(tmp_path / "cv.gguf", model_path, seed=3), 1.0)])
    with _oracle(model_path) as o:
        o.set_adapters_lora([o.lora_init(lora)], [0.8])
        want_lora = o.eval_logits(TOKENS)
        o.set_adapters_lora([], [])
        o.set_adapter_cvec(data, n_embd, 1, spec.n_layer)
        want_cvec = o.eval_logits(TOKENS)
    model = llamir.load_model(model_path)
    ctx = _context(model)
    ctx.set_adapters_lora([llamir.load_adapter_lora(model, lora)], [0.8])
    assert nmse(_logits(ctx), want_lora) == 0.0
    ctx.set_adapters_lora([], [])
    ctx.set_adapter_cvec(data, n_embd, 1, spec.n_layer)
    assert nmse(_logits(ctx), want_cvec) == 0.0


def test_t5_applies_them_in_the_encoder_and_decoder(tmp_path, nmse):
    """Self and cross attention projections, the ffn, the output and the embedding rows; the control
    vector after each encoder and decoder block."""
    model_path = write_model(tmp_path / "t5.gguf", SynthSpec(arch="t5", n_head_kv=4, seed=3))
    lora = write_lora(tmp_path / "l.gguf", model_path, seed=1, targets=(
        "attn_q", "attn_k", "attn_v", "attn_o", "cross_attn_q", "cross_attn_k", "cross_attn_v", "cross_attn_o",
        "ffn_up", "ffn_gate", "ffn_down", "output", "token_embd"))
    n_embd, data = load_control_vectors([(write_control_vector(tmp_path / "cv.gguf", model_path, seed=3), 1.0)])
    model = llamir.load_model(model_path)
    src, dec = [5, 6, 7, 8, 9], [model.hparams.extra.dec_start_token_id, 11, 12, 13]

    def theirs(o):
        o.clear()
        assert o.encode_batch(src) == 0
        assert o.decode_batch(dec, list(range(len(dec))), [(0,)] * len(dec), [True] * len(dec)) == 0
        return np.stack([o.logits_ith(i) for i in range(len(dec))])

    def ours(ctx):
        ctx.memory.clear()
        assert ctx.encode(llamir.Batch.from_tokens(src)) == 0, ctx.last_error
        assert ctx.decode(llamir.Batch.from_tokens(dec, logits="all")) == 0, ctx.last_error
        return ctx.get_logits().copy()

    with _oracle(model_path) as o:
        o.set_adapters_lora([o.lora_init(lora)], [0.8])
        want_lora = theirs(o)
        o.set_adapters_lora([], [])
        o.set_adapter_cvec(data, n_embd, 1, 2)
        want_cvec = theirs(o)
    ctx = _context(model)
    ctx.set_adapters_lora([llamir.load_adapter_lora(model, lora)], [0.8])
    assert nmse(ours(ctx), want_lora) == 0.0
    ctx.set_adapters_lora([], [])
    ctx.set_adapter_cvec(data, n_embd, 1, 2)
    assert nmse(ours(ctx), want_cvec) == 0.0


def test_bert_takes_lora_but_no_control_vector(tmp_path, nmse):
    """bert's graph calls build_lora_mm but not build_cvec: a control vector changes nothing."""
    model_path = write_model(tmp_path / "bert.gguf", SynthSpec(arch="bert", seed=3))
    lora = write_lora(tmp_path / "l.gguf", model_path, seed=1)
    n_embd, data = load_control_vectors([(write_control_vector(tmp_path / "cv.gguf", model_path, seed=3), 1.0)])
    with LlamaCppOracle(model_path, n_ctx=N_CTX, embeddings=True, pooling="mean") as o:
        assert o.decode_batch(TOKENS, list(range(len(TOKENS))), [(0,)] * len(TOKENS), [True] * len(TOKENS)) == 0
        base = o.embeddings_seq(0)
        o.set_adapters_lora([o.lora_init(lora)], [0.8])
        assert o.decode_batch(TOKENS, list(range(len(TOKENS))), [(0,)] * len(TOKENS), [True] * len(TOKENS)) == 0
        want = o.embeddings_seq(0)
    model = llamir.load_model(model_path)
    ctx = _context(model, embeddings=True, pooling_type="mean")

    def ours():
        assert ctx.encode(llamir.Batch.from_tokens(TOKENS)) == 0, ctx.last_error
        return ctx.get_embeddings_seq(0).copy()

    ctx.set_adapter_cvec(data, n_embd, 1, 2)
    assert nmse(ours(), base) == 0.0
    ctx.set_adapters_lora([llamir.load_adapter_lora(model, lora)], [0.8])
    assert nmse(ours(), want) == 0.0 and nmse(want, base) > 1e-4


# -- what a LoRA file says about itself --------------------------------------------------------------
def test_metadata_and_alora_tokens_read_as_llama_cpp_reads_them(files, tmp_path):
    model_path = files("llama-f32")[0]
    path = _adapter_file(tmp_path / "alora.gguf", model_path, extra=lambda w: (
        w.add_string("adapter.lora.task_name", "summarize"),
        w.add_key_value("adapter.alora.invocation_tokens", [7, 8, 9], gguf.GGUFValueType.ARRAY,
                        gguf.GGUFValueType.UINT32)))
    adapter = llamir.load_adapter_lora(llamir.load_model(model_path), path)
    with _oracle(model_path) as o:
        handle = o.lora_init(path)
        for key in ("adapter.lora.alpha", "adapter.lora.task_name", "general.type", "general.architecture", "nope"):
            assert adapter.meta_val_str(key) == o.adapter_meta_val_str(handle, key), key
        assert list(adapter.alora_invocation_tokens) == o.alora_invocation_tokens(handle) == [7, 8, 9]
    assert adapter.alpha == 16.0 and adapter.weights["blk.0.attn_q.weight"].rank == 8


# -- bad files and calls -----------------------------------------------------------------------------
def _adapter_file(path, model_path, *, arch="llama", general_type="adapter", adapter_type="lora", alpha=16.0,
                  tensors=None, extra=None):
    """A LoRA GGUF written by hand: `tensors` {name: f32 array} (default: a good attn_q pair of rank 8)."""
    model = llamir.load_model(model_path)
    n_out, n_in = model.tensor("blk.0.attn_q.weight").shape
    rng = np.random.default_rng(0)
    if tensors is None:
        tensors = {"blk.0.attn_q.weight.lora_a": rng.standard_normal((8, n_in)),
                   "blk.0.attn_q.weight.lora_b": rng.standard_normal((n_out, 8))}

    def fill(w: gguf.GGUFWriter) -> None:
        if general_type is not None:
            w.add_type(general_type)
        if adapter_type is not None:
            w.add_string("adapter.type", adapter_type)
        if alpha is not None:
            w.add_float32("adapter.lora.alpha", alpha)
        if extra is not None:
            extra(w)
        for name, values in tensors.items():
            w.add_tensor(name, np.asarray(values, dtype=np.float32))

    return write_gguf(path, arch, fill)


BAD_FILES = {
    "not an adapter": (dict(general_type="model"), "expect general.type to be 'adapter', but got: 'model'"),
    "no general.type": (dict(general_type=None), "expect general.type to be 'adapter', but got: ''"),
    "wrong arch": (dict(arch="qwen2"), "model arch and LoRA arch mismatch: the model is 'llama', the adapter 'qwen2'"),
    "not lora": (dict(adapter_type="control_vector"), "expect adapter.type to be 'lora', but got: 'control_vector'"),
    "missing b": (dict(tensors={"blk.0.attn_q.weight.lora_a": np.ones((8, 64))}),
                  "LoRA tensor pair for 'blk.0.attn_q.weight' is missing one component: blk.0.attn_q.weight.lora_b"),
    "missing a": (dict(tensors={"blk.1.ffn_up.weight.lora_b": np.ones((128, 8))}),
                  "pair for 'blk.1.ffn_up.weight' is missing one component: blk.1.ffn_up.weight.lora_a"),
    "wrong shape": (dict(tensors={"blk.0.attn_k.weight.lora_a": np.ones((8, 64)),
                                  "blk.0.attn_k.weight.lora_b": np.ones((64, 8))}),
                    "tensor 'blk.0.attn_k.weight' has incorrect shape .*the base is \\[32, 64\\], so lora_a must be "
                    "\\[rank, 64\\] and lora_b \\[32, rank\\]"),
    "not transposed": (dict(tensors={"blk.0.attn_q.weight.lora_a": np.ones((8, 64)),
                                     "blk.0.attn_q.weight.lora_b": np.ones((64, 4))}),
                       "'blk.0.attn_q.weight': lora_a tensor is not transposed"),
    "not in the model": (dict(tensors={"blk.9.attn_q.weight.lora_a": np.ones((8, 64)),
                                       "blk.9.attn_q.weight.lora_b": np.ones((64, 8))}),
                         "LoRA tensor 'blk.9.attn_q.weight' does not exist in base model"),
    "unexpected suffix": (dict(tensors={"blk.0.attn_q.weight.lora_c": np.ones((8, 64))}),
                          "LoRA tensor 'blk.0.attn_q.weight.lora_c' has unexpected suffix"),
    "alora tokens not an array": (dict(extra=lambda w: w.add_uint32("adapter.alora.invocation_tokens", 3)),
                                  "invalid gguf type for adapter.alora.invocation_tokens"),
    "alora tokens not u32": (dict(extra=lambda w: w.add_array("adapter.alora.invocation_tokens", [1, 2])),
                             "invalid gguf element type for adapter.alora.invocation_tokens"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_lora_files_are_refused_as_llama_cpp_refuses_them(files, tmp_path, nmse, case):
    model_path, good, _, _ = files("llama-f32")
    options, message = BAD_FILES[case]
    path = _adapter_file(tmp_path / "bad.gguf", model_path, **options)
    with _oracle(model_path) as o, pytest.raises(RuntimeError, match="refused"):
        o.lora_init(path)
    model = llamir.load_model(model_path)
    ctx = _context(model)
    ctx.set_adapters_lora([llamir.load_adapter_lora(model, good)], [0.5])
    before = _logits(ctx)
    with pytest.raises(AdapterError, match=message):
        llamir.load_adapter_lora(model, path)
    assert nmse(_logits(ctx), before) == 0.0


def test_a_file_that_is_not_gguf_is_refused(files, tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(AdapterError, match="failed to load lora adapter from file: .*bad magic"):
        llamir.load_adapter_lora(llamir.load_model(files("llama-f32")[0]), path)


def test_set_adapters_lora_refuses_a_bad_list_and_keeps_the_set(files, nmse):
    model_path, good, _, _ = files("llama-f32")
    model, other = llamir.load_model(model_path), llamir.load_model(model_path)
    adapter = llamir.load_adapter_lora(model, good)
    ctx = _context(model)
    ctx.set_adapters_lora([adapter], [0.5])
    before = _logits(ctx)
    with pytest.raises(AdapterError, match="1 adapters but 2 scales"):
        ctx.set_adapters_lora([adapter], [0.5, 1.0])
    with pytest.raises(AdapterError, match="was loaded for another model"):
        ctx.set_adapters_lora([llamir.load_adapter_lora(other, good)], [1.0])
    with pytest.raises(AdapterError, match="adapters\\[0\\] is a str"):
        ctx.set_adapters_lora([str(good)], [1.0])
    assert nmse(_logits(ctx), before) == 0.0


def test_an_embedding_pair_on_a_tied_output_is_a_clear_decode_error(tmp_path):
    """A tied output reads token_embd.weight, whose LoRA pair is laid out for row lookups: llama.cpp
    aborts inside ggml; llamir's decode fails with a reason."""
    model_path = write_model(tmp_path / "tied.gguf", SynthSpec(arch="llama", tied=True, seed=4))
    lora = write_lora(tmp_path / "l.gguf", model_path, targets=("token_embd",))
    model = llamir.load_model(model_path)
    ctx = _context(model)
    ctx.set_adapters_lora([llamir.load_adapter_lora(model, lora)], [1.0])
    assert ctx.decode(llamir.Batch.from_tokens(TOKENS)) == -3
    assert "cannot adapt the tied output projection" in ctx.last_error


def test_write_lora_refuses_a_target_the_model_lacks(files, tmp_path):
    with pytest.raises(ValueError, match="LoRA target 'attn_qkv' matches no tensor of the llama model"):
        write_lora(tmp_path / "x.gguf", MODELS["llama-f32"], targets=("attn_qkv",))


# -- the command line --------------------------------------------------------------------------------
def test_cli_lora_and_control_vector_flags_give_llama_cpps_logits(files, tmp_path, nmse, capsys):
    """--lora FNAME[:SCALE] and --lora-scaled FNAME:SCALE in command-line order, a scaled control
    vector over --control-vector-layer-range."""
    model_path, first, second, cvec = files("llama-f32")
    out = tmp_path / "logits.npy"
    argv = ["logits", str(model_path), "--tokens", ",".join(map(str, TOKENS)), "--out", str(out),
            "--backend", "numpy", "--numerics", str(oracle_numerics()), "--n-ctx", str(N_CTX), "--n-batch",
            str(N_BATCH), f"--lora={first}:0.5", "--lora-scaled", f"{second}:2", "--control-vector-scaled",
            f"{cvec}:0.7", "--control-vector-layer-range", "2", "3"]
    assert main(argv) == 0
    n_embd, data = load_control_vectors([(cvec, 0.7)])
    with _oracle(model_path) as o:
        o.set_adapters_lora([o.lora_init(first), o.lora_init(second)], [0.5, 2.0])
        o.set_adapter_cvec(data, n_embd, 2, 3)
        want = o.eval_logits(TOKENS)
    assert nmse(np.load(out), want) == 0.0
    with pytest.raises(SystemExit):   # argparse: --lora-scaled needs FNAME:SCALE
        main(argv[:14] + ["--lora-scaled", str(first)])
    assert main(argv[:14] + ["--lora", str(cvec)]) == 1
    assert "expect general.type to be 'adapter'" in capsys.readouterr().err
