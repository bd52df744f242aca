"""SplitPlan: the result of scheduling a graph over backends (ggml_backend_sched's splits).

Every value has a backend and the cause of that choice; splits are contiguous runs of nodes on
one backend; a split's inputs are values from other backends that it copies in. The plan
prints as text (golden-testable), as JSON, and explains any node's placement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llamir.ir import Graph, Node
from llamir.sched.cost import CPU_COST, copy_seconds, op_seconds

if TYPE_CHECKING:
    from llamir.backends.base import Backend, BufferType, CostModel

# ggml's SET_CAUSE codes, spelled out for --explain
CAUSES = {
    "usr": "pinned by the caller (ggml_backend_sched_set_tensor_backend)",
    "1.dst": "its memory is pre-allocated in a buffer this backend uses",
    "1.vsrc": "it views pre-allocated memory in a buffer this backend uses",
    "1.inp": "graph inputs start on the CPU (the last backend)",
    "1.wgt": "it uses a weight stored in this backend's buffer",
    "1.off": "op_offload: its weight is in host memory and this backend claims the op for this batch size",
    "2.gpu-down": "expanded forward from a neighbouring non-CPU node",
    "2.gpu-up": "expanded backward from a neighbouring non-CPU node",
    "2.rest-down": "expanded forward from a neighbouring node",
    "2.rest-up": "expanded backward from a neighbouring node",
    "3.best": "the backend supporting the op with the most inputs already on it",
    "3.upg": "upgraded to a higher-priority backend sharing the buffer type",
    "4.vsrc": "a view lives with the memory it views",
    "4.cur": "an unassigned source follows the node that uses it",
    "4.first": "the first backend that supports the op",
    "6.cpy": "a pipeline copy of a graph input",
}


class SchedError(ValueError):
    """A graph the scheduler cannot place; the message names the value, op and backends."""


@dataclass(frozen=True)
class TensorBuffer:
    """Where a pre-allocated leaf (weight, KV cache) lives: a buffer type and whether the buffer
    holds weights (ggml's GGML_BACKEND_BUFFER_USAGE_WEIGHTS; the KV cache does not)."""

    buft: BufferType
    weights: bool = True


@dataclass(frozen=True)
class Cause:
    """Why a value went where it did: ggml's code, a sentence, and the value it followed."""

    code: str
    detail: str = ""
    via: Node | None = None

    def __str__(self) -> str:
        return f"{self.code}: {self.detail}" if self.detail else self.code


@dataclass(frozen=True, eq=False)
class InputCopy:
    """The copy of `src` on backend `backend` for pipeline copy `copy` ("gpu0#kq_mask#0")."""

    src: Node
    backend: int
    copy: int
    name: str
    nbytes: int


@dataclass
class Split:
    """Nodes graph.nodes[i_start:i_end] on one backend, and the inputs it copies in."""

    index: int
    backend: int
    i_start: int
    i_end: int
    inputs: list[Node] = field(default_factory=list)
    copies: list[InputCopy] = field(default_factory=list)  # copies[k] is inputs[k] for cur_copy
    pipeline: list[list[InputCopy]] = field(default_factory=list)  # every pipeline copy of inputs[k]


Ref = Node | InputCopy


def value_label(value: Ref, ids: dict[int, int]) -> str:
    if isinstance(value, InputCopy):
        return value.name
    return value.name if value.name else f"%{ids[id(value)]}"


@dataclass
class SplitPlan:
    """Backends, assignments with causes, splits and copies of one concrete graph."""

    graph: Graph
    backends: list[Backend]
    n_copies: int
    cur_copy: int
    op_offload: bool
    assignment: dict[int, int]
    causes: dict[int, Cause]
    splits: list[Split]
    sources: dict[int, tuple[Ref, ...]]  # node id -> its inputs after copies (only rewritten nodes)
    graph_input_copies: dict[int, list[Ref]] = field(default_factory=dict)  # n_copies > 1
    ids: dict[int, int] = field(default_factory=dict)
    # id(value) -> its row (a block index, "input" or "output"), from the builder's layer map, for
    # the pictures; set by whoever planned a model graph (llamir.cli_splits.plan_model)
    rows: dict[int, int | str] | None = None

    def __post_init__(self) -> None:
        self.ids = {id(v): i for i, v in enumerate(self.graph.all_values())}

    # -- queries ------------------------------------------------------------------------------
    @property
    def labels(self) -> list[str]:
        return [b.label for b in self.backends]

    def backend_index(self, value: Ref) -> int:
        if isinstance(value, InputCopy):
            return value.backend
        return self.assignment[id(value)]

    def backend_of(self, value: Ref) -> Backend:
        return self.backends[self.backend_index(value)]

    def inputs_of(self, node: Node) -> tuple[Ref, ...]:
        return self.sources.get(id(node), node.inputs)

    def label(self, value: Ref) -> str:
        return value_label(value, self.ids)

    def find(self, name: str) -> Node:
        """A value by name or %index; KeyError lists a few names when there is no match."""
        if name.startswith("%") and name[1:].isdigit():
            values = list(self.graph.all_values())
            k = int(name[1:])
            if k < len(values):
                return values[k]
        for value in self.graph.all_values():
            if value.name == name:
                return value
        raise KeyError(f"no value named {name!r} in graph {self.graph.name}")

    @property
    def n_splits(self) -> int:
        return len(self.splits)

    @property
    def n_split_copies(self) -> int:
        return sum(len(s.inputs) for s in self.splits)

    @property
    def bytes_moved(self) -> int:
        """Bytes copied between backends for one batch."""
        return sum(c.nbytes for s in self.splits for c in s.copies)

    def split_nodes(self, split: Split) -> list[Node]:
        return self.graph.nodes[split.i_start : split.i_end]

    # -- costs --------------------------------------------------------------------------------
    def cost_model(self, backend_index: int) -> CostModel:
        return self.backends[backend_index].cost_model or CPU_COST

    def copy_seconds(self, copy: InputCopy, from_backend: int) -> float:
        """A copy crosses the host link of each non-CPU side (device to device goes through the host)."""
        seconds = 0.0
        for b in (from_backend, copy.backend):
            if not self.backends[b].is_cpu:
                seconds += copy_seconds(self.cost_model(b), copy.nbytes)
        return seconds or copy_seconds(CPU_COST, copy.nbytes)

    def split_seconds(self, split: Split) -> tuple[float, float]:
        """(compute, copy-in) seconds of one split under the backends' cost models."""
        model = self.cost_model(split.backend)
        compute = sum(op_seconds(model, n) for n in self.split_nodes(split) if not n.op.is_view)
        copies = sum(
            self.copy_seconds(c, self.backend_index(i))
            for i, c in zip(split.inputs, split.copies, strict=True)
        )
        return compute, copies

    @property
    def est_seconds(self) -> float:
        """Estimated time per batch: splits run one after another, copies before each split."""
        return sum(sum(self.split_seconds(s)) for s in self.splits)

    # -- text ---------------------------------------------------------------------------------
    def explain(self, name: str) -> str:
        """Why `name` runs where it does, following expansions back to their origin."""
        value = self.find(name)
        lines, seen = [], set()
        while value is not None and id(value) not in seen:
            seen.add(id(value))
            cause = self.causes.get(id(value))
            where = self.labels[self.assignment[id(value)]]
            what = value.kind if value.is_leaf else value.op.name
            if cause is None:
                lines.append(f"{self.label(value)} ({what}) on {where}")
                break
            lines.append(
                f"{self.label(value)} ({what}) on {where}: [{cause.code}] "
                f"{cause.detail or CAUSES.get(cause.code, '')}"
            )
            value = cause.via
        copies = [
            f"  copied to {s.index} ({self.labels[s.backend]}) as {c.name}, {format_bytes(c.nbytes)}"
            for s in self.splits
            for i, c in zip(s.inputs, s.copies, strict=True)
            if i is self.find(name)
        ]
        return (
            "\n".join(
                ["  " * min(k, 1) + ("<- " if k else "") + line for k, line in enumerate(lines)] + copies
            )
            + "\n"
        )

    def to_text(self, show_nodes: bool = True) -> str:
        g = self.graph
        lines = [
            f"split plan of graph {g.name}: backends {', '.join(self.labels)}; n_copies {self.n_copies}"
            f" (copy {self.cur_copy}); op_offload {'on' if self.op_offload else 'off'}"
        ]
        for split in self.splits:
            nodes = [n for n in self.split_nodes(split) if not n.op.is_view]
            lines.append(
                f"split {split.index}: {self.labels[split.backend]}, nodes {split.i_start}..{split.i_end - 1}"
                f" ({len(nodes)} ops), {len(split.inputs)} inputs"
            )
            for inp, cpy in zip(split.inputs, split.copies, strict=True):
                lines.append(
                    f"  input {self.label(inp)} from {self.labels[self.backend_index(inp)]} -> {cpy.name}"
                    f" ({format_bytes(cpy.nbytes)})"
                )
            if show_nodes:
                for n in nodes:
                    lines.append(
                        f"  %{self.ids[id(n)]} {n.op.name} {n.type}"
                        f"{' ' + repr(n.name) if n.name else ''} [{self.causes[id(n)].code}]"
                    )
        lines.append(
            f"total: {self.n_splits} splits, {self.n_split_copies} copies, "
            f"{format_bytes(self.bytes_moved)} moved per batch, est. {self.est_seconds * 1e3:.3f} ms"
        )
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict:
        def node_entry(n: Node) -> dict:
            return {
                "id": self.ids[id(n)],
                "op": n.op.name,
                "name": n.name,
                "type": str(n.type),
                "cause": self.causes[id(n)].code,
                "detail": self.causes[id(n)].detail,
            }

        splits = []
        for s in self.splits:
            compute, copy = self.split_seconds(s)
            splits.append(
                {
                    "index": s.index,
                    "backend": self.labels[s.backend],
                    "i_start": s.i_start,
                    "i_end": s.i_end,
                    "inputs": [
                        {
                            "value": self.label(i),
                            "from": self.labels[self.backend_index(i)],
                            "copy": c.name,
                            "bytes": c.nbytes,
                        }
                        for i, c in zip(s.inputs, s.copies, strict=True)
                    ],
                    "nodes": [node_entry(n) for n in self.split_nodes(s) if not n.op.is_view],
                    "est_compute_s": compute,
                    "est_copy_s": copy,
                }
            )
        return {
            "graph": self.graph.name,
            "backends": self.labels,
            "n_copies": self.n_copies,
            "cur_copy": self.cur_copy,
            "op_offload": self.op_offload,
            "splits": splits,
            "totals": {
                "n_splits": self.n_splits,
                "n_copies": self.n_split_copies,
                "bytes_moved": self.bytes_moved,
                "est_seconds": self.est_seconds,
            },
        }


def format_bytes(n: int) -> str:
    if n >= 1 << 20:
        return f"{n / (1 << 20):.2f} MiB"
    if n >= 1 << 10:
        return f"{n / (1 << 10):.2f} KiB"
    return f"{n} B"


def est_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if math.isfinite(seconds) else "?"
