"""Hadamard-rotated quantized KV caches against llama.cpp 0.3.36 on the same files.

llama.cpp rotates q/k (attn_rot_k: quantized K, head size a multiple of 64) and v plus the
attention output (attn_rot_v: the same for V) with a Walsh-Hadamard matrix, unless
LLAMA_ATTN_ROT_DISABLE is set when the context is made. llamir runs the oracle build's numerics
profile here, so every comparison is bit for bit: logits of a prompt fed in one batch and one
token at a time, llama and gemma3 (iSWA), flash attention on, and off where llama.cpp allows a
quantized K without it; a K-shift over a rotated K; and the rotated cache's state bytes.
"""

from __future__ import annotations

import numpy as np
import pytest

import llamir
from llamir.backends.llvm import LLVMBackend
from llamir.frontend.synth import SynthSpec, write_model
from llamir.testing.llama_cpp import LlamaCppOracle, nmse, oracle_numerics

pytestmark = pytest.mark.llama_cpp

PROMPT = [int(t) for t in np.random.RandomState(11).randint(3, 500, size=24)]
N_CTX, N_BATCH = 256, 64

# head sizes 64 and 128 (K rotated by 64 / 128, V by 64); 256 rotates K by 256 and V by 64;
# gemma3: layers 0 and 2 use an 8-token window (their own cache), layer 1 is global
MODELS = {
    "llama-hd64": SynthSpec(arch="llama", n_embd=128, n_head=2, n_head_kv=1, n_ff=256, seed=3),
    "llama-hd128": SynthSpec(arch="llama", n_embd=256, n_head=2, n_head_kv=1, n_ff=256, dtype="q8_0", seed=4),
    "llama-hd256": SynthSpec(arch="llama", n_embd=256, n_head=1, n_head_kv=1, n_ff=256, seed=5),
    "gemma3-hd64": SynthSpec(arch="gemma3", n_layer=3, n_embd=128, n_head=2, n_head_kv=1, n_ff=256,
                             sliding_window=8, swa_pattern=2, seed=6),
    "gemma3-hd128": SynthSpec(arch="gemma3", n_layer=3, n_embd=256, n_head=2, n_head_kv=2, n_ff=256,
                              sliding_window=8, swa_pattern=2, seed=7),
}
# (type_k, type_v, flash attention): a quantized V needs flash attention, a quantized K does not
KV_TYPES = {
    "q8_0": ("q8_0", "q8_0", True),
    "q4_0": ("q4_0", "q4_0", True),
    "f16-k-q8_0-v": ("f16", "q8_0", True),
    "q8_0-k-no-fa": ("q8_0", "f16", False),
    "q4_0-k-no-fa": ("q4_0", "f16", False),
}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv_rotation")

    def path(name: str):
        p = root / f"{name}.gguf"
        if not p.exists():
            write_model(p, MODELS[name])
        return p

    return path


@pytest.fixture(scope="module")
def llvm():
    backend = LLVMBackend(n_threads=2, disk_cache=False, numerics=oracle_numerics())
    yield backend
    backend.close()


def llamir_context(path, backend, type_k: str, type_v: str, flash_attn: bool, **params) -> llamir.Context:
    return llamir.Context(llamir.load_model(path), backend=backend, numerics=oracle_numerics(), n_ctx=N_CTX,
                          n_batch=N_BATCH, n_ubatch=N_BATCH, type_k=type_k, type_v=type_v,
                          flash_attn="on" if flash_attn else "off", **params)


def oracle(path, type_k: str, type_v: str, flash_attn: bool) -> LlamaCppOracle:
    return LlamaCppOracle(path, n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_BATCH, type_k=type_k, type_v=type_v,
                          flash_attn=flash_attn)


def feed(ctx: llamir.Context, mode: str, prompt=PROMPT) -> np.ndarray:
    if mode == "batch":
        assert ctx.decode(llamir.Batch.from_tokens(prompt, logits="all")) == 0, ctx.last_error
        return ctx.get_logits().copy()
    rows = []
    for i, token in enumerate(prompt):
        assert ctx.decode(llamir.Batch.from_tokens([token], pos0=i, logits="all")) == 0, ctx.last_error
        rows.append(ctx.get_logits_ith(-1).copy())
    return np.stack(rows)


