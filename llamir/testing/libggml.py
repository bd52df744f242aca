"""One ggml op at a time on llama.cpp's own CPU backend, through ctypes: the op-level oracle.

`LibGgml` loads libggml-base/libggml-cpu from the installed llama-cpp-python wheel (nothing is
imported until `LibGgml.load()` is called) and runs tiny graphs:

    gg = LibGgml.load()                   # None when llama-cpp-python is not installed
    with gg.graph() as g:
        x = g.tensor(x_np)                # numpy shape [..., ne1, ne0]: ggml's ne[] reversed
        y = g.op("ggml_soft_max_ext", x, None, g.f(0.125), g.f(0.0))
        out = g.compute(y)                # -> numpy, same axis order as the inputs

Shapes are numpy's everywhere: a numpy array [a, b, c] is the ggml tensor ne = {c, b, a, 1}.
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


@dataclass(frozen=True)
class Raw:
    """Bytes of a quantized (or any) ggml type with its numpy-order element shape."""

    data: np.ndarray      # uint8 [..., row_bytes]
    ggml_type: int
    shape: tuple[int, ...]


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

    def tensor(self, value: np.ndarray | Raw) -> TensorP:
        """A new tensor filled with `value` (float32/float16/int32 arrays, or Raw bytes)."""
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
        t = self.lib.base.ggml_new_tensor(self.ctx, ggml_type, len(shape), ne)
        nbytes = self.lib.base.ggml_nbytes(t)
        if nbytes != data.nbytes:
            raise ValueError(f"a type-{ggml_type} tensor of shape {shape} takes {nbytes} bytes, "
                             f"got {data.nbytes}")
        ctypes.memmove(t.contents.data, data.ctypes.data, nbytes)
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
    if a is None:
        return ctypes.c_void_p(None)
    if isinstance(a, bool):
        return ctypes.c_bool(a)
    if isinstance(a, int):
        return ctypes.c_int(a)
    if isinstance(a, float):
        raise TypeError("pass floats as GgmlGraph.f(x): ggml builders take both float and int64 args")
    return a
