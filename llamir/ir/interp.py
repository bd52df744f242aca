"""The numpy reference interpreter: the oracle every backend and pass is checked against.

Values are numpy arrays in their storage form: float32/float16 for f32/f16, uint16 bits for
bf16, int arrays for ints, and uint8 bytes [..., row_bytes] for quantized types. Views are
real numpy views over the same memory (with ggml's byte strides), so writes through
`set_rows` land in the persistent state buffers (the KV cache) exactly as in ggml.

The math of each op lives in interp_kernels.py, written to follow ggml's CPU backend where
its precision is observable (f16 rounding of matmul activations, f32 rope angles, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from llamir.ir import dims, ops
from llamir.ir import interp_fused as _fused  # noqa: F401  (registers the fused ops' kernels)
from llamir.ir.dims import Bindings
from llamir.ir.dtypes import DType
from llamir.ir.graph import Graph, Node
from llamir.ir.interp_kernels import KERNELS, Context
from llamir.ir.numerics import Numerics, numerics_named
from llamir.ir.ops import IRError


class InterpError(RuntimeError):
    """A graph that cannot be evaluated with the given inputs; names the value at fault."""


def storage_shape(shape: tuple[int, ...], dtype: DType) -> tuple[int, ...]:
    """Numpy shape of a value's storage (quantized rows become bytes)."""
    if dtype.is_quantized:
        return tuple(shape[:-1]) + (dtype.row_bytes(shape[-1]),)
    return tuple(shape)


def storage_dtype(dtype: DType) -> np.dtype:
    return np.dtype(np.uint16) if dtype.name == "bf16" else dtype.np_dtype


def check_value(node: Node, value: np.ndarray, bindings: Bindings) -> None:
    """Raise InterpError unless `value` has the storage form of `node`'s type."""
    try:
        want = storage_shape(node.type.evaluate(bindings), node.dtype)
    except KeyError as err:
        raise InterpError(f"{node.kind} {node.name!r} ({node.type}): {err.args[0]}") from None
    if not isinstance(value, np.ndarray):
        raise InterpError(f"{node.kind} {node.name!r}: expected a numpy array, got {type(value).__name__}")
    if tuple(value.shape) != want or value.dtype != storage_dtype(node.dtype):
        raise InterpError(f"{node.kind} {node.name!r}: expected {node.type} (storage {want} "
                          f"{storage_dtype(node.dtype)}), got {tuple(value.shape)} {value.dtype}")


