"""The layer of every value of a model graph, for the split pictures: a block index, or the
"input" / "output" rows for what comes before the first block and after the last.

The graph carries no layer table yet, so the layers come from what the frontend writes: a value
named by llama.cpp's callback convention (name=("attn_norm", 3) gives "attn_norm-3") or reading
a block weight ("blk.3.attn_q.weight") is in that block; an unnamed value belongs to the
earliest block that uses it (a layer's first rms_norm is unnamed and feeds "attn_norm-3"); what is
left goes to the input or output row by its position before or after the first block's values.
Pass an explicit `layer_of` to the drawing functions where a frontend knows better.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from llamir.ir import Graph, Node

INPUT, OUTPUT = "input", "output"
Row = int | str  # a block index, INPUT or OUTPUT

_CALLBACK_NAME = re.compile(r"^.+-(\d+)$")
_BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.")


def node_layers(graph: Graph) -> dict[int, Row]:
    """id(value) -> its row, for every leaf and node of `graph`."""
    rows: dict[int, Row] = {}
    for node in graph.nodes:
        layer = _own_layer(node)
        if layer is not None:
            rows[id(node)] = layer
    for node in reversed(graph.nodes):  # unnamed values join the earliest block using them
        if id(node) in rows or node.name:
            continue
        used_in = [rows[id(u)] for u in node.users if isinstance(rows.get(id(u)), int)]
        if used_in:
            rows[id(node)] = min(used_in)
    blocks = [i for i, n in enumerate(graph.nodes) if isinstance(rows.get(id(n)), int)]
    first = blocks[0] if blocks else len(graph.nodes)
    for i, node in enumerate(graph.nodes):
        rows.setdefault(id(node), INPUT if i < first else OUTPUT)
    for leaf in graph.leafs:
        rows[id(leaf)] = _leaf_layer(leaf, rows)
    return rows


def _own_layer(node: Node) -> int | None:
    m = _CALLBACK_NAME.match(node.name or "")
    if m:
        return int(m.group(1))
    for x in node.inputs:
        if x.is_leaf and x.kind == "weight":
            m = _BLOCK_TENSOR.match(x.name or "")
            if m:
                return int(m.group(1))
    return None


def _leaf_layer(leaf: Node, rows: Mapping[int, Row]) -> Row:
    """A block's weights and KV cache are in that block; graph inputs come before everything."""
    m = _BLOCK_TENSOR.match(leaf.name or "")
    if m:
        return int(m.group(1))
    if leaf.kind == "state":
        used_in = sorted({r for u in leaf.users if isinstance(r := rows.get(id(u)), int)})
        if used_in:
            return used_in[0]
    if leaf.kind == "weight" and leaf.users and all(rows.get(id(u)) == OUTPUT for u in leaf.users):
        return OUTPUT
    return INPUT


def row_order(rows: Iterable[Row]) -> list[Row]:
    """The rows present, top to bottom: input, blocks in order, output."""
    present = set(rows)
    blocks = sorted(r for r in present if isinstance(r, int))
    return [INPUT] * (INPUT in present) + blocks + [OUTPUT] * (OUTPUT in present)


def row_title(row: Row) -> str:
    return f"layer {row}" if isinstance(row, int) else row


def rows_title(rows: Iterable[Row]) -> str:
    """A selection of rows in words: "layers 3-5, output"."""
    parts, blocks = [], sorted(r for r in set(rows) if isinstance(r, int))
    if INPUT in set(rows):
        parts.append(INPUT)
    start = None
    for k, b in enumerate(blocks):
        start = b if start is None else start
        if k + 1 == len(blocks) or blocks[k + 1] != b + 1:
            parts.append(f"layer {b}" if start == b else f"layers {start}-{b}")
            start = None
    if OUTPUT in set(rows):
        parts.append(OUTPUT)
    return ", ".join(parts)


def parse_layers(text: str, n_layer: int) -> set[Row]:
    """A --layers selection: "3-5", "4", "input", "output", comma-separated ("28-29,output")."""
    chosen: set[Row] = set()
    for item in (s.strip() for s in text.split(",")):
        if item in (INPUT, OUTPUT):
            chosen.add(item)
            continue
        lo, sep, hi = item.partition("-")
        if not (lo.isdigit() and (not sep or hi.isdigit())):
            raise ValueError(f"--layers {text!r}: {item!r} is not a layer, a range A-B, 'input' or 'output'")
        a, b = int(lo), int(hi) if sep else int(lo)
        if not a <= b < n_layer:
            raise ValueError(f"--layers {text!r}: {item!r} is outside the model's layers 0-{n_layer - 1}")
        chosen.update(range(a, b + 1))
    return chosen
