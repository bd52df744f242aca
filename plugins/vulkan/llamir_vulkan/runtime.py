"""The Vulkan runtime under the backend: the instance and its physical devices, a logical device
with one compute queue, memory and buffers, compute pipelines, and command buffers that are
recorded once and submitted again and again.

Everything here talks to the driver through the `vulkan` package (cffi). It is imported lazily,
so a machine without a Vulkan loader gets a clear "not usable" from the registry instead of an
import error. ggml-vulkan's ggml_vk_instance_init / ggml_vk_get_device are the model: one
instance per process, a device per physical device, a compute queue family, the storage
features the shaders need enabled through the pNext chain, and the Khronos validation layer
when asked for (LLAMIR_VULKAN_VALIDATE=1), whose messages are collected and can fail a test.
"""

from __future__ import annotations

import atexit
import os
import threading
from dataclasses import dataclass, field

import numpy as np

WHOLE_SIZE = 0xFFFFFFFFFFFFFFFF
UINT64_MAX = 0xFFFFFFFFFFFFFFFF
VALIDATION_LAYER = "VK_LAYER_KHRONOS_validation"


class VulkanError(RuntimeError):
    """The Vulkan driver refused or failed something; the message says what."""


def load_vulkan():
    """The `vulkan` module, or VulkanError saying why it cannot be used here."""
    try:
        import vulkan as vk
    except OSError as err:  # cffi: no libvulkan.so.1
        raise VulkanError(f"no Vulkan loader (libvulkan.so.1): {err}") from err
    except ImportError as err:
        raise VulkanError(f"the `vulkan` Python package is not installed: {err}") from err
    return vk


def validation_requested() -> bool:
    return os.environ.get("LLAMIR_VULKAN_VALIDATE", "") not in ("", "0")


def _binding_limit() -> int:
    """LLAMIR_VULKAN_MAX_BINDING: a smaller storage-buffer range than the device's, so tests can
    exercise the kernels that split a large tensor across bindings."""
    value = os.environ.get("LLAMIR_VULKAN_MAX_BINDING", "")
    return int(value) if value else 1 << 62


@dataclass
class PhysicalInfo:
    """What a physical device is and offers: ggml_vk_device's facts."""

    index: int
    handle: object
    name: str
    type: str
    api_version: tuple[int, int, int]
    max_storage_range: int
    min_storage_alignment: int
    max_workgroups: tuple[int, int, int]
    max_invocations: int
    shared_memory: int
    subgroup_size: int
    max_allocation: int  # maxMemoryAllocationSize: the largest buffer
    memory_types: list[tuple[int, int]]  # (property flags, heap index)
    heap_sizes: list[int]
    heap_device_local: list[bool]
    queue_family: int | None
    features: dict[str, bool] = field(default_factory=dict)

    @property
    def device_local_bytes(self) -> int:
        return sum(s for s, local in zip(self.heap_sizes, self.heap_device_local, strict=True) if local) or \
            sum(self.heap_sizes)

    def missing(self) -> list[str]:
        """The features the shaders need that this device lacks."""
        need = ["storageBuffer16BitAccess", "storageBuffer8BitAccess"]
        gone = [f for f in need if not self.features.get(f)]
        if self.queue_family is None:
            gone.append("a compute queue")
        return gone


