"""LLVMBackend: whole splits compiled to native code with llvmlite (see the package docstring)."""

from __future__ import annotations

import hashlib
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

from llamir.backends.base import Backend, BackendError, cpu_device, default_threads
from llamir.backends.llvm.cache import CompileCache
from llamir.backends.llvm.codegen import (
    ARENA_SIZE,
    ENTRY,
    FrameLayout,
    ModuleBuilder,
    kernel_module,
    kernel_symbol,
)
from llamir.backends.llvm.compiler import CodegenError, can_fork, compile_jobs, optimize_and_emit
from llamir.backends.llvm.compiler import compile_workers as default_compile_workers
from llamir.backends.llvm.executable import CompiledSplit
from llamir.backends.llvm.lowering import Lowerer, support_table
from llamir.backends.llvm.runtime import ThreadPool, load_object
from llamir.backends.llvm.target import Target, host_target
from llamir.ir import Graph, Node, print_graph
from llamir.ir.dims import Bindings
from llamir.ir.numerics import Numerics, numerics_named
from llamir.passes.decompose import decompose

log = logging.getLogger("llamir")

DEFAULT_PASSES = "cse,fuse-rms-norm,fuse-norm,dce"  # after the decomposition of what the table lacks


class CompileRecord(NamedTuple):
    """One compile in CompileStats.history."""

    graph: str
    cache: str
    seconds: float          # wall
    cpu_seconds: float      # CPU of this thread and of the worker processes


@dataclass
class CompileStats:
    """What the last compile did, for reports: wall seconds of the whole compile and of its
    phases (planning, compiling the missing modules, linking), the seconds the modules' compiles
    took summed over the worker processes (llvm_s; CPU seconds: llvm_cpu_s), and the cache
    outcome."""

    plan_s: float = 0.0
    compile_s: float = 0.0
    llvm_s: float = 0.0
    llvm_cpu_s: float = 0.0
    link_s: float = 0.0
    wall_s: float = 0.0
    cpu_s: float = 0.0              # this thread's
    in_workers: bool = False        # the modules were compiled in worker processes
    cache: str = ""
    n_kernels: int = 0
    n_steps: int = 0
    n_stages: int = 0
    history: list = field(default_factory=list)

    @property
    def total_s(self) -> float:
        return self.wall_s

    @property
    def total_cpu_s(self) -> float:
        """CPU seconds of the compile: this thread's, plus the worker processes' when they ran."""
        return self.cpu_s + (self.llvm_cpu_s if self.in_workers else 0.0)


def _copy_graph(graph: Graph) -> Graph:
    """A copy of `graph` for the passes to rewrite: new nodes over the same (frozen) ops and types,
    in the same order (it prints as `graph` does; parsing the printed text gives the same graph
    but costs 5-10x more)."""
    copy = Graph(graph.name, graph.dim_names)
    new: dict[int, Node] = {}
    for leaf in graph.leafs:
        node = new[id(leaf)] = Node(copy, leaf.op, (), leaf.type, leaf.name)
        copy.leafs.append(node)
    for old in graph.nodes:
        node = new[id(old)] = Node(copy, old.op, tuple(new[id(x)] for x in old.inputs), old.type, old.name)
        for x in node.inputs:
            x.users.append(node)
        copy.nodes.append(node)
    copy.outputs = {name: new[id(x)] for name, x in graph.outputs.items()}
    return copy


def _or_nothing(job: Callable[[], bytes]) -> Callable[[], bytes]:
    """`job`, giving no object (b"") where it raises: precompile leaves the error to compile()."""
    def run() -> bytes:
        try:
            return job()
        except Exception:  # noqa: BLE001 - reported by compile(), for the graph it belongs to
            return b""
    return run


def _compile_weight(kernel) -> int:
    """Which kernels to start compiling first (the workers take them in order): matmuls and
    attention are the big modules."""
    name = type(kernel).__name__
    return 2 if name.startswith("MatMul") else 1 if "Attn" in name else 0


