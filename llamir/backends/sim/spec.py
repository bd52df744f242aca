"""The text spec of a simulated device: `sim:NAME[:KEY=VALUE]...`.

    sim:gpu0                                  every op, 24 GiB, GPU-like defaults
    sim:gpu0:ops=mul_mat,add,rms_norm:mem=2GiB
    sim:gpu1:ops=all,-soft_max_ext:types=f32,f16,q8_0:offload=off
    sim:blas:ops=mul_mat:host=yes:offload=32  an accelerator that computes in host memory

Keys (each at most once):
  ops=LIST      op names it runs; `all`; `-name` removes one (views always run)
  types=LIST    dtypes it accepts for float/quantized inputs and results (ints always pass)
  mem=SIZE      device memory: 512MiB, 2GiB, 1.5GB, 1000000 (bytes)
  offload=N|off op_offload: claim ops with host weights at a batch of N or more (default 32)
  tflops=X      compute throughput, TFLOP/s (default 50)
  bw=X          memory bandwidth, GB/s (default 1000)
  link=X        host link bandwidth, GB/s (default 25)
  latency=X     host link latency per copy, microseconds (default 10)
  host=yes|no   computes in host memory: uses CPU buffers directly, no copies (default no)
  events=yes|no, async=yes|no   capabilities the scheduler may use (default yes)
  align=N       buffer alignment in bytes, a power of two (default 128)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from llamir.backends.base import CostModel
from llamir.backends.registry import SpecError, parse_bool
from llamir.ir.dtypes import dtype_named
from llamir.ir.ops import OPS

DEFAULT_MEM = 24 << 30
DEFAULT_OFFLOAD_BATCH = 32
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?", re.IGNORECASE)
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
KEYS = (
    "ops",
    "types",
    "mem",
    "offload",
    "tflops",
    "bw",
    "link",
    "latency",
    "host",
    "events",
    "async",
    "align",
)


@dataclass(frozen=True)
class SimSpec:
    """A simulated device. `ops` None means every op; `types` None means every dtype."""

    name: str = "sim"
    ops: frozenset[str] | None = None
    types: frozenset[str] | None = None
    mem: int = DEFAULT_MEM
    offload_batch: int | None = DEFAULT_OFFLOAD_BATCH
    host: bool = False
    events: bool = True
    async_: bool = True
    align: int = 128
    cost: CostModel = field(default_factory=CostModel)

    def describe(self) -> str:
        ops = "all" if self.ops is None else ",".join(sorted(self.ops))
        parts = [
            f"sim:{self.name}",
            f"ops={ops}",
            f"mem={format_size(self.mem)}",
            f"offload={self.offload_batch if self.offload_batch is not None else 'off'}",
        ]
        if self.types is not None:
            parts.insert(2, "types=" + ",".join(sorted(self.types)))
        if self.host:
            parts.append("host=yes")
        return ":".join(parts)


def format_size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def parse_size(text: str) -> int:
    m = _SIZE.fullmatch(text.strip())
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 512MiB, 2GiB, 1.5GB, 1000000)")
    unit = (m.group(2) or "b").lower()
    return int(float(m.group(1)) * _UNITS[unit])


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"must be > 0, got {text!r}")
    return value


def parse_ops(text: str) -> frozenset[str] | None:
    """`all`, names, and `-name` removals -> the op-name set (None for all)."""
    chosen: set[str] | None = set()
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        if item == "all":
            chosen = None
            continue
        name = item[1:] if item.startswith("-") else item
        if name not in OPS or name == "leaf":
            raise ValueError(
                f"unknown op {name!r} (known: {', '.join(sorted(o for o in OPS if o != 'leaf'))})"
            )
        if item.startswith("-"):
            chosen = (set(OPS) - {"leaf"} if chosen is None else chosen) - {name}
        elif chosen is not None:
            chosen.add(name)
    return None if chosen is None else frozenset(chosen)


def parse_types(text: str) -> frozenset[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    for name in names:
        dtype_named(name)  # raises with the known names
    return frozenset(names)


def parse_sim_spec(text: str) -> SimSpec:
    """`sim:NAME[:KEY=VALUE]...` -> SimSpec; SpecError names the part that is wrong."""
    parts = text.split(":")
    if parts[0] != "sim":
        raise SpecError(f"device spec {text!r}: a simulated device starts with 'sim:'")
    if len(parts) < 2 or not parts[1]:
        raise SpecError(f"device spec {text!r}: missing device name (sim:NAME, e.g. sim:gpu0)")
    name = parts[1]
    if not _NAME.fullmatch(name) or name.lower() in ("cpu", "numpy"):
        raise SpecError(f"device spec {text!r}: invalid device name {name!r}")
    spec, cost, seen = SimSpec(name=name), {}, set()
    for part in parts[2:]:
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in KEYS:
            raise SpecError(
                f"device spec {text!r}: {part!r} is not KEY=VALUE with KEY one of {', '.join(KEYS)}"
            )
        if key in seen:
            raise SpecError(f"device spec {text!r}: {key} given twice")
        seen.add(key)
        try:
            spec, cost = _apply(spec, cost, key, value.strip())
        except ValueError as err:
            raise SpecError(f"device spec {text!r}: {key}: {err}") from None
    return replace(spec, cost=replace(spec.cost, **cost)) if cost else spec


def _apply(spec: SimSpec, cost: dict, key: str, value: str) -> tuple[SimSpec, dict]:
    if key == "ops":
        return replace(spec, ops=parse_ops(value)), cost
    if key == "types":
        return replace(spec, types=parse_types(value)), cost
    if key == "mem":
        return replace(spec, mem=parse_size(value)), cost
    if key == "offload":
        if value.lower() in ("off", "no", "never"):
            return replace(spec, offload_batch=None), cost
        n = int(value)
        if n < 0:
            raise ValueError(f"batch threshold must be >= 0, got {n}")
        return replace(spec, offload_batch=n), cost
    if key in ("host", "events", "async"):
        field_name = {"async": "async_"}.get(key, key)
        return replace(spec, **{field_name: parse_bool(value)}), cost
    if key == "align":
        n = int(value)
        if n <= 0 or n & (n - 1):
            raise ValueError(f"must be a power of two, got {n}")
        return replace(spec, align=n), cost
    cost_field = {"tflops": "tflops", "bw": "mem_gbps", "link": "link_gbps", "latency": "latency_us"}[key]
    return spec, {**cost, cost_field: _positive(value)}
