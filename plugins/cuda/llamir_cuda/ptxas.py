"""ptxas, NVIDIA's PTX assembler, as an offline check of the generated PTX: does it assemble for
an architecture, and with how many registers, spills, shared and stack bytes.

ptxas is found as LLAMIR_PTXAS, on PATH, under CUDA_HOME / /usr/local/cuda, or in the
`nvidia-cuda-nvcc` wheel (`pip install 'llamir-cuda[ptxas]'`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from llamir_cuda.driver import DriverError


class PtxasError(DriverError):
    """ptxas is missing, or rejected a PTX file (its message is kept)."""


@dataclass(frozen=True)
class PtxasReport:
    """What ptxas -v said of one entry function."""

    function: str
    arch: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    shared_bytes: int

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads

    def line(self) -> str:
        return (f"{self.function:48s} {self.arch:6s} regs {self.registers:3d}  spills {self.spills:4d} B  "
                f"stack {self.stack_bytes:5d} B  smem {self.shared_bytes:6d} B")


def find_ptxas() -> str:
    """The ptxas executable, or PtxasError saying where it was looked for."""
    env = os.environ.get("LLAMIR_PTXAS")
    if env:
        if Path(env).is_file():
            return env
        raise PtxasError(f"LLAMIR_PTXAS={env} is not a file")
    found = shutil.which("ptxas")
    if found:
        return found
    places = [Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "ptxas"]
    try:
        import nvidia  # the nvidia-cuda-nvcc wheel's namespace package

        for root in nvidia.__path__:
            places += sorted(Path(root).glob("cu*/bin/ptxas")) + sorted(Path(root).glob("cuda_nvcc/bin/ptxas"))
    except ImportError:
        pass
    for p in places:
        if p.is_file():
            return str(p)
    raise PtxasError("ptxas not found (set LLAMIR_PTXAS, put it on PATH, or pip install 'llamir-cuda[ptxas]'); "
                     f"looked in: {', '.join(map(str, places))}")


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def assemble(ptx: str, arch: str, ptxas: str | None = None) -> list[PtxasReport]:
    """Assemble `ptx` for `arch` (ptxas -v); one report per entry function."""
    exe = ptxas or find_ptxas()
    with tempfile.TemporaryDirectory(prefix="llamir-ptxas-") as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        proc = subprocess.run([exe, f"-arch={arch}", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
                              capture_output=True, text=True, timeout=300)
    if proc.returncode:
        raise PtxasError(f"ptxas -arch={arch} rejected the PTX:\n{proc.stderr.strip()}")
    return parse_report(proc.stderr + proc.stdout)


def parse_report(text: str) -> list[PtxasReport]:
    reports, current = [], None
    stack = spill_s = spill_l = 0
    for line in text.splitlines():
        m = _ENTRY.search(line)
        if m:
            current, stack, spill_s, spill_l = m.groups(), 0, 0, 0
            continue
        m = _SPILL.search(line)
        if m and current:
            stack, spill_s, spill_l = map(int, m.groups())
            continue
        m = _REGS.search(line)
        if m and current:
            reports.append(PtxasReport(current[0], current[1], int(m.group(1)), spill_s, spill_l, stack,
                                       int(m.group(2) or 0)))
            current = None
    return reports


def check_kernel(kernel, arch: str, ptxas: str | None = None) -> PtxasReport:
    """Assemble one kir kernel for `arch`; its report."""
    reports = assemble(kernel.ptx(arch), arch, ptxas)
    if len(reports) != 1:
        raise PtxasError(f"{kernel.name}: ptxas reported {len(reports)} entry functions")
    return reports[0]


def check_kernels(kernels, archs, ptxas: str | None = None) -> list[PtxasReport]:
    """check_kernel of every kernel for every arch (kernel-major), the assemblies run side by side,
    one ptxas per CPU this process may use; the first rejection raises."""
    exe = ptxas or find_ptxas()
    todo = [(kernel, arch, kernel.ptx(arch)) for kernel in kernels for arch in archs]

    def one(item) -> PtxasReport:
        kernel, arch, text = item
        reports = assemble(text, arch, exe)
        if len(reports) != 1:
            raise PtxasError(f"{kernel.name}: ptxas reported {len(reports)} entry functions")
        return reports[0]

    with ThreadPoolExecutor(max_workers=max(1, min(len(todo), len(os.sched_getaffinity(0))))) as pool:
        return list(pool.map(one, todo))


def tool_version(ptxas: str | None = None) -> str:
    out = subprocess.run([ptxas or find_ptxas(), "--version"], capture_output=True, text=True).stdout
    return out.strip().splitlines()[-1] if out.strip() else "?"


__all__ = ["PtxasError", "PtxasReport", "assemble", "check_kernel", "check_kernels", "find_ptxas", "parse_report",
           "tool_version"]
