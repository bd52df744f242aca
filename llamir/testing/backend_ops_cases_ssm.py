"""test-backend-ops cases of the state-space-model ops, after ggml's test_ssm_conv and
test_ssm_scan (tests/test-backend-ops.cpp): Mamba-1 and Mamba-2 shapes, several sequences,
one token and many, states picked by a permutation of ids (or a few of more slots), ggml's
rollback snapshots (K > 1), overlapping x/B/C views, and the layouts llama.cpp's mamba graphs
give them (views of one projection; the conv window as concat(conv state, x^T)). Batch sizes
are symbolic dims in some cases, so the same kernels run whatever the batch."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from llamir.ir import F32, I32, GraphBuilder
from llamir.testing.backend_ops_cases import Case, Values, build, params, uniform

CONV_NMSE = 1e-7          # ggml's default bound
MAMBA1_NMSE = 1e-7        # test_ssm_scan::max_nmse_err: Mamba-1 (head_dim 1) is pure f32
MAMBA2_NMSE = 2e-7


def permutation(n_slots: int | None = None) -> Values:
    """ids: a random permutation of the sequences' slots (or a draw of distinct slots of n_slots)."""
    def make(rng, shape):
        return rng.permutation(n_slots or shape[0])[:shape[0]].astype(np.int32)
    return make


# -- ssm_conv -------------------------------------------------------------------------------------------
def _conv(d_conv: int, d_inner: int, n_t: int, n_s: int) -> Case:
    window = d_conv - 1 + n_t
    return build("ssm_conv", params(type="f32", ne_a=(window, d_inner, n_s, 1), ne_b=(d_conv, d_inner, 1, 1)),
                 lambda g: g.output("out", g.ssm_conv(g.input("sx", (n_s, d_inner, window), F32),
                                                      g.weight("c", (d_inner, d_conv), F32))),
                 max_nmse=CONV_NMSE, flops=2 * n_s * n_t * d_inner * d_conv)


def ssm_conv_cases() -> Iterator[Case]:
    for d_conv in (3, 4, 9):
        for d_inner in (37, 1536):
            for n_t, n_s in ((1, 1), (d_conv + 1, 1), (1, 4), (64, 1), (64, 4)):
                yield _conv(d_conv, d_inner, n_t, n_s)

    def batch(g: GraphBuilder) -> None:        # n_s symbolic
        g.output("out", g.ssm_conv(g.input("sx", ("S", 96, 3 + 5), F32), g.weight("c", (96, 4), F32)))
    yield build("ssm_conv", params(type="f32", ne_a=(8, 96, "S", 1), ne_b=(4, 96, 1, 1)), batch, ("S",),
                bindings={"S": 3}, max_nmse=CONV_NMSE)

    def every_other(g: GraphBuilder) -> None:  # sequences 2 windows apart (rows stay packed)
        big = g.input("sx_all", (6, 40, 3 + 7), F32)
        sx = g.view(big, [3, 40, 10], [2 * 40 * 10 * 4, 10 * 4, 4], 40 * 10 * 4)
        g.output("out", g.ssm_conv(sx, g.weight("c", (40, 4), F32)))
    yield build("ssm_conv", params(type="f32", ne_a=(10, 40, 3, 1), ne_b=(4, 40, 1, 1), v="strided"), every_other,
                max_nmse=CONV_NMSE)

    def mamba_window(g: GraphBuilder) -> None:  # llama.cpp's conv_x = concat(conv state, x^T, 0)
        state = g.input("conv", ("S", 64, 3), F32)                                 # [S, d_inner, d_conv - 1]
        x = g.input("x", ("S", 5, 64), F32)                                        # [S, n_t, d_inner]
        sx = g.concat(state, g.transpose(x), axis=2)                              # [S, d_inner, 3 + n_t]
        g.output("out", g.ssm_conv(sx, g.weight("c", (64, 4), F32)))
    yield build("ssm_conv", params(type="f32", ne_a=(8, 64, "S", 1), ne_b=(4, 64, 1, 1), v="concat"), mamba_window,
                ("S",), bindings={"S": 2}, max_nmse=CONV_NMSE)


