"""LibCuda: NVIDIA's CUDA driver through ctypes.

Without a GPU: what a machine without a usable driver reports, kernel parameter packing, error
formatting, every bound signature against cuda.h, and LibCuda's plumbing over fake_libcuda.c (a
stand-in libcuda compiled against cuda.h). With one (`gpu`): memory, streams, events, hand-written
PTX kernels and a CUDA graph of one, checked against numpy.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import itertools
import os
import pathlib
import re
import shutil
import subprocess
import threading
from dataclasses import dataclass, field

import numpy as np
import pytest
from llamir_cuda import libcuda
from llamir_cuda.driver import DeviceInfo, DriverError
from llamir_cuda.libcuda import CudaFunction, LibCuda, format_error, pack_args

HERE = pathlib.Path(__file__).parent
PTX_HEADER = ".version 7.0\n.target sm_75\n.address_size 64\n"


@dataclass
class PtxKernel:
    """What LibCudaContext.load needs of a kernel: hand-written PTX, and the archs it was asked for."""

    name: str
    params: tuple[str, ...]
    body: str
    asked: list[str] = field(default_factory=list)
    serial: int = field(default_factory=itertools.count().__next__)  # each object its own cache entry

    @property
    def key(self) -> tuple[str, int]:
        return (self.name, self.serial)

    def ptx(self, arch: str) -> str:
        self.asked.append(arch)
        return PTX_HEADER + self.body


# x[i] += 1.0 for i < n
ADD_ONE = PtxKernel("add_one", ("p", "i"), """
.visible .entry add_one(.param .u64 x, .param .u32 n)
{
    .reg .pred %p;
    .reg .b32 %r<5>;
    .reg .f32 %f<3>;
    .reg .b64 %rd<4>;
    ld.param.u64 %rd1, [x];
    ld.param.u32 %r1, [n];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mad.lo.s32 %r2, %r2, %r3, %r4;
    setp.ge.s32 %p, %r2, %r1;
    @%p bra DONE;
    cvta.to.global.u64 %rd1, %rd1;
    mul.wide.s32 %rd2, %r2, 4;
    add.s64 %rd3, %rd1, %rd2;
    ld.global.f32 %f1, [%rd3];
    add.f32 %f2, %f1, 0f3F800000;
    st.global.f32 [%rd3], %f2;
DONE:
    ret;
}
""")

# out[0:4] = a (int32), out[8:16] = b (int64), out[16:20] = c (float32)
ECHO = PtxKernel("echo", ("p", "i", "l", "f"), """
.visible .entry echo(.param .u64 out, .param .u32 a, .param .u64 b, .param .f32 c)
{
    .reg .b32 %r1;
    .reg .b64 %rd<3>;
    .reg .f32 %f1;
    ld.param.u64 %rd1, [out];
    cvta.to.global.u64 %rd1, %rd1;
    ld.param.u32 %r1, [a];
    ld.param.u64 %rd2, [b];
    ld.param.f32 %f1, [c];
    st.global.u32 [%rd1], %r1;
    st.global.u64 [%rd1+8], %rd2;
    st.global.f32 [%rd1+16], %f1;
    ret;
}
""")

# An unknown instruction on line 7 of the module (the header is lines 1-3).
BROKEN = PtxKernel("broken", (), "\n.visible .entry broken()\n{\n    bogus.instruction %r1;\n    ret;\n}\n")


# -- no driver ---------------------------------------------------------------------------------------
def test_missing_library_names_the_path_and_the_reason(tmp_path):
    path = str(tmp_path / "libcuda.so.1")
    with pytest.raises(DriverError) as err:
        LibCuda(path)
    message = str(err.value)
    assert path in message and "the path argument" in message and "No such file" in message


def test_library_named_by_the_environment(tmp_path, monkeypatch):
    path = str(tmp_path / "elsewhere.so")
    monkeypatch.setenv("LLAMIR_CUDA_LIBRARY", path)
    with pytest.raises(DriverError, match="LLAMIR_CUDA_LIBRARY") as err:
        LibCuda()
    assert path in str(err.value)


def test_no_driver_installed(monkeypatch):
    monkeypatch.delenv("LLAMIR_CUDA_LIBRARY", raising=False)
    monkeypatch.setattr(libcuda, "LIBRARY", "libcuda-absent-llamir.so.1")
    with pytest.raises(DriverError, match=r"^libcuda-absent-llamir\.so\.1 not found: no NVIDIA driver is installed"):
        LibCuda()


def test_a_library_that_is_not_a_cuda_driver():
    libm = ctypes.util.find_library("m")
    if libm is None:
        pytest.skip("no libm to load")
    with pytest.raises(DriverError, match="has no cuInit: not a CUDA driver"):
        LibCuda(libm)


# -- kernel parameters -------------------------------------------------------------------------------
def test_pack_args_points_each_slot_at_its_value_in_its_c_type():
    args = [0xABCD00001234, -7, -(1 << 40), 1.5]
    pointers, values = pack_args(("p", "i", "l", "f"), args, "k")
    ctypes_ = (ctypes.c_uint64, ctypes.c_int32, ctypes.c_int64, ctypes.c_float)
    assert [type(value) for value in values] == list(ctypes_)
    assert list(pointers) == [ctypes.addressof(value) for value in values]
    read = [ctypes.cast(slot, ctypes.POINTER(ctype)).contents.value for slot, ctype in zip(pointers, ctypes_)]
    assert read == args


def test_pack_args_takes_numpy_scalars_and_the_edges_of_each_range():
    pointers, values = pack_args("pilf", [np.uint64(2**64 - 1), np.int32(-2**31), 2**63 - 1, np.float32(0.25)])
    assert [value.value for value in values] == [2**64 - 1, -2**31, 2**63 - 1, 0.25]
    assert len(pointers) == 4


def test_pack_args_without_parameters():
    pointers, values = pack_args((), [])
    assert len(pointers) == 0 and values == ()


@pytest.mark.parametrize("signature, args, message", [
    ("pi", [1], r"^k takes 2 arguments \(p, i\), got 1$"),
    ("p", [1, 2], r"^k takes 1 arguments \(p\), got 2$"),
    ("p", [1.0], r"argument 0 \(p\) must be an integer, got float 1\.0"),
    ("p", [-1], r"argument 0 \(p\) = -1 does not fit"),
    ("ii", [0, 2**31], r"argument 1 \(i\) = 2147483648 does not fit"),
    ("l", [2**63], r"argument 0 \(l\) = 9223372036854775808 does not fit"),
    ("f", ["1.0"], r"argument 0 \(f\) must be a number, got str"),
    ("q", [1], r"parameter 0 has kind 'q'"),
])
def test_pack_args_rejects_what_the_signature_does_not_allow(signature, args, message):
    with pytest.raises(DriverError, match=message):
        pack_args(signature, args, "k")


# -- errors ------------------------------------------------------------------------------------------
def test_format_error_names_the_call_and_the_error():
    assert (format_error("cuMemAlloc_v2", 2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory")
            == "cuMemAlloc_v2 failed: CUDA_ERROR_OUT_OF_MEMORY (out of memory)")
    assert format_error("cuInit", 100, "CUDA_ERROR_NO_DEVICE", None) == "cuInit failed: CUDA_ERROR_NO_DEVICE"
    assert (format_error("cuInit", 4242, None, None)
            == "cuInit failed: CUresult 4242 (the driver does not know this code)")


# -- against cuda.h ----------------------------------------------------------------------------------
def _cuda_include() -> pathlib.Path | None:
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), *sorted(glob.glob("/usr/local/cuda*"))[::-1]]
    for root in roots:
        if root and (pathlib.Path(root) / "include" / "cuda.h").is_file():
            return pathlib.Path(root) / "include"
    return None


@pytest.fixture(scope="session")
def cuda_include() -> pathlib.Path:
    include = _cuda_include()
    if include is None:
        pytest.skip("no cuda.h (a CUDA toolkit) on this machine")
    if shutil.which("cc") is None:
        pytest.skip("no C compiler (cc) to read cuda.h with")
    return include


_HANDLES = {"CUcontext", "CUmodule", "CUfunction", "CUstream", "CUevent", "CUgraph", "CUgraphExec"}
_C_TYPES = {"int": ctypes.c_int, "unsigned int": ctypes.c_uint, "unsigned char": ctypes.c_ubyte,
            "unsigned long long": ctypes.c_ulonglong, "size_t": ctypes.c_size_t, "CUdeviceptr": ctypes.c_uint64,
            "CUdevice": ctypes.c_int, "CUresult": ctypes.c_int, "CUdevice_attribute": ctypes.c_int,
            "CUstreamCaptureMode": ctypes.c_int, "CUjit_option": ctypes.c_int, "float": ctypes.c_float}


def _ctype_of(declaration: str):
    """The ctypes type a C parameter declaration ('const void *srcHost') is passed as."""
    words = re.sub(r"\bconst\b", " ", declaration).replace("*", " * ").split()[:-1]  # less the name
    return _pointer_to(" ".join(word for word in words if word != "*"), words.count("*"))


def _pointer_to(base: str, stars: int):
    if stars == 0:
        return ctypes.c_void_p if base in _HANDLES else _C_TYPES[base]
    if stars == 1 and base in ("void", "char"):
        return ctypes.c_void_p if base == "void" else ctypes.c_char_p
    return ctypes.POINTER(_pointer_to(base, stars - 1))


def test_every_bound_symbol_is_cuda_h_s_with_its_parameters(cuda_include):
    # The preprocessed header is what a C program sees: its macros turn API names into the
    # symbols they stand for (cuMemAlloc -> cuMemAlloc_v2), and internal sections are gone.
    header = subprocess.run(["cc", "-E", "-P", f"-I{cuda_include}", "-"], input="#include <cuda.h>\n",
                            capture_output=True, text=True, check=True).stdout
    declared = {name: params for name, params in re.findall(r"CUresult\s+(\w+)\s*\(([^)]*)\)\s*;", header)}
    for symbol, argtypes in libcuda.SIGNATURES.items():
        assert symbol in declared, f"cuda.h declares no {symbol}"
        params = [p.strip() for p in declared[symbol].split(",") if p.strip() and p.strip() != "void"]
        assert list(argtypes) == [_ctype_of(p) for p in params], f"{symbol}({', '.join(params)})"


def test_enum_values_are_cuda_h_s(cuda_include):
    text = (cuda_include / "cuda.h").read_text()
    for name in ("CUDA_SUCCESS", "CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK", "CU_DEVICE_ATTRIBUTE_WARP_SIZE",
                 "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK", "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT",
                 "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR", "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR",
                 "CU_STREAM_NON_BLOCKING", "CU_EVENT_DISABLE_TIMING", "CU_STREAM_CAPTURE_MODE_RELAXED",
                 "CU_JIT_ERROR_LOG_BUFFER", "CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES"):
        value = re.search(rf"^\s*{name}\s*=\s*(0x[0-9a-fA-F]+|\d+)", text, re.MULTILINE)
        assert value is not None, name
        assert getattr(libcuda, name) == int(value.group(1), 0), name
    for code in libcuda.INIT_HINTS:
        assert re.search(rf"^\s*CUDA_ERROR_\w+\s*=\s*{code},", text, re.MULTILINE), code


# -- over a fake libcuda -----------------------------------------------------------------------------
@pytest.fixture(scope="session")
def fake_library(cuda_include, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("fake_libcuda") / "libcuda.so.1"
    subprocess.run(["cc", "-shared", "-fPIC", "-Wall", "-Werror", f"-I{cuda_include}",
                    str(HERE / "fake_libcuda.c"), "-o", str(path)], check=True)
    return str(path)


class FakeState:
    """The fake's counters, read from the same loaded library."""

    def __init__(self, path: str):
        self._library = ctypes.CDLL(path)

    def retained(self, device: int) -> int:
        return (ctypes.c_int * 2).in_dll(self._library, "fake_retained")[device]

    def __getattr__(self, name: str) -> int:
        ctype = ctypes.c_int if name == "set_current_calls" else ctypes.c_ulonglong
        return ctype.in_dll(self._library, f"fake_{name}").value