class LLVMBackend(Backend):
    """CPU backend: one native entry per split, run-time dims, ggml-style threads."""

    name: ClassVar[str] = "llvm"
    _shared_caches: ClassVar[dict] = {}

    def __init__(self, n_threads: int | None = None, target: Target | None = None, passes: str = DEFAULT_PASSES,
                 cache_dir=None, disk_cache: bool = True, numerics: Numerics | str | None = None,
                 compile_workers: int | None = None):
        """`numerics`: the ggml build whose arithmetic the code reproduces (default: the host's,
        see llamir.ir.numerics); any profile runs on any x86 target. `compile_workers`: processes
        that compile kernels in parallel (default: one per CPU; 1 compiles in this process)."""
        self.target = target or host_target()
        self.numerics = numerics_named(numerics)
        super().__init__(cpu_device("cpu", f"host CPU (LLVM JIT, {self.target.describe()}, numerics {self.numerics})"))
        self.support = support_table(self.target)
        self.n_threads = n_threads or default_threads()
        self.passes = passes
        self.compile_workers = compile_workers or default_compile_workers()
        if disk_cache:
            from pathlib import Path

            from llamir.paths import cache_dir as default_dir
            directory = Path(cache_dir) if cache_dir is not None else default_dir() / "llvm"
        else:
            directory = None
        self.cache = LLVMBackend._shared_caches.setdefault(str(directory), CompileCache(directory))
        self._pool: ThreadPool | None = None
        self._executables: weakref.WeakSet = weakref.WeakSet()
        self.compile_stats = CompileStats()

    @property
    def pool(self) -> ThreadPool:
        if self._pool is None or self._pool.n_threads != self.n_threads or self._pool._pid != os.getpid():
            self._pool = ThreadPool(self.n_threads, self.target)
            for exe in list(self._executables):
                exe.pool = self._pool
        return self._pool

    def set_n_threads(self, n_threads: int) -> None:
        """ggml_backend_cpu_set_n_threads: later runs use `n_threads` (compiled code is unchanged;
        the thread count is a run-time value)."""
        super().set_n_threads(n_threads)
        if n_threads != self.n_threads:
            self.n_threads = n_threads
            _ = self.pool

    def supports_op(self, node: Node) -> bool:
        return self.support(node)

    def compile(self, graph: Graph, observe_variant: bool = False) -> CompiledSplit:
        """The split as native code (see the package docstring); BackendError for what it cannot run."""
        try:
            return self._compile(graph, observe_variant)
        except BackendError:
            raise
        except (CodegenError, ValueError, KeyError) as err:
            raise BackendError(f"llvm backend cannot compile {graph.name}: {type(err).__name__}: {err}") from err
        except Exception as err:  # noqa: BLE001 - llvmlite raises NameError, RuntimeError, ...: all one failure here
            raise BackendError(f"llvm backend failed to compile {graph.name} ({type(err).__module__}."
                               f"{type(err).__name__}): {err}") from err

    def _compile(self, graph: Graph, observe_variant: bool = False) -> CompiledSplit:
        unsupported = [n for n in graph.nodes if not n.op.is_view and not self.supports_op(n)]
        if unsupported:
            names = ", ".join(sorted({n.op.name for n in unsupported}))
            raise BackendError(f"backend llvm cannot run: {names}")
        stats = CompileStats(history=self.compile_stats.history)
        t0, cpu0 = time.perf_counter(), time.thread_time()
        passes = "" if observe_variant else self.passes
        entry_key = self._entry_key(graph, observe_variant)
        loaded = self.cache.loaded_split(f"{entry_key}|{self.n_threads}")
        if loaded is not None:            # the same graph again (a new context on the same model)
            g, plan, tracker, addrs, n_kernels = loaded
            stats.cache = "hit"
        else:
            g, plan, tracker, addrs, n_kernels = self._build(graph, passes, observe_variant, entry_key, stats)
            self.cache.keep_split(f"{entry_key}|{self.n_threads}", (g, plan, tracker, addrs, n_kernels))
        stats.n_kernels = n_kernels
        stats.n_steps, stats.n_stages = len(plan.steps), plan.n_stages
        stats.wall_s, stats.cpu_s = time.perf_counter() - t0, time.thread_time() - cpu0
        stats.history.append(CompileRecord(graph.name, stats.cache, stats.total_s, stats.total_cpu_s))
        self.compile_stats = stats
        log.info("llvm: compiled %s (%d steps, %d stages, %d kernels, %s) in %.2fs", graph.name, stats.n_steps,
                 stats.n_stages, stats.n_kernels, stats.cache, stats.total_s)
        debug = None if observe_variant else (lambda: self.compile(graph, observe_variant=True))
        exe = CompiledSplit(g, plan, FrameLayout.of(plan), addrs, tracker, self.pool, debug)
        self._executables.add(exe)
        return exe

    def _entry_key(self, graph: Graph, observe_variant: bool) -> str:
        passes = "" if observe_variant else self.passes
        variant = ("observe|" if observe_variant else "") + f"{self.numerics}|" + passes
        return self.cache.key(hashlib.sha256(print_graph(graph).encode()).hexdigest(), self.target.key, variant)

    def _lower(self, graph: Graph, passes: str, observe_variant: bool, entry_key: str):
        """Lower (a copy of) `graph`: (graph, plan, module builder, kernels, cache keys of the
        kernels and then of the entry)."""
        g = _copy_graph(graph)
        decompose(g, self.support.claims)
        if passes:
            from llamir.passes.pipeline import run_pipeline

            run_pipeline(g, passes)
        lowerer = Lowerer(g, self.target, self.n_threads, self.numerics)
        if observe_variant:
            lowerer.keep_values = True
        plan = lowerer.run()
        builder = ModuleBuilder(plan, self.target, name=g.name)
        kernels = builder.distinct_kernels()
        keys = [self.cache.key(kernel_symbol(k), self.target.key, "kernel") for k in kernels] + [entry_key]
        return g, plan, builder, kernels, keys

    def _jobs(self, g: Graph, builder: ModuleBuilder, kernels: list, missing: list[int]):
        """(weight, name, job) of each missing module: index i < len(kernels) is that kernel, the
        last index the entry (straight-line calls: no pass pipeline, fast instruction selection)."""
        target = self.target

        def job(i: int):
            if i == len(kernels):
                return lambda: optimize_and_emit(builder.build(), target, speed_level=0, codegen_opt=0)
            return lambda: optimize_and_emit(kernel_module(kernels[i], target), target)

        return [(_compile_weight(kernels[i]) if i < len(kernels) else -1,
                 kernel_symbol(kernels[i]) if i < len(kernels) else f"entry of {g.name}", job(i)) for i in missing]

    def _build(self, graph: Graph, passes: str, observe_variant: bool, entry_key: str, stats: CompileStats):
        """Lower `graph`, get the object code of its kernels and entry (from the cache, or
        compiled in parallel), and link them."""
        t0 = time.perf_counter()
        g, plan, builder, kernels, keys = self._lower(graph, passes, observe_variant, entry_key)
        t1 = time.perf_counter()
        stats.plan_s = t1 - t0
        objects: list[bytes | None] = [self.cache.get(key) for key in keys]
        todo = [i for i, obj in enumerate(objects) if obj is None]
        if todo:
            todo.sort(key=lambda i: -_compile_weight(kernels[i]) if i < len(kernels) else 0)
            jobs = self._jobs(g, builder, kernels, todo)
            compiled = compile_jobs([job for _, _, job in jobs], self.compile_workers, [name for _, name, _ in jobs])
            stats.in_workers = can_fork() and min(self.compile_workers, len(todo)) > 1
            for i, (obj, seconds, cpu_seconds) in zip(todo, compiled, strict=True):
                self.cache.put(keys[i], obj)
                objects[i] = obj
                stats.llvm_s += seconds
                stats.llvm_cpu_s += cpu_seconds
            stats.compile_s = time.perf_counter() - t1
        n_new = sum(1 for i in todo if i < len(kernels))
        stats.cache = "hit" if not todo else (f"miss ({n_new} new kernels)" if n_new else "miss (entry)")
        t2 = time.perf_counter()
        tracker, addrs = load_object(self.target, [objects[-1]] + objects[:-1], [ENTRY, ARENA_SIZE])
        stats.link_s = time.perf_counter() - t2
        return g, plan, tracker, addrs, len(kernels)

    def precompile(self, graphs: Iterable[Graph], bindings: Iterable[Bindings] | None = None) -> int:
        """Compile the kernels and entries of many graphs ahead, all in one batch in the worker
        processes, into the compile cache: compile() of each graph then only lowers and links
        (the code takes its dims at run time, so `bindings` does not change it).
        What test-backend-ops does before its hundreds of one-kernel graphs, each too small to
        keep two compiler processes busy. A graph that cannot be lowered is left for its
        compile() to report; if the batch fails, compile() compiles (and reports) one graph at a
        time. Returns the number of modules compiled."""
        pending: dict[str, tuple[int, str, Callable[[], bytes]]] = {}
        for graph in graphs:
            if any(not n.op.is_view and not self.supports_op(n) for n in graph.nodes):
                continue
            try:
                entry_key = self._entry_key(graph, False)
                if self.cache.loaded_split(f"{entry_key}|{self.n_threads}") is not None:
                    continue
                g, _, builder, kernels, keys = self._lower(graph, self.passes, False, entry_key)
            except Exception:  # noqa: BLE001 - whatever lowering raises, compile() raises it again and names it
                continue
            missing = [i for i, key in enumerate(keys) if key not in pending and self.cache.get(key) is None]
            for i, job in zip(missing, self._jobs(g, builder, kernels, missing), strict=True):
                pending[keys[i]] = job
        order = sorted(pending, key=lambda key: -pending[key][0])
        try:
            compiled = compile_jobs([_or_nothing(pending[key][2]) for key in order], self.compile_workers,
                                    [pending[key][1] for key in order])
        except CodegenError:     # a worker killed by LLVM: compile() meets it again, for its own graph
            return 0
        done = [(key, obj) for key, (obj, _, _) in zip(order, compiled, strict=True) if obj]
        for key, obj in done:
            self.cache.put(key, obj)
        return len(done)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
