"""What the CUDA plugin's kernel tests share: test-backend-ops on the emulated device, and
ptxas on the PTX of the kernels a run made."""

from __future__ import annotations

import contextlib
from unittest import mock

from llamir_cuda import kir
from llamir_cuda.lowering import Lowering
from llamir_cuda.ptxas import check_kernels

from llamir.testing.backend_ops import OK, run_backend_ops

ARCHS = ("sm_80", "sm_90")


@contextlib.contextmanager
def recording_launches():
    """The kernels the lowerings inside the `with` launch, by key (kernels are made once per
    process, so this sees the ones a run uses whichever test made them first)."""
    kernels: dict[tuple, kir.Kernel] = {}
    launch = Lowering.launch

    def record(self, kernel, grid, args, name=""):
        kernels.setdefault(kernel.key, kernel)
        return launch(self, kernel, grid, args, name)

    with mock.patch.object(Lowering, "launch", record):
        yield kernels


def run_ops(backend, ops: list[str], min_supported: int = 1):
    """test-backend-ops for `ops`: every case the backend claims passes; returns the kernels the
    run launched, and the report."""
    with recording_launches() as launched:
        report = run_backend_ops(backend, ops)
    failures = report.failures
    assert not failures, "\n".join(r.line() for r in failures[:20])
    supported = [r for r in report.results if r.status == OK]
    assert len(supported) >= min_supported, f"only {len(supported)} cases of {ops} ran on cuda"
    return list(launched.values()), report


def assert_assembles(kernels, archs=ARCHS, no_spills: bool = False):
    """Every kernel's PTX assembles with ptxas for each arch (and spills nothing, if asked)."""
    assert kernels, "no kernel was made"
    for report in check_kernels(kernels, archs):
        if no_spills:
            assert report.spills == 0, report.line()
