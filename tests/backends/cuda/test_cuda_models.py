"""Whole models on the CUDA plugin's emulated device: llama.cpp's logits within tolerance on the
conformance models (the device alone, and split with the CPU), the KV cache in device memory,
launch sequences replayed and captured as CUDA graphs while the graph is reused, and emit-ptx
for a llama, a qwen2 and a gemma3 model at sm_80 and sm_90, every file through ptxas."""

from __future__ import annotations

import json

import numpy as np
import pytest
from llamir_cuda.emit import emit_ptx

import llamir
from llamir.frontend.placement import PlacementParams
from llamir.frontend.synth import SynthSpec, write_model
from llamir.testing.conformance import N_BATCH, N_CTX, PROMPT, Case, llama_cpp_logits, llamir_logits

TOKENS = list(range(5, 45))
# as for the Vulkan plugin: the device sums in another order (warps, tiles, its own exp), so an
# f16 KV cache or the q8 rounding of activations flips a quantum now and then
FLOAT_NMSE, QUANT_NMSE = 1e-6, 1e-3


def _nmse(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sum((a - b) ** 2) / np.sum(b * b))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("cuda") / "m.gguf", SynthSpec(n_layer=2, dtype="q8_0"))


@pytest.fixture(scope="module")
def model(model_path):
    return llamir.load_model(model_path)


def _logits(model, devices=(), placement=None, backend="llvm", **kw):
    """A 40-token prompt (every row), then one generated token: both logits blocks."""
    ctx = llamir.Context(model, n_ctx=256, flash_attn=kw.pop("flash_attn", "off"), backend=backend,
                         devices=list(devices), placement=placement, **kw)
    assert ctx.decode(llamir.Batch.from_tokens(TOKENS, logits="all")) == 0, ctx.last_error
    first = ctx.get_logits().copy()
    assert ctx.decode(llamir.Batch.from_tokens([3], pos0=len(TOKENS))) == 0, ctx.last_error
    return ctx, [first, ctx.get_logits_ith(-1).copy()]


# every weight type the issue names, the three architectures taken in turn
MODEL_CASES = [("f32", "llama"), ("f16", "qwen2"), ("q8_0", "gemma3"), ("q4_0", "llama"), ("q4_1", "qwen2"),
               ("q4_k", "gemma3"), ("q6_k", "llama")]


@pytest.mark.llama_cpp
@pytest.mark.parametrize("dtype, arch", MODEL_CASES, ids=[f"{a}-{d}" for d, a in MODEL_CASES])
def test_model_matches_llama_cpp(cuda, conformance_model, arch, dtype):
    """The conformance models with every layer on the device: llama.cpp's logits within
    tolerance, the prompt at once and token by token (the argmax agrees on float weights; a
    quantized model's near-ties may flip within the bound)."""
    path = conformance_model(Case(arch, dtype, 2, dtype in ("f16", "q4_0")))
    model = llamir.load_model(path)
    for mode in ("batch", "incremental"):
        got, want = llamir_logits(model, mode, "cuda"), llama_cpp_logits(path, mode)
        assert _nmse(got, want) < (FLOAT_NMSE if dtype in ("f32", "f16") else QUANT_NMSE), (mode, _nmse(got, want))
        if dtype in ("f32", "f16"):
            assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.95


def _cpu_and_device_logits(model, device, mode: str, flash_attn: str, prompt=PROMPT):
    """Every position's logits of `prompt` fed in `mode` ("batch": one decode; "incremental": a
    token at a time), on the numpy reference and with every layer on `device`."""
    rows = []
    for cpu, devices in (("numpy", []), ("llvm", [device])):
        placement = PlacementParams(n_gpu_layers=99) if devices else None
        ctx = llamir.Context(model, n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_BATCH, flash_attn=flash_attn,
                             backend=cpu, devices=devices, placement=placement)
        feed = [prompt] if mode == "batch" else [[token] for token in prompt]
        logits, pos = [], 0
        for tokens in feed:
            assert ctx.decode(llamir.Batch.from_tokens(list(tokens), pos0=pos, logits="all")) == 0, ctx.last_error
            logits.append(ctx.get_logits().copy())
            pos += len(tokens)
        rows.append(np.concatenate(logits))
    return rows


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, arch", MODEL_CASES, ids=[f"{a}-{d}" for d, a in MODEL_CASES])
def test_gpu_model_matches_the_cpu(gpu_backend, conformance_model, arch, dtype):
    """On a real GPU, the conformance models with every layer on it: the numpy reference's logits
    on the same GGUF within the emulator tests' bounds, the prompt at once and token by token,
    flash attention off and on."""
    path = conformance_model(Case(arch, dtype, 2, dtype in ("f16", "q4_0")))
    model = llamir.load_model(path)
    bound = FLOAT_NMSE if dtype in ("f32", "f16") else QUANT_NMSE
    for mode in ("batch", "incremental"):
        for fa in ("off", "on"):
            want, got = _cpu_and_device_logits(model, gpu_backend, mode, fa)
            error, argmax = _nmse(got, want), float((got.argmax(-1) == want.argmax(-1)).mean())
            print(f"gpu conformance {arch}-{dtype} {mode} fa={fa}: nmse {error:.3g} (bound {bound:g}), "
                  f"argmax agrees {argmax:.0%}")
            assert error < bound, (mode, fa, error)
            if dtype in ("f32", "f16"):
                assert argmax >= 0.95, (mode, fa, argmax)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["q4_0", "q8_0", "f16"])
