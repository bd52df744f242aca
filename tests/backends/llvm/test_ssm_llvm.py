"""ssm_conv and ssm_scan on the LLVM backend: the test-backend-ops cases bit for bit against the
reference on other thread counts than the shared run (heads and channels split unevenly), the
batch sizes taken at run time (one executable for every batch of a symbolic graph, one kernel for
graphs that differ only in their token count), and a state id out of range reported, not used."""

from __future__ import annotations

import numpy as np
import pytest
from shared_backends import shared_backend

from llamir.backends.base import BackendError
from llamir.backends.llvm.kernels.ssm import SsmConv, SsmScan
from llamir.backends.llvm.lowering import Lowerer
from llamir.ir import F32, I32, GraphBuilder, bind_dims, run_graph
from llamir.testing.backend_ops import OK, run_backend_ops

f32 = np.float32


@pytest.mark.parametrize("n_threads", [1, 3])
def test_backend_ops_cases_are_bit_exact(n_threads):
    report = run_backend_ops(shared_backend(n_threads=n_threads), ops=["ssm_conv", "ssm_scan"])
    assert len(report.results) > 40
    bad = [r.line() for r in report.results if r.status != OK or r.error != 0.0]
    assert not bad, "\n".join(bad)


def mamba2_block(n_t, n_head=4, head_dim=8, d_state=80, n_group=2, d_conv=4, dims_=("S", "R")):
    """A Mamba-2 layer's conv and scan: the window is concat(conv state, xBC^T), and x, B and C are
    views of the conv output, as llm_build_mamba_base::build_mamba2_layer makes them."""
    d_inner = n_head * head_dim
    d_xbc = d_inner + 2 * n_group * d_state
    b = GraphBuilder("mamba2", dims=list(dims_))
    S = b.dim("S")
    conv_state = b.input("conv", ["S", d_xbc, d_conv - 1], F32)
    xbc = b.input("xBC", ["S", n_t, d_xbc], F32)
    window = b.concat(conv_state, b.transpose(xbc), axis=2)                    # [S, d_xbc, d_conv - 1 + n_t]
    conv = b.ssm_conv(window, b.weight("conv_w", [d_xbc, d_conv], F32), name="conv")   # [S, n_t, d_xbc]
    seq, tok = n_t * d_xbc * 4, d_xbc * 4
    x = b.view(conv, [S, n_t, n_head, head_dim], [seq, tok, head_dim * 4, 4], 0)
    B = b.view(conv, [S, n_t, n_group, d_state], [seq, tok, d_state * 4, 4], d_inner * 4)
    C = b.view(conv, [S, n_t, n_group, d_state], [seq, tok, d_state * 4, 4], (d_inner + n_group * d_state) * 4)
    y = b.ssm_scan(b.state("ssm", ["R", n_head, head_dim, d_state], F32), x, b.input("dt", ["S", n_t, n_head], F32),
                   b.weight("A", [n_head, 1], F32), B, C, b.input("ids", ["S"], I32), name="scan")
    b.output("conv", conv)
    b.output("y", y)
    return b.graph


def block_values(rng, graph, bindings):
    values = {}
    for leaf in graph.leafs:
        shape = leaf.type.evaluate(bindings)
        if leaf.name == "ids":
            values[leaf.name] = rng.permutation(bindings["R"])[: shape[0]].astype(np.int32)
        elif leaf.name == "A":
            values[leaf.name] = rng.uniform(-1, -0.5, shape).astype(f32)
        else:
            values[leaf.name] = rng.uniform(-1, 1, shape).astype(f32)
    return values


def test_symbolic_batch_runs_in_one_executable():
    graph = mamba2_block(n_t=3)
    exe = shared_backend().compile(graph)
    rng = np.random.default_rng(2)
    for bindings in ({"S": 1, "R": 1}, {"S": 3, "R": 5}, {"S": 2, "R": 4}):
        values = block_values(rng, graph, bindings)
        got, want = exe(dict(values), bindings), run_graph(graph, dict(values), bindings)
        for name in ("conv", "y"):
            np.testing.assert_array_equal(got[name], want[name])


def _ssm_kernel_keys(graph) -> list:
    plan = Lowerer(graph, shared_backend().target).run()
    return [s.kernel.key() for s in plan.steps if isinstance(s.kernel, (SsmConv, SsmScan))]


def test_graphs_that_differ_in_tokens_and_batch_share_kernels():
    """Concrete graphs of other token and sequence counts compile to the same two functions."""
    graphs = [bind_dims(mamba2_block(n_t), {"S": n_s, "R": n_rs}) for n_t, n_s, n_rs in ((1, 1, 2), (7, 3, 4))]
    assert all(g.nodes[-1].type.is_concrete for g in graphs)
    keys = [_ssm_kernel_keys(g) for g in graphs]
    assert len(keys[0]) == 2 and keys[0] == keys[1]


def test_a_state_id_out_of_range_is_reported():
    graph = mamba2_block(n_t=2)
    bindings = {"S": 2, "R": 3}
    values = block_values(np.random.default_rng(0), graph, bindings)
    values["ids"] = np.array([0, 3], np.int32)
    exe = shared_backend().compile(graph)
    with pytest.raises(BackendError, match=r"index 3 is out of range \(ssm_scan state id in ssm_scan scan\)"):
        exe(dict(values), bindings)
    values["ids"] = np.array([2, 0], np.int32)
    np.testing.assert_array_equal(exe(dict(values), bindings)["y"], run_graph(graph, values, bindings)["y"])
