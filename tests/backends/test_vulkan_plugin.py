"""The Vulkan plugin (plugins/vulkan) on Mesa's lavapipe, under the Khronos validation layer
(tests/conftest.py turns it on for the whole suite; any message it reports fails the test that
caused it). Found through its entry point; test-backend-ops passes for every op it claims;
models give llama.cpp's logits within tolerance on the device alone and split with the CPU;
the KV cache stays in device memory; command buffers are replayed while the graph is reused;
staging, split bindings, a missing driver or compiler, and the shader cache.

It needs no GPU: .ci/run installs lavapipe, glslc and the validation layer, so a machine
without them fails here rather than skipping.
"""

from __future__ import annotations

import os
import subprocess
import sys

import llamir_vulkan  # pip install -e plugins/vulkan (.ci/run does); missing, the module fails
import numpy as np
import pytest

import llamir
from llamir.backends import get_backend, get_registry
from llamir.cli import main
from llamir.frontend.placement import PlacementParams
from llamir.frontend.synth import SynthSpec, write_model
from llamir.testing.backend_ops import run_backend_ops
from llamir.testing.conformance import Case, llama_cpp_logits, llamir_logits

TOKENS = list(range(5, 45))
# mul_mat rounds b to the weight's vec_dot_type bit for bit as ggml's CPU does, but the device
# sums in another order (tiles, shared-memory reductions, its own exp): an f16 KV cache or a q8
# rounding of the activations then flips now and then, one quantum each, and the flips spread
# through the later quantized matmuls. Measured on the conformance models: f32/f16 weights
# <= 6e-8, quantized <= 1.6e-4 (one row of 40 with another argmax, q6_k); flash attention
# (f16 V accumulated in f32 here, in f16 by the CPU) 2.5e-4.
FLOAT_NMSE, QUANT_NMSE = 1e-6, 1e-3


@pytest.fixture(autouse=True)
def no_validation_messages():
    """Every test leaves the validation layer silent."""
    before = len(llamir_vulkan.validation_messages())
    yield
    new = llamir_vulkan.validation_messages()[before:]
    assert not new, "Vulkan validation layer:\n" + "\n".join(m[:400] for m in new[:5])


@pytest.fixture(scope="module")
def vulkan():
    device = get_registry("vulkan").devices()[0]
    assert not device.unusable, f"the Vulkan device is not usable: {device.unusable}"
    return get_backend("vulkan")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("vulkan") / "m.gguf", SynthSpec(n_layer=3, dtype="q8_0"))


@pytest.fixture(scope="module")
def model(model_path):
    return llamir.load_model(model_path)


def _nmse(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sum((a - b) ** 2) / np.sum(b * b))


def _logits(model, devices=(), placement=None, backend="llvm", **kw):
    """A 40-token prompt (every row), then one generated token: both logits blocks."""
    ctx = llamir.Context(model, n_ctx=256, flash_attn=kw.pop("flash_attn", "off"), backend=backend,
                         devices=list(devices), placement=placement, **kw)
    assert ctx.decode(llamir.Batch.from_tokens(TOKENS, logits="all")) == 0, ctx.last_error
    first = ctx.get_logits().copy()
    assert ctx.decode(llamir.Batch.from_tokens([3], pos0=len(TOKENS))) == 0, ctx.last_error
    return ctx, [first, ctx.get_logits_ith(-1).copy()]


# -- the plugin ------------------------------------------------------------------------------------
def test_found_through_the_entry_point_and_listed(vulkan, capsys):
    assert vulkan.name == "vulkan" and not vulkan.is_cpu and not vulkan.device.buffer_type().is_host
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "vulkan:0  vulkan0" in out and "llvmpipe" in out


@pytest.mark.parametrize("env, reason", [
    ({"LLAMIR_GLSLC": "/nonexistent/glslc"}, "LLAMIR_GLSLC=/nonexistent/glslc is not an executable glslc"),
    ({"VK_ICD_FILENAMES": "/nonexistent.json", "VK_DRIVER_FILES": "/nonexistent.json"}, "no Vulkan driver"),
])
def test_a_missing_compiler_or_driver_is_a_device_not_usable(env, reason):
    """`llamir backends` still works and says why; asking for the device fails with the reason."""
    run = dict(os.environ, **env)
    listed = subprocess.run([sys.executable, "-m", "llamir.cli", "backends"], capture_output=True, text=True,
                            env=run, check=True)
    assert "not usable" in listed.stdout and reason in listed.stdout, listed.stdout
    asked = subprocess.run([sys.executable, "-m", "llamir.cli", "test-backend-ops", "-b", "vulkan", "-o", "add"],
                           capture_output=True, text=True, env=run)
    assert asked.returncode != 0 and reason in asked.stdout + asked.stderr


