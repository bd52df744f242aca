"""The one-token decode, without the general path's objects: a generated token (one token, one
sequence, its logits) over a single-stream KV cache with a reusable graph.

Context.decode's general path builds a BatchAllocator state, a ubatch, a slot, a KV cache
context, an undo record, the graph params and the outputs' rollback copy for every token; for a
4.5M model those cost as much as the kernels. A generated token needs none of them: its cell is
the first free one from the head, its inputs are four scalars and one mask row written into the
arrays the graph is bound to, and its logits row is written only once the compute succeeded (so a
failure has nothing of the outputs to put back).

TokenStep does exactly what the general path would do for such a batch, bit for bit: the same
cell, head, positions, mask, inputs, outputs, perf counters and rollback. Whatever it does not
cover (a batch that the general path would refuse, several tokens or sequences, a cell to reuse
in a sliding window, a pending K-shift, a new n_kv, callbacks) it hands back untouched: decode()
returns None before changing anything, and the general path takes the batch.
"""

from __future__ import annotations

import numpy as np

from llamir.context.batch import POS_LIMIT, Batch
from llamir.context.graph_inputs import GraphResult, InputAttnKV, InputEmbd, InputOutIds, InputPos
from llamir.context.kv_cache import KVCache, padded_n_kv

_I64, _BOOL = np.dtype(np.int64), np.dtype(bool)
_INPUT_KINDS = frozenset({InputEmbd, InputPos, InputOutIds, InputAttnKV})


