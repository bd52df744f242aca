"""Parse the textual IR written by printer.py back into a Graph.

The grammar is one line per item, read left to right by a cursor that knows its line and column:

    graph NAME(DIM, ...) {
      %N = KIND : TYPE "name"                          leaves (input, weight, state) first
      %N = OP(%a, %b) {key=value, ...} : TYPE "name"   the name is optional on nodes
      return NAME = %N, ...                            at most once, last
    }

Blank lines and lines starting with `#` are skipped anywhere. Everything that is not this
grammar, and every graph the verifier would refuse, is a ParseError naming the line, the column
where it helps, and the offending text. Nothing in the grammar nests, so nothing recurses, and no
number in the text sizes an allocation.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re

from llamir.ir import dims
from llamir.ir.dtypes import DType, dtype_named
from llamir.ir.graph import Graph, Node
from llamir.ir.ops import OPS, IRError
from llamir.ir.ops.leaf import LEAF_KINDS
from llamir.ir.types import MAX_RANK, TensorType
from llamir.ir.verifier import INT64_MAX, VerifyError, check_attr_dims, check_view_bounds, type_problem, verify

INT32_MAX = 2**31 - 1      # ggml's op params are int32

_WS = " \t\r\f\v"
_IDENT = re.compile(r"[A-Za-z_][\w.\-]*")        # graph and output names, as graph.py checks them
_DIM_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)
_WORD = re.compile(r"[a-z_0-9]+", re.ASCII)       # op names, leaf kinds, dtype names
_DIGITS = re.compile(r"[0-9]+", re.ASCII)
_INT = re.compile(r"-?[0-9]+", re.ASCII)
_FLOAT = re.compile(r"[+-]?(?:inf|nan|(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)(?![\w.])", re.ASCII)
_SHOWN = re.compile(r"[^\s,()\[\]{}:=*%\"]+|.", re.DOTALL)
_GRAPH = re.compile(r"graph(?![\w.\-])")
_RETURN = re.compile(r"return(?![\w.\-])")
_MAX_LITERAL = 64          # the longest float repr is 24 characters; longer literals are refused unread


class ParseError(IRError):
    """Text that is not valid IR; the message gives the line (and column) and the problem."""


def parse_graph(text: str | bytes) -> Graph:
    """Parse one graph; every node is re-typed by its op and must match the printed type, and the
    result passes verify(). Raises ParseError, and only ParseError, for any malformed text."""
    if isinstance(text, (bytes, bytearray)):
        data = bytes(text)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            line = data.count(b"\n", 0, err.start) + 1
            raise ParseError(f"line {line}: IR text is not UTF-8: byte {err.start} is {data[err.start]:#04x}") from None
    if not isinstance(text, str):
        raise TypeError(f"parse_graph takes IR text (str or bytes), got {type(text).__name__}")
    lines = [(i + 1, raw) for i, raw in enumerate(text.split("\n"))]
    lines = [(n, raw) for n, raw in lines if raw.strip(_WS) and not raw.strip(_WS).startswith("#")]
    if not lines:
        raise ParseError("empty IR text")
    graph = _header(_Cursor(*lines[0]))
    reader = _BodyReader(graph)
    for index, (lineno, raw) in enumerate(lines[1:], start=1):
        if raw.strip(_WS) == "}":
            _after_close(lines[index + 1:])
            return reader.finish(lineno)
        reader.line(_Cursor(lineno, raw))
    raise ParseError(f"missing closing '}}': the text ends at line {lines[-1][0]} inside graph {graph.name}")


def _after_close(rest: list[tuple[int, str]]) -> None:
    if rest:
        lineno, raw = rest[0]
        cur = _Cursor(lineno, raw)
        raise cur.error(f"text after the closing '}}' of the graph: {cur.shown()}")


class _Cursor:
    """One line of IR text read left to right; errors carry its line number and a column."""

    __slots__ = ("lineno", "text", "pos")

    def __init__(self, lineno: int, text: str):
        self.lineno, self.text, self.pos = lineno, text, 0

    def error(self, message: str, pos: int | None = None) -> ParseError:
        column = (self.pos if pos is None else pos) + 1
        return ParseError(f"line {self.lineno}, column {column}: {message}")

    def line_error(self, message: str) -> ParseError:
        return ParseError(f"line {self.lineno}: {message}")

    def skip(self) -> int:
        text, pos = self.text, self.pos
        while pos < len(text) and text[pos] in _WS:
            pos += 1
        self.pos = pos
        return pos

    def peek(self) -> str:
        pos = self.skip()
        return self.text[pos] if pos < len(self.text) else ""

    def shown(self) -> str:
        """The upcoming token, for messages: 'end of line' or its text (shortened)."""
        if not self.peek():
            return "end of line"
        token = _SHOWN.match(self.text, self.pos).group()
        return repr(token if len(token) <= 40 else token[:37] + "...")

    def accept(self, literal: str) -> bool:
        if self.peek() and self.text.startswith(literal, self.pos):
            self.pos += len(literal)
            return True
        return False

    def expect(self, literal: str, context: str) -> None:
        if not self.accept(literal):
            raise self.error(f"expected {literal!r} {context}, got {self.shown()}")

    def token(self, pattern: re.Pattern, what: str) -> str:
        self.skip()
        m = pattern.match(self.text, self.pos)
        if not m:
            raise self.error(f"expected {what}, got {self.shown()}")
        self.pos = m.end()
        return m.group()

    def string(self) -> str:
        """A JSON string literal (the printer writes names with json.dumps)."""
        start = self.skip()
        try:
            value, self.pos = json.decoder.scanstring(self.text, start + 1, True)
        except json.JSONDecodeError as err:
            raise self.error(f"bad string literal: {err.msg}", err.pos) from None
        return value

    def end(self, context: str) -> None:
        if self.peek():
            hint = " (a comment takes a whole line)" if self.peek() == "#" else ""
            raise self.error(f"unexpected {self.shown()} {context}{hint}")


# -- the header --------------------------------------------------------------------------------
def _header(cur: _Cursor) -> Graph:
    if not _GRAPH.match(cur.text, cur.skip()):
        raise cur.error(f"expected 'graph NAME(dims) {{', got {cur.text.strip(_WS)[:40]!r}")
    cur.pos += len("graph")
    name_pos = cur.skip()
    name = cur.token(_IDENT, "the graph's name after 'graph'")
    cur.expect("(", "after the graph's name (the dims list, possibly empty)")
    dim_names: list[str] = []
    if not cur.accept(")"):
        while True:
            pos = cur.skip()
            dim = cur.token(_DIM_NAME, "a dim name such as T")
            if dim in dim_names:
                raise cur.error(f"dim {dim!r} is declared twice", pos)
            dim_names.append(dim)
            if cur.accept(")"):
                break
            cur.expect(",", "or ')' between dim names")
    cur.expect("{", "after the dims list")
    cur.end("after 'graph NAME(dims) {': the first value goes on the next line")
    try:
        return Graph(name, dim_names)
    except IRError as err:
        raise cur.error(str(err), name_pos) from None


# -- the body ----------------------------------------------------------------------------------
class _BodyReader:
    """Reads value lines and the return line into one graph, checking each as it goes."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.values: list[Node] = []
        self.leaf_lines: dict[str, int] = {}   # leaf name -> the line that declared it
        self.return_line: int | None = None

    def line(self, cur: _Cursor) -> None:
        head = cur.peek()
        if head == "}":
            raise cur.error(f"text after the closing '}}' on its line: {cur.text.strip(_WS)[1:].strip(_WS)[:40]!r}")
        if self.return_line is not None:
            raise cur.error(f"only the closing '}}' may follow the return on line {self.return_line}, "
                            f"got {cur.shown()}")
        if head == "%":
            self._value(cur)
        elif _RETURN.match(cur.text, cur.pos):
            cur.pos += len("return")
            self._return(cur)
            self.return_line = cur.lineno
        else:
            raise cur.error(f"expected '%N = ...', 'return ...' or '}}', got {cur.shown()}")

    def finish(self, lineno: int) -> Graph:
        try:
            verify(self.graph)
        except VerifyError as err:   # the checks above should have caught it first, with its line
            raise ParseError(f"line {lineno}: the graph does not verify: {err}") from None
        return self.graph

    def _value(self, cur: _Cursor) -> None:
        start = cur.pos
        cur.pos += 1                                    # the '%' line() saw
        index = cur.token(_DIGITS, "a value number after '%'")
        if index != str(len(self.values)):
            raise cur.error(f"value %{_short(index)} out of order (expected %{len(self.values)})", start)
        cur.expect("=", f"after %{index}")
        head_pos = cur.skip()
        head = cur.token(_WORD, "an op name or a leaf kind (input, weight, state)")
        if head in LEAF_KINDS:
            self.values.append(self._leaf(cur, head))
            return
        if head not in OPS or OPS[head].is_leaf:
            known = [name for name, cls in OPS.items() if not cls.is_leaf] + list(LEAF_KINDS)
            close = difflib.get_close_matches(head, known, n=1)
            raise cur.error(f"unknown op {head!r}" + (f" (did you mean {close[0]!r}?)" if close else ""), head_pos)
        self.values.append(self._node(cur, head))

    def _leaf(self, cur: _Cursor, kind: str) -> Node:
        if cur.peek() == "(":
            raise cur.error(f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} leaf takes no arguments")
        type_ = _colon_type(cur, self.graph, kind)
        name = self._name(cur)
        if self.graph.nodes:
            raise cur.line_error("leaves must come before nodes")
        if name is None:
            raise cur.line_error(f"the {kind} leaf has no name: leaves are bound by name")
        if name in self.leaf_lines:
            raise cur.line_error(f"two leaves are named {name!r} (the first on line {self.leaf_lines[name]}); "
                                 "leaves are bound by name")
        self.leaf_lines[name] = cur.lineno
        return self.graph.add_leaf(kind, type_, name)

    def _node(self, cur: _Cursor, op_name: str) -> Node:
        cur.expect("(", f"after {op_name} (its arguments)")
        args: list[Node] = []
        if not cur.accept(")"):
            while True:
                args.append(self._ref(cur))
                if cur.accept(")"):
                    break
                cur.expect(",", "or ')' between arguments")
        op = _make_op(cur, OPS[op_name], self.graph)
        type_ = _colon_type(cur, self.graph, op_name)
        name = self._name(cur)
        try:
            node = self.graph.add_node(op, args, name)
        except IRError as err:
            raise cur.line_error(str(err)) from None
        if node.type != type_:
            raise cur.line_error(f"{op_name} infers {node.type} but the text says {type_}")
        _check_node(cur, self.graph, node)
        return node

    def _name(self, cur: _Cursor) -> str | None:
        if cur.peek() != '"':
            cur.end("after the type (a name must be a \"quoted\" string)")
            return None
        name = cur.string()
        cur.end("after the name")
        return name

    def _ref(self, cur: _Cursor) -> Node:
        pos = cur.skip()
        if not cur.accept("%"):
            raise cur.error(f"expected a value reference like %3, got {cur.shown()}")
        digits = cur.token(_DIGITS, "a value number after '%'")
        if len(digits) > 18 or int(digits) >= len(self.values):
            raise cur.error(f"%{_short(digits)} is used before it is defined", pos)
        return self.values[int(digits)]

    def _return(self, cur: _Cursor) -> None:
        seen: set[str] = set()
        while True:
            pos = cur.skip()
            name = cur.token(_IDENT, "an output name" + (" after 'return'" if not seen else ""))
            if name in seen:
                raise cur.error(f"output {name!r} is returned twice", pos)
            seen.add(name)
            cur.expect("=", f"after the output name {name!r}")
            node = self._ref(cur)
            try:
                self.graph.set_output(name, node)
            except IRError as err:
                raise cur.error(str(err), pos) from None
            if not cur.peek():
                return
            cur.expect(",", "between outputs")


