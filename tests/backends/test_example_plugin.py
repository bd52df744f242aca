"""The worked example plugin (plugins/example), installed with pip and found through the
`llamir.backends` entry point: listed by `llamir backends`, the CPU's tokens and logits when the
model runs on it, a KV cache that stays in its memory (a generated token copies only the split
boundary's activations), and state, undo and K-shift through the buffer interface."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import llamir
from llamir.backends import BackendError, TensorData, get_backend
from llamir.backends.registry import reload_plugins
from llamir.cli import main
from llamir.frontend.placement import PlacementParams
from llamir.frontend.synth import SynthSpec, write_model

PLUGIN = Path(__file__).resolve().parents[2] / "plugins" / "example"
TOKENS = list(range(5, 45))


@pytest.fixture(scope="module")
def example():
    """pip install the plugin as a user would, then find it through its entry point. (Not as an
    editable install: that only takes effect in interpreters started after it.)"""
    import importlib

    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(PLUGIN)],
                   check=True, capture_output=True)
    importlib.invalidate_caches()
    reload_plugins()
    return get_backend("example")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("example") / "m.gguf", SynthSpec(n_layer=3, dtype="q8_0"))


@pytest.fixture(scope="module")
def model(model_path):
    return llamir.load_model(model_path)


def _ctx(model, devices=(), **kw):
    placement = PlacementParams(n_gpu_layers=99) if devices else None
    return llamir.Context(model, n_ctx=256, flash_attn="off", devices=list(devices), placement=placement, **kw)


def test_found_through_the_entry_point_and_listed(example, capsys):
    assert example.name == "example" and not example.is_cpu and not example.device.buffer_type().is_host
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "example: worked example plugin" in out and "example:0  example0" in out and "usable" in out
    fresh = subprocess.run([sys.executable, "-m", "llamir.cli", "backends"], capture_output=True, text=True, check=True)
    assert "example:0  example0" in fresh.stdout   # a new process finds it too


def test_run_gives_the_cpu_tokens(example, model_path, capsys):
    args = [str(model_path), "-p", "hello world", "-n", "10", "--temp", "0"]
    assert main(["run", *args]) == 0
    want = capsys.readouterr().out
    assert main(["run", *args, "--device", "example", "-ngl", "99"]) == 0
    assert capsys.readouterr().out == want


def test_logits_are_the_cpus_bit_for_bit(example, model):
    rows = []
    for devices in ((), ("example",)):
        ctx = _ctx(model, devices)
        assert ctx.decode(llamir.Batch.from_tokens(TOKENS, logits="all")) == 0, ctx.last_error
        first = ctx.get_logits().copy()
        assert ctx.decode(llamir.Batch.from_tokens([3], pos0=len(TOKENS))) == 0, ctx.last_error
        rows.append((first, ctx.get_logits().copy()))
    for got, want in zip(rows[1], rows[0]):
        np.testing.assert_array_equal(got, want)


def test_partial_offload_with_op_offload_gives_the_cpus_logits(example, model):
    """-ngl 1: the CPU's layers offload their big-batch matmuls to the device (op_offload), so a
    CPU split's node range holds views of device values; the CPU must not read them."""
    want = _logits_of(model, ())
    ctx = llamir.Context(model, n_ctx=256, flash_attn="off", devices=["example"],
                         placement=PlacementParams(n_gpu_layers=1))
    got = _logits_of(model, ctx=ctx)
    assert ctx.n_splits["pp"] > 2, ctx.n_splits
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def _logits_of(model, devices=(), ctx=None):
    ctx = ctx or _ctx(model, devices)
    assert ctx.decode(llamir.Batch.from_tokens(TOKENS, logits="all")) == 0, ctx.last_error
    first = ctx.get_logits().copy()
    assert ctx.decode(llamir.Batch.from_tokens([3], pos0=len(TOKENS))) == 0, ctx.last_error
    return first, ctx.get_logits().copy()


