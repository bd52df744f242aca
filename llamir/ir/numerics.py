"""Numerics profiles: which x86 build of ggml's CPU backend the arithmetic reproduces.

ggml picks its float kernels at compile time from the ISA it is built for, and the two builds
llama.cpp makes on the project's machines round differently in the last bits:

- `avx512` (GGML_AVX512 + VNNI + BF16, the Intel build): 16-lane GGML_F32/F16 vectors
  (GGML_F32_STEP 64), the AVX512F ggml_v_expf (vscalefps), _mm512_reduce_add_ps, tinyBLAS
  with 16-lane tiles, vdpbf16ps for bf16 dots, and CPU_REPACK q2_K_8x8 weights;
- `avx2` (AVX2 + FMA + F16C, the AMD Zen 3 build): 8-lane vectors (GGML_F32_STEP 32), the
  AVX2 ggml_v_expf (exponent bits added by integer arithmetic), 128-bit horizontal sums,
  tinyBLAS with 8-lane tiles, bf16 dots through f32 fma, and q2_K weights left unpacked.

Integer dot products (the quantized types) give the same bits in both. A profile is a plain
value: the numpy reference follows it on any host, and the LLVM backend emits its order with
whatever vectors the host has, so either profile can be checked on either machine.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Numerics:
    """One build's observable float arithmetic."""

    name: str
    lanes: int             # GGML_F32_EPR: floats per vector
    bf16_dot: bool         # vdpbf16ps (AVX512_BF16): pairs of bf16 products per lane
    repack_q2_k: bool      # q2_K weights go to the CPU_REPACK q2_K_8x8 kernels (AVX-512 builds)
    fused_tail: int        # ggml_vec_dot_f32's leftovers as GCC compiles them: the products of whole
                           # vector groups are rounded, the scalar last K % fused_tail are fmas

    @property
    def step(self) -> int:
        """GGML_F32_STEP: the four accumulators of ggml_vec_dot_f32/f16 cover this many values."""
        return 4 * self.lanes

    def __str__(self) -> str:
        return self.name


AVX512 = Numerics("avx512", lanes=16, bf16_dot=True, repack_q2_k=True, fused_tail=8)
AVX2 = Numerics("avx2", lanes=8, bf16_dot=False, repack_q2_k=False, fused_tail=4)
PROFILES: dict[str, Numerics] = {p.name: p for p in (AVX512, AVX2)}


def numerics_named(profile: str | Numerics | None) -> Numerics:
    """A profile from its name (None: the host's, see host_numerics); a clear error otherwise."""
    if profile is None:
        return host_numerics()
    if isinstance(profile, Numerics):
        return profile
    try:
        return PROFILES[profile]
    except KeyError:
        raise ValueError(f"unknown numerics profile {profile!r}; choose one of {', '.join(PROFILES)}") from None


@functools.cache
def host_numerics() -> Numerics:
    """The default profile: $LLAMIR_NUMERICS when set (for a llama.cpp built for another CPU),
    else the build llama.cpp makes for this CPU: GGML_AVX512 is on when the CPU has AVX-512F (as
    .ci/run and llama.cpp's native build decide), AVX2 otherwise."""
    chosen = os.environ.get("LLAMIR_NUMERICS", "").strip()
    if chosen:
        if chosen not in PROFILES:
            raise ValueError(f"LLAMIR_NUMERICS={chosen!r} is not a numerics profile; "
                             f"choose one of {', '.join(PROFILES)}")
        return PROFILES[chosen]
    return AVX512 if "avx512f" in _cpu_flags() else AVX2


def _cpu_flags() -> frozenset[str]:
    path = "/proc/cpuinfo"
    if not os.path.exists(path):
        return frozenset()
    with open(path) as f:
        for line in f:
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    return frozenset()
