"""The CUDA backend: device memory behind llamir's Buffer interface, and splits computed as
sequences of kernel launches on one stream, built once and replayed while the graph is reused
(captured as a CUDA graph on a driver that has them)."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from llamir.backends import (
    Backend,
    BackendError,
    Buffer,
    BufferType,
    BufferUsage,
    CostModel,
    Device,
    DeviceCaps,
    DeviceGraph,
    DeviceType,
    Event,
    TensorData,
    op_batch_size,
    split_work,
)
from llamir.ir import ops
from llamir_cuda import (  # noqa: F401 - each registers its kernels
    kernels_attention,
    kernels_elementwise,
    kernels_matmul,
    kernels_norm,
    kernels_rope,
)
from llamir_cuda.driver import DeviceContext, DeviceInfo, Driver, DriverError
from llamir_cuda.lowering import KERNELS, Launch, Lowering, rank_ok

OFFLOAD_BATCH = 32
MAX_SEQUENCES = 64
GRAPH_AFTER = 2  # a sequence replayed this often is captured as a CUDA graph
VIEWS = (ops.View, ops.Reshape, ops.Permute, ops.Transpose)
STAGING_MIN = 1 << 20


class CudaBuffer(Buffer):
    """Device memory (cuMemAlloc). The host reaches it only through set/get bytes, which copy
    on the context's default stream and wait for the copy."""

    def __init__(self, buft: CudaBufferType, size: int, usage: BufferUsage):
        super().__init__(buft, size, usage)
        self.ctx: DeviceContext = buft.device.ctx
        self.device_ptr = self.ctx.alloc(max(self.size, 1))

    def set_bytes(self, offset: int, data: np.ndarray) -> None:
        self.check_range(offset, data.nbytes)
        self.ctx.memcpy_htod_async(self.device_ptr + offset, np.ascontiguousarray(data).view(np.uint8).reshape(-1))
        self.ctx.stream_synchronize()

    def get_bytes(self, offset: int, nbytes: int) -> np.ndarray:
        self.check_range(offset, nbytes)
        out = np.empty(int(nbytes), np.uint8)
        self.ctx.memcpy_dtoh_async(out, self.device_ptr + offset)
        self.ctx.stream_synchronize()
        return out

    def clear(self, value: int = 0) -> None:
        self.ctx.memset_async(self.device_ptr, value, self.size)
        self.ctx.stream_synchronize()

    def copy_from(self, src: Buffer, src_offset: int, dst_offset: int, nbytes: int) -> bool:
        if not isinstance(src, CudaBuffer) or src.ctx is not self.ctx:
            return False
        src.check_range(src_offset, nbytes)
        self.check_range(dst_offset, nbytes)
        self.ctx.memcpy_dtod_async(self.device_ptr + dst_offset, src.device_ptr + src_offset, nbytes)
        self.ctx.stream_synchronize()
        return True

    def __del__(self):
        ptr = getattr(self, "device_ptr", None)
        if ptr is not None:
            try:
                self.ctx.free(ptr)
            except DriverError:
                pass  # the context is gone (interpreter exit)


class CudaBufferType(BufferType):
    def __init__(self, device: CudaDevice):
        super().__init__(device.name, device, alignment=256, max_size=device.info.total_memory, is_host=False)

    def alloc_buffer(self, size: int, usage: BufferUsage = BufferUsage.ANY) -> Buffer:
        return CudaBuffer(self, size, usage)


class CudaDevice(Device):
    """One GPU of a driver (the real one, or the emulator). Its context is made on first use,
    so listing devices costs no driver work beyond the query."""

    def __init__(self, driver: Driver, info: DeviceInfo, unusable: str | None = None):
        super().__init__(f"cuda{info.index}", DeviceType.GPU, info.total_memory,
                         f"{info.name} ({info.arch}, {info.multiprocessors} SMs, {driver.name})",
                         caps=DeviceCaps(async_=True, events=True), alignment=256, unusable=unusable)
        self.driver, self.info = driver, info
        self._ctx: DeviceContext | None = None
        self._cuda_buft: CudaBufferType | None = None

    @property
    def ctx(self) -> DeviceContext:
        if self.unusable:
            raise BackendError(f"{self.name}: not usable: {self.unusable}")
        if self._ctx is None:
            self._ctx = self.driver.context(self.info.index)
        return self._ctx

    def buffer_type(self) -> BufferType:
        if self._cuda_buft is None:
            self._cuda_buft = CudaBufferType(self)
        return self._cuda_buft


