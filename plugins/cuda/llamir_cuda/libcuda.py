"""NVIDIA's CUDA driver API (libcuda.so.1) through ctypes, with no dependency, as tinygrad does.

Every call's CUresult is checked and a failure names the call and the driver's error. Symbols are
the ones cuda.h (CUDA 13.0) resolves its API names to: cuMemAlloc is cuMemAlloc_v2, cuStreamBeginCapture
is cuStreamBeginCapture_v2, cuGraphInstantiate is cuGraphInstantiateWithFlags, and so on. Each
context is its device's primary context, made current on whichever thread calls into it.
"""

from __future__ import annotations

import ctypes
import numbers
import operator
import os
import threading
from ctypes import POINTER, c_char_p, c_float, c_int, c_size_t, c_ubyte, c_uint, c_uint64, c_ulonglong, c_void_p
from dataclasses import dataclass

import numpy as np

from .driver import DeviceContext, DeviceInfo, Driver, DriverError

LIBRARY = "libcuda.so.1"
LIBRARY_ENV = "LLAMIR_CUDA_LIBRARY"

# Values from cuda.h (CUDA 13.0).
CUDA_SUCCESS = 0
CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 1
CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK = 8
CU_DEVICE_ATTRIBUTE_WARP_SIZE = 10
CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
CU_STREAM_NON_BLOCKING = 0x1
CU_EVENT_DISABLE_TIMING = 0x2
CU_STREAM_CAPTURE_MODE_RELAXED = 2
CU_JIT_ERROR_LOG_BUFFER = 5
CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES = 6
JIT_LOG_BYTES = 16 << 10

# Why cuInit fails on a machine, in words a user can act on (the driver's own string follows).
INIT_HINTS = {
    34: "this libcuda is the CUDA toolkit's stub library, not an NVIDIA driver's",
    100: "the NVIDIA driver sees no GPU (none installed, or hidden by CUDA_VISIBLE_DEVICES or the container)",
    803: "the user-space driver (libcuda) and the kernel module are different versions",
    804: "the forward-compatibility driver does not support this GPU",
}

_DEVICE = c_int  # CUdevice
_PTR = c_uint64  # CUdeviceptr
_HANDLE = c_void_p  # CUcontext, CUmodule, CUfunction, CUstream, CUevent, CUgraph, CUgraphExec

# Every function this module calls, by the symbol cuda.h resolves its name to, with its parameters.
SIGNATURES: dict[str, tuple] = {
    "cuInit": (c_uint,),
    "cuDriverGetVersion": (POINTER(c_int),),
    "cuGetErrorName": (c_int, POINTER(c_char_p)),
    "cuGetErrorString": (c_int, POINTER(c_char_p)),
    "cuDeviceGetCount": (POINTER(c_int),),
    "cuDeviceGet": (POINTER(_DEVICE), c_int),
    "cuDeviceGetName": (c_char_p, c_int, _DEVICE),
    "cuDeviceTotalMem_v2": (POINTER(c_size_t), _DEVICE),
    "cuDeviceGetAttribute": (POINTER(c_int), c_int, _DEVICE),
    "cuDevicePrimaryCtxRetain": (POINTER(_HANDLE), _DEVICE),
    "cuDevicePrimaryCtxRelease_v2": (_DEVICE,),
    "cuCtxSetCurrent": (_HANDLE,),
    "cuMemAlloc_v2": (POINTER(_PTR), c_size_t),
    "cuMemFree_v2": (_PTR,),
    "cuMemHostAlloc": (POINTER(c_void_p), c_size_t, c_uint),
    "cuMemFreeHost": (c_void_p,),
    "cuMemcpyHtoDAsync_v2": (_PTR, c_void_p, c_size_t, _HANDLE),
    "cuMemcpyDtoHAsync_v2": (c_void_p, _PTR, c_size_t, _HANDLE),
    "cuMemcpyDtoDAsync_v2": (_PTR, _PTR, c_size_t, _HANDLE),
    "cuMemsetD8Async": (_PTR, c_ubyte, c_size_t, _HANDLE),
    "cuModuleLoadDataEx": (POINTER(_HANDLE), c_void_p, c_uint, POINTER(c_int), POINTER(c_void_p)),
    "cuModuleGetFunction": (POINTER(_HANDLE), _HANDLE, c_char_p),
    "cuModuleUnload": (_HANDLE,),
    "cuLaunchKernel": (_HANDLE, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, _HANDLE,
                       POINTER(c_void_p), POINTER(c_void_p)),
    "cuStreamCreate": (POINTER(_HANDLE), c_uint),
    "cuStreamSynchronize": (_HANDLE,),
    "cuStreamDestroy_v2": (_HANDLE,),
    "cuStreamWaitEvent": (_HANDLE, _HANDLE, c_uint),
    "cuEventCreate": (POINTER(_HANDLE), c_uint),
    "cuEventRecord": (_HANDLE, _HANDLE),
    "cuEventSynchronize": (_HANDLE,),
    "cuEventElapsedTime_v2": (POINTER(c_float), _HANDLE, _HANDLE),
    "cuEventDestroy_v2": (_HANDLE,),
    "cuStreamBeginCapture_v2": (_HANDLE, c_int),
    "cuStreamEndCapture": (_HANDLE, POINTER(_HANDLE)),
    "cuGraphInstantiateWithFlags": (POINTER(_HANDLE), _HANDLE, c_ulonglong),
    "cuGraphDestroy": (_HANDLE,),
    "cuGraphLaunch": (_HANDLE, _HANDLE),
    "cuGraphExecDestroy": (_HANDLE,),
}

