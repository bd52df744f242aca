"""The backend interface, after ggml-backend: Device, BufferType, Buffer, TensorData, Backend, Event.

A Device describes hardware (type, memory, capabilities, whether it is usable) and hands out its
buffer type. A BufferType allocates Buffers: opaque device memory behind set/get bytes, copy and
clear (HostBuffer is host memory with zero-copy numpy views). TensorData says where a tensor's
bytes are in a buffer. A Backend (an ABC: a device and `supports_op` are required) runs ops,
with optional hooks (`supports_buft`, `offload_op`, `cost_model`, `set_n_threads`, `close`,
tensor get/set/copy, events) and two ways to execute: `compile(graph)` for a whole graph (values
by name), and `graph_compute(split, memory)` for one split of a scheduled graph whose tensors
live in allocated buffers (SplitRun and SplitMemory below; the scheduler's executor implements
them). The default graph_compute goes through compile.

Every call here is synchronous: the "async" methods complete before they return, and events
only count records and waits, which is all a simulated device needs to be observable.
"""

from __future__ import annotations

import abc
import enum
import math
from collections.abc import Callable, Iterable, Mapping
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
    """Allocates buffers on one device (ggml_backend_buffer_type). `is_host`: the memory is
    ordinary host memory, so any backend that reads host memory may use it in place (no copy).

    The base class allocates host-addressable buffers (HostBuffer); a device whose memory the
    host cannot address subclasses it and returns its own Buffer from `alloc_buffer`."""

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

    def alloc_buffer(self, size: int, usage: BufferUsage = BufferUsage.ANY) -> Buffer:
        return HostBuffer(self, size, usage)

    def __repr__(self) -> str:
        return f"<buffer type {self.name}>"


class Buffer(abc.ABC):
    """`size` bytes of one buffer type's memory (ggml_backend_buffer): set and get bytes, copy
    from another buffer, clear. Where the memory lives is the buffer's business; `mapped()`
    gives its bytes as a host array only when this process can address them."""

    def __init__(self, buft: BufferType, size: int, usage: BufferUsage = BufferUsage.ANY):
        self.buft = buft
        self.size = int(size)
        self.usage = usage

    @property
    def is_host(self) -> bool:
        return self.buft.is_host

    def check_range(self, offset: int, nbytes: int) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise BackendError(
                f"{self.buft.name} buffer: bytes [{offset}, {offset + nbytes}) are outside its {self.size} bytes"
            )

    @abc.abstractmethod
    def set_bytes(self, offset: int, data: np.ndarray) -> None:
        """ggml_backend_tensor_set: write the uint8 array `data` at `offset`."""

    @abc.abstractmethod
    def get_bytes(self, offset: int, nbytes: int) -> np.ndarray:
        """ggml_backend_tensor_get: a host copy (uint8) of the bytes [offset, offset + nbytes)."""

    @abc.abstractmethod
    def clear(self, value: int = 0) -> None:
        """ggml_backend_buffer_clear: every byte set to `value`."""

    def copy_from(self, src: Buffer, src_offset: int, dst_offset: int, nbytes: int) -> bool:
        """ggml_backend_buffer_cpy_tensor: copy from `src` without going through the host; False
        when this buffer cannot (the caller then gets from src and sets here)."""
        return False

    def mapped(self) -> np.ndarray | None:
        """The buffer's bytes as a uint8 host array, or None when the host cannot address them."""
        return None

    def __repr__(self) -> str:
        return f"<buffer {self.buft.name} {self.size} bytes {self.usage.value}>"


class HostBuffer(Buffer):
    """A buffer in memory this process addresses (the CPU's, or a simulated device's): a uint8
    numpy array, or a zero-copy view of a caller's array (`HostBuffer.wrap`)."""

    def __init__(
        self, buft: BufferType, size: int, usage: BufferUsage = BufferUsage.ANY, data: np.ndarray | None = None
    ):
        super().__init__(buft, size, usage)
        self.data = np.zeros(self.size, dtype=np.uint8) if data is None else data

    @classmethod
    def wrap(cls, buft: BufferType, array: np.ndarray, usage: BufferUsage = BufferUsage.ANY) -> HostBuffer:
        """The bytes of a C-contiguous array, without copying them."""
        if not array.flags.c_contiguous:
            raise BackendError(f"cannot wrap a non-contiguous {array.dtype} array {array.shape} as a buffer")
        raw = array.reshape(-1).view(np.uint8)
        return cls(buft, raw.size, usage, raw)

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """The bytes [offset, offset + nbytes), in place; a clear error when out of range."""
        self.check_range(offset, nbytes)
        return self.data[offset : offset + nbytes]

    def set_bytes(self, offset: int, data: np.ndarray) -> None:
        self.view(offset, data.nbytes)[...] = data.reshape(-1).view(np.uint8)

    def get_bytes(self, offset: int, nbytes: int) -> np.ndarray:
        return self.view(offset, nbytes).copy()

    def clear(self, value: int = 0) -> None:
        self.data[...] = value

    def copy_from(self, src: Buffer, src_offset: int, dst_offset: int, nbytes: int) -> bool:
        raw = src.mapped()
        if raw is None:
            return False
        src.check_range(src_offset, nbytes)
        self.view(dst_offset, nbytes)[...] = raw[src_offset : src_offset + nbytes]
        return True

    def mapped(self) -> np.ndarray:
        return self.data


