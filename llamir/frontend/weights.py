"""Typed access to a model's weights through its architecture's tensor specs: a builder reads
`L = g.layer_weights(il); L.attn_q` (llama.cpp's `model.layers[il].wq`) instead of spelling
"blk.{il}.attn_q.weight", so the specs are the one list of the tensors an architecture has."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llamir.frontend.graph_context import GraphContext
    from llamir.ir import Node


class UndeclaredTensorError(AttributeError):
    """A builder asked for a tensor that its architecture's tensor_specs does not declare."""


def gguf_suffix(attr: str) -> str:
    """The GGUF name an attribute stands for: attn_q -> attn_q.weight, attn_q_bias -> attn_q.bias;
    a name that has its suffix already (attn_q.bias) is kept."""
    if "." in attr:
        return attr
    if attr.endswith("_bias"):
        return attr[: -len("_bias")] + ".bias"
    return attr + ".weight"


class Weights:
    """The weights under one prefix ("blk.3." for a block, "" for the model's own), by their specs.

    `L.attn_q` is blk.3.attn_q.weight and `L.attn_q_bias` blk.3.attn_q.bias (`L["attn_q.bias"]`
    the same): a required tensor gives its weight leaf (an ArchError when the model lacks it), an
    optional one the leaf or None, and a tensor the architecture does not declare an
    UndeclaredTensorError that lists the ones it does."""

    __slots__ = ("_g", "prefix")

    def __init__(self, g: GraphContext, prefix: str = ""):
        self._g = g
        self.prefix = prefix

    def __getattr__(self, attr: str) -> Node | None:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return self[gguf_suffix(attr)]

    def __getitem__(self, name: str) -> Node | None:
        return self._g.declared_weight(self.prefix + name)

    def names(self) -> list[str]:
        """The declared tensors under this prefix (without it), in spec order; a global group lists
        the tensors of no block."""
        specs = self._g.model.tensor_specs
        if self.prefix:
            return [n[len(self.prefix):] for n in specs if n.startswith(self.prefix)]
        return [n for n in specs if not n.startswith("blk.")]

    def __repr__(self) -> str:
        return f"<Weights {self.prefix or '(global)'} {', '.join(self.names())}>"


__all__ = ["UndeclaredTensorError", "Weights", "gguf_suffix"]
