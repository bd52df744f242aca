"""The split plan as a picture a person can read: one row per layer (and rows for what comes before
the first layer and after the last), each row's ops as a bar coloured by device and cut where a
split starts, every split as a band over the rows it spans, every copy written out in the row that
first reads it (tensor, from -> to, bytes), and the totals.

The SVG is written by hand and is deterministic; `render.svg_to_png` rasterizes it. The node-level
graph of a few layers is in draw_graph.py (graphviz).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from html import escape

from llamir.sched.layers import Row, plan_rows, row_order, row_title
from llamir.sched.plan import InputCopy, SplitPlan, est_ms, format_bytes

PALETTE = (
    "#4e79a7",
    "#f28e2b",
    "#59a14f",
    "#b07aa1",
    "#edc948",
    "#76b7b2",
    "#ff9da7",
    "#9c755f",
    "#e15759",
    "#bab0ac",
)
CPU_COLOUR = "#b8b8b8"
COPY_COLOUR = "#d62728"
FONT = 13  # px; the picture is drawn 1:1, so this is what a reader sees at 100 %
PAD, LABEL_W, LANE_W, BAR_W, COPY_W = 18, 86, 150, 430, 430
ROW_H, LINE_H, TOP = 26, 17, 118


def backend_colour(plan: SplitPlan, b: int) -> str:
    return CPU_COLOUR if plan.backends[b].is_cpu else PALETTE[b % len(PALETTE)]


def ink_on(colour: str) -> str:
    """Black or white text, whichever reads better on `colour` ("#rrggbb")."""
    r, g, b = (int(colour[k : k + 2], 16) for k in (1, 3, 5))
    return "#000000" if 0.299 * r + 0.587 * g + 0.114 * b > 140 else "#ffffff"


def _text_w(text: str, size: int = FONT) -> float:
    return 0.6 * size * len(text)  # DejaVu/Liberation Sans average advance, slightly generous


@dataclass
class _Segment:
    """A run of one row's ops, in node order, that sit in one split."""

    split: int
    n_ops: int


@dataclass
class _RowInfo:
    row: Row
    segments: list[_Segment] = field(default_factory=list)
    copies: list[tuple[int, object, InputCopy]] = field(default_factory=list)  # (split, input, copy)
    y: int = 0
    h: int = ROW_H


def _rows(plan: SplitPlan, layer_of: Mapping[int, Row]) -> list[_RowInfo]:
    infos = {r: _RowInfo(r) for r in row_order(layer_of[id(n)] for n in plan.graph.nodes)}
    for split in plan.splits:
        for node in plan.split_nodes(split):
            if node.op.is_view:
                continue
            segments = infos[layer_of[id(node)]].segments
            if segments and segments[-1].split == split.index:
                segments[-1].n_ops += 1
            else:
                segments.append(_Segment(split.index, 1))
    for split, row, inp, copy in _copy_rows(plan, layer_of):
        infos[row].copies.append((split, inp, copy))
    return list(infos.values())


def _copy_rows(plan: SplitPlan, layer_of: Mapping[int, Row]):
    """(split, row, input, copy): each copy is shown in the top row of the split that reads it."""
    order = {r: k for k, r in enumerate(row_order(layer_of.values()))}
    for split in plan.splits:
        readers: dict[int, Row] = {}
        for node in plan.split_nodes(split):
            for ref in plan.inputs_of(node):
                if isinstance(ref, InputCopy):
                    row = layer_of[id(node)]
                    if id(ref) not in readers or order[row] < order[readers[id(ref)]]:
                        readers[id(ref)] = row
        first = layer_of[id(plan.graph.nodes[split.i_start])] if split.i_end > split.i_start else None
        for inp, copy in zip(split.inputs, split.copies, strict=True):
            row = readers.get(id(copy), first)
            if row is not None:
                yield split.index, row, inp, copy


def _lanes(extents: list[tuple[int, int]]) -> list[int]:
    """Greedy interval colouring: splits that share a row go in different lanes."""
    lane_end: list[int] = []
    lanes = []
    for lo, hi in extents:
        for k, end in enumerate(lane_end):
            if end < lo:
                lane_end[k] = hi
                lanes.append(k)
                break
        else:
            lane_end.append(hi)
            lanes.append(len(lane_end) - 1)
    return lanes