class TokenStep:
    """Armed by the context after a one-token decode through the general path succeeded: it
    keeps that graph's bound input arrays and bindings, and serves the next tokens while the
    graph stays the one the general path would reuse."""

    def __init__(self, ctx, result: GraphResult, kv: InputAttnKV, bindings: dict[str, int]):
        self.ctx = ctx
        self.cparams = ctx.cparams
        self.result = result
        self.memory: KVCache = ctx.memory
        self.bindings = dict(bindings)
        self.executable = result.graph.executable
        # a backend's executable may offer to run again on what its last call bound
        self.call_bound = getattr(self.executable, "call_bound", None)
        self.binding = getattr(self.executable, "binding", None)
        values = result.values
        k_name, v_name, mask_name = kv.leaf_names
        self.n_kv = kv.n_kv
        self.tokens, self.pos, self.out_ids = values["inp_tokens"], values["inp_pos"], values["inp_out_ids"]
        self.k_idxs, self.v_idxs, self.mask = values[k_name], values[v_name], values[mask_name]
        kv_size = self.memory.kv_size
        # v_idxs of cell c: c + j * kv_size for each of the n_embd_v_gqa rows (transposed V)
        self.v_rows = np.arange(len(self.v_idxs), dtype=np.int64) * kv_size if self.memory.layout.v_trans else None
        # the mask row: allowed (1) -> 0, masked (0) -> -inf, in the mask's dtype
        self.fill = np.array([-np.inf, 0.0], dtype=self.mask.dtype)
        self.mask_row = self.mask.reshape(-1)
        self.n_vocab = ctx.model.hparams.n_vocab

    @classmethod
    def arm(cls, ctx, result: GraphResult | None, bindings: dict[str, int]) -> TokenStep | None:
        """A TokenStep for the graph a one-token decode just ran, or None if that graph is not
        one it can serve."""
        cp, memory = ctx.cparams, ctx.memory
        if (result is None or result.graph.executable is None or not ctx.runner.single
                or type(memory) is not KVCache or memory.n_stream != 1 or memory.swa_type != "none"
                or memory.n_swa or not cp.graph_reuse or not cp.causal_attn or cp.embeddings
                or {type(inp) for inp in result.inputs} != _INPUT_KINDS or len(result.inputs) != 4):
            return None
        p = result.params
        if (p.n_tokens, p.n_seq_tokens, p.n_seqs, p.n_seqs_unq, p.n_outputs) != (1, 1, 1, 1, 1) \
                or p.equal_seqs or not p.has_tokens or p.gtype != "decoder":
            return None
        kv = next(inp for inp in result.inputs if type(inp) is InputAttnKV)
        if kv.alibi or kv.suffix or kv.mctx.cache is not memory or not kv.causal:
            return None
        return cls(ctx, result, kv, bindings)

    def decode(self, batch: Batch) -> int | None:
        """The status of decoding `batch`, or None (nothing changed) if the general path must."""
        ctx = self.ctx
        if (ctx._prev is not self.result or ctx.memory is not self.memory or ctx.cparams is not self.cparams
                or ctx.abort_callback is not None or ctx.cb_eval is not None
                or type(batch) is not Batch or batch.embd is not None):
            return None
        token = self._one_int(batch.tokens)
        if token is None or not 0 <= token < self.n_vocab:
            return None
        seq_ids = batch.seq_ids
        if seq_ids is None:
            s = 0
        elif type(seq_ids) is list and len(seq_ids) == 1 and type(seq_ids[0]) is tuple and len(seq_ids[0]) == 1:
            s = seq_ids[0][0]
            if type(s) is not int or not 0 <= s < self.memory.n_seq_max:
                return None
        else:
            return None
        logits = batch.logits
        if logits is not None and not (type(logits) is np.ndarray and logits.shape == (1,)
                                       and logits.dtype == _BOOL and logits[0]):
            return None
        memory = self.memory
        if memory.pending_copies:
            return None
        cells = memory.v_cells[0]
        if cells.has_shift:
            return None
        # the position: the sequence's next one, or the batch's if it continues the sequence
        p_max = cells.seq_pos_max(s)
        if batch.pos is None:
            p = p_max + 1
        else:
            p = self._one_int(batch.pos)
            if p is None or (p_max >= 0 and p != p_max + 1):
                return None
        if not 0 <= p <= POS_LIMIT:
            return None
        # the slot: find_slot's, the first empty cell from the head
        found = memory.free_cells(0, 1)
        if found is None:
            return None
        idx = int(found[0])
        # the graph is the one to reuse only while n_kv (the used prefix padded to 256) stays
        if padded_n_kv(cells.size, max(cells.used_max_p1(), idx + 1)) != self.n_kv:
            return None

        perf = ctx.perf_counters
        perf.start(1)
        old_head, old_shift = memory.v_heads[0], int(cells.shift[idx])
        cells.pos_set(idx, p)
        try:
            cells.seq_add(idx, s)
            memory.v_heads[0] = idx + 1
            perf.n_reused += 1
            self._set_inputs(token, p, idx, cells, s)
            status, message, out = ctx._compute(self.result.graph, self.result.values, self.bindings, 1, self._run)
        except BaseException:
            self._rollback(cells, idx, old_head, old_shift)
            raise
        if status:
            self._rollback(cells, idx, old_head, old_shift)
            return ctx._fail(status, message)
        ctx.outputs.commit_one(out.get("logits"), out.get("embd"))
        perf.stop()
        return 0

    def _set_inputs(self, token: int, p: int, idx: int, cells, s: int) -> None:
        """What GraphResult.set_inputs writes for this token, into the same arrays."""
        self.tokens[0] = token
        self.pos[0] = p
        self.out_ids[0] = 0
        self.k_idxs[0] = idx
        if self.v_rows is None:
            self.v_idxs[0] = idx
        else:
            np.add(self.v_rows, idx, out=self.v_idxs)
        # KVCache.kq_mask: the cells of sequence s at positions <= p, which are all of s's cells
        # (p is past every position s holds: the sequence's next one, or s held none)
        np.take(self.fill, cells.seq[:self.n_kv, s].view(np.uint8), out=self.mask_row)

    def _run(self) -> dict:
        """The graph on the inputs just written: without binding them again while the
        executable still holds what the arming call (or the last full call here) bound."""
        out = None if self.call_bound is None else self.call_bound(self.binding)
        if out is None:
            out = self.ctx.runner.run(self.result.graph, self.result.values, self.bindings, 1, None)
            self.binding = getattr(self.executable, "binding", None)
        return out

    def _rollback(self, cells, idx: int, head: int, shift: int) -> None:
        """The cell empty again (as it was) and the head back: what KVCache.undo would restore."""
        cells.rm(idx)
        cells.shift[idx] = shift
        self.memory.v_heads[0] = head

    @staticmethod
    def _one_int(value) -> int | None:
        """The one element of a 1-element int64 array (a batch's checked form), else None."""
        if type(value) is np.ndarray and value.shape == (1,) and value.dtype == _I64:
            x = int(value[0])
            if -2**31 <= x < 2**31:
                return x
        return None
