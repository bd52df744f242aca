"""One ggml op at a time on llama.cpp's own CPU backend, through ctypes: the op-level oracle.

`LibGgml` loads libggml-base/libggml-cpu from the installed llama-cpp-python wheel (nothing is
imported until `LibGgml.load()` is called) and runs tiny graphs:

    gg = LibGgml.load()                   # None when llama-cpp-python is not installed
    with gg.graph() as g:
        x = g.tensor(x_np)                # numpy shape [..., ne1, ne0]: ggml's ne[] reversed
        y = g.op("ggml_soft_max_ext", x, None, g.f(0.125), g.f(0.0))
        out = g.compute(y)                # -> numpy, same axis order as the inputs

Floats go as g.f(x), int64_t and size_t parameters as g.i64(n) and g.size(n) (a plain int is a
C int): g.op("ggml_ssm_scan", s, x, dt, A, B, C, ids, g.i64(1)).

Shapes are numpy's everywhere: a numpy array [a, b, c] is the ggml tensor ne = {c, b, a, 1}.

`gg.backend_graph()` runs the same kind of graph the way llama.cpp does, through ggml-backend:
weights go to the first of the CPU device's extra buffer types (CPU_REPACK, ...) that supports
their matmul, as llama.cpp's weight_buft_supported decides, else to the CPU buffer type; setting
a weight there performs the repack; the graph runs with ggml_backend_graph_compute:

    with gg.backend_graph() as g:
        w = g.weight(Raw(bytes, 12, (M, K)))          # placed like a model weight; g.placement(w)
        y = g.op("ggml_mul_mat", w, g.tensor(x))
        out = g.compute(y, n_threads=2)
"""

from __future__ import annotations

import ctypes
import importlib.util
import pathlib
from dataclasses import dataclass

import numpy as np

GGML_MAX_DIMS = 4
_TYPE_OF_NUMPY = {np.dtype(np.float32): 0, np.dtype(np.float16): 1, np.dtype(np.int32): 26}
_NUMPY_OF_TYPE = {v: k for k, v in _TYPE_OF_NUMPY.items()}


