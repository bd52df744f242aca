"""Element-wise kernels: binary ops with ggml's broadcast (src1 repeated along every axis)."""

from __future__ import annotations

from llamir.ir import ops
from llamir_cuda import kir
from llamir_cuda.kir import tensor
from llamir_cuda.lowering import ceil_div, grid_for, is_float, kernel

BLOCK = 256
BINARY = {ops.Add: "fadd", ops.Sub: "fsub", ops.Mul: "fmul", ops.Div: "fdiv"}


def _binary_kernel(op: str, ta: str, tb: str, td: str) -> kir.Kernel:
    def body(k: kir.KernelBuilder) -> None:
        b, a, c, d = k.b, k.args["a"], k.args["b"], k.args["d"]
        i = k.global_id()
        with k.if_then(b.icmp_signed("<", i, k.count(d))):
            idx = k.unravel(i, d.ne)
            x = k.load_f32(a.ptr, k.offset(a, *idx), ta)
            y = k.load_f32(c.ptr, k.offset(c, *(b.srem(v, n) for v, n in zip(idx, c.ne, strict=True))), tb)
            k.store_f32(getattr(b, op)(x, y), d.ptr, k.offset(d, *idx), td)

    return kir.define(f"binary_{op}", (ta, tb, td), (tensor("a"), tensor("b"), tensor("d")), BLOCK, body)


@kernel(*BINARY, supports=lambda node: is_float(*(v.type for v in (*node.inputs, node))))
def binary(k, node, srcs, dst) -> None:
    a, c = node.inputs
    kern = _binary_kernel(BINARY[type(node.op)], a.dtype.name, c.dtype.name, node.dtype.name)
    k.launch(kern, grid_for(ceil_div(int(node.type.numel), BLOCK)),
             [(a.type, srcs[0]), (c.type, srcs[1]), (node.type, dst)])
