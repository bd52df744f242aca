"""The LLVM backend as a backend: compile cache (memory, disk, corrupt entries), run-time dims
without recompiling, thread counts, errors reported by kernels, bad leaves, observation of named
values, barriers between dependent steps only, the arena's reuse of memory, and running again
on what the last call bound (call_bound)."""

from __future__ import annotations

import numpy as np
import pytest

from llamir.backends.base import BackendError
from llamir.backends.llvm import LLVMBackend
from llamir.backends.llvm.target import host_target, restricted_target
from llamir.ir import F16, F32, I32, GraphBuilder, Interpreter, ops, run_graph

rng = np.random.default_rng(3)


def _graph(n: int = 24):
    b = GraphBuilder("g", dims=["T"])
    x, w = b.input("x", ["T", n], F32), b.weight("w", [n], F32)
    h = b.op(ops.RmsNormMul(eps=1e-5), x, w, name="norm")
    y = b.silu(b.mul_mat(b.weight("m", [16, n], F16), h), name="act")
    b.output("y", y)
    return b.graph


def _values(T: int, n: int = 24):
    return {"x": rng.standard_normal((T, n)).astype(np.float32), "w": rng.standard_normal(n).astype(np.float32),
            "m": rng.standard_normal((16, n)).astype(np.float16)}


def test_run_time_dims_reuse_one_executable(llvm_backend):
    g = _graph()
    exe = llvm_backend.compile(g)
    for T in (1, 7, 3, 64):
        values = _values(T)
        np.testing.assert_array_equal(exe(values, {"T": T})["y"], run_graph(g, values, {"T": T})["y"])