class Tensor(ctypes.Structure):
    """struct ggml_tensor (ggml.h of the vendored ggml, GGML_MAX_SRC = 10, GGML_MAX_NAME = 64)."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p),
                ("ne", ctypes.c_int64 * GGML_MAX_DIMS), ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
                ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16), ("flags", ctypes.c_int32),
                ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p),
                ("name", ctypes.c_char * 64), ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]


TensorP = ctypes.POINTER(Tensor)


class InitParams(ctypes.Structure):
    """struct ggml_init_params (passed by value to ggml_init)."""

    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


def _lib_dir() -> pathlib.Path | None:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return None
    lib_dir = pathlib.Path(spec.origin).parent / "lib"
    return lib_dir if (lib_dir / "libggml-cpu.so").exists() else None


class LibGgml:
    """The loaded libraries; `graph()` opens a context to build and run one small graph."""

    _instance: LibGgml | None = None

    def __init__(self, lib_dir: pathlib.Path):
        self.base = ctypes.CDLL(str(lib_dir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        self.cpu = ctypes.CDLL(str(lib_dir / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        self.base.ggml_init.restype = ctypes.c_void_p
        self.base.ggml_init.argtypes = [InitParams]
        self.base.ggml_free.argtypes = [ctypes.c_void_p]
        self.base.ggml_new_graph.restype = ctypes.c_void_p
        self.base.ggml_new_graph.argtypes = [ctypes.c_void_p]
        self.base.ggml_build_forward_expand.argtypes = [ctypes.c_void_p, TensorP]
        self.base.ggml_new_tensor.restype = TensorP
        self.base.ggml_new_tensor.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                              ctypes.POINTER(ctypes.c_int64)]
        self.base.ggml_nbytes.restype = ctypes.c_size_t
        self.base.ggml_nbytes.argtypes = [TensorP]
        self.base.ggml_tensor_overhead.restype = ctypes.c_size_t
        self.base.ggml_graph_overhead.restype = ctypes.c_size_t
        self.cpu.ggml_graph_compute_with_ctx.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        self.cpu.ggml_cpu_init()
        self._declare_backend()

    def _declare_backend(self) -> None:
        """Signatures of the ggml-backend functions the backend path calls."""
        vp, base, cpu = ctypes.c_void_p, self.base, self.cpu
        for fn, res, args in [
            (cpu.ggml_backend_cpu_init, vp, []),
            (cpu.ggml_backend_cpu_set_n_threads, None, [vp, ctypes.c_int]),
            (base.ggml_backend_get_device, vp, [vp]),
            (base.ggml_backend_dev_backend_reg, vp, [vp]),
            (base.ggml_backend_reg_get_proc_address, vp, [vp, ctypes.c_char_p]),
            (base.ggml_backend_buft_name, ctypes.c_char_p, [vp]),
            (base.ggml_backend_cpu_buffer_type, vp, []),
            (base.ggml_backend_buft_alloc_buffer, vp, [vp, ctypes.c_size_t]),
            (base.ggml_backend_buffer_free, None, [vp]),
            (base.ggml_backend_alloc_ctx_tensors_from_buft, vp, [vp, vp]),
            (base.ggml_backend_dev_supports_op, ctypes.c_bool, [vp, TensorP]),
            (base.ggml_backend_tensor_set, None, [TensorP, vp, ctypes.c_size_t, ctypes.c_size_t]),
            (base.ggml_backend_tensor_get, None, [TensorP, vp, ctypes.c_size_t, ctypes.c_size_t]),
            (base.ggml_backend_graph_compute, ctypes.c_int, [vp, vp]),
            (base.ggml_backend_free, None, [vp]),
        ]:
            fn.restype, fn.argtypes = res, args

    @classmethod
    def load(cls) -> LibGgml | None:
        """The shared instance, or None when llama-cpp-python (with its libggml) is absent."""
        if cls._instance is None:
            lib_dir = _lib_dir()
            if lib_dir is None:
                return None
            cls._instance = cls(lib_dir)
        return cls._instance

    def graph(self, mem_bytes: int = 64 << 20) -> GgmlGraph:
        return GgmlGraph(self, mem_bytes)

    def backend_graph(self) -> BackendGraph:
        return BackendGraph(self)

    def extra_bufts(self, device) -> list[int]:
        """The CPU device's extra buffer types (ggml_backend_dev_get_extra_bufts), in priority order."""
        reg = self.base.ggml_backend_dev_backend_reg(device)
        proc = self.base.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
        if not proc:
            raise RuntimeError("the CPU backend does not export ggml_backend_dev_get_extra_bufts")
        get = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(proc)
        found, array = [], get(device)
        while array and array[len(found)]:
            found.append(array[len(found)])
        return found


@dataclass(frozen=True)
class Raw:
    """Bytes of a quantized (or any) ggml type with its numpy-order element shape."""

    data: np.ndarray      # uint8 [..., row_bytes]
    ggml_type: int
    shape: tuple[int, ...]


def new_tensor(lib: LibGgml, ctx, value: np.ndarray | Raw) -> tuple[TensorP, np.ndarray]:
    """A tensor of `value`'s type and numpy shape in ggml context `ctx` (its data not yet written),
    and the contiguous bytes that belong in it."""
    if isinstance(value, Raw):
        ggml_type, shape, data = value.ggml_type, value.shape, np.ascontiguousarray(value.data)
    else:
        data = np.ascontiguousarray(value)
        if data.dtype not in _TYPE_OF_NUMPY:
            raise TypeError(f"no ggml type for numpy {data.dtype}; wrap bytes in Raw")
        ggml_type, shape = _TYPE_OF_NUMPY[data.dtype], data.shape
    if not 1 <= len(shape) <= GGML_MAX_DIMS:
        raise ValueError(f"ggml tensors have 1 to 4 dims, got shape {shape}")
    ne = (ctypes.c_int64 * len(shape))(*reversed(shape))
    t = lib.base.ggml_new_tensor(ctx, ggml_type, len(shape), ne)
    nbytes = lib.base.ggml_nbytes(t)
    if nbytes != data.nbytes:
        raise ValueError(f"a type-{ggml_type} tensor of shape {shape} takes {nbytes} bytes, got {data.nbytes}")
    return t, data


