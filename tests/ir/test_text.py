"""The text form: parse(print(g)) == g for every op and for random graphs, stable fingerprints,
parse errors with line numbers, and a golden printed graph."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamir.ir import (
    BF16,
    F16,
    F32,
    I32,
    I64,
    Q8_0,
    GraphBuilder,
    IRError,
    ParseError,
    dims,
    fingerprint,
    ops,
    parse_graph,
    print_graph,
    verify,
)


def round_trip(graph):
    text = print_graph(graph)
    parsed = parse_graph(text)
    assert print_graph(parsed) == text
    assert parsed == graph
    verify(parsed)
    return parsed


# -- every op ------------------------------------------------------------------------------------
def every_op_graph() -> GraphBuilder:
    """One graph that uses every op, most with non-default attributes."""
    b = GraphBuilder("every-op.v1", dims=["T", "n_kv"])
    T, n_kv = b.dim("T"), b.dim("n_kv")
    x = b.input("x", ["T", 2, 8], F32)                                             # [T, H, d]
    pos = b.input("pos", ["T"], I32)
    w = b.weight("w", [16, 8], F16)
    q8 = b.weight("q8", [4, 32], Q8_0)
    cache = b.state("cache", [8, 16], F32)
    kv_idx = b.input("kv_idx", ["T"], I64)
    mask = b.input("mask", [1, 1, "T", "n_kv"], F16)
    experts = b.weight("experts", [3, 4, 8], F32)
    ids = b.input("ids", ["T", 2], I32)

    r = b.rope_ext(x, pos, b.weight("ff", [4], F32), n_dims=8, mode=ops.ROPE_NEOX, n_ctx_orig=4096,
                   freq_base=1e6, freq_scale=0.25, ext_factor=1.0, attn_factor=0.9, beta_fast=16.0,
                   beta_slow=2.0, name=("rope", 0))
    flat = b.reshape(r, T, 16)                                                     # [T, 16]
    h = b.rms_norm(flat, 1e-5, name="attn_norm-0")
    h = b.norm(h, 1e-3)
    h = b.op(ops.L2Norm(eps=1e-9), h)
    h = b.op(ops.GroupNorm(n_groups=2, eps=1e-4), b.reshape(h, T, 4, 2, 2))
    h = b.cont(h, T, 16)
    for name in sorted(n for n, c in ops.OPS.items() if issubclass(c, ops.Unary)):
        h = b.unary(name, h)
    h = b.scale(b.clamp(h, -3.5, float("inf")), 0.125, -1.0)
    h = b.op(ops.Fill(c=2.5), b.div(b.sub(b.add(h, h), h), b.mul(h, h)))
    kq = b.mul_mat(w, b.get_rows(b.weight("emb", [5, 8], F32), pos))                # [T, 16]
    h = b.add(h, kq)
    written = b.set_rows(cache, h, kv_idx)
    kv = b.view(written, [n_kv, 16], [64, 4], offset=0)
    k4 = b.permute(b.reshape(b.cont(kv), n_kv, 2, 8), 1, 0, 2)                      # [2, n_kv, 8]
    q4 = b.reshape(b.cont(b.permute(x, 1, 0, 2)), 1, 2, T, 8)
    k4 = b.reshape(b.cont(k4), 1, 2, n_kv, 8)
    att = b.flash_attn_ext(q4, b.cast(k4, F16), b.cast(k4, BF16), mask, scale=0.35, max_bias=8.0,
                           logit_softcap=30.0, sinks=b.weight("sinks", [2], F32))
    scores = b.soft_max_ext(b.mul_mat(k4, q4), b.cast(mask, F32), 0.35, max_bias=2.0,
                            sinks=b.weight("sinks2", [2], F32))
    tr = b.transpose(b.reshape(scores, 2, T, n_kv))
    glus = [b.glu(kind, h, swapped=True) for kind in sorted(n for n, c in ops.OPS.items()
                                                           if issubclass(c, ops.Glu))]
    split = b.swiglu(glus[0], glus[1])
    cat = b.concat(split, b.repeat(b.sum_rows(split), T, 8), axis=-1)               # [T, 16]
    moe = b.mul_mat_id(experts, b.reshape(cat, T, 2, 8), ids)                       # [T, 2, 4]
    q8_out = b.mul_mat(q8, b.concat(cat, cat, axis=1))                              # [T, 4]
    b.output("attn", att)
    b.output("tr", b.cont(tr))
    b.output("moe", b.mean(moe))
    b.output("sum", b.op(ops.Sum(), q8_out))
    b.output("order", b.argsort(b.cont(b.reshape(moe, T, 8)), descending=True))
    b.output("top", b.top_k(b.cont(b.reshape(moe, T, 8)), 3))
    b.output("greedy", b.argmax(b.cont(b.reshape(moe, T, 8))))                      # [T] i32
    b.output("cdf", b.cumsum(b.soft_max_ext(b.cont(b.reshape(moe, T, 8)), None, 1.0)))  # [T, 8]
    # the fused ops passes/fusion.py forms
    fw = b.weight("fw", [16], F32)
    b.output("rms_mul", b.op(ops.OPS["rms_norm_mul"](eps=1e-5), h, fw))
    b.output("ln", b.op(ops.OPS["norm_mul_add"](eps=1e-5), h, fw, b.weight("fb", [16], F32)))
    vt = b.cont(b.transpose(k4))                                                    # [1, 2, 8, n_kv]
    b.output("attn2", b.op(ops.OPS["soft_max_attn"](scale=0.35), q4, k4, vt, b.cast(mask, F32)))
    # a Mamba-2 block's conv and scan
    conv = b.ssm_conv(b.input("conv_x", [2, 4, 6], F32), b.weight("conv_w", [4, 3], F32))   # [2, 4, 4]
    scan = b.ssm_scan(b.state("ssm_s", [3, 2, 2, 4], F32), b.reshape(conv, 2, 4, 2, 2),
                      b.input("ssm_dt", [2, 4, 2], F32), b.weight("ssm_a", [2, 1], F32),
                      b.input("ssm_b", [2, 4, 1, 4], F32), b.input("ssm_c", [2, 4, 1, 4], F32),
                      b.input("ssm_ids", [2], I32), K=2)
    b.output("ssm", scan)
    return b


def test_every_op_round_trips():
    b = every_op_graph()
    used = {n.op.name for n in b.graph.nodes}
    assert used == set(ops.OPS) - {"leaf"}, sorted(set(ops.OPS) - {"leaf"} - used)
    verify(b.graph)
    round_trip(b.graph)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # log/sqrt of negatives along the unary chain
def test_every_op_graph_evaluates_to_the_storage_form_of_its_types():
    import numpy as np

    from llamir.ir.interp import Interpreter, check_value

    graph = every_op_graph().graph
    rng = np.random.default_rng(0)
    env = {"T": 3, "n_kv": 5}
    ints = {"pos": (0, 5), "kv_idx": (0, 8), "ids": (0, 3), "ssm_ids": (0, 3)}   # pos also indexes the 5-row emb
    leaf_values = {}
    for leaf in graph.leafs:
        shape = leaf.type.evaluate(env)
        if leaf.dtype == Q8_0:
            raw = rng.integers(0, 255, (shape[0], Q8_0.row_bytes(shape[1])), dtype=np.uint8)
            raw.reshape(-1, 34)[:, :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)  # sane scales
            leaf_values[leaf.name] = raw
        elif leaf.name in ints:
            lo, hi = ints[leaf.name]
            leaf_values[leaf.name] = rng.permutation(hi)[: shape[0]].astype(leaf.dtype.np_dtype) \
                if leaf.name == "kv_idx" else rng.integers(lo, hi, shape).astype(leaf.dtype.np_dtype)
        else:
            leaf_values[leaf.name] = rng.standard_normal(shape).astype(leaf.dtype.np_dtype)
    values = Interpreter().evaluate(graph, leaf_values, env)
    for node in graph.nodes:
        check_value(node, values[id(node)], env)            # raises InterpError on a mismatch


def test_attributes_with_special_floats_round_trip():
    b = GraphBuilder("t")
    x = b.input("x", [4], F32)
    specials = [(float("-inf"), 0.0), (float("nan"), float("inf")), (-0.0, 1e-300),
                (5e-324, 1.7976931348623157e308)]
    for lo, hi in specials:
        b.clamp(x, lo, hi)
    b.scale(x, 0.1 + 0.2, 1 / 3)
    parsed = round_trip(b.graph)
    assert parsed.nodes[-1].op.s == 0.1 + 0.2 and parsed.nodes[-1].op.b == 1 / 3   # repr is exact


def test_names_with_any_characters_round_trip():
    b = GraphBuilder("t")
    x = b.input('in "quoted" : f32[9]', [4], F32)
    for name in ['a"b', "back\\slash", "tab\tnew\nline", "ünï ☃", "%3 = silu(%0)", "", "x } {"]:
        x = b.silu(x, name=name)
    parsed = round_trip(b.graph)
    assert [n.name for n in parsed.all_values()] == [n.name for n in b.graph.all_values()]


def test_int_valued_float_attribute_round_trips():
    b = GraphBuilder("t")
    b.op(ops.Scale(s=2), b.input("x", [4], F32))
    round_trip(b.graph)


@pytest.mark.parametrize("graph_name,output_name", [("my graph", "y"), ("t", "logits,0"), ("t", "a = b")])
def test_graph_and_output_names_round_trip_or_are_rejected(graph_name, output_name):
    try:
        b = GraphBuilder(graph_name)
        b.output(output_name, b.silu(b.input("x", [4], F32)))
    except (IRError, ValueError):
        return                                                  # rejecting the name is fine
    round_trip(b.graph)


# -- random graphs -------------------------------------------------------------------------------
floats = st.floats(allow_nan=True, allow_infinity=True)
names = st.none() | st.text(max_size=6)
UNARY = sorted(n for n, c in ops.OPS.items() if issubclass(c, ops.Unary))
GLU = sorted(n for n, c in ops.OPS.items() if issubclass(c, ops.Glu))


def _grow(draw, b: GraphBuilder, x, pool):
    """One random node on top of x (may raise IRError for ill-typed picks)."""
    kind = draw(st.sampled_from(["unary", "binary", "scale", "clamp", "norm", "permute", "transpose",
                                 "cont", "flat", "view", "cast", "glu", "softmax", "reduce", "sort",
                                 "concat", "repeat", "fill", "top_k", "argmax", "cumsum"]))
    if kind == "unary":
        return b.unary(draw(st.sampled_from(UNARY)), x)
    if kind == "binary":
        other = draw(st.sampled_from(pool))
        return getattr(b, draw(st.sampled_from(["add", "sub", "mul", "div"])))(x, other)
    if kind == "scale":
        return b.scale(x, draw(floats), draw(floats))
    if kind == "clamp":
        return b.clamp(x, draw(floats), draw(floats))
    if kind == "norm":
        cls = draw(st.sampled_from([ops.RmsNorm, ops.Norm, ops.L2Norm]))
        return b.op(cls(eps=draw(st.floats(1e-12, 1.0))), x)
    if kind == "permute":
        return b.permute(x, *draw(st.permutations(range(x.type.rank))))
    if kind == "transpose":
        return b.transpose(x)
    if kind == "cont":
        return b.cont(x)
    if kind == "flat":
        return b.reshape(b.cont(x), dims.prod(x.shape))
    if kind == "view":
        strides = x.type.contiguous_strides()
        second_row = x.shape[0] != 1 and draw(st.booleans())      # T rows: the verifier cannot tell
        return b.view(x, (1,) + tuple(x.shape[1:]), strides, offset=strides[0] if second_row else 0)
    if kind == "cast":
        return b.cast(x, draw(st.sampled_from([F32, F16, BF16])))
    if kind == "glu":
        return b.glu(draw(st.sampled_from(GLU)), x, swapped=draw(st.booleans()))
    if kind == "softmax":
        return b.soft_max_ext(x, None, draw(floats))
    if kind == "reduce":
        return b.op(draw(st.sampled_from([ops.SumRows(), ops.Mean(), ops.Sum()])), x)
    if kind == "sort":
        return b.argsort(x, descending=draw(st.booleans()))
    if kind == "concat":
        return b.concat(x, x, axis=draw(st.integers(-x.type.rank, x.type.rank - 1)))
    if kind == "repeat":
        return b.repeat(x, 2, *x.shape)
    if kind == "fill":
        return b.op(ops.Fill(c=draw(floats)), x)
    if kind == "argmax":
        return b.argmax(x)
    if kind == "cumsum":
        return b.cumsum(x)
    return b.top_k(x, draw(st.integers(1, 3)))


@st.composite
def random_graphs(draw):
    dim_names = draw(st.sampled_from([(), ("T",), ("T", "n_kv")]))
    b = GraphBuilder(draw(st.sampled_from(["g", "llama", "qwen2.5-vl"])), dims=list(dim_names))
    rows = "T" if dim_names else 3
    pool = [b.input("x", [rows, 8], F32), b.weight("w", [1, 8], F32),
            b.input("y", [2, rows, 4], draw(st.sampled_from([F32, F16])))]
    for _ in range(draw(st.integers(1, 12))):
        x = draw(st.sampled_from(pool))
        try:
            node = _grow(draw, b, x, pool)
        except IRError:
            continue
        b.name(node, draw(names))
        pool.append(node)
    for i, node in enumerate(draw(st.lists(st.sampled_from(pool), max_size=3))):
        b.output(f"out{i}", node)
    return b.graph


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_graphs())
def test_random_graphs_round_trip(graph):
    verify(graph)
    parsed = round_trip(graph)
    assert fingerprint(parsed) == fingerprint(graph)


# -- fingerprints --------------------------------------------------------------------------------
def _small(eps=1e-6, name="attn_norm-0", base=10000.0):
    b = GraphBuilder("tiny", dims=["T"])
    x = b.input("x", ["T", 4, 8], F32)
    h = b.rms_norm(x, eps, name=name)
    r = b.rope_ext(h, b.input("pos", ["T"], I32), n_dims=8, mode=ops.ROPE_NORM, n_ctx_orig=2048,
                   freq_base=base)
    q = b.permute(r, 1, 0, 2)                                                      # [4, T, 8]
    k = b.view(b.state("cache_k", [16, 4, 8], F16), [16, 4, 8], [64, 16, 2])
    kq = b.mul_mat(b.permute(k, 1, 0, 2), q)                                       # [4, T, 16]
    b.output("probs", b.soft_max_ext(kq, b.input("mask", ["T", 16], F32), 0.35355339059327373))
    return b.graph


def test_fingerprint_is_stable_and_sensitive():
    fp = fingerprint(_small())
    assert fp == fingerprint(_small()) == _small().fingerprint()
    assert len(fp) == 64 and int(fp, 16) >= 0
    assert fp == hashlib.sha256(print_graph(_small()).encode()).hexdigest()
    changed = {fingerprint(_small(eps=1e-5)), fingerprint(_small(name="attn_norm-1")),
               fingerprint(_small(base=10000.5))}
    assert fp not in changed and len(changed) == 3
    assert fingerprint(parse_graph(print_graph(_small()))) == fp


def test_golden_small_graph(golden):
    golden("ir_text_small.ir", print_graph(_small()))


def test_golden_text_parses_to_the_same_fingerprint():
    from pathlib import Path

    text = (Path(__file__).parents[1] / "golden" / "ir_text_small.ir").read_text()
    assert fingerprint(parse_graph(text)) == hashlib.sha256(text.encode()).hexdigest()


# -- parse errors --------------------------------------------------------------------------------
GOOD = """graph t(T) {
  %0 = input : f32[T,4] "x"
  %1 = silu(%0) : f32[T,4]
  return y = %1
}
"""


def _broken(line_no: int, new_line: str) -> str:
    lines = GOOD.splitlines()
    lines[line_no - 1] = new_line
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("line_no,new_line,message", [
    (1, "graf t(T) {", r"^line 1, column 1: expected 'graph NAME\(dims\) \{', got 'graf t\(T\) \{'$"),
    (2, '  %0 = input : f32[S,4] "x"', r"^line 2, column 20: dim 'S' is not declared by graph t \(declared: T\)$"),
    (2, '  %0 = inptu : f32[T,4] "x"', r"^line 2, column 8: unknown op 'inptu' \(did you mean 'input'\?\)$"),
    (2, '  %0 = input : f33[T,4] "x"', r"^line 2, column 16: unknown dtype 'f33'; known: f32, f16"),
    (2, '  %0 = input f32[T,4] "x"', r"^line 2, column 14: missing ': type' after input, got 'f32'$"),
    (3, "  %1 = silu(%0) : f32[T,5]", r"^line 3: silu infers f32\[T,4\] but the text says f32\[T,5\]$"),
    (3, "  %1 = silu(%3) : f32[T,4]", r"^line 3, column 13: %3 is used before it is defined$"),
    (3, "  %2 = silu(%0) : f32[T,4]", r"^line 3, column 3: value %2 out of order \(expected %1\)$"),
    (3, "  %1 = silu(%0) {eps=1.0} : f32[T,4]", r"^line 3, column 18: silu has no attribute 'eps' \(it has none\)$"),
    (3, "  %1 = scale(%0) {sc=1.0} : f32[T,4]", r"scale has no attribute 'sc' \(it has: s, b\)$"),
    (3, "  %1 = scale(%0) {s=abc} : f32[T,4]", r"^line 3, column 21: scale.s: expected a number .*, got 'abc'$"),
    (3, "  %1 = add(%0) : f32[T,4]", r"^line 3: add takes 2 inputs, got 1$"),
    (3, "  %1 = silu(0) : f32[T,4]", r"^line 3, column 13: expected a value reference like %3, got '0'$"),
    (3, "  %1 = argsort(%0) {descending=yes} : i32[T,4]",
     r"^line 3, column 32: argsort.descending: expected true or false, got 'yes'$"),
    (4, "  return y = %7", r"^line 4, column 14: %7 is used before it is defined$"),
    (4, "  return y = %1,", r"^line 4, column 17: expected an output name, got end of line$"),
    (4, "  return", r"^line 4, column 9: expected an output name after 'return', got end of line$"),
    (2, '  %0 = input : f32[T,4] "x" # the tokens', r"^line 2, column 29: unexpected '#' after the name "
                                                 r"\(a comment takes a whole line\)$"),
])
def test_parse_errors_name_the_line_column_and_token(line_no, new_line, message):
    parse_graph(GOOD)                                  # the unbroken text is fine
    with pytest.raises(ParseError, match=message):
        parse_graph(_broken(line_no, new_line))


def test_parse_error_line_numbers_count_comments_and_blank_lines():
    text = GOOD.replace("  %1 = silu(%0) : f32[T,4]", "\n  # a comment\n\n  %1 = silu(%0) : f32[T,9]")
    with pytest.raises(ParseError, match=r"^line 6: "):
        parse_graph(text)


def test_parse_structure_errors():
    with pytest.raises(ParseError, match="^empty IR text$"):
        parse_graph("\n  # only a comment\n")
    with pytest.raises(ParseError, match=r"^missing closing '\}': the text ends at line 4 inside graph t$"):
        parse_graph(GOOD.replace("}\n", ""))
    text = GOOD.replace('  %1 = silu', '  %1 = silu(%0) : f32[T,4]\n  %2 = input : f32[4] "late"\n  %3 = silu')
    with pytest.raises(ParseError, match=r"^line 4: leaves must come before nodes$"):
        parse_graph(text.replace("y = %1", "y = %3"))
    with pytest.raises(ParseError, match=r"^line 5, column 3: only the closing '\}' may follow the return on "
                                         r"line 4, got 'return'$"):
        parse_graph(GOOD.replace("  return y = %1\n", "  return y = %1\n  return z = %0\n"))
    assert isinstance(ParseError("x"), IRError)


# -- finding 8 of issue 9: what the parser used to accept or report with an internal message -----
@pytest.mark.parametrize("text,message", [
    (GOOD + "%2 = silu(%1) : f32[T,4]\n", r"^line 6, column 1: text after the closing '\}' of the graph: '%'$"),
    (GOOD + GOOD, r"^line 6, column 1: text after the closing '\}' of the graph: 'graph'$"),
    (GOOD.replace("}\n", "} x\n"), r"^line 5, column 1: text after the closing '\}' on its line: 'x'$"),
    (GOOD.replace("}\n", "}}\n"), r"^line 5, column 1: text after the closing '\}' on its line: '\}'$"),
])
def test_text_after_the_closing_brace_is_refused(text, message):
    with pytest.raises(ParseError, match=message):
        parse_graph(text)


def test_comments_and_blank_lines_may_follow_the_closing_brace():
    assert parse_graph(GOOD + "\n  # the end\n\n") == parse_graph(GOOD)


def test_duplicate_output_names_are_refused():
    with pytest.raises(ParseError, match=r"^line 4, column 18: output 'y' is returned twice$"):
        parse_graph(GOOD.replace("return y = %1", "return y = %1, y = %0"))
    assert list(parse_graph(GOOD.replace("return y = %1", "return y = %1, z = %1")).outputs) == ["y", "z"]


def test_duplicate_attribute_keys_are_refused():
    text = GOOD.replace("silu(%0)", "scale(%0) {s=2.0, b=1.0, s=3.0}")
    with pytest.raises(ParseError, match=r"^line 3, column 33: attribute 's' of scale is given twice$"):
        parse_graph(text)


def test_duplicate_and_missing_leaf_names_are_refused():
    text = GOOD.replace('  %1 = silu(%0)', '  %1 = weight : f32[4] "x"\n  %2 = silu(%0)').replace("= %1", "= %2")
    with pytest.raises(ParseError, match=r"^line 3: two leaves are named 'x' \(the first on line 2\); leaves "
                                         r"are bound by name$"):
        parse_graph(text)
    with pytest.raises(ParseError, match=r"^line 2: the input leaf has no name: leaves are bound by name$"):
        parse_graph(GOOD.replace(' "x"', ""))
    named_twice = GOOD.replace("silu(%0) : f32[T,4]", 'silu(%0) : f32[T,4] "x"')   # node names may repeat
    assert parse_graph(named_twice).nodes[0].name == "x"


@pytest.mark.parametrize("line,message", [
    ("  %1 = silu(%0 : f32[T,4]", r"^line 3, column 16: expected ',' or '\)' between arguments, got ':'$"),
    ("  %1 = silu(%0,) : f32[T,4]", r"^line 3, column 16: expected a value reference like %3, got '\)'$"),
    ("  %1 = silu(%²) : f32[T,4]", r"^line 3, column 14: expected a value number after '%', got '²'$"),
    ("  %1 = silu(%٣) : f32[T,4]", r"^line 3, column 14: expected a value number after '%', got '٣'$"),
    ("  %1 = scale(%0) {s=2.0} {b=1.0} : f32[T,4]", r"^line 3, column 26: missing ': type' after scale, got '\{'$"),
    ("  %1 = scale(%0) {s=2.0,} : f32[T,4]", r"^line 3, column 25: expected an attribute name, got '\}'$"),
    ("  %1 = scale(%0) {s=2.0 : f32[T,4]", r"^line 3, column 25: expected ',' or '\}' between attributes, got ':'$"),
    ("  %1 = permute(%0) {axes=[1,0} : f32[4,T]", r"^line 3, column 30: expected ',' or '\]' in permute.axes, "
                                                  r"got '\}'$"),
    ('  %1 = silu(%0) : f32[T,4] "\\q"', r"^line 3, column 29: bad string literal: Invalid \\escape$"),
    ('  %1 = silu(%0) : f32[T,4] "open', r"^line 3, column 28: bad string literal: Unterminated string"),
    ("  %1 = leaf() : f32[T,4]", r"^line 3, column 8: unknown op 'leaf'"),
    ("  %1 = rmsnorm(%0) : f32[T,4]", r"^line 3, column 8: unknown op 'rmsnorm' \(did you mean 'rms_norm'\?\)$"),
    ('  %1 = input(%0) : f32[T,4] "y"', r"^line 3, column 13: an input leaf takes no arguments$"),
])
def test_malformed_lines_get_messages_naming_the_token(line, message):
    """The old parser said 'line 3: substring not found' (no ')'), 'invalid literal for int()'
    (a unicode digit after %) or accepted the text (trailing commas, a second attribute list)."""
    with pytest.raises(ParseError, match=message):
        parse_graph(_broken(3, line))


@pytest.mark.parametrize("header,message", [
    ("graph ²(T) {", r"^line 1, column 7: expected the graph's name after 'graph', got '²'$"),
    ("graph 9t(T) {", r"^line 1, column 7: expected the graph's name after 'graph', got '9t'$"),
    ("graph t(T, T) {", r"^line 1, column 12: dim 'T' is declared twice$"),
    ("graph t(T,) {", r"^line 1, column 11: expected a dim name such as T, got '\)'$"),
    ("graph t(T-1) {", r"^line 1, column 10: expected ',' or '\)' between dim names, got '-1'$"),
    ("graph t(T) { %0", r"^line 1, column 14: unexpected '%' after 'graph NAME\(dims\) \{'"),
    ("graph t(T)", r"^line 1, column 11: expected '\{' after the dims list, got end of line$"),
])
def test_bad_headers(header, message):
    """A graph name the Graph class refuses used to escape as a bare IRError, not a ParseError."""
    with pytest.raises(ParseError, match=message):
        parse_graph(_broken(1, header))


@pytest.mark.parametrize("line,message", [
    ('  %0 = input : f32[T,' + "9" * 5000 + '] "x"', r"^line 2, column 22: dim: 9999999999\.\.\.\(5000 digits\) "
                                                     r"is out of range \(it must fit in int64\)$"),
    ('  %0 = input : f32[T,9223372036854775808] "x"', r"dim: 9223372036854775808 is out of range"),
    ('  %0 = input : f32[T,4294967296*4294967296] "x"', r"^line 2, column 22: the dim's coefficient "
                                                        r"18446744073709551616 does not fit in int64$"),
    ('  %0 = input : f32[T,-4] "x"', r"^line 2, column 22: expected a dim \(a count >= 0.*got '-4'$"),
    ('  %0 = input : f32[T,4,1,1,1] "x"', r"^line 2, column 16: a type has at most 4 dims$"),
    ('  %0 = input : f32[] "x"', r"^line 2, column 20: expected a dim .*, got '\]'$"),
    ('  %0 = input : f32[4611686018427387904,2] "x"', r"^line 2, column 16: f32\[4611686018427387904,2\] takes "
                                                     r"36893488147419103232 bytes, more than int64 counts$"),
    ('  %0 = input : q4_0[T,48] "x"', r"^line 2, column 16: a q4_0 row of 48 elements is not a whole number of "
                                      r"32-element blocks$"),
    ('  %0 = input : q8_0[4,T] "x"', r"^line 2, column 16: a q8_0 row needs a concrete length, got T$"),
])
def test_huge_and_negative_dims_are_refused(line, message):
    with pytest.raises(ParseError, match=message):
        parse_graph(_broken(2, line))


@pytest.mark.parametrize("attrs,type_,message", [
    ("scale(%0) {s=1e999}", "f32[T,4]", r"^line 3, column 21: scale.s: 1e999 is out of float range \(write inf\)$"),
    ("scale(%0) {s=" + "1" * 100 + "}", "f32[T,4]", r"scale.s: a number literal of 100 characters is too long$"),
    ("top_k(%0) {k=2147483648}", "i32[T,4]", r"^line 3, column 21: top_k.k: 2147483648 is out of range "
                                             r"\(it must fit in int32\)$"),
    ("top_k(%0) {k=" + "9" * 5000 + "}", "i32[T,4]", r"top_k.k: 9999999999\.\.\.\(5000 digits\) is out of range"),
    ("permute(%0) {axes=" + "[" * 100_000 + "}", "f32[4,T]", r"^line 3, column 27: expected an integer in "
                                                             r"permute.axes, got '\['$"),
    ("permute(%0) {axes=[" + "1," * 100_000 + "0]}", "f32[4,T]", r"permute.axes: a list of more than 4 items"),
    ("rms_norm(%0) {eps=nan}", "f32[T,4]", r"^line 3: rms_norm: eps must be >= 0 \(not NaN\), got nan$"),
    ("rms_norm(%0) {eps=-1e-05}", "f32[T,4]", r"^line 3: rms_norm: eps must be >= 0 \(not NaN\), got -1e-05$"),
    ("cpy(%0) {dtype=none}", "f32[T,4]", r"^line 3: cpy: cpy needs a target dtype$"),
])
def test_bad_attribute_values_are_refused(attrs, type_, message):
    """Huge or nested inputs are refused at the first bad token: no int() of a 5000-digit literal,
    no recursion into 100000 brackets."""
    with pytest.raises(ParseError, match=message):
        parse_graph(_broken(3, f"  %1 = {attrs} : {type_}"))


def test_graphs_the_verifier_refuses_do_not_parse():
    text = """graph t(T) {
  %0 = input : f32[3,4] "x"
  %1 = view(%0) {shape=[2,4], strides=[16,4], offset=32} : f32[2,4]
  %2 = view(%0) {shape=[4], strides=[4], offset=T} : f32[4]
}
"""
    with pytest.raises(ParseError, match=r"^line 3: <view f32\[2,4\]> reads bytes \[32, 64\) of a 48-byte f32\[3,4\]$"):
        parse_graph(text)
    text = text.replace("offset=32", "offset=16").replace("graph t(T)", "graph t()")
    with pytest.raises(ParseError, match=r"^line 4, column 49: dim 'T' is not declared by graph t \(declared: none\)$"):
        parse_graph(text)
    verify(parse_graph(text.replace("offset=T", "offset=8")))


def test_bytes_are_read_as_utf8():
    assert parse_graph(GOOD.encode()) == parse_graph(GOOD)
    with pytest.raises(ParseError, match=r"^line 2: IR text is not UTF-8: byte 38 is 0xff$"):
        parse_graph(GOOD.encode().replace(b'"x"', b'"\xff"'))
    with pytest.raises(TypeError, match="parse_graph takes IR text"):
        parse_graph(None)


def test_lenient_spellings_parse_to_the_canonical_graph():
    """Extra spaces, CRLF line ends, default attributes written out and an empty attribute list read
    as the printer's own text, which is what the graph prints back."""
    loose = ("graph  t( T ) {\r\n  %0=input:f32[ T , 4 ]\"x\"\r\n"
             "  %1 = scale( %0 ) { s = 1.0 , b = 0.0 } : f32[T,4]\r\n  return y=%1\r\n}\r\n")
    assert print_graph(parse_graph(loose)) == GOOD.replace("silu(%0)", "scale(%0)")


@pytest.mark.parametrize("text,message", [
    ("f32[-1]", r"invalid dim '-1': '-1' is neither a count nor a name"),
    ("f32[T*٣]", r"'٣' is neither a count nor a name"),
    ("f32[" + "9" * 5000 + "]", r"is neither a count nor a name"),            # no int() of 5000 digits
    ("f32[4294967296*4294967296]", r"its coefficient does not fit in int64"),
    ("f32[T]]", r"expected DTYPE\[DIM,...\] such as f32\[T,64\]"),
    ("f32[1,2,3,4,5]", r"more than 4 dims"),
])
def test_parse_type_is_as_strict_as_the_parser(text, message):
    from llamir.ir import parse_type

    with pytest.raises(ValueError, match=message):
        parse_type(text)
    assert parse_type(" f32[T,4*n_kv] ") == parse_graph(
        'graph t(T, n_kv) {\n  %0 = input : f32[T,4*n_kv] "x"\n}\n').leafs[0].type
