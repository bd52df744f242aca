"""How much llama.cpp disagrees with itself: the floor under any tolerance we set against it.

Measured (NMSE of logits, `sum((a-b)^2)/sum(b^2)`) on synthetic models and on SmolLM2 cut to two
blocks: f16 vs f32 KV cache; batch vs incremental vs ubatch-split feeding; and, for quantized
weights, llama.cpp on the file vs llama.cpp on its f32-dequantized rewrite (the spread that comes
from llama.cpp quantizing activations for its Q8_0/Q8_1 dot products). The asserts are loose
sanity bounds; run with `-s` to see the figures.
"""

from __future__ import annotations

import numpy as np
import pytest

from llamir.frontend.gguf_rewrite import rewrite
from llamir.frontend.synth import SynthSpec, write_model
from llamir.testing import LlamaCppOracle, nmse

pytestmark = pytest.mark.llama_cpp

ARCHS = ("llama", "qwen2", "qwen3")
N_TOKENS = 40
N_UBATCH = 16          # < N_TOKENS, so "ubatch" feeding is split into 3 ubatches
FIGURES: dict[str, float] = {}


def _spec(arch: str, dtype: str = "f32") -> SynthSpec:
    return SynthSpec(arch=arch, n_layer=4, n_embd=128, n_head=4, n_head_kv=2, n_ff=256, dtype=dtype)


def _tokens(n_vocab: int) -> list[int]:
    rng = np.random.default_rng(1234)
    return [int(t) for t in rng.integers(3, n_vocab, N_TOKENS)]  # skip the control tokens 0..2


def _logits(path, tokens, mode: str, kv: str = "f32") -> np.ndarray:
    n_ubatch = N_UBATCH if mode == "ubatch" else 64
    with LlamaCppOracle(path, n_ctx=128, n_batch=64, n_ubatch=n_ubatch, type_k=kv, type_v=kv) as oracle:
        return oracle.eval_logits(tokens, mode)


def _record(name: str, value: float, bound: float) -> None:
    FIGURES[name] = value
    print(f"\n  spread  {name:<46} nmse = {value:.3g}")
    assert np.isfinite(value) and value <= bound, f"{name}: nmse {value:.3g} > sanity bound {bound:g}"


@pytest.fixture(scope="module", autouse=True)
def _summary():
    yield
    if FIGURES:
        print("\nllama.cpp self-spread (logits NMSE):")
        for name, value in FIGURES.items():
            print(f"  {name:<48} {value:.3g}")


@pytest.fixture(scope="module")
def synth_models(tmp_path_factory) -> dict[tuple[str, str], object]:
    """(arch, dtype) -> path for f32/f16/q8_0/q4_0/q4_1 files, plus (arch, dtype + '->f32') rewrites."""
    root = tmp_path_factory.mktemp("spread")
    models = {}
    for arch in ARCHS:
        for dtype in ("f32", "f16", "q8_0", "q4_0", "q4_1"):
            path = write_model(root / f"{arch}-{dtype}.gguf", _spec(arch, dtype))
            models[arch, dtype] = path
            if dtype != "f32":
                models[arch, dtype + "->f32"] = rewrite(path, root / f"{arch}-{dtype}-f32.gguf", dtype="f32")
    return models


@pytest.mark.parametrize("arch", ARCHS)
def test_kv_cache_f16_vs_f32(synth_models, arch):
    path = synth_models[arch, "f32"]
    tokens = _tokens(_spec(arch).n_vocab)
    for mode in ("batch", "incremental"):
        f16, f32 = _logits(path, tokens, mode, kv="f16"), _logits(path, tokens, mode, kv="f32")
        _record(f"{arch} kv f16 vs f32 ({mode})", nmse(f16, f32), bound=1e-4)