class GgmlGraph:
    """A ggml context holding the inputs, the op tensors and, on compute, the work buffer."""

    def __init__(self, lib: LibGgml, mem_bytes: int):
        self.lib = lib
        overhead = lib.base.ggml_graph_overhead() + 256 * lib.base.ggml_tensor_overhead()
        params = InitParams(mem_bytes + overhead, None, False)
        self.ctx = lib.base.ggml_init(params)
        if not self.ctx:
            raise MemoryError(f"ggml_init could not allocate {mem_bytes} bytes")

    def __enter__(self) -> GgmlGraph:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.ctx:
            self.lib.base.ggml_free(self.ctx)
            self.ctx = None

    # -- arguments ------------------------------------------------------------------------
    @staticmethod
    def f(x: float) -> ctypes.c_float:
        return ctypes.c_float(x)

    @staticmethod
    def i64(x: int) -> ctypes.c_int64:
        """An int64_t argument (ggml_ssm_scan's K, ggml_view_*'s ne): plain ints pass as int."""
        return ctypes.c_int64(x)

    @staticmethod
    def size(x: int) -> ctypes.c_size_t:
        """A size_t argument (ggml_view_*'s byte strides and offset)."""
        return ctypes.c_size_t(x)

    def tensor(self, value: np.ndarray | Raw) -> TensorP:
        """A new tensor filled with `value` (float32/float16/int32 arrays, or Raw bytes)."""
        t, data = new_tensor(self.lib, self.ctx, value)
        ctypes.memmove(t.contents.data, data.ctypes.data, data.nbytes)
        return t

    def op(self, name: str, *args) -> TensorP:
        """Call the ggml builder `name` with this context first; tensors, ints, c_float, None."""
        fn = getattr(self.lib.base, name)
        fn.restype = TensorP
        out = fn(ctypes.c_void_p(self.ctx), *[_arg(a) for a in args])
        if not out:
            raise RuntimeError(f"{name} returned NULL")
        return out

    def call(self, name: str, *args) -> None:
        """Call a ggml function that returns nothing (ggml_soft_max_add_sinks, ...)."""
        fn = getattr(self.lib.base, name)
        fn.restype = None
        fn(*[_arg(a) for a in args])

    # -- running --------------------------------------------------------------------------
    def compute(self, out: TensorP, n_threads: int = 1) -> np.ndarray:
        """Build the graph ending in `out`, compute it on the CPU backend, return out as numpy."""
        gf = self.lib.base.ggml_new_graph(self.ctx)
        self.lib.base.ggml_build_forward_expand(gf, out)
        status = self.lib.cpu.ggml_graph_compute_with_ctx(self.ctx, gf, n_threads)
        if status != 0:
            raise RuntimeError(f"ggml_graph_compute_with_ctx failed with status {status}")
        return read(out)


