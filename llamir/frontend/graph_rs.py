"""The graph side of recurrent memory: the per-layer state leaves and how a ubatch reads and writes
them, as llama.cpp's llama_memory_recurrent and llm_graph_context::build_rs lay them out.

Layout (numpy order): per recurrent layer il, `cache_r_l{il}` [size, n_embd_r] holds each cell's
conv state (the last d_conv - 1 inputs of the 1-D convolution) and `cache_s_l{il}` [size, n_embd_s]
its scan state, f32. A ubatch of `rs_seqs` sequences with `rs_seq_tokens` tokens each uses the
`n_rs` cells head .. head + n_rs - 1 (its own sequences first), whose states may still sit in other
rows: llama.cpp's find_slot moves cells' metadata, not their data.

build_rs moves the data: every cell of the range takes the row its state is in (`rs_s_copy`,
llama.cpp's s_copy), times 0 for a cell that starts from nothing (`rs_keep`; llama.cpp zeroes the
row rs_z and points those cells at it), written back into the range's own rows (`rs_dst`, head + i).
The layer then reads its sequences' states from their own rows and writes the new ones there.
All of it is ordered by data: the move reads before it writes, and what reads the moved tensor
comes after the move.
"""

from __future__ import annotations

from dataclasses import dataclass

from llamir.frontend.built import InputSpec
from llamir.ir import F32, I32, GraphBuilder, Node, sym
from llamir.ir.dims import Dim

RS_DIM_NAMES = ("rs_seqs", "rs_seq_tokens", "n_rs")
RS_INPUTS = ("rs_s_copy", "rs_keep", "rs_dst")


@dataclass(frozen=True)
class RSLayout:
    """The recurrent state as graphs see it: `size` cells of an r and an s row per layer."""

    size: int
    n_embd_r: int
    n_embd_s: int
    layers: tuple[int, ...] = ()
    n_layer: int = 0          # the model's layers (a state counts them all; a hybrid's others keep none)

    def r_shape(self) -> tuple[int, int]:
        return (self.size, self.n_embd_r)

    def s_shape(self) -> tuple[int, int]:
        return (self.size, self.n_embd_s)


def cache_r_name(il: int) -> str:
    return f"cache_r_l{il}"


def cache_s_name(il: int) -> str:
    return f"cache_s_l{il}"


class RSGraph:
    """build_rs_inp and build_rs for one graph: the inputs, the state leaves and their moves."""

    def __init__(self, b: GraphBuilder, layout: RSLayout, n_seqs: Dim | None = None, n_seq_tokens: Dim | None = None):
        """`n_seqs` and `n_seq_tokens`: the ubatch's sequences and tokens per sequence (rs_seqs and
        rs_seq_tokens, or a hybrid's KV streams ns and T_s)."""
        self.b, self.layout = b, layout
        self.n_seqs = sym("rs_seqs") if n_seqs is None else n_seqs
        self.n_seq_tokens = sym("rs_seq_tokens") if n_seq_tokens is None else n_seq_tokens
        self.n_rs = sym("n_rs")
        self.s_copy = b.input("rs_s_copy", [self.n_rs], I32)          # the row holding each cell's state
        self.keep = b.input("rs_keep", [self.n_rs, 1], F32)           # 0: the cell starts from zero
        self.dst = b.input("rs_dst", [self.n_rs], I32)                # head + i
        self.ids = b.view(self.dst, [self.n_seqs], [4], 0, name="rs_ids")   # the ubatch's own cells

    def input_spec(self) -> InputSpec:
        return InputSpec("rs", RS_INPUTS)

    def _leaf(self, name: str, shape: tuple[int, int]) -> Node:
        return self.b.state(name, shape, F32)

    def _moved(self, name: str, shape: tuple[int, int]) -> Node:
        """The state leaf after every cell of the range took its state into its own row."""
        states = self._leaf(name, shape)
        rows = self.b.mul(self.b.get_rows(states, self.s_copy), self.keep)        # [n_rs, n_embd]
        return self.b.set_rows(states, rows, self.dst)                            # [size, n_embd]

    def r(self, il: int) -> Node:
        """The conv states (r) of layer il, moved; read the ubatch's rows with `own`."""
        return self._moved(cache_r_name(il), self.layout.r_shape())

    def s(self, il: int) -> Node:
        """The scan states (s) of layer il, moved: ssm_scan reads them through `ids`."""
        return self._moved(cache_s_name(il), self.layout.s_shape())

    def own(self, moved: Node) -> Node:
        """The ubatch's sequences' rows of a moved state: [rs_seqs, n_embd]."""
        return self.b.get_rows(moved, self.ids)

    def store(self, moved: Node, rows: Node, name=None) -> Node:
        """Write the ubatch's new states [rs_seqs, n_embd] into their cells' rows (after the move)."""
        return self.b.set_rows(moved, rows, self.ids, name=name)


__all__ = ["RS_DIM_NAMES", "RS_INPUTS", "RSGraph", "RSLayout", "cache_r_name", "cache_s_name"]
