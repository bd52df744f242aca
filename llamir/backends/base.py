"""The backend interface, after ggml-backend: Device, BufferType, Buffer, Backend, Event.

A Device describes hardware (type, memory, capabilities) and hands out buffer types and
backends. A BufferType allocates Buffers (byte arrays with an alignment and a usage). A
Backend runs ops: `supports_op`, `supports_buft`, `offload_op`, tensor get/set/copy, events,
and two ways to execute: `compile(graph)` for a whole graph (values by name), and
`graph_compute(split, memory)` for one split of a scheduled graph whose tensors live in
allocated buffers (SplitRun and SplitMemory below; the scheduler's executor implements them).
The default graph_compute goes through compile.

Every call here is synchronous: the "async" methods complete before they return, and events
only count records and waits, which is all a simulated device needs to be observable.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np

from llamir.ir import Graph, Node
from llamir.ir.dims import Bindings


def default_threads() -> int:
    """The thread count a CPU backend uses unless told otherwise: the CPUs this process may run on."""
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class BackendError(RuntimeError):
    """A backend that cannot run what it was asked to; the message names the op or value."""


class Executable(Protocol):
    """A compiled graph: run(leaf values by name, dim bindings) -> outputs by name."""

    def __call__(
        self,
        leaf_values: Mapping[str, np.ndarray],
        bindings: Bindings,
        observe: Callable[[Node, np.ndarray], bool] | None = None,
    ) -> dict[str, np.ndarray]: ...


class SplitMemory(Protocol):
    """The values of one scheduled execution, as a backend's graph_compute sees them (the
    scheduler's executor implements it): read an input, write a result into its slot."""

    def value(self, ref) -> np.ndarray: ...

    def root(self, ref) -> np.ndarray: ...

    def store(self, node: Node, result: np.ndarray) -> np.ndarray: ...

    def set(self, ref, value: np.ndarray, root: np.ndarray) -> None: ...


class SplitRun(Protocol):
    """One split of a scheduled graph: its nodes in order, each node's inputs (copies made for
    this split where its sources live elsewhere), and the compile path every backend may use."""

    @property
    def nodes(self) -> list[Node]: ...

    def inputs_of(self, node: Node) -> tuple: ...

    def is_copy(self, ref) -> bool: ...

    def compute_through_compile(
        self, backend: Backend, memory: SplitMemory, observe: Callable[[Node, np.ndarray], bool] | None = None
    ) -> bool: ...


class DeviceType(enum.Enum):
    """ggml_backend_dev_type: the scheduler wants the CPU last; ACCEL shares host memory."""

    CPU = "cpu"
    GPU = "gpu"
    ACCEL = "accel"


class BufferUsage(enum.Enum):
    ANY = "any"
    WEIGHTS = "weights"
    COMPUTE = "compute"


@dataclass(frozen=True)
class DeviceCaps:
    """ggml_backend_dev_caps."""

    async_: bool = False
    host_buffer: bool = False
    events: bool = False


class BufferType:
    """Allocates buffers on one device. `is_host`: the memory is ordinary host memory, so any
    backend that can read host memory may use it directly (no copy)."""

    def __init__(
        self,
        name: str,
        device: Device | None,
        alignment: int = 32,
        max_size: int | None = None,
        is_host: bool = False,
    ):
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"buffer type {name}: alignment {alignment} is not a power of two")
        self.name = name
        self.device = device
        self.alignment = alignment
        self.max_size = max_size
        self.is_host = is_host

    def alloc_size(self, nbytes: int) -> int:
        """ggml_backend_buft_get_alloc_size: bytes a tensor of `nbytes` takes in this buffer type."""
        return int(nbytes)

    def alloc_buffer(
        self, size: int, usage: BufferUsage = BufferUsage.ANY, materialize: bool = True
    ) -> Buffer:
        return Buffer(self, size, usage, materialize)

    def __repr__(self) -> str:
        return f"<buffer type {self.name}>"