@pytest.fixture
def fake(fake_library, monkeypatch):
    monkeypatch.delenv("FAKE_CUDA_INIT_RESULT", raising=False)
    driver = LibCuda(fake_library)
    yield driver, FakeState(fake_library)
    driver.close()


@pytest.mark.parametrize("code, hint, error", [
    (100, "the NVIDIA driver sees no GPU", "cuInit failed: CUDA_ERROR_NO_DEVICE (no CUDA-capable device is detected)"),
    (34, "the CUDA toolkit's stub library", "cuInit failed: CUDA_ERROR_STUB_LIBRARY (CUDA driver is a stub library)"),
    (4242, "cannot be initialized", "cuInit failed: CUresult 4242 (the driver does not know this code)"),
])
def test_cuinit_failure_says_why(fake_library, monkeypatch, code, hint, error):
    monkeypatch.setenv("FAKE_CUDA_INIT_RESULT", str(code))
    with pytest.raises(DriverError) as err:
        LibCuda(fake_library)
    message = str(err.value)
    assert message.startswith(f"CUDA driver {fake_library} is not usable: ")
    assert hint in message and message.endswith(error)


def test_devices_as_the_driver_reports_them(fake):
    driver, _ = fake
    assert driver.driver_version == 13000
    assert driver.devices() == [
        DeviceInfo(index=i, name=f"Fake GPU {i}", compute_capability=(9, i), total_memory=(i + 1) << 34,
                   multiprocessors=132, max_shared_per_block=49152, max_threads_per_block=1024, warp_size=32)
        for i in range(2)
    ]
    assert [info.arch for info in driver.devices()] == ["sm_90", "sm_91"]