def _short(digits: str) -> str:
    return digits if len(digits) <= 20 else f"{digits[:10]}...({len(digits)} digits)"


def _check_node(cur: _Cursor, graph: Graph, node: Node) -> None:
    """What the verifier checks beyond typing: concrete views in bounds, attribute dims declared."""
    try:
        check_attr_dims(graph, node)
        check_view_bounds(node)
    except VerifyError as err:
        raise cur.line_error(str(err)) from None


# -- types and dims ----------------------------------------------------------------------------
def _colon_type(cur: _Cursor, graph: Graph, head: str) -> TensorType:
    if not cur.accept(":"):
        raise cur.error(f"missing ': type' after {head}, got {cur.shown()}")
    return _type(cur, graph)


def _type(cur: _Cursor, graph: Graph) -> TensorType:
    """DTYPE[DIM,...], e.g. f32[T,576]."""
    pos = cur.skip()
    name = cur.token(_WORD, "a type such as f32[T,64]")
    try:
        dtype = dtype_named(name)
    except ValueError as err:
        raise cur.error(str(err), pos) from None
    cur.expect("[", f"after the dtype {name} (its shape)")
    shape = [_dim(cur, graph)]
    while cur.accept(","):
        shape.append(_dim(cur, graph))
        if len(shape) > MAX_RANK:
            raise cur.error(f"a type has at most {MAX_RANK} dims", pos)
    cur.expect("]", "or ',' in the shape")
    type_ = TensorType(tuple(shape), dtype)
    problem = type_problem(type_)
    if problem:
        raise cur.error(problem, pos)
    return type_


