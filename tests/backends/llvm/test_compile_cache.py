"""Compiles: kernels built in forked worker processes (the same object code as in this process,
failures and crashed workers reported), the per-kernel cache shared between graphs, a graph
compiled again only bound, and the graph copy the passes work on."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from llamir.backends.base import BackendError
from llamir.backends.llvm import LLVMBackend
from llamir.backends.llvm import backend as backend_module
from llamir.backends.llvm.compiler import CodegenError, can_fork, compile_jobs
from llamir.frontend.synth import SynthSpec, write_model
from llamir.ir import F16, F32, GraphBuilder, ops, print_graph, run_graph

needs_fork = pytest.mark.skipif(not can_fork(), reason="compiles run in forked processes only on Linux")
rng = np.random.default_rng(5)


def _graph(act: str = "silu", n: int = 40, name: str = "g"):
    b = GraphBuilder(name, dims=["T"])
    x, w = b.input("x", ["T", n], F32), b.weight("w", [n], F32)
    h = b.op(ops.RmsNormMul(eps=1e-5), x, w, name="norm")
    y = b.mul_mat(b.weight("m", [16, n], F16), h)
    b.output("y", b.silu(y) if act == "silu" else b.gelu(y))
    return b.graph


def _values(T: int, n: int = 40):
    return {"x": rng.standard_normal((T, n)).astype(np.float32), "w": rng.standard_normal(n).astype(np.float32),
            "m": rng.standard_normal((16, n)).astype(np.float16)}


@needs_fork
def test_jobs_in_workers_return_in_order_and_run_elsewhere():
    jobs = [lambda i=i: f"{i}:{os.getpid()}".encode() for i in range(7)]
    results = compile_jobs(jobs, workers=3)
    assert [r[0].split(b":")[0] for r in results] == [str(i).encode() for i in range(7)]
    assert all(int(r[0].split(b":")[1]) != os.getpid() for r in results) and all(r[1] >= 0 for r in results)
    assert compile_jobs(jobs[:1], workers=3)[0][0] == f"0:{os.getpid()}".encode()   # one job: no fork


@needs_fork
def test_a_failing_job_raises_its_own_error_naming_it():
    def bad():
        raise ValueError("no such lane")

    with pytest.raises(ValueError, match="no such lane") as info:
        compile_jobs([lambda: b"ok", bad, lambda: b"ok"], workers=2, names=["a", "kernel_b", "c"])
    assert any("kernel_b" in note for note in info.value.__notes__)


@needs_fork
def test_a_worker_killed_by_llvm_is_a_codegen_error():
    def crash():     # as an LLVM fatal error would (SIGKILL: no faulthandler dump in the test log)
        os.kill(os.getpid(), signal.SIGKILL)

    with pytest.raises(CodegenError, match=r"kernel_x: the compiler process died \(killed by signal 9\)"):
        compile_jobs([lambda: b"ok", crash], workers=2, names=["ok", "kernel_x"])


@needs_fork
def test_a_thread_pool_collected_in_a_worker_does_not_wait_for_its_threads():
    """A forked worker has none of the parent's threads: a pool garbage-collected there (its
    finalizer run by the child's gc) must not wait for them. It spun forever in sched_yield."""
    import gc
    import subprocess
    import sys

    script = (
        "import gc\n"
        "from llamir.backends.llvm.compiler import compile_jobs\n"
        "from llamir.backends.llvm.runtime import ThreadPool\n"
        "pool = ThreadPool(2)\n"
        "pool.cycle = pool\n"          # only the cyclic gc frees it
        "del pool\n"
        "gc.disable()\n"
        "def job():\n"
        "    gc.collect()\n"
        "    return b'ok'\n"
        "print(compile_jobs([job, job], workers=2))\n"
    )
    gc.collect()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("b'ok'") == 2


