"""What building a model graph returns (the contract between the builders and the context).

    built = model.build_graph(config)
    built.graph        # the symbolic graph
    built.inputs       # InputSpec per graph input: its kind, its leaves and its parameters
    built.memory       # the KV layouts the graph reads and writes
    built.layers       # the layer of every node and leaf

The context fills inputs by kind (llama.cpp's llm_graph_input_* objects, created by the builder);
placement and the runner read the layer map instead of parsing names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from llamir.ir import Graph

if TYPE_CHECKING:
    from llamir.frontend.graph_kv import KVLayout

INPUT_LAYER = -1   # llama.cpp's il = -1: what comes before the first block


@dataclass(frozen=True)
class InputSpec:
    """One graph input object: `kind` (embd, pos, out_ids, attn_kv, attn_no_cache, mean, cls),
    the leaves it fills and its parameters (e.g. a cache's suffix)."""

    kind: str
    leaves: tuple[str, ...]
    params: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))

    def param(self, key: str, default=None):
        return self.params.get(key, default)


class LayerMap:
    """The layer of every value of a graph, recorded while it was built: a block index, INPUT_LAYER
    before the first block, n_layer for the output layer (as llama.cpp counts layers). Nodes are
    stored by position, so the map also reads a copy of the graph with the same node order (a
    graph with its dims bound); leaves by name."""

    def __init__(self, node_layers: tuple[int, ...], leaf_layers: Mapping[str, int], n_layer: int):
        self.node_layers, self.leaf_layers, self.n_layer = node_layers, dict(leaf_layers), n_layer
        self._of: dict[int, tuple[Graph, dict[int, int]]] = {}

    @property
    def output(self) -> int:
        return self.n_layer

    def of(self, graph: Graph) -> dict[int, int]:
        """id(value) -> layer for every node and leaf of `graph` (this graph or a copy in the same
        order); a leaf added later (a duplicated output weight) takes its users' layer."""
        hit = self._of.get(id(graph))
        if hit is not None and hit[0] is graph:
            return hit[1]
        if len(graph.nodes) != len(self.node_layers):
            raise ValueError(f"graph {graph.name} has {len(graph.nodes)} nodes; the layer map was recorded "
                             f"for {len(self.node_layers)}")
        out = {id(n): layer for n, layer in zip(graph.nodes, self.node_layers, strict=True)}
        for leaf in graph.leafs:
            layer = self.leaf_layers.get(leaf.name)
            if layer is None:
                users = [out[id(u)] for u in leaf.users if id(u) in out]
                layer = min(users) if users else INPUT_LAYER
            out[id(leaf)] = layer
        if len(self._of) > 8:
            self._of.clear()
        self._of[id(graph)] = (graph, out)
        return out


@dataclass
class BuiltGraph:
    """A model graph with its inputs, the memory it uses and its layer map."""

    graph: Graph
    inputs: tuple[InputSpec, ...]
    memory: tuple[KVLayout, ...]
    layers: LayerMap

    def input(self, kind: str) -> InputSpec | None:
        return next((spec for spec in self.inputs if spec.kind == kind), None)


__all__ = ["INPUT_LAYER", "BuiltGraph", "InputSpec", "LayerMap"]