def _dim(cur: _Cursor, graph: Graph) -> dims.Dim:
    """A dim: a count, a declared name, or a product of them (576, T, 4*T, T*n_kv)."""
    pos = cur.skip()
    coef, factors = 1, []
    while True:
        term_pos = cur.skip()
        if cur.peek().isascii() and cur.peek().isdigit():
            coef *= _int_literal(cur, cur.token(_DIGITS, "a count"), INT64_MAX, term_pos, "dim")
            if coef > INT64_MAX:
                raise cur.error(f"the dim's coefficient {_short(str(coef))} does not fit in int64", pos)
        else:
            name = cur.token(_DIM_NAME, "a dim (a count >= 0, a dim name, or a product such as 4*T)")
            if name not in graph.dim_names:
                declared = ", ".join(graph.dim_names) or "none"
                raise cur.error(f"dim {name!r} is not declared by graph {graph.name} (declared: {declared})",
                                term_pos)
            factors.append(name)
        if not cur.accept("*"):
            break
    return dims.prod([coef, *map(dims.sym, factors)])


def _int_literal(cur: _Cursor, digits: str, limit: int, pos: int, what: str) -> int:
    """An integer of at most `limit` in magnitude (checked before any int() of a long literal)."""
    body = digits.lstrip("-")
    if len(body) > len(str(limit)) or int(body) > limit:
        bits = "int32" if limit == INT32_MAX else "int64"
        raise cur.error(f"{what}: {_short(digits)} is out of range (it must fit in {bits})", pos)
    return int(digits)


