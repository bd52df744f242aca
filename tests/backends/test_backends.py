"""Backends: device specs and their errors, the registry, sim and null devices, tensor copies."""

from __future__ import annotations

import numpy as np
import pytest

from llamir.backends import (
    BackendError,
    DeviceType,
    TensorData,
    available_backends,
    backend_from_spec,
    get_backend,
)
from llamir.backends.base import BufferType
from llamir.backends.registry import BUILTINS
from llamir.backends.sim import SimBackend, SimSpec, parse_sim_spec
from llamir.backends.sim.spec import SpecError, parse_size
from llamir.ir import F16, F32, I32, Q8_0, GraphBuilder


def test_spec_from_the_issue():
    spec = parse_sim_spec("sim:gpu0:ops=mul_mat,add,rms_norm:mem=2GiB")
    assert spec.name == "gpu0" and spec.ops == {"mul_mat", "add", "rms_norm"} and spec.mem == 2 << 30
    assert spec.offload_batch == 32 and not spec.host


def test_plain_sim_is_a_gpu_with_every_op():
    b = backend_from_spec("sim:gpu1")
    assert b.spec.ops is None and b.device.type == DeviceType.GPU and b.label == "gpu1"
    assert b.supports_buft(b.device.buffer_type())
    assert not b.supports_buft(backend_from_spec("cpu").device.buffer_type())


def test_spec_keys():
    spec = parse_sim_spec(
        "sim:x:ops=all,-soft_max_ext:types=f32,f16:offload=off:tflops=10:bw=500:link=16:"
        "latency=5:host=yes:events=no:async=no:align=64:mem=1.5GB"
    )
    assert spec.ops is not None and "soft_max_ext" not in spec.ops and "mul_mat" in spec.ops
    assert spec.types == {"f32", "f16"} and spec.offload_batch is None and spec.host
    assert (spec.cost.tflops, spec.cost.mem_gbps, spec.cost.link_gbps, spec.cost.latency_us) == (
        10,
        500,
        16,
        5,
    )
    assert not spec.events and not spec.async_ and spec.align == 64 and spec.mem == 1_500_000_000
    assert parse_size("512MiB") == 512 << 20 and parse_size("1000") == 1000


@pytest.mark.parametrize(
    "bad, message",
    [
        ("sim", "missing device name"),
        ("sim:", "missing device name"),
        ("sim:cpu", "invalid device name"),
        ("sim:g:mem", "is not KEY=VALUE"),
        ("sim:g:speed=3", "is not KEY=VALUE with KEY one of ops"),
        ("sim:g:ops=mul_mat,frobnicate", "unknown op 'frobnicate'"),
        ("sim:g:types=f33", "f33"),
        ("sim:g:mem=lots", "not a size"),
        ("sim:g:offload=-1", "must be >= 0"),
        ("sim:g:host=maybe", "expected yes or no"),
        ("sim:g:align=48", "power of two"),
        ("sim:g:tflops=0", "must be > 0"),
        ("sim:g:mem=1GiB:mem=2GiB", "mem given twice"),
        ("gpu7", "unknown backend 'gpu7'"),
        ("cpu:fast", "the CPU takes no options"),
        ("rocm:0:x", "unknown backend 'rocm'"),
        ("cuda:0:x", "'x' is not KEY=VALUE"),
        ("llvm:x", "neither a device index nor KEY=VALUE"),
        ("llvm:3", "devices 0..0, not 3"),
        ("llvm:fast=1", "no option 'fast'"),
        ("numpy:threads=0", "threads=0: must be >= 1"),
        ("numpy:threads=2:threads=3", "threads is given twice"),
    ],
)
def test_bad_specs_get_clear_errors(bad, message):
    with pytest.raises(SpecError, match=message) as info:
        backend_from_spec(bad)
    assert repr(bad) in str(info.value) or bad in ("sim",) or "missing" in message


def _node(op_builder):
    b = GraphBuilder("probe")
    return op_builder(b)


