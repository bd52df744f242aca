"""Where the weights and the KV cache live, like llama.cpp's load_tensors (src/llama-model.cpp).

    placement = place_model(model, built, [gpu0, gpu1, cpu], PlacementParams(n_gpu_layers=20))
    placement.apply(graph)                      # a tied output gets its own leaf on its device
    sched = Scheduler(placement.backends, placement.buffers())

Layers: `n_gpu_layers` counts the output layer as one more layer, so the last
n_gpu_layers of the n_layer + 1 layers are offloaded (i_gpu_start = n_layer + 1 - n_gpu_layers).
Offloaded layers are spread over the devices by `tensor_split` (default: their free memory);
split_mode "none" puts them all on `main_gpu`. The input layer (token_embd) stays on the CPU.
Tensor overrides (regex on the tensor name -> device) are checked first. A layer weight whose
device cannot run the op that uses it falls back to the CPU (llama.cpp's select_weight_buft);
an override to such a device is an error.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from llamir.backends.base import Backend
from llamir.frontend.built import INPUT_LAYER, BuiltGraph, LayerMap
from llamir.ir import Graph, Node, ops
from llamir.sched.scheduler import TensorBuffer

SPLIT_MODES = ("none", "layer")
OP_OFFLOAD_MIN_BATCH = 32  # graph_get_cb pins norms below this batch size


class PlacementError(ValueError):
    """Placement parameters or device memory that cannot work; the message says which."""


@dataclass(frozen=True)
class PlacementParams:
    """llama_model_params' placement fields. n_gpu_layers < 0 means every layer."""

    n_gpu_layers: int = -1
    split_mode: str = "layer"
    main_gpu: int = 0
    tensor_split: tuple[float, ...] = ()
    overrides: tuple[tuple[str, str], ...] = ()  # (regex, device name), first match wins
    offload_kqv: bool = True


@dataclass(frozen=True)
class WeightPlace:
    device: str
    reason: str