class Buffer:
    """A block of `size` bytes of one buffer type. `data` is a uint8 array (None when the
    buffer only accounts for memory, as for weights that stay in the caller's arrays)."""

    def __init__(
        self, buft: BufferType, size: int, usage: BufferUsage = BufferUsage.ANY, materialize: bool = True
    ):
        self.buft = buft
        self.size = int(size)
        self.usage = usage
        self.data: np.ndarray | None = np.zeros(self.size, dtype=np.uint8) if materialize else None

    @property
    def is_host(self) -> bool:
        return self.buft.is_host

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """The bytes [offset, offset + nbytes) of this buffer; a clear error when out of range."""
        if self.data is None:
            raise BackendError(f"{self.buft.name} buffer of {self.size} bytes holds no data")
        if offset < 0 or offset + nbytes > self.size:
            raise BackendError(
                f"{self.buft.name} buffer: bytes [{offset}, {offset + nbytes}) are outside its "
                f"{self.size} bytes"
            )
        return self.data[offset : offset + nbytes]

    def __repr__(self) -> str:
        return f"<buffer {self.buft.name} {self.size} bytes {self.usage.value}>"


class Event:
    """ggml_backend_event: records on one backend; others may wait for it."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.n_records = 0
        self.n_waits = 0

    def record(self) -> None:
        self.n_records += 1
        self.backend.stats.events_recorded += 1

    def synchronize(self) -> None:
        self.backend.synchronize()

    def wait(self, waiter: Backend) -> None:
        self.n_waits += 1
        waiter.stats.events_waited += 1


class Device:
    """A device: its type, memory, capabilities, buffer types, and the backends it creates."""

    def __init__(
        self,
        name: str,
        type: DeviceType,
        memory_total: int,
        description: str = "",
        caps: DeviceCaps = DeviceCaps(),
        alignment: int = 32,
        host_memory: bool = False,
    ):
        self.name = name
        self.type = type
        self.memory_total = int(memory_total)
        self.description = description or name
        self.caps = caps
        # host_memory: the device computes in host memory (CPU, BLAS-like accelerators)
        self.host_memory = host_memory or type == DeviceType.CPU
        self._buft = BufferType(name, self, alignment=alignment, is_host=self.host_memory)

    @property
    def memory_free(self) -> int:
        return self.memory_total

    def buffer_type(self) -> BufferType:
        return self._buft

    def host_buffer_type(self) -> BufferType | None:
        return None

    def supports_buft(self, buft: BufferType) -> bool:
        """Own buffers, and host memory when the device computes in host memory."""
        return buft is self._buft or (self.host_memory and buft.is_host)

    def __repr__(self) -> str:
        return f"<device {self.name} {self.type.value}>"


CPU_MEMORY = 64 << 30


def cpu_device(name: str = "cpu", description: str = "host CPU (numpy)") -> Device:
    return Device(name, DeviceType.CPU, CPU_MEMORY, description, alignment=32)


@dataclass(frozen=True)
class CostModel:
    """A device's figures for split-plan estimates (llamir.sched.cost): throughput in TFLOP/s,
    memory and host-link bandwidth in GB/s, link latency in us."""

    tflops: float = 50.0
    mem_gbps: float = 1000.0
    link_gbps: float = 25.0
    latency_us: float = 10.0


def op_batch_size(node: Node) -> int:
    """The batch size an offload_op compares with its threshold (ggml-cuda's get_op_batch_size):
    0 for get_rows, ne[1] for mul_mat, ne[2] for mul_mat_id and rope, else the row count."""
    from llamir.ir import ops

    shape = [int(d) for d in node.type.shape]
    ne = list(reversed(shape)) + [1] * (4 - len(shape))
    if node.is_op(ops.GetRows):
        return 0
    if node.is_op(ops.MulMat):
        return ne[1]
    if node.is_op(ops.MulMatId, ops.RopeExt):
        return ne[2]
    return int(math.prod(shape[:-1])) if len(shape) > 1 else 1


@dataclass
class BackendStats:
    """What a backend did: bytes copied in and out, copies, events. Sim devices report these."""

    bytes_in: int = 0
    bytes_out: int = 0
    n_copies_in: int = 0
    n_copies_out: int = 0
    n_graph_computes: int = 0
    n_synchronize: int = 0
    events_recorded: int = 0
    events_waited: int = 0


def op_supported_by_numpy(node: Node) -> bool:
    from llamir.ir.interp_kernels import KERNELS

    return node.is_leaf or node.op.is_view or type(node.op) in KERNELS


class Backend:
    """A device that can run graphs. Subclasses set `name` and implement compile (whole graphs)
    and/or graph_compute (one scheduled split over allocated memory)."""

    name: ClassVar[str] = "?"
    cost_model: CostModel | None = None  # None: the scheduler's CPU figures

    # -- identity -----------------------------------------------------------------------------
    @property
    def device(self) -> Device:
        dev = self.__dict__.get("_device")
        if dev is None:
            dev = self.__dict__["_device"] = cpu_device(self.name)
        return dev

    @device.setter
    def device(self, value: Device) -> None:
        self.__dict__["_device"] = value

    @property
    def label(self) -> str:
        """The name a split plan prints: the device's name (e.g. gpu0, cpu)."""
        return self.device.name

    @property
    def stats(self) -> BackendStats:
        stats = self.__dict__.get("_stats")
        if stats is None:
            stats = self.__dict__["_stats"] = BackendStats()
        return stats

    @property
    def is_cpu(self) -> bool:
        return self.device.type == DeviceType.CPU

    # -- support --------------------------------------------------------------------------------
    def supports_op(self, node: Node) -> bool:
        return True

    def supports_buft(self, buft: BufferType) -> bool:
        return self.device.supports_buft(buft)

    def offload_op(self, node: Node) -> bool:
        """Whether running `node` here is worth copying its host weights over (big batches)."""
        return False

    def unsupported(self, graph: Graph) -> list[Node]:
        return [n for n in graph.nodes if not n.op.is_view and not self.supports_op(n)]

    # -- tensors and synchronization -------------------------------------------------------------
    def set_tensor_async(self, dst: np.ndarray, data: np.ndarray) -> None:
        """Host -> this device: write `data` into the storage array `dst`."""
        np.copyto(dst, data, casting="no")
        self.stats.bytes_in += int(data.nbytes)
        self.stats.n_copies_in += 1

    def get_tensor_async(self, src: np.ndarray) -> np.ndarray:
        """This device -> host: a copy of the storage array `src`."""
        self.stats.bytes_out += int(src.nbytes)
        self.stats.n_copies_out += 1
        return np.array(src, copy=True)

    def cpy_tensor_async(self, src_backend: Backend, src: np.ndarray, dst: np.ndarray) -> bool:
        """Copy from another backend's tensor into ours; False when this backend cannot do it
        directly (the scheduler then goes through the host: get on the source, set here)."""
        return False

    def synchronize(self) -> None:
        self.stats.n_synchronize += 1

    def event_new(self) -> Event | None:
        """An event, or None when the device has no events (the scheduler then synchronizes)."""
        return Event(self) if self.device.caps.events else None

    # -- execution -------------------------------------------------------------------------------
    def compile(self, graph: Graph) -> Executable:
        raise BackendError(f"backend {self.name} cannot compile whole graphs")

    def graph_compute(
        self, run: SplitRun, memory: SplitMemory, observe: Callable[[Node, np.ndarray], bool] | None = None
    ) -> bool:
        """Compute one split: read its inputs from `memory`, write its results there. Returns
        False when `observe` asked to stop. The default compiles the split's subgraph."""
        return run.compute_through_compile(self, memory, observe)

    def __repr__(self) -> str:
        return f"<backend {self.name} on {self.device.name}>"