class CudaEvent(Event):
    """A cuEvent recorded on the backend's stream; another CUDA backend waits for it on its own
    stream, any other backend by synchronizing."""

    def __init__(self, backend: CudaBackend):
        super().__init__(backend)
        self.handle = backend.ctx.event_new()

    def record(self) -> None:
        super().record()
        self.backend.ctx.event_record(self.handle, self.backend.stream)

    def synchronize(self) -> None:
        self.backend.ctx.event_synchronize(self.handle)

    def wait(self, waiter: Backend) -> None:
        super().wait(waiter)
        if isinstance(waiter, CudaBackend) and waiter.ctx is self.backend.ctx:
            waiter.ctx.stream_wait_event(waiter.stream, self.handle)
        else:
            self.synchronize()


class _Sequence:
    """The launches of one split over fixed memory, with their functions loaded; replayed
    launch by launch, or as a CUDA graph once it recurs."""

    def __init__(self, ctx: DeviceContext, launches: list[Launch], pins: list):
        self.ctx, self.pins = ctx, pins
        self.items = [(None if ln.kernel is None else ctx.load(ln.kernel), ln) for ln in launches]
        self.n_replays = 0
        self.graph = None

    def replay(self, stream, use_graphs: bool) -> None:
        self.n_replays += 1
        if self.graph is not None:
            self.ctx.graph_launch(self.graph, stream)
            return
        capture = use_graphs and self.ctx.supports_graphs and self.n_replays == GRAPH_AFTER
        if capture:
            self.ctx.begin_capture(stream)
        for function, ln in self.items:
            if ln.kernel is None:
                self.ctx.memcpy_dtod_async(*ln.copy, stream=stream)
            else:
                self.ctx.launch(function, ln.grid, ln.block, ln.args, stream)
        if capture:
            self.graph = self.ctx.end_capture(stream)
            self.ctx.graph_launch(self.graph, stream)

    def free(self) -> None:
        if self.graph is not None:
            self.ctx.graph_free(self.graph)
            self.graph = None


