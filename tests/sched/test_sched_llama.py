"""The scheduler on a 2-layer llama: llama.cpp's split counts, op_offload, overrides, pipeline
copies, and scheduled execution over allocated memory equal to the numpy reference."""

from __future__ import annotations

import numpy as np
import pytest
from sched_helpers import N_CTX, batch_values

from llamir.backends import backend_from_spec
from llamir.cli_splits import graph_config, reserve_batches
from llamir.frontend.placement import PlacementError, PlacementParams, place_model
from llamir.ir import Interpreter
from llamir.ir.bind import bind_dims
from llamir.sched.compute_buffers import check_allocation
from llamir.sched.scheduler import SchedError, Scheduler


def setup(model, specs=("sim:gpu0",), n_tokens=1, n_out=1, **params):
    devices = [backend_from_spec(s) for s in specs] + [backend_from_spec("cpu")]
    built = model.build_graph(graph_config(model, N_CTX, False))
    graph = built.graph
    placement = place_model(model, built, devices, PlacementParams(**params))
    placement.apply(graph)
    bound = bind_dims(graph, {"T": n_tokens, "n_kv": N_CTX, "n_out": n_out})
    return placement, bound


def plan_of(model, specs=("sim:gpu0",), n_tokens=1, op_offload=True, n_copies=1, **params):
    placement, bound = setup(model, specs, n_tokens, **params)
    sched = Scheduler(placement.backends, placement.buffers(), op_offload=op_offload, n_copies=n_copies)
    return sched.split_graph(bound, placement.pins(bound, n_tokens))


def backends_of_splits(plan) -> list[str]:
    return [plan.labels[s.backend] for s in plan.splits]


def test_full_offload_gives_two_splits_with_embedding_lookup_on_cpu(tiny_llama):
    plan = plan_of(tiny_llama)
    assert backends_of_splits(plan) == ["cpu", "gpu0"]
    first = [n for n in plan.split_nodes(plan.splits[0]) if not n.op.is_view]
    assert [n.op.name for n in first] == ["get_rows"]
    assert plan.causes[id(first[0])].code == "1.wgt"


@pytest.mark.parametrize(
    "ngl, layers, output",
    [
        (0, ["cpu", "cpu"], "cpu"),
        (1, ["cpu", "cpu"], "gpu0"),
        (2, ["cpu", "gpu0"], "gpu0"),
        (3, ["gpu0", "gpu0"], "gpu0"),
        (99, ["gpu0", "gpu0"], "gpu0"),
    ],
)
def test_n_gpu_layers_counts_the_output_layer(tiny_llama, ngl, layers, output):
    placement, _ = setup(tiny_llama, n_gpu_layers=ngl)
    assert placement.layer_device == layers and placement.output_device == output
    assert placement.weights["token_embd.weight"].device == "cpu"
    assert placement.weights["output.weight"].device == output  # the tied output's own copy
    assert placement.weights["blk.1.attn_q.weight"].device == layers[1]


@pytest.mark.parametrize("ngl", [1, 2])
def test_partial_offload_is_cpu_then_device(tiny_llama, ngl):
    assert backends_of_splits(plan_of(tiny_llama, n_gpu_layers=ngl)) == ["cpu", "gpu0"]


def test_no_offload_is_one_cpu_split(tiny_llama):
    assert backends_of_splits(plan_of(tiny_llama, n_gpu_layers=0)) == ["cpu"]


def test_cpu_override_inside_offloaded_layers_adds_two_splits_each(tiny_llama):
    one = plan_of(tiny_llama, overrides=((r"blk\.1\.ffn_(up|gate|down)", "cpu"),))
    assert backends_of_splits(one) == ["cpu", "gpu0", "cpu", "gpu0"]
    cpu_ops = [n.op.name for n in one.split_nodes(one.splits[2]) if not n.op.is_view]
    assert cpu_ops == ["mul_mat", "mul_mat", "swiglu", "mul_mat"]
    two = plan_of(tiny_llama, overrides=((r"blk\.\d\.ffn_(up|gate|down)", "cpu"),))
    assert backends_of_splits(two) == ["cpu", "gpu0", "cpu", "gpu0", "cpu", "gpu0"]