def test_backend_ops_all_pass(vulkan):
    """ggml's test-backend-ops over every registered op: each case the backend claims matches
    the numpy reference within ggml's per-op bound."""
    report = run_backend_ops(vulkan)
    assert report.ok, "\n".join(r.line() for r in report.failures)
    claimed = {r.op for r in report.results if r.status != "not supported"}
    # what the issue asks of it, by op name
    for op in ("get_rows", "rms_norm", "rms_norm_mul", "norm", "norm_mul_add", "add", "mul", "scale", "silu",
               "swiglu", "rope_ext", "soft_max_ext", "flash_attn_ext", "set_rows", "cpy", "cont", "mul_mat",
               "mul_mat_id"):
        assert op in claimed, f"{op} is not supported"
    dtypes = {r.params.split(",")[0] for r in report.results if r.op == "mul_mat" and r.status == "OK"}
    for t in ("type_a=f32", "type_a=f16", "type_a=q8_0", "type_a=q4_0", "type_a=q4_1", "type_a=q4_k",
              "type_a=q6_k"):
        assert t in dtypes, f"mul_mat {t} does not pass"


@pytest.mark.parametrize("env", [{"LLAMIR_VULKAN_STAGING": "1"}, {"LLAMIR_VULKAN_MAX_BINDING": "4096"}],
                         ids=["staging", "split-bindings"])
def test_backend_ops_through_staging_and_split_bindings(env):
    """Device memory the host cannot map (every transfer through a staging buffer, as on a
    discrete GPU), and weights larger than one binding (bound in row chunks)."""
    run = dict(os.environ, **env)
    out = subprocess.run([sys.executable, "-m", "llamir.cli", "test-backend-ops", "-b", "vulkan", "-o", "mul_mat",
                          "-o", "get_rows", "-o", "set_rows", "-o", "rms_norm_mul"], capture_output=True,
                         text=True, env=run)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "FAIL" not in out.stdout


# -- whole models ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["f32", "f16", "q8_0", "q4_0", "q4_1", "q4_k", "q6_k"])
def test_model_matches_llama_cpp(vulkan, conformance_model, dtype):
    """The conformance models on the device alone (every layer; the CPU runs only what the
    device does not): llama.cpp's logits within tolerance, prompt at once and token by token."""
    path = conformance_model(Case("llama", dtype, 2, dtype in ("f16", "q4_0")))
    model = llamir.load_model(path)
    for mode in ("batch", "incremental"):
        got = llamir_logits(model, mode, "vulkan")
        want = llama_cpp_logits(path, mode)
        assert _nmse(got, want) < (FLOAT_NMSE if dtype in ("f32", "f16") else QUANT_NMSE), (mode, _nmse(got, want))
        assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.95


@pytest.mark.parametrize("spec", [SynthSpec(arch="mamba", n_layer=2, n_embd=64, seed=3),
                                  SynthSpec(arch="jamba", n_layer=3, n_embd=64, n_head=4, n_head_kv=2, seed=5)],
                         ids=["mamba", "jamba"])
def test_recurrent_models_match_llama_cpp(vulkan, tmp_path, spec):
    """Recurrent state in device memory; ssm_conv and ssm_scan, which the device does not run,
    on the CPU between its splits: llama.cpp's logits within tolerance."""
    path = write_model(tmp_path / "m.gguf", spec)
    model = llamir.load_model(path)
    for mode in ("batch", "incremental"):
        got, want = llamir_logits(model, mode, "vulkan"), llama_cpp_logits(path, mode)
        assert _nmse(got, want) < FLOAT_NMSE, (mode, _nmse(got, want))


@pytest.mark.parametrize("placement", [
    PlacementParams(n_gpu_layers=1), PlacementParams(n_gpu_layers=2),
    PlacementParams(n_gpu_layers=99, overrides=((r"ffn_.*", "cpu"),)),
], ids=["ngl1", "ngl2", "ffn-on-cpu"])
def test_mixed_cpu_and_vulkan_splits_match_the_cpu(vulkan, model, placement):
    _, want = _logits(model)
    ctx, got = _logits(model, ["vulkan"], placement)
    assert ctx.n_splits["pp"] >= 2, ctx.n_splits
    for g, w in zip(got, want, strict=True):
        assert _nmse(g, w) < QUANT_NMSE


def test_backend_vulkan_in_context_and_flash_attention(vulkan, model):
    """Context(backend="vulkan") offloads every layer; flash attention on the device too."""
    _, want = _logits(model)
    for fa in ("off", "on"):
        ctx, got = _logits(model, backend="vulkan", flash_attn=fa)
        (cg,) = ctx.runner.graphs.values()
        assert cg.placement.layer_device == ["vulkan0"] * 3
        for g, w in zip(got, want, strict=True):
            assert _nmse(g, w) < QUANT_NMSE, fa


def test_run_on_the_device_gives_the_cpu_tokens(vulkan, model_path, capsys):
    args = [str(model_path), "-p", "hello world", "-n", "12", "--temp", "0"]
    assert main(["run", *args]) == 0
    want = capsys.readouterr().out
    assert main(["run", *args, "--device", "vulkan", "-ngl", "99"]) == 0
    assert capsys.readouterr().out == want