# -- ssm_scan -------------------------------------------------------------------------------------------
def _scan(d_state: int, head_dim: int, n_head: int, n_group: int, n_t: int, n_s: int, K: int = 1,
          weak_decay: bool = False, n_rs: int | None = None, symbolic: bool = False) -> Case:
    n_rs = n_rs or n_s
    a_cols = 1 if head_dim > 1 else d_state
    S, R = ("S", "R") if symbolic else (n_s, n_rs)

    def fn(g: GraphBuilder) -> None:
        s = g.input("s", (R, n_head, head_dim, d_state), F32)
        x = g.input("x", (S, n_t, n_head, head_dim), F32)
        dt = g.input("dt", (S, n_t, n_head), F32)
        A = g.weight("A", (n_head, a_cols), F32)
        B = g.input("B", (S, n_t, n_group, d_state), F32)
        C = g.input("C", (S, n_t, n_group, d_state), F32)
        g.output("out", g.ssm_scan(s, x, dt, A, B, C, g.input("ids", (S,), I32), K=K))

    text = params(type="f32", d_state=d_state, head_dim=head_dim, n_head=n_head, n_group=n_group,
                  n_seq_tokens=n_t, n_seqs=n_s, K=K, weak_decay=int(weak_decay), n_rs=n_rs,
                  **({"dims": "S,R"} if symbolic else {}))
    decay = uniform(-0.02, -0.005) if weak_decay else uniform(-1.0, -0.5)
    return build("ssm_scan", text, fn, ("S", "R") if symbolic else (),
                 bindings={"S": n_s, "R": n_rs} if symbolic else {},
                 values={"A": decay, "ids": permutation(n_rs)},
                 max_nmse=MAMBA2_NMSE if head_dim > 1 else MAMBA1_NMSE,
                 flops=6 * n_s * n_t * n_head * head_dim * d_state)


def _scan_overlap(d_state: int, n_head: int, n_t: int, n_s: int) -> Case:
    """ggml's xbc_overlap: x, B and C are views of one [2*n_s, n_t, n_head, d_state] tensor, x one
    sequence in, B at 0 and C two sequences in (head_dim = d_state, n_group = n_head)."""
    row, tok = d_state * 4, n_head * d_state * 4
    seq = n_t * tok

    def fn(g: GraphBuilder) -> None:
        xbc = g.input("xbc", (2 * n_s, n_t, n_head, d_state), F32)
        shape, strides = [n_s, n_t, n_head, d_state], [seq, tok, row, 4]
        x, B, C = (g.view(xbc, shape, strides, offset) for offset in (seq, 0, 2 * seq))
        g.output("out", g.ssm_scan(g.input("s", (n_s, n_head, d_state, d_state), F32), x,
                                   g.input("dt", (n_s, n_t, n_head), F32), g.weight("A", (n_head, 1), F32), B, C,
                                   g.input("ids", (n_s,), I32)))

    text = params(type="f32", d_state=d_state, head_dim=d_state, n_head=n_head, n_group=n_head,
                  n_seq_tokens=n_t, n_seqs=n_s, xbc_overlap=1)
    return build("ssm_scan", text, fn, values={"A": uniform(-1.0, -0.5), "ids": permutation()},
                 max_nmse=MAMBA2_NMSE)


