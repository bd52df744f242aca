"""Property tests: random graphs on random device mixes. Every node runs on a backend that
supports it, splits are contiguous, copies are exactly the crossing inputs, the allocation has
no overlaps, and executing the plan gives the numpy interpreter's results bit for bit."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamir.backends import backend_from_spec
from llamir.ir import F32, GraphBuilder, Interpreter, ops
from llamir.sched.compute_buffers import check_allocation
from llamir.sched.plan import InputCopy
from llamir.sched.scheduler import Scheduler, TensorBuffer

OPS = ("add", "mul", "sub", "silu", "neg", "tanh", "rms_norm", "scale", "mul_mat", "cont", "soft_max_ext")
COLS = 8


@st.composite
def graphs(draw):
    rows = draw(st.sampled_from([1, 3, 33]))
    b = GraphBuilder("random")
    values = [b.input("x", [rows, COLS], F32)]
    weights = []
    for k in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(("unary", "binary", "norm", "scale", "matmul", "view", "softmax")))
        x = values[draw(st.integers(0, len(values) - 1))]
        if kind == "unary":
            y = b.op(draw(st.sampled_from([ops.Silu(), ops.Neg(), ops.Tanh()])), x)
        elif kind == "binary":
            other = values[draw(st.integers(0, len(values) - 1))]
            y = b.op(draw(st.sampled_from([ops.Add(), ops.Mul(), ops.Sub()])), x, other)
        elif kind == "norm":
            y = b.rms_norm(x, 1e-5)
        elif kind == "scale":
            y = b.scale(x, 0.5)
        elif kind == "matmul":
            w = b.weight(f"w{k}", [COLS, COLS], F32)
            weights.append(w.name)
            y = b.mul_mat(w, x)
        elif kind == "softmax":
            y = b.soft_max_ext(x, None, 1.0)
        else:
            y = b.cont(b.transpose(b.transpose(x)))
        values.append(y)
    b.output("out", values[-1])
    b.output("mid", values[len(values) // 2])
    return b.graph, rows, weights


@st.composite
def device_mixes(draw, weights):
    n = draw(st.integers(1, 3))
    devices = []
    for i in range(n):
        chosen = draw(st.sets(st.sampled_from(OPS)))
        threshold = draw(st.sampled_from(["32", "1", "off"]))
        devices.append(
            backend_from_spec(f"sim:gpu{i}:ops={','.join(sorted(chosen)) or 'cont'}:offload={threshold}")
        )
    cpu = backend_from_spec("cpu")
    buffers = {}
    for name in weights:  # each weight on a device that runs mul_mat, or in host memory
        homes = [d for d in devices if d.spec.ops is None or "mul_mat" in d.spec.ops] + [cpu]
        home = homes[draw(st.integers(0, len(homes) - 1))]
        buffers[name] = TensorBuffer(home.device.buffer_type())
    return devices + [cpu], buffers, draw(st.integers(1, 3))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_graphs_on_random_devices(data):
    graph, rows, weights = data.draw(graphs())
    backends, buffers, n_copies = data.draw(device_mixes(weights))
    sched = Scheduler(backends, buffers, n_copies=n_copies)
    scheduled = sched.alloc_graph(graph)
    plan = scheduled.plan

    for node in graph.nodes:  # every node on a backend that supports it
        assert plan.backend_of(node).supports_op(node), (node, plan.backend_of(node))

    assert plan.splits[0].i_start == 0 and plan.splits[-1].i_end == len(graph.nodes)
    for a, b in zip(plan.splits, plan.splits[1:], strict=False):  # contiguous, in topological order
        assert a.i_end == b.i_start and a.i_start < a.i_end
    for split in plan.splits:
        for node in plan.split_nodes(split):
            if not node.op.is_view:
                assert plan.assignment[id(node)] == split.backend

    def memory_of(value):
        if value.is_leaf and value.kind == "weight":
            return buffers.get(value.name, TensorBuffer(backends[-1].device.buffer_type())).buft
        root = value
        while not root.is_leaf and root.op.is_view:
            root = root.inputs[0]
        return backends[plan.assignment[id(root)]].device.buffer_type()

    expected = set()
    for split in plan.splits:  # a copy exactly where an input lives in memory the split cannot use
        backend = backends[split.backend]
        for node in plan.split_nodes(split):
            if node.op.is_view:
                continue
            for src, ref in zip(node.inputs, plan.inputs_of(node), strict=True):
                crosses = not backend.supports_buft(memory_of(src))
                assert isinstance(ref, InputCopy) == crosses, (node, src)
                if crosses:
                    assert ref.src is src and ref.backend == split.backend and ref.copy == plan.cur_copy
                    expected.add((id(src), split.backend))
    assert plan.n_split_copies == len(expected)

    check_allocation(scheduled.alloc_graph, scheduled.allocation, sched.compute_buffers.galloc.allocs)
    rng = np.random.default_rng(0)
    values = {
        leaf.name: rng.standard_normal([int(d) for d in leaf.type.shape]).astype(np.float32)
        for leaf in graph.leafs
    }
    got = sched.graph_compute(scheduled, values)
    want = Interpreter().run(graph, values)
    for name in want:
        assert np.array_equal(got[name], want[name], equal_nan=True), name


def test_a_strided_view_crossing_devices_keeps_its_layout():
    """A transposed or permuted view computed on the CPU and read by a device split is copied with
    its strides (ggml_dup_tensor_layout), so the device reads the same elements (t5 and mamba
    transpose activations into device layers)."""
    from llamir.backends import get_backend

    rng = np.random.default_rng(0)
    for make in (lambda b, s: b.transpose(s), lambda b, s: b.permute(s, 2, 0, 1)):
        b = GraphBuilder("view_copy")
        s = b.scale(b.input("x", [3, 4, 5], F32), 2.0)
        z = b.cont(make(b, s))
        b.output("out", b.mul_mat(b.weight("w", [6, z.shape[-1]], F32), z))
        gpu = backend_from_spec("sim:gpu0:ops=cont,mul_mat:offload=off")
        sched = Scheduler([gpu, get_backend("numpy")], {"w": TensorBuffer(gpu.device.buffer_type())})
        values = {"x": rng.standard_normal((3, 4, 5)).astype(np.float32),
                  "w": rng.standard_normal((6, z.shape[-1])).astype(np.float32)}
        scheduled = sched.alloc_graph(b.graph)
        assert scheduled.plan.n_splits == 2
        got = sched.graph_compute(scheduled, values)["out"]
        assert np.array_equal(got, Interpreter().run(b.graph, values)["out"])
