"""The node-level graph of chosen layers as DOT text for graphviz: the ops of those layers (views
folded into what they view) in one cluster per split, coloured by device; the graph inputs, KV
cache and values of other layers they read, drawn dashed as outside the selection; every copy
between devices as a red node naming the tensor, the devices and the bytes."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from html import escape

from llamir.ir import Node
from llamir.sched.draw import COPY_COLOUR, backend_colour, ink_on
from llamir.sched.layers import Row, plan_rows, row_title
from llamir.sched.plan import InputCopy, Ref, SplitPlan, format_bytes

FONT = 'fontname="DejaVu Sans"'


def _q(text: str) -> str:
    """A DOT double-quoted string."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def selected_nodes(plan: SplitPlan, rows: Collection[Row] | None, layer_of: Mapping[int, Row]) -> list[Node]:
    """The non-view ops of the chosen rows (every row when `rows` is None), in node order."""
    return [
        n for n in plan.graph.nodes
        if not n.op.is_view and (rows is None or layer_of[id(n)] in rows)
    ]


class _DotGraph:
    """Collects DOT statements while resolving what each drawn op reads."""

    def __init__(self, plan: SplitPlan, layer_of: Mapping[int, Row], chosen: list[Node]):
        self.plan, self.layer_of = plan, layer_of
        self.chosen = {id(n) for n in chosen}
        self.outside: dict[int, Node] = {}
        self.copies: dict[int, tuple[InputCopy, int]] = {}  # id(copy) -> (copy, split index)
        self.edges: list[str] = []

    def vid(self, value: Node) -> str:
        return f"v{self.plan.ids[id(value)]}"

    def source(self, ref: Ref, split: int, weights: bool = False) -> str | None:
        """The drawn id of what `ref` stands for: a view's root, a copy node, or an outside value."""
        plan = self.plan
        while not isinstance(ref, InputCopy) and not ref.is_leaf and ref.op.is_view:
            ref = plan.inputs_of(ref)[0]
        if isinstance(ref, InputCopy):
            if id(ref) not in self.copies:
                self.copies[id(ref)] = (ref, split)
                src = self.source(ref.src, split, weights=True)
                if src is not None:
                    self.edges.append(f'{src} -> c{id(ref)} [color="{COPY_COLOUR}", style=dashed, penwidth=1.6];')
            return f"c{id(ref)}"
        if ref.is_leaf and ref.kind == "weight" and not weights:
            return None  # weights would double the picture; a copied weight shows as its copy node
        if id(ref) not in self.chosen:
            self.outside[id(ref)] = ref
        return self.vid(ref)

    def op_label(self, node: Node) -> str:
        name = node.name or self.plan.label(node)
        return f"{node.op.name}\n{name}"

    def outside_label(self, value: Node) -> str:
        name = self.plan.label(value)
        if value.is_leaf and value.kind == "state":
            return f"{name}\n(KV cache)"
        if value.is_leaf:
            return f"{name}\n({value.kind}, from outside)"
        return f"{name}\n({row_title(self.layer_of[id(value)])}, not drawn)"


def plan_to_dot(
    plan: SplitPlan,
    rows: Collection[Row] | None = None,
    title: str = "",
) -> str:
    """DOT text of the ops in `rows` (block indices, "input", "output"; None: all of them)."""
    layer_of = plan_rows(plan)
    chosen = selected_nodes(plan, rows, layer_of)
    dg = _DotGraph(plan, layer_of, chosen)
    split_of = {}
    for split in plan.splits:
        for node in plan.split_nodes(split):
            split_of[id(node)] = split.index
    for node in chosen:
        for ref in plan.inputs_of(node):
            src = dg.source(ref, split_of[id(node)])
            if src is not None:
                copied = src.startswith("c")
                style = f'color="{COPY_COLOUR}"' if copied else 'color="#666666"'
                dg.edges.append(f"{src} -> {dg.vid(node)} [{style}];")
    return "\n".join(_document(plan, dg, chosen, split_of, title)) + "\n"


