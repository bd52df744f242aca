"""Textual IR: one line per value, types always printed; `parse(print(g))` round-trips exactly.

    graph llama(T, n_kv) {
      %0 = input : i32[T] "inp_tokens"
      %1 = weight : f32[512,64] "token_embd.weight"
      %2 = get_rows(%1, %0) : f32[T,64] "inp_embd"
      %3 = rms_norm(%2) {eps=1e-05} : f32[T,64] "norm-0"
      return logits = %9
    }

Attributes equal to their defaults are omitted. The fingerprint is the sha256 of this text.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math

from llamir.ir import dims
from llamir.ir.dtypes import DType
from llamir.ir.graph import Graph, Node


def format_value(value: object) -> str:
    """One attribute value in IR syntax."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, DType):
        return value.name
    if value is None:
        return "none"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value)
    if isinstance(value, (int, dims.Sym)):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, tuple):
        return "[" + ",".join(format_value(v) for v in value) + "]"
    raise TypeError(f"cannot print attribute value {value!r}")


def format_attrs(op) -> str:
    parts = []
    for field in dataclasses.fields(op):
        value = getattr(op, field.name)
        if str(field.type) == "float" and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)  # Scale(s=2) prints as 2.0, as the parser will read it
        default = field.default if field.default is not dataclasses.MISSING else dataclasses.MISSING
        if default is not dataclasses.MISSING and (_same(value, default) or value == default
                                                   and isinstance(value, float) == isinstance(default, float)):
            continue
        parts.append(f"{field.name}={format_value(value)}")
    return "{" + ", ".join(parts) + "}" if parts else ""


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def print_graph(graph: Graph) -> str:
    ids: dict[int, int] = {}
    lines = [f"graph {graph.name}({', '.join(graph.dim_names)}) {{"]
    for value in graph.all_values():
        ids[id(value)] = len(ids)
        lines.append("  " + _format_value_line(value, ids))
    if graph.outputs:
        outs = ", ".join(f"{name} = %{ids[id(node)]}" for name, node in graph.outputs.items())
        lines.append(f"  return {outs}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _format_value_line(value: Node, ids: dict[int, int]) -> str:
    label = f" {json.dumps(value.name)}" if value.name is not None else ""
    if value.is_leaf:
        return f"%{ids[id(value)]} = {value.kind} : {value.type}{label}"
    args = ", ".join(f"%{ids[id(x)]}" for x in value.inputs)
    attrs = format_attrs(value.op)
    attrs = f" {attrs}" if attrs else ""
    return f"%{ids[id(value)]} = {value.op.name}({args}){attrs} : {value.type}{label}"


def fingerprint(graph: Graph) -> str:
    """A stable hash of the canonical text: same model and params, same fingerprint anywhere."""
    return hashlib.sha256(print_graph(graph).encode()).hexdigest()