class Interpreter:
    """Evaluates graphs with numpy, reproducing the arithmetic of one numerics profile (the host's
    by default) as ggml computes it with `n_threads` threads. One instance may keep a cache of
    prepared weights."""

    def __init__(self, cache_weights: bool = False, exact: bool = True, numerics: Numerics | str | None = None,
                 n_threads: int = 2):
        if n_threads < 1:
            raise ValueError(f"n_threads must be >= 1, got {n_threads}")
        self.ctx = Context(weight_cache={} if cache_weights else None, exact=exact,
                           numerics=numerics_named(numerics), n_threads=n_threads)

    @property
    def numerics(self) -> Numerics:
        return self.ctx.numerics

    def run(
        self,
        graph: Graph,
        leaf_values: Mapping[str, np.ndarray],
        bindings: Bindings | None = None,
        observe: Callable[[Node, np.ndarray], bool] | None = None,
    ) -> dict[str, np.ndarray]:
        """Evaluate `graph`; returns its outputs by name. `observe(node, value)` is called after
        each named node (returning False stops evaluation, like ggml's eval callback)."""
        values = self.evaluate(graph, leaf_values, bindings or {}, observe)
        # after an observe() stop, only the outputs computed so far come back
        return {name: values[id(node)] for name, node in graph.outputs.items() if id(node) in values}

    def evaluate(self, graph: Graph, leaf_values, bindings, observe=None) -> dict[int, np.ndarray]:
        values: dict[int, np.ndarray] = {}
        roots: dict[int, np.ndarray] = {}  # the owning buffer of every value, for view bounds
        for leaf in graph.leafs:
            if leaf.name not in leaf_values:
                raise InterpError(f"no value for {leaf.kind} {leaf.name!r} ({leaf.type})")
            value = leaf_values[leaf.name]
            check_value(leaf, value, bindings)
            if not (value.flags.c_contiguous or value.size <= 1):
                # views apply byte strides to the buffer, so it must be laid out as the type says
                raise InterpError(f"{leaf.kind} {leaf.name!r}: the array is not C-contiguous "
                                  "(pass np.ascontiguousarray)")
            values[id(leaf)] = value
            roots[id(leaf)] = value
        for node in graph.nodes:
            args = [values[id(x)] for x in node.inputs]
            try:
                if node.op.is_view:
                    out = self._view(node, args[0], roots[id(node.inputs[0])], bindings)
                    roots[id(node)] = roots[id(node.inputs[0])]
                elif node.op.has_side_effects:
                    out = KERNELS[type(node.op)](self.ctx, node, args, bindings)
                    roots[id(node)] = roots[id(node.inputs[0])]
                else:  # a computed value owns fresh, C-contiguous memory, as a ggml tensor does
                    out = np.ascontiguousarray(KERNELS[type(node.op)](self.ctx, node, args, bindings))
                    roots[id(node)] = out
            except (IRError, InterpError):
                raise
            except (ValueError, IndexError, KeyError, TypeError) as err:
                raise InterpError(f"{node.op.name} {node.name or ''} ({node.type}): {err}") from err
            values[id(node)] = out
            if observe is not None and node.name and observe(node, out) is False:
                break
        return values

    def compute(self, node: Node, args: list[np.ndarray], bindings: Bindings | None = None) -> np.ndarray:
        """One op's numpy kernel on its input arrays (for backends that run ops through numpy).
        Ops with side effects (set_rows, cpy) write into their first input and return it."""
        if node.op.is_view:
            raise InterpError(f"{node.op.name} is a view: it computes nothing")
        try:
            return KERNELS[type(node.op)](self.ctx, node, args, bindings or {})
        except (IRError, InterpError):
            raise
        except (ValueError, IndexError, KeyError, TypeError) as err:
            raise InterpError(f"{node.op.name} {node.name or ''} ({node.type}): {err}") from err

    # -- views ----------------------------------------------------------------------------
    def _view(self, node: Node, x: np.ndarray, root: np.ndarray, bindings: Bindings) -> np.ndarray:
        op = node.op
        if isinstance(op, ops.Reshape):
            if not _is_contiguous(x):
                raise InterpError(f"reshape {node.name or ''}: input is not contiguous")
            return x.reshape(storage_shape(node.type.evaluate(bindings), node.dtype))
        if isinstance(op, ops.Permute):
            return np.transpose(x, op.axes)
        if isinstance(op, ops.Transpose):
            return np.swapaxes(x, -1, -2)
        if isinstance(op, ops.View):
            shape = storage_shape(node.type.evaluate(bindings), node.dtype)
            strides = tuple(dims.evaluate(s, bindings) for s in op.strides[:-1]) + (x.itemsize,)
            offset = dims.evaluate(op.offset, bindings)
            return strided_view(x, root, shape, strides, offset, node.name or "view")
        raise InterpError(f"unknown view op {op.name}")


def _is_contiguous(x: np.ndarray) -> bool:
    return x.flags.c_contiguous or x.size <= 1


class _Strided:
    """Carrier of an __array_interface__, keeping the viewed buffer alive."""

    def __init__(self, interface: dict, keep: np.ndarray):
        self.__array_interface__ = interface
        self.keep = keep


def strided_view(x: np.ndarray, root: np.ndarray, shape, strides, offset: int, label: str) -> np.ndarray:
    """ggml_view: `shape`/byte `strides` starting `offset` bytes into x, bounds-checked against
    the owning buffer `root` so a bad view is an error, never a wild read."""
    start = x.__array_interface__["data"][0] + offset
    lo, hi = np.lib.array_utils.byte_bounds(root)
    if any(n == 0 for n in shape):
        end = start
    else:
        end = start + sum((n - 1) * s for n, s in zip(shape, strides)) + x.itemsize
    if start < lo or end > hi or any(s < 0 for s in strides):
        raise InterpError(f"view {label!r} (offset {offset}, shape {shape}, strides {strides}) reaches "
                          f"outside its {hi - lo}-byte buffer")
    interface = {"data": (start, not x.flags.writeable), "shape": tuple(shape),
                 "strides": tuple(strides), "typestr": x.dtype.str, "version": 3}
    return np.asarray(_Strided(interface, x))


def run_graph(graph: Graph, leaf_values: Mapping[str, np.ndarray], bindings: Bindings | None = None,
              numerics: Numerics | str | None = None, n_threads: int = 2) -> dict[str, np.ndarray]:
    """Evaluate `graph` once with a fresh interpreter (the host's numerics profile by default)."""
    return Interpreter(numerics=numerics, n_threads=n_threads).run(graph, leaf_values, bindings)
