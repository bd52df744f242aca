"""LLVMBackend: whole splits compiled to native code with llvmlite (see the package docstring)."""

from __future__ import annotations

import logging
import os
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import ClassVar

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
from llamir.backends.llvm.compiler import CodegenError, optimize_and_emit
from llamir.backends.llvm.executable import CompiledSplit
from llamir.backends.llvm.lowering import Lowerer, supported
from llamir.backends.llvm.runtime import ThreadPool, load_object
from llamir.backends.llvm.target import Target, host_target
from llamir.ir import Graph, Node, ops, parse_graph, print_graph
from llamir.ir.numerics import Numerics, numerics_named

log = logging.getLogger("llamir")

DEFAULT_PASSES = "unfuse-attention,cse,fuse-rms-norm,fuse-norm,dce"


@dataclass
class CompileStats:
    """What the last compile did, for reports: seconds per phase, cache outcome."""

    plan_s: float = 0.0
    codegen_s: float = 0.0
    llvm_s: float = 0.0
    link_s: float = 0.0
    cache: str = ""
    n_kernels: int = 0
    n_steps: int = 0
    n_stages: int = 0
    history: list = field(default_factory=list)

    @property
    def total_s(self) -> float:
        return self.plan_s + self.codegen_s + self.llvm_s + self.link_s


class LLVMBackend(Backend):
    """CPU backend: one native entry per split, run-time dims, ggml-style threads."""

    name: ClassVar[str] = "llvm"
    _shared_caches: ClassVar[dict] = {}

    def __init__(self, n_threads: int | None = None, target: Target | None = None, passes: str = DEFAULT_PASSES,
                 cache_dir=None, disk_cache: bool = True, numerics: Numerics | str | None = None):
        """`numerics`: the ggml build whose arithmetic the code reproduces (default: the host's,
        see llamir.ir.numerics); any profile runs on any x86 target."""
        self.target = target or host_target()
        self.numerics = numerics_named(numerics)
        self.device = cpu_device("cpu", f"host CPU (LLVM JIT, {self.target.describe()}, numerics {self.numerics})")
        self.n_threads = n_threads or default_threads()
        self.passes = passes
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
        if n_threads < 1:
            raise ValueError(f"n_threads must be >= 1, got {n_threads}")
        if n_threads != self.n_threads:
            self.n_threads = n_threads
            _ = self.pool

    def supports_op(self, node: Node) -> bool:
        if node.is_op(ops.SoftMaxAttn):   # decomposed (unfuse-attention) before lowering
            return True
        return supported(node, self.target)

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
        t0 = time.perf_counter()
        g = parse_graph(print_graph(graph))
        passes = "unfuse-attention" if observe_variant else self.passes
        if passes:
            from llamir.passes.pipeline import run_pipeline

            run_pipeline(g, passes)
        lowerer = Lowerer(g, self.target, self.n_threads, self.numerics)
        if observe_variant:
            lowerer.keep_values = True
        plan = lowerer.run()
        t1 = time.perf_counter()
        builder = ModuleBuilder(plan, self.target, name=graph.name)
        variant = ("observe|" if observe_variant else "") + f"{self.numerics}|" + passes
        entry_key = self.cache.key(graph.fingerprint(), self.target.key, variant)
        objects, n_new = self._kernel_objects(builder.distinct_kernels(), stats)
        entry_obj = self.cache.get(entry_key)
        if entry_obj is None:
            t2 = time.perf_counter()
            module = builder.build()
            t3 = time.perf_counter()
            entry_obj = optimize_and_emit(module, self.target, speed_level=1)
            self.cache.put(entry_key, entry_obj)
            stats.codegen_s += t3 - t2
            stats.llvm_s += time.perf_counter() - t3
        stats.cache = "hit" if n_new == 0 else f"miss ({n_new} new kernels)"
        t4 = time.perf_counter()
        tracker, addrs = load_object(self.target, [entry_obj] + objects, [ENTRY, ARENA_SIZE])
        stats.plan_s, stats.link_s = t1 - t0, time.perf_counter() - t4
        stats.n_kernels = len(objects)
        stats.n_steps, stats.n_stages = len(plan.steps), plan.n_stages
        stats.history.append((graph.name, stats.cache, stats.total_s))
        self.compile_stats = stats
        log.info("llvm: compiled %s (%d steps, %d stages, %d kernels, %s) in %.2fs", graph.name, stats.n_steps,
                 stats.n_stages, stats.n_kernels, stats.cache, stats.total_s)
        debug = None if observe_variant else (lambda: self.compile(graph, observe_variant=True))
        exe = CompiledSplit(g, plan, FrameLayout.of(plan), addrs, tracker, self.pool, debug)
        self._executables.add(exe)
        return exe

    def _kernel_objects(self, kernels, stats: CompileStats) -> tuple[list[bytes], int]:
        """Object code of each kernel: from the cache, or compiled (in parallel: LLVM runs
        without the GIL)."""
        objects: dict[int, bytes] = {}
        todo = []
        for i, kernel in enumerate(kernels):
            key = self.cache.key(kernel_symbol(kernel), self.target.key, "kernel")
            obj = self.cache.get(key)
            if obj is None:
                todo.append((i, kernel, key))
            else:
                objects[i] = obj
        if todo:
            t0 = time.perf_counter()
            modules = [(i, kernel_module(kernel, self.target), key) for i, kernel, key in todo]
            t1 = time.perf_counter()
            workers = max(1, min(len(modules), self.n_threads))
            with ThreadPoolExecutor(workers) as pool:
                compiled = list(pool.map(lambda m: optimize_and_emit(m[1], self.target), modules))
            for (i, _, key), obj in zip(modules, compiled, strict=True):
                self.cache.put(key, obj)
                objects[i] = obj
            stats.codegen_s += t1 - t0
            stats.llvm_s += time.perf_counter() - t1
        return [objects[i] for i in range(len(kernels))], len(todo)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