@dataclass
class Placement:
    """The devices a model uses, the device of every layer, weight and KV-cache tensor."""

    devices: list[Backend]
    cpu: Backend
    params: PlacementParams
    n_layer: int
    layer_device: list[str]
    output_device: str
    weights: dict[str, WeightPlace] = field(default_factory=dict)
    state: dict[str, str] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)  # leaf name -> GGUF tensor it duplicates
    weight_bytes: dict[str, int] = field(default_factory=dict)
    state_bytes: dict[str, int] = field(default_factory=dict)
    layers: LayerMap | None = None  # the layer of every value of the placed graph

    @property
    def backends(self) -> list[Backend]:
        """The scheduler's backends in priority order: the model's devices, then the CPU."""
        return [*self.devices, self.cpu]

    @property
    def full_offload(self) -> bool:
        return self.n_gpu_layers > self.n_layer

    @property
    def n_gpu_layers(self) -> int:
        n = self.params.n_gpu_layers
        return self.n_layer + 1 if n < 0 else n

    def backend(self, name: str) -> Backend:
        for b in self.backends:
            if b.label == name:
                return b
        raise PlacementError(
            f"no device named {name!r} (devices: {', '.join(b.label for b in self.backends)})"
        )

    def buffers(self) -> dict[str, TensorBuffer]:
        """Leaf name -> buffer for the scheduler: weights (WEIGHTS usage) and the KV cache."""
        out = {
            name: TensorBuffer(self.backend(p.device).device.buffer_type(), True)
            for name, p in self.weights.items()
        }
        out.update(
            {
                name: TensorBuffer(self.backend(dev).device.buffer_type(), False)
                for name, dev in self.state.items()
            }
        )
        return out

    def apply(self, graph: Graph) -> Graph:
        """Give a tied output its own weight leaf (llama.cpp's duplicated token_embd), so the
        output matmul can run where the output layer lives. Idempotent; returns `graph`."""
        dup = "output.weight"
        if dup not in self.sources or any(leaf.name == dup for leaf in graph.leafs):
            return graph
        src = self.sources[dup]
        users = [n for n in graph.nodes if n.is_op(ops.MulMat) and n.inputs[0].name == src]
        if not users:
            return graph
        leaf = graph.add_leaf("weight", users[0].inputs[0].type, dup)
        for node in users:
            node.inputs = (leaf, *node.inputs[1:])
        graph.rebuild_users()
        return graph

    def weight_values(self, model, graph: Graph) -> dict:
        """Every weight leaf of `graph` by name, duplicates read from their source tensor."""
        return {
            leaf.name: model.weight_array(self.sources.get(leaf.name, leaf.name))
            for leaf in graph.leafs_of_kind("weight")
        }

    def pins(self, graph: Graph, n_tokens: int) -> dict[Node, str]:
        """llama_context::graph_get_cb: a layer's norm (and l_last) is pinned to the layer's device
        for small batches or full offload; without offload_kqv the attention output to the CPU."""
        out: dict[Node, str] = {}
        if n_tokens < OP_OFFLOAD_MIN_BATCH or self.full_offload:
            layer_of = self.layers.of(graph)
            for node in graph.nodes:
                if not _is_layer_norm(node):
                    continue
                il = layer_of[id(node)]
                if not 0 <= il < len(self.layer_device):
                    continue
                backend = self.backend(self.layer_device[il])
                if backend.supports_op(node):
                    out[node] = backend.label
        if not self.params.offload_kqv:
            for node in graph.nodes:
                if node.is_op(ops.Cont) and (node.name or "").startswith("kqv_out-"):
                    out[node] = self.cpu.label
        return out

    def memory_use(self) -> dict[str, tuple[int, int]]:
        """Device name -> (weight bytes, KV-cache bytes)."""
        return {
            b.label: (self.weight_bytes.get(b.label, 0), self.state_bytes.get(b.label, 0))
            for b in self.backends
        }

    def check_memory(self, compute: Mapping[str, int] | None = None) -> None:
        """PlacementError when weights + KV cache (+ compute buffers) exceed a device's memory."""
        for b in self.devices:
            w, kv = self.weight_bytes.get(b.label, 0), self.state_bytes.get(b.label, 0)
            c = (compute or {}).get(b.label, 0)
            total = w + kv + c
            if total > b.device.memory_total:
                extra = f" + compute {_mib(c)}" if compute else ""
                raise PlacementError(
                    f"not enough memory on {b.label}: weights {_mib(w)} + KV cache {_mib(kv)}{extra} = {_mib(total)}"
                    f" > {_mib(b.device.memory_total)} (n_gpu_layers = {self.params.n_gpu_layers}); offload fewer "
                    f"layers or give the device more memory"
                )

    def summary(self) -> str:
        groups: dict[str, list[str]] = {}
        for il, dev in enumerate(self.layer_device):
            groups.setdefault(dev, []).append(str(il))
        lines = [
            f"layers: {'; '.join(f'{d}: {_ranges(v)}' for d, v in groups.items())}; output: {self.output_device}"
        ]
        for b in self.backends:
            w, kv = self.weight_bytes.get(b.label, 0), self.state_bytes.get(b.label, 0)
            lines.append(f"{b.label}: weights {_mib(w)}, KV cache {_mib(kv)}")
        return "\n".join(lines) + "\n"


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"


def _ranges(items: list[str]) -> str:
    nums = [int(x) for x in items]
    out, start = [], nums[0]
    for a, b in zip(nums, nums[1:] + [None], strict=True):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)


def _is_layer_norm(node: Node) -> bool:
    """A tensor llama.cpp names "norm" (or "l_last"): a normalization whose result is then scaled
    by a norm weight (graph_get_cb pins these to their layer's device)."""
    if (node.name or "").startswith("l_last-"):
        return True
    return node.is_op(ops.RmsNorm, ops.Norm) and any(
        user.is_op(ops.Mul) and user.inputs[1].is_leaf and user.inputs[1].kind == "weight" for user in node.users)


def _layer_splits(devices: Sequence[Backend], tensor_split: Sequence[float]) -> list[float]:
    """Cumulative, normalised split points (by free memory when tensor_split is all zero)."""
    if tensor_split and len(tensor_split) != len(devices):
        raise PlacementError(
            f"tensor_split has {len(tensor_split)} values for {len(devices)} devices "
            f"({', '.join(d.label for d in devices)})"
        )
    if any(x < 0 for x in tensor_split):
        raise PlacementError(f"tensor_split values must be >= 0, got {list(tensor_split)}")
    weights = list(tensor_split) if any(tensor_split) else [float(d.device.memory_free) for d in devices]
    total, acc, out = sum(weights), 0.0, []
    for w in weights:
        acc += w
        out.append(acc / total)
    return out


