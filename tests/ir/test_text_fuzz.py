"""Property tests of the text form (issue 9): builder graphs print, parse back to the same text and
fingerprint; mutated texts (tokens deleted, duplicated, swapped or replaced, lines moved, random
bytes, unicode, huge numbers, NaN/inf) either parse to a graph that verifies and round-trips, or
raise ParseError naming the line. Nothing else may come out of parse_graph.

The coverage-guided counterpart is fuzz/fuzz_ir.py (atheris), seeded with the same golden files.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamir.ir import (
    BF16,
    F16,
    F32,
    I32,
    Q4_0,
    Q8_0,
    GraphBuilder,
    IRError,
    ParseError,
    VerifyError,
    dims,
    fingerprint,
    ops,
    parse_graph,
    print_graph,
    verify,
)

GOLDEN = Path(__file__).parents[1] / "golden"
SEEDS = sorted(p.read_text() for p in GOLDEN.rglob("*.ir"))
def fuzz(n: int) -> settings:
    return settings(max_examples=n, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
MESSAGE = re.compile(r"line \d+(, column \d+)?: \S|empty IR text$|missing closing '\}': the text ends at line \d+ ")


# -- (a) builder graphs round-trip --------------------------------------------------------------
floats = st.floats(allow_nan=True, allow_infinity=True)
eps = st.floats(0.0, 1.0) | st.just(float("inf"))
names = st.none() | st.text(max_size=8)
UNARY = sorted(n for n, c in ops.OPS.items() if issubclass(c, ops.Unary))
GLU = sorted(n for n, c in ops.OPS.items() if issubclass(c, ops.Glu))


def _fresh(b: GraphBuilder, prefix: str) -> str:
    """A leaf name no other leaf has (a skipped draw may leave its leaf behind)."""
    return f"{prefix}{len(b.graph.leafs)}"


def _grow(draw, b: GraphBuilder, x, pool, T):
    """One node on top of x; IRError for picks that do not type-check (the draw is skipped)."""
    kind = draw(st.sampled_from([
        "unary", "binary", "scale", "clamp", "norm", "group_norm", "rope", "mul_mat", "get_rows",
        "set_rows", "view", "reshape", "permute", "transpose", "cont", "cast", "concat", "repeat",
        "glu", "softmax", "flash", "reduce", "sort", "top_k", "argmax", "cumsum", "fill", "fused"]))
    if kind == "unary":
        return b.unary(draw(st.sampled_from(UNARY)), x)
    if kind == "binary":
        return getattr(b, draw(st.sampled_from(["add", "sub", "mul", "div"])))(x, draw(st.sampled_from(pool)))
    if kind == "scale":
        return b.scale(x, draw(floats), draw(floats))
    if kind == "clamp":
        return b.clamp(x, draw(floats), draw(floats))
    if kind == "norm":
        return b.op(draw(st.sampled_from([ops.RmsNorm, ops.Norm, ops.L2Norm]))(eps=draw(eps)), x)
    if kind == "group_norm":
        return b.op(ops.GroupNorm(n_groups=draw(st.integers(1, 4)), eps=draw(eps)), x)
    if kind == "rope":
        n_dims = draw(st.sampled_from([2, 4, 8]))
        return b.rope_ext(x, b.input(_fresh(b, "pos"), [x.shape[-3]] if x.type.rank >= 3 else [T], I32),
                          n_dims=n_dims, mode=draw(st.sampled_from([ops.ROPE_NORM, ops.ROPE_NEOX])),
                          n_ctx_orig=draw(st.integers(0, 2**31 - 1)), freq_base=draw(floats),
                          freq_scale=draw(floats), ext_factor=draw(floats), beta_fast=draw(floats))
    if kind == "mul_mat":
        whole_blocks = isinstance(x.shape[-1], int) and x.shape[-1] % 32 == 0
        w = b.weight(_fresh(b, "w"), [draw(st.integers(1, 5)), x.shape[-1]],
                     draw(st.sampled_from([F32, F16, Q8_0, Q4_0] if whole_blocks else [F32, F16])))
        return b.mul_mat(w, x)
    if kind == "get_rows":
        return b.get_rows(b.weight(_fresh(b, "emb"), [7, x.shape[-1]], F32), b.input(_fresh(b, "tok"), [T], I32))
    if x.type.rank < 2 and kind in ("set_rows", "flash"):
        raise IRError(f"{kind} needs rows")
    if kind == "set_rows":
        cache = b.state(_fresh(b, "cache"), [16, x.shape[-1]], draw(st.sampled_from([F32, F16])))
        return b.set_rows(cache, x, b.input(_fresh(b, "idx"), [x.shape[-2]], I32))
    if kind == "view":
        strides = x.type.contiguous_strides()
        offset = strides[0] if x.shape[0] != 1 and draw(st.booleans()) else 0     # the second row, if any
        return b.view(x, (1,) + tuple(x.shape[1:]), strides, offset=offset)
    if kind == "reshape":
        return b.reshape(b.cont(x), dims.prod(x.shape))
    if kind == "permute":
        return b.permute(x, *draw(st.permutations(range(x.type.rank))))
    if kind == "transpose":
        return b.transpose(x)
    if kind == "cont":
        return b.cont(x)
    if kind == "cast":
        return b.cast(x, draw(st.sampled_from([F32, F16, BF16, Q8_0])))
    if kind == "concat":
        return b.concat(x, x, axis=draw(st.integers(-x.type.rank, x.type.rank - 1)))
    if kind == "repeat":
        return b.repeat(x, draw(st.sampled_from([2, T])), *x.shape)
    if kind == "glu":
        return b.glu(draw(st.sampled_from(GLU)), x, swapped=draw(st.booleans()))
    if kind == "softmax":
        return b.soft_max_ext(x, draw(st.sampled_from([None, *pool])), draw(floats))
    if kind == "flash":
        q = b.reshape(b.cont(x), 1, 1, *x.shape[-2:]) if x.type.rank == 2 else x
        mask = b.input(_fresh(b, "mask"), [1, 1, q.shape[2], q.shape[2]], F16)
        return b.flash_attn_ext(q, q, q, mask, scale=draw(floats), logit_softcap=draw(floats))
    if kind == "reduce":
        return b.op(draw(st.sampled_from([ops.SumRows(), ops.Mean(), ops.Sum()])), x)
    if kind == "sort":
        return b.argsort(x, descending=draw(st.booleans()))
    if kind == "top_k":
        return b.top_k(x, draw(st.integers(1, 3)))
    if kind == "argmax":
        return b.argmax(x)
    if kind == "cumsum":
        return b.cumsum(x)
    if kind == "fill":
        return b.op(ops.Fill(c=draw(floats)), x)
    return b.op(ops.OPS["rms_norm_mul"](eps=draw(eps)), x, draw(st.sampled_from(pool)))


@st.composite
def builder_graphs(draw):
    dim_names = draw(st.sampled_from([(), ("T",), ("T", "n_kv"), ("n_tokens", "T", "S_2")]))
    graph_name = draw(st.from_regex(r"[A-Za-z_][\w.\-]{0,10}", fullmatch=True))
    b = GraphBuilder(graph_name, dims=list(dim_names))
    T = dims.prod([draw(st.sampled_from([1, 2, 3])), *map(dims.sym, dim_names[:draw(st.integers(0, 2))])])
    pool = [b.input("x", [T, 8], F32), b.input("x32", [T, 32], F32), b.weight("w", [1, 8], F32),
            b.input("y", [2, T, 4], F32), b.state("s:" + draw(st.text(max_size=12)), [3, 2, 4], F16)]
    for _ in range(draw(st.integers(1, 14))):
        try:
            node = _grow(draw, b, draw(st.sampled_from(pool)), pool, T)
        except IRError:
            continue
        b.name(node, draw(names))
        pool.append(node)
    outputs = draw(st.lists(st.from_regex(r"[A-Za-z_][\w.\-]{0,6}", fullmatch=True), max_size=4, unique=True))
    for name in outputs:
        b.output(name, draw(st.sampled_from(pool)))
    return b.graph


@fuzz(300)
@given(builder_graphs())
def test_builder_graphs_round_trip_with_stable_fingerprints(graph):
    verify(graph)
    text = print_graph(graph)
    parsed = parse_graph(text)
    verify(parsed)
    assert print_graph(parsed) == text
    assert fingerprint(parsed) == fingerprint(graph) == hashlib.sha256(text.encode()).hexdigest()
    assert parse_graph(text.encode()) == parsed
    if graph.nodes:                                     # one changed name changes the fingerprint
        parsed.nodes[-1].name = (parsed.nodes[-1].name or "") + "'"
        assert fingerprint(parsed) != fingerprint(graph)


# -- (b) mutated texts --------------------------------------------------------------------------
TOKEN = re.compile(r'"(?:[^"\\\n]|\\.)*"|[A-Za-z_0-9.+\-]+|\s+|.', re.DOTALL)
SPECIAL = [
    "9" * 30, str(2**63), str(2**63 - 1), str(2**31), "-1", "-0", "0", "00", "1e999", "-1e999", "1e-999",
    "nan", "-nan", "inf", "-inf", "NaN", "Infinity", "-0.0", "0x10", "1_000", "5e-324",
    "ü", "٣", "²", "ⅷ", "\u2028", "\x85", "\x00", "\ufeff", "\ud800", "☃", "\t", "\r", "\n", "\\", "\\u00",
    "{", "}", "(", ")", "[", "]", ",", "=", ":", "%", '"', "#", "*", "-", ".", "[" * 64, "}" * 64,
    "graph", "return", "input", "weight", "state", "leaf", "none", "true", "false", "T", "n_kv", "S",
    "f32", "q8_0", "q4_k", "i32", "view", "permute", "rope_ext", "shape", "axes", "eps", "%0", "%99",
    "0*T", "T*T*T", "4*n_kv",
]
text_pieces = st.sampled_from(SPECIAL) | st.text(max_size=6)


@st.composite
def mutated_texts(draw):
    text = draw(st.sampled_from(SEEDS))
    for _ in range(draw(st.integers(1, 4))):
        tokens = TOKEN.findall(text)
        if not tokens:
            break
        i = draw(st.integers(0, len(tokens) - 1))
        kind = draw(st.sampled_from(["delete", "duplicate", "swap", "replace", "insert", "line_dup",
                                     "line_delete", "line_swap", "truncate"]))
        if kind == "delete":
            del tokens[i]
        elif kind == "duplicate":
            tokens.insert(i, tokens[i])
        elif kind == "swap":
            j = draw(st.integers(0, len(tokens) - 1))
            tokens[i], tokens[j] = tokens[j], tokens[i]
        elif kind == "replace":
            tokens[i] = draw(text_pieces)
        elif kind == "insert":
            tokens.insert(i, draw(text_pieces))
        elif kind == "truncate":
            tokens = tokens[:i]
        else:
            lines = text.split("\n")
            a, c = draw(st.integers(0, len(lines) - 1)), draw(st.integers(0, len(lines) - 1))
            if kind == "line_dup":
                lines.insert(c, lines[a])
            elif kind == "line_delete":
                del lines[a]
            else:
                lines[a], lines[c] = lines[c], lines[a]
            tokens = ["\n".join(lines)]
        text = "".join(tokens)
    return text


def check_parse(text: str | bytes) -> bool:
    """parse_graph returns a verified graph whose text round-trips, or raises ParseError naming the
    line; True when it parsed."""
    try:
        graph = parse_graph(text)
    except (ParseError, VerifyError) as err:
        message = str(err)
        assert MESSAGE.match(message), message
        assert "substring not found" not in message and "invalid literal" not in message, message
        return False
    verify(graph)
    printed = print_graph(graph)
    again = parse_graph(printed)
    assert print_graph(again) == printed and fingerprint(again) == fingerprint(graph)
    return True


@fuzz(2000)
@given(mutated_texts())
def test_mutated_texts_parse_cleanly_or_raise_parse_error(text):
    check_parse(text)


@st.composite
def flipped_bytes(draw):
    data = bytearray(draw(st.sampled_from(SEEDS)).encode())
    for _ in range(draw(st.integers(1, 6))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data)


@fuzz(1000)
@given(flipped_bytes())
def test_random_bytes_parse_cleanly_or_raise_parse_error(data):
    check_parse(data)


@fuzz(300)
@given(st.text(max_size=200) | st.binary(max_size=200))
def test_arbitrary_text_is_refused_cleanly(text):
    check_parse(text)


@pytest.mark.parametrize("seed", range(len(SEEDS)))
def test_seeds_are_valid_and_canonical(seed):
    assert check_parse(SEEDS[seed]) and print_graph(parse_graph(SEEDS[seed])) == SEEDS[seed]


HUGE = {"brackets": "[" * 200_000, "parens": "(" * 200_000, "percents": "%" * 200_000, "quotes": '"' * 200_001,
        "digits": "9" * 200_000, "backslashes": "\\" * 200_000, "exponent": "1e" + "9" * 200_000,
        "factors": "T*" * 100_000 + "T"}


@pytest.mark.parametrize("piece", HUGE.values(), ids=HUGE.keys())
def test_huge_pieces_are_refused_without_recursion(piece):
    """Every place a huge or deeply nested piece can go: refused at its first token, in linear time."""
    for seed in SEEDS[:1]:
        lines = seed.split("\n")
        for i in range(len(lines)):
            for spot in (0, len(lines[i]) // 2, len(lines[i])):
                check_parse("\n".join(lines[:i] + [lines[i][:spot] + piece + lines[i][spot:]] + lines[i + 1:]))


def test_the_atheris_script_checks_and_mutates_without_atheris(capsys):
    """fuzz/fuzz_ir.py's property and token mutator run here too (atheris is needed only to fuzz)."""
    import importlib.util
    import random

    spec = importlib.util.spec_from_file_location("fuzz_ir", Path(__file__).parents[2] / "fuzz" / "fuzz_ir.py")
    fuzz_ir = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fuzz_ir)
    assert fuzz_ir.replay([str(p) for p in sorted(GOLDEN.rglob("*.ir"))]) == 0
    assert capsys.readouterr().out.count(": parsed: graph ") == len(SEEDS)
    rng = random.Random(0)
    outcomes = {fuzz_ir.check(fuzz_ir.mutate_tokens(rng.choice(SEEDS), rng).encode("utf-8", "surrogatepass"))
                .split(":")[0] for _ in range(300)}
    assert outcomes == {"parsed", "refused"}
