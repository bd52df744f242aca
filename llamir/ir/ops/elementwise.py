"""Element-wise ops: binary arithmetic with ggml's repeat-broadcast, unary functions, GLUs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llamir.ir import dims
from llamir.ir.ops.base import Op, register_op, require
from llamir.ir.types import TensorType


def can_repeat(small: TensorType, big: TensorType) -> bool:
    """ggml_can_repeat, right-aligned: each dim of `small` tiles the matching dim of `big`."""
    if small.rank > big.rank:
        return False
    return all(dims.broadcast_ok(s, b) for s, b in zip(reversed(small.shape), reversed(big.shape)))


class Binary(Op):
    """y = a (op) b, b repeated (tiled, not only size-1 broadcast) to a's shape; y has a's type."""

    arity: ClassVar[int] = 2
    can_inplace: ClassVar[bool] = True
    is_elementwise: ClassVar[bool] = True

    def infer(self, a: TensorType, b: TensorType) -> TensorType:
        require(a.dtype.is_float and b.dtype.is_float, f"expects float inputs, got {a.dtype} and {b.dtype}")
        require(can_repeat(b, a), f"{b} cannot be repeated to {a}")
        return a


@register_op
@dataclass(frozen=True, slots=True)
class Add(Binary):
    """y = a + b (b tiled to a's shape)."""
    name: ClassVar[str] = "add"


@register_op
@dataclass(frozen=True, slots=True)
class Sub(Binary):
    """y = a - b (b tiled to a's shape)."""
    name: ClassVar[str] = "sub"


@register_op
@dataclass(frozen=True, slots=True)
class Mul(Binary):
    """y = a * b (b tiled to a's shape)."""
    name: ClassVar[str] = "mul"


@register_op
@dataclass(frozen=True, slots=True)
class Div(Binary):
    """y = a / b (b tiled to a's shape)."""
    name: ClassVar[str] = "div"


class Unary(Op):
    """y = f(x) element-wise; same type as x."""

    can_inplace: ClassVar[bool] = True
    is_elementwise: ClassVar[bool] = True

    def infer(self, x: TensorType) -> TensorType:
        require(x.dtype.is_float, f"expects a float input, got {x.dtype}")
        return x


def _unary(op_name: str, doc: str) -> type[Unary]:
    cls = type(op_name.title().replace("_", ""), (Unary,), {"__doc__": doc, "name": op_name,
                                                             "__annotations__": {}})
    cls.name = op_name
    return register_op(dataclass(frozen=True, slots=True)(cls))


Neg = _unary("neg", "y = -x")
Abs = _unary("abs", "y = |x|")
Sgn = _unary("sgn", "y = sign(x)")
Step = _unary("step", "y = 1 if x > 0 else 0")
Tanh = _unary("tanh", "y = tanh(x)")
Elu = _unary("elu", "y = x if x > 0 else exp(x) - 1")
Relu = _unary("relu", "y = max(x, 0)")
Sigmoid = _unary("sigmoid", "y = 1 / (1 + exp(-x))")
Gelu = _unary("gelu", "y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))")
GeluErf = _unary("gelu_erf", "y = 0.5 x (1 + erf(x / sqrt(2)))")
GeluQuick = _unary("gelu_quick", "y = x sigmoid(1.702 x)")
Silu = _unary("silu", "y = x sigmoid(x)")
HardSigmoid = _unary("hardsigmoid", "y = clamp((x + 3) / 6, 0, 1)")
HardSwish = _unary("hardswish", "y = x clamp((x + 3) / 6, 0, 1)")
Exp = _unary("exp", "y = exp(x)")
Log = _unary("log", "y = ln(x)")
Sqr = _unary("sqr", "y = x^2")
Sqrt = _unary("sqrt", "y = sqrt(x)")
Sin = _unary("sin", "y = sin(x)")
Cos = _unary("cos", "y = cos(x)")
Softplus = _unary("softplus", "y = ln(1 + exp(x))")


@register_op
@dataclass(frozen=True, slots=True)
class Scale(Op):
    """y = x * s + b (ggml_scale / ggml_scale_bias)."""

    name: ClassVar[str] = "scale"
    can_inplace: ClassVar[bool] = True
    is_elementwise: ClassVar[bool] = True
    s: float = 1.0
    b: float = 0.0

    def infer(self, x: TensorType) -> TensorType:
        require(x.dtype.is_float, f"expects a float input, got {x.dtype}")
        return x


@register_op
@dataclass(frozen=True, slots=True)
class Clamp(Op):
    """y = min(max(x, min), max)."""

    name: ClassVar[str] = "clamp"
    is_elementwise: ClassVar[bool] = True
    min: float = float("-inf")
    max: float = float("inf")

    def infer(self, x: TensorType) -> TensorType:
        require(x.dtype.is_float, f"expects a float input, got {x.dtype}")
        return x


@register_op
@dataclass(frozen=True, slots=True)
class Fill(Op):
    """y = c everywhere, with x's type (ggml_fill)."""

    name: ClassVar[str] = "fill"
    can_inplace: ClassVar[bool] = True
    c: float = 0.0

    def infer(self, x: TensorType) -> TensorType:
        require(x.dtype.is_float, f"expects a float input, got {x.dtype}")
        return x


GLU_KINDS = ("swiglu", "geglu", "reglu", "geglu_erf", "geglu_quick")


class Glu(Op):
    """Gated unit. Split form (a, b): y = act(a) * b. Fused form (x): a, b = halves of x's last
    axis (a first unless `swapped`), so y has half of x's last axis."""

    split: bool = True
    swapped: bool = False

    def n_inputs(self) -> int:
        return 2 if self.split else 1

    def infer(self, *xs: TensorType) -> TensorType:
        a = xs[0]
        require(a.dtype.is_float, f"expects float inputs, got {a.dtype}")
        if self.split:
            require(xs[1].shape == a.shape, f"gate {a} and up {xs[1]} shapes differ")
            return a
        last = a.shape[-1]
        require(isinstance(last, int) and last % 2 == 0, f"fused form needs an even last axis, got {a}")
        return a.with_shape(a.shape[:-1] + (last // 2,))


def _glu(op_name: str, doc: str) -> type[Glu]:
    cls = type(op_name.title().replace("_", ""), (Glu,), {
        "__doc__": doc, "__annotations__": {"split": "bool", "swapped": "bool"},
        "split": True, "swapped": False})
    cls.name = op_name
    cls.is_elementwise = True
    return register_op(dataclass(frozen=True, slots=True)(cls))


SwiGlu = _glu("swiglu", "y = silu(a) * b")
GeGlu = _glu("geglu", "y = gelu(a) * b")
ReGlu = _glu("reglu", "y = relu(a) * b")
GeGluErf = _glu("geglu_erf", "y = gelu_erf(a) * b")
GeGluQuick = _glu("geglu_quick", "y = gelu_quick(a) * b")
