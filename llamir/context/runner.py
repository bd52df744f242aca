"""How a context runs graphs: weight placement on its devices, the scheduler, worst-case
reservation, and per-ubatch execution (llama_context's sched_reserve / graph_compute).

With only the CPU backend the whole graph is one split, so the runner executes the backend's
compiled symbolic graph directly (no re-split per batch, nothing recompiled while generating).
With devices, every ubatch's bound graph is split, allocated and computed split by split.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from llamir.backends import Backend, BufferUsage, TensorData
from llamir.backends.base import alloc_tensors
from llamir.frontend.adapter import AdaptedModel, AdapterSet
from llamir.frontend.built import BuiltGraph
from llamir.frontend.graph_context import GraphConfig
from llamir.frontend.placement import Placement, PlacementParams, place_model
from llamir.ir import ops
from llamir.ir.bind import bind_dims
from llamir.sched.scheduler import Scheduler

log = logging.getLogger("llamir")


@dataclass
class CompiledGraph:
    """One GraphConfig's symbolic graph, its placement and (CPU-only) executable."""

    graph: object
    placement: Placement
    weights: dict
    executable: object | None
    bound: dict
    built: BuiltGraph   # the graph's input specs, memory layouts and layer map


class Runner:
    def __init__(self, model, backends: list[Backend], placement_params: PlacementParams, op_offload: bool):
        self.model = model
        self.backends = backends
        self.placement_params = placement_params
        self.op_offload = op_offload
        self.graphs: dict[GraphConfig, CompiledGraph] = {}
        self.sched: Scheduler | None = None
        self.n_splits: dict[str, int] = {}
        self.reserved = False
        self.device_weights: dict[str, TensorData] = {}
        self._scheduled: tuple | None = None  # (bound graph, pins key, ScheduledGraph) of the last run
        self.n_sched_reused = 0
        self.adapter_tensors: dict = {}   # graph leaf name -> the LoRA / control vector tensor it reads

    @property
    def cpu(self) -> Backend:
        return self.backends[-1]

    @property
    def single(self) -> bool:
        return len(self.backends) == 1

    def compiled(self, config: GraphConfig) -> CompiledGraph:
        if config not in self.graphs:
            built = self.model.build_graph(config)
            graph = built.graph
            placement = place_model(self._weight_source(config), built, self.backends, self.placement_params)
            placement.apply(graph)
            if self.sched is None:
                self.sched = Scheduler(placement.backends, placement.buffers(), op_offload=self.op_offload)
            else:
                self.sched.buffers.update(placement.buffers())
            executable = None
            if self.single:
                unsupported = self.cpu.unsupported(graph)
                if unsupported:
                    from llamir.backends import BackendError

                    names = ", ".join(sorted({n.op.name for n in unsupported}))
                    raise BackendError(f"backend {self.cpu.name} cannot run: {names}")
                executable = self.cpu.compile(graph)
            weights = self._resident(placement, placement.weight_values(self._weight_source(config), graph))
            self.graphs[config] = CompiledGraph(graph, placement, weights, executable, {}, built)
        return self.graphs[config]

    def _weight_source(self, config: GraphConfig):
        """Where a graph's weights come from: the model, and for a graph with adapters their tensors."""
        return AdaptedModel(self.model, self.adapter_tensors) if config.adapters else self.model

    def use_adapters(self, adapters: AdapterSet, tensors: dict) -> None:
        """The adapter set graphs are built with from now on, and its leaves' tensors: compiled graphs
        of other sets are dropped (the graphs without adapters stay), a graph of this set reads the
        tensors as they are now (a control vector's new data), and device copies of adapter tensors
        that changed are made again."""
        old = self.adapter_tensors
        self.adapter_tensors = dict(tensors)
        for name in [n for n in self.device_weights if n in old and old[n] is not tensors.get(n)]:
            del self.device_weights[name]
        for config in [c for c in self.graphs if c.adapters and c.adapters != adapters]:
            del self.graphs[config]
        self._scheduled = None
        for config, cg in self.graphs.items():
            if config.adapters:
                cg.weights = self._resident(cg.placement, cg.placement.weight_values(self._weight_source(config),
                                                                                     cg.graph))

    def _resident(self, placement: Placement, weights: dict) -> dict:
        """Weights placed on a device are copied into its memory once (one WEIGHTS buffer per
        device, as llama.cpp's model loader does) and stay there; host weights stay as they are."""
        buffers = placement.buffers()
        todo: dict[int, tuple] = {}
        for name, array in weights.items():
            tb = buffers.get(name)
            if tb is None or tb.buft.is_host or name in self.device_weights:
                continue
            todo.setdefault(id(tb.buft), (tb.buft, {}))[1][name] = array
        for buft, arrays in todo.values():
            tensors = alloc_tensors(buft, {n: (a.shape, a.dtype) for n, a in arrays.items()}, BufferUsage.WEIGHTS)
            for name, td in tensors.items():
                td.write(arrays[name])
            self.device_weights.update(tensors)
            log.info("weights: %d tensors (%d bytes) copied into %s memory", len(tensors),
                     sum(td.nbytes for td in tensors.values()), buft.name)
        return {name: self.device_weights.get(name, array) for name, array in weights.items()}

    def _bound(self, cg: CompiledGraph, bindings: dict[str, int]):
        key = tuple(sorted(bindings.items()))
        if key not in cg.bound:
            if len(cg.bound) > 32:
                cg.bound.clear()
            cg.bound[key] = bind_dims(cg.graph, {k: v for k, v in bindings.items() if k in cg.graph.dim_names})
        return cg.bound[key]

    def plan(self, cg: CompiledGraph, bindings: dict[str, int], n_tokens: int):
        """The split plan of one bound graph (llama.cpp's sched_split_graph)."""
        g = self._bound(cg, bindings)
        return self.sched.split_graph(g, cg.placement.pins(g, n_tokens))

    def reserve(self, cg: CompiledGraph, worst: list[tuple[str, dict[str, int], int]]) -> dict[str, int]:
        """sched_reserve: measure each worst-case graph (pp, tg, pp); record split counts."""
        for label, bindings, n_tokens in worst:
            g = self._bound(cg, bindings)
            pins = cg.placement.pins(g, n_tokens)
            self.sched.reserve(g, pins)
            self.n_splits[label] = self.sched.split_graph(g, pins).n_splits
        self.reserved = True
        cg.placement.check_memory(self.sched.buffer_sizes())
        return self.sched.buffer_sizes()

    def run(self, cg: CompiledGraph, values: dict, bindings: dict[str, int], n_tokens: int, observe):
        if cg.executable is not None:
            return cg.executable(values, bindings, observe)
        g = self._bound(cg, bindings)
        pins = cg.placement.pins(g, n_tokens)
        key = frozenset((id(node), label) for node, label in pins.items())
        last = self._scheduled
        if last is not None and last[0] is g and last[1] == key and self.sched.n_copies == 1:
            # the graph is reused (llama.cpp's can_reuse): its splits and allocation stand, as
            # llama_context skips ggml_backend_sched_alloc_graph for a reused graph
            scheduled = last[2]
            self.n_sched_reused += 1
        else:
            scheduled = self.sched.alloc_graph(g, pins)
            self._scheduled = (g, key, scheduled)
        self.n_splits["last"] = scheduled.plan.n_splits
        return self.sched.graph_compute(scheduled, values, observe)

    def flash_attn_placed_well(self, cg: CompiledGraph, bindings: dict[str, int]) -> bool:
        """flash_attn=auto: every __fattn__-il node must land on layer il's device (llama.cpp
        turns flash attention off otherwise)."""
        plan = self.plan(cg, bindings, 1)
        bound = self._bound(cg, bindings)
        layer_of = cg.placement.layers.of(bound)
        for node in bound.nodes:
            if not node.is_op(ops.FlashAttnExt):
                continue
            il = layer_of[id(node)]
            device = cg.placement.layer_device[il]
            placed = plan.backend_of(node).label
            if placed != device:
                log.info("flash_attn auto: layer %d's attention runs on %s, not %s: disabling", il, placed, device)
                return False
        return True
