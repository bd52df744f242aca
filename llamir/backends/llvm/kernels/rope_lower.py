"""Lowering of rope_ext: one shared cos/sin cache per distinct (positions, parameters)."""

from __future__ import annotations

from llamir.backends.llvm import expr as E
from llamir.backends.llvm.kernels.rope import Rope, RopeCache
from llamir.backends.llvm.lowering import Lowerer, lowering
from llamir.backends.llvm.plan import Part
from llamir.ir import Node, ops


def _ok(node: Node, target) -> bool:
    return node.inputs[0].dtype.name in ("f32", "f16") and node.dtype.name in ("f32", "f16")


@lowering(ops.RopeExt, supports=_ok)
def lower_rope(L: Lowerer, node: Node) -> None:
    op = node.op
    x = L.ref(node.inputs[0])
    pos = L.ref(node.inputs[1])
    factors = L.ref(node.inputs[2]) if op.freq_factors else None
    n_tokens = pos.shape[0]
    half = op.n_dims // 2
    key = ("rope", id(node.inputs[1]), id(node.inputs[2]) if factors else None, op.n_dims, op.freq_base,
           op.freq_scale, op.ext_factor, op.attn_factor, op.beta_fast, op.beta_slow, op.n_ctx_orig)
    cache = L.cache.get(key)
    cache_part = None
    if cache is None:
        cache = L.scratch(E.mul(n_tokens, half * 8), "rope_cache")
        cache_part = Part(cache, 0, half * 8, n_tokens)
        ins = [pos] + ([factors] if factors else [])
        L.step(RopeCache(op, n_tokens, factors is not None), [(cache, 0)] + ins, ins, [cache], cache_part)
        L.cache[key] = cache
    cache_part = Part(cache, 0, half * 8, n_tokens)
    out = L.out(node)
    xp = x.padded()
    units = E.mul(xp.shape[0], xp.shape[1])
    part = Part(out.buf, out.offset, E.mul(E.prod(out.shape[-2:]), out.dtype.type_size), units) \
        if out.is_contiguous else None
    read_parts = [cache_part if xp.shape[0] == 1 else None]
    x_part = Part(x.buf, x.offset, E.mul(E.prod(x.shape[-2:]), x.dtype.type_size), units) if x.is_contiguous else None
    L.step(Rope(op, out, x), [out, x, (cache, 0)], [x, cache], [out], part, read_parts + [x_part])