def rotation(ctx: llamir.Context) -> list[tuple[int, int]]:
    """(rot_k, rot_v) of each cache of a context that has layers in it."""
    caches = ctx.memory.caches
    return [(c.layout.rot_k, c.layout.rot_v) for c in caches if c.layout.layers]


def expected_rotation(name: str, type_k: str, type_v: str) -> tuple[int, int]:
    head = MODELS[name].n_embd_head
    rot_k = head & -head if type_k != "f16" else 0       # the largest power of 2 dividing the head
    return rot_k, 64 if type_v != "f16" else 0


def assert_exact(got: np.ndarray, want: np.ndarray, what: str) -> None:
    rows = np.flatnonzero(np.any(got != want, axis=-1))
    assert rows.size == 0, f"{what}: NMSE {nmse(got, want):.3g}, rows that differ: {rows[:8].tolist()}"


@pytest.mark.parametrize("kv", KV_TYPES)
@pytest.mark.parametrize("name", ["llama-hd64", "llama-hd128", "gemma3-hd64", "gemma3-hd128"])
def test_rotated_cache_matches_llama_cpp(model_path, name, kv):
    """Both feeding modes on the numpy reference, logits bit for bit with llama.cpp's."""
    type_k, type_v, flash_attn = KV_TYPES[kv]
    path = model_path(name)
    with oracle(path, type_k, type_v, flash_attn) as o:
        want = {mode: o.eval_logits(PROMPT, mode) for mode in ("batch", "incremental")}
    for mode in ("batch", "incremental"):
        ctx = llamir_context(path, "numpy", type_k, type_v, flash_attn)
        assert set(rotation(ctx)) == {expected_rotation(name, type_k, type_v)}
        assert_exact(feed(ctx, mode), want[mode], f"{name} {kv} {mode}")


def test_head_256_rotates_k_by_256_and_v_by_64(model_path):
    path = model_path("llama-hd256")
    with oracle(path, "q8_0", "q8_0", True) as o:
        want = o.eval_logits(PROMPT, "batch")
    ctx = llamir_context(path, "numpy", "q8_0", "q8_0", True)
    assert rotation(ctx) == [(256, 64)]
    assert_exact(feed(ctx, "batch"), want, "head 256")


@pytest.mark.parametrize("kv", ["q4_0", "q8_0-k-no-fa"])
@pytest.mark.parametrize("name", ["llama-hd128", "gemma3-hd64"])
def test_rotated_cache_on_llvm_matches_llama_cpp(model_path, llvm, name, kv):
    type_k, type_v, flash_attn = KV_TYPES[kv]
    path = model_path(name)
    with oracle(path, type_k, type_v, flash_attn) as o:
        want = {mode: o.eval_logits(PROMPT, mode) for mode in ("batch", "incremental")}
    for mode in ("batch", "incremental"):
        ctx = llamir_context(path, llvm, type_k, type_v, flash_attn)
        assert_exact(feed(ctx, mode), want[mode], f"llvm {name} {kv} {mode}")


@pytest.mark.parametrize("value, rotated", [("1", False), ("0", True), (" 2", False), ("yes", True)])
def test_llama_attn_rot_disable_turns_rotation_off_in_both_engines(model_path, monkeypatch, value, rotated):
    """llama.cpp reads LLAMA_ATTN_ROT_DISABLE with atoi when its KV cache is made: "1" and " 2"
    turn the rotation off, "0" and "yes" (atoi 0) leave it on. Both engines then agree bit for
    bit, and llama.cpp's logits differ from its rotated ones exactly when it is off."""
    path = model_path("gemma3-hd64")
    monkeypatch.delenv("LLAMA_ATTN_ROT_DISABLE", raising=False)
    with oracle(path, "q8_0", "q8_0", True) as o:
        rotated_logits = o.eval_logits(PROMPT, "batch")
    monkeypatch.setenv("LLAMA_ATTN_ROT_DISABLE", value)
    with oracle(path, "q8_0", "q8_0", True) as o:
        want = o.eval_logits(PROMPT, "batch")
    ctx = llamir_context(path, "numpy", "q8_0", "q8_0", True)
    assert set(rotation(ctx)) == {(64, 64) if rotated else (0, 0)}
    assert ctx.cparams.attn_rot == rotated
    assert_exact(feed(ctx, "batch"), want, f"LLAMA_ATTN_ROT_DISABLE={value!r}")
    assert np.array_equal(want, rotated_logits) == rotated