def place_model(
    model, built: BuiltGraph, backends: Sequence[Backend], params: PlacementParams | None = None
) -> Placement:
    """Place `model`'s weights (those the built graph uses) and KV cache on `backends` (devices,
    CPU last), each by the layer the builder recorded for it."""
    graph = built.graph
    params = params or PlacementParams()
    if params.split_mode not in SPLIT_MODES:
        raise PlacementError(
            f"split_mode {params.split_mode!r} is not supported (choose one of {', '.join(SPLIT_MODES)})"
        )
    if not backends or not backends[-1].is_cpu:
        raise PlacementError("the device list must end with the CPU")
    cpu, gpus = backends[-1], list(backends[:-1])
    if params.split_mode == "none" and gpus:
        if not 0 <= params.main_gpu < len(gpus):
            raise PlacementError(f"main_gpu {params.main_gpu} is outside 0..{len(gpus) - 1}")
        gpus = [gpus[params.main_gpu]]
    n_layer = model.hparams.n_layer
    ngl = n_layer + 1 if params.n_gpu_layers < 0 else params.n_gpu_layers
    i_gpu_start = max(n_layer + 1 - ngl, 0)
    act_gpu_layers = min(ngl, n_layer + 1) if gpus else 0
    splits = _layer_splits(gpus, params.tensor_split if params.split_mode == "layer" else ()) if gpus else []

    def device_of_layer(il: int) -> str:
        if il < i_gpu_start or il - i_gpu_start >= act_gpu_layers:
            return cpu.label
        k = bisect.bisect_right(splits, (il - i_gpu_start) / act_gpu_layers)
        return gpus[min(k, len(gpus) - 1)].label

    placement = Placement(
        gpus, cpu, params, n_layer, [device_of_layer(il) for il in range(n_layer)], device_of_layer(n_layer),
        layers=built.layers,
    )
    overrides = [(re.compile(rx), dev) for rx, dev in params.overrides]
    for _, dev in params.overrides:
        placement.backend(dev)  # a clear error for an unknown or unused device
    if "output.weight" not in model.tensors:
        placement.sources["output.weight"] = "token_embd.weight"
    names = [leaf.name for leaf in graph.leafs_of_kind("weight")]
    if "output.weight" in placement.sources and "output.weight" not in names:
        names.append("output.weight")
    for name in names:
        placement.weights[name] = _place_weight(placement, graph, name, overrides)
        size = model.tensor(placement.sources.get(name, name)).n_bytes
        dev = placement.weights[name].device
        placement.weight_bytes[dev] = placement.weight_bytes.get(dev, 0) + size
    for leaf in graph.leafs_of_kind("state"):
        il = built.layers.leaf_layers[leaf.name]
        dev = placement.layer_device[il] if params.offload_kqv and 0 <= il < n_layer else cpu.label
        placement.state[leaf.name] = dev
        placement.state_bytes[dev] = placement.state_bytes.get(dev, 0) + int(leaf.type.nbytes)
    placement.check_memory()
    return placement


def _consumers(graph: Graph, name: str, source: str | None) -> list[Node]:
    if name == "output.weight" and source:
        return [
            n
            for n in graph.nodes
            if n.is_op(ops.MulMat)
            and n.inputs[0].name in (name, source)
            and (n.name == "result_output" or n is graph.outputs.get("logits"))
        ]
    leaf = next((x for x in graph.leafs if x.name == name), None)
    return list(leaf.users) if leaf is not None else []


def _place_weight(p: Placement, graph: Graph, name: str, overrides) -> WeightPlace:
    users = _consumers(graph, name, p.sources.get(name))
    for rx, dev in overrides:
        if rx.search(name):
            backend = p.backend(dev)
            bad = [u for u in users if not backend.supports_op(u)]
            if bad:
                raise PlacementError(
                    f"tensor {name} is overridden to {dev} by {rx.pattern!r}, but {dev} cannot run "
                    f"{bad[0].op.name} ({bad[0].name or 'unnamed'}) that uses it"
                )
            return WeightPlace(dev, f"override {rx.pattern}={dev}")
    layer = p.layers.leaf_layers.get(name, p.n_layer)   # a duplicated output weight: the output layer
    if layer == INPUT_LAYER:
        return WeightPlace(p.cpu.label, "input layer (always on the CPU)")
    dev = p.output_device if layer >= p.n_layer else p.layer_device[layer]
    where = "output layer" if layer >= p.n_layer else f"layer {layer}"
    backend = p.backend(dev)
    bad = [u for u in users if not backend.supports_op(u)]
    if bad:  # select_weight_buft: the next buffer type in the list, the CPU's
        return WeightPlace(p.cpu.label, f"{where} is on {dev}, which cannot run {bad[0].op.name} with it")
    return WeightPlace(dev, where)
