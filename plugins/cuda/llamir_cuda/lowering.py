"""From a node to kernel launches: the kernel registry and what every lowering shares.

A lowering turns one node (its input and output tensors in device memory) into launches of
kir kernels. Each tensor argument is its data pointer, ne0..ne3 and nb0..nb3 in bytes, in
ggml's order (ne0 is the innermost axis, numpy's last); for a block-quantized tensor ne0
counts elements and nb0 is the block's size.

Kernels register with `@kernel(op classes..., supports=predicate)`; the backend claims an op
when a kernel is registered for its class and the predicate accepts the node.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from llamir.backends import BackendError, TensorData
from llamir.ir import Node, TensorType
from llamir_cuda import kir

MAX_GRID_Y = 65535


@dataclass
class Launch:
    """One kernel launch (or, with `copy`, one device-to-device copy: dst, src, nbytes)."""

    kernel: kir.Kernel | None
    grid: tuple[int, int, int]
    args: list
    copy: tuple[int, int, int] | None = None
    name: str = ""

    @property
    def block(self) -> tuple[int, int, int]:
        return self.kernel.block


def device_ptr(td: TensorData) -> int:
    """The device address of `td`'s first byte."""
    ptr = getattr(td.buffer, "device_ptr", None)
    if ptr is None:
        raise BackendError(f"cuda: a tensor in {td.buffer.buft.name} memory reached a CUDA kernel")
    return int(ptr) + int(td.offset)


def tensor_args(ttype: TensorType, td: TensorData) -> list[int]:
    """ptr, ne0..ne3, nb0..nb3 (bytes) of a tensor of rank <= 4."""
    shape = [int(d) for d in ttype.shape]
    if len(shape) > 4:
        raise BackendError(f"cuda: rank {len(shape)} tensors are not supported")
    strides = [int(s) for s in td.strides]
    if ttype.dtype.is_quantized:
        strides[-1] = ttype.dtype.type_size  # per block
    ne = list(reversed(shape)) + [1] * (4 - len(shape))
    nb = list(reversed(strides)) + [0] * (4 - len(shape))
    for i in range(len(shape), 4):  # ggml: the strides past the rank continue the last one
        nb[i] = nb[i - 1] * ne[i - 1] // (ttype.dtype.block_size if i == 1 else 1) if i else ttype.dtype.type_size
    return [device_ptr(td), *ne, *nb]


def grid_for(n_blocks: int) -> tuple[int, int, int]:
    """n_blocks as an x grid (CUDA's x dimension takes 2^31 - 1 blocks)."""
    n = max(int(n_blocks), 1)
    if n >= 1 << 31:
        raise BackendError(f"cuda: {n} blocks exceed the grid")
    return (n, 1, 1)


def ceil_div(n: int, d: int) -> int:
    return -(-int(n) // int(d))


class Lowering:
    """What kernels use to build their launches on one device."""

    def __init__(self, scratch: Callable[[int], TensorData] | None = None):
        self.launches: list[Launch] = []
        self._scratch = scratch
        self.pinned: list = []  # buffers the launches use besides the nodes' own (scratch)

    def scratch(self, nbytes: int) -> TensorData:
        """`nbytes` of device memory for an intermediate one kernel makes and the next consumes
        (ggml-cuda's pool); the launches of a stream run in order, so one buffer serves all."""
        if self._scratch is None:
            raise BackendError("cuda: this lowering has no scratch memory")
        td = self._scratch(nbytes)
        self.pinned.append(td.buffer)
        return td

    def launch(self, kernel: kir.Kernel, grid: tuple[int, int, int], args: list, name: str = "") -> None:
        """Launch `kernel` over `grid`; `args` follows its declared params, a tensor as
        (TensorType, TensorData) or as the flat list of `tensor_args`."""
        flat: list = []
        for a in args:
            if isinstance(a, tuple) and len(a) == 2 and isinstance(a[1], TensorData):
                flat += tensor_args(*a)
            else:
                flat.append(a)
        if len(flat) != len(kernel.params):
            raise BackendError(f"cuda: {kernel.name} takes {len(kernel.params)} arguments, got {len(flat)}")
        if min(grid) < 1:
            return  # nothing to compute (an empty tensor)
        self.launches.append(Launch(kernel, tuple(int(g) for g in grid), flat, name=name))

    def copy(self, dst: TensorData, src: TensorData, nbytes: int) -> None:
        """A byte copy between two device tensors (cuMemcpyDtoDAsync)."""
        if nbytes:
            self.launches.append(Launch(None, (0, 0, 0), [], copy=(device_ptr(dst), device_ptr(src), int(nbytes))))


Kernel = Callable[[Lowering, Node, list[TensorData], TensorData], None]
Predicate = Callable[[Node], bool]


@dataclass(frozen=True)
class Entry:
    lower: Kernel
    supports: Predicate


KERNELS: dict[type, Entry] = {}


def kernel(*op_classes: type, supports: Predicate = lambda node: True):
    """Register a lowering for op classes, with the predicate saying which nodes it runs."""

    def register(fn: Kernel) -> Kernel:
        for cls in op_classes:
            KERNELS[cls] = Entry(fn, supports)
        return fn

    return register


def dtype_name(ttype: TensorType) -> str:
    return ttype.dtype.name


def is_f32(*types: TensorType) -> bool:
    return all(t.dtype.name == "f32" for t in types)


def is_float(*types: TensorType) -> bool:
    return all(t.dtype.name in ("f32", "f16", "bf16") for t in types)


def rank_ok(node: Node) -> bool:
    return all(v.type.rank <= 4 for v in (*node.inputs, node))


def f32_bits(value: float) -> float:
    """A float as the float32 the kernel receives."""
    return float(np.float32(value))