@pytest.mark.parametrize("backend", ["numpy", "llvm"])
@pytest.mark.parametrize("name, kv", [("llama-hd64", "q8_0"), ("llama-hd128", "q4_0-k-no-fa"),
                                      ("gemma3-hd128", "q8_0")])
def test_k_shift_of_a_rotated_k_matches_llama_cpp(model_path, llvm, backend, name, kv):
    """seq_rm + seq_add (a context shift): the rotated K is dequantized, rotated back, re-roped,
    rotated forward and quantized again; the next decodes agree with llama.cpp bit for bit."""
    type_k, type_v, flash_attn = KV_TYPES[kv]
    path = model_path(name)
    ctx = llamir_context(path, llvm if backend == "llvm" else "numpy", type_k, type_v, flash_attn)
    with oracle(path, type_k, type_v, flash_attn) as o:
        for engine in (ctx, o):
            engine_decode(engine, PROMPT, 0)
        for op, args in (("seq_rm", (0, 4, 12)), ("seq_add", (0, 12, -1, -8))):
            getattr(o, op)(*args)
            getattr(ctx.memory, op)(*args)
        for tokens, pos0 in (([7, 8, 9], len(PROMPT) - 8), ([10], len(PROMPT) - 5)):
            want = engine_decode(o, tokens, pos0)
            got = engine_decode(ctx, tokens, pos0)
            assert_exact(got, want, f"{name} {kv} after the K-shift, pos {pos0}")
        assert ctx.memory.seq_pos_max(0) == o.seq_pos_max(0)


def engine_decode(engine, tokens, pos0) -> np.ndarray:
    """Decode `tokens` at pos0.. in sequence 0 with llamir or the oracle; every row's logits."""
    if isinstance(engine, LlamaCppOracle):
        assert engine.decode(tokens, pos0=pos0, logits="all") == 0
        return np.stack([engine.logits_ith(i) for i in range(len(tokens))])
    assert engine.decode(llamir.Batch.from_tokens(tokens, pos0=pos0, logits="all")) == 0, engine.last_error
    return engine.get_logits().copy()


@pytest.mark.parametrize("name, kv", [("llama-hd128", "q8_0"), ("gemma3-hd64", "f16-k-q8_0-v")])
def test_rotated_cache_state_is_llama_cpps_byte_for_byte(model_path, name, kv):
    """The cache holds rotated, quantized rows: after the same prompt both engines' states are the
    same bytes, and that state loaded into a fresh context of each engine gives the same next
    logits. (A load packs the cells from the first one, so where a window pruned some, as in
    gemma3's SWA cache, flash attention then sums in another order than before the save.)"""
    type_k, type_v, flash_attn = KV_TYPES[kv]
    path = model_path(name)
    with oracle(path, type_k, type_v, flash_attn) as o:
        engine_decode(o, PROMPT, 0)
        theirs = o.state_get_data()
    with oracle(path, type_k, type_v, flash_attn) as o:
        assert o.state_set_data(theirs) > 0
        want = engine_decode(o, [5], len(PROMPT))
    ctx = llamir_context(path, "numpy", type_k, type_v, flash_attn)
    engine_decode(ctx, PROMPT, 0)
    assert ctx.state_get_data() == theirs
    fresh = llamir_context(path, "numpy", type_k, type_v, flash_attn)
    fresh.state_set_data(theirs)
    assert_exact(engine_decode(fresh, [5], len(PROMPT)), want, f"{name} {kv} after a state load")
