"""From a node to dispatches: the kernel registry and what every kernel shares.

A kernel lowers one node to one or more dispatches of a shader variant. Each tensor it touches
is a storage-buffer binding (a window of the buffer starting at an aligned offset, at most
maxStorageBufferRange bytes) plus a descriptor in the params buffer: the element offset from
the window's start, ne0..ne3 and nb0..nb3 in elements, in ggml's order (ne0 is the innermost
axis, numpy's last). The GLSL side is `struct Tensor` in shaders/common.glsl.

Kernels register with `@kernel(op classes..., supports=predicate)`; the backend claims an op
when a kernel is registered for its class and the predicate accepts the node.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from llamir.backends import BackendError, TensorData
from llamir.ir import Node, TensorType, geometry

MAX_GROUPS = 65535


@dataclass(frozen=True)
class Binding:
    """A storage-buffer window: `range` bytes of `memory` from `offset`."""

    memory: object
    offset: int
    range: int
    written: bool = False


@dataclass
class Dispatch:
    """One vkCmdDispatch (or, with `copy`, one vkCmdCopyBuffer: src, src_offset, dst, dst_offset, n)."""

    pipeline: object            # None until Lowering.finish() makes it (and for a copy)
    bindings: list[Binding]
    params: np.ndarray
    groups: tuple[int, int, int]
    copy: tuple | None = None
    name: str = ""
    shader: str = ""
    defines: dict = field(default_factory=dict)


def unit_of(ttype: TensorType) -> int:
    """The element a shader indexes a tensor by: its item size for floats and ints (bf16: 2
    bytes, read as uint16), a byte for quantized rows."""
    return 1 if ttype.dtype.is_quantized else int(geometry.storage_dtype(ttype.dtype).itemsize)


def groups_for(n_groups: int) -> tuple[int, int, int]:
    """n_groups workgroups as an x*y grid within maxComputeWorkGroupCount (shaders read the flat
    index back with common.glsl's group_id())."""
    n_groups = max(int(n_groups), 1)
    if n_groups <= MAX_GROUPS:
        return (n_groups, 1, 1)
    y = -(-n_groups // MAX_GROUPS)
    return (MAX_GROUPS, y, 1)


@dataclass
class Params:
    """The params block of one dispatch, packed as uint32 words in declaration order."""

    words: list[int] = field(default_factory=list)

    def u32(self, *values: int) -> Params:
        for v in values:
            self.words.append(int(v) & 0xFFFFFFFF)
        return self

    def i32(self, *values: int) -> Params:
        return self.u32(*values)

    def f32(self, *values: float) -> Params:
        for v in values:
            self.words.append(int(np.array(v, np.float32).view(np.uint32)))
        return self

    def array(self) -> np.ndarray:
        return np.array(self.words or [0], dtype=np.uint32)


class Lowering:
    """What kernels use to build their dispatches on one GPU."""

    def __init__(self, gpu, compiler, scratch: Callable[[int], TensorData] | None = None):
        self.gpu, self.compiler = gpu, compiler
        self.info = gpu.info
        self.dispatches: list[Dispatch] = []
        self._scratch = scratch
        self.pinned: list = []  # buffers the dispatches use besides the nodes' own (scratch)

    def scratch(self, nbytes: int) -> TensorData:
        """`nbytes` of device memory for an intermediate a kernel makes and consumes itself (B
        rounded to the weight's vec_dot type), like ggml-vulkan's prealloc buffers. The same
        memory serves every kernel, one after another; the barriers keep them apart."""
        if self._scratch is None:
            raise BackendError("vulkan: this lowering has no scratch memory")
        td = self._scratch(nbytes)
        self.pinned.append(td.buffer)
        return td

    # -- tensors -------------------------------------------------------------------------------
    def bind(self, td: TensorData, written: bool = False) -> Binding:
        """The window of `td`'s buffer that holds it, starting at an aligned offset."""
        mem = getattr(td.buffer, "memory", None)
        if mem is None:
            raise BackendError(f"vulkan: a tensor in {td.buffer.buft.name} memory reached a Vulkan kernel")
        start = td.offset - td.offset % self.info.min_storage_alignment
        extent = td.offset - start + max(td.nbytes, 1)
        if extent > self.info.max_storage_range:
            raise BackendError(f"vulkan: a {td.nbytes}-byte tensor exceeds {self.info.name}'s "
                               f"maxStorageBufferRange ({self.info.max_storage_range} bytes)")
        size = min(mem.size - start, self.info.max_storage_range)
        return Binding(mem, start, size, written)

    def descriptor(self, ttype: TensorType, td: TensorData, binding: Binding) -> list[int]:
        """offset, ne0..ne3, nb0..nb3 (elements; bytes for quantized tensors)."""
        unit = unit_of(ttype)
        shape = [int(d) for d in ttype.shape]
        if len(shape) > 4:
            raise BackendError(f"vulkan: rank {len(shape)} tensors are not supported")
        strides = list(td.strides)
        if ttype.dtype.is_quantized:
            strides[-1] = ttype.dtype.type_size  # per block
        rel = td.offset - binding.offset
        if rel % unit or any(s % unit for s in strides):
            raise BackendError(f"vulkan: a {ttype} tensor is not aligned to its {unit}-byte elements")
        ne = list(reversed(shape)) + [1] * (4 - len(shape))
        nb = [s // unit for s in reversed(strides)] + [0] * (4 - len(shape))
        for i in range(len(shape), 4):  # ggml: the strides past the rank continue the last one
            nb[i] = nb[i - 1] * ne[i - 1] if i else 1
        return [rel // unit, *ne, *nb]

    # -- dispatches ------------------------------------------------------------------------------
    def dispatch(self, shader: str, defines: dict, tensors: list[tuple[TensorType, TensorData, bool]],
                 params: Params | None, groups: tuple[int, int, int], name: str = "") -> None:
        """Dispatch a shader variant: binding 0 is the params block (the tensors' descriptors,
        then `params`), bindings 1.. the tensors in order."""
        bindings, words = [], Params()
        for ttype, td, written in tensors:
            b = self.bind(td, written)
            bindings.append(b)
            words.u32(*self.descriptor(ttype, td, b))
        if params is not None:
            words.words += params.words
        self.dispatches.append(Dispatch(None, bindings, words.array(), groups, name=name, shader=shader,
                                        defines=dict(defines)))

    def variants(self) -> list[tuple[str, dict]]:
        """The shader variants the dispatches use: (template, defines)."""
        return [(d.shader, d.defines) for d in self.dispatches if d.copy is None]

    def finish(self) -> Lowering:
        """Compile the variants the dispatches use (the new ones side by side) and make their
        pipelines."""
        self.compiler.compile_all(self.variants())
        for d in self.dispatches:
            if d.copy is None and d.pipeline is None:
                d.pipeline = self.gpu.pipeline(d.shader, self.compiler.spirv(d.shader, d.defines), len(d.bindings) + 1)
        return self

    def copy(self, src: TensorData, dst: TensorData, nbytes: int) -> None:
        """A byte copy between two device tensors (vkCmdCopyBuffer)."""
        s, d = self.bind(src), self.bind(dst, written=True)
        self.dispatches.append(Dispatch(None, [s, d], np.zeros(1, np.uint32), (0, 0, 0),
                                        copy=(s.memory, src.offset, d.memory, dst.offset, nbytes)))


Kernel = Callable[[Lowering, Node, list[TensorData], TensorData], None]
Predicate = Callable[[Node], bool]


@dataclass(frozen=True)
class Entry:
    lower: Kernel
    supports: Predicate
    splits_src0: bool  # the kernel splits a src0 larger than one binding into row chunks


KERNELS: dict[type, Entry] = {}


def kernel(*op_classes: type, supports: Predicate = lambda node: True, splits_src0: bool = False):
    """Register a kernel for op classes, with the predicate saying which nodes it runs.
    `splits_src0`: src0 may exceed maxStorageBufferRange (the kernel binds it in row chunks);
    every other tensor of the node must fit one binding."""

    def register(fn: Kernel) -> Kernel:
        for cls in op_classes:
            KERNELS[cls] = Entry(fn, supports, splits_src0)
        return fn

    return register


def float_type(dtype) -> str:
    """The GLSL storage type of a float tensor."""
    return {"f32": "float", "f16": "float16_t"}[dtype.name]


def is_f32(*types: TensorType) -> bool:
    return all(t.dtype.name == "f32" for t in types)


def is_float(*types: TensorType) -> bool:
    return all(t.dtype.name in ("f32", "f16") for t in types)
