"""The CUDA plugin's attention kernels (flash_attn_ext, soft_max_attn) on the emulated device,
against the numpy reference: test-backend-ops' cases, then cases that reach what those do not
(the mma kernel on quantized, bf16 and odd or large heads; the vec kernel split over the cells,
with heads past the mma kernel's, on strided q and several streams), and their PTX through ptxas."""

from __future__ import annotations

import numpy as np
from cuda_common import assert_assembles, run_ops

from llamir.ir import BF16, F16, F32, Q4_0, Q4_1, Q5_0, Q8_0, ops
from llamir.testing.backend_ops import run_backend_ops
from llamir.testing.backend_ops_cases import build, params


def _causal(history: int):
    """A causal mask over `history` earlier cells (f32 values; the case stores its dtype)."""
    def make(rng, shape):
        m = np.zeros(shape, np.float32)
        for t in range(shape[-2]):
            m[..., t, history + t + 1:] = -np.inf
        return m
    return make


def _case(op: str, kv, T: int, n: int, *, dk: int = 64, dv: int = 64, heads=(4, 2), streams=(1, 1),
          mask=F16, max_bias=0.0, softcap=0.0, sinks=False, v_type=None, strided_q=False):
    """An attention graph: q [S, H, T, dk] (a permuted view when strided_q, so its ne0 stride is
    T elements), K/V of `kv` (V of v_type when given) over n cells, the last T of them the
    queries' own (causal)."""
    n_head, n_kv_head = heads
    s_q, s_kv = streams
    v_type = v_type or kv

    def fn(g):
        if strided_q:
            q = g.permute(g.input("qt", (s_q, n_head, dk, "T"), F32), 0, 1, 3, 2)
        else:
            q = g.input("q", (s_q, n_head, "T", dk), F32)
        k = g.input("k", (s_kv, n_kv_head, "n", dk), kv)
        m = g.input("m", (1, 1, "T", "n"), mask) if mask else None
        s = g.input("s", (n_head,), F32) if sinks else None
        if op == "flash_attn_ext":
            v = g.input("v", (s_kv, n_kv_head, "n", dv), v_type)
            g.output("out", g.flash_attn_ext(q, k, v, m, 0.125, max_bias=max_bias, logit_softcap=softcap, sinks=s))
        else:
            v = g.input("v", (s_kv, n_kv_head, dv, "n"), v_type)
            attn = ops.SoftMaxAttn(scale=0.125, max_bias=max_bias, mask=mask is not None, sinks=sinks)
            g.output("out", g.op(attn, q, k, v, *[x for x in (m, s) if x is not None]))

    text = params(hsk=dk, hsv=dv, nh=heads, streams=streams, kv=n, nb=T, mask=mask or 0, sinks=int(sinks),
                  max_bias=max_bias, logit_softcap=softcap, type_K=kv, type_V=v_type, strided_q=int(strided_q))
    return build(op, text, fn, ("T", "n"), bindings={"T": T, "n": n}, values={"m": _causal(n - T)},
                 max_nmse=5e-4)


def _run(cuda, cases):
    report = run_backend_ops(cuda, cases=cases)
    assert not report.failures, "\n".join(r.line() for r in report.failures)
    assert report.n_passed == len(cases), "\n".join(r.line() for r in report.results if r.status != "OK")


def _made(kernels, name: str, **fields) -> bool:
    """Whether the run made a kernel `name` whose variant has these fields."""
    return any(k.key[0] == name and all(getattr(k.key[1], f) == v for f, v in fields.items()) for k in kernels)


def test_attention_ops(cuda):
    """Every case test-backend-ops has: decode rows take the vec kernel, 10 and 140 rows the mma one."""
    kernels, _ = run_ops(cuda, ["flash_attn_ext", "soft_max_attn"], min_supported=23)
    assert _made(kernels, "flash_attn_vec") and _made(kernels, "flash_attn_mma") and _made(kernels, "soft_max_attn_mma")
    assert_assembles(kernels, no_spills=True)


