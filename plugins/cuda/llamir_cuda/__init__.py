"""llamir's CUDA backend: kernels written once over llvmlite (kir.py), printed as PTX by LLVM's
NVPTX target for NVIDIA's driver, or compiled for the host and run by a SIMT emulator.

    pip install -e plugins/cuda             # needs nothing but llamir; a GPU needs NVIDIA's driver
    llamir backends                         # lists cuda and its devices (or why not usable)
    llamir test-backend-ops -b cuda
    llamir run MODEL --device cuda -ngl 99 --temp 0
    python -m llamir_cuda emit-ptx MODEL --arch sm_90 --out DIR

LLAMIR_CUDA_DRIVER picks the driver: unset or "libcuda" for NVIDIA's (libcuda.so.1, or the file
LLAMIR_CUDA_LIBRARY names), "emulator" for the host emulator (one device, slow, exact to the
kernels: what the tests run on machines without a GPU). docs/cuda.md has the rest.
"""

from __future__ import annotations

import os

from llamir.backends import Backend, BackendReg, Device, DeviceType, Option, parse_bool

DRIVERS = ("libcuda", "emulator")


class CudaReg(BackendReg):
    """The CUDA devices of this machine. Nothing is loaded until the devices are asked for; a
    machine without a driver or a GPU gets one device that says why it is not usable."""

    name = "cuda"
    description = "CUDA kernels (llvmlite NVPTX -> PTX) through libcuda, or the host SIMT emulator"
    options = {"offload": Option("offload_batch", int, "op_offload batch threshold (default 32)"),
               "graphs": Option("graphs", parse_bool, "capture recurring launch sequences as CUDA graphs (default on)")}

    def __init__(self):
        self._devices: list[Device] | None = None

    def devices(self) -> list[Device]:
        if self._devices is None:
            self._devices = _discover()
        return list(self._devices)

    def init_backend(self, device: Device, **options) -> Backend:
        from llamir_cuda.backend import CudaBackend

        return CudaBackend(device, **options)


def driver_name() -> str:
    name = os.environ.get("LLAMIR_CUDA_DRIVER", "") or "libcuda"
    if name not in DRIVERS:
        raise ValueError(f"LLAMIR_CUDA_DRIVER must be one of {', '.join(DRIVERS)}, got {name!r}")
    return name


def _discover() -> list[Device]:
    from llamir_cuda.backend import CudaDevice
    from llamir_cuda.driver import DriverError

    try:
        if driver_name() == "emulator":
            from llamir_cuda.emulator import shared_emulator

            driver = shared_emulator()
        else:
            from llamir_cuda.libcuda import LibCuda

            driver = LibCuda()
        infos = driver.devices()
    except (DriverError, ValueError, OSError) as err:
        return [Device("cuda0", DeviceType.GPU, 0, "no CUDA device", unusable=str(err))]
    if not infos:
        return [Device("cuda0", DeviceType.GPU, 0, "no CUDA device",
                       unusable=f"the {driver.name} driver sees no CUDA device")]
    return [CudaDevice(driver, info) for info in infos]


__all__ = ["CudaReg", "driver_name"]
