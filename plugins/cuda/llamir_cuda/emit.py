"""The PTX of every kernel a model's decode graphs need, found by running them: a llamir
Context with every layer on a CUDA device whose driver only records (memory is address space,
copies and launches are noted, nothing computes), decoding a prompt of n_ubatch tokens and
then one token, with flash attention on and off. Each kernel it loads is one PTX file.

    python -m llamir_cuda emit-ptx MODEL --arch sm_90 --out DIR [--ptxas]
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from llamir_cuda import kir
from llamir_cuda.driver import DeviceContext, DeviceInfo, Driver, DriverError, ImmediateStreams

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")


class RecordingDriver(Driver):
    """One device of the given architecture that computes nothing: what the backend loads and
    launches on it is recorded."""

    name = "recorder"

    def __init__(self, arch: str = "sm_90", memory: int = 1 << 40):
        if arch not in ARCHS:
            raise DriverError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")
        major, minor = int(arch[3]), int(arch[4:])
        self.info = DeviceInfo(0, f"recorder ({arch})", (major, minor), memory, 132)
        self._context = RecordingContext(self.info)

    def devices(self) -> list[DeviceInfo]:
        return [self.info]

    def context(self, index: int) -> RecordingContext:
        return self._context


@dataclass
class RecordingContext(ImmediateStreams, DeviceContext):
    info: DeviceInfo
    kernels: dict[tuple, kir.Kernel] = field(default_factory=dict)
    launches: list[tuple[str, tuple]] = field(default_factory=list)
    _next: itertools.count = field(default_factory=lambda: itertools.count(1))

    def alloc(self, nbytes: int) -> int:
        return next(self._next) << 40  # disjoint, aligned, never dereferenced

    def free(self, ptr: int) -> None:
        pass

    def alloc_host(self, nbytes: int) -> np.ndarray:
        return np.zeros(int(nbytes), np.uint8)

    def free_host(self, array: np.ndarray) -> None:
        pass

    def memcpy_htod_async(self, dst: int, src: np.ndarray, stream=None) -> None:
        pass

    def memcpy_dtoh_async(self, dst: np.ndarray, src: int, stream=None) -> None:
        dst[...] = 0

    def memcpy_dtod_async(self, dst: int, src: int, nbytes: int, stream=None) -> None:
        pass

    def memset_async(self, dst: int, value: int, nbytes: int, stream=None) -> None:
        pass

    def load(self, kernel: kir.Kernel) -> kir.Kernel:
        self.kernels.setdefault(kernel.key, kernel)
        return kernel

    def launch(self, function, grid, block, args, stream=None) -> None:
        if len(args) != len(function.params):
            raise DriverError(f"{function.name} takes {len(function.params)} arguments, got {len(args)}")
        self.launches.append((function.name, tuple(grid)))



def model_kernels(model_path: str | Path, arch: str = "sm_90", n_ubatch: int = 512,
                  flash_attn: tuple[str, ...] = ("on", "off")) -> list[kir.Kernel]:
    """The kernels of `model_path`'s decode graphs on one `arch` device holding every layer."""
    import llamir
    from llamir_cuda.backend import CudaBackend, CudaDevice

    model = llamir.load_model(model_path)
    driver = RecordingDriver(arch)
    found: dict[tuple, kir.Kernel] = {}
    for fa in flash_attn:
        backend = CudaBackend(CudaDevice(driver, driver.info))
        ctx = llamir.Context(model, n_ctx=2 * n_ubatch, n_batch=n_ubatch, n_ubatch=n_ubatch, flash_attn=fa,
                             devices=[backend], placement=llamir.PlacementParams(n_gpu_layers=-1))
        vocab = model.hparams.n_vocab
        prompt = [int(t) % vocab for t in range(1, n_ubatch + 1)]
        for batch in (llamir.Batch.from_tokens(prompt), llamir.Batch.from_tokens([1], pos0=n_ubatch)):
            if ctx.decode(batch) != 0:
                raise DriverError(f"decode failed while recording {model_path}: {ctx.last_error}")
        backend.close()
        found.update(driver.context(0).kernels)
    return sorted(found.values(), key=lambda k: k.name)


def emit_ptx(model_path: str | Path, arch: str, out: str | Path, check: bool = False,
             n_ubatch: int = 512) -> list[dict]:
    """Write one PTX file per kernel into `out` (and index.json); with `check`, assemble each
    with ptxas for `arch` and record its registers and spills."""
    from llamir_cuda.ptxas import check_kernels

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    kernels = model_kernels(model_path, arch, n_ubatch)
    rows = []
    for kernel in kernels:
        path = out / f"{kernel.name}.ptx"
        path.write_text(kernel.ptx(arch))
        rows.append({"kernel": kernel.name, "file": path.name, "block": list(kernel.block), "key": repr(kernel.key)})
    if check:
        for row, r in zip(rows, check_kernels(kernels, [arch]), strict=True):
            row.update(registers=r.registers, spill_stores=r.spill_stores, spill_loads=r.spill_loads,
                       stack_bytes=r.stack_bytes, shared_bytes=r.shared_bytes)
    (out / "index.json").write_text(json.dumps({"model": str(model_path), "arch": arch, "kernels": rows}, indent=1))
    return rows
