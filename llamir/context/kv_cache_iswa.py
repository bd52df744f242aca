"""The iSWA memory (llama_kv_cache_iswa): a full KV cache for the global-attention layers beside a
sliding-window cache for the SWA layers, driven in lockstep."""

from __future__ import annotations

from dataclasses import dataclass

from llamir.context.batch import BatchAllocator, UBatch
from llamir.context.kv_cache import KVCache, KVCacheContext, MemoryStatus
from llamir.context.memory import Memory
from llamir.context.params import pad
from llamir.frontend.hparams import HParams
from llamir.ir import DType


class KVCacheISWA(Memory):
    """Base cache (non-SWA layers) + SWA cache (window layers, a "_swa" input suffix)."""

    def __init__(self, hp: HParams, kv_size: int, n_seq_max: int, unified: bool, type_k: DType, type_v: DType,
                 v_trans: bool, swa_full: bool, n_ubatch: int, attn_rot: bool = True):
        self.unified = unified
        base_layers = tuple(il for il in range(hp.n_layer) if not hp.is_swa(il))
        swa_layers = tuple(il for il in range(hp.n_layer) if hp.is_swa(il))
        size_swa = kv_size if swa_full else pad(min(kv_size, hp.n_swa * (n_seq_max if unified else 1) + n_ubatch), 256)
        common = dict(n_seq_max=n_seq_max, unified=unified, type_k=type_k, type_v=type_v, v_trans=v_trans,
                      attn_rot=attn_rot)
        self.base = KVCache(hp, kv_size, layers=base_layers, **common)
        self.swa = KVCache(hp, size_swa, n_swa=hp.n_swa, swa_type=hp.swa_type, layers=swa_layers, suffix="_swa",
                           **common)

    @property
    def caches(self) -> tuple[KVCache, KVCache]:
        return (self.base, self.swa)

    @property
    def n_stream(self) -> int:
        return self.base.n_stream

    def total_bytes(self) -> int:
        return self.base.total_bytes() + self.swa.total_bytes()

    # -- batches ----------------------------------------------------------------------------------
    def init_batch(self, balloc: BatchAllocator, n_ubatch: int, embd_all: bool) -> ISWAContext:
        splits = ([lambda: balloc.split_simple(n_ubatch)] if self.unified else []) + \
                 [lambda: balloc.split_equal(n_ubatch, not self.unified)]
        for split in splits:
            balloc.split_reset()
            ubatches: list[UBatch] = []
            while (ub := split()) is not None:
                ubatches.append(ub)
            if balloc.n_used < balloc.n_tokens:
                continue
            slots_base = self.base.prepare(ubatches)
            slots_swa = self.swa.prepare(ubatches) if slots_base is not None else None
            if slots_swa is not None:
                return ISWAContext(KVCacheContext(self.base, MemoryStatus.SUCCESS, ubatches, slots_base),
                                   KVCacheContext(self.swa, MemoryStatus.SUCCESS, ubatches, slots_swa))
        failed = KVCacheContext(self.base, MemoryStatus.FAILED_PREPARE)
        return ISWAContext(failed, KVCacheContext(self.swa, MemoryStatus.FAILED_PREPARE))

    def init_full(self) -> ISWAContext:
        return ISWAContext(self.base.init_full(), self.swa.init_full())

    def get_can_shift(self) -> bool:
        return self.base.kv_size == self.swa.kv_size


    # -- sequences --------------------------------------------------------------------------------
    def clear(self, data: bool = True) -> None:
        for c in self.caches:
            c.clear(data)

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        ok = self.base.seq_rm(seq_id, p0, p1)
        return self.swa.seq_rm(seq_id, p0, p1) and ok

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        for c in self.caches:
            c.seq_cp(src, dst, p0, p1)

    def seq_keep(self, seq_id: int) -> None:
        for c in self.caches:
            c.seq_keep(seq_id)

    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        for c in self.caches:
            c.seq_add(seq_id, p0, p1, shift)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        for c in self.caches:
            c.seq_div(seq_id, p0, p1, d)

    def seq_pos_min(self, seq_id: int) -> int:
        return self.swa.seq_pos_min(seq_id)  # the SWA cache holds a subset of the base

    def seq_pos_max(self, seq_id: int) -> int:
        return self.swa.seq_pos_max(seq_id)


@dataclass
class ISWAContext:
    """Both caches' contexts over the same ubatches."""

    base: KVCacheContext
    swa: KVCacheContext

    @property
    def status(self) -> MemoryStatus:
        return self.base.status if self.base.status != MemoryStatus.SUCCESS else self.swa.status

    @property
    def n_kv(self) -> int:
        return self.base.n_kv

    def next(self) -> bool:
        self.swa.next()
        return self.base.next()

    def apply(self) -> bool:
        return self.base.apply() and self.swa.apply()

    def rollback(self, keep: int = 0) -> None:
        self.swa.rollback(keep)
        self.base.rollback(keep)

    @property
    def i_cur(self) -> int:
        return self.base.i_cur

    def get_ubatch(self) -> UBatch:
        return self.base.get_ubatch()

    def slot(self):
        return self.base.slot()

    def contexts(self) -> list[KVCacheContext]:
        return [self.base, self.swa]

    def bindings(self, n_tokens: int) -> dict[str, int]:
        return {**self.swa.bindings(n_tokens), **self.base.bindings(n_tokens)}