def test_kv_cache_lives_in_device_memory_and_recordings_are_replayed(vulkan, model):
    """The offloaded layers' K and V are Vulkan buffers; generated tokens replay the command
    buffers recorded for the reused graph instead of recording new ones."""
    from llamir_vulkan.backend import VulkanBuffer

    ctx = llamir.Context(model, n_ctx=256, flash_attn="off", backend="vulkan")
    assert ctx.decode(llamir.Batch.from_tokens(TOKENS, logits="last")) == 0, ctx.last_error
    (cache,) = ctx.memory.caches
    assert {type(getattr(t, "buffer", t)) for t in cache.tensors.values()} == {VulkanBuffer}
    backend = ctx.runner.backends[0]
    token = int(np.argmax(ctx.get_logits_ith(-1)))
    counts = []
    for i in range(6):
        assert ctx.decode(llamir.Batch.from_tokens([token], pos0=len(TOKENS) + i)) == 0, ctx.last_error
        token = int(np.argmax(ctx.get_logits_ith(-1)))
        counts.append(backend.n_recorded)
    assert counts[-1] == counts[1], counts   # after the first generated token, only replays


def test_state_save_and_load_through_device_memory(vulkan, model):
    """The state blob of a context whose cache is on the device restores the same logits."""
    ctx = llamir.Context(model, n_ctx=256, flash_attn="off", backend="vulkan")
    assert ctx.decode(llamir.Batch.from_tokens(TOKENS, logits="last")) == 0
    blob = ctx.state_get_data()
    assert ctx.decode(llamir.Batch.from_tokens([7], pos0=len(TOKENS))) == 0
    want = ctx.get_logits_ith(-1).copy()
    other = llamir.Context(model, n_ctx=256, flash_attn="off", backend="vulkan")
    other.state_set_data(blob)
    assert other.decode(llamir.Batch.from_tokens([7], pos0=len(TOKENS))) == 0
    np.testing.assert_allclose(other.get_logits_ith(-1), want, rtol=0, atol=1e-5)


def test_shader_cache_compiles_each_variant_once(tmp_path, monkeypatch):
    from llamir_vulkan.kernels_elementwise import storage
    from llamir_vulkan.shaders import ShaderCompiler, ShaderError

    from llamir.ir import F16, F32

    monkeypatch.setenv("LLAMIR_VULKAN_CACHE", str(tmp_path))
    first = ShaderCompiler()
    code = first.spirv("unary", {"OP_SILU": 1, **storage("A", F32), **storage("D", F32)})
    assert code[:4] == b"\x03\x02\x23\x07" and first.n_compiled == 1   # the SPIR-V magic number
    again = ShaderCompiler()
    assert again.spirv("unary", {"OP_SILU": 1, **storage("A", F32), **storage("D", F32)}) == code
    assert again.n_compiled == 0
    again.spirv("unary", {"OP_SILU": 1, **storage("A", F16), **storage("D", F32)})
    assert again.n_compiled == 1
    with pytest.raises(ShaderError, match="glslc failed on unary.comp"):
        again.spirv("unary", {"OP_NO_SUCH_OP": 1, **storage("A", F32), **storage("D", F32)})


def test_precompile_compiles_the_cases_variants_side_by_side(tmp_path, monkeypatch):
    """test-backend-ops' precompile: every variant its cases use (those with dims too, laid out
    under their bindings) compiled in one batch, two glslc at a time; the cases then compile
    nothing more."""
    import threading
    import time

    from llamir_vulkan.shaders import ShaderCompiler

    from llamir.testing.backend_ops import all_cases

    monkeypatch.setenv("LLAMIR_VULKAN_CACHE", str(tmp_path))
    monkeypatch.setenv("LLAMIR_VULKAN_COMPILE_WORKERS", "2")
    be = get_backend("vulkan")
    be.compiler = ShaderCompiler()
    running, most, lock = [0], [0], threading.Lock()
    compile_one = ShaderCompiler._compile

    def watched(self, name, defines):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)
        try:
            return compile_one(self, name, defines)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(ShaderCompiler, "_compile", watched)
    cases = all_cases(["silu", "rms_norm", "rope_ext", "add"])
    assert any(case.graph.dim_names for case in cases)
    n = be.precompile([case.graph for case in cases], [dict(case.bindings) for case in cases])
    assert n == be.compiler.n_compiled >= 8 and most[0] == 2
    report = run_backend_ops(be, cases=cases)
    assert report.ok and be.compiler.n_compiled == n, "a case compiled a variant precompile missed"
    assert len(list(tmp_path.glob("*.spv"))) == n


def test_compile_workers_must_be_a_positive_count(monkeypatch):
    from llamir_vulkan.shaders import ShaderError, compile_workers

    monkeypatch.setenv("LLAMIR_VULKAN_COMPILE_WORKERS", "0")
    with pytest.raises(ShaderError, match="LLAMIR_VULKAN_COMPILE_WORKERS=0 is not a positive integer"):
        compile_workers()
