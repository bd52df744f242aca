"""What the CUDA plugin's kernel tests share: test-backend-ops on the emulated device, and
ptxas on the PTX of the kernels a run made."""

from __future__ import annotations

from llamir_cuda import kir
from llamir_cuda.ptxas import check_kernel

from llamir.testing.backend_ops import OK, run_backend_ops

ARCHS = ("sm_80", "sm_90")


def run_ops(backend, ops: list[str], min_supported: int = 1):
    """test-backend-ops for `ops`: every case the backend claims passes; returns the kernels the
    run made, and the report."""
    before = {k.key for k in kir.defined_kernels()}
    report = run_backend_ops(backend, ops)
    failures = report.failures
    assert not failures, "\n".join(r.line() for r in failures[:20])
    supported = [r for r in report.results if r.status == OK]
    assert len(supported) >= min_supported, f"only {len(supported)} cases of {ops} ran on cuda"
    return [k for k in kir.defined_kernels() if k.key not in before], report


def assert_assembles(kernels, archs=ARCHS, no_spills: bool = False):
    """Every kernel's PTX assembles with ptxas for each arch (and spills nothing, if asked)."""
    assert kernels, "no kernel was made"
    for kernel in kernels:
        for arch in archs:
            report = check_kernel(kernel, arch)
            if no_spills:
                assert report.spills == 0, report.line()
