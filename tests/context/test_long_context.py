"""Long context against llama.cpp: a 2048-cell cache filled by a prompt fed in ubatches, then
single-token decodes at positions 2040..2047 (n_kv 2048), head sizes 64 and 128, flash attention
on and off, on the numpy reference and the LLVM backend (both with the oracle build's numerics
profile): every requested row of logits equal bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

import llamir
from llamir.backends.llvm import LLVMBackend
from llamir.frontend.synth import SynthSpec, write_model
from llamir.testing.conformance import make_context
from llamir.testing.llama_cpp import LlamaCppOracle, oracle_numerics

pytestmark = [pytest.mark.llama_cpp, pytest.mark.slow]

N_CTX, N_BATCH, N_UBATCH = 2048, 512, 256
N_PROMPT, N_GEN = 2040, 8
PROMPT = [int(t) for t in np.random.RandomState(5).randint(3, 512, size=N_PROMPT)]
GENERATED = [int(t) for t in np.random.RandomState(6).randint(3, 512, size=N_GEN)]
# head size 64: 128 wide, 2 heads over 1 KV head; head size 128: 256 wide, 2 heads, 2 KV heads
MODELS = {
    "hd64": SynthSpec(arch="llama", n_embd=128, n_head=2, n_head_kv=1, n_ff=256, dtype="f16", n_ctx_train=4096,
                      seed=11),
    "hd128": SynthSpec(arch="qwen2", n_embd=256, n_head=2, n_head_kv=2, n_ff=256, dtype="q8_0", n_ctx_train=4096,
                       seed=12),
}


def _batches():
    """(tokens, pos0, logits flags) of each decode: the prompt in n_batch pieces (each split into
    ubatches of 256) with every 128th token and the last one an output, then one token at a time."""
    for start in range(0, N_PROMPT, N_BATCH):
        tokens = PROMPT[start:start + N_BATCH]
        flags = [(start + i) % 128 == 127 or i == len(tokens) - 1 for i in range(len(tokens))]
        yield tokens, start, flags
    for i, token in enumerate(GENERATED):
        yield [token], N_PROMPT + i, [True]


def _llama_cpp_rows(path, flash_attn: bool) -> list[np.ndarray]:
    rows = []
    with LlamaCppOracle(path, n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_UBATCH, flash_attn=flash_attn) as o:
        for tokens, pos0, flags in _batches():
            assert o.decode(tokens, pos0=pos0, logits=flags) == 0
            rows.append(np.stack([o.logits_ith(i) for i, f in enumerate(flags) if f]))
    return rows


def _llamir_rows(path, backend, flash_attn: bool) -> list[np.ndarray]:
    ctx = make_context(llamir.load_model(path), backend, n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_UBATCH,
                       flash_attn="on" if flash_attn else "off")
    rows = []
    for tokens, pos0, flags in _batches():
        batch = llamir.Batch(tokens=tokens, pos=list(range(pos0, pos0 + len(tokens))), seq_ids=[(0,)] * len(tokens),
                             logits=flags)
        assert ctx.decode(batch) == 0, ctx.last_error
        rows.append(np.stack([ctx.get_logits_ith(i) for i, f in enumerate(flags) if f]))
    assert ctx.memory.seq_pos_max(0) == N_CTX - 1
    return rows


@pytest.fixture(scope="module", params=list(MODELS))
def model_path(request, tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("long") / f"{request.param}.gguf", MODELS[request.param])


@pytest.fixture(scope="module")
def llvm():
    backend = LLVMBackend(n_threads=2, disk_cache=False, numerics=oracle_numerics())
    yield backend
    backend.close()


@pytest.mark.parametrize("flash_attn", [False, True], ids=["fa-off", "fa-on"])
@pytest.mark.parametrize("side", ["numpy", "llvm"])
def test_filled_2048_cell_cache_matches_llama_cpp(model_path, llvm, side, flash_attn):
    theirs = _llama_cpp_rows(model_path, flash_attn)
    ours = _llamir_rows(model_path, llvm if side == "llvm" else "numpy", flash_attn)
    positions = [pos0 + len(tokens) - 1 for tokens, pos0, _ in _batches()]
    moved = [f"decode ending at position {p}: {int((a != b).any(axis=-1).sum())} of {len(a)} rows differ, "
             f"max {np.abs(a - b).max():.3g}" for p, a, b in zip(positions, ours, theirs) if not np.array_equal(a, b)]
    assert not moved, "\n".join(moved)
