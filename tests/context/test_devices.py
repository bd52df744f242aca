"""A context on simulated devices: the same logits as the CPU alone, llama.cpp's placement and
reservation, flash_attn=auto resolved by where attention was scheduled, and the memory table."""

from __future__ import annotations

import io

import numpy as np
import pytest

import llamir
from llamir.frontend.placement import PlacementError, PlacementParams
from llamir.frontend.synth import SynthSpec, write_model

TOKENS = list(range(5, 45))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return llamir.load_model(write_model(tmp_path_factory.mktemp("dev") / "m.gguf",
                                         SynthSpec(n_layer=3, dtype="q8_0")))


def _logits(model, **kw):
    ctx = llamir.Context(model, n_ctx=256, **kw)
    assert ctx.decode(llamir.Batch.from_tokens(TOKENS, logits="all")) == 0, ctx.last_error
    rows = [ctx.get_logits().copy()]
    assert ctx.decode(llamir.Batch.from_tokens([3], pos0=len(TOKENS))) == 0
    rows.append(ctx.get_logits().copy())
    return ctx, rows


@pytest.mark.parametrize("devices,placement", [
    (["sim:gpu0"], None),
    (["sim:gpu0"], PlacementParams(n_gpu_layers=2)),
    (["sim:gpu0", "sim:gpu1"], PlacementParams(tensor_split=(1.0, 2.0))),
    (["sim:gpu0:ops=all,-soft_max_ext"], None),
    (["sim:gpu0"], PlacementParams(overrides=((r"blk\.1\.ffn_.*", "cpu"),))),
])
def test_devices_give_the_cpu_logits_bit_for_bit(model, devices, placement):
    _, want = _logits(model, flash_attn="off")
    ctx, got = _logits(model, flash_attn="off", devices=devices, placement=placement)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert ctx.n_splits["pp"] >= 2 and ctx.n_splits["tg"] >= 2


def test_full_offload_gives_two_splits(model):
    ctx = llamir.Context(model, n_ctx=256, flash_attn="off", devices=["sim:gpu0"])
    assert ctx.n_splits["tg"] == 2   # the embedding lookup stays on the CPU


def test_flash_attn_auto_follows_the_device(model):
    assert llamir.Context(model, n_ctx=256, devices=["sim:gpu0"]).cparams.flash_attn is True
    no_fa = llamir.Context(model, n_ctx=256, devices=["sim:gpu0:ops=all,-flash_attn_ext"])
    assert no_fa.cparams.flash_attn is False     # attention would leave the layer's device


def test_too_little_device_memory_is_a_clear_error(model):
    with pytest.raises(PlacementError, match="not enough memory on gpu0"):
        llamir.Context(model, n_ctx=256, devices=["sim:gpu0:mem=1KiB"])


def test_memory_breakdown(model):
    ctx = llamir.Context(model, n_ctx=256, flash_attn="off", devices=["sim:gpu0:mem=1GiB"],
                         placement=PlacementParams(n_gpu_layers=2))
    mb = ctx.memory_breakdown()
    weights = sum(t.n_bytes for t in model.tensors.values())
    assert mb["gpu0"]["model"] + mb["cpu"]["model"] >= weights   # a tied/duplicated output may count twice
    assert mb["gpu0"]["context"] + mb["cpu"]["context"] == sum(b.nbytes for b in ctx.memory.buffers.values())
    assert mb["gpu0"]["compute"] > 0 and mb["cpu"]["compute"] > 0
    out = io.StringIO()
    ctx.memory_breakdown_print(out)
    lines = out.getvalue().splitlines()
    assert "memory breakdown [MiB]" in lines[0] and "gpu0" in lines[1] and "Host" in lines[2]
