"""The Vulkan backend: device memory behind llamir's Buffer interface, and splits computed by
command buffers of shader dispatches, recorded once and replayed while the graph is reused."""

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
    TensorData,
    op_batch_size,
    split_work,
)
from llamir.ir import ops
from llamir_vulkan import (  # noqa: F401 - each registers its kernels
    kernels_attention,
    kernels_elementwise,
    kernels_matmul,
    kernels_norm,
)
from llamir_vulkan.lowering import KERNELS, Lowering
from llamir_vulkan.runtime import Gpu, Instance, PhysicalInfo, Recording, VulkanError
from llamir_vulkan.shaders import ShaderCompiler, ShaderError, variant_id

OFFLOAD_BATCH = 32
MAX_RECORDINGS = 64
VIEWS = (ops.View, ops.Reshape, ops.Permute, ops.Transpose)


class VulkanBuffer(Buffer):
    """A VkBuffer in device memory. The host reaches it only through set/get bytes (in place
    through the mapping where the memory is host-visible, else through a staging buffer)."""

    def __init__(self, buft: VulkanBufferType, size: int, usage: BufferUsage):
        super().__init__(buft, size, usage)
        self.gpu: Gpu = buft.device.gpu
        self.memory = self.gpu.alloc(self.size)

    def set_bytes(self, offset: int, data: np.ndarray) -> None:
        self.check_range(offset, data.nbytes)
        self.gpu.write(self.memory, offset, data)

    def get_bytes(self, offset: int, nbytes: int) -> np.ndarray:
        self.check_range(offset, nbytes)
        return self.gpu.read(self.memory, offset, nbytes)

    def clear(self, value: int = 0) -> None:
        self.gpu.fill(self.memory, value)

    def copy_from(self, src: Buffer, src_offset: int, dst_offset: int, nbytes: int) -> bool:
        if not isinstance(src, VulkanBuffer) or src.gpu is not self.gpu:
            return False
        src.check_range(src_offset, nbytes)
        self.check_range(dst_offset, nbytes)
        self.gpu.copy(src.memory, src_offset, self.memory, dst_offset, nbytes)
        return True

    def __del__(self):
        memory = getattr(self, "memory", None)
        if memory is not None and self.gpu.device is not None:
            memory.free()


class VulkanBufferType(BufferType):
    def __init__(self, device: VulkanDevice):
        super().__init__(device.name, device, alignment=max(device.info.min_storage_alignment, 64),
                         max_size=device.info.max_allocation, is_host=False)

    def alloc_buffer(self, size: int, usage: BufferUsage = BufferUsage.ANY) -> Buffer:
        return VulkanBuffer(self, size, usage)


class VulkanDevice(Device):
    """One physical device. Its logical device, shader compiler and buffer type are made on
    first use, so listing devices costs no driver work."""

    def __init__(self, index: int, info: PhysicalInfo, instance: Instance, unusable: str | None = None):
        gone = info.missing()
        unusable = unusable or (f"lacks {', '.join(gone)}" if gone else None)
        # lavapipe reports itself as a CPU, but its memory is its own: a GPU to the scheduler
        super().__init__(f"vulkan{index}", DeviceType.GPU,
                         info.device_local_bytes, f"{info.name} ({info.type}, Vulkan "
                         f"{'.'.join(map(str, info.api_version))})", caps=DeviceCaps(async_=True, events=True),
                         alignment=max(info.min_storage_alignment, 64), unusable=unusable)
        self.index, self.info, self.instance = index, info, instance
        self._gpu: Gpu | None = None
        self._compiler: ShaderCompiler | None = None
        self._vk_buft: VulkanBufferType | None = None

    @property
    def gpu(self) -> Gpu:
        if self.unusable:
            raise BackendError(f"{self.name}: not usable: {self.unusable}")
        if self._gpu is None:
            import os

            self._gpu = Gpu(self.instance, self.info, force_staging=os.environ.get("LLAMIR_VULKAN_STAGING", "")
                            not in ("", "0"))
        return self._gpu

    @property
    def compiler(self) -> ShaderCompiler:
        if self._compiler is None:
            self._compiler = ShaderCompiler()
        return self._compiler

    def buffer_type(self) -> BufferType:
        if self._vk_buft is None:
            self._vk_buft = VulkanBufferType(self)
        return self._vk_buft


def _fits(node, limit: int, skip_src0: bool) -> bool:
    """Whether every tensor of the node fits one storage-buffer binding (symbolic sizes are
    checked when the graph is bound and lowered)."""
    for v in (*node.inputs[int(skip_src0):], node):
        shape = v.type.shape
        if all(isinstance(d, int) for d in shape) and \
                int(np.prod(shape, dtype=np.int64)) * v.dtype.type_size // v.dtype.block_size > limit:
            return False
    return True