@pytest.mark.parametrize("kv", ["f32", "f16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_feeding_modes(synth_models, arch, kv):
    path = synth_models[arch, "f32"]
    tokens = _tokens(_spec(arch).n_vocab)
    batch = _logits(path, tokens, "batch", kv)
    for mode in ("incremental", "ubatch"):
        _record(f"{arch} kv {kv}: {mode} vs batch", nmse(_logits(path, tokens, mode, kv), batch), bound=1e-5)


@pytest.mark.parametrize("dtype", ["f16", "q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_file_vs_its_f32_dequantized_rewrite(synth_models, arch, dtype):
    tokens = _tokens(_spec(arch).n_vocab)
    quant = _logits(synth_models[arch, dtype], tokens, "batch")
    exact = _logits(synth_models[arch, dtype + "->f32"], tokens, "batch")
    _record(f"{arch} {dtype} file vs f32 rewrite", nmse(quant, exact), bound=1e-2)


@pytest.mark.slow
def test_smollm2_two_blocks():
    from llamir.frontend.default_model import smollm2_truncated

    q4_1, f32 = smollm2_truncated(2), smollm2_truncated(2, "f32")
    with LlamaCppOracle(q4_1, n_ctx=128) as oracle:
        tokens = oracle.tokenize("The capital of France is Paris. It is known for the Eiffel Tower, "
                                 "its museums and its food, and millions of people visit it every year.")
    assert len(tokens) > N_UBATCH
    exact = _logits(f32, tokens, "batch")
    quant = _logits(q4_1, tokens, "batch")
    _record("smollm2[:2] q4_1 file vs f32 rewrite", nmse(quant, exact), bound=1e-2)
    _record("smollm2[:2] q4_1 kv f16 vs f32", nmse(_logits(q4_1, tokens, "batch", "f16"), quant), bound=1e-3)
    _record("smollm2[:2] q4_1 incremental vs batch", nmse(_logits(q4_1, tokens, "incremental"), quant),
            bound=1e-3)
    _record("smollm2[:2] q4_1 ubatch vs batch", nmse(_logits(q4_1, tokens, "ubatch"), quant), bound=1e-3)
    _record("smollm2[:2] f32 incremental vs batch", nmse(_logits(f32, tokens, "incremental"), exact),
            bound=1e-5)


def test_oracle_memory_ops_and_greedy(synth_models):
    """The harness itself: sequence ops and greedy decoding agree with plain decodes."""
    path = synth_models["llama", "f32"]
    tokens = _tokens(_spec("llama").n_vocab)[:12]
    with LlamaCppOracle(path, n_ctx=128, n_batch=32, type_k="f32", type_v="f32", n_seq_max=2,
                        kv_unified=True) as oracle:
        full = oracle.eval_logits(tokens, "batch")
        assert (oracle.seq_pos_min(0), oracle.seq_pos_max(0)) == (0, len(tokens) - 1)
        assert oracle.seq_rm(0, len(tokens) - 1, -1)           # drop the last position, decode it again
        assert oracle.seq_pos_max(0) == len(tokens) - 2
        assert oracle.decode(tokens[-1:], pos0=len(tokens) - 1) == 0
        assert nmse(oracle.logits_ith(0), full[-1]) < 1e-10
        oracle.seq_cp(0, 1)                                     # seq 1 shares the prefix of seq 0
        oracle.seq_rm(1, len(tokens) - 1, -1)
        assert oracle.decode(tokens[-1:], pos0=len(tokens) - 1, seq_id=1) == 0
        assert nmse(oracle.logits_ith(0), full[-1]) < 1e-10
        oracle.seq_keep(1)
        assert oracle.seq_pos_max(0) == -1 and oracle.seq_pos_max(1) == len(tokens) - 1
        with pytest.raises(IndexError):
            oracle.logits_ith(5)                                # only one output in the last decode

        generated = oracle.greedy(tokens, 4)
        context = list(tokens)
        for token in generated:
            assert token == int(np.argmax(oracle.eval_logits(context, "batch")[-1]))
            context.append(token)
