"""Golden split plans (text): small graphs and a 2-layer llama on several device mixes.

The goldens are read against llama.cpp's behaviour by eye once (split boundaries, causes, copy
names "<backend>#<tensor>#<copy>"), then guard against drift; `pytest --update-golden` rewrites.
"""

from __future__ import annotations

import pytest
from sched_helpers import N_CTX

from llamir.backends import backend_from_spec
from llamir.cli_splits import plan_model
from llamir.frontend.placement import PlacementParams
from llamir.ir import F32, GraphBuilder, ops
from llamir.sched.scheduler import Scheduler, TensorBuffer


def small_graph(rows: int):
    b = GraphBuilder("small")
    x = b.input("x", [rows, 8], F32)
    w_up, w_down = b.weight("w_up", [16, 8], F32), b.weight("w_down", [8, 16], F32)
    norm_w = b.weight("norm_w", [8], F32)
    h = b.mul(b.rms_norm(x, 1e-5, name="norm"), norm_w, name="normed")  # [rows, 8]
    up = b.mul_mat(w_up, h, name="up")  # [rows, 16]
    act = b.op(ops.Silu(), up, name="act")
    t = b.transpose(act)  # [16, rows] view
    back = b.cont(b.transpose(t), name="back")  # [rows, 16]
    down = b.mul_mat(w_down, back, name="down")  # [rows, 8]
    b.output("out", b.add(down, x, name="residual"))
    return b.graph


SMALL_CASES = {
    "gpu_weights": ("sim:gpu0", {"w_up": "gpu0", "w_down": "gpu0", "norm_w": "gpu0"}, 4),
    "no_silu": ("sim:gpu0:ops=all,-silu", {"w_up": "gpu0", "w_down": "gpu0", "norm_w": "gpu0"}, 4),
    "host_weights_offload": ("sim:gpu0", {}, 64),
    "host_weights_small_batch": ("sim:gpu0", {}, 4),
    "accel_in_host_memory": ("sim:blas:host=yes:ops=mul_mat", {}, 64),
}


@pytest.mark.parametrize("case", sorted(SMALL_CASES))
def test_small_graph_plans(golden, case):
    spec, where, rows = SMALL_CASES[case]
    gpu, cpu = backend_from_spec(spec), backend_from_spec("cpu")
    buffers = {name: TensorBuffer(gpu.device.buffer_type()) for name, dev in where.items()}
    sched = Scheduler([gpu, cpu], buffers)
    plan = sched.split_graph(small_graph(rows))
    text = plan.to_text() + plan.explain("back") + plan.explain("down")
    sched.reserve(small_graph(rows))
    text += "compute buffers: " + ", ".join(f"{k} {v}" for k, v in sched.buffer_sizes().items()) + "\n"
    golden(f"splits_small_{case}.txt", text)


LLAMA_CASES = {
    "full_offload": (["sim:gpu0"], PlacementParams(), 1),
    "ngl1_batch512": (["sim:gpu0"], PlacementParams(n_gpu_layers=1), 512),
    "cpu_ffn_override": (["sim:gpu0"], PlacementParams(overrides=((r"blk\.1\.ffn_.*", "cpu"),)), 1),
    "two_gpus": (["sim:gpu0", "sim:gpu1"], PlacementParams(tensor_split=(1.0, 2.0)), 1),
    "gpu_without_softmax": (["sim:gpu0:ops=all,-soft_max_ext"], PlacementParams(), 1),
}


@pytest.mark.parametrize("case", sorted(LLAMA_CASES))
def test_llama_plans(golden, tiny_llama, case):
    specs, params, n_tokens = LLAMA_CASES[case]
    devices = [backend_from_spec(s) for s in specs] + [backend_from_spec("cpu")]
    n_ctx = max(N_CTX, n_tokens)
    report = plan_model(tiny_llama, devices, params, n_tokens=n_tokens, n_ctx=n_ctx, n_ubatch=n_ctx)
    text = report.placement.summary() + report.plan.to_text() + report.plan.explain("result_output")
    text += "compute buffers: " + ", ".join(f"{k} {v}" for k, v in report.compute.items()) + "\n"
    golden(f"splits_llama_{case}.txt", text)
