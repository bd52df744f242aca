"""What the backend needs of a CUDA driver, as an interface with two implementations:

- `libcuda.LibCuda`: NVIDIA's driver (libcuda.so.1) through ctypes; kernels are loaded as PTX
  the driver JIT-compiles for its GPU.
- `emulator.Emulator`: the same kernels compiled for the host CPU by LLVM and run under a SIMT
  scheduler (one fiber per GPU thread, barriers and warp shuffles honoured), over host memory.
  It is how the kernels and the backend are tested on machines without a GPU.

Device pointers are ints. A stream or event is whatever object the driver returns; the backend
only passes them back. Kernel arguments follow the kernel's signature (`Kernel.params`): "p" a
device pointer, "i" an int32, "l" an int64, "f" a float32.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass

import numpy as np

from llamir.backends import BackendError


class DriverError(BackendError):
    """A driver call failed, or there is no usable driver (the message says which and why)."""


@dataclass(frozen=True)
class DeviceInfo:
    """One GPU as the driver reports it."""

    index: int
    name: str
    compute_capability: tuple[int, int]
    total_memory: int
    multiprocessors: int
    max_shared_per_block: int = 48 << 10
    max_threads_per_block: int = 1024
    warp_size: int = 32

    @property
    def arch(self) -> str:
        """The ptxas/PTX target of this GPU, e.g. sm_90."""
        major, minor = self.compute_capability
        return f"sm_{major}{minor}"


class Driver(abc.ABC):
    """A CUDA driver: the devices it sees, and a context on each."""

    name: str = "?"

    @abc.abstractmethod
    def devices(self) -> list[DeviceInfo]:
        """Every device, in the driver's order (empty when it sees none)."""

    @abc.abstractmethod
    def context(self, index: int) -> DeviceContext:
        """The (primary) context of device `index`, made on first use and shared afterwards."""


class DeviceContext(abc.ABC):
    """Memory, streams, events, modules and launches on one device. Every *_async call is
    ordered on its stream; `stream=None` is the context's default stream."""

    info: DeviceInfo

    # -- memory ----------------------------------------------------------------------------------
    @abc.abstractmethod
    def alloc(self, nbytes: int) -> int:
        """`nbytes` of device memory (at least 256-byte aligned): its device pointer."""

    @abc.abstractmethod
    def free(self, ptr: int) -> None: ...

    @abc.abstractmethod
    def alloc_host(self, nbytes: int) -> np.ndarray:
        """Page-locked host memory as a uint8 array (staging for async copies); freed with
        `free_host` of the same array."""

    @abc.abstractmethod
    def free_host(self, array: np.ndarray) -> None: ...

    @abc.abstractmethod
    def memcpy_htod_async(self, dst: int, src: np.ndarray, stream=None) -> None:
        """Host -> device: all of the C-contiguous `src` to `dst`. `src` must stay alive and
        unchanged until the stream reaches the copy (pinned memory makes it truly async)."""

    @abc.abstractmethod
    def memcpy_dtoh_async(self, dst: np.ndarray, src: int, stream=None) -> None:
        """Device -> host: `dst.nbytes` bytes from `src` into the C-contiguous `dst`."""

    @abc.abstractmethod
    def memcpy_dtod_async(self, dst: int, src: int, nbytes: int, stream=None) -> None: ...

    @abc.abstractmethod
    def memset_async(self, dst: int, value: int, nbytes: int, stream=None) -> None:
        """Every byte of [dst, dst + nbytes) set to `value`."""

    # -- kernels ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def load(self, kernel) -> object:
        """A launchable function for a `kernels.Kernel` (cached by the kernel's key)."""

    @abc.abstractmethod
    def launch(self, function, grid: tuple[int, int, int], block: tuple[int, int, int],
               args: list, stream=None) -> None:
        """Launch `function` over `grid` blocks of `block` threads with `args` (one value per
        entry of the kernel's signature)."""

    # -- streams and events ----------------------------------------------------------------------
    @abc.abstractmethod
    def stream_new(self) -> object: ...

    @abc.abstractmethod
    def stream_synchronize(self, stream=None) -> None: ...

    @abc.abstractmethod
    def event_new(self, timing: bool = False) -> object:
        """An event; with `timing`, one whose records `event_elapsed` can measure between."""

    def event_elapsed(self, start, end) -> float:
        """Seconds between the records of two timing events, once `end`'s has completed."""
        raise DriverError(f"{type(self).__name__} has no timing events")

    @abc.abstractmethod
    def event_record(self, event, stream=None) -> None: ...

    @abc.abstractmethod
    def event_synchronize(self, event) -> None: ...

    @abc.abstractmethod
    def stream_wait_event(self, stream, event) -> None: ...

    # -- CUDA graphs (optional) ------------------------------------------------------------------
    supports_graphs: bool = False

    def begin_capture(self, stream) -> None:
        raise DriverError(f"{type(self).__name__} has no CUDA graphs")

    def end_capture(self, stream) -> object:
        """The captured work as an executable graph."""
        raise DriverError(f"{type(self).__name__} has no CUDA graphs")

    def graph_launch(self, graph, stream=None) -> None:
        raise DriverError(f"{type(self).__name__} has no CUDA graphs")

    def graph_free(self, graph) -> None:  # noqa: B027 - nothing to release without graphs
        pass


class HostEvent:
    """An event of an ImmediateStreams context: when it was last recorded, by the host's clock."""

    time: float = 0.0


class ImmediateStreams:
    """Streams and events of a context whose copies and launches complete when called (the
    emulator, the recorder): everything is already in order, so there is nothing to wait for,
    and an event's time is the host's when it is recorded."""

    def stream_new(self) -> object:
        return object()

    def stream_synchronize(self, stream=None) -> None:
        pass

    def event_new(self, timing: bool = False) -> HostEvent:
        return HostEvent()

    def event_record(self, event: HostEvent, stream=None) -> None:
        event.time = time.perf_counter()

    def event_elapsed(self, start: HostEvent, end: HostEvent) -> float:
        return end.time - start.time

    def event_synchronize(self, event) -> None:
        pass

    def stream_wait_event(self, stream, event) -> None:
        pass