@dataclass(frozen=True, eq=False)
class TensorData:
    """Where a tensor's bytes are (ggml_tensor's buffer + data): `nbytes` (ggml_nbytes) from
    `offset` in `buffer`, read as `shape` of `dtype` with byte `strides` (storage shape and dtype:
    quantized rows are bytes)."""

    buffer: Buffer
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype
    strides: tuple[int, ...]
    nbytes: int

    @classmethod
    def of_array(cls, buft: BufferType, array: np.ndarray) -> TensorData:
        """A C-contiguous array as a tensor of a host buffer, in place."""
        return cls(HostBuffer.wrap(buft, array), 0, tuple(array.shape), array.dtype, tuple(array.strides),
                   int(array.nbytes))

    def array(self) -> np.ndarray:
        """The tensor in place, as a host array; BackendError when its memory is a device's."""
        raw = self.buffer.mapped()
        if raw is None:
            raise BackendError(f"a {self.dtype} tensor {self.shape} lives in {self.buffer.buft.name} "
                               f"device memory, which the host cannot address")
        self.buffer.check_range(self.offset, self.nbytes)
        return np.ndarray(self.shape, self.dtype, raw, self.offset, self.strides)

    def read(self) -> np.ndarray:
        """A host copy of the tensor (through get_bytes: a device copy counts as one)."""
        return host_array(self.buffer.get_bytes(self.offset, self.nbytes), self)

    def write(self, value: np.ndarray) -> None:
        """Overwrite a contiguous tensor with `value` (same storage shape and dtype)."""
        if tuple(value.shape) != self.shape or value.dtype != self.dtype:
            raise BackendError(f"cannot write a {value.dtype} {tuple(value.shape)} array into a "
                               f"{self.dtype} {self.shape} tensor")
        self.buffer.set_bytes(self.offset, np.ascontiguousarray(value).reshape(-1).view(np.uint8))


