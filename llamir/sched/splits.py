"""Splits and copies, passes 5 and 6 of ggml_backend_sched_split_graph: the assigned graph is cut
into contiguous runs of one backend, and every input a split cannot read where it lives gets a
copy on the split's backend (one per pipeline slot when n_copies > 1).
"""

from __future__ import annotations

from llamir.ir import Node
from llamir.ir.geometry import ggml_nbytes, value_strides
from llamir.sched.assign import Assignment
from llamir.sched.plan import InputCopy, Split, SplitPlan


def _nbytes(a: Assignment, value: Node) -> int:
    return ggml_nbytes(value, value_strides(value, a.strides))


def _copy_of(a: Assignment, src: Node, b: int, copies: dict, split: Split) -> InputCopy:
    key = (id(src), b)
    if key not in copies:
        name = f"{a.backends[b].label}#{src.name or f'%{a.ids[id(src)]}'}"
        copies[key] = [InputCopy(src, b, c, f"{name}#{c}", _nbytes(a, src)) for c in range(a.s.n_copies)]
        split.inputs.append(src)
        split.copies.append(copies[key][a.s.cur_copy])
        split.pipeline.append(copies[key])
    return copies[key][a.s.cur_copy]


def _needs_new_split(a: Assignment, node: Node, split: Split) -> bool:
    """ggml starts a new split on the same backend when a node reads a weight the split's backend
    cannot use in place, so that the weight's copy does not overwrite an earlier one."""
    return bool(split.inputs) and any(
        src.is_leaf
        and (tb := a.buffer(src)) is not None
        and tb.weights
        and a.get(src) != split.backend
        and not a.buffer_supported(src, split.backend)
        for src in node.inputs
    )


def cut_splits(a: Assignment) -> tuple[list[Split], dict[int, tuple]]:
    """Pass 5: the splits, and each node's inputs with copies substituted where needed."""
    nodes = a.graph.nodes
    first = next((n for n in nodes if not n.op.is_view), None)
    splits = [Split(0, a.get(first) if first is not None else a.s.cpu, 0, len(nodes))]
    copies: dict[tuple[int, int], list[InputCopy]] = {}
    sources: dict[int, tuple] = {}
    for i, node in enumerate(nodes):
        if node.op.is_view:
            continue
        split, nb = splits[-1], a.get(node)
        if nb != split.backend or _needs_new_split(a, node, split):
            split.i_end = i
            split = Split(len(splits), nb, i, len(nodes))
            splits.append(split)
        new_inputs = list(node.inputs)
        for j, src in enumerate(node.inputs):
            if a.get(src) != split.backend and not a.buffer_supported(src, split.backend):
                new_inputs[j] = _copy_of(a, src, split.backend, copies, split)
        if any(x is not y for x, y in zip(new_inputs, node.inputs, strict=True)):
            sources[id(node)] = tuple(new_inputs)
    return splits, sources


def graph_input_copies(a: Assignment) -> dict[int, list]:
    """Pass 6 (n_copies > 1): each graph input gets a copy per pipeline slot on its backend;
    the current slot's copy is the input itself."""
    if a.s.n_copies == 1:
        return {}
    out = {}
    for leaf in a.graph.leafs_of_kind("input"):
        b = a.get(leaf)
        name = f"{a.backends[b].label}#{leaf.name}"
        out[id(leaf)] = [
            leaf if c == a.s.cur_copy else InputCopy(leaf, b, c, f"{name}#{c}", _nbytes(a, leaf))
            for c in range(a.s.n_copies)
        ]
    return out


def build_plan(a: Assignment) -> SplitPlan:
    """The SplitPlan of an assignment whose passes 1-4 have run."""
    splits, sources = cut_splits(a)
    s = a.s
    return SplitPlan(
        a.graph, a.backends, s.n_copies, s.cur_copy, s.op_offload, a.assign, a.causes, splits, sources,
        graph_input_copies(a),
    )
