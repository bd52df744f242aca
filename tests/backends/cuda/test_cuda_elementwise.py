"""The CUDA plugin's element-wise kernels on the emulated device, against the numpy reference
(test-backend-ops), and their PTX through ptxas."""

from __future__ import annotations

from cuda_common import assert_assembles, run_ops


def test_binary(cuda):
    kernels, _ = run_ops(cuda, ["add", "sub", "mul", "div"], min_supported=40)
    assert_assembles(kernels, no_spills=True)
