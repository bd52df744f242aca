"""Whole models on the LLVM backend against llama.cpp, on the same random-weight GGUF files as
the foundation's conformance suite (tests/context/test_llama_cpp_conformance.py): logits in the
three feeding modes within half of llama.cpp's own f16/f32 KV spread, and greedy generation
token for token."""

from __future__ import annotations

import numpy as np
import pytest

import llamir
from llamir.frontend.synth import SynthSpec, write_model

pytestmark = [pytest.mark.llama_cpp, pytest.mark.slow]
llama_cpp_oracle = pytest.importorskip("llamir.testing.llama_cpp")
pytest.importorskip("llama_cpp")

N_CTX, N_BATCH = 256, 64
PROMPT = [int(t) for t in np.random.RandomState(0).randint(3, 500, size=40)]
CASES = [
    (arch, dtype, n_head_kv, tied)
    for arch in ("llama", "qwen2", "qwen3")
    for dtype, n_head_kv, tied in (("f32", 2, False), ("f16", 4, True), ("q8_0", 2, False),
                                   ("q4_0", 4, True), ("q4_1", 2, False))
]
IDS = [f"{a}-{d}-{'gqa' if h < 4 else 'mha'}{h}-{'tied' if t else 'untied'}" for a, d, h, t in CASES]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("conformance_llvm")


@pytest.fixture(scope="module")
def backend():
    from llamir.backends.llvm import LLVMBackend

    b = LLVMBackend(n_threads=2, disk_cache=False)
    yield b
    b.close()


def _model(model_dir, arch, dtype, n_head_kv, tied):
    spec = SynthSpec(arch=arch, n_layer=2, n_embd=64, n_head=4, n_head_kv=n_head_kv, n_ff=128,
                     n_vocab=512, dtype=dtype, tied=tied, seed=7)
    path = model_dir / f"{arch}-{dtype}-{n_head_kv}-{int(tied)}.gguf"
    if not path.exists():
        write_model(path, spec)
    return path


def _ours(model, backend, mode: str, flash_attn: str = "off", type_kv: str = "f16") -> np.ndarray:
    n_ubatch = 16 if mode == "ubatch" else N_BATCH
    ctx = llamir.Context(model, n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=n_ubatch, flash_attn=flash_attn,
                         type_k=type_kv, type_v=type_kv, backend=backend)
    if mode == "incremental":
        rows = []
        for i, token in enumerate(PROMPT):
            assert ctx.decode(llamir.Batch.from_tokens([token], pos0=i, logits="all")) == 0, ctx.last_error
            rows.append(ctx.get_logits_ith(-1).copy())
        return np.stack(rows)
    assert ctx.decode(llamir.Batch.from_tokens(PROMPT, logits="all")) == 0, ctx.last_error
    return ctx.get_logits().copy()


def _theirs(path, mode: str, flash_attn: bool = False, type_kv: str = "f16") -> np.ndarray:
    n_ubatch = 16 if mode == "ubatch" else N_BATCH
    with llama_cpp_oracle.LlamaCppOracle(path, n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=n_ubatch,
                                         flash_attn=flash_attn, type_k=type_kv, type_v=type_kv) as o:
        return o.eval_logits(PROMPT, mode)


def _spread(path) -> float:
    return llama_cpp_oracle.nmse(_theirs(path, "batch", type_kv="f16"), _theirs(path, "batch", type_kv="f32"))


@pytest.mark.parametrize("arch,dtype,n_head_kv,tied", CASES, ids=IDS)
def test_logits_match_llama_cpp(model_dir, backend, nmse, arch, dtype, n_head_kv, tied):
    path = _model(model_dir, arch, dtype, n_head_kv, tied)
    model = llamir.load_model(path)
    tolerance = 0.5 * _spread(path)
    for mode in ("batch", "incremental", "ubatch"):
        err = nmse(_ours(model, backend, mode), _theirs(path, mode))
        assert err <= tolerance, f"{mode}: NMSE {err:.3g} > {tolerance:.3g}"


@pytest.mark.parametrize("arch,dtype,n_head_kv,tied", CASES[::2], ids=IDS[::2])
def test_greedy_generation_is_token_identical(model_dir, backend, arch, dtype, n_head_kv, tied):
    path = _model(model_dir, arch, dtype, n_head_kv, tied)
    prompt = PROMPT[:8]
    with llama_cpp_oracle.LlamaCppOracle(path, n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_BATCH) as o:
        want = o.greedy(prompt, 32)
    ctx = llamir.Context(llamir.load_model(path), n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_BATCH,
                         flash_attn="off", backend=backend)
    assert ctx.decode(llamir.Batch.from_tokens(prompt, logits="last")) == 0
    got = []
    for i in range(32):
        token = int(np.argmax(ctx.get_logits_ith(-1)))
        got.append(token)
        assert ctx.decode(llamir.Batch.from_tokens([token], pos0=len(prompt) + i)) == 0
    assert got == want


@pytest.mark.parametrize("dtype", ["f32", "q4_1"])
def test_f32_kv_cache_and_flash_attention_match(model_dir, backend, nmse, dtype):
    path = _model(model_dir, "llama", dtype, 2, False)
    model = llamir.load_model(path)
    tolerance = 0.5 * _spread(path)
    assert nmse(_ours(model, backend, "batch", type_kv="f32"), _theirs(path, "batch", type_kv="f32")) <= tolerance
    for mode in ("batch", "incremental"):
        err = nmse(_ours(model, backend, mode, flash_attn="on"), _theirs(path, mode, flash_attn=True))
        assert err <= tolerance, f"{mode}: NMSE {err:.3g} > {tolerance:.3g}"