def alloc_tensors(
    buft: BufferType, tensors: Mapping[str, tuple[tuple[int, ...], np.dtype]], usage: BufferUsage = BufferUsage.ANY
) -> dict[str, TensorData]:
    """One buffer of `buft` holding C-contiguous tensors (name -> storage shape, dtype) at aligned
    offsets, as ggml_backend_alloc_ctx_tensors_from_buft does; the buffer starts zeroed."""
    offsets, size = {}, 0
    for name, (shape, dtype) in tensors.items():
        size = -(-size // buft.alignment) * buft.alignment
        offsets[name] = size
        size += buft.alloc_size(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize)
    if buft.max_size is not None and size > buft.max_size:
        raise BackendError(f"{buft.name}: {size} bytes of tensors exceed the buffer type's {buft.max_size}")
    buffer = buft.alloc_buffer(max(size, 1), usage)
    buffer.clear(0)
    out = {}
    for name, (shape, dtype) in tensors.items():
        dtype = np.dtype(dtype)
        out[name] = TensorData(buffer, offsets[name], tuple(shape), dtype, c_strides(shape, dtype.itemsize),
                               int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
    return out


def host_array(raw: np.ndarray, td: TensorData) -> np.ndarray:
    """The tensor `td` read out as `raw` (a fresh host copy of its nbytes bytes), typed: in place
    when it is C-contiguous, else compacted."""
    typed = np.ndarray(td.shape, td.dtype, raw, 0, td.strides)
    return typed if typed.flags.c_contiguous else typed.copy()


def c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """Byte strides of a C-contiguous array."""
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= int(n)
    return tuple(reversed(strides))


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
        unusable: str | None = None,
    ):
        self.name = name
        self.type = type
        self.unusable = unusable  # why a backend cannot be made on it (no driver, ...), or None
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
        return buft is self.buffer_type() or (self.host_memory and buft.is_host)

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


class Backend(abc.ABC):
    """Runs ops on one device (ggml_backend). Required: a device (passed to __init__) and
    `supports_op`; everything else is an optional hook with a default:

    - `compile(graph)` for whole graphs (values by name) and/or `graph_compute(split, memory)` for
      one split of a scheduled graph over allocated memory (the default compiles the split);
    - `supports_buft`, `offload_op`, `cost_model`, `set_n_threads`, `close`;
    - tensor copies (`set_tensor_async`, `get_tensor_async`, `cpy_tensor_async`), `synchronize`
      and `event_new`, all through the buffer interface.
    """

    name: ClassVar[str] = "?"
    cost_model: CostModel | None = None  # None: the scheduler's CPU figures

    def __init__(self, device: Device):
        self._device = device
        self._stats = BackendStats()

    # -- identity -----------------------------------------------------------------------------
    @property
    def device(self) -> Device:
        return self._device

    @property
    def label(self) -> str:
        """The name a split plan prints: the device's name (e.g. gpu0, cpu)."""
        return self.device.name

    @property
    def stats(self) -> BackendStats:
        return self._stats

    @property
    def is_cpu(self) -> bool:
        return self.device.type == DeviceType.CPU

    # -- support --------------------------------------------------------------------------------
    @abc.abstractmethod
    def supports_op(self, node: Node) -> bool:
        """Whether this backend runs `node` (a support table: llamir.backends.support)."""

    def supports_buft(self, buft: BufferType) -> bool:
        return self.device.supports_buft(buft)

    def offload_op(self, node: Node) -> bool:
        """Whether running `node` here is worth copying its host weights over (big batches)."""
        return False

    def unsupported(self, graph: Graph) -> list[Node]:
        return [n for n in graph.nodes if not n.op.is_view and not self.supports_op(n)]

    # -- optional hooks ---------------------------------------------------------------------------
    def set_n_threads(self, n_threads: int) -> None:
        """ggml_backend_cpu_set_n_threads; a device that does not use host threads ignores it."""
        if n_threads < 1:
            raise ValueError(f"n_threads must be >= 1, got {n_threads}")

    def close(self) -> None:  # noqa: B027 - an optional hook: nothing to release by default
        """Release what the backend holds (thread pools, device handles); it is not used again."""

    # -- tensors and synchronization -------------------------------------------------------------
    def set_tensor_async(self, dst: TensorData, data: np.ndarray) -> None:
        """Host -> this device: write the uint8 `data` at `dst`'s first byte."""
        dst.buffer.set_bytes(dst.offset, data)
        self.stats.bytes_in += int(data.nbytes)
        self.stats.n_copies_in += 1

    def get_tensor_async(self, src: TensorData) -> np.ndarray:
        """This device -> host: a copy of `src`'s nbytes bytes (uint8)."""
        self.stats.bytes_out += int(src.nbytes)
        self.stats.n_copies_out += 1
        return src.buffer.get_bytes(src.offset, src.nbytes)

    def cpy_tensor_async(self, src_backend: Backend, src: TensorData, dst: TensorData) -> bool:
        """Copy another backend's tensor into ours without the host; False when this backend
        cannot (the scheduler then goes through the host: get on the source, set here)."""
        return False

    def synchronize(self) -> None:
        self.stats.n_synchronize += 1

    def event_new(self) -> Event | None:
        """An event, or None when the device has no events (the scheduler then synchronizes)."""
        return Event(self) if self.device.caps.events else None

    # -- execution -------------------------------------------------------------------------------
    def compile(self, graph: Graph) -> Executable:
        raise BackendError(f"backend {self.name} cannot compile whole graphs")

    def precompile(self, graphs: Iterable[Graph], bindings: Iterable[Bindings] | None = None) -> int:
        """Prepare the code of many graphs ahead, in one batch where the backend can share or
        parallelise the work, so that compile() of each is quick; errors are left for compile()
        to report. `bindings`, when given, holds the dims each graph will run with, in order
        (for a backend whose code depends on them). Returns the number of modules prepared (0:
        nothing to prepare ahead)."""
        return 0

    def graph_compute(
        self, run: SplitRun, memory: SplitMemory, observe: Callable[[Node, np.ndarray], bool] | None = None
    ) -> bool:
        """Compute one split: read its inputs from `memory`, write its results there. Returns
        False when `observe` asked to stop. The default compiles the split's subgraph."""
        return run.compute_through_compile(self, memory, observe)

    def __repr__(self) -> str:
        return f"<backend {self.name} on {self.device.name}>"
