"""Rows of the split pictures: a block index, or "input" / "output" for what comes before the
first block and after the last, from the layer map the model builder records
(llamir.frontend.built.LayerMap: -1 before the first block, n_layer for the output layer).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

INPUT, OUTPUT = "input", "output"
Row = int | str  # a block index, INPUT or OUTPUT


def rows_of(layers: Mapping[int, int], n_layer: int) -> dict[int, Row]:
    """id(value) -> row, from id(value) -> layer."""
    return {key: INPUT if layer < 0 else OUTPUT if layer >= n_layer else layer for key, layer in layers.items()}


def plan_rows(plan) -> Mapping[int, Row]:
    """The rows of a plan's values; a plan of a model graph carries them (SplitPlan.rows)."""
    if plan.rows is None:
        raise ValueError(f"the plan of {plan.graph.name} has no layer rows: plan a model graph with "
                         "llamir.cli_splits.plan_model, or set plan.rows from the builder's layer map")
    return plan.rows


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
