"""Whole-model conformance against llama.cpp, shared by the reference suite
(tests/context/test_llama_cpp_conformance.py) and the LLVM one: small random-weight models, the
logits of llamir and of llama.cpp in three feeding modes, llama.cpp's own f16/f32 KV spread
(the tolerance is half of it), and greedy generation."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import llamir
from llamir.frontend.synth import SynthSpec, write_model
from llamir.testing.llama_cpp import LlamaCppOracle, nmse

N_CTX, N_BATCH, N_UBATCH_SPLIT = 256, 64, 16
PROMPT = [int(t) for t in np.random.RandomState(0).randint(3, 500, size=40)]
MODES = ("batch", "incremental", "ubatch")   # one batch; one token at a time; ubatches of 16

# every arch with every weight type; GQA/MHA and tied/untied alternate so each meets every arch
CASES = [
    (arch, dtype, n_head_kv, tied)
    for arch in ("llama", "qwen2", "qwen3")
    for dtype, n_head_kv, tied in (("f32", 2, False), ("f16", 4, True), ("q8_0", 2, False),
                                   ("q4_0", 4, True), ("q4_1", 2, False))
]


def case_id(case: tuple) -> str:
    arch, dtype, n_head_kv, tied = case
    return f"{arch}-{dtype}-{'gqa' if n_head_kv < 4 else 'mha'}{n_head_kv}-{'tied' if tied else 'untied'}"


def case_model(model_dir: Path, arch: str, dtype: str, n_head_kv: int, tied: bool) -> Path:
    """The case's 2-layer model, written once into `model_dir`."""
    path = model_dir / f"{arch}-{dtype}-{n_head_kv}-{int(tied)}.gguf"
    if not path.exists():
        write_model(path, SynthSpec(arch=arch, n_layer=2, n_embd=64, n_head=4, n_head_kv=n_head_kv, n_ff=128,
                                    n_vocab=512, dtype=dtype, tied=tied, seed=7))
    return path


def llamir_logits(model, mode: str, *, flash_attn: str = "off", type_kv: str = "f16", backend=None) -> np.ndarray:
    """Every position's logits of PROMPT, fed in `mode`."""
    kw = {} if backend is None else {"backend": backend}
    ctx = llamir.Context(model, n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_UBATCH_SPLIT if mode == "ubatch" else N_BATCH,
                         flash_attn=flash_attn, type_k=type_kv, type_v=type_kv, **kw)
    if mode == "incremental":
        rows = []
        for i, token in enumerate(PROMPT):
            assert ctx.decode(llamir.Batch.from_tokens([token], pos0=i, logits="all")) == 0, ctx.last_error
            rows.append(ctx.get_logits_ith(-1).copy())
        return np.stack(rows)
    assert ctx.decode(llamir.Batch.from_tokens(PROMPT, logits="all")) == 0, ctx.last_error
    return ctx.get_logits().copy()


def llama_cpp_logits(path: Path, mode: str, *, flash_attn: bool = False, type_kv: str = "f16") -> np.ndarray:
    """The same from llama.cpp on the same file."""
    n_ubatch = N_UBATCH_SPLIT if mode == "ubatch" else N_BATCH
    with LlamaCppOracle(path, n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=n_ubatch, flash_attn=flash_attn,
                        type_k=type_kv, type_v=type_kv) as o:
        return o.eval_logits(PROMPT, mode)


def llama_cpp_kv_spread(path: Path) -> float:
    """llama.cpp's own NMSE between its f16 and f32 KV caches on this file and prompt."""
    return nmse(llama_cpp_logits(path, "batch", type_kv="f16"), llama_cpp_logits(path, "batch", type_kv="f32"))


def greedy_pair(path: Path, n_prompt: int = 8, n_gen: int = 32, backend=None) -> tuple[list[int], list[int]]:
    """(llamir's, llama.cpp's) greedy continuations of PROMPT[:n_prompt], n_gen tokens each."""
    prompt = PROMPT[:n_prompt]
    with LlamaCppOracle(path, n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_BATCH) as o:
        want = o.greedy(prompt, n_gen)
    kw = {} if backend is None else {"backend": backend}
    ctx = llamir.Context(llamir.load_model(path), n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_BATCH, flash_attn="off",
                         **kw)
    assert ctx.decode(llamir.Batch.from_tokens(prompt, logits="last")) == 0, ctx.last_error
    got = []
    for i in range(n_gen):
        token = int(np.argmax(ctx.get_logits_ith(-1)))
        got.append(token)
        assert ctx.decode(llamir.Batch.from_tokens([token], pos0=n_prompt + i)) == 0, ctx.last_error
    return got, want