PARAM_TYPES = {"p": ctypes.c_uint64, "i": ctypes.c_int32, "l": ctypes.c_int64, "f": ctypes.c_float}
_INT_RANGES = {"p": (0, (1 << 64) - 1), "i": (-(1 << 31), (1 << 31) - 1), "l": (-(1 << 63), (1 << 63) - 1)}


def format_error(call: str, code: int, name: str | None, text: str | None) -> str:
    """`call` failed with CUresult `code`, spelled as cuGetErrorName / cuGetErrorString give it."""
    if name is None:
        return f"{call} failed: CUresult {code} (the driver does not know this code)"
    return f"{call} failed: {name} ({text})" if text else f"{call} failed: {name}"


def pack_args(signature, args, kernel: str = "kernel") -> tuple[ctypes.Array, tuple]:
    """cuLaunchKernel's kernelParams for `args` of a kernel with parameter kinds `signature`:
    an array of void* to one ctypes value per argument, and those values, which must stay alive
    until the launch call returned (the array does not keep them)."""
    if len(args) != len(signature):
        raise DriverError(f"{kernel} takes {len(signature)} arguments ({', '.join(signature)}), got {len(args)}")
    values = tuple(_param_value(kind, arg, kernel, position)
                   for position, (kind, arg) in enumerate(zip(signature, args)))
    pointers = (c_void_p * len(values))(*(ctypes.addressof(value) for value in values))
    return pointers, values


def _param_value(kind: str, arg, kernel: str, position: int):
    ctype = PARAM_TYPES.get(kind)
    if ctype is None:
        raise DriverError(f"{kernel}: parameter {position} has kind {kind!r}; the kinds are p, i, l and f")
    if kind == "f":
        if not isinstance(arg, numbers.Real):
            raise DriverError(f"{kernel}: argument {position} (f) must be a number, got {type(arg).__name__} {arg!r}")
        return ctype(arg)
    try:
        value = operator.index(arg)
    except TypeError:
        raise DriverError(f"{kernel}: argument {position} ({kind}) must be an integer, "
                          f"got {type(arg).__name__} {arg!r}") from None
    low, high = _INT_RANGES[kind]
    if not low <= value <= high:
        raise DriverError(f"{kernel}: argument {position} ({kind}) = {value} does not fit a {ctype.__name__}")
    return ctype(value)


def _open_library(path: str, source: str) -> ctypes.CDLL:
    try:
        return ctypes.CDLL(path)
    except OSError as err:
        if source == "default":
            missing = "not found" if "No such file" in str(err) or "cannot open" in str(err) else "cannot be loaded"
            raise DriverError(f"{path} {missing}: no NVIDIA driver is installed, or its libcuda is not on the "
                              f"dynamic loader's path ({err})") from err
        raise DriverError(f"{path} (given by {source}) cannot be loaded: {err}") from err


