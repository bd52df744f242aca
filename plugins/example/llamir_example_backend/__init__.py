"""An example llamir backend: a device whose memory is its own.

The device keeps every byte in private memory that the host cannot address (its buffers have no
`mapped()` view), so every tensor that crosses between it and the host is a real copy, counted
by the device. It runs a subset of ops through llamir's numpy kernels, on views of its own
memory, which is what a GPU backend does with its kernels. docs/writing-a-backend.md walks
through this file.

    pip install -e plugins/example
    llamir backends                      # lists `example` and its device
    llamir test-backend-ops -b example
    llamir run MODEL --device example -ngl 99 --temp 0
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llamir.backends import (
    Backend,
    BackendError,
    BackendReg,
    Buffer,
    BufferType,
    BufferUsage,
    Device,
    DeviceCaps,
    DeviceType,
    Option,
    SupportTable,
    TensorData,
    numpy_table,
    op_batch_size,
)
from llamir.ir import Interpreter

MEMORY = 4 << 30
OFFLOAD_BATCH = 32
# The ops it runs: enough for llama-shaped models; the rest stays on the CPU.
OPS = (
    "add", "mul", "scale", "rms_norm", "rms_norm_mul", "mul_mat", "rope_ext", "soft_max_ext", "get_rows",
    "set_rows", "cpy", "cont", "silu", "swiglu", "flash_attn_ext",
)


@dataclass
class Counters:
    """What crossed the device boundary: the device's own account, as a GPU driver keeps it."""

    bytes_to_device: int = 0
    bytes_to_host: int = 0
    bytes_on_device: int = 0  # device-to-device copies
    n_buffers: int = 0


class ExampleBuffer(Buffer):
    """Device memory: a private bytearray, only reachable through the buffer interface."""

    def __init__(self, buft: ExampleBufferType, size: int, usage: BufferUsage):
        super().__init__(buft, size, usage)
        self._memory = np.zeros(self.size, dtype=np.uint8)
        self._counters = buft.device.counters
        self._counters.n_buffers += 1

    def set_bytes(self, offset: int, data: np.ndarray) -> None:
        self.check_range(offset, data.nbytes)
        self._memory[offset : offset + data.nbytes] = data.reshape(-1).view(np.uint8)
        self._counters.bytes_to_device += int(data.nbytes)

    def get_bytes(self, offset: int, nbytes: int) -> np.ndarray:
        self.check_range(offset, nbytes)
        self._counters.bytes_to_host += int(nbytes)
        return self._memory[offset : offset + nbytes].copy()

    def clear(self, value: int = 0) -> None:
        self._memory[...] = value

    def copy_from(self, src: Buffer, src_offset: int, dst_offset: int, nbytes: int) -> bool:
        if not isinstance(src, ExampleBuffer):
            return False  # from the host: the caller gets from src and sets here
        src.check_range(src_offset, nbytes)
        self.check_range(dst_offset, nbytes)
        self._memory[dst_offset : dst_offset + nbytes] = src._memory[src_offset : src_offset + nbytes]
        self._counters.bytes_on_device += int(nbytes)
        return True

    def device_array(self, td: TensorData) -> np.ndarray:
        """The tensor in place, for this device's kernels (not for the host)."""
        self.check_range(td.offset, td.nbytes)
        return np.ndarray(td.shape, td.dtype, self._memory, td.offset, td.strides)


class ExampleBufferType(BufferType):
    def __init__(self, device: ExampleDevice):
        super().__init__(f"{device.name}", device, alignment=128, is_host=False)

    def alloc_buffer(self, size: int, usage: BufferUsage = BufferUsage.ANY) -> Buffer:
        return ExampleBuffer(self, size, usage)


class ExampleDevice(Device):
    def __init__(self, index: int = 0):
        super().__init__(f"example{index}", DeviceType.GPU, MEMORY, "example device: private memory, numpy kernels",
                         caps=DeviceCaps(async_=False, events=False), alignment=128)
        self.counters = Counters()
        self._buft = ExampleBufferType(self)

    def buffer_type(self) -> BufferType:
        return self._buft