def test_gpu_110m_shapes_match_the_cpu(gpu_backend, tmp_path, dtype):
    """The bench models' shapes (n_embd 768, n_ff 2048, vocab 32000; two of their 12 layers) on a
    real GPU: a 512-token prompt in one ubatch (tile kernels at full size) and tokens after it,
    against the LLVM CPU backend. (q4_k is left out: numpy takes half a minute to write it.)"""
    spec = SynthSpec(arch="llama", n_layer=2, n_embd=768, n_head=12, n_head_kv=12, n_ff=2048, n_vocab=32000,
                     tied=True, dtype=dtype, seed=1)
    model = llamir.load_model(write_model(tmp_path / f"big-{dtype}.gguf", spec))
    prompt = [int(t) for t in np.random.default_rng(2).integers(3, 32000, 512)]
    for fa in ("off", "on"):
        logits = []
        for devices in ([], [gpu_backend]):
            ctx = llamir.Context(model, n_ctx=1024, n_batch=512, n_ubatch=512, flash_attn=fa, devices=devices,
                                 placement=PlacementParams(n_gpu_layers=99) if devices else None)
            assert ctx.decode(llamir.Batch.from_tokens(prompt, logits="all")) == 0, ctx.last_error
            rows = [ctx.get_logits().copy()]
            for i, token in enumerate((5, 17, 123)):
                assert ctx.decode(llamir.Batch.from_tokens([token], pos0=len(prompt) + i)) == 0, ctx.last_error
                rows.append(ctx.get_logits_ith(-1)[None].copy())
            logits.append(np.concatenate(rows))
        want, got = logits
        error = _nmse(got, want)
        print(f"gpu 110m-shape {dtype} fa={fa}: nmse {error:.3g} (bound {QUANT_NMSE:g})")
        assert error < QUANT_NMSE, (fa, error)


@pytest.mark.parametrize("placement", [
    PlacementParams(n_gpu_layers=1), PlacementParams(n_gpu_layers=99, overrides=((r"ffn_.*", "cpu"),)),
], ids=["ngl1", "ffn-on-cpu"])
def test_mixed_cpu_and_cuda_splits_match_the_cpu(cuda, model, placement):
    _, want = _logits(model)
    ctx, got = _logits(model, ["cuda"], placement)
    assert ctx.n_splits["pp"] >= 2, ctx.n_splits
    for g, w in zip(got, want, strict=True):
        assert _nmse(g, w) < QUANT_NMSE


def test_flash_attention_on_the_device(cuda, model):
    _, want = _logits(model)
    for fa in ("off", "on"):
        ctx, got = _logits(model, backend="cuda", flash_attn=fa)
        (cg,) = ctx.runner.graphs.values()
        assert cg.placement.layer_device == ["cuda0"] * 2
        for g, w in zip(got, want, strict=True):
            assert _nmse(g, w) < QUANT_NMSE, fa


def test_kv_cache_in_device_memory_and_sequences_replayed_as_graphs(cuda, model):
    """The offloaded layers' K and V are CUDA buffers; generated tokens replay the launch
    sequence lowered for the reused graph, captured as a CUDA graph from its second run."""
    from llamir_cuda.backend import CudaBuffer

    ctx = llamir.Context(model, n_ctx=256, flash_attn="off", backend="cuda")
    assert ctx.decode(llamir.Batch.from_tokens(TOKENS, logits="last")) == 0, ctx.last_error
    (cache,) = ctx.memory.caches
    assert {type(getattr(t, "buffer", t)) for t in cache.tensors.values()} == {CudaBuffer}
    backend = ctx.runner.backends[0]
    assert backend.name == "cuda"
    emu = backend.ctx
    lowered, graphs = backend.n_lowered, emu.n_graphs
    tokens = []
    for i in range(4):
        tok = int(np.argmax(ctx.get_logits_ith(-1)))
        tokens.append(tok)
        assert ctx.decode(llamir.Batch.from_tokens([tok], pos0=len(TOKENS) + i)) == 0, ctx.last_error
    assert backend.n_lowered - lowered <= 1  # the one-token graph's sequence, lowered once
    assert emu.n_graphs > graphs and emu.n_graph_launches >= 2
    backend.timing = True  # the device's time of a token's replay, between two events on the stream
    assert ctx.decode(llamir.Batch.from_tokens([tokens[-1]], pos0=len(TOKENS) + 4)) == 0, ctx.last_error
    assert backend.device_time() > 0 and not backend._timed
    # the same tokens with graphs off
    ctx2 = llamir.Context(model, n_ctx=256, flash_attn="off", devices=["cuda:0:graphs=off"],
                          placement=PlacementParams(n_gpu_layers=99))
    assert ctx2.decode(llamir.Batch.from_tokens(TOKENS, logits="last")) == 0
    for i in range(4):
        assert int(np.argmax(ctx2.get_logits_ith(-1))) == tokens[i]
        assert ctx2.decode(llamir.Batch.from_tokens([tokens[i]], pos0=len(TOKENS) + i)) == 0