def test_the_primary_context_is_retained_once_and_released_on_close(fake):
    driver, state = fake
    with pytest.raises(DriverError, match="no CUDA device 2: the driver sees 2"):
        driver.context(2)
    context = driver.context(1)
    assert driver.context(1) is context and state.retained(1) == 1
    context.close()
    assert state.retained(1) == 0
    with pytest.raises(DriverError, match="the context of CUDA device 1 is closed"):
        context.alloc(16)
    again = driver.context(1)
    assert again is not context and state.retained(1) == 1


def test_the_context_is_made_current_on_each_thread_that_uses_it(fake):
    driver, state = fake
    context = driver.context(0)
    ptr = context.alloc(4096)  # the fake fails memory calls on a thread with no current context
    assert ptr == 0xABCD00000000 + 4096
    calls = state.set_current_calls
    context.free(ptr)
    assert state.set_current_calls == calls and state.last_free == ptr
    results = []
    worker = threading.Thread(target=lambda: results.append(context.alloc(64)))
    worker.start()
    worker.join()
    assert results == [0xABCD00000000 + 64] and state.set_current_calls == calls + 1


def test_a_failed_call_names_what_it_did_the_call_and_the_error(fake):
    driver, state = fake
    context = driver.context(0)
    with pytest.raises(DriverError) as err:
        context.alloc(1 << 41)
    assert str(err.value) == "alloc(2199023255552): cuMemAlloc_v2 failed: CUDA_ERROR_OUT_OF_MEMORY (out of memory)"
    assert state.last_alloc == 1 << 41
    with pytest.raises(DriverError, match=r"cuMemAlloc_v2 failed: CUresult 12345 \(the driver does not know"):
        context.alloc(12345)