class Instance:
    """The process's Vulkan instance (validation layer and debug messenger when requested)."""

    _lock = threading.Lock()
    _shared: Instance | None = None

    def __init__(self, validate: bool):
        vk = self.vk = load_vulkan()
        self.validate = validate
        self.messages: list[str] = []
        layers = []
        extensions = []
        if validate:
            have = {p.layerName for p in vk.vkEnumerateInstanceLayerProperties()}
            if VALIDATION_LAYER not in have:
                raise VulkanError(f"LLAMIR_VULKAN_VALIDATE is set but {VALIDATION_LAYER} is not installed "
                                  f"(apt-get install vulkan-validationlayers)")
            layers.append(VALIDATION_LAYER)
            extensions.append("VK_EXT_debug_utils")
        app = vk.VkApplicationInfo(pApplicationName="llamir", applicationVersion=1, pEngineName="llamir",
                                   engineVersion=1, apiVersion=vk.VK_MAKE_VERSION(1, 2, 0))
        try:
            self.handle = vk.vkCreateInstance(vk.VkInstanceCreateInfo(
                pApplicationInfo=app, ppEnabledLayerNames=layers, ppEnabledExtensionNames=extensions), None)
        except vk.VkErrorIncompatibleDriver as err:
            raise VulkanError("no Vulkan driver (vkCreateInstance: VK_ERROR_INCOMPATIBLE_DRIVER); install one, "
                              "e.g. mesa-vulkan-drivers for lavapipe") from err
        except vk.VkError as err:
            raise VulkanError(f"vkCreateInstance failed: {type(err).__name__}") from err
        self._messenger = None
        if validate:
            create = vk.vkGetInstanceProcAddr(self.handle, "vkCreateDebugUtilsMessengerEXT")
            info = vk.VkDebugUtilsMessengerCreateInfoEXT(
                messageSeverity=vk.VK_DEBUG_UTILS_MESSAGE_SEVERITY_WARNING_BIT_EXT
                | vk.VK_DEBUG_UTILS_MESSAGE_SEVERITY_ERROR_BIT_EXT,
                messageType=vk.VK_DEBUG_UTILS_MESSAGE_TYPE_GENERAL_BIT_EXT
                | vk.VK_DEBUG_UTILS_MESSAGE_TYPE_VALIDATION_BIT_EXT
                | vk.VK_DEBUG_UTILS_MESSAGE_TYPE_PERFORMANCE_BIT_EXT,
                pfnUserCallback=self._on_message)
            self._messenger = create(self.handle, info, None)
        self.physical = [self._describe(i, pd) for i, pd in enumerate(vk.vkEnumeratePhysicalDevices(self.handle))]

    def _on_message(self, severity, types, data, user):
        text = self.vk.ffi.string(data.pMessage).decode(errors="replace")
        self.messages.append(text)
        return 0

    @classmethod
    def shared(cls) -> Instance:
        """The one instance of this process (created on first use)."""
        with cls._lock:
            if cls._shared is None:
                cls._shared = cls(validation_requested())
            return cls._shared

    def _describe(self, index: int, pd) -> PhysicalInfo:
        vk = self.vk
        props = vk.vkGetPhysicalDeviceProperties(pd)
        limits = props.limits
        mem = vk.vkGetPhysicalDeviceMemoryProperties(pd)
        families = vk.vkGetPhysicalDeviceQueueFamilyProperties(pd)
        compute = [i for i, q in enumerate(families) if q.queueFlags & vk.VK_QUEUE_COMPUTE_BIT]
        # a compute-only family first, as ggml-vulkan prefers
        compute.sort(key=lambda i: bool(families[i].queueFlags & vk.VK_QUEUE_GRAPHICS_BIT))
        f11 = vk.VkPhysicalDeviceVulkan11Features()
        f12 = vk.VkPhysicalDeviceVulkan12Features(pNext=f11)
        feats = vk.VkPhysicalDeviceFeatures2(pNext=f12)
        vk.vkGetPhysicalDeviceFeatures2(pd, feats)
        sub = vk.VkPhysicalDeviceSubgroupProperties()
        m3 = vk.VkPhysicalDeviceMaintenance3Properties(pNext=sub)
        vk.vkGetPhysicalDeviceProperties2(pd, vk.VkPhysicalDeviceProperties2(pNext=m3))
        kinds = {vk.VK_PHYSICAL_DEVICE_TYPE_DISCRETE_GPU: "discrete GPU", vk.VK_PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU:
                 "integrated GPU", vk.VK_PHYSICAL_DEVICE_TYPE_VIRTUAL_GPU: "virtual GPU",
                 vk.VK_PHYSICAL_DEVICE_TYPE_CPU: "CPU"}
        v = props.apiVersion
        return PhysicalInfo(
            index=index, handle=pd, name=vk.ffi.string(props.deviceName).decode()
            if not isinstance(props.deviceName, str) else props.deviceName,
            type=kinds.get(props.deviceType, "other"),
            api_version=(v >> 22, (v >> 12) & 0x3FF, v & 0xFFF),
            max_storage_range=min(int(limits.maxStorageBufferRange), _binding_limit()),
            min_storage_alignment=int(limits.minStorageBufferOffsetAlignment),
            max_workgroups=tuple(int(n) for n in limits.maxComputeWorkGroupCount),
            max_invocations=int(limits.maxComputeWorkGroupInvocations),
            shared_memory=int(limits.maxComputeSharedMemorySize),
            subgroup_size=int(sub.subgroupSize),
            max_allocation=int(m3.maxMemoryAllocationSize),
            memory_types=[(int(mem.memoryTypes[i].propertyFlags), int(mem.memoryTypes[i].heapIndex))
                          for i in range(mem.memoryTypeCount)],
            heap_sizes=[int(mem.memoryHeaps[i].size) for i in range(mem.memoryHeapCount)],
            heap_device_local=[bool(mem.memoryHeaps[i].flags & vk.VK_MEMORY_HEAP_DEVICE_LOCAL_BIT)
                               for i in range(mem.memoryHeapCount)],
            queue_family=compute[0] if compute else None,
            features={"storageBuffer16BitAccess": bool(f11.storageBuffer16BitAccess),
                      "storageBuffer8BitAccess": bool(f12.storageBuffer8BitAccess),
                      "shaderFloat16": bool(f12.shaderFloat16), "shaderInt8": bool(f12.shaderInt8)},
        )