def _document(plan: SplitPlan, dg: _DotGraph, chosen: list[Node], split_of, title: str) -> list[str]:
    head = title or f"graph {plan.graph.name}"
    moved = sum(c.nbytes for c, _ in dg.copies.values())
    label = (f"{head}\n{len(chosen)} ops, {len(dg.copies)} copies drawn ({format_bytes(moved)}); "
             f"whole plan: {plan.n_splits} splits, {plan.n_split_copies} copies, "
             f"{format_bytes(plan.bytes_moved)} per batch")
    out = [
        f"digraph {_q(plan.graph.name)} {{",
        f"  graph [{FONT}, fontsize=14, label={_q(label)}, labelloc=t, bgcolor=white, newrank=true, "
        "nodesep=0.2, ranksep=0.3];",
        f'  node [{FONT}, fontsize=11, shape=box, style="rounded,filled", height=0.3, margin="0.08,0.03"];',
        f'  edge [{FONT}, fontsize=10, arrowsize=0.6];',
        _legend(plan),
    ]
    by_split: dict[int, list[str]] = {}
    for node in chosen:
        colour = backend_colour(plan, plan.assignment[id(node)])
        cause = plan.causes.get(id(node))
        tip = f"{plan.label(node)} {node.op.name} {node.type} on {plan.labels[plan.assignment[id(node)]]}"
        tip += f" [{cause}]" if cause else ""
        by_split.setdefault(split_of[id(node)], []).append(
            f'{dg.vid(node)} [label={_q(dg.op_label(node))}, fillcolor="{colour}", fontcolor="{ink_on(colour)}", '
            f'class="op", tooltip={_q(tip)}];'
        )
    for copy, split in dg.copies.values():
        src = plan.labels[plan.backend_index(copy.src)]
        text = f"copy {plan.label(copy.src)}\n{src} -> {plan.labels[copy.backend]}\n{format_bytes(copy.nbytes)}"
        by_split.setdefault(split, []).append(
            f'c{id(copy)} [label={_q(text)}, shape=note, style=filled, fillcolor="#fde0dd", '
            f'color="{COPY_COLOUR}", fontcolor="#8b0000", class="copy", tooltip={_q(copy.name)}];'
        )
    for index in sorted(by_split):
        split = plan.splits[index]
        colour = backend_colour(plan, split.backend)
        text = f"split {index}: {plan.labels[split.backend]} (nodes {split.i_start}..{split.i_end - 1})"
        out.append(f"  subgraph cluster_split_{index} {{")
        out.append(f'    label={_q(text)}; style="rounded,bold"; color="{colour}"; penwidth=2.5; labeljust=l;')
        out += [f"    {line}" for line in by_split[index]]
        out.append("  }")
    for value in dg.outside.values():
        colour = backend_colour(plan, plan.assignment[id(value)])
        if value.is_leaf and value.kind == "state":  # a layer's KV cache: drawn with the layer's ops
            out.append(f'  {dg.vid(value)} [label={_q(dg.outside_label(value))}, shape=cylinder, '
                       f'style=filled, fillcolor="#ffffff", color="{colour}", penwidth=2, class="state"];')
            continue
        out.append(
            f'  {dg.vid(value)} [label={_q(dg.outside_label(value))}, style="dashed,rounded", '
            f'color="{colour}", penwidth=2, class="outside"];'
        )
    out += [f"  {e}" for e in dg.edges]
    out.append("}")
    return out


def _legend(plan: SplitPlan) -> str:
    cells = "".join(
        f'<TD BGCOLOR="{backend_colour(plan, b)}" WIDTH="16"> </TD><TD ALIGN="LEFT">{escape(label)}  </TD>'
        for b, label in enumerate(plan.labels)
    )
    cells += f'<TD><FONT COLOR="{COPY_COLOUR}">copy</FONT></TD>'
    return f'  legend [shape=plaintext, style="", label=<<TABLE BORDER="0" CELLSPACING="3"><TR>{cells}</TR></TABLE>>];'


__all__ = ["plan_to_dot", "selected_nodes"]