def test_the_jit_error_log_reaches_the_error(fake):
    driver, _ = fake
    kernel = PtxKernel("add_one", ADD_ONE.params, ADD_ONE.body)
    with pytest.raises(DriverError) as err:
        driver.context(0).load(kernel)
    first, log = str(err.value).split("\n", 1)
    assert first == ("loading kernel add_one for sm_90: cuModuleLoadDataEx failed: "
                     "CUDA_ERROR_INVALID_PTX (a PTX JIT compilation failed)")
    assert log == "fake JIT: .version 7.0"
    assert kernel.asked == ["sm_90"]


def test_a_symbol_the_driver_lacks(fake):
    driver, _ = fake
    with pytest.raises(DriverError, match=r"has no cuStreamCreate: its CUDA version 13000 is older"):
        driver.context(0).stream_new()


def test_arguments_are_checked_before_the_driver_is_called(fake):
    driver, _ = fake
    context = driver.context(0)
    with pytest.raises(DriverError, match=r"^add_one takes 2 arguments \(p, i\), got 1$"):
        context.launch(CudaFunction("add_one", ("p", "i"), 0), (1, 1, 1), (32, 1, 1), [0])
    with pytest.raises(DriverError, match="must have 3 dimensions"):
        context.launch(CudaFunction("add_one", ("p", "i"), 0), (1, 1), (32, 1, 1), [0, 1])
    with pytest.raises(DriverError, match="value 256 is not a byte"):
        context.memset_async(0, 256, 16)
    with pytest.raises(DriverError, match="not a whole allocation of alloc_host"):
        context.free_host(np.zeros(16, np.uint8))
    with pytest.raises(DriverError, match="not C-contiguous"):
        context.memcpy_htod_async(0, np.zeros((4, 4), np.float32)[:, 1])
    with pytest.raises(DriverError, match="the default stream cannot be captured"):
        context.begin_capture(None)