class ExampleBackend(Backend):
    """Runs its splits node by node with llamir's numpy kernels over its own memory."""

    name = "example"

    def __init__(self, device: ExampleDevice, offload_batch: int = OFFLOAD_BATCH):
        super().__init__(device)
        self.support: SupportTable = numpy_table().only(OPS)
        self.offload_batch = offload_batch
        self.interp = Interpreter(exact=True)

    def supports_op(self, node) -> bool:
        return self.support(node)

    def offload_op(self, node) -> bool:
        return op_batch_size(node) >= self.offload_batch

    def _array(self, td: TensorData) -> np.ndarray:
        if not isinstance(td.buffer, ExampleBuffer):
            raise BackendError(f"example backend: a tensor in {td.buffer.buft.name} memory reached its kernels")
        return td.buffer.device_array(td)

    def graph_compute(self, run, memory, observe=None) -> bool:
        self.stats.n_graph_computes += 1
        for node in run.nodes:
            if node.op.is_view:  # a view is only geometry: memory.tensor(view) already has it
                continue
            args = [self._array(memory.tensor(ref)) for ref in run.inputs_of(node)]
            out = self.interp.compute(node, args)
            if not node.op.has_side_effects:  # set_rows and cpy wrote into their destination
                dst = self._array(memory.tensor(node))
                dst[...] = np.asarray(out).reshape(dst.shape)
            if observe is not None and node.name and observe(node, memory.read(self, node)) is False:
                return False
        return True

    def compile(self, graph):
        """Whole graphs (test-backend-ops): leaves are set into device memory, every node runs
        there, outputs are read back, all through the buffer interface."""
        return _CompiledGraph(self, graph)


class _CompiledGraph:
    """A whole graph on the device: leaves copied in, the numpy kernels over device memory,
    outputs copied back out."""

    def __init__(self, backend: ExampleBackend, graph):
        unsupported = backend.unsupported(graph)
        if unsupported:
            raise BackendError(f"backend example cannot run: {', '.join(sorted({n.op.name for n in unsupported}))}")
        self.backend, self.graph = backend, graph

    def _on_device(self, host: np.ndarray) -> TensorData:
        host = np.ascontiguousarray(host)
        buf = self.backend.device.buffer_type().alloc_buffer(max(host.nbytes, 1))
        td = TensorData(buf, 0, host.shape, host.dtype, host.strides, host.nbytes)
        td.write(host)
        return td

    def __call__(self, leaf_values, bindings, observe=None):
        leaves = {leaf.name: self._on_device(leaf_values[leaf.name]) for leaf in self.graph.leafs}
        arrays = {name: td.buffer.device_array(td) for name, td in leaves.items()}
        results = self.backend.interp.run(self.graph, arrays, bindings, observe)
        for leaf in self.graph.leafs_of_kind("state"):  # written in place (set_rows): back to the caller
            np.copyto(leaf_values[leaf.name], leaves[leaf.name].read())
        return {name: self._on_device(value).read() for name, value in results.items()}


class ExampleReg(BackendReg):
    """The plugin's registry: one device (two with LLAMIR_EXAMPLE_DEVICES=2)."""

    name = "example"
    description = "worked example plugin: a device with private memory running ops through numpy"
    options = {"offload": Option("offload_batch", int, "op_offload batch threshold (default 32)")}

    def __init__(self):
        import os

        self._devices = [ExampleDevice(i) for i in range(int(os.environ.get("LLAMIR_EXAMPLE_DEVICES", "1")))]

    def devices(self) -> list[Device]:
        return list(self._devices)

    def init_backend(self, device: Device, **options) -> Backend:
        return ExampleBackend(device, **options)


__all__ = ["Counters", "ExampleBackend", "ExampleBuffer", "ExampleDevice", "ExampleReg"]