@needs_fork
def test_workers_emit_the_same_object_code_as_this_process():
    g = _graph()
    LLVMBackend._shared_caches.clear()
    serial = LLVMBackend(n_threads=1, disk_cache=False, compile_workers=1)
    serial.compile(g)
    LLVMBackend._shared_caches.clear()
    parallel = LLVMBackend(n_threads=1, disk_cache=False, compile_workers=3)
    exe = parallel.compile(g)
    assert parallel.cache is not serial.cache and parallel.cache.memory == serial.cache.memory
    stats, record = parallel.compile_stats, parallel.compile_stats.history[-1]
    assert stats.in_workers and not serial.compile_stats.in_workers
    assert record.cpu_seconds == stats.cpu_s + stats.llvm_cpu_s and stats.llvm_cpu_s > 0
    values = _values(6)
    np.testing.assert_array_equal(exe(values, {"T": 6})["y"], run_graph(g, values, {"T": 6})["y"])
    LLVMBackend._shared_caches.clear()


def test_kernels_are_shared_between_graphs_through_the_cache(tmp_path):
    first = LLVMBackend(n_threads=1, cache_dir=tmp_path)
    first.compile(_graph("silu"))
    n_kernels = first.compile_stats.n_kernels
    other = _graph("gelu")                       # the same norm and matmul, another activation
    exe = first.compile(other)
    assert first.compile_stats.cache == "miss (1 new kernels)" and first.compile_stats.n_kernels == n_kernels
    values = _values(3)
    np.testing.assert_array_equal(exe(values, {"T": 3})["y"], run_graph(other, values, {"T": 3})["y"])
    LLVMBackend._shared_caches.clear()


@needs_fork
def test_precompile_builds_many_graphs_code_in_one_batch(tmp_path, monkeypatch):
    """What test-backend-ops does first: every graph's kernels and entry compiled together in the
    workers; compile() then lowers and links only. A graph it cannot lower is left to compile()."""
    lowerer = backend_module.Lowerer

    def picky(g, *args, **kwargs):
        if g.name == "bad":
            raise ValueError("no lowering for this one")
        return lowerer(g, *args, **kwargs)

    monkeypatch.setattr(backend_module, "Lowerer", picky)
    be = LLVMBackend(n_threads=1, cache_dir=tmp_path, compile_workers=2)
    graphs = [_graph("silu"), _graph("gelu", name="g2"), _graph("silu", n=48, name="g3")]
    assert be.precompile([*graphs, _graph(name="bad")]) >= 5   # >= 2 kernels, 3 entries
    batches = []
    monkeypatch.setattr(backend_module, "compile_jobs", lambda jobs, *a, **k: batches.append(jobs) or [])
    for g in graphs:
        exe = be.compile(g)
        assert be.compile_stats.cache == "hit"
        values = _values(5, 48 if g.name == "g3" else 40)
        np.testing.assert_array_equal(exe(values, {"T": 5})["y"], run_graph(g, values, {"T": 5})["y"])
    assert not batches and be.precompile(graphs) == 0
    with pytest.raises(BackendError, match="no lowering for this one"):
        be.compile(_graph(name="bad"))
    LLVMBackend._shared_caches.clear()


def test_the_same_graph_again_is_only_bound(tmp_path, monkeypatch):
    g = _graph(n=56)
    LLVMBackend(n_threads=2, cache_dir=tmp_path).compile(g)

    def no_lowering(*args, **kwargs):
        raise AssertionError("a graph compiled before was lowered again")

    monkeypatch.setattr(backend_module, "Lowerer", no_lowering)
    again = LLVMBackend(n_threads=2, cache_dir=tmp_path)     # a second context's backend, same process
    exe = again.compile(g)
    assert again.compile_stats.cache == "hit"
    values = _values(4, 56)
    np.testing.assert_array_equal(exe(values, {"T": 4})["y"], run_graph(g, values, {"T": 4})["y"])
    with pytest.raises(BackendError, match="lowered again"):   # another thread count is another plan
        LLVMBackend(n_threads=3, cache_dir=tmp_path).compile(g)
    LLVMBackend._shared_caches.clear()