# -- on a GPU ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpu():
    try:
        driver = LibCuda()
    except DriverError as err:
        pytest.skip(f"no usable CUDA driver: {err}")
    if not driver.devices():
        pytest.skip("the CUDA driver sees no device")
    yield driver.context(0)
    driver.close()


@pytest.mark.gpu
def test_gpu_device_info(gpu):
    info = gpu.info
    assert info.name and info.warp_size == 32 and info.max_threads_per_block == 1024
    assert info.compute_capability >= (5, 0) and info.multiprocessors > 0
    assert info.total_memory > 1 << 30 and info.max_shared_per_block >= 48 << 10


@pytest.mark.gpu
def test_gpu_copies_round_trip_through_pinned_and_device_memory(gpu):
    data = np.random.default_rng(0).integers(0, 256, (1 << 20) + 3, dtype=np.uint8)
    stream = gpu.stream_new()
    pinned = gpu.alloc_host(data.nbytes)
    pinned[:] = data
    first, second = gpu.alloc(data.nbytes), gpu.alloc(data.nbytes)
    out = np.zeros_like(data)
    gpu.memcpy_htod_async(first, pinned, stream)
    gpu.memcpy_dtod_async(second, first, data.nbytes, stream)
    gpu.memcpy_dtoh_async(out, second, stream)
    gpu.stream_synchronize(stream)
    np.testing.assert_array_equal(out, data)
    gpu.free(first)
    gpu.free(second)
    gpu.free_host(pinned)


@pytest.mark.gpu
def test_gpu_memset_sets_exactly_its_range(gpu):
    ptr = gpu.alloc(1000)
    gpu.memset_async(ptr, 0, 1000)
    gpu.memset_async(ptr + 100, 0xAB, 300)
    out = np.empty(1000, np.uint8)
    gpu.memcpy_dtoh_async(out, ptr)
    gpu.stream_synchronize()
    want = np.zeros(1000, np.uint8)
    want[100:400] = 0xAB
    np.testing.assert_array_equal(out, want)
    gpu.free(ptr)


@pytest.mark.gpu
def test_gpu_a_stream_waits_for_an_event_of_another(gpu):
    nbytes = 64 << 20  # long enough to still run when the second stream is given its copy
    producer, consumer = gpu.stream_new(), gpu.stream_new()
    source, target = gpu.alloc(nbytes), gpu.alloc(nbytes)
    gpu.memset_async(target, 0, nbytes, consumer)
    gpu.stream_synchronize(consumer)
    done = gpu.event_new()
    gpu.memset_async(source, 7, nbytes, producer)
    gpu.event_record(done, producer)
    gpu.stream_wait_event(consumer, done)
    gpu.memcpy_dtod_async(target, source, nbytes, consumer)
    out = np.empty(nbytes, np.uint8)
    gpu.memcpy_dtoh_async(out, target, consumer)
    gpu.event_synchronize(done)
    gpu.stream_synchronize(consumer)
    assert np.all(out == 7)
    gpu.free(source)
    gpu.free(target)