class CudaBackend(Backend):
    """Runs splits as launch sequences on one stream of one CUDA device."""

    name = "cuda"
    cost_model = CostModel(tflops=60.0, mem_gbps=3000.0, link_gbps=25.0, latency_us=10.0)

    def __init__(self, device: CudaDevice, offload_batch: int = OFFLOAD_BATCH, graphs: bool = True):
        super().__init__(device)
        self.ctx = device.ctx
        self.stream = self.ctx.stream_new()
        self.offload_batch = offload_batch
        self.use_graphs = graphs
        self._sequences: OrderedDict[tuple, _Sequence] = OrderedDict()
        self._scratch: Buffer | None = None
        self._arena: np.ndarray | None = None  # pinned staging for host -> device copies
        self._arena_used = 0
        self.n_lowered = 0
        # with `timing`, each replay is recorded between two timing events: device_time() sums them
        self.timing = False
        self._timed: list[tuple] = []
        self._spare_events: list = []
        self._device_seconds = 0.0

    # -- support ------------------------------------------------------------------------------------
    def supports_op(self, node) -> bool:
        if not rank_ok(node):
            return False
        if node.is_op(*VIEWS):
            return True
        entry = KERNELS.get(type(node.op))
        return entry is not None and entry.supports(node)

    def offload_op(self, node) -> bool:
        return op_batch_size(node) >= self.offload_batch

    # -- execution ----------------------------------------------------------------------------------
    def lower(self, work) -> Lowering:
        k = Lowering(self._scratch_tensor)
        for node, srcs, dst in work:
            entry = KERNELS.get(type(node.op))
            if entry is None:
                raise BackendError(f"cuda: no kernel for {node.op.name}")
            entry.lower(k, node, srcs, dst)
        return k

    def _sequence(self, work) -> _Sequence:
        """The launches of `work` (nodes with their tensors): replayed when the same nodes run
        over the same memory again, else lowered."""
        key = tuple((id(node), *((id(td.buffer), td.offset, td.shape, td.strides) for td in (*srcs, dst)))
                    for node, srcs, dst in work)
        hit = self._sequences.get(key)
        if hit is not None:
            self._sequences.move_to_end(key)
            return hit
        k = self.lower(work)
        # the entry holds the nodes and buffers its ids name, so none is freed while it lives
        pins = [(node, *(td.buffer for td in (*srcs, dst))) for node, srcs, dst in work] + k.pinned
        seq = _Sequence(self.ctx, k.launches, pins)
        self.n_lowered += 1
        self._sequences[key] = seq
        while len(self._sequences) > MAX_SEQUENCES:
            _, old = self._sequences.popitem(last=False)
            old.free()
        return seq

    def _scratch_tensor(self, nbytes: int) -> TensorData:
        """The backend's scratch buffer, grown (to a new buffer: sequences keep the old one they
        use) when a kernel needs more."""
        if self._scratch is None or self._scratch.size < nbytes:
            size = max(int(nbytes), 2 * self._scratch.size if self._scratch is not None else 1 << 20)
            self._scratch = self.device.buffer_type().alloc_buffer(size, BufferUsage.COMPUTE)
        return TensorData(self._scratch, 0, (int(nbytes),), np.dtype(np.uint8), (1,), int(nbytes))

    def run(self, work, observe=None, read=None) -> bool:
        """Compute `work` on the stream (asynchronously), or node by node, waiting for each,
        when `observe` watches every result."""
        if observe is None:
            if work:
                seq = self._sequence(work)
                if self.timing:
                    start, end = (self._spare_events.pop() if self._spare_events else self.ctx.event_new(timing=True)
                                  for _ in range(2))
                    self.ctx.event_record(start, self.stream)
                seq.replay(self.stream, self.use_graphs)
                if self.timing:
                    self.ctx.event_record(end, self.stream)
                    self._timed.append((start, end))
            return True
        for item in work:
            self._sequence([item]).replay(self.stream, use_graphs=False)
            self.ctx.stream_synchronize(self.stream)
            node = item[0]
            if node.name and observe(node, read(node)) is False:
                return False
        return True

    def graph_compute(self, run, memory, observe=None) -> bool:
        self.stats.n_graph_computes += 1
        return self.run(split_work(run, memory), observe, lambda node: memory.read(self, node))

    def compile(self, graph):
        return DeviceGraph(self, graph, self._run_synchronously)

    def _run_synchronously(self, work, observe, read) -> bool:
        done = self.run(work, observe, read)
        self.synchronize()
        return done

    def device_time(self) -> float:
        """Seconds the device spent running this backend's splits while `timing` was on (each
        replay between two events on the stream: its kernels and copies, not the host's work)."""
        self.ctx.stream_synchronize(self.stream)
        for start, end in self._timed:
            self._device_seconds += self.ctx.event_elapsed(start, end)
            self._spare_events += [start, end]
        self._timed.clear()
        return self._device_seconds

    # -- copies and synchronization ---------------------------------------------------------------
    def set_tensor_async(self, dst: TensorData, data: np.ndarray) -> None:
        """Host -> device on the stream, from a copy of `data` in the backend's pinned staging
        arena (reused from its start after each synchronize)."""
        if not isinstance(dst.buffer, CudaBuffer):
            return super().set_tensor_async(dst, data)
        data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        dst.buffer.check_range(dst.offset, data.nbytes)
        staging = self._stage(data.nbytes)
        staging[:] = data
        self.ctx.memcpy_htod_async(dst.buffer.device_ptr + dst.offset, staging, self.stream)
        self.stats.bytes_in += int(data.nbytes)
        self.stats.n_copies_in += 1

    def _stage(self, nbytes: int) -> np.ndarray:
        """`nbytes` of the pinned arena not used by a copy still in flight: when it is full, the
        stream is drained first; when too small, it is replaced by one twice the size."""
        if self._arena_used + nbytes > (self._arena.nbytes if self._arena is not None else 0):
            self.synchronize()
            if self._arena is None or self._arena.nbytes < nbytes:
                if self._arena is not None:
                    self.ctx.free_host(self._arena)
                size = max(STAGING_MIN, 2 * (self._arena.nbytes if self._arena is not None else 0), nbytes)
                self._arena = self.ctx.alloc_host(size)
        start = self._arena_used
        self._arena_used += -(-nbytes // 256) * 256
        return self._arena[start:start + nbytes]

    def get_tensor_async(self, src: TensorData) -> np.ndarray:
        if not isinstance(src.buffer, CudaBuffer):
            return super().get_tensor_async(src)
        out = np.empty(int(src.nbytes), np.uint8)
        self.ctx.memcpy_dtoh_async(out, src.buffer.device_ptr + src.offset, self.stream)
        self.ctx.stream_synchronize(self.stream)  # the caller reads it now
        self.stats.bytes_out += int(src.nbytes)
        self.stats.n_copies_out += 1
        return out

    def cpy_tensor_async(self, src_backend: Backend, src: TensorData, dst: TensorData) -> bool:
        """Device to device on one context, ordered after the source backend's work."""
        if not (isinstance(src.buffer, CudaBuffer) and isinstance(dst.buffer, CudaBuffer)
                and src.buffer.ctx is self.ctx and dst.buffer.ctx is self.ctx):
            return False
        if isinstance(src_backend, CudaBackend) and src_backend is not self:
            event = CudaEvent(src_backend)
            event.record()
            event.wait(self)
        self.ctx.memcpy_dtod_async(dst.buffer.device_ptr + dst.offset, src.buffer.device_ptr + src.offset,
                                   int(src.nbytes), self.stream)
        return True

    def synchronize(self) -> None:
        super().synchronize()
        self.ctx.stream_synchronize(self.stream)
        self._arena_used = 0  # every staged copy has landed

    def event_new(self) -> Event | None:
        return CudaEvent(self)

    def close(self) -> None:
        self.synchronize()
        for seq in self._sequences.values():
            seq.free()
        self._sequences.clear()
        if self._arena is not None:
            self.ctx.free_host(self._arena)
            self._arena = None
