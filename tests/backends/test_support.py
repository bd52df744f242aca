"""The Backend contract (an ABC: a device and supports_op required), support tables as data with
combinators, the one decomposition pass they drive, and registries: plugins found through entry
points, broken ones reported, specs NAME[:INDEX][:KEY=VALUE]."""

from __future__ import annotations

import numpy as np
import pytest

from llamir.backends import (
    Backend,
    BackendError,
    BackendReg,
    Device,
    DeviceType,
    SpecError,
    backend_from_spec,
    cpu_device,
    float_types,
    get_backend,
    numpy_table,
    registry,
)
from llamir.ir import F16, F32, GraphBuilder, Interpreter, ops
from llamir.passes.decompose import DecomposeUnsupported, decompose


def test_a_backend_must_say_its_device_and_what_it_supports():
    class NoSupport(Backend):
        name = "x"

    with pytest.raises(TypeError, match="supports_op"):
        NoSupport(cpu_device())

    class Minimal(Backend):
        name = "minimal"

        def supports_op(self, node):
            return node.is_op(ops.Add)

    with pytest.raises(TypeError):
        Minimal()   # no device: nothing defaults to being the CPU
    b = Minimal(Device("m0", DeviceType.GPU, 1 << 30))
    assert not b.is_cpu and b.cost_model is None and b.event_new() is None
    b.set_n_threads(4)   # optional hooks have defaults
    b.close()
    with pytest.raises(ValueError, match="n_threads must be >= 1"):
        b.set_n_threads(0)
    with pytest.raises(BackendError, match="cannot compile whole graphs"):
        b.compile(GraphBuilder("g").graph)


def test_tables_combine():
    numpy = numpy_table()
    gpu = numpy.only({"mul_mat", "add", "rms_norm"}).where(float_types({"f32"}))
    assert gpu.op_names() == ["add", "mul_mat", "rms_norm"]
    g = GraphBuilder("g")
    a32, a16 = g.input("a", [4], F32), g.input("b", [4], F16)
    add32, add16, mul = g.add(a32, a32), g.add(a16, a16), g.mul(a32, a32)
    assert gpu.claims(add32) and not gpu.claims(add16) and not gpu.claims(mul)
    assert (gpu | numpy.only({"mul"})).claims(mul) and not (gpu & numpy.only({"mul"})).claims(mul)
    assert not gpu.without(ops.Add).claims(add32)
    assert gpu.claims(a32)   # leaves (and views) are always supported
    with pytest.raises(ValueError, match="ops frobnicate are not in the table"):
        numpy.only({"frobnicate"})


def test_a_fused_op_is_supported_through_its_parts_and_decomposed_by_the_table():
    g = GraphBuilder("g")
    x, w = g.input("x", [3, 32], F32), g.weight("w", [32], F32)
    g.output("y", g.op(ops.RmsNormMul(eps=1e-5), x, w))
    graph = g.graph
    node = graph.outputs["y"]
    parts = numpy_table().without(ops.RmsNormMul)
    assert not parts.claims(node) and parts(node)          # runs it, as rms_norm then mul
    assert not parts.without(ops.RmsNorm)(node)
    xs, ws = np.random.default_rng(0).standard_normal((3, 32)).astype(np.float32), np.ones(32, np.float32)
    want = Interpreter().run(graph, {"x": xs, "w": ws})["y"]
    assert decompose(graph, numpy_table().claims) is False   # the numpy table claims the fused op
    assert decompose(graph, parts.claims) is True
    assert [n.op.name for n in graph.nodes] == ["rms_norm", "mul"]
    np.testing.assert_array_equal(Interpreter().run(graph, {"x": xs, "w": ws})["y"], want)
    assert DecomposeUnsupported().name == "decompose"


class _Reg(BackendReg):
    name = "fake"
    description = "a registry made in a test"

    def devices(self):
        return [Device("fake0", DeviceType.GPU, 1 << 30),
                Device("fake1", DeviceType.GPU, 1 << 30, unusable="no driver for it")]

    def init_backend(self, device, **options):
        return get_backend("null") if not options else (_ for _ in ()).throw(TypeError("no options"))


def test_plugins_through_entry_points_and_their_failures(monkeypatch, capsys):
    class Broken:
        def __init__(self):
            raise RuntimeError("libvulkan.so.1: cannot open shared object file")

    entry_points = {"fake": lambda: _Reg, "broken": lambda: Broken, "wrong": lambda: object()}
    monkeypatch.setattr(registry, "_plugins", entry_points)
    monkeypatch.setattr(registry, "_loaded", {})
    assert {"fake", "broken", "wrong"} <= set(registry.available_backends())
    assert backend_from_spec("fake:0").name == "null"
    with pytest.raises(SpecError, match=r"fake:1 \(fake1\) cannot be used: no driver for it"):
        backend_from_spec("fake:1")
    with pytest.raises(BackendError, match="failed to load: RuntimeError: libvulkan"):
        get_backend("broken")
    with pytest.raises(BackendError, match="gives a object, not a llamir.backends.BackendReg"):
        get_backend("wrong")
    from llamir.cli import main

    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "fake:1  fake1" in out and "not usable: no driver for it" in out
    assert "not usable: the plugin failed to load (BackendError: plugin backend 'broken' failed to load" in out
