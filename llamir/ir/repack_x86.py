"""Which weights ggml's CPU backend repacks on x86 (the CPU_REPACK buffer type), per numerics profile.

llama.cpp puts a weight into CPU_REPACK when the buffer type supports its matmul, which is when
ggml_repack_get_optimal_repack_type (ggml-cpu/repack.cpp) finds a layout for it. On x86:
q4_0_8x8 (AVX2) and q4_K_8x8 (AVX2) for Q4_0 and Q4_K, q2_K_8x8 for Q2_K only in builds with
AVX-512 (`ggml_cpu_has_avx512()`), each when the weight's row count is a multiple of 8. KV caches
and other computed operands are never repacked.
"""

from __future__ import annotations

from llamir.ir.dtypes import Q2_K, Q4_0, Q4_K, DType
from llamir.ir.numerics import Numerics

_LAYOUTS = {Q4_0.name: "q4_0_8x8_q8_0", Q4_K.name: "q4_K_8x8_q8_K", Q2_K.name: "q2_K_8x8_q8_K"}


def repack_type(dtype: DType, m_rows: int, numerics: Numerics) -> str | None:
    """ggml's repacked layout for a weight of `dtype` with `m_rows` rows (ne[1]), or None."""
    layout = _LAYOUTS.get(dtype.name)
    if layout is None or m_rows % 8:
        return None
    if dtype == Q2_K and not numerics.repack_q2_k:
        return None
    return layout
