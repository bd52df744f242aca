"""Whole-model conformance against llama.cpp, shared by the reference suite
(tests/context/test_llama_cpp_conformance.py) and the LLVM one: small random-weight models, the
logits of llamir and of llama.cpp in three feeding modes, and greedy generation.

llamir runs the numerics profile of the installed llama.cpp build (`oracle_numerics()`), so the
comparison is exact by construction on any host: every helper says which backend it runs and
passes that profile. The numpy reference's and llama.cpp's logits are memoised per file and
setting, so the LLVM suite can compare against both without recomputing them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import llamir
from llamir.backends import Backend
from llamir.frontend.synth import SynthSpec, write_model
from llamir.testing.llama_cpp import LlamaCppOracle, oracle_numerics

N_CTX, N_BATCH, N_UBATCH_SPLIT = 256, 64, 16
PROMPT = tuple(int(t) for t in np.random.RandomState(0).randint(3, 500, size=40))
MODES = ("batch", "incremental", "ubatch")   # one batch; one token at a time; ubatches of 16

# weight types whose blocks span 256 values (K-quants) and the other types added with them: their
# models are 256 wide (rows of 256, head size 64); the first five types use 64-wide models
WIDE_DTYPES = ("bf16", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k")
ARCHS = ("llama", "qwen2", "qwen3", "gemma3")


@dataclass(frozen=True)
class Case:
    """One conformance model: architecture, weight type, KV heads (of 4), tied output."""

    arch: str
    dtype: str
    n_head_kv: int
    tied: bool

    @property
    def id(self) -> str:
        return f"{self.arch}-{self.dtype}-{'gqa' if self.n_head_kv < 4 else 'mha'}{self.n_head_kv}-" + \
            ("tied" if self.tied else "untied")

    def spec(self) -> SynthSpec:
        wide = self.dtype in WIDE_DTYPES
        # gemma3: a window of 8 on layer 0, layer 1 global, so a 40-token prompt meets both
        swa = {"sliding_window": 8, "swa_pattern": 2} if self.arch == "gemma3" else {}
        return SynthSpec(arch=self.arch, n_layer=2, n_embd=256 if wide else 64, n_head=4, n_head_kv=self.n_head_kv,
                         n_ff=512 if wide else 128, n_vocab=512, dtype=self.dtype, tied=self.tied, seed=7, **swa)


# every arch with every 64-wide weight type; GQA/MHA and tied/untied alternate so each meets every arch
CASES = [Case(arch, dtype, n_head_kv, tied)
         for arch in ARCHS
         for dtype, n_head_kv, tied in (("f32", 2, False), ("f16", 4, True), ("q8_0", 2, False),
                                        ("q4_0", 4, True), ("q4_1", 2, False))]
# the 256-wide types, each on one arch, the archs and shapes taken in turn
CASES += [Case(ARCHS[i % 4], dtype, (2, 4, 1)[i % 3], i % 2 == 1) for i, dtype in enumerate(WIDE_DTYPES)]


# models for single settings: gemma3's interleaved window layers, YaRN and linear rope scaling, and
# quantized KV caches (a K/V row holds whole 32-value blocks): head size 32, which llama.cpp stores
# as it is, and 64, which it stores Hadamard-rotated (llama_kv_cache's attn_rot_k/attn_rot_v)
NAMED = {
    "gemma3-iswa": SynthSpec(arch="gemma3", n_layer=7, sliding_window=8),
    "qwen2-yarn": SynthSpec(arch="qwen2", rope_scaling="yarn", n_ctx_train=8192),
    "qwen2-linear": SynthSpec(arch="qwen2", rope_scaling="linear", n_ctx_train=8192),
    "llama-f32-hd32": SynthSpec(arch="llama", n_embd=64, n_head=2, n_head_kv=1, n_ff=128, dtype="f32", seed=3),
    "qwen2-q8_0-hd32": SynthSpec(arch="qwen2", n_embd=64, n_head=2, n_head_kv=2, n_ff=128, dtype="q8_0", seed=4),
    "llama-f32-hd64": SynthSpec(arch="llama", n_embd=128, n_head=2, n_head_kv=1, n_ff=256, dtype="f32", seed=3),
}
QUANT_KV_MODELS = ("llama-f32-hd32", "qwen2-q8_0-hd32", "llama-f32-hd64")

# attention settings beside the default (f16 KV, flash attention off): name -> llama.cpp's keywords
ATTENTION = {
    "f32-kv": {"type_k": "f32", "type_v": "f32"},
    "flash-attn": {"flash_attn": True},
    "flash-attn-f32-kv": {"flash_attn": True, "type_k": "f32", "type_v": "f32"},
}


def case_model(model_dir: Path, case: Case | str) -> Path:
    """The model of a Case (2 layers) or of a NAMED setting, written once into `model_dir`."""
    name, spec = (case, NAMED[case]) if isinstance(case, str) else (case.id, case.spec())
    path = Path(model_dir) / f"{name}.gguf"
    if not path.exists():
        write_model(path, spec)
    return path


def make_context(model, backend: str | Backend, **params) -> llamir.Context:
    """A llamir context on `backend` ("numpy", or an LLVM backend made with oracle_numerics())
    running the oracle build's numerics profile."""
    return llamir.Context(model, backend=backend, numerics=oracle_numerics(), **params)