def test_the_graph_copy_prints_as_the_model_graph(tmp_path, monkeypatch):
    """The copy the passes rewrite is the graph the context built: same text, its own nodes."""
    import llamir

    copies = []
    real_copy = backend_module._copy_graph

    def spy(graph):
        copy = real_copy(graph)
        copies.append((print_graph(graph), print_graph(copy)))
        assert all(a is not b for a, b in zip(copy.all_values(), graph.all_values(), strict=True))
        assert all(x.graph is copy for x in copy.all_values())
        users = {id(n): [id(u) for u in n.users] for n in copy.all_values()}
        copy.rebuild_users()
        assert users == {id(n): [id(u) for u in n.users] for n in copy.all_values()}
        return copy

    monkeypatch.setattr(backend_module, "_copy_graph", spy)
    path = write_model(tmp_path / "m.gguf", SynthSpec(n_layer=2, dtype="q4_0"))
    backend = LLVMBackend(n_threads=1, cache_dir=tmp_path / "cache")
    ctx = llamir.Context(llamir.load_model(path), n_ctx=32, n_batch=8, n_ubatch=8, backend=backend)
    assert ctx.decode(llamir.Batch.from_tokens([1, 2, 3], logits="last")) == 0
    assert copies and all(original == copy for original, copy in copies)
    LLVMBackend._shared_caches.clear()


def _quant_graph(m_rows: int):
    from llamir.ir import Q4_0

    b = GraphBuilder("q", dims=["T"])
    x = b.input("x", ["T", 64], F32)
    b.output("y", b.mul_mat(b.weight("w", [m_rows, 64], Q4_0), x))
    return b.graph


def test_runtime_ints_share_a_kernel_between_dims(tmp_path, monkeypatch):
    """A kernel that passes its row count at run time serves two weights of different heights
    with one compiled function, and both still give the reference's bits."""
    from llamir.backends.llvm.kernels.matmul_quant import MatMulQ
    from llamir.ir import Q4_0, quants

    monkeypatch.setattr(MatMulQ, "runtime_ints", (1,))
    backend = LLVMBackend(n_threads=2, cache_dir=tmp_path)
    for m_rows, expect in ((32, "miss"), (48, "miss (entry)")):
        g = _quant_graph(m_rows)
        exe = backend.compile(g)
        assert backend.compile_stats.cache.startswith(expect)
        values = {"x": rng.standard_normal((5, 64)).astype(np.float32),
                  "w": quants.quantize(rng.standard_normal((m_rows, 64)).astype(np.float32), Q4_0)}
        np.testing.assert_array_equal(exe(values, {"T": 5})["y"], run_graph(g, values, {"T": 5})["y"])
    monkeypatch.setattr(MatMulQ, "runtime_ints", ())
    backend.compile(_quant_graph(64))
    assert backend.compile_stats.cache == "miss (1 new kernels)"    # compiled in: one kernel per height
    LLVMBackend._shared_caches.clear()


@pytest.mark.parametrize("flash_attn", ["on", "off"])
def test_a_new_context_size_compiles_no_kernels(tmp_path, flash_attn):
    """The KV cache's strides (flash attention's K and V, set_rows' destination, the K/V matmuls'
    a rows) are run-time arguments: a context of another size builds only its entry."""
    import llamir

    path = write_model(tmp_path / "m.gguf", SynthSpec(n_layer=1, dtype="f16"))
    model = llamir.load_model(path)
    backend = LLVMBackend(n_threads=2, cache_dir=tmp_path / "cache")
    logits = []
    for n_ctx in (256, 512):
        ctx = llamir.Context(model, n_ctx=n_ctx, n_batch=32, n_ubatch=32, backend=backend, flash_attn=flash_attn)
        assert ctx.decode(llamir.Batch.from_tokens([1, 2, 3, 4, 5])) == 0, ctx.last_error
        logits.append(ctx.get_logits_ith(-1).copy())
    assert backend.compile_stats.cache == "miss (entry)"
    np.testing.assert_array_equal(logits[0], logits[1])
    LLVMBackend._shared_caches.clear()