class BackendGraph:
    """A graph computed by the CPU backend with llama.cpp's weight placement (see the module doc).

    Weights, inputs and op results live in three no_alloc contexts; `compute` allocates the
    inputs and results in the CPU buffer type, copies the inputs in, and runs the graph."""

    def __init__(self, lib: LibGgml, max_tensors: int = 64):
        self.lib = lib
        self.max_tensors = max_tensors
        self._contexts: list[int] = []
        self._buffers: list[int] = []
        self._pending: list[tuple[TensorP, np.ndarray]] = []
        self._placement: dict[int, str] = {}
        self.backend = lib.cpu.ggml_backend_cpu_init()
        if not self.backend:
            raise RuntimeError("ggml_backend_cpu_init failed")
        self.device = lib.base.ggml_backend_get_device(self.backend)
        self.ctx_w = self._context(graph=False)
        self.ctx = self._context(graph=True)

    def __enter__(self) -> BackendGraph:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for buf in self._buffers:
            self.lib.base.ggml_backend_buffer_free(buf)
        for ctx in self._contexts:
            self.lib.base.ggml_free(ctx)
        if self.backend:
            self.lib.base.ggml_backend_free(self.backend)
        self._buffers, self._contexts, self.backend = [], [], None

    def _context(self, graph: bool) -> int:
        size = self.max_tensors * self.lib.base.ggml_tensor_overhead() + (self.lib.base.ggml_graph_overhead()
                                                                           if graph else 0)
        ctx = self.lib.base.ggml_init(InitParams(size, None, True))
        if not ctx:
            raise MemoryError("ggml_init failed for a no_alloc context")
        self._contexts.append(ctx)
        return ctx

    f = staticmethod(GgmlGraph.f)
    i64 = staticmethod(GgmlGraph.i64)
    size = staticmethod(GgmlGraph.size)

    def tensor(self, value: np.ndarray | Raw) -> TensorP:
        """An input tensor (activations, ids, a KV cache), filled when the graph is computed."""
        t, data = new_tensor(self.lib, self.ctx, value)
        self._pending.append((t, data))
        return t

    def weight(self, value: Raw | np.ndarray, op: str = "mul_mat", n_expert_used: int = 1) -> TensorP:
        """A model weight placed as llama.cpp places it for `op` ("mul_mat" or "mul_mat_id"), and set."""
        t, data = new_tensor(self.lib, self.ctx_w, value)
        chosen = next((b for b in self.lib.extra_bufts(self.device) if self._supports(t, op, b, n_expert_used)),
                      self.lib.base.ggml_backend_cpu_buffer_type())
        buf = self.lib.base.ggml_backend_alloc_ctx_tensors_from_buft(self.ctx_w, chosen)
        if not buf:
            raise MemoryError(f"could not allocate a weight in {self.lib.base.ggml_backend_buft_name(chosen)}")
        self._buffers.append(buf)
        self.lib.base.ggml_backend_tensor_set(t, data.ctypes.data, 0, data.nbytes)
        self._placement[ctypes.addressof(t.contents)] = self.lib.base.ggml_backend_buft_name(chosen).decode()
        self.ctx_w = self._context(graph=False)   # the next weight gets its own buffer
        return t

    def placement(self, t: TensorP) -> str:
        """The name of the buffer type a weight went to ("CPU_REPACK", "CPU", ...)."""
        return self._placement[ctypes.addressof(t.contents)]

    def _supports(self, w: TensorP, op: str, buft: int, n_expert_used: int) -> bool:
        """llama.cpp's weight_buft_supported: the op on a dummy buffer of `buft`, asked of the device."""
        base = self.lib.base
        scratch = base.ggml_init(InitParams(8 * base.ggml_tensor_overhead(), None, True))
        k = w.contents.ne[0]
        try:
            if op == "mul_mat":
                b = base.ggml_new_tensor(scratch, 0, 2, (ctypes.c_int64 * 2)(k, 512))
                fn, args = base.ggml_mul_mat, [w, b]
            elif op == "mul_mat_id":
                b = base.ggml_new_tensor(scratch, 0, 3, (ctypes.c_int64 * 3)(k, n_expert_used, 512))
                ids = base.ggml_new_tensor(scratch, 26, 2, (ctypes.c_int64 * 2)(n_expert_used, 512))
                fn, args = base.ggml_mul_mat_id, [w, b, ids]
            else:
                raise ValueError(f"weights are placed for mul_mat or mul_mat_id, not {op!r}")
            fn.restype = TensorP
            node = fn(ctypes.c_void_p(scratch), *args)
            dummy = base.ggml_backend_buft_alloc_buffer(buft, 0)
            w.contents.buffer = dummy
            try:
                return bool(base.ggml_backend_dev_supports_op(self.device, node))
            finally:
                w.contents.buffer = None
                base.ggml_backend_buffer_free(dummy)
        finally:
            base.ggml_free(scratch)

    def op(self, name: str, *args) -> TensorP:
        fn = getattr(self.lib.base, name)
        fn.restype = TensorP
        out = fn(ctypes.c_void_p(self.ctx), *[_arg(a) for a in args])
        if not out:
            raise RuntimeError(f"{name} returned NULL")
        return out

    def compute(self, out: TensorP, n_threads: int = 2) -> np.ndarray:
        """Allocate inputs and results in the CPU buffer type, run the graph, return `out` (contiguous)."""
        base = self.lib.base
        gf = base.ggml_new_graph(self.ctx)
        base.ggml_build_forward_expand(gf, out)
        buf = base.ggml_backend_alloc_ctx_tensors_from_buft(self.ctx, base.ggml_backend_cpu_buffer_type())
        if not buf:
            raise MemoryError("could not allocate the graph's tensors in the CPU buffer type")
        self._buffers.append(buf)
        for t, data in self._pending:
            base.ggml_backend_tensor_set(t, data.ctypes.data, 0, data.nbytes)
        self.lib.cpu.ggml_backend_cpu_set_n_threads(self.backend, n_threads)
        status = base.ggml_backend_graph_compute(self.backend, gf)
        if status != 0:
            raise RuntimeError(f"ggml_backend_graph_compute failed with status {status}")
        c = out.contents
        if c.type not in _NUMPY_OF_TYPE:
            raise TypeError(f"cannot read ggml type {c.type} back as numpy")
        n_dims = GGML_MAX_DIMS
        while n_dims > 1 and c.ne[n_dims - 1] == 1:
            n_dims -= 1
        result = np.empty(tuple(c.ne[i] for i in reversed(range(n_dims))), _NUMPY_OF_TYPE[c.type])
        if base.ggml_nbytes(out) != result.nbytes:
            raise ValueError("compute reads back contiguous results only")
        base.ggml_backend_tensor_get(out, result.ctypes.data, 0, result.nbytes)
        return result