def _feed(ctx: llamir.Context, mode: str, prompt) -> np.ndarray:
    if mode == "incremental":
        rows = []
        for i, token in enumerate(prompt):
            assert ctx.decode(llamir.Batch.from_tokens([token], pos0=i, logits="all")) == 0, ctx.last_error
            rows.append(ctx.get_logits_ith(-1).copy())
        return np.stack(rows)
    assert ctx.decode(llamir.Batch.from_tokens(list(prompt), logits="all")) == 0, ctx.last_error
    return ctx.get_logits().copy()


def llamir_logits(model, mode: str, backend: str | Backend, *, flash_attn: str = "off", type_k: str = "f16",
                  type_v: str = "f16", prompt=PROMPT) -> np.ndarray:
    """Every position's logits of `prompt`, fed in `mode`, on `backend`."""
    if backend == "numpy":
        return _numpy_logits(str(model.path), mode, flash_attn, type_k, type_v, tuple(prompt)).copy()
    ctx = make_context(model, backend, n_ctx=N_CTX, n_batch=N_BATCH,
                       n_ubatch=N_UBATCH_SPLIT if mode == "ubatch" else N_BATCH, flash_attn=flash_attn,
                       type_k=type_k, type_v=type_v)
    return _feed(ctx, mode, prompt)


@functools.lru_cache(maxsize=256)
def _numpy_logits(path: str, mode: str, flash_attn: str, type_k: str, type_v: str, prompt: tuple) -> np.ndarray:
    ctx = make_context(llamir.load_model(path), "numpy", n_ctx=N_CTX, n_batch=N_BATCH,
                       n_ubatch=N_UBATCH_SPLIT if mode == "ubatch" else N_BATCH, flash_attn=flash_attn,
                       type_k=type_k, type_v=type_v)
    return _feed(ctx, mode, prompt)


def llama_cpp_logits(path: Path, mode: str, *, flash_attn: bool = False, type_k: str = "f16",
                     type_v: str = "f16", prompt=PROMPT) -> np.ndarray:
    """The same from llama.cpp on the same file."""
    return _llama_cpp_logits(str(path), mode, flash_attn, type_k, type_v, tuple(prompt)).copy()


@functools.lru_cache(maxsize=256)
def _llama_cpp_logits(path: str, mode: str, flash_attn: bool, type_k: str, type_v: str, prompt: tuple) -> np.ndarray:
    n_ubatch = N_UBATCH_SPLIT if mode == "ubatch" else N_BATCH
    with LlamaCppOracle(path, n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=n_ubatch, flash_attn=flash_attn,
                        type_k=type_k, type_v=type_v) as o:
        return o.eval_logits(list(prompt), mode)


