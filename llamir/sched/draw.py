"""Draw a split plan as SVG: one box per op, coloured by backend, laid out by topological
generation (networkx); edges that cross backends are copies, drawn red and dashed.

The SVG is written by hand (no graphviz or matplotlib needed); the output is deterministic.
"""

from __future__ import annotations

from html import escape

from llamir.ir import Node
from llamir.sched.plan import InputCopy, SplitPlan, format_bytes, view_root

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
CPU_COLOUR = "#c8c8c8"
BOX_W, BOX_H, GAP_X, GAP_Y, TOP = 120, 30, 16, 22, 70


def _colour(plan: SplitPlan, b: int) -> str:
    return CPU_COLOUR if plan.backends[b].is_cpu else PALETTE[b % len(PALETTE)]


def _drawn(plan: SplitPlan) -> list[Node]:
    """Ops (views folded into what they view) and the input/state leaves they read."""
    values = [
        v
        for v in plan.graph.all_values()
        if (v.is_leaf and v.kind != "weight") or (not v.is_leaf and not v.op.is_view)
    ]
    return [v for v in values if not v.is_leaf or v.users]


def _edges(plan: SplitPlan, drawn: set[int]) -> list[tuple[Node, Node, bool]]:
    edges = []
    for node in plan.graph.nodes:
        if node.op.is_view or id(node) not in drawn:
            continue
        for ref, orig in zip(plan.inputs_of(node), node.inputs, strict=True):
            root = orig
            while not root.is_leaf and root.op.is_view:
                root = root.inputs[0]
            if id(root) in drawn:
                edges.append((root, node, isinstance(ref, InputCopy)))
    return edges


def _layout(values: list[Node], edges) -> dict[int, tuple[int, int]]:
    import networkx as nx

    g = nx.DiGraph()
    order = {id(v): i for i, v in enumerate(values)}
    g.add_nodes_from(order.values())
    g.add_edges_from((order[id(a)], order[id(b)]) for a, b, _ in edges)
    pos = {}
    for row, generation in enumerate(nx.topological_generations(g)):
        for col, k in enumerate(sorted(generation)):
            pos[id(values[k])] = (col, row)
    return pos


def plan_to_svg(plan: SplitPlan) -> str:
    """The plan as an SVG document (text)."""
    values = _drawn(plan)
    edges = _edges(plan, {id(v) for v in values})
    pos = _layout(values, edges)
    n_cols = max((c for c, _ in pos.values()), default=0) + 1
    n_rows = max((r for _, r in pos.values()), default=0) + 1
    width = max(n_cols * (BOX_W + GAP_X) + GAP_X, 640)
    height = TOP + n_rows * (BOX_H + GAP_Y) + GAP_Y

    def xy(v: Node) -> tuple[int, int]:
        c, r = pos[id(v)]
        return GAP_X + c * (BOX_W + GAP_X), TOP + r * (BOX_H + GAP_Y)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="10">',
        '<defs><marker id="arrow" markerWidth="8" markerHeight="8" refX="7" refY="4" orient="auto">'
        '<path d="M0,0 L8,4 L0,8 z" fill="#555"/></marker>'
        '<marker id="copy" markerWidth="8" markerHeight="8" refX="7" refY="4" orient="auto">'
        '<path d="M0,0 L8,4 L0,8 z" fill="#d62728"/></marker></defs>',
        f'<text x="{GAP_X}" y="18" font-size="13">split plan of {escape(plan.graph.name)}: {plan.n_splits} splits, '
        f"{plan.n_split_copies} copies, {escape(format_bytes(plan.bytes_moved))} moved per batch</text>",
    ]
    x = GAP_X
    for b, backend in enumerate(plan.backends):
        out.append(
            f'<rect x="{x}" y="30" width="14" height="14" fill="{_colour(plan, b)}"/>'
            f'<text x="{x + 18}" y="41">{escape(backend.label)}</text>'
        )
        x += 30 + 7 * len(backend.label)
    out.append(
        f'<line x1="{x}" y1="37" x2="{x + 24}" y2="37" stroke="#d62728" stroke-dasharray="4,2" '
        f'marker-end="url(#copy)"/><text x="{x + 30}" y="41">copy</text>'
    )
    for a, b, copied in edges:
        (ax, ay), (bx, by) = xy(a), xy(b)
        style = (
            'stroke="#d62728" stroke-width="1.5" stroke-dasharray="4,2" marker-end="url(#copy)"'
            if copied
            else 'stroke="#999" marker-end="url(#arrow)"'
        )
        out.append(
            f'<line x1="{ax + BOX_W // 2}" y1="{ay + BOX_H}" x2="{bx + BOX_W // 2}" y2="{by}" {style}/>'
        )
    for v in values:
        x0, y0 = xy(v)
        b = plan.assignment[id(v)]
        what = v.kind if v.is_leaf else v.op.name
        name = v.name or plan.label(v)
        tip = f"{plan.label(v)} {what} {v.type} on {plan.labels[b]}"
        if id(v) in plan.causes:
            tip += f" [{plan.causes[id(v)]}]"
        shape = 'rx="12"' if v.is_leaf else 'rx="3"'
        out.append(
            f'<g><title>{escape(tip)}</title><rect x="{x0}" y="{y0}" width="{BOX_W}" height="{BOX_H}" {shape} '
            f'fill="{_colour(plan, b)}" stroke="#333"/>'
            f'<text x="{x0 + 4}" y="{y0 + 12}">{escape(what[:20])}</text>'
            f'<text x="{x0 + 4}" y="{y0 + 24}" fill="#222">{escape(name[:22])}</text></g>'
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


__all__ = ["plan_to_svg", "view_root"]