def read(t: TensorP) -> np.ndarray:
    """A copy of a float32/float16/int32 tensor's data in numpy axis order (strides honoured)."""
    c = t.contents
    if c.type not in _NUMPY_OF_TYPE:
        raise TypeError(f"cannot read ggml type {c.type} back as numpy")
    dtype = _NUMPY_OF_TYPE[c.type]
    n_dims = GGML_MAX_DIMS
    while n_dims > 1 and c.ne[n_dims - 1] == 1:
        n_dims -= 1
    shape = tuple(c.ne[i] for i in reversed(range(n_dims)))
    strides = tuple(c.nb[i] for i in reversed(range(n_dims)))
    span = sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + dtype.itemsize
    buf = (ctypes.c_char * span).from_address(c.data)
    return np.ndarray(shape, dtype, buffer=buf, strides=strides).copy()


def _arg(a):
    """A builder argument as ctypes passes it: None is NULL, bool a C bool, int a C int (32-bit:
    wrap int64_t and size_t parameters with GgmlGraph.i64 / GgmlGraph.size)."""
    if a is None:
        return ctypes.c_void_p(None)
    if isinstance(a, bool):
        return ctypes.c_bool(a)
    if isinstance(a, int):
        return ctypes.c_int(a)
    if isinstance(a, float):
        raise TypeError("pass floats as GgmlGraph.f(x): ggml builders take both float and int64 args")
    return a


def assert_same_bits(got: np.ndarray, want: np.ndarray) -> None:
    """Both arrays hold identical float bits (want is reshaped to got); the error says how many
    values differ and shows the first."""
    assert got.size == want.size and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    want = want.reshape(got.shape)
    uint = {4: np.uint32, 2: np.uint16}[got.dtype.itemsize]
    differ = got.view(uint) != want.view(uint)
    if np.any(differ):
        at = tuple(int(i) for i in np.argwhere(differ)[0])
        raise AssertionError(f"{int(differ.sum())} of {got.size} values differ; first at {at}: "
                             f"{got[at]!r} != {want[at]!r}")