class VulkanBackend(Backend):
    """Runs splits as command buffers of shader dispatches on one Vulkan device."""

    name = "vulkan"
    cost_model = CostModel(tflops=0.05, mem_gbps=20.0, link_gbps=20.0, latency_us=50.0)

    def __init__(self, device: VulkanDevice, offload_batch: int = OFFLOAD_BATCH):
        super().__init__(device)
        self.gpu = device.gpu
        self.compiler = device.compiler
        self.offload_batch = offload_batch
        self._recordings: OrderedDict[tuple, tuple] = OrderedDict()
        self._scratch: Buffer | None = None
        self.n_recorded = 0

    # -- support ------------------------------------------------------------------------------------
    def supports_op(self, node) -> bool:
        if any(v.type.rank > 4 for v in (*node.inputs, node)):
            return False
        if node.is_op(*VIEWS):
            return True
        entry = KERNELS.get(type(node.op))
        return entry is not None and entry.supports(node) and \
            _fits(node, self.gpu.info.max_storage_range, entry.splits_src0)

    def offload_op(self, node) -> bool:
        return op_batch_size(node) >= self.offload_batch

    # -- execution ----------------------------------------------------------------------------------
    def lower(self, work, finish: bool = True) -> Lowering:
        """`work`'s dispatches, their pipelines made (the new shader variants compiled side by
        side); with finish=False only the dispatches, naming their variants."""
        k = Lowering(self.gpu, self.compiler, self._scratch_tensor)
        for node, srcs, dst in work:
            entry = KERNELS.get(type(node.op))
            if entry is None:
                raise BackendError(f"vulkan: no kernel for {node.op.name}")
            entry.lower(k, node, srcs, dst)
        return k.finish() if finish else k

    def precompile(self, graphs, bindings=None) -> int:
        """Compile the shader variants of many graphs in one batch, side by side, into the shader
        cache: what test-backend-ops does before its hundreds of one-node graphs, whose variants
        one at a time keep a single glslc busy for minutes on a fresh machine. Each graph is laid
        out in device memory under its `bindings` (a graph with dims left unbound is skipped) and
        lowered to learn its variants; a graph that cannot be is left for its compile() to
        report, as is a variant that does not compile. Returns the number of variants compiled."""
        graphs = list(graphs)
        bindings = list(bindings) if bindings is not None else [{}] * len(graphs)
        variants: dict[tuple, tuple[str, dict]] = {}
        for graph, dims in zip(graphs, bindings, strict=True):
            if set(graph.dim_names) - set(dims):
                continue
            try:
                k = self.lower(DeviceGraph(self, graph, self.run).work(dims), finish=False)
            except Exception:  # noqa: BLE001 - whatever lowering raises, compile() raises it again and names it
                continue
            for name, defines in k.variants():
                variants[variant_id(name, defines)] = (name, defines)
        before = self.compiler.n_compiled
        try:
            self.compiler.compile_all(variants.values())
        except ShaderError:
            pass
        return self.compiler.n_compiled - before

    def _recording(self, work) -> Recording:
        """The command buffer of `work` (nodes with their tensors): replayed when the same nodes
        run over the same memory again, else recorded."""
        key = tuple((id(node), *((id(td.buffer), td.offset, td.shape, td.strides) for td in (*srcs, dst)))
                    for node, srcs, dst in work)
        hit = self._recordings.get(key)
        if hit is not None:
            self._recordings.move_to_end(key)
            return hit[0]
        k = self.lower(work)
        params, offsets = _pack_params(k.dispatches, self.gpu.info.min_storage_alignment)
        rec = Recording(self.gpu, k.dispatches, params, offsets)
        self.n_recorded += 1
        # the entry holds the nodes and buffers its ids name, so none is freed while it lives
        pins = [(node, *(td.buffer for td in (*srcs, dst))) for node, srcs, dst in work] + k.pinned
        self._recordings[key] = (rec, pins)
        while len(self._recordings) > MAX_RECORDINGS:
            _, (old, _) = self._recordings.popitem(last=False)
            old.free()
        return rec

    def _scratch_tensor(self, nbytes: int) -> TensorData:
        """The backend's scratch buffer, grown (to a new buffer: recordings keep the old one
        they use) when a kernel needs more."""
        if self._scratch is None or self._scratch.size < nbytes:
            size = max(int(nbytes), 2 * self._scratch.size if self._scratch is not None else 1 << 20)
            self._scratch = self.device.buffer_type().alloc_buffer(size, BufferUsage.COMPUTE)
        return TensorData(self._scratch, 0, (int(nbytes),), np.dtype(np.uint8), (1,), int(nbytes))

    def run(self, work, observe=None, read=None) -> bool:
        """Compute `work`: one submit, or one per node when `observe` watches each result."""
        if observe is None:
            if work:  # asynchronous: the next host access to this GPU's memory waits for it
                self._recording(work).submit(wait=False)
            return True
        for item in work:
            self._recording([item]).submit()
            node = item[0]
            if node.name and observe(node, read(node)) is False:
                return False
        return True

    def graph_compute(self, run, memory, observe=None) -> bool:
        self.stats.n_graph_computes += 1
        return self.run(split_work(run, memory), observe, lambda node: memory.read(self, node))

    def compile(self, graph):
        """A whole graph (test-backend-ops): leaves copied into device buffers, every node run
        there, outputs read back."""
        return DeviceGraph(self, graph, self.run)

    def synchronize(self) -> None:
        super().synchronize()
        self.gpu.wait()

    def close(self) -> None:
        for rec, _ in self._recordings.values():
            rec.free()
        self._recordings.clear()


def _pack_params(dispatches, alignment: int) -> tuple[np.ndarray, list[int]]:
    """Every dispatch's params block in one buffer, each at an aligned byte offset."""
    words, offsets = [], []
    step = max(alignment // 4, 1)
    for d in dispatches:
        pad = -len(words) % step
        words.extend([0] * pad)
        offsets.append(len(words) * 4)
        words.extend(int(w) for w in d.params)
    return np.array(words or [0], dtype=np.uint32), offsets


def describe_error(err: Exception) -> str:
    if isinstance(err, VulkanError | ShaderError):
        return str(err)
    return f"{type(err).__name__}: {err}"
