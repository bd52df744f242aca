"""argmax and cumsum on the LLVM backend: test-backend-ops bit for bit, row counts known only at
run time (one compiled graph for every T), rows split between 1..4 threads, the sampler-shaped
chain softmax -> cumsum next to argmax, and llama.cpp's libggml on ties, -inf and NaN."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from shared_backends import shared_backend

from llamir.ir import F32, GraphBuilder, run_graph
from llamir.testing.backend_ops import OK, run_backend_ops
from llamir.testing.libggml import assert_same_bits

f32 = np.float32


def logits_with_ties(rng, rows: int, n: int, nan: bool = True) -> np.ndarray:
    """Few distinct values, a quarter masked to -inf; with `nan`, row 0 all -inf and NaNs in the
    last two rows."""
    x = np.round(rng.normal(0, 2, (rows, n))).astype(f32)
    x[rng.random(x.shape) < 0.25] = -np.inf
    x[:, 0] = 0.0
    if nan:
        x[0] = -np.inf
        x[-2:][rng.random((min(rows, 2), n)) < 0.1] = np.nan
    return x


def sampler_graph(n_vocab: int) -> GraphBuilder:
    """What a backend sampler appends to the logits: greedy's argmax, and top-p's cumulative sum
    of the softmax."""
    b = GraphBuilder("sampler", dims=["T"])
    logits = b.input("logits", ["T", n_vocab], F32)                     # [T, n_vocab]
    b.output("greedy", b.argmax(logits))                                # [T] i32
    probs = b.soft_max_ext(logits, None, 1.0 / 0.8)                     # [T, n_vocab]
    b.output("cdf", b.cumsum(probs))                                    # [T, n_vocab]
    return b


def test_backend_ops_cases_are_bit_exact():
    report = run_backend_ops(shared_backend(), ops=["argmax", "cumsum"])
    assert len(report.results) >= 15
    assert all(r.status == OK and r.error == 0.0 for r in report.results), \
        "\n".join(r.line() for r in report.results if r.status != OK or r.error)


@pytest.mark.parametrize("n_threads", [1, 3, 4])
def test_run_time_rows_split_between_threads(n_threads):
    """One compiled graph for T = 1 (fewer rows than threads) .. 37 (rows that do not divide);
    logits with ties and -inf (no NaN: softmax's NaN bits are not this test's business)."""
    run = shared_backend(n_threads=n_threads).compile(sampler_graph(1000).graph)
    rng = np.random.default_rng(n_threads)
    for T in (1, 2, 5, 37):
        logits = logits_with_ties(rng, T, 1000, nan=False)
        got = run({"logits": logits.copy()}, {"T": T})
        want = run_graph(sampler_graph(1000).graph, {"logits": logits}, {"T": T})
        np.testing.assert_array_equal(got["greedy"], want["greedy"])
        assert_same_bits(got["cdf"], want["cdf"])


def test_argmax_of_a_vector_and_of_a_strided_view():
    b = GraphBuilder("views")
    x = b.input("x", [6, 40], F32)
    b.output("vec", b.argmax(b.input("v", [301], F32)))                 # [1]
    b.output("cols", b.argmax(b.transpose(x)))                          # [40]
    b.output("cdf_cols", b.cumsum(b.transpose(x)))                      # [40, 6]
    rng = np.random.default_rng(2)
    values = {"x": logits_with_ties(rng, 6, 40), "v": np.round(rng.normal(0, 1, 301)).astype(f32)}
    got = shared_backend().compile(b.graph)({k: v.copy() for k, v in values.items()}, {})
    want = run_graph(b.graph, values)
    for name in ("vec", "cols"):
        np.testing.assert_array_equal(got[name], want[name])
    assert_same_bits(got["cdf_cols"], want["cdf_cols"])


def test_one_short_row_compiles():
    """LLVM 22 does not terminate when it vectorizes and unrolls the argmax loop over a constant
    31..33 columns of one row; the kernel takes its shape at run time, so it never sees one. (In
    a child process compiling in-process, so that a hang is a timeout that leaves nothing behind.)"""
    script = textwrap.dedent("""
        import numpy as np
        from llamir.backends.llvm import LLVMBackend
        from llamir.ir import F32, GraphBuilder
        be = LLVMBackend(n_threads=2, disk_cache=False, compile_workers=1)
        for n in (31, 32, 33):
            b = GraphBuilder("short")
            b.output("y", b.argmax(b.input("x", [1, n], F32)))
            b.output("c", b.cumsum(b.input("z", [1, n], F32)))
            x = np.arange(n, dtype=np.float32)[None]
            out = be.compile(b.graph)({"x": x, "z": x.copy()}, {})
            assert out["y"].tolist() == [n - 1], out
        be.close()
        print("compiled")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-2000:]


@pytest.mark.llama_cpp
@pytest.mark.parametrize("rows,n", [(3, 32), (9, 301), (4, 32000)])
def test_equals_ggml(ggml, rows, n):
    logits = logits_with_ties(np.random.default_rng(n), rows, n)
    probs = (np.random.default_rng(rows).exponential(1, (rows, n)) / n).astype(f32)
    b = GraphBuilder("oracle", dims=["T"])
    b.output("greedy", b.argmax(b.input("logits", ["T", n], F32)))
    b.output("cdf", b.cumsum(b.input("probs", ["T", n], F32)))
    got = shared_backend().compile(b.graph)({"logits": logits.copy(), "probs": probs.copy()}, {"T": rows})
    for name, x, key in (("ggml_argmax", logits, "greedy"), ("ggml_cumsum", probs, "cdf")):
        with ggml.graph(256 << 20) as g:
            want = g.compute(g.op(name, g.tensor(x)), n_threads=2)
        if key == "greedy":
            np.testing.assert_array_equal(got[key], want)
        else:
            assert_same_bits(got[key], want)