def test_sim_support_by_op_and_dtype():
    gpu = SimBackend(SimSpec("g", ops=frozenset({"mul_mat", "get_rows"}), types=frozenset({"f32", "f16"})))
    f16_mm = _node(lambda b: b.mul_mat(b.weight("w", [4, 8], F16), b.input("x", [2, 8], F32)))
    q8_mm = _node(lambda b: b.mul_mat(b.weight("w", [4, 32], Q8_0), b.input("x", [2, 32], F32)))
    rows = _node(lambda b: b.get_rows(b.weight("w", [4, 8], F16), b.input("i", [2], I32)))
    add = _node(lambda b: b.add(b.input("x", [2, 8], F32), b.input("y", [2, 8], F32)))
    assert gpu.supports_op(f16_mm) and gpu.supports_op(rows)  # i32 indices always pass
    assert not gpu.supports_op(q8_mm) and not gpu.supports_op(add)
    picky = SimBackend(SimSpec("p"), predicate=lambda n: n.op.name != "add")
    assert picky.supports_op(f16_mm) and not picky.supports_op(add)


def test_offload_op_uses_ggml_cuda_batch_sizes():
    gpu = backend_from_spec("sim:g")
    mm = lambda t: _node(lambda b: b.mul_mat(b.weight("w", [4, 8], F32), b.input("x", [t, 8], F32)))  # noqa: E731
    rows = _node(lambda b: b.get_rows(b.weight("w", [4, 8], F32), b.input("i", [512], I32)))
    assert gpu.offload_op(mm(32)) and not gpu.offload_op(mm(31)) and not gpu.offload_op(rows)
    assert not backend_from_spec("sim:g:offload=off").offload_op(mm(512))
    assert backend_from_spec("sim:g:offload=4").offload_op(mm(4))


def test_registry_keeps_llvm_and_adds_sim_and_null():
    assert {"numpy", "llvm", "sim", "null"} <= set(BUILTINS) <= set(available_backends())
    assert get_backend("sim").label == "sim" and get_backend("null").supports_op(None)
    with pytest.raises(BackendError, match="unknown backend 'nope'"):
        get_backend("nope")


def test_tensor_set_get_count_bytes_and_events():
    gpu = backend_from_spec("sim:g")
    buf = gpu.device.buffer_type().alloc_buffer(16)
    dst = TensorData(buf, 8, (8,), np.dtype(np.uint8), (1,), 8)
    gpu.set_tensor_async(dst, np.arange(8, dtype=np.uint8))
    assert list(gpu.get_tensor_async(dst)) == list(range(8)) and list(dst.read()) == list(range(8))
    assert (gpu.stats.bytes_in, gpu.stats.bytes_out) == (8, 8)
    event = gpu.event_new()
    event.record()
    event.wait(gpu)
    assert gpu.stats.events_recorded == 1 and gpu.stats.events_waited == 1
    assert backend_from_spec("sim:h:events=no").event_new() is None


def test_buffers():
    buft = BufferType("b", None, alignment=64)
    buf = buft.alloc_buffer(128)
    assert buf.view(64, 64).shape == (64,)
    with pytest.raises(BackendError, match=r"bytes \[100, 164\) are outside its 128 bytes"):
        buf.view(100, 64)
    with pytest.raises(ValueError, match="not a power of two"):
        BufferType("bad", None, alignment=3)


def test_numpy_backend_still_compiles_whole_graphs():
    b = GraphBuilder("g")
    x = b.input("x", [2, 3], F32)
    b.output("y", b.add(x, x))
    run = get_backend("numpy").compile(b.graph)
    out = run({"x": np.ones((2, 3), np.float32)}, {})
    assert np.array_equal(out["y"], np.full((2, 3), 2, np.float32))


def test_null_backend_runs_nothing_but_the_scheduler_walks_its_paths():
    from llamir.sched.scheduler import Scheduler, TensorBuffer

    b = GraphBuilder("g")
    x = b.input("x", [2, 3], F32)
    b.output("y", b.add(x, b.weight("w", [2, 3], F32)))
    null, cpu = backend_from_spec("null:n0"), backend_from_spec("cpu")
    sched = Scheduler([null, cpu], {"w": TensorBuffer(null.device.buffer_type())})
    scheduled = sched.alloc_graph(b.graph)
    assert [scheduled.plan.labels[s.backend] for s in scheduled.plan.splits] == ["n0"]
    out = sched.graph_compute(scheduled, {"x": np.ones((2, 3), np.float32), "w": np.ones((2, 3), np.float32)})
    assert null.stats.n_graph_computes == 1 and null.stats.bytes_in == 24
    assert not np.any(out["y"] == 2)  # x + w was never computed: y holds what its memory held
