"""The hybrid memory (llama_memory_hybrid): a KV cache for the attention layers beside a recurrent
memory for the recurrent ones (Jamba), driven together.

Batches split as the recurrent memory needs them (by sequence when every token is an output,
else equal runs, sequential only for a KV cache of several streams); the recurrent memory
prepares first, then the KV cache. A sequence operation runs on both, seq_rm on the recurrent
memory first (when it refuses, nothing changes); a sequence's positions are where both have it.
State: the KV cache's part (skipped with PARTIAL_ONLY), then the recurrent part.
"""

from __future__ import annotations

from collections.abc import Mapping

from llamir.context.batch import BatchAllocator, UBatch
from llamir.context.kv_cache import KVCache, KVCacheContext, MemoryStatus
from llamir.context.memory import Memory
from llamir.context.memory_recurrent import RecurrentContext, RecurrentMemory
from llamir.context.state_kv import STATE_SEQ_FLAGS_PARTIAL_ONLY, check_memory_seq_id


class HybridMemory(Memory):
    """`attn` holds the attention layers' K/V, `recr` the recurrent layers' state."""

    def __init__(self, attn: KVCache, recr: RecurrentMemory):
        self.attn, self.recr = attn, recr

    @property
    def caches(self) -> tuple[KVCache]:
        return (self.attn,)

    @property
    def rs_layout(self):
        return self.recr.layout

    @property
    def n_seq_max(self) -> int:
        return self.attn.n_seq_max

    @property
    def buffers(self) -> dict:
        return {**self.attn.tensors, **self.recr.tensors}

    def place(self, buffers: Mapping) -> None:
        self.attn.place(buffers)
        self.recr.place(buffers)

    def total_bytes(self) -> int:
        return self.attn.total_bytes() + self.recr.total_bytes()

    # -- batches ----------------------------------------------------------------------------------
    def init_batch(self, balloc: BatchAllocator, n_ubatch: int, embd_all: bool) -> HybridContext:
        balloc.split_reset()
        ubatches: list[UBatch] = []
        sequential = self.attn.n_stream > 1
        while True:
            ub = balloc.split_seq(n_ubatch) if embd_all else balloc.split_equal(n_ubatch, sequential)
            if ub is None or ub.n_tokens == 0:
                break
            ubatches.append(ub)
        if balloc.n_used < balloc.n_tokens or not self.recr.prepare(ubatches):
            return HybridContext.failed(self)
        slots = self.attn.prepare(ubatches)
        if slots is None:
            return HybridContext.failed(self)
        return HybridContext(KVCacheContext(self.attn, MemoryStatus.SUCCESS, ubatches, slots),
                             RecurrentContext(self.recr, MemoryStatus.SUCCESS, ubatches))

    def init_full(self) -> HybridContext:
        return HybridContext(self.attn.init_full(), self.recr.init_full())

    def get_can_shift(self) -> bool:
        return self.attn.get_can_shift()

    def clear(self, data: bool = True) -> None:
        self.attn.clear(data)
        self.recr.clear(data)

    # -- sequences --------------------------------------------------------------------------------
    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        if not self.recr.seq_rm(seq_id, p0, p1):
            return False
        return self.attn.seq_rm(seq_id, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        self.attn.seq_cp(src, dst, p0, p1)
        self.recr.seq_cp(src, dst, p0, p1)

    def seq_keep(self, seq_id: int) -> None:
        self.attn.seq_keep(seq_id)
        self.recr.seq_keep(seq_id)

    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        self.attn.seq_add(seq_id, p0, p1, shift)
        self.recr.seq_add(seq_id, p0, p1, shift)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        self.attn.seq_div(seq_id, p0, p1, d)
        self.recr.seq_div(seq_id, p0, p1, d)

    def seq_pos_min(self, seq_id: int) -> int:
        return max(self.attn.seq_pos_min(seq_id), self.recr.seq_pos_min(seq_id))

    def seq_pos_max(self, seq_id: int) -> int:
        return min(self.attn.seq_pos_max(seq_id), self.recr.seq_pos_max(seq_id))

    # -- state ------------------------------------------------------------------------------------
    def state_write(self, writer, seq_id: int = -1, flags: int = 0) -> None:
        check_memory_seq_id(self, seq_id)
        if not flags & STATE_SEQ_FLAGS_PARTIAL_ONLY:
            self.attn.state_write(writer, seq_id, flags)
        self.recr.state_write(writer, seq_id, flags)

    def state_parse(self, reader, source, flags: int = 0):
        attn = None if flags & STATE_SEQ_FLAGS_PARTIAL_ONLY else self.attn.state_parse(reader, source, flags)
        return attn, self.recr.state_parse(reader, source, flags)

    def state_apply(self, parsed, dest_seq_id: int) -> None:
        """Both parts, or neither: a recurrent part that finds no cell puts the KV cache back."""
        attn, recr = parsed
        if attn is None:
            self.recr.state_apply(recr, dest_seq_id)
            return
        record = self.recr.record()
        saved = self.attn_snapshot()
        self.attn.state_apply(attn, dest_seq_id)
        try:
            self.recr.state_apply(recr, dest_seq_id)
        except BaseException:
            self.recr.restore(record)
            self.attn_restore(saved)
            raise

    def attn_snapshot(self):
        """The KV cache's cells, heads and tensors (what a state restore changes)."""
        cells = [c.snapshot() for c in self.attn.v_cells]
        tensors = {name: self.attn.host(name).copy() for name in self.attn.tensors}
        return cells, list(self.attn.v_heads), tensors

    def attn_restore(self, saved) -> None:
        cells, heads, tensors = saved
        for c, snap in zip(self.attn.v_cells, cells):
            c.restore(snap)
        self.attn.v_heads = heads
        for name, array in tensors.items():
            host = self.attn.host(name)
            host[...] = array
            self.attn.put_back(name, host)


class HybridContext:
    """llama_memory_hybrid_context: the KV cache's and the recurrent memory's contexts in lockstep."""

    def __init__(self, attn: KVCacheContext, recr: RecurrentContext):
        self.attn, self.recr = attn, recr
        failed = MemoryStatus.FAILED_PREPARE
        self.status = failed if failed in (attn.status, recr.status) else MemoryStatus.SUCCESS

    @classmethod
    def failed(cls, memory: HybridMemory) -> HybridContext:
        return cls(KVCacheContext(memory.attn, MemoryStatus.FAILED_PREPARE),
                   RecurrentContext(memory.recr, MemoryStatus.FAILED_PREPARE))

    @property
    def i_cur(self) -> int:
        return self.attn.i_cur

    @property
    def recurrent(self) -> RecurrentContext:
        return self.recr

    def next(self) -> bool:
        self.recr.next()
        return self.attn.next()

    def apply(self) -> bool:
        return self.attn.apply() and self.recr.apply()

    def rollback(self, keep: int = 0) -> None:
        self.recr.rollback(keep)
        self.attn.rollback(keep)

    def get_ubatch(self) -> UBatch:
        return self.attn.get_ubatch()

    def contexts(self) -> list[KVCacheContext]:
        return [self.attn]

    def bindings(self, n_tokens: int) -> dict[str, int]:
        return {**self.attn.bindings(n_tokens), **self.recr.bindings(n_tokens)}


__all__ = ["HybridContext", "HybridMemory"]
