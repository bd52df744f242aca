"""All IR ops, one frozen class per op; OPS maps ggml op names to classes."""

from llamir.ir.ops.attention import ROPE_NEOX, ROPE_NORM, FlashAttnExt, RopeExt, SoftMaxExt
from llamir.ir.ops.base import OPS, IRError, Op, register_op, require
from llamir.ir.ops.elementwise import (
    Abs,
    Add,
    Binary,
    Clamp,
    Cos,
    Div,
    Elu,
    Exp,
    Fill,
    GeGlu,
    GeGluErf,
    GeGluQuick,
    Gelu,
    GeluErf,
    GeluQuick,
    Glu,
    HardSigmoid,
    HardSwish,
    Log,
    Mul,
    Neg,
    ReGlu,
    Relu,
    Scale,
    Sgn,
    Sigmoid,
    Silu,
    Sin,
    Softplus,
    Sqr,
    Sqrt,
    Step,
    Sub,
    SwiGlu,
    Tanh,
    Unary,
    can_repeat,
)
from llamir.ir.ops.fused import NormMulAdd, RmsNormMul, SoftMaxAttn
from llamir.ir.ops.layout import Concat, Cont, Cpy, Permute, Repeat, Reshape, Transpose, View
from llamir.ir.ops.leaf import Leaf
from llamir.ir.ops.matmul import GetRows, MulMat, MulMatId, SetRows
from llamir.ir.ops.norm import GroupNorm, L2Norm, Norm, RmsNorm
from llamir.ir.ops.reduce import Argmax, Argsort, Cumsum, Mean, Sum, SumRows, TopK
from llamir.ir.ops.ssm import SsmConv, SsmScan

__all__ = [name for name in dir() if not name.startswith("_")]