class LibCuda(Driver):
    """The CUDA driver in libcuda.so.1, or the library LLAMIR_CUDA_LIBRARY or `path` names."""

    name = "libcuda"

    def __init__(self, path: str | None = None):
        source = "the path argument" if path else LIBRARY_ENV if os.environ.get(LIBRARY_ENV) else "default"
        self.path = path or os.environ.get(LIBRARY_ENV) or LIBRARY
        self._library = _open_library(self.path, source)
        self._functions: dict[str, object] = {}  # symbol -> its ctypes function, typed on first use
        self._current = threading.local()  # .context: the LibCudaContext this thread made current
        self._contexts: dict[int, LibCudaContext] = {}
        self._devices: list[DeviceInfo] | None = None
        self._handles: list[int] = []
        result = self._function("cuInit")(0)
        if result != CUDA_SUCCESS:
            hint = INIT_HINTS.get(result, "the NVIDIA driver cannot be initialized")
            raise DriverError(f"CUDA driver {self.path} is not usable: {hint}; "
                              f"{self.describe_failure('cuInit', result)}")
        version = c_int()
        self.call("cuDriverGetVersion", ctypes.byref(version))
        self.driver_version = version.value  # 1000 * major + 10 * minor, e.g. 12040

    # -- calls -----------------------------------------------------------------------------------
    def _function(self, symbol: str):
        function = self._functions.get(symbol)
        if function is None:
            try:
                function = getattr(self._library, symbol)
            except AttributeError:
                version = getattr(self, "driver_version", None)
                why = f"its CUDA version {version} is older than this backend needs" if version else "not a CUDA driver"
                raise DriverError(f"{self.path} has no {symbol}: {why}") from None
            function.argtypes = SIGNATURES[symbol]
            function.restype = c_int
            self._functions[symbol] = function
        return function

    def call(self, symbol: str, *args, about: str = "") -> None:
        """Call `symbol` and raise DriverError naming it (and `about`, what it was doing) on failure."""
        result = self._function(symbol)(*args)
        if result != CUDA_SUCCESS:
            failure = self.describe_failure(symbol, result)
            raise DriverError(f"{about}: {failure}" if about else failure)

    def describe_failure(self, symbol: str, code: int) -> str:
        """format_error for `code`, with the names the driver gives it."""
        name, text = c_char_p(), c_char_p()
        if self._function("cuGetErrorName")(code, ctypes.byref(name)) != CUDA_SUCCESS or not name.value:
            return format_error(symbol, code, None, None)
        self._function("cuGetErrorString")(code, ctypes.byref(text))
        return format_error(symbol, code, name.value.decode(), text.value.decode() if text.value else None)

    # -- devices ---------------------------------------------------------------------------------
    def devices(self) -> list[DeviceInfo]:
        if self._devices is None:
            count = c_int()
            self.call("cuDeviceGetCount", ctypes.byref(count))
            self._handles = [self._device_handle(index) for index in range(count.value)]
            self._devices = [self._device_info(index, handle) for index, handle in enumerate(self._handles)]
        return list(self._devices)

    def _device_handle(self, index: int) -> int:
        device = _DEVICE()
        self.call("cuDeviceGet", ctypes.byref(device), index)
        return device.value

    def _device_info(self, index: int, device: int) -> DeviceInfo:
        name = ctypes.create_string_buffer(256)
        self.call("cuDeviceGetName", name, len(name), device)
        total = c_size_t()
        self.call("cuDeviceTotalMem_v2", ctypes.byref(total), device)

        def attribute(which: int) -> int:
            value = c_int()
            self.call("cuDeviceGetAttribute", ctypes.byref(value), which, device, about=f"attribute {which}")
            return value.value

        return DeviceInfo(
            index=index,
            name=name.value.decode(errors="replace"),
            compute_capability=(attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                                attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)),
            total_memory=total.value,
            multiprocessors=attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
            max_shared_per_block=attribute(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK),
            max_threads_per_block=attribute(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK),
            warp_size=attribute(CU_DEVICE_ATTRIBUTE_WARP_SIZE),
        )

    def context(self, index: int) -> LibCudaContext:
        infos = self.devices()
        if not 0 <= index < len(infos):
            raise DriverError(f"no CUDA device {index}: the driver sees {len(infos)}")
        if index not in self._contexts:
            self._contexts[index] = LibCudaContext(self, infos[index], self._handles[index])
        return self._contexts[index]

    def make_current(self, context: LibCudaContext) -> None:
        """Bind `context` to the calling thread unless this driver already did so on it."""
        if getattr(self._current, "context", None) is not context:
            self.call("cuCtxSetCurrent", context.handle)
            self._current.context = context

    def forget(self, context: LibCudaContext) -> None:
        """`context` was closed: context() makes a new one next time."""
        if self._contexts.get(context.info.index) is context:
            del self._contexts[context.info.index]
        if getattr(self._current, "context", None) is context:
            self._current.context = None

    def close(self) -> None:
        """Close every context this driver made."""
        for context in list(self._contexts.values()):
            context.close()


@dataclass(frozen=True)
class CudaFunction:
    """A loaded kernel: its entry point in a module, with the signature its launches are packed by."""

    name: str
    params: tuple[str, ...]
    handle: int


