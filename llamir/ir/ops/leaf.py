"""Leaves: values that enter a graph from outside rather than being computed in it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llamir.ir.ops.base import IRError, Op, register_op, require
from llamir.ir.types import TensorType

LEAF_KINDS = ("input", "weight", "state")


@register_op
@dataclass(frozen=True, slots=True)
class Leaf(Op):
    """A graph leaf. `input`: set per execution (tokens, positions, masks); `weight`: model
    parameters, read-only; `state`: persistent buffers a graph may write (KV cache)."""

    name: ClassVar[str] = "leaf"
    arity: ClassVar[int] = 0
    is_leaf: ClassVar[bool] = True
    kind: str = "input"

    def __post_init__(self) -> None:
        require(self.kind in LEAF_KINDS, f"leaf kind must be one of {LEAF_KINDS}, got {self.kind!r}")

    def infer(self, *inputs: TensorType) -> TensorType:
        raise IRError(f"a {self.kind} leaf has no inputs: its type is declared when it is added, not inferred")