def test_flash_attn_mma_cases(cuda):
    """The tensor-core kernel on prompts: quantized and mixed K/V, bf16, odd heads (padded to the
    fragments) with ALiBi, softcap and sinks, 256-wide heads (Q staged in shared memory), two
    streams, a strided q, no mask and an f32 one."""
    before = {k.key for k in _kernels()}
    cases = [
        _case("flash_attn_ext", Q4_0, 40, 70, v_type=Q8_0),
        _case("flash_attn_ext", Q4_1, 20, 45, v_type=Q5_0, heads=(2, 2)),
        _case("flash_attn_ext", BF16, 20, 45, heads=(2, 1), mask=F32),
        _case("flash_attn_ext", F16, 20, 75, dk=72, dv=40, heads=(8, 2), max_bias=8.0, softcap=30.0, sinks=True),
        _case("flash_attn_ext", F16, 8, 40, dk=256, dv=256, heads=(4, 1)),
        _case("flash_attn_ext", F32, 9, 30, streams=(2, 2), mask=None),
        _case("flash_attn_ext", F16, 12, 33, strided_q=True, sinks=True),
    ]
    _run(cuda, cases)
    made = [k for k in _kernels() if k.key not in before]
    assert _made(made, "flash_attn_mma", k_type="q4_0", v_type="q8_0")
    assert _made(made, "flash_attn_mma", k_type="bf16") and _made(made, "flash_attn_mma", dk=72, dv=40)
    assert _made(made, "flash_attn_mma", dk=256) and _made(made, "flash_attn_mma", dense=False)
    assert not _made(made, "flash_attn_vec")
    assert_assembles(made, no_spills=True)


def test_flash_attn_vec_cases(cuda):
    """The decode kernel: cells split over blocks and merged (sinks and ALiBi in the merge),
    MLA-sized heads, many rows (heads past the mma kernel's; two decode tokens of 8 heads per KV
    head) over several row blocks, quantized and bf16 K/V, a strided q, two streams."""
    before = {k.key for k in _kernels()}
    cases = [
        _case("flash_attn_ext", F16, 1, 300, max_bias=8.0, sinks=True),
        _case("flash_attn_ext", F16, 1, 40, dk=576, dv=512, heads=(2, 1)),
        _case("flash_attn_ext", F16, 5, 37, dk=320, dv=320, heads=(2, 1), softcap=20.0),
        _case("flash_attn_ext", F16, 2, 40, heads=(16, 2)),
        _case("flash_attn_ext", Q5_0, 2, 64, v_type=Q4_1),
        _case("flash_attn_ext", BF16, 1, 37, mask=F32),
        _case("flash_attn_ext", F32, 3, 37, strided_q=True),
        _case("flash_attn_ext", F16, 1, 37, streams=(2, 2), mask=None),
    ]
    _run(cuda, cases)
    made = [k for k in _kernels() if k.key not in before]
    assert _made(made, "flash_attn_combine") and _made(made, "flash_attn_vec", dk=576)
    assert _made(made, "flash_attn_vec", dk=320) and _made(made, "flash_attn_vec", dense=False)
    assert not _made(made, "flash_attn_mma")
    assert_assembles(made, no_spills=True)


def test_soft_max_attn_cases(cuda):
    """soft_max_attn (V transposed) on both kernels: decode (with a split), a prompt on the
    tensor cores, q streams broadcast over one KV stream."""
    before = {k.key for k in _kernels()}
    cases = [
        _case("soft_max_attn", F16, 1, 37, max_bias=8.0, sinks=True),
        _case("soft_max_attn", F16, 1, 300),
        _case("soft_max_attn", F32, 30, 50, dk=80, dv=48, heads=(4, 1)),
        _case("soft_max_attn", F16, 5, 37, streams=(2, 1)),
    ]
    _run(cuda, cases)
    made = [k for k in _kernels() if k.key not in before]
    assert _made(made, "soft_max_attn_vec") and _made(made, "soft_max_attn_combine")
    assert _made(made, "soft_max_attn_mma", dk=80)
    assert_assembles(made, no_spills=True)


def _kernels():
    from llamir_cuda import kir

    return kir.defined_kernels()
