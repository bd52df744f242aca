"""Both numerics profiles against logits recorded from both x86 builds of llama.cpp.

On an AVX-512 host, llama.cpp 0.3.36 was built twice (AVX-512 + VNNI + BF16, and AVX2 + FMA +
F16C only) and run on the small models below; tests/data/oracle_logits/{avx512,avx2}.npz hold
their logits (tests/data/oracle_logits/record.py writes them). Whatever this host is, the test
regenerates each model (checking its sha256), runs llamir in each profile on the numpy reference
and the LLVM backend, and requires the logits of that profile's build bit for bit. The models
are chosen where the two builds differ (float matmuls, softmax, SiLU, flash attention, bf16,
q2_K's AVX-512-only repack), and the test checks that they really do differ.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

import llamir
from llamir.frontend.synth import SynthSpec, write_model
from llamir.ir.numerics import PROFILES

DATA = Path(__file__).parents[1] / "data" / "oracle_logits"
PROMPT = [int(t) for t in np.random.RandomState(5).randint(3, 500, size=40)]
FEEDS = ("batch", "incremental")
N_INCREMENTAL = 12
N_CTX, N_BATCH = 256, 64


@dataclass(frozen=True)
class Recorded:
    spec: SynthSpec
    context: dict = field(default_factory=dict)   # flash_attn, type_k, type_v


MODELS = {
    "llama-f32": Recorded(SynthSpec(arch="llama", n_embd=64, n_head=4, n_head_kv=2, n_ff=128, seed=11)),
    "qwen2-f16-fa": Recorded(SynthSpec(arch="qwen2", dtype="f16", n_head_kv=4, seed=12), {"flash_attn": True}),
    "gemma3-f16": Recorded(SynthSpec(arch="gemma3", dtype="f16", n_layer=3, sliding_window=8, swa_pattern=3,
                                     seed=13)),
    "llama-bf16": Recorded(SynthSpec(arch="llama", dtype="bf16", n_embd=256, n_ff=512, seed=14)),
    "qwen3-q2_k": Recorded(SynthSpec(arch="qwen3", dtype="q2_k", n_embd=256, n_ff=512, seed=15)),
    "llama-q8_0-f32kv": Recorded(SynthSpec(arch="llama", dtype="q8_0", n_embd=256, n_ff=512, seed=16),
                                 {"type_k": "f32", "type_v": "f32"}),
}


def llama_cpp_feed(path: Path, model: Recorded, feed: str) -> np.ndarray:
    """llama.cpp's logits of PROMPT: one batch with every logit, or the first tokens one by one."""
    from llamir.testing.llama_cpp import LlamaCppOracle

    with LlamaCppOracle(path, n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_BATCH, n_threads=2, **model.context) as o:
        tokens = PROMPT if feed == "batch" else PROMPT[:N_INCREMENTAL]
        return o.eval_logits(tokens, feed).astype(np.float32)


def llamir_feed(path: Path, model: Recorded, feed: str, backend, profile: str) -> np.ndarray:
    ctx_kw = dict(model.context)
    if "flash_attn" in ctx_kw:
        ctx_kw["flash_attn"] = "on" if ctx_kw["flash_attn"] else "off"
    else:
        ctx_kw["flash_attn"] = "off"
    ctx = llamir.Context(llamir.load_model(path), backend=backend, numerics=profile, n_ctx=N_CTX, n_batch=N_BATCH,
                         n_ubatch=N_BATCH, **ctx_kw)
    if feed == "batch":
        assert ctx.decode(llamir.Batch.from_tokens(PROMPT, logits="all")) == 0, ctx.last_error
        return ctx.get_logits().copy()
    rows = []
    for i, token in enumerate(PROMPT[:N_INCREMENTAL]):
        assert ctx.decode(llamir.Batch.from_tokens([token], pos0=i, logits="all")) == 0, ctx.last_error
        rows.append(ctx.get_logits_ith(-1).copy())
    return np.stack(rows)


@pytest.fixture(scope="module")
def recorded() -> dict[str, dict[str, np.ndarray]]:
    out = {}
    for profile in PROFILES:
        with np.load(DATA / f"{profile}.npz") as f:
            out[profile] = {k: f[k] for k in f.files}
    return out


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory, recorded) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("recorded")
    paths = {}
    for name, model in MODELS.items():
        path = write_model(root / f"{name}.gguf", model.spec)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        for profile in PROFILES:   # the recorded logits are of this very file
            assert str(recorded[profile][f"{name}/sha256"]) == digest, f"{name}: synth wrote a different file"
        paths[name] = path
    return paths


@pytest.fixture(scope="module", params=sorted(PROFILES))
def llvm(request):
    from llamir.backends.llvm import LLVMBackend

    b = LLVMBackend(n_threads=2, disk_cache=False, numerics=request.param)
    yield b
    b.close()


def _assert_same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape, (what, got.shape, want.shape)
    differ = got.view(np.uint32) != want.view(np.uint32)
    assert not differ.any(), f"{what}: {int(differ.sum())} of {got.size} logits differ from the recorded build"


def test_the_two_builds_differ_on_these_models(recorded):
    """Each model tells the builds apart in at least one feeding (otherwise it proves nothing)."""
    for name in MODELS:
        assert any(not np.array_equal(recorded["avx512"][f"{name}/{f}"], recorded["avx2"][f"{name}/{f}"])
                   for f in FEEDS), name


@pytest.mark.parametrize("profile", sorted(PROFILES))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_reference_reproduces_each_build(recorded, model_paths, name, profile):
    for feed in FEEDS:
        got = llamir_feed(model_paths[name], MODELS[name], feed, "numpy", profile)
        _assert_same(got, recorded[profile][f"{name}/{feed}"], f"numpy {profile} {name} {feed}")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_llvm_reproduces_each_build(recorded, model_paths, llvm, name):
    profile = llvm.numerics.name
    for feed in FEEDS:
        got = llamir_feed(model_paths[name], MODELS[name], feed, llvm, profile)
        _assert_same(got, recorded[profile][f"{name}/{feed}"], f"llvm {profile} {name} {feed}")