def test_memory_and_disk_cache(tmp_path):
    g = _graph(40)
    first = LLVMBackend(n_threads=1, cache_dir=tmp_path)
    first.compile(g)
    assert first.compile_stats.cache.startswith("miss")
    first.compile(g)
    assert first.compile_stats.cache == "hit"
    assert any(tmp_path.glob("*.o"))
    LLVMBackend._shared_caches.clear()                  # a new process: only the disk remains
    second = LLVMBackend(n_threads=1, cache_dir=tmp_path)
    exe = second.compile(g)
    assert second.compile_stats.cache == "hit"
    values = _values(5, 40)
    np.testing.assert_array_equal(exe(values, {"T": 5})["y"], run_graph(g, values, {"T": 5})["y"])


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_corrupt_cache_entries_are_discarded_and_rebuilt(tmp_path, damage):
    g = _graph(48)
    LLVMBackend(n_threads=1, cache_dir=tmp_path).compile(g)
    for path in tmp_path.glob("*.o"):
        data = bytearray(path.read_bytes())
        if damage == "truncate":
            data = data[: len(data) // 2]
        elif damage == "flip":
            data[len(data) // 2] ^= 0xFF
        else:
            data = bytearray(b"not an object file")
        path.write_bytes(bytes(data))
    LLVMBackend._shared_caches.clear()
    backend = LLVMBackend(n_threads=1, cache_dir=tmp_path)
    exe = backend.compile(g)
    assert backend.cache.rejected > 0 and backend.compile_stats.cache.startswith("miss")
    values = _values(3, 48)
    np.testing.assert_array_equal(exe(values, {"T": 3})["y"], run_graph(g, values, {"T": 3})["y"])
    LLVMBackend._shared_caches.clear()
    again = LLVMBackend(n_threads=1, cache_dir=tmp_path)
    again.compile(g)
    assert again.cache.rejected == 0 and again.compile_stats.cache == "hit"   # the rebuilt entries are good


@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_thread_counts_give_identical_results(n_threads):
    g = _graph()
    backend = LLVMBackend(n_threads=n_threads, disk_cache=False)
    values = _values(9)
    got = backend.compile(g)(values, {"T": 9})["y"]
    np.testing.assert_array_equal(got, run_graph(g, values, {"T": 9})["y"])
    backend.close()


def test_avx2_code_paths_on_this_host():
    """The same kernels compiled without AVX-512 (8-lane hardware, no VNNI)."""
    target = restricted_target(host_target(), ("avx512", "avxvnni"))
    assert not target.avx512 and not target.vnni
    backend = LLVMBackend(n_threads=2, target=target, disk_cache=False)
    b = GraphBuilder("g", dims=["T"])
    x = b.input("x", ["T", 64], F32)
    from llamir.ir import Q4_0, Q8_0, quants

    b.output("a", b.mul_mat(b.weight("q4", [32, 64], Q4_0), x))
    b.output("b", b.silu(b.mul_mat(b.weight("q8", [24, 64], Q8_0), x)))
    q = b.reshape(x, 1, 1, b.dim("T"), 64)
    kv = b.weight("kv", [1, 1, 9, 64], F16)
    b.output("fa", b.flash_attn_ext(q, kv, kv, None, 0.125))
    b.output("sm", b.soft_max_ext(b.reshape(x, 1, b.dim("T"), 64), None, 0.5))
    values = {"x": rng.standard_normal((5, 64)).astype(np.float32),
              "kv": rng.standard_normal((1, 1, 9, 64)).astype(np.float16),
              "q4": quants.quantize(rng.standard_normal((32, 64)).astype(np.float32), Q4_0),
              "q8": quants.quantize(rng.standard_normal((24, 64)).astype(np.float32), Q8_0)}
    got = backend.compile(b.graph)(values, {"T": 5})
    want = run_graph(b.graph, values, {"T": 5})
    for name in want:
        if name == "fa":      # the reference's numpy exp vs glibc expf: ulps
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_array_equal(got[name], want[name])
    backend.close()


def test_out_of_range_index_is_an_error_not_a_wild_read(llvm_backend):
    b = GraphBuilder("g", dims=["T"])
    w = b.weight("w", [10, 8], F32)
    b.output("y", b.get_rows(w, b.input("i", ["T"], I32), name="gather"))
    exe = llvm_backend.compile(b.graph)
    values = {"w": np.ones((10, 8), np.float32), "i": np.array([1, 10, 2], np.int32)}
    with pytest.raises(BackendError, match=r"index 10 is out of range.*get_rows"):
        exe(values, {"T": 3})
    values["i"] = np.array([1, 9, 2], np.int32)
    assert exe(values, {"T": 3})["y"].shape == (3, 8)     # the executable is still usable


def test_leaf_errors_name_the_leaf(llvm_backend):
    exe = llvm_backend.compile(_graph())
    values = _values(4)
    with pytest.raises(BackendError, match="no value for .*'m'"):
        exe({k: v for k, v in values.items() if k != "m"}, {"T": 4})
    with pytest.raises(BackendError, match=r"input 'x': expected storage \(5, 24\)"):
        exe(values, {"T": 5})
    with pytest.raises(BackendError, match="dim 'T' has no value"):
        exe(values, {})
    bad = dict(values, w=values["w"].astype(np.float64))
    with pytest.raises(BackendError, match="weight 'w'"):
        exe(bad, {"T": 4})


def test_non_contiguous_inputs_are_copied_and_state_must_be_contiguous(llvm_backend):
    g = _graph()
    exe = llvm_backend.compile(g)
    values = _values(4)
    strided = np.asfortranarray(values["x"])
    got = exe(dict(values, x=strided), {"T": 4})["y"]
    np.testing.assert_array_equal(got, run_graph(g, values, {"T": 4})["y"])
    b = GraphBuilder("g2", dims=["T"])
    cache = b.state("c", [8, 4], F32)
    b.set_rows(cache, b.input("s", ["T", 4], F32), b.input("i", ["T"], I32))
    b.output("y", b.scale(b.input("z", [1], F32), 1.0))
    exe2 = llvm_backend.compile(b.graph)
    with pytest.raises(BackendError, match="state 'c' must be C-contiguous"):
        exe2({"c": np.zeros((4, 8), np.float32).T, "s": np.ones((1, 4), np.float32), "i": np.array([0], np.int32),
              "z": np.ones(1, np.float32)}, {"T": 1})


def test_observe_sees_every_named_value_in_order_and_can_stop(llvm_backend):
    g = _graph()
    exe = llvm_backend.compile(g)
    values = _values(3)
    expected = {}
    Interpreter().run(g, values, {"T": 3}, observe=lambda n, v: expected.setdefault(n.name, v.copy()) is not None)
    seen = []

    def watch(node, value):
        seen.append(node.name)
        np.testing.assert_array_equal(value, expected[node.name])
        return True

    exe(values, {"T": 3}, observe=watch)
    assert seen == ["norm", "act"]
    stopped = []
    exe(values, {"T": 3}, observe=lambda n, v: stopped.append(n.name) or False)
    assert stopped == ["norm"]


def test_row_wise_chains_share_a_stage_and_temporaries_share_memory(llvm_backend):
    """add -> rms_norm*w -> silu run without barriers between them (each thread keeps its rows);
    a matmul needs one before it reads activations; temporaries of far-apart stages overlap."""
    from llamir.backends.llvm.lowering import Lowerer
    from llamir.passes.pipeline import run_pipeline

    b = GraphBuilder("g", dims=["T"])
    x, w = b.input("x", ["T", 32], F32), b.weight("w", [32], F32)
    h = x
    for i in range(3):
        h = b.mul(b.rms_norm(b.add(h, x), 1e-5), w)
        h = b.mul_mat(b.weight(f"m{i}", [32, 32], F32), b.silu(h))
    b.output("y", h)
    g = b.graph
    run_pipeline(g, "fuse-rms-norm,dce")
    plan = Lowerer(g, llvm_backend.target).run()
    kinds = [(type(s.kernel).__name__, s.stage) for s in plan.steps]
    first_mm = next(i for i, (k, _) in enumerate(kinds) if k == "MatMulFloat")
    pre = {stage for _, stage in kinds[:first_mm]}
    assert len(pre) == 1 and kinds[first_mm][1] == kinds[0][1] + 1
    offsets = [t.offset for t in plan.temps if t.first >= 0]
    assert len(set(offsets)) < len(offsets)              # some temporaries reuse arena bytes


def test_supports_op_refuses_what_it_cannot_lower(llvm_backend):
    b = GraphBuilder("g")
    x = b.input("x", [4, 256], F32)
    from llamir.ir import Q4_K

    q = b.cast(x, Q4_K)                   # no reference quantizer for K-quants in the kernels
    b.output("y", q)
    node = b.graph.nodes[-1]
    assert not llvm_backend.supports_op(node)
    with pytest.raises(BackendError, match="cannot run: cpy"):
        llvm_backend.compile(b.graph)


def test_set_n_threads_keeps_compiled_code():
    g = _graph()
    backend = LLVMBackend(n_threads=1, disk_cache=False)
    exe = backend.compile(g)
    values = _values(6)
    want = run_graph(g, values, {"T": 6})["y"]
    np.testing.assert_array_equal(exe(values, {"T": 6})["y"], want)
    backend.set_n_threads(3)
    assert exe.pool.n_threads == 3
    np.testing.assert_array_equal(exe(values, {"T": 6})["y"], want)
    backend.close()


def test_outputs_in_leaf_memory_are_views_of_the_leaf(llvm_backend):
    """A set_rows result (and a view of it) comes back as a view of the caller's array, as the
    interpreter returns it: the scheduler keeps such values in their owner's memory."""
    b = GraphBuilder("g", dims=["T"])
    cache = b.state("c", [8, 4], F32)
    stored = b.set_rows(cache, b.input("s", ["T", 4], F32), b.input("i", ["T"], I32))
    b.output("stored", stored)
    b.output("rows", b.view(stored, [2, 4], [16, 4], 16))
    exe = llvm_backend.compile(b.graph)
    c = np.zeros((8, 4), np.float32)
    out = exe({"c": c, "s": np.ones((2, 4), np.float32), "i": np.array([1, 6], np.int32)}, {"T": 2})
    assert np.shares_memory(out["stored"], c) and np.shares_memory(out["rows"], c)
    np.testing.assert_array_equal(out["rows"], c[1:3])
    assert c[1].sum() == 4 and c[6].sum() == 4


def test_as_the_scheduler_cpu_backend_next_to_a_simulated_device(tmp_path):
    """Splits handed over by the scheduler (one compile per split) give the CPU's logits."""
    import llamir
    from llamir.frontend.placement import PlacementParams
    from llamir.frontend.synth import SynthSpec, write_model

    model = llamir.load_model(write_model(tmp_path / "m.gguf", SynthSpec(n_layer=3, dtype="q8_0")))
    tokens = list(range(5, 30))

    def logits(**kw):
        ctx = llamir.Context(model, n_ctx=128, **kw)
        assert ctx.decode(llamir.Batch.from_tokens(tokens, logits="all")) == 0, ctx.last_error
        return ctx.get_logits().copy()

    want = logits(backend="numpy")
    got = logits(backend=LLVMBackend(n_threads=2, disk_cache=False), devices=["sim:gpu0"],
                 placement=PlacementParams(n_gpu_layers=2))
    np.testing.assert_array_equal(got, want)


def test_a_non_contiguous_weight_is_bound_through_a_kept_copy(llvm_backend):
    g = _graph()
    exe = llvm_backend.compile(g)
    values = _values(4)
    values["m"] = np.asfortranarray(values["m"])      # a strided weight: copied once, and the copy kept
    want = run_graph(g, {k: np.ascontiguousarray(v) for k, v in values.items()}, {"T": 4})["y"]
    import gc

    for _ in range(3):
        gc.collect()
        np.testing.assert_array_equal(exe(values, {"T": 4})["y"], want)


def test_nan_attributes_key_their_kernels_stably(tmp_path):
    """Issue 9, finding 6: NaN != NaN, so kernels keyed by attribute tuples declared one symbol
    twice (llvmlite's DuplicatedNameError). Two NaN ropes (distinct NaN objects), a NaN scale and
    a finite rope compile to one module and agree with the numpy reference, NaNs included."""
    b = GraphBuilder("nan_attrs", dims=["T"])
    x, pos = b.input("x", ["T", 2, 8], F32), b.input("pos", ["T"], I32)
    for name, base in (("a", float("nan")), ("b", float("nan")), ("c", 10000.0)):
        b.output(name, b.rope_ext(x, pos, n_dims=8, mode=0, n_ctx_orig=0, freq_base=base))
    b.output("s", b.scale(b.rope_ext(x, pos, n_dims=8, mode=2, n_ctx_orig=0, freq_base=500.0), float("nan")))
    backend = LLVMBackend(n_threads=1, cache_dir=tmp_path)     # a fresh cache: every kernel is built
    exe = backend.compile(b.graph)
    values = {"x": rng.standard_normal((3, 2, 8)).astype(np.float32), "pos": np.arange(3, dtype=np.int32)}
    got, want = exe(values, {"T": 3}), run_graph(b.graph, values, {"T": 3})
    for name in "abcs":
        np.testing.assert_array_equal(got[name], want[name])     # NaN == NaN for assert_array_equal
    assert np.isnan(got["a"]).any() and not np.isnan(got["c"]).any()


@pytest.mark.parametrize("error", ["duplicated", "llvm"])
def test_llvmlite_errors_while_compiling_are_backend_errors(tmp_path, monkeypatch, error):
    """Whatever llvmlite raises (DuplicatedNameError is a NameError, LLVM's own errors come up as
    RuntimeError) reaches the caller as BackendError naming the graph and the original type."""
    import llvmlite.binding
    from llvmlite.ir._utils import DuplicatedNameError

    import llamir.backends.llvm.backend as backend_module

    def fail(module, target, speed_level=3):
        if error == "duplicated":
            raise DuplicatedNameError(f"Duplicated name '{module.name}'")
        return llvmlite.binding.parse_assembly("this is not LLVM IR")   # llvmlite's RuntimeError

    monkeypatch.setattr(backend_module, "optimize_and_emit", fail)
    with pytest.raises(BackendError, match=r"llvm backend failed to compile g \((llvmlite\S*|builtins)\."
                                           r"(DuplicatedNameError|RuntimeError)\)"):
        LLVMBackend(n_threads=1, cache_dir=tmp_path).compile(_graph(56))


def _called(llvm_backend, T: int):
    """A compiled _graph() after one call on fresh values: (graph, executable, values, binding)."""
    g = _graph()
    exe = llvm_backend.compile(g)
    values = _values(T)
    exe(values, {"T": T})
    return g, exe, values, exe.binding


def test_call_bound_sees_inputs_refilled_in_place(llvm_backend):
    """CompiledSplit.call_bound runs again on the arrays the last call bound, refilled in place:
    what a full call and the reference give."""
    g, exe, values, binding = _called(llvm_backend, 3)
    for _ in range(3):
        values["x"][...] = rng.standard_normal(values["x"].shape)
        out = exe.call_bound(binding)
        np.testing.assert_array_equal(out["y"], run_graph(g, values, {"T": 3})["y"])
        np.testing.assert_array_equal(out["y"], exe(values, {"T": 3})["y"])
        assert exe.binding == binding          # a full call on the same arrays binds nothing new


def test_call_bound_refuses_after_anything_else_was_bound(llvm_backend):
    """Nothing runs (None) once other dims or another input or weight array were bound."""
    g, exe, values, binding = _called(llvm_backend, 3)
    exe(_values(5), {"T": 5})                  # other dims and arrays
    assert exe.call_bound(binding) is None
    exe(values, {"T": 3})
    binding = exe.binding
    exe({**values, "x": values["x"].copy()}, {"T": 3})   # another input array
    assert exe.call_bound(binding) is None
    exe(values, {"T": 3})
    binding = exe.binding
    exe({**values, "m": values["m"].copy()}, {"T": 3})   # another weight array
    assert exe.call_bound(binding) is None


def test_call_bound_refuses_an_input_bound_as_a_copy(llvm_backend):
    """An input bound through a contiguous copy does not see its array refilled: refused."""
    g = _graph()
    exe = llvm_backend.compile(g)
    values = _values(4)
    values["x"] = np.asfortranarray(values["x"])          # bound through a contiguous copy
    exe(values, {"T": 4})
    assert exe.call_bound(exe.binding) is None
    values["x"] = np.ascontiguousarray(values["x"])
    exe(values, {"T": 4})
    assert exe.call_bound(exe.binding) is not None