def plan_to_svg(plan: SplitPlan, title: str = "") -> str:
    """The plan as an SVG document (text): layer rows, split bands, copies with their bytes."""
    layer_of = plan_rows(plan)
    rows = _rows(plan, layer_of)
    y = TOP
    for info in rows:
        info.y, info.h = y, max(ROW_H, 8 + LINE_H * len(info.copies))
        y += info.h
    bottom = y
    index = {info.row: k for k, info in enumerate(rows)}
    extents = []
    for split in plan.splits:
        touched = [index[layer_of[id(n)]] for n in plan.split_nodes(split)]
        extents.append((min(touched), max(touched)) if touched else (0, 0))
    lanes = _lanes(extents)
    n_lanes = max(lanes, default=0) + 1
    lane_w = LANE_W if n_lanes <= 3 else max(12, 3 * LANE_W // n_lanes)
    x_lanes = PAD + LABEL_W
    x_bar = x_lanes + n_lanes * lane_w + PAD
    x_copy = x_bar + BAR_W + PAD
    width = x_copy + COPY_W + PAD
    height = bottom + 2 * PAD + LINE_H

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="DejaVu Sans, Liberation Sans, Arial, sans-serif" '
        f'font-size="{FONT}">',
        '<defs><marker id="copy" markerWidth="8" markerHeight="8" refX="7" refY="4" orient="auto">'
        f'<path d="M0,0 L8,4 L0,8 z" fill="{COPY_COLOUR}"/></marker></defs>',
        f'<rect width="{width}" height="{height}" fill="white"/>',
    ]
    out += _header(plan, title, x_lanes, x_bar, x_copy)
    for k, info in enumerate(rows):
        if k % 2:
            out.append(f'<rect x="{PAD}" y="{info.y}" width="{width - 2 * PAD}" height="{info.h}" fill="#f4f4f4"/>')
        out.append(
            f'<text class="row" x="{PAD + 4}" y="{info.y + 18}" font-weight="bold">{escape(row_title(info.row))}</text>'
        )
    for split, (lo, hi), lane in zip(plan.splits, extents, lanes, strict=True):
        out += _band(plan, split, rows[lo].y, rows[hi].y + rows[hi].h, x_lanes + lane * lane_w, lane_w)
    max_ops = max((sum(s.n_ops for s in info.segments) for info in rows), default=1) or 1
    for info in rows:
        out += _bar(plan, info, x_bar, BAR_W / max_ops)
        out += _copy_lines(plan, info, x_copy)
    out.append(
        f'<text class="totals" x="{PAD}" y="{bottom + PAD + 12}" font-weight="bold">total: {plan.n_splits} splits, '
        f"{plan.n_split_copies} copies, {escape(format_bytes(plan.bytes_moved))} moved per batch, "
        f"est. {escape(est_ms(plan.est_seconds))}</text>"
    )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _header(plan: SplitPlan, title: str, x_lanes: int, x_bar: int, x_copy: int) -> list[str]:
    head = title or f"split plan of graph {plan.graph.name}"
    out = [
        f'<text x="{PAD}" y="26" font-size="17" font-weight="bold">{escape(head)}</text>',
        f'<text x="{PAD}" y="48">{plan.n_splits} splits, {plan.n_split_copies} copies, '
        f"{escape(format_bytes(plan.bytes_moved))} moved per batch; n_copies {plan.n_copies}, "
        f"op_offload {'on' if plan.op_offload else 'off'}</text>",
    ]
    n_ops = [0] * len(plan.backends)
    for split in plan.splits:
        n_ops[split.backend] += sum(1 for n in plan.split_nodes(split) if not n.op.is_view)
    x = PAD
    for b, backend in enumerate(plan.backends):
        label = f"{backend.label} ({n_ops[b]} ops)"
        out.append(
            f'<g class="legend"><rect x="{x}" y="60" width="16" height="16" fill="{backend_colour(plan, b)}" '
            f'stroke="#333"/><text x="{x + 22}" y="73">{escape(label)}</text></g>'
        )
        x += 40 + int(_text_w(label))
    out.append(
        f'<line x1="{x}" y1="68" x2="{x + 26}" y2="68" stroke="{COPY_COLOUR}" stroke-width="2" '
        f'marker-end="url(#copy)"/><text x="{x + 32}" y="73">copy between devices</text>'
    )
    y = TOP - 8
    for x0, text in ((PAD + 4, "layer"), (x_lanes, "splits"), (x_bar, "ops in node order, by split"),
                     (x_copy, "copies into the split: tensor, from -> to, bytes")):
        out.append(f'<text x="{x0}" y="{y}" fill="#555">{escape(text)}</text>')
    return out