def test_state_save_and_load_through_device_memory(cuda, model):
    """The state blob of a context whose cache is on the device restores the same logits."""
    ctx = llamir.Context(model, n_ctx=256, flash_attn="off", backend="cuda")
    assert ctx.decode(llamir.Batch.from_tokens(TOKENS, logits="last")) == 0
    blob = ctx.state_get_data()
    assert ctx.decode(llamir.Batch.from_tokens([7], pos0=len(TOKENS))) == 0
    want = ctx.get_logits_ith(-1).copy()
    other = llamir.Context(model, n_ctx=256, flash_attn="off", backend="cuda")
    other.state_set_data(blob)
    assert other.decode(llamir.Batch.from_tokens([7], pos0=len(TOKENS))) == 0
    np.testing.assert_allclose(other.get_logits_ith(-1), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_emit_ptx_assembles_for_sm80_and_sm90(tmp_path, arch):
    """Every kernel of the model's prompt and one-token graphs (flash attention on and off), one
    PTX file each, assembled by ptxas for its arch; the matmul kernels spill nothing."""
    spec = SynthSpec(arch=arch, n_layer=2, n_embd=256, n_ff=512, dtype="q4_k",
                     sliding_window=8 if arch == "gemma3" else None, swa_pattern=2)
    path = write_model(tmp_path / f"{arch}.gguf", spec)
    for sm in ("sm_80", "sm_90"):
        out = tmp_path / sm
        rows = emit_ptx(path, sm, out, check=True, n_ubatch=64)   # assembled by ptxas, side by side
        index = json.loads((out / "index.json").read_text())
        assert index["arch"] == sm and len(index["kernels"]) == len(rows) >= 8
        families = {r["kernel"].rsplit("_", 1)[0] for r in rows}
        for family in ("mmq_matvec", "mmq_tile", "flash_attn_mma", "flash_attn_vec", "rope", "soft_max",
                       "set_rows", "get_rows", "norm_rms"):
            assert family in families, (family, sorted(families))
        for row in rows:
            assert f".target {sm}" in (out / row["file"]).read_text()
            assert row["registers"] > 0
            if row["kernel"].startswith(("mul_m", "mmq_")):
                assert row["spill_stores"] == row["spill_loads"] == 0, row


def test_run_on_the_device_gives_the_cpu_tokens(cuda, model_path, capsys):
    from llamir.cli import main

    args = [str(model_path), "-p", "hello world", "-n", "12", "--temp", "0"]
    assert main(["run", *args]) == 0
    want = capsys.readouterr().out
    assert main(["run", *args, "--device", "cuda", "-ngl", "99"]) == 0
    assert capsys.readouterr().out == want


def test_emit_ptx_command(model_path, tmp_path):
    """`python -m llamir_cuda emit-ptx` writes the files and prints each one's ptxas report; a bad
    arch or a missing model is an error that says so."""
    import subprocess
    import sys

    def emit(*args):
        return subprocess.run([sys.executable, "-m", "llamir_cuda", "emit-ptx", *args], capture_output=True,
                              text=True)

    out = emit(str(model_path), "--arch", "sm_80", "--out", str(tmp_path / "ptx"), "--ptxas", "--n-ubatch", "32")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "kernels for sm_80" in out.stdout and "regs" in out.stdout
    assert len(list((tmp_path / "ptx").glob("*.ptx"))) == len(json.loads((tmp_path / "ptx" / "index.json")
                                                                     .read_text())["kernels"])
    bad = emit(str(model_path), "--arch", "sm_70", "--out", str(tmp_path / "x"))
    assert bad.returncode == 1 and "arch must be one of sm_80" in bad.stderr
    missing = emit(str(tmp_path / "none.gguf"), "--out", str(tmp_path / "y"))
    assert missing.returncode == 1 and "none.gguf" in missing.stderr