def test_a_generated_token_copies_only_the_split_boundary(example, model):
    ctx = _ctx(model, ("example",))
    device = ctx.runner.backends[0].device
    kv = ctx.memory.buffers
    assert kv and all(isinstance(t, TensorData) and t.buffer.buft is device.buffer_type() for t in kv.values())
    assert ctx.decode(llamir.Batch.from_tokens(TOKENS)) == 0, ctx.last_error
    before = (device.counters.bytes_to_device, device.counters.bytes_to_host)
    assert ctx.decode(llamir.Batch.from_tokens([3], pos0=len(TOKENS))) == 0, ctx.last_error
    copied_in = device.counters.bytes_to_device - before[0]
    copied_out = device.counters.bytes_to_host - before[1]
    # what the plan says crosses the boundary: the split inputs copied onto the device, and the
    # logits (the graph's output, computed there) read back
    result = ctx._prev
    plan = ctx.runner.plan(result.graph, ctx._last_bindings, 1)
    dev_index = next(i for i, b in enumerate(plan.backends) if b.device is device)
    boundary = sum(c.nbytes for s in plan.splits if s.backend == dev_index for c in s.copies)
    outputs = sum(int(np.prod([int(d) for d in n.type.shape])) * 4 for n in plan.graph.outputs.values()
                  if plan.backend_index(n) == dev_index)
    assert copied_in == boundary and copied_out == outputs
    assert copied_in + copied_out < ctx.memory.total_bytes() // 10   # the cache never moves


def test_state_undo_and_shift_go_through_the_device(example, model):
    """State saved from the device's KV cache loads into a CPU context (and back), and a K-shift
    of the device's cache gives the CPU's next logits."""
    dev, cpu = _ctx(model, ("example",)), _ctx(model)
    for ctx in (dev, cpu):
        assert ctx.decode(llamir.Batch.from_tokens(TOKENS)) == 0, ctx.last_error
    assert dev.state_get_data() == cpu.state_get_data()
    fresh = _ctx(model, ("example",))
    assert fresh.state_set_data(cpu.state_get_data()) > 0
    for ctx in (dev, cpu, fresh):
        ctx.memory.seq_rm(0, 4, 14)
        ctx.memory.seq_add(0, 14, -1, -10)
        assert ctx.decode(llamir.Batch.from_tokens([7], pos0=30)) == 0, ctx.last_error
    np.testing.assert_array_equal(dev.get_logits_ith(-1), cpu.get_logits_ith(-1))
    np.testing.assert_array_equal(fresh.get_logits_ith(-1), cpu.get_logits_ith(-1))


def test_device_memory_is_not_the_hosts(example):
    buft = example.device.buffer_type()
    buf = buft.alloc_buffer(64)
    assert buf.mapped() is None
    t = TensorData(buf, 0, (4, 4), np.dtype(np.float32), (16, 4), 64)
    t.write(np.arange(16, dtype=np.float32).reshape(4, 4))
    np.testing.assert_array_equal(t.read(), np.arange(16, dtype=np.float32).reshape(4, 4))
    with pytest.raises(BackendError, match="device memory, which the host cannot address"):
        t.array()
    with pytest.raises(BackendError, match=r"bytes \[48, 112\) are outside its 64 bytes"):
        TensorData(buf, 48, (4, 4), np.dtype(np.float32), (16, 4), 64).read()
    with pytest.raises(BackendError, match="cannot write a float64"):
        t.write(np.zeros((4, 4)))


def test_bad_specs_and_options_name_the_problem(example):
    from llamir.backends import SpecError, backend_from_spec

    assert backend_from_spec("example:0:offload=8").offload_batch == 8
    with pytest.raises(SpecError, match="devices 0..0, not 1"):
        backend_from_spec("example:1")
    with pytest.raises(SpecError, match="no option 'threads'"):
        backend_from_spec("example:threads=2")


def test_backend_ops_pass_on_the_device(example, capsys):
    import re

    assert main(["test-backend-ops", "-b", "example"]) == 0
    out = capsys.readouterr().out
    m = re.search(r"(\d+)/(\d+) tests passed", out)
    assert m and m.group(1) == m.group(2) and int(m.group(2)) > 200
    assert "SET_ROWS" in out and "MUL_MAT(type_a=q8_0" in out


def test_perplexity_and_bench_take_the_device(example, model_path, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 12)
    args = ["perplexity", str(model_path), "-f", str(text), "-c", "32"]
    assert main(args) == 0
    want = capsys.readouterr().out
    assert "Final estimate: PPL = " in want
    assert main([*args, "--device", "example", "-ngl", "99"]) == 0
    assert capsys.readouterr().out == want
    assert main(["bench", str(model_path), "-p", "8", "-n", "2", "--reps", "1", "--device", "example"]) == 0
    assert "devices example0 (splits: {'pp': 2, 'tg': 2" in capsys.readouterr().out
    assert main(["run", str(model_path), "-p", "hi", "-n", "2", "--device", "cpu"]) == 1
    assert "the CPU runs --backend llvm; give only devices" in capsys.readouterr().err
