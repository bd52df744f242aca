"""The Op base class and the op registry.

An op is a frozen dataclass: its fields are its typed attributes, `infer` computes the
result type from the input types, and the class docstring states the math. Ops carry ggml's
names and semantics, in numpy dimension order.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import ClassVar

from llamir.ir.types import TensorType


class IRError(ValueError):
    """An ill-formed graph or op use, with what was wrong in the message."""


def require(cond: bool, message: str) -> None:
    """Raise IRError(message) unless `cond` holds: the one way ops state their preconditions."""
    if not cond:
        raise IRError(message)


OPS: dict[str, type[Op]] = {}


def register_op(cls: type[Op]) -> type[Op]:
    """Record an op class under its ggml name (lowercase, e.g. "rms_norm")."""
    name = cls.name
    if name in OPS and OPS[name] is not cls:
        raise RuntimeError(f"op name {name!r} registered twice")
    OPS[name] = cls
    return cls


class Op(ABC):
    """Base of all ops. Subclasses are `@register_op @dataclass(frozen=True, slots=True)`."""

    name: ClassVar[str] = "?"
    arity: ClassVar[int] = 1
    is_view: ClassVar[bool] = False          # VIEW/RESHAPE/PERMUTE/TRANSPOSE: output aliases input 0
    has_side_effects: ClassVar[bool] = False  # writes into a persistent input (set_rows)
    can_inplace: ClassVar[bool] = False       # ggml_op_can_inplace: the result may reuse input memory
    is_elementwise: ClassVar[bool] = False
    is_leaf: ClassVar[bool] = False

    def n_inputs(self) -> int:
        """How many inputs this op instance takes (optional operands are attribute-driven)."""
        return self.arity

    @abstractmethod
    def infer(self, *inputs: TensorType) -> TensorType:
        """The result type for these input types; IRError (via `require`) when they do not fit."""

    def check_and_infer(self, inputs: tuple[TensorType, ...]) -> TensorType:
        """Arity check, then `infer`; errors name the op."""
        n = self.n_inputs()
        require(len(inputs) == n, f"{self.name} takes {n} inputs, got {len(inputs)}")
        try:
            return self.infer(*inputs)
        except IRError as err:
            raise IRError(f"{self.name}: {err}") from None
        except ValueError as err:  # shape arithmetic (dims, TensorType) failing on bad input
            raise IRError(f"{self.name}: {err}") from None

    def attrs(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def attr_fields(cls) -> tuple[dataclasses.Field, ...]:
        return dataclasses.fields(cls)  # type: ignore[arg-type]

    def __str__(self) -> str:
        return self.name


def same_shape(a: TensorType, b: TensorType) -> bool:
    return a.shape == b.shape