def test_op_offload_moves_host_weight_matmul_for_big_batches_only(tiny_llama):
    small = plan_of(tiny_llama, n_tokens=1, n_gpu_layers=1)
    big = plan_of(tiny_llama, n_tokens=512, n_gpu_layers=1)
    q_small = small.find("blk.0.attn_q.weight").users[0]
    q_big = big.find("blk.0.attn_q.weight").users[0]
    assert small.backend_of(q_small).label == "cpu" and small.causes[id(q_small)].code == "1.wgt"
    assert big.backend_of(q_big).label == "gpu0" and big.causes[id(q_big)].code == "1.off"
    assert big.n_splits > small.n_splits
    copied = {c.name for s in big.splits for c in s.copies}
    assert "gpu0#blk.0.attn_q.weight#0" in copied
    off = plan_of(tiny_llama, n_tokens=512, n_gpu_layers=1, op_offload=False)
    assert backends_of_splits(off) == ["cpu", "gpu0"]


def test_an_op_the_device_lacks_mid_layer_splits_there_and_comes_back(tiny_llama):
    plan = plan_of(tiny_llama, specs=("sim:gpu0:ops=all,-swiglu",))
    assert backends_of_splits(plan) == ["cpu", "gpu0", "cpu", "gpu0", "cpu", "gpu0"]
    for s in plan.splits[2::2]:
        assert [n.op.name for n in plan.split_nodes(s) if not n.op.is_view] == ["swiglu"]
    swiglu = plan.find("ffn_swiglu-0")
    assert plan.causes[id(swiglu)].code == "3.best"


def test_two_devices_split_layers_by_tensor_split(tiny_llama):
    placement, _ = setup(tiny_llama, specs=("sim:gpu0", "sim:gpu1"), tensor_split=(2.0, 1.0))
    assert placement.layer_device == ["gpu0", "gpu0"] and placement.output_device == "gpu1"
    plan = plan_of(tiny_llama, specs=("sim:gpu0", "sim:gpu1"), tensor_split=(1.0, 2.0))
    assert backends_of_splits(plan) == ["cpu", "gpu0", "gpu1"]
    none, _ = setup(tiny_llama, specs=("sim:gpu0", "sim:gpu1"), split_mode="none", main_gpu=1)
    assert [b.label for b in none.backends] == ["gpu1", "cpu"] and none.layer_device == ["gpu1", "gpu1"]


def test_small_batches_pin_the_norm_to_its_layer_device(tiny_llama):
    plan = plan_of(tiny_llama, specs=("sim:gpu0", "sim:gpu1"), tensor_split=(1.0, 2.0))
    norm = plan.find("attn_norm-1").inputs[0]  # the rms_norm llama.cpp names "norm-1"
    assert plan.causes[id(norm)].code == "usr" and plan.backend_of(norm).label == "gpu1"


def test_pipeline_copies_rotate_between_batches(tiny_llama):
    placement, bound = setup(tiny_llama, specs=("sim:gpu0",))
    sched = Scheduler(placement.backends, placement.buffers(), n_copies=3)
    names = []
    for _ in range(4):
        scheduled = sched.alloc_graph(bound, placement.pins(bound, 1))
        names.append(scheduled.plan.splits[1].copies[0].name)
        check_allocation(scheduled.alloc_graph, scheduled.allocation, sched.compute_buffers.galloc.allocs)
    assert names == [f"gpu0#inp_embd#{c}" for c in (0, 1, 2, 0)]
    sched.synchronize()
    assert sched.alloc_graph(bound).plan.cur_copy == 0


@pytest.mark.parametrize(
    "specs, kwargs",
    [
        (("sim:gpu0",), {}),
        (("sim:gpu0",), {"n_gpu_layers": 2}),
        (("sim:gpu0", "sim:gpu1"), {"tensor_split": (1.0, 1.0)}),
        (("sim:gpu0:ops=all,-swiglu,-soft_max_ext",), {}),
        (("sim:gpu0",), {"overrides": ((r"blk\.0\.ffn_.*", "cpu"),)}),
        (("sim:acc:host=yes:ops=mul_mat",), {}),
        (("null:nul",), {"n_gpu_layers": 0}),
    ],
)
@pytest.mark.parametrize("n_tokens", [1, 40])
def test_scheduled_execution_equals_numpy(tiny_llama_q8, specs, kwargs, n_tokens):
    placement, bound = setup(tiny_llama_q8, specs, n_tokens, n_out=n_tokens, **kwargs)
    values = batch_values(bound, n_tokens, N_CTX, n_tokens)
    values.update(placement.weight_values(tiny_llama_q8, bound))
    sched = Scheduler(placement.backends, placement.buffers())
    scheduled = sched.alloc_graph(bound, placement.pins(bound, n_tokens))
    assert (
        check_allocation(scheduled.alloc_graph, scheduled.allocation, sched.compute_buffers.galloc.allocs) > 0
    )
    mine = {k: v.copy() for k, v in values.items()}
    got = sched.graph_compute(scheduled, mine)
    theirs = {k: v.copy() for k, v in values.items()}
    want = Interpreter().run(bound, theirs)
    assert np.array_equal(got["logits"], want["logits"])
    for leaf in bound.leafs_of_kind("state"):  # the KV cache writes land in the caller's arrays
        assert np.array_equal(mine[leaf.name], theirs[leaf.name]) and np.any(mine[leaf.name])