class Memory:
    """One allocation with the VkBuffer over it; `host` is its persistent mapping (uint8) when the
    memory type is host-visible, else None (reads and writes then go through staging)."""

    def __init__(self, gpu: Gpu, size: int, host_visible: bool):
        vk = gpu.vk
        self.gpu, self.size = gpu, int(size)
        usage = (vk.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT
                 | vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT)
        self.buffer = vk.vkCreateBuffer(gpu.device, vk.VkBufferCreateInfo(
            size=self.size, usage=usage, sharingMode=vk.VK_SHARING_MODE_EXCLUSIVE), None)
        req = vk.vkGetBufferMemoryRequirements(gpu.device, self.buffer)
        type_index, flags = gpu.memory_type(req.memoryTypeBits, host_visible)
        try:
            self.memory = vk.vkAllocateMemory(gpu.device, vk.VkMemoryAllocateInfo(
                allocationSize=req.size, memoryTypeIndex=type_index), None)
        except vk.VkError as err:
            vk.vkDestroyBuffer(gpu.device, self.buffer, None)
            raise VulkanError(f"{gpu.info.name}: cannot allocate {self.size} bytes of device memory "
                              f"({type(err).__name__})") from err
        vk.vkBindBufferMemory(gpu.device, self.buffer, self.memory, 0)
        self.host: np.ndarray | None = None
        # device memory the host can see (lavapipe, integrated GPUs) is written in place, unless
        # the backend was told to go through staging as it must on a discrete GPU
        coherent = vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | vk.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT
        mappable = flags & coherent == coherent and (host_visible or not gpu.force_staging)
        if mappable:
            raw = vk.vkMapMemory(gpu.device, self.memory, 0, self.size, 0)
            self.host = np.frombuffer(raw, dtype=np.uint8, count=self.size)

    def free(self) -> None:
        vk, dev = self.gpu.vk, self.gpu.device
        if self.buffer is not None:
            if self.host is not None:
                self.host = None
                vk.vkUnmapMemory(dev, self.memory)
            vk.vkDestroyBuffer(dev, self.buffer, None)
            vk.vkFreeMemory(dev, self.memory, None)
            self.buffer = self.memory = None