def greedy_pair(path: Path, backend: str | Backend, n_prompt: int = 8, n_gen: int = 32,
                flash_attn: bool = False) -> tuple[list[int], list[int]]:
    """(llamir's, llama.cpp's) greedy continuations of PROMPT[:n_prompt], n_gen tokens each."""
    prompt = list(PROMPT[:n_prompt])
    with LlamaCppOracle(path, n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_BATCH, flash_attn=flash_attn) as o:
        want = o.greedy(prompt, n_gen)
    ctx = make_context(llamir.load_model(path), backend, n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_BATCH,
                       flash_attn="on" if flash_attn else "off")
    assert ctx.decode(llamir.Batch.from_tokens(prompt, logits="last")) == 0, ctx.last_error
    got = []
    for i in range(n_gen):
        token = int(np.argmax(ctx.get_logits_ith(-1)))
        got.append(token)
        assert ctx.decode(llamir.Batch.from_tokens([token], pos0=n_prompt + i)) == 0, ctx.last_error
    return got, want


def mismatch(what: str, llvm: np.ndarray, numpy: np.ndarray, llama_cpp: np.ndarray) -> str:
    """Which side moved, for an assert message: the LLVM backend, the numpy reference or both."""
    from llamir.testing.llama_cpp import nmse

    rows = np.flatnonzero(np.any(llvm != numpy, axis=-1)) if llvm.ndim > 1 else np.zeros(0, int)
    return (f"{what}: NMSE llvm/numpy {nmse(llvm, numpy):.3g}, numpy/llama.cpp {nmse(numpy, llama_cpp):.3g}, "
            f"llvm/llama.cpp {nmse(llvm, llama_cpp):.3g}; rows where llvm != numpy: {[int(r) for r in rows[:8]]}")


# -- the checks every architecture's conformance tests make -----------------------------------------
def numpy_errors(path: Path, modes=MODES) -> dict[str, float]:
    """NMSE of the numpy reference against llama.cpp per feeding mode (0 where exact)."""
    from llamir.testing.llama_cpp import nmse

    model = llamir.load_model(path)
    return {mode: nmse(llamir_logits(model, mode, "numpy"), llama_cpp_logits(path, mode)) for mode in modes}


def llvm_mismatches(path: Path, backend: Backend, modes=MODES) -> list[str]:
    """The feeding modes where the LLVM backend, the numpy reference and llama.cpp disagree, each
    with which side moved (empty: all three bit for bit)."""
    model = llamir.load_model(path)
    moved = []
    for mode in modes:
        llvm, numpy = llamir_logits(model, mode, backend), llamir_logits(model, mode, "numpy")
        theirs = llama_cpp_logits(path, mode)
        if not ((llvm == numpy).all() and (llvm == theirs).all()):
            moved.append(mismatch(mode, llvm, numpy, theirs))
    return moved


def device_logits(model, devices=(), placement=None, backend: str | Backend = "llvm", n_ctx: int = N_CTX,
                  **params) -> tuple[llamir.Context, list[np.ndarray]]:
    """A prompt of 40 tokens (every row) then one more token on `devices` placed by `placement`:
    the context and the two logits blocks, to compare a split run with the CPU's."""
    ctx = llamir.Context(model, n_ctx=n_ctx, flash_attn="off", backend=backend, devices=list(devices),
                         placement=placement, **params)
    tokens = list(range(5, 45))
    assert ctx.decode(llamir.Batch.from_tokens(tokens, logits="all")) == 0, ctx.last_error
    rows = [ctx.get_logits().copy()]
    assert ctx.decode(llamir.Batch.from_tokens([3], pos0=len(tokens))) == 0, ctx.last_error
    rows.append(ctx.get_logits_ith(-1).copy())
    return ctx, rows


def assert_device_matches_cpu(model, devices=("sim:gpu0",), placement=None, min_splits: int = 2, **params):
    """The model split over `devices` gives the CPU's logits bit for bit, in at least min_splits
    splits; returns the device context."""
    from llamir.frontend.placement import PlacementParams

    _, want = device_logits(model, **params)
    ctx, got = device_logits(model, devices, placement or PlacementParams(n_gpu_layers=2), **params)
    assert ctx.n_splits["pp"] >= min_splits, ctx.n_splits
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    return ctx
