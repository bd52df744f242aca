"""The host target: LLVM initialisation, the CPU and its features (AMX stripped), the vector
width kernels are written for, and the target machine that emits their object code."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import llvmlite
import llvmlite.binding as llvm

# AMX tile instructions trap in sandboxed hosts that still advertise them; kernels never need them.
_NEVER = ("amx",)
# What an AVX2 + FMA + F16C machine (AMD Zen 3) lacks that LLVM would select on its own: AVX-512 and
# AVX10 (which implies it), VEX VNNI (LLVM folds pmaddwd + add into vpdpwssd), GFNI (byte shifts
# become gf2p8affineqb), and the newer VEX integer extensions.
AVX2_ONLY_DROPS = ("avx512", "avx10", "avxvnni", "avxifma", "avxneconvert", "gfni")


@functools.cache
def init_llvm() -> None:
    """Initialise LLVM's native target once per process."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()


@dataclass(frozen=True)
class Target:
    """What the generated code may use. `features` is LLVM's +/- list without AMX."""

    triple: str
    cpu: str
    features: str

    @functools.cached_property
    def feature_set(self) -> frozenset[str]:
        """The enabled features (kept: support predicates ask for them per node)."""
        return frozenset(f[1:] for f in self.features.split(",") if f.startswith("+"))

    def has(self, feature: str) -> bool:
        return feature in self.feature_set

    @property
    def avx512(self) -> bool:
        return self.has("avx512f") and self.has("avx512bw") and self.has("avx512vl") and self.has("avx512dq")

    @property
    def vnni(self) -> bool:
        """Byte dot products (vpdpbusd) on 256-bit vectors: AVX512-VNNI+VL, or AVX-VNNI."""
        return (self.has("avx512vnni") and self.has("avx512vl")) or self.has("avxvnni")

    @property
    def vnni512(self) -> bool:
        return self.has("avx512vnni") and self.avx512

    @property
    def f16c(self) -> bool:
        return self.has("f16c") or self.avx512

    @property
    def fma(self) -> bool:
        return self.has("fma")

    @property
    def lanes(self) -> int:
        """f32 lanes of the widest vector the kernels use."""
        return 16 if self.avx512 else 8

    @property
    def prefetch_distance(self) -> int:
        """How far ahead of its reads (bytes) a kernel streaming weights prefetches: about what one
        core reads in a DRAM latency (token generation reads each weight once, from DRAM when the
        weights exceed the L3). Measured per CPU family, two threads on the 110M and 1B bench
        models: 1 KiB on Intel (Emerald Rapids: large-q4_0 28.8 -> 21.4 ms a token against no
        prefetch; 2 KiB no better), 4 KiB on AMD Zen (Zen 5: big-q6_k 2.6 -> 2.2 ms a token
        against 1 KiB, big-q4_0 9% and big-q4_k 5% faster). Part of the code a target gets,
        so it follows from `cpu`, which is in `key`."""
        return 4096 if self.cpu.startswith("znver") else 1024

    @property
    def key(self) -> str:
        """Identifies the code this target gets: part of every compile-cache key."""
        text = f"{self.triple}|{self.cpu}|{self.features}|llvmlite {llvmlite.__version__}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def machine(self, opt: int = 3) -> llvm.TargetMachine:
        """LLVM's target machine; `opt` is the code generator's level (0: fast instruction
        selection, for code whose speed does not matter)."""
        init_llvm()
        target = llvm.Target.from_triple(self.triple)
        return target.create_target_machine(cpu=self.cpu, features=self.features, opt=opt, reloc="pic",
                                            codemodel="jitdefault")

    def describe(self) -> str:
        isa = "avx512" if self.avx512 else ("avx2" if self.has("avx2") else "baseline")
        extra = "+vnni" if self.vnni else ""
        return f"{self.cpu} {isa}{extra}"


def strip_features(features: dict[str, bool], drop: tuple[str, ...] = _NEVER) -> str:
    """LLVM's feature string from a {name: enabled} map, with every `drop` prefix disabled."""
    parts = []
    for name in sorted(features):
        enabled = features[name] and not name.startswith(drop)
        parts.append(("+" if enabled else "-") + name)
    return ",".join(parts)


@functools.cache
def host_target() -> Target:
    """The machine this process runs on."""
    init_llvm()
    features = dict(llvm.get_host_cpu_features().items())
    return Target(llvm.get_process_triple(), llvm.get_host_cpu_name(), strip_features(features))


def restricted_target(base: Target, disable: tuple[str, ...], cpu: str = "x86-64-v3") -> Target:
    """`base` with the features starting with any of `disable` turned off (e.g. ("avx512",) to
    test the AVX2 code paths on an AVX-512 host), tuned for `cpu` (LLVM's scheduling model and
    Target.prefetch_distance; the generic x86-64-v3 unless the CPU emulated is known). Dropping
    avx512 drops AVX10 too, which implies it."""
    features = {f[1:]: f.startswith("+") for f in base.features.split(",") if f}
    drop = tuple(disable) + (("avx10",) if any(d.startswith("avx512") for d in disable) else ())
    return Target(base.triple, base.cpu if not disable else cpu, strip_features(features, _NEVER + drop))


def avx2_only_target(base: Target | None = None) -> Target:
    """An AVX2-only machine (AMD Zen 3: AVX2, FMA, F16C) emulated on `base` (default the host):
    tuned as LLVM tunes for a Zen 3 host (`znver3`), with Zen's prefetch distance. Generic
    x86-64-v3 tuning made the emulated Zen 3 slower than it is: its 1 KiB distance left Zen 5's
    AVX2 token generation 10-25% behind (big-q6_k 2.9 -> 2.2-2.7 ms, big-q8_0 3.2 -> 2.7 ms)."""
    return restricted_target(base or host_target(), AVX2_ONLY_DROPS, cpu="znver3")
