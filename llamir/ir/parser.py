"""Parse the textual IR written by printer.py back into a Graph."""

from __future__ import annotations

import dataclasses
import json
import re

from llamir.ir import dims
from llamir.ir.dtypes import dtype_named
from llamir.ir.graph import Graph, Node
from llamir.ir.ops import OPS, IRError
from llamir.ir.ops.leaf import LEAF_KINDS
from llamir.ir.types import parse_type

_HEADER = re.compile(r"graph\s+([\w.\-]+)\s*\(([^)]*)\)\s*\{$")
_VALUE = re.compile(r"%(\d+)\s*=\s*([a-z_0-9]+)\s*(.*)$")
_STRING = r'"(?:[^"\\]|\\.)*"'


class ParseError(IRError):
    """Text that is not valid IR; the message gives the line number and the problem."""


def parse_graph(text: str) -> Graph:
    """Parse one graph; every node is re-typed by its op and must match the printed type."""
    lines = [(i + 1, raw.strip()) for i, raw in enumerate(text.splitlines())]
    lines = [(n, s) for n, s in lines if s and not s.startswith("#")]
    if not lines:
        raise ParseError("empty IR text")
    lineno, head = lines[0]
    m = _HEADER.match(head)
    if not m:
        raise ParseError(f"line {lineno}: expected 'graph NAME(dims) {{', got {head!r}")
    dim_names = [d.strip() for d in m.group(2).split(",") if d.strip()]
    graph = Graph(m.group(1), dim_names)
    values: dict[int, Node] = {}
    closed = False
    for lineno, line in lines[1:]:
        try:
            if line == "}":
                closed = True
                break
            if line.startswith("return"):
                _parse_return(graph, line[len("return"):], values)
            else:
                _parse_value(graph, line, values)
        except (IRError, ValueError, KeyError) as err:
            raise ParseError(f"line {lineno}: {err}") from None
    if not closed:
        raise ParseError("missing closing '}'")
    return graph


def _parse_return(graph: Graph, text: str, values: dict[int, Node]) -> None:
    for part in _split_top(text):
        name, _, ref = part.partition("=")
        graph.set_output(name.strip(), _ref(ref.strip(), values))


def _parse_value(graph: Graph, line: str, values: dict[int, Node]) -> None:
    m = _VALUE.match(line)
    if not m:
        raise ValueError(f"cannot parse {line!r}")
    index, head, rest = int(m.group(1)), m.group(2), m.group(3).strip()
    if index != len(values):
        raise ValueError(f"value %{index} out of order (expected %{len(values)})")
    name = None
    name_match = re.search(rf"({_STRING})\s*$", rest)
    if name_match:
        name = json.loads(name_match.group(1))
        rest = rest[: name_match.start()].rstrip()
    body, sep, type_text = rest.rpartition(":")
    if not sep:
        raise ValueError(f"missing ': type' in {line!r}")
    type = parse_type(type_text)
    body = body.strip()
    if head in LEAF_KINDS:
        if body:
            raise ValueError(f"unexpected text {body!r} after leaf kind")
        if graph.nodes:
            raise ValueError("leaves must come before nodes")
        values[index] = graph.add_leaf(head, type, name)
        return
    if head not in OPS:
        raise ValueError(f"unknown op {head!r}")
    if not body.startswith("("):
        raise ValueError(f"expected '(' after {head}")
    close = body.index(")")
    args = [_ref(a.strip(), values) for a in body[1:close].split(",") if a.strip()]
    attr_text = body[close + 1:].strip()
    op = _make_op(head, attr_text)
    node = graph.add_node(op, args, name)
    if node.type != type:
        raise ValueError(f"{head} infers {node.type} but the text says {type}")
    values[index] = node


def _ref(text: str, values: dict[int, Node]) -> Node:
    if not text.startswith("%") or not text[1:].isdigit():
        raise ValueError(f"expected a value reference like %3, got {text!r}")
    index = int(text[1:])
    if index not in values:
        raise ValueError(f"%{index} is used before it is defined")
    return values[index]


def _make_op(name: str, attr_text: str):
    cls = OPS[name]
    kwargs = {}
    if attr_text:
        if not (attr_text.startswith("{") and attr_text.endswith("}")):
            raise ValueError(f"bad attributes {attr_text!r}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for item in _split_top(attr_text[1:-1]):
            key, _, value = item.partition("=")
            key = key.strip()
            if key not in fields:
                raise ValueError(f"{name} has no attribute {key!r}")
            kwargs[key] = _parse_attr(value.strip(), str(fields[key].type))
    return cls(**kwargs)


def _parse_attr(text: str, annotation: str):
    if annotation == "bool":
        if text not in ("true", "false"):
            raise ValueError(f"expected true/false, got {text!r}")
        return text == "true"
    if annotation == "int":
        return int(text)
    if annotation == "float":
        return float(text)
    if annotation == "str":
        return json.loads(text)
    if annotation == "Dim":
        return dims.parse_dim(text)
    if annotation.startswith("DType"):
        return None if text == "none" else dtype_named(text)
    if annotation.startswith("tuple"):
        if not (text.startswith("[") and text.endswith("]")):
            raise ValueError(f"expected a [list], got {text!r}")
        items = _split_top(text[1:-1])
        parse = int if "int" in annotation else dims.parse_dim
        return tuple(parse(i) for i in items)
    raise ValueError(f"no parser for attribute type {annotation}")


def _split_top(text: str) -> list[str]:
    """Split on commas that are outside brackets and strings."""
    parts, depth, current, in_str, escaped = [], 0, [], False, False
    for ch in text:
        if in_str:
            current.append(ch)
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
            continue
        current.append(ch)
    if "".join(current).strip():
        parts.append("".join(current).strip())
    return parts