def _band(plan: SplitPlan, split, y0: int, y1: int, x: int, w: int) -> list[str]:
    colour = backend_colour(plan, split.backend)
    label = plan.labels[split.backend]
    n_ops = sum(1 for n in plan.split_nodes(split) if not n.op.is_view)
    tip = (f"split {split.index}: {label}, nodes {split.i_start}..{split.i_end - 1}, {n_ops} ops, "
           f"{len(split.inputs)} inputs")
    out = [
        f'<g class="band" data-split="{split.index}"><title>{escape(tip)}</title>'
        f'<rect x="{x + 2}" y="{y0 + 2}" width="{w - 4}" height="{y1 - y0 - 4}" rx="5" fill="{colour}" '
        f'fill-opacity="0.45" stroke="{colour}" stroke-width="2"/>'
    ]
    lines = [f"split {split.index}: {label}", f"{n_ops} ops"]
    if y1 - y0 < 2 * LINE_H + 6:
        lines = [f"split {split.index}: {label}"] if y1 - y0 >= LINE_H + 4 else []
    for k, line in enumerate(lines):
        if _text_w(line) <= w - 10:
            out.append(f'<text class="band-label" x="{x + 8}" y="{y0 + 18 + k * LINE_H}">{escape(line)}</text>')
        elif k == 0 and _text_w(f"{split.index}") <= w - 6:
            out.append(f'<text class="band-label" x="{x + 4}" y="{y0 + 18}">{split.index}</text>')
    out.append("</g>")
    return out


def _bar(plan: SplitPlan, info: _RowInfo, x: float, px_per_op: float) -> list[str]:
    out = []
    for seg in info.segments:
        split = plan.splits[seg.split]
        w = seg.n_ops * px_per_op
        colour = backend_colour(plan, split.backend)
        tip = f"{row_title(info.row)}: {seg.n_ops} ops in split {seg.split} on {plan.labels[split.backend]}"
        out.append(
            f'<g class="segment" data-split="{seg.split}"><title>{escape(tip)}</title>'
            f'<rect x="{x:.1f}" y="{info.y + 4}" width="{w:.1f}" height="{ROW_H - 8}" fill="{colour}" stroke="#333"/>'
        )
        for text in (f"split {seg.split}: {seg.n_ops} ops", f"{seg.split}: {seg.n_ops}", f"{seg.split}"):
            if _text_w(text, FONT - 1) <= w - 6:
                out.append(f'<text x="{x + 4:.1f}" y="{info.y + 18}" font-size="{FONT - 1}" '
                           f'fill="{ink_on(colour)}">{escape(text)}</text>')
                break
        out.append("</g>")
        x += w
    return out


def _copy_lines(plan: SplitPlan, info: _RowInfo, x: int) -> list[str]:
    out = []
    for k, (split, inp, copy) in enumerate(info.copies):
        y = info.y + 18 + k * LINE_H
        src, dst = plan.labels[plan.backend_index(inp)], plan.labels[copy.backend]
        text = f"{plan.label(inp)}: {src} -> {dst} (split {split}), {format_bytes(copy.nbytes)}"
        tip = f"split {split} reads {copy.name} ({format_bytes(copy.nbytes)})"
        out.append(
            f'<g class="copy" data-split="{split}" data-bytes="{copy.nbytes}"><title>{escape(tip)}</title>'
            f'<line x1="{x}" y1="{y - 4}" x2="{x + 18}" y2="{y - 4}" stroke="{COPY_COLOUR}" stroke-width="2" '
            f'marker-end="url(#copy)"/><text x="{x + 24}" y="{y}" fill="#8b0000">{escape(text)}</text></g>'
        )
    return out


__all__ = ["backend_colour", "plan_to_svg"]
