"""The CUDA plugin's tests run on the emulated device (tests/conftest.py picks the driver); the
tests marked `gpu` run on a real GPU through NVIDIA's driver, and skip where there is none."""

from __future__ import annotations

import os

import pytest

from llamir.backends import get_backend, get_registry

# "emulator": the `gpu` model tests run on the emulator instead, to try them (and fill the PTX
# cache's kernel list) on a machine without a GPU; see bench/gpu_check_cuda.py
GPU_TESTS_DRIVER = "LLAMIR_CUDA_GPU_TESTS"


@pytest.fixture(scope="session")
def cuda():
    device = get_registry("cuda").devices()[0]
    assert not device.unusable, f"the CUDA device is not usable: {device.unusable}"
    return get_backend("cuda")


@pytest.fixture(scope="session")
def gpu_backend():
    """A CUDA backend on the first GPU of NVIDIA's driver, whatever LLAMIR_CUDA_DRIVER picks for
    the rest of the suite; skips without a usable driver or GPU."""
    from llamir_cuda.backend import CudaBackend, CudaDevice
    from llamir_cuda.driver import DriverError

    if os.environ.get(GPU_TESTS_DRIVER) == "emulator":
        from llamir_cuda.emulator import shared_emulator

        driver = shared_emulator()
    else:
        from llamir_cuda.libcuda import LibCuda

        try:
            driver = LibCuda()
        except DriverError as err:
            pytest.skip(f"no usable CUDA driver: {err}")
    infos = driver.devices()
    if not infos:
        pytest.skip("the CUDA driver sees no device")
    backend = CudaBackend(CudaDevice(driver, infos[0]))
    yield backend
    backend.close()