# -- attributes --------------------------------------------------------------------------------
def _make_op(cur: _Cursor, cls, graph: Graph):
    kwargs: dict[str, object] = {}
    if cur.accept("{"):
        fields = {f.name: str(f.type) for f in dataclasses.fields(cls)}
        if not cur.accept("}"):
            while True:
                pos = cur.skip()
                key = cur.token(_DIM_NAME, "an attribute name")
                if key not in fields:
                    known = f"it has: {', '.join(fields)}" if fields else "it has none"
                    raise cur.error(f"{cls.name} has no attribute {key!r} ({known})", pos)
                if key in kwargs:
                    raise cur.error(f"attribute {key!r} of {cls.name} is given twice", pos)
                cur.expect("=", f"after the attribute name {key!r}")
                kwargs[key] = _attr_value(cur, fields[key], graph, f"{cls.name}.{key}")
                if cur.accept("}"):
                    break
                cur.expect(",", "or '}' between attributes")
    try:
        return cls(**kwargs)
    except (IRError, ValueError) as err:
        raise cur.line_error(f"{cls.name}: {err}") from None


def _attr_value(cur: _Cursor, annotation: str, graph: Graph, what: str):
    pos = cur.skip()
    if annotation == "bool":
        word = cur.token(_DIM_NAME, f"true or false for {what}")
        if word not in ("true", "false"):
            raise cur.error(f"{what}: expected true or false, got {word!r}", pos)
        return word == "true"
    if annotation == "int":
        return _int_literal(cur, cur.token(_INT, f"an integer for {what}"), INT32_MAX, pos, what)
    if annotation == "float":
        return _float_literal(cur, what)
    if annotation == "str":
        if cur.peek() != '"':
            raise cur.error(f"{what}: expected a \"string\", got {cur.shown()}")
        return cur.string()
    if annotation == "Dim":
        return _dim(cur, graph)
    if annotation == "DType | None":
        return _dtype_or_none(cur, what)
    if annotation in ("tuple[int, ...]", "tuple[Dim, ...]"):
        return _list(cur, annotation, graph, what)
    raise cur.error(f"{what}: attributes of type {annotation} have no text form")


def _float_literal(cur: _Cursor, what: str) -> float:
    pos = cur.skip()
    m = _FLOAT.match(cur.text, pos)
    if not m:
        raise cur.error(f"{what}: expected a number (or inf, -inf, nan), got {cur.shown()}")
    literal = m.group()
    if len(literal) > _MAX_LITERAL:
        raise cur.error(f"{what}: a number literal of {len(literal)} characters is too long", pos)
    value = float(literal)
    if math.isinf(value) and "inf" not in literal:
        raise cur.error(f"{what}: {literal} is out of float range (write inf)", pos)
    cur.pos = m.end()
    return value


def _dtype_or_none(cur: _Cursor, what: str) -> DType | None:
    pos = cur.skip()
    word = cur.token(_WORD, f"a dtype or none for {what}")
    if word == "none":
        return None
    try:
        return dtype_named(word)
    except ValueError as err:
        raise cur.error(f"{what}: {err}", pos) from None


def _list(cur: _Cursor, annotation: str, graph: Graph, what: str) -> tuple:
    cur.expect("[", f"for {what} (a [list])")
    items: list = []
    if cur.accept("]"):
        return ()
    while True:
        pos = cur.skip()
        if annotation == "tuple[int, ...]":
            items.append(_int_literal(cur, cur.token(_INT, f"an integer in {what}"), INT32_MAX, pos, what))
        else:
            items.append(_dim(cur, graph))
        if len(items) > MAX_RANK:
            raise cur.error(f"{what}: a list of more than {MAX_RANK} items (the largest rank)", pos)
        if cur.accept("]"):
            return tuple(items)
        cur.expect(",", f"or ']' in {what}")