@dataclass
class Pipeline:
    """A compute pipeline of one shader variant: its bindings' layout and the pipeline."""

    name: str
    n_bindings: int
    set_layout: object
    layout: object
    handle: object
    module: object


class Gpu:
    """A logical device on one physical device: its compute queue, memory, pipelines and the
    submission of command buffers (waited on with a fence)."""

    def __init__(self, instance: Instance, info: PhysicalInfo, force_staging: bool = False):
        vk = self.vk = instance.vk
        self.instance, self.info = instance, info
        self.force_staging = force_staging
        f11 = vk.VkPhysicalDeviceVulkan11Features(storageBuffer16BitAccess=True)
        f12 = vk.VkPhysicalDeviceVulkan12Features(pNext=f11, storageBuffer8BitAccess=True)
        features = vk.VkPhysicalDeviceFeatures2(pNext=f12)
        queue = vk.VkDeviceQueueCreateInfo(queueFamilyIndex=info.queue_family, queueCount=1,
                                           pQueuePriorities=[1.0])
        try:
            self.device = vk.vkCreateDevice(info.handle, vk.VkDeviceCreateInfo(
                pNext=features, pQueueCreateInfos=[queue], ppEnabledExtensionNames=[]), None)
        except vk.VkError as err:
            raise VulkanError(f"vkCreateDevice on {info.name} failed: {type(err).__name__}") from err
        self.queue = vk.vkGetDeviceQueue(self.device, info.queue_family, 0)
        self.pool = vk.vkCreateCommandPool(self.device, vk.VkCommandPoolCreateInfo(
            flags=vk.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT, queueFamilyIndex=info.queue_family), None)
        self.fence = vk.vkCreateFence(self.device, vk.VkFenceCreateInfo(), None)
        self.pipeline_cache = self._load_pipeline_cache()
        self.pipelines: dict[tuple, Pipeline] = {}
        self._staging: Memory | None = None
        self._transfer = self.command_buffer()
        self.lock = threading.RLock()
        self._in_flight = False
        self.n_submits = 0
        atexit.register(self._at_exit)

    def _at_exit(self) -> None:
        if self.device is not None and self.pipelines:
            self.wait()
            self.save_pipeline_cache()

    # -- memory ----------------------------------------------------------------------------------
    def memory_type(self, bits: int, host_visible: bool) -> tuple[int, int]:
        """The memory type for a buffer: device-local for device memory, host-visible and coherent
        for staging and params (ggml_vk_create_buffer's preferences)."""
        vk = self.vk
        local = vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT
        visible = vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | vk.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT
        want = visible if host_visible else local
        types = [(i, f) for i, (f, _) in enumerate(self.info.memory_types) if bits & (1 << i)]
        for i, f in types:
            if f & want == want:
                return i, f
        if types and not host_visible:  # no device-local memory: any type will do
            return types[0]
        raise VulkanError(f"{self.info.name}: no memory type fits (bits {bits:#x}, host-visible {host_visible})")

    def alloc(self, size: int) -> Memory:
        return Memory(self, max(int(size), 4), host_visible=False)

    def staging(self, size: int) -> Memory:
        """A host-visible buffer at least `size` bytes (kept and grown)."""
        if self._staging is None or self._staging.size < size:
            if self._staging is not None:
                self._staging.free()
            self._staging = Memory(self, max(size, 1 << 20), host_visible=True)
        return self._staging

    # -- transfers ---------------------------------------------------------------------------------
    def write(self, mem: Memory, offset: int, data: np.ndarray) -> None:
        raw = data.reshape(-1).view(np.uint8)
        self.wait()  # a dispatch in flight may still read these bytes
        if mem.host is not None:
            mem.host[offset: offset + raw.size] = raw
            return
        with self.lock:
            stage = self.staging(raw.size)
            stage.host[: raw.size] = raw
            self.copy(stage, 0, mem, offset, raw.size)

    def read(self, mem: Memory, offset: int, nbytes: int) -> np.ndarray:
        self.wait()  # a dispatch in flight may still write these bytes
        if mem.host is not None:
            return mem.host[offset: offset + nbytes].copy()
        with self.lock:
            stage = self.staging(nbytes)
            self.copy(mem, offset, stage, 0, nbytes)
            return stage.host[:nbytes].copy()

    def _one_time(self, record) -> None:
        """Record commands with `record(cb)` into the transfer command buffer, submit, wait."""
        vk = self.vk
        with self.lock:
            cb = self._transfer
            vk.vkResetCommandBuffer(cb, 0)
            vk.vkBeginCommandBuffer(cb, vk.VkCommandBufferBeginInfo(
                flags=vk.VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT))
            record(cb)
            vk.vkEndCommandBuffer(cb)
            self.submit(cb)

    def fill(self, mem: Memory, value: int) -> None:
        """Every byte of `mem` set to `value` (vkCmdFillBuffer fills whole words)."""
        word = (value & 0xFF) * 0x01010101
        self._one_time(lambda cb: self.vk.vkCmdFillBuffer(cb, mem.buffer, 0, mem.size // 4 * 4, word))
        tail = mem.size % 4
        if tail:
            self.write(mem, mem.size - tail, np.full(tail, value & 0xFF, np.uint8))

    def copy(self, src: Memory, src_offset: int, dst: Memory, dst_offset: int, nbytes: int) -> None:
        """vkCmdCopyBuffer, submitted and waited for."""
        if nbytes == 0:
            return
        region = self.vk.VkBufferCopy(srcOffset=src_offset, dstOffset=dst_offset, size=nbytes)
        self._one_time(lambda cb: self.vk.vkCmdCopyBuffer(cb, src.buffer, dst.buffer, 1, [region]))

    # -- pipelines -------------------------------------------------------------------------------
    def _pipeline_cache_path(self):
        from llamir_vulkan.shaders import cache_dir

        safe = "".join(c if c.isalnum() else "_" for c in self.info.name)
        return cache_dir() / f"pipelines-{safe}.bin"

    def _load_pipeline_cache(self):
        """A VkPipelineCache seeded from the last run's data (drivers that compile pipelines to
        machine code keep it there; the driver ignores data that is not its own)."""
        vk = self.vk
        path = self._pipeline_cache_path()
        data = path.read_bytes() if path.exists() else b""
        if data:
            info = vk.VkPipelineCacheCreateInfo(initialDataSize=len(data), pInitialData=vk.ffi.from_buffer(data))
        else:
            info = vk.VkPipelineCacheCreateInfo()
        return vk.vkCreatePipelineCache(self.device, info, None)

    def save_pipeline_cache(self) -> None:
        vk, ffi = self.vk, self.vk.ffi
        n = ffi.new("size_t*")
        if vk.lib.vkGetPipelineCacheData(self.device, self.pipeline_cache, n, ffi.NULL) != vk.VK_SUCCESS:
            return
        data = ffi.new("char[]", n[0])
        if vk.lib.vkGetPipelineCacheData(self.device, self.pipeline_cache, n, data) != vk.VK_SUCCESS:
            return
        path = self._pipeline_cache_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(bytes(ffi.buffer(data, n[0])))
        os.replace(tmp, path)

    def pipeline(self, name: str, spirv: bytes, n_bindings: int) -> Pipeline:
        """The compute pipeline of a SPIR-V module (cached by its code): binding 0 is the params
        buffer, bindings 1..n-1 the tensors, all storage buffers."""
        key = (name, spirv)
        hit = self.pipelines.get(key)
        if hit is not None:
            return hit
        vk, dev = self.vk, self.device
        module = vk.vkCreateShaderModule(dev, vk.VkShaderModuleCreateInfo(codeSize=len(spirv), pCode=spirv), None)
        bindings = [vk.VkDescriptorSetLayoutBinding(
            binding=i, descriptorType=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, descriptorCount=1,
            stageFlags=vk.VK_SHADER_STAGE_COMPUTE_BIT) for i in range(n_bindings)]
        set_layout = vk.vkCreateDescriptorSetLayout(dev, vk.VkDescriptorSetLayoutCreateInfo(pBindings=bindings), None)
        layout = vk.vkCreatePipelineLayout(dev, vk.VkPipelineLayoutCreateInfo(pSetLayouts=[set_layout]), None)
        stage = vk.VkPipelineShaderStageCreateInfo(stage=vk.VK_SHADER_STAGE_COMPUTE_BIT, module=module, pName="main")
        handle = vk.vkCreateComputePipelines(dev, self.pipeline_cache, 1, [
            vk.VkComputePipelineCreateInfo(stage=stage, layout=layout)], None)[0]
        pipe = Pipeline(name, n_bindings, set_layout, layout, handle, module)
        self.pipelines[key] = pipe
        return pipe

    # -- command buffers -------------------------------------------------------------------------
    def command_buffer(self):
        vk = self.vk
        return vk.vkAllocateCommandBuffers(self.device, vk.VkCommandBufferAllocateInfo(
            commandPool=self.pool, level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY, commandBufferCount=1))[0]

    def submit(self, cb, wait: bool = True) -> None:
        """Submit a command buffer, signalling the fence; wait for it unless `wait` is False
        (then the next submit, transfer or `wait()` does: one submission is in flight at most)."""
        vk = self.vk
        with self.lock:
            self.wait()
            vk.vkQueueSubmit(self.queue, 1, [vk.VkSubmitInfo(pCommandBuffers=[cb])], self.fence)
            self._in_flight = True
            self.n_submits += 1
            if wait:
                self.wait()

    def wait(self) -> None:
        """Wait for the submission in flight, if any (vkWaitForFences)."""
        vk = self.vk
        with self.lock:
            if self._in_flight:
                vk.vkWaitForFences(self.device, 1, [self.fence], vk.VK_TRUE, UINT64_MAX)
                vk.vkResetFences(self.device, 1, [self.fence])
                self._in_flight = False

    def close(self) -> None:
        vk, dev = self.vk, self.device
        if dev is None:
            return
        vk.vkDeviceWaitIdle(dev)
        if self.pipelines:
            self.save_pipeline_cache()
        if self._staging is not None:
            self._staging.free()
        for p in self.pipelines.values():
            vk.vkDestroyPipeline(dev, p.handle, None)
            vk.vkDestroyPipelineLayout(dev, p.layout, None)
            vk.vkDestroyDescriptorSetLayout(dev, p.set_layout, None)
            vk.vkDestroyShaderModule(dev, p.module, None)
        self.pipelines.clear()
        vk.vkDestroyPipelineCache(dev, self.pipeline_cache, None)
        vk.vkDestroyFence(dev, self.fence, None)
        vk.vkDestroyCommandPool(dev, self.pool, None)
        vk.vkDestroyDevice(dev, None)
        self.device = None


class Recording:
    """A command buffer of dispatches, recorded once and submitted as often as it is needed
    (ggml-vulkan records a graph's command buffers each compute; llamir keeps them while the
    graph is reused). It owns its descriptor pool and sets, and the params buffer its
    dispatches read their shapes and constants from."""

    def __init__(self, gpu: Gpu, dispatches: list, params: np.ndarray, param_offsets: list[int]):
        vk, dev = gpu.vk, gpu.device
        self.gpu = gpu
        self.n_dispatches = len(dispatches)
        n_sets = max(len(dispatches), 1)
        n_desc = max(sum(len(d.bindings) + 1 for d in dispatches), 1)
        self.pool = vk.vkCreateDescriptorPool(dev, vk.VkDescriptorPoolCreateInfo(maxSets=n_sets, pPoolSizes=[
            vk.VkDescriptorPoolSize(type=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, descriptorCount=n_desc)]), None)
        self.params = Memory(gpu, max(params.nbytes, 16), host_visible=True)
        self.params.host[: params.nbytes] = params.view(np.uint8)
        self.cb = gpu.command_buffer()
        vk.vkBeginCommandBuffer(self.cb, vk.VkCommandBufferBeginInfo(flags=0))
        barrier = vk.VkMemoryBarrier(
            srcAccessMask=vk.VK_ACCESS_SHADER_WRITE_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT,
            dstAccessMask=vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_SHADER_WRITE_BIT
            | vk.VK_ACCESS_TRANSFER_READ_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT)
        stages = vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | vk.VK_PIPELINE_STAGE_TRANSFER_BIT
        touched: set = set()  # memory read or written since the last barrier
        written: set = set()  # memory written since the last barrier
        for d, p_off in zip(dispatches, param_offsets, strict=True):
            uses = {id(b.memory) for b in d.bindings}
            writes = {id(b.memory) for b in d.bindings if b.written}
            if uses & written or writes & touched:  # read after write, write after read or write
                vk.vkCmdPipelineBarrier(self.cb, stages, stages, 0, 1, [barrier], 0, None, 0, None)
                touched, written = set(), set()
            touched |= uses
            written |= writes
            if d.copy is not None:
                src, src_off, dst, dst_off, n = d.copy
                vk.vkCmdCopyBuffer(self.cb, src.buffer, dst.buffer, 1, [vk.VkBufferCopy(
                    srcOffset=src_off, dstOffset=dst_off, size=n)])
                continue
            pipe = d.pipeline
            dset = vk.vkAllocateDescriptorSets(dev, vk.VkDescriptorSetAllocateInfo(
                descriptorPool=self.pool, pSetLayouts=[pipe.set_layout]))[0]
            infos = [(self.params.buffer, p_off, max(d.params.nbytes, 4))] + [
                (b.memory.buffer, b.offset, b.range) for b in d.bindings]
            writes = [vk.VkWriteDescriptorSet(
                dstSet=dset, dstBinding=i, descriptorType=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                pBufferInfo=[vk.VkDescriptorBufferInfo(buffer=buf, offset=off, range=rng)])
                for i, (buf, off, rng) in enumerate(infos)]
            vk.vkUpdateDescriptorSets(dev, len(writes), writes, 0, None)
            vk.vkCmdBindPipeline(self.cb, vk.VK_PIPELINE_BIND_POINT_COMPUTE, pipe.handle)
            vk.vkCmdBindDescriptorSets(self.cb, vk.VK_PIPELINE_BIND_POINT_COMPUTE, pipe.layout, 0, 1, [dset], 0,
                                       None)
            vk.vkCmdDispatch(self.cb, *d.groups)
        # the results are read by transfers and the host after the submit
        vk.vkCmdPipelineBarrier(self.cb, stages, stages | vk.VK_PIPELINE_STAGE_HOST_BIT, 0, 1, [
            vk.VkMemoryBarrier(srcAccessMask=vk.VK_ACCESS_SHADER_WRITE_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT,
                               dstAccessMask=vk.VK_ACCESS_HOST_READ_BIT | vk.VK_ACCESS_TRANSFER_READ_BIT
                               | vk.VK_ACCESS_SHADER_READ_BIT)], 0, None, 0, None)
        vk.vkEndCommandBuffer(self.cb)

    def submit(self, wait: bool = True) -> None:
        self.gpu.submit(self.cb, wait)

    def free(self) -> None:
        vk, gpu = self.gpu.vk, self.gpu
        if self.cb is None or gpu.device is None:
            return
        gpu.wait()
        vk.vkFreeCommandBuffers(gpu.device, gpu.pool, 1, [self.cb])
        vk.vkDestroyDescriptorPool(gpu.device, self.pool, None)
        self.params.free()
        self.cb = None
