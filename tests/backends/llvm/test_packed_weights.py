"""The process-wide cache of repacked weights: prepare() packs a model's weights on several
threads, and what it packs is what get() returns, bit for bit the serial repack."""

from __future__ import annotations

import numpy as np

from llamir.backends.llvm.kernels.repack import HUGE_PAGE, PackedWeights, repack, weight_format
from llamir.backends.llvm.kernels.repack_k import K_FORMATS
from llamir.ir import dtype_named, quants


def test_prepare_packs_each_missing_weight_once_and_get_returns_it():
    rng = np.random.default_rng(5)
    cache = PackedWeights()
    weights = []
    for name in ("q4_0", "q8_0", "q5_1", "q6_k", "q4_k"):
        for m in (40, 64):
            w = quants.quantize(rng.normal(0, 1, (m, 512)).astype(np.float32), dtype_named(name))
            weights.append((w, K_FORMATS.get(name) or weight_format(name, m)))
    first = cache.get(*weights[0])                 # already packed: prepare leaves it as it is
    cache.prepare(weights)
    assert cache.get(*weights[0]) is first
    for w, fmt in weights:
        got = cache.get(w, fmt)
        assert got is cache.get(w, fmt)            # a hit, not a second packing
        want = repack(w, fmt)
        assert got.shape == want.shape and (got == want).all(), fmt


def test_prepare_gathers_a_models_weights_into_one_huge_page_arena_in_order():
    """A model's weights packed together share one arena on a 2 MiB boundary, in the order
    given, each on a cache line; they stay valid while any of them lives."""
    rng = np.random.default_rng(6)
    cache = PackedWeights()
    weights = [(quants.quantize(rng.normal(0, 1, (m, 1024)).astype(np.float32), dtype_named("q8_0")),
                weight_format("q8_0", m)) for m in (1000, 48, 2000)]       # 2.2 MiB packed in all
    cache.prepare(weights)
    packed = [cache.get(w, fmt) for w, fmt in weights]
    addresses = [p.__array_interface__["data"][0] for p in packed]
    assert addresses[0] % HUGE_PAGE == 0
    assert all(a % 64 == 0 for a in addresses) and addresses == sorted(addresses)
    assert addresses[2] - addresses[0] < sum(p.nbytes for p in packed[:2]) + 128   # one arena, no gaps
    last, fmt = weights.pop()
    del cache, weights, packed[:2]            # the arena outlives the cache and the other weights
    assert (packed[0] == repack(last, fmt)).all()

