"""Context parameters resolved like llama_context's constructor, the seeds' error paths, graph
reuse while generating, perf counters and the eval callback."""

from __future__ import annotations

import numpy as np
import pytest

import llamir
from llamir.context import ContextParamsError
from llamir.frontend.synth import SynthSpec, write_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return llamir.load_model(write_model(tmp_path_factory.mktemp("params") / "m.gguf", SynthSpec(n_layer=2)))


def test_n_ctx_padding_and_batch_caps(model):
    c = llamir.Context(model, n_ctx=300, n_batch=1000, n_ubatch=4000).cparams
    assert c.n_ctx == 512 and c.n_batch == 300 and c.n_ubatch == 300   # n_batch capped by n_ctx before padding
    c = llamir.Context(model, n_ctx=1000, n_seq_max=3).cparams          # not unified: per-sequence streams
    assert c.n_ctx_seq == 512 and c.n_ctx == 1536
    c = llamir.Context(model, n_ctx=1000, n_seq_max=3, kv_unified=True).cparams
    assert c.n_ctx_seq == c.n_ctx == 1024
    assert llamir.Context(model, n_ctx=0).cparams.n_ctx == model.hparams.n_ctx_train


def test_seed_error_paths(model):
    with pytest.raises(ContextParamsError, match="n_seq_max must be <= 256"):
        llamir.Context(model, n_seq_max=257)
    with pytest.raises(ContextParamsError, match="quantized V cache requires flash_attn to be enabled"):
        llamir.Context(model, type_v="q8_0", flash_attn="off")
    with pytest.raises(ContextParamsError, match="K cache type q8_0 with block size 32 does not divide n_embd_head_k"):
        llamir.Context(model, type_k="q8_0", flash_attn="on")
    llamir.Context(model, type_k="q8_0", flash_attn="off")  # a quantized K alone works without flash attention
    with pytest.raises(ContextParamsError, match="flash_attn must be auto, on or off"):
        llamir.Context(model, flash_attn="maybe")


def test_flash_attn_auto_resolves_on_a_backend_that_supports_it(model):
    assert llamir.Context(model, flash_attn="auto").cparams.flash_attn is True
    assert llamir.Context(model, flash_attn="off").cparams.flash_attn is False


def _generate(model, n, monkeypatch=None):
    ctx = llamir.Context(model, n_ctx=256, flash_attn="off")
    assert ctx.decode(llamir.Batch.from_tokens([5, 6, 7, 8])) == 0
    rows = []
    for i in range(n):
        assert ctx.decode(llamir.Batch.from_tokens([9 + i], pos0=4 + i)) == 0
        rows.append(ctx.get_logits_ith(-1).copy())
    return ctx, np.stack(rows)


def test_graph_reuse_happens_and_changes_nothing(model, monkeypatch):
    ctx, rows = _generate(model, 6)
    assert ctx.perf()["n_reused"] == 5          # every generation step after the first
    monkeypatch.setenv("LLAMIR_GRAPH_REUSE_DISABLE", "1")
    ctx_off, rows_off = _generate(model, 6)
    assert ctx_off.perf()["n_reused"] == 0
    np.testing.assert_array_equal(rows, rows_off)


def test_perf_counts_prompt_and_generation(model, capsys):
    ctx = llamir.Context(model, n_ctx=256, no_perf=False, flash_attn="off")
    assert ctx.decode(llamir.Batch.from_tokens([1, 2, 3, 4, 5])) == 0
    for i in range(3):
        assert ctx.decode(llamir.Batch.from_tokens([6], pos0=5 + i)) == 0
    perf = ctx.perf()
    assert perf["n_p_eval"] == 5 and perf["n_eval"] == 3 and perf["t_eval_ms"] > 0
    ctx.perf_print()
    assert "prompt eval time" in capsys.readouterr().err
    ctx.perf_reset()
    assert ctx.perf()["n_eval"] == 1  # llama.cpp reports at least 1


def test_eval_callback_sees_named_tensors(model):
    ctx = llamir.Context(model, n_ctx=256, flash_attn="off")
    asked, seen = [], {}

    def cb(name, value, ask):
        if ask:
            asked.append(name)
            return name.startswith("attn_norm")
        seen[name] = value.copy()
        return True

    ctx.cb_eval = cb
    assert ctx.decode(llamir.Batch.from_tokens([1, 2, 3])) == 0
    assert {"attn_norm-0", "attn_norm-1"} <= set(seen) and "result_output" in asked
    assert seen["attn_norm-0"].shape == (3, 64)


def test_backend_defaults_and_thread_counts(model):
    """The default CPU backend is llvm (as the CLI's); a backend instance keeps its own thread count
    unless n_threads is asked for; by name, the backend gets the affinity count."""
    import os

    from llamir.backends.llvm import LLVMBackend
    from llamir.ir.numerics import host_numerics

    ctx = llamir.Context(model)
    assert ctx.backend.name == "llvm" and ctx.backend.numerics == host_numerics()
    assert ctx.cparams.n_threads == ctx.backend.n_threads == len(os.sched_getaffinity(0))
    one = LLVMBackend(n_threads=1, disk_cache=False)
    assert llamir.Context(model, backend=one).backend.n_threads == 1
    assert llamir.Context(model, backend=one, n_threads=2).backend.n_threads == 2
    assert llamir.Context(model, backend="numpy", n_threads=3).backend.n_threads == 3
    one.close()


def test_numerics_choice(model):
    from llamir.backends.numpy import NumpyBackend

    ctx = llamir.Context(model, backend="numpy", numerics="avx2")
    assert ctx.backend.numerics.name == "avx2"
    assert llamir.Context(model, backend=NumpyBackend(numerics="avx2"), numerics="avx2").backend.numerics.name == "avx2"
    with pytest.raises(ContextParamsError, match="numerics=avx512 was asked for, but the backend numpy reproduces"):
        llamir.Context(model, backend=NumpyBackend(numerics="avx2"), numerics="avx512")
    with pytest.raises(ValueError, match="unknown numerics profile 'sse'; choose one of avx512, avx2"):
        llamir.Context(model, backend="numpy", numerics="sse")