@pytest.mark.gpu
def test_gpu_timing_events_measure_the_work_between_them(gpu):
    nbytes = 1 << 30
    stream, ptr = gpu.stream_new(), gpu.alloc(nbytes)
    start, end = gpu.event_new(timing=True), gpu.event_new(timing=True)
    gpu.event_record(start, stream)
    for value in range(8):
        gpu.memset_async(ptr, value, nbytes, stream)
    gpu.event_record(end, stream)
    gpu.event_synchronize(end)
    seconds = gpu.event_elapsed(start, end)
    assert 8 * nbytes / 10e12 < seconds < 1.0  # 8 GiB written: no device writes 10 TB/s
    gpu.free(ptr)


def _upload(gpu, values: np.ndarray, stream=None) -> int:
    ptr = gpu.alloc(values.nbytes)
    gpu.memcpy_htod_async(ptr, values, stream)
    gpu.stream_synchronize(stream)
    return ptr


def _download(gpu, ptr: int, like: np.ndarray, stream=None) -> np.ndarray:
    out = np.empty_like(like)
    gpu.memcpy_dtoh_async(out, ptr, stream)
    gpu.stream_synchronize(stream)
    return out


@pytest.mark.gpu
def test_gpu_kernel_adds_one_to_each_float(gpu):
    x = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    kernel = PtxKernel("add_one", ADD_ONE.params, ADD_ONE.body)
    function = gpu.load(kernel)
    assert gpu.load(kernel) is function and kernel.asked == [gpu.info.arch]
    ptr = _upload(gpu, x)
    gpu.launch(function, (4, 1, 1), (256, 1, 1), [ptr, x.size])
    np.testing.assert_array_equal(_download(gpu, ptr, x), x + np.float32(1))
    gpu.free(ptr)


@pytest.mark.gpu
def test_gpu_every_kind_of_argument_reaches_the_kernel(gpu):
    ptr = _upload(gpu, np.zeros(24, np.uint8))
    gpu.launch(gpu.load(ECHO), (1, 1, 1), (1, 1, 1), [ptr, -123456, -(3 << 40) - 5, 2.75])
    record = _download(gpu, ptr, np.zeros(24, np.uint8))
    assert record[0:4].view(np.int32)[0] == -123456
    assert record[8:16].view(np.int64)[0] == -(3 << 40) - 5
    assert record[16:20].view(np.float32)[0] == np.float32(2.75)
    gpu.free(ptr)


@pytest.mark.gpu
def test_gpu_a_jit_error_carries_the_compiler_log(gpu):
    with pytest.raises(DriverError, match="CUDA_ERROR_INVALID_PTX") as err:
        gpu.load(BROKEN)
    assert "line 7" in str(err.value)


@pytest.mark.gpu
def test_gpu_graph_replays_what_was_captured(gpu):
    x = np.arange(4096, dtype=np.float32)
    stream = gpu.stream_new()
    ptr = _upload(gpu, x, stream)
    add_one = gpu.load(ADD_ONE)
    gpu.begin_capture(stream)
    gpu.launch(add_one, (16, 1, 1), (256, 1, 1), [ptr, x.size], stream)
    graph = gpu.end_capture(stream)
    np.testing.assert_array_equal(_download(gpu, ptr, x, stream), x)  # captured, not run
    for _ in range(3):
        gpu.graph_launch(graph, stream)
    np.testing.assert_array_equal(_download(gpu, ptr, x, stream), x + 3)
    gpu.graph_free(graph)
    gpu.free(ptr)


@pytest.mark.gpu
def test_gpu_context_works_from_another_thread(gpu):
    x = np.linspace(-1, 1, 300, dtype=np.float32)
    results, failures = [], []

    def work():
        try:
            ptr = _upload(gpu, x)
            gpu.launch(gpu.load(ADD_ONE), (2, 1, 1), (256, 1, 1), [ptr, x.size])
            results.append(_download(gpu, ptr, x))
            gpu.free(ptr)
        except DriverError as err:
            failures.append(err)

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    assert failures == []
    np.testing.assert_array_equal(results[0], x + np.float32(1))