def test_sim_devices_count_the_bytes_they_copy(tiny_llama):
    placement, bound = setup(tiny_llama, n_gpu_layers=2)
    values = batch_values(bound, 1, N_CTX, 1)
    values.update(placement.weight_values(tiny_llama, bound))
    sched = Scheduler(placement.backends, placement.buffers())
    scheduled = sched.alloc_graph(bound, placement.pins(bound, 1))
    sched.graph_compute(scheduled, values)
    gpu = placement.backends[0]
    assert gpu.stats.bytes_in == scheduled.plan.bytes_moved
    assert gpu.stats.n_copies_in == scheduled.plan.n_split_copies
    assert gpu.stats.bytes_out == bound.outputs["logits"].type.nbytes


def test_reserved_buffers_cover_every_real_batch(tiny_llama):
    placement, _ = setup(tiny_llama, n_gpu_layers=2)
    graph = tiny_llama.build_graph(graph_config(tiny_llama, N_CTX, False)).graph
    placement.apply(graph)
    sched = Scheduler(placement.backends, placement.buffers())
    for t in reserve_batches(placement.backends, N_CTX):
        bound = bind_dims(graph, {"T": t, "n_kv": N_CTX, "n_out": t})
        sched.reserve(bound, placement.pins(bound, t))
    reserved = sched.buffer_sizes()
    assert all(reserved.values())
    for t in (1, 2, 7, 16, 31, 32):
        for n_kv in (t, N_CTX):
            for n_out in {1, t}:
                bound = bind_dims(graph, {"T": t, "n_kv": n_kv, "n_out": n_out})
                scheduled = sched.alloc_graph(bound, placement.pins(bound, t))
                for b, label in enumerate(scheduled.plan.labels):
                    assert scheduled.allocation.buffer_size(b) <= reserved[label], (t, n_kv, n_out, label)
    assert sched.compute_buffers.n_reallocs == 0 and sched.buffer_sizes() == reserved


def test_not_enough_device_memory_is_a_clear_error(tiny_llama):
    with pytest.raises(PlacementError, match=r"not enough memory on gpu0: weights .* KV cache"):
        setup(tiny_llama, specs=("sim:gpu0:mem=64KiB",))


def test_override_to_a_device_that_cannot_run_the_op_is_an_error(tiny_llama):
    with pytest.raises(
        PlacementError, match=r"blk.0.ffn_up.weight is overridden to gpu0 .* cannot run mul_mat"
    ):
        setup(tiny_llama, specs=("sim:gpu0:ops=add,mul",), overrides=((r"ffn_up", "gpu0"),))


def test_layer_weight_falls_back_to_cpu_when_its_device_lacks_the_op(tiny_llama):
    placement, _ = setup(tiny_llama, specs=("sim:gpu0:ops=all,-get_rows,-mul_mat",))
    place = placement.weights["blk.0.attn_q.weight"]
    assert place.device == "cpu" and "cannot run mul_mat" in place.reason


def test_kv_cache_on_a_device_without_set_rows_is_a_scheduler_error(tiny_llama):
    with pytest.raises(
        SchedError, match=r"pre-allocated tensor cache_k_l0 in a gpu0 buffer cannot run set_rows"
    ):
        plan_of(tiny_llama, specs=("sim:gpu0:ops=all,-set_rows",))


def test_unknown_override_device_and_bad_params(tiny_llama):
    with pytest.raises(PlacementError, match="no device named 'gpu7'"):
        setup(tiny_llama, overrides=(("ffn", "gpu7"),))
    with pytest.raises(PlacementError, match="tensor_split has 3 values for 1 devices"):
        setup(tiny_llama, tensor_split=(1.0, 1.0, 1.0))
    with pytest.raises(PlacementError, match="split_mode 'row' is not supported"):
        setup(tiny_llama, split_mode="row")