def _scan_mamba2_views(d_state: int, head_dim: int, n_head: int, n_group: int, n_t: int) -> Case:
    """llama.cpp's Mamba-2 layer: x, B and C are views of one conv output [S, n_t, d_inner + 2*G*ds]."""
    d_inner = head_dim * n_head
    row = d_inner + 2 * n_group * d_state

    def fn(g: GraphBuilder) -> None:
        S = g.dim("S")
        xbc = g.input("xBC", ("S", n_t, row), F32)
        seq = n_t * row * 4
        x = g.view(xbc, [S, n_t, n_head, head_dim], [seq, row * 4, head_dim * 4, 4], 0)
        B = g.view(xbc, [S, n_t, n_group, d_state], [seq, row * 4, d_state * 4, 4], d_inner * 4)
        C = g.view(xbc, [S, n_t, n_group, d_state], [seq, row * 4, d_state * 4, 4], (d_inner + n_group * d_state) * 4)
        s = g.input("s", ("R", n_head, head_dim, d_state), F32)
        g.output("out", g.ssm_scan(s, x, g.input("dt", ("S", n_t, n_head), F32), g.weight("A", (n_head, 1), F32),
                                   B, C, g.input("ids", ("S",), I32)))

    text = params(type="f32", d_state=d_state, head_dim=head_dim, n_head=n_head, n_group=n_group,
                  n_seq_tokens=n_t, n_seqs="S", v="xBC_views")
    return build("ssm_scan", text, fn, ("S", "R"), bindings={"S": 2, "R": 4},
                 values={"A": uniform(-1.0, -0.5), "ids": permutation(4)}, max_nmse=MAMBA2_NMSE)


def _scan_mamba1_views(d_state: int, d_inner: int, dt_rank: int, n_t: int) -> Case:
    """llama.cpp's Mamba-1 layer: B and C are views of x_db [S, n_t, dt_rank + 2*d_state]."""
    row = dt_rank + 2 * d_state

    def fn(g: GraphBuilder) -> None:
        S = g.dim("S")
        x_db = g.input("x_db", ("S", n_t, row), F32)
        seq = n_t * row * 4
        B = g.view(x_db, [S, n_t, 1, d_state], [seq, row * 4, d_state * 4, 4], dt_rank * 4)
        C = g.view(x_db, [S, n_t, 1, d_state], [seq, row * 4, d_state * 4, 4], (dt_rank + d_state) * 4)
        x = g.reshape(g.input("x", ("S", n_t, d_inner), F32), S, n_t, d_inner, 1)
        s = g.input("s", ("R", d_inner, 1, d_state), F32)
        g.output("out", g.ssm_scan(s, x, g.input("dt", ("S", n_t, d_inner), F32),
                                   g.weight("A", (d_inner, d_state), F32), B, C, g.input("ids", ("S",), I32)))

    text = params(type="f32", d_state=d_state, head_dim=1, n_head=d_inner, n_group=1, n_seq_tokens=n_t,
                  n_seqs="S", v="x_db_views")
    return build("ssm_scan", text, fn, ("S", "R"), bindings={"S": 3, "R": 3},
                 values={"A": uniform(-1.0, -0.5), "ids": permutation()}, max_nmse=MAMBA1_NMSE)


def ssm_scan_cases() -> Iterator[Case]:
    yield _scan(16, 1, 1024, 1, 32, 4)                        # Mamba-1
    yield _scan(16, 1, 1536, 1, 1, 2, n_rs=5)                 # Mamba-1 decode, 2 of 5 slots
    yield _scan(16, 1, 64, 1, 7, 3, symbolic=True, n_rs=4)    # Mamba-1, symbolic batch
    yield _scan(96, 64, 128, 8, 1, 1)                         # Nemotron-3-Puzzle decode
    yield _scan(96, 64, 16, 8, 12, 2, weak_decay=True)        # d_state 96: a partial AVX-512 step
    yield _scan(128, 64, 16, 2, 32, 4)                        # Mamba-2
    yield _scan(256, 64, 8, 2, 16, 4)                         # Falcon-H1
    yield _scan(128, 80, 128, 1, 1, 1)                        # Nemotron-9B decode
    yield _scan(128, 64, 16, 2, 9, 2, weak_decay=True)
    yield _scan(48, 8, 6, 3, 5, 3, symbolic=True, n_rs=6)     # uneven heads per thread, no whole step
    yield _scan(128, 64, 16, 2, 4, 2, K=4)                    # rollback snapshots
    yield _scan(128, 64, 16, 2, 8, 2, K=3)                    # rollback, more tokens than blocks
    yield _scan(128, 64, 16, 2, 2, 2, K=4)                    # more blocks than tokens: the rest zero
    yield _scan_overlap(128, 4, 16, 2)
    yield _scan_mamba2_views(64, 16, 8, 2, 6)
    yield _scan_mamba1_views(16, 96, 6, 5)