class LibCudaContext(DeviceContext):
    """The primary context of one device; released by `close`, with the streams, events, modules
    and graphs made through it."""

    supports_graphs = True

    def __init__(self, driver: LibCuda, info: DeviceInfo, device: int):
        self.info = info
        self._driver = driver
        self._device = device
        handle = _HANDLE()
        driver.call("cuDevicePrimaryCtxRetain", ctypes.byref(handle), device, about=f"device {info.index}")
        self.handle = handle.value
        self._closed = False
        self._host: dict[int, int] = {}  # pinned address -> bytes
        self._functions: dict[object, CudaFunction] = {}
        self._modules: list[int] = []
        self._streams: list[int] = []
        self._events: list[int] = []
        self._graphs: set[int] = set()
        self._load_lock = threading.Lock()

    def _enter(self) -> LibCuda:
        if self._closed:
            raise DriverError(f"the context of CUDA device {self.info.index} is closed")
        self._driver.make_current(self)
        return self._driver

    # -- memory ----------------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> int:
        ptr = _PTR()
        self._enter().call("cuMemAlloc_v2", ctypes.byref(ptr), nbytes, about=f"alloc({nbytes})")
        return ptr.value

    def free(self, ptr: int) -> None:
        self._enter().call("cuMemFree_v2", ptr, about=f"free({ptr:#x})")

    def alloc_host(self, nbytes: int) -> np.ndarray:
        address = c_void_p()
        self._enter().call("cuMemHostAlloc", ctypes.byref(address), nbytes, 0, about=f"alloc_host({nbytes})")
        self._host[address.value] = nbytes
        return np.ctypeslib.as_array(ctypes.cast(address, POINTER(ctypes.c_uint8)), shape=(nbytes,))

    def free_host(self, array: np.ndarray) -> None:
        address = array.ctypes.data
        if self._host.get(address) != array.nbytes:
            raise DriverError(f"free_host: the array at {address:#x} ({array.nbytes} bytes) is not a whole "
                              f"allocation of alloc_host")
        self._enter().call("cuMemFreeHost", address)
        del self._host[address]

    def memcpy_htod_async(self, dst: int, src: np.ndarray, stream=None) -> None:
        if not src.flags.c_contiguous:
            raise DriverError(f"memcpy_htod_async: src (shape {src.shape}, strides {src.strides}) is not C-contiguous")
        self._enter().call("cuMemcpyHtoDAsync_v2", dst, src.ctypes.data, src.nbytes, stream,
                           about=f"memcpy_htod_async({dst:#x}, {src.nbytes} bytes)")

    def memcpy_dtoh_async(self, dst: np.ndarray, src: int, stream=None) -> None:
        if not (dst.flags.c_contiguous and dst.flags.writeable):
            raise DriverError(f"memcpy_dtoh_async: dst (shape {dst.shape}, strides {dst.strides}) is not a "
                              f"writeable C-contiguous array")
        self._enter().call("cuMemcpyDtoHAsync_v2", dst.ctypes.data, src, dst.nbytes, stream,
                           about=f"memcpy_dtoh_async({src:#x}, {dst.nbytes} bytes)")

    def memcpy_dtod_async(self, dst: int, src: int, nbytes: int, stream=None) -> None:
        self._enter().call("cuMemcpyDtoDAsync_v2", dst, src, nbytes, stream,
                           about=f"memcpy_dtod_async({dst:#x}, {src:#x}, {nbytes})")

    def memset_async(self, dst: int, value: int, nbytes: int, stream=None) -> None:
        if not 0 <= value <= 255:
            raise DriverError(f"memset_async: value {value} is not a byte (0..255)")
        self._enter().call("cuMemsetD8Async", dst, value, nbytes, stream,
                           about=f"memset_async({dst:#x}, {value}, {nbytes})")

    # -- kernels ---------------------------------------------------------------------------------
    def load(self, kernel) -> CudaFunction:
        """The kernel's PTX for this GPU JIT-compiled by the driver; a JIT error carries its log."""
        function = self._functions.get(kernel.key)
        if function is not None:
            return function
        with self._load_lock:
            if kernel.key not in self._functions:
                self._functions[kernel.key] = self._load_module(kernel)
            return self._functions[kernel.key]

    def _load_module(self, kernel) -> CudaFunction:
        driver = self._enter()
        ptx = kernel.ptx(self.info.arch).encode() + b"\0"
        log = ctypes.create_string_buffer(JIT_LOG_BYTES)
        options = (c_int * 2)(CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES)
        values = (c_void_p * 2)(ctypes.addressof(log), JIT_LOG_BYTES)
        module = _HANDLE()
        try:
            driver.call("cuModuleLoadDataEx", ctypes.byref(module), ptx, 2, options, values,
                        about=f"loading kernel {kernel.name} for {self.info.arch}")
        except DriverError as err:
            message = log.value.decode(errors="replace").strip()
            raise DriverError(f"{err}\n{message}" if message else str(err)) from None
        self._modules.append(module.value)
        function = _HANDLE()
        driver.call("cuModuleGetFunction", ctypes.byref(function), module, kernel.name.encode(),
                    about=f"kernel {kernel.name}")
        return CudaFunction(kernel.name, tuple(kernel.params), function.value)

    def launch(self, function: CudaFunction, grid: tuple[int, int, int], block: tuple[int, int, int],
               args: list, stream=None) -> None:
        driver = self._enter()
        if len(grid) != 3 or len(block) != 3:
            raise DriverError(f"launch of {function.name}: grid {grid} and block {block} must have 3 dimensions")
        params, values = pack_args(function.params, args, function.name)
        driver.call("cuLaunchKernel", function.handle, *grid, *block, 0, stream, params, None,
                    about=f"launch of {function.name} over grid {tuple(grid)}, block {tuple(block)}")
        del values  # the driver has copied the parameters once cuLaunchKernel returned

    # -- streams and events ----------------------------------------------------------------------
    def stream_new(self) -> int:
        stream = _HANDLE()
        self._enter().call("cuStreamCreate", ctypes.byref(stream), CU_STREAM_NON_BLOCKING)
        self._streams.append(stream.value)
        return stream.value

    def stream_synchronize(self, stream=None) -> None:
        self._enter().call("cuStreamSynchronize", stream)

    def event_new(self, timing: bool = False) -> int:
        event = _HANDLE()
        self._enter().call("cuEventCreate", ctypes.byref(event), 0 if timing else CU_EVENT_DISABLE_TIMING)
        self._events.append(event.value)
        return event.value

    def event_elapsed(self, start, end) -> float:
        milliseconds = c_float()
        self._enter().call("cuEventElapsedTime_v2", ctypes.byref(milliseconds), start, end)
        return milliseconds.value / 1e3

    def event_record(self, event, stream=None) -> None:
        self._enter().call("cuEventRecord", event, stream)

    def event_synchronize(self, event) -> None:
        self._enter().call("cuEventSynchronize", event)

    def stream_wait_event(self, stream, event) -> None:
        self._enter().call("cuStreamWaitEvent", stream, event, 0)

    # -- CUDA graphs -----------------------------------------------------------------------------
    def begin_capture(self, stream) -> None:
        """Record what `stream` is given from now on instead of running it (a stream of
        stream_new: the default stream cannot be captured)."""
        if stream is None:
            raise DriverError("begin_capture: the default stream cannot be captured; use a stream of stream_new")
        self._enter().call("cuStreamBeginCapture_v2", stream, CU_STREAM_CAPTURE_MODE_RELAXED)

    def end_capture(self, stream) -> int:
        driver = self._enter()
        graph = _HANDLE()
        driver.call("cuStreamEndCapture", stream, ctypes.byref(graph))
        if not graph.value:
            raise DriverError("end_capture: the capture was invalidated (the driver returned no graph)")
        executable = _HANDLE()
        try:
            driver.call("cuGraphInstantiateWithFlags", ctypes.byref(executable), graph, 0)
        finally:
            driver.call("cuGraphDestroy", graph)
        self._graphs.add(executable.value)
        return executable.value

    def graph_launch(self, graph, stream=None) -> None:
        self._enter().call("cuGraphLaunch", graph, stream)

    def graph_free(self, graph) -> None:
        self._enter().call("cuGraphExecDestroy", graph)
        self._graphs.discard(graph)

    # -- lifetime --------------------------------------------------------------------------------
    def close(self) -> None:
        """Destroy what this context made and release the primary context. Every release is
        attempted; the first failure is raised afterwards."""
        if self._closed:
            return
        driver = self._enter()
        releases = ([("cuGraphExecDestroy", graph) for graph in self._graphs]
                    + [("cuEventDestroy_v2", event) for event in self._events]
                    + [("cuStreamDestroy_v2", stream) for stream in self._streams]
                    + [("cuModuleUnload", module) for module in self._modules]
                    + [("cuMemFreeHost", address) for address in self._host]
                    + [("cuDevicePrimaryCtxRelease_v2", self._device)])
        self._closed = True
        driver.forget(self)
        failures = []
        for symbol, handle in releases:
            try:
                driver.call(symbol, handle)
            except DriverError as err:
                failures.append(str(err))
        if failures:
            raise DriverError(f"closing the context of CUDA device {self.info.index}: " + "; ".join(failures))
