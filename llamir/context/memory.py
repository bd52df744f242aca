"""The memory of a context (llama_memory_i): one base class for every kind, and the kinds an
architecture's `create_memory` may choose (llama_model::create_memory).

A memory is a set of caches (KVCache), each with its layout (the graph's view of it: the K/V
shapes, the input suffix) and its tensors. The base class gives what is the same for every kind:
its layouts and tensors, placing tensors in a device's memory, the byte count, the pending-update
check and state save/load (llamir.context.state_kv walks the caches); a kind implements batches,
sequence operations and its caches.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping

import numpy as np

log = logging.getLogger("llamir")


class Memory(ABC):
    """What a context needs from its memory."""

    @property
    @abstractmethod
    def caches(self) -> tuple:
        """The KV caches, in the order the graph's inputs and the state blob list them."""

    # -- what every kind has --------------------------------------------------------------------
    @property
    def layouts(self) -> tuple:
        """Each cache's layout: what a graph reads and writes (GraphConfig.memory)."""
        return tuple(cache.layout for cache in self.caches)

    @property
    def buffers(self) -> dict[str, np.ndarray]:
        """Every cache tensor by leaf name (host arrays, or TensorData in a device's memory)."""
        return {name: t for cache in self.caches for name, t in cache.tensors.items()}

    def place(self, buffers: Mapping) -> None:
        """Move tensors placed on a device into its memory (KVCache.place)."""
        for cache in self.caches:
            cache.place(buffers)

    def total_bytes(self) -> int:
        return sum(cache.total_bytes() for cache in self.caches)

    def has_pending_update(self) -> bool:
        return any(cache.has_pending_update() for cache in self.caches)

    def init_update(self, ctx):
        """llama_memory_i::init_update: NO_UPDATE when nothing is pending; else a context whose
        apply() runs the K-shift and the queued stream copies through the context's backend."""
        from llamir.context.kv_cache import MemoryStatus, UpdateContext

        status = MemoryStatus.SUCCESS if self.has_pending_update() else MemoryStatus.NO_UPDATE
        return UpdateContext(self, ctx, status)

    def state_write(self, writer, seq_id: int = -1, flags: int = 0) -> None:
        """Every cell (seq_id -1) or one sequence's, cache by cache (llamir.context.state_kv)."""
        from llamir.context import state_kv

        state_kv.check_memory_seq_id(self, seq_id)
        state_kv.write_memory(writer, self, seq_id, flags)

    def state_parse(self, reader, source, flags: int = 0):
        """Parse and check this memory's part of a state, a whole one (source None) or one
        sequence's (a state_kv.SeqSource), changing nothing; state_apply commits it."""
        from llamir.context import state_kv

        return state_kv.read_memory(reader, self, source, flags)

    def state_apply(self, parsed, dest_seq_id: int) -> None:
        """Commit what state_parse read: the whole memory (dest_seq_id -1) or one sequence."""
        from llamir.context import state_kv

        state_kv.apply_memory(parsed, dest_seq_id)

    def state_read(self, reader, seq_id: int = -1, flags: int = 0) -> None:
        """Parse and check every part first, then apply: a bad blob raises StateError and nothing
        changes."""
        from llamir.context import state_kv

        state_kv.check_memory_seq_id(self, seq_id)
        source = None if seq_id == -1 else state_kv.SeqSource()
        self.state_apply(self.state_parse(reader, source, flags), seq_id)

    # -- what each kind implements --------------------------------------------------------------
    @abstractmethod
    def init_batch(self, balloc, n_ubatch: int, embd_all: bool): ...

    @abstractmethod
    def init_full(self): ...

    @abstractmethod
    def get_can_shift(self) -> bool: ...

    @abstractmethod
    def clear(self, data: bool = True) -> None: ...

    @abstractmethod
    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool: ...

    @abstractmethod
    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None: ...

    @abstractmethod
    def seq_keep(self, seq_id: int) -> None: ...

    @abstractmethod
    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None: ...

    @abstractmethod
    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None: ...

    @abstractmethod
    def seq_pos_min(self, seq_id: int) -> int: ...

    @abstractmethod
    def seq_pos_max(self, seq_id: int) -> int: ...


# -- the tensors of a memory: host arrays, or TensorData in a device's memory ------------------
def place_tensors(tensors: dict, buffers: Mapping, what: str) -> None:
    """Move the tensors the placement put in a device's memory there, one buffer per buffer type
    (as llama.cpp allocates a memory's tensors from each layer's device buffer type); their
    contents come along."""
    from llamir.backends.base import alloc_tensors

    by_buft: dict[int, tuple[object, dict[str, np.ndarray]]] = {}
    for name, buf in tensors.items():
        tb = buffers.get(name)
        if tb is None or tb.buft.is_host or not isinstance(buf, np.ndarray):
            continue
        by_buft.setdefault(id(tb.buft), (tb.buft, {}))[1][name] = buf
    for buft, arrays in by_buft.values():
        placed = alloc_tensors(buft, {name: (a.shape, a.dtype) for name, a in arrays.items()})
        for name, td in placed.items():
            td.write(arrays[name])
            tensors[name] = td
        log.info("%s: %d tensors (%d bytes) in %s memory", what, len(placed),
                 sum(td.nbytes for td in placed.values()), buft.name)


def host_array(buf) -> np.ndarray:
    """A memory tensor as a host array: itself in host memory, else a copy (see put_back)."""
    return buf if isinstance(buf, np.ndarray) else buf.read()


def put_back(buf, array: np.ndarray) -> None:
    """After changing host_array(buf): a device tensor gets the new contents."""
    if not isinstance(buf, np.ndarray):
        buf.write(array)


def zero_tensors(tensors: dict) -> None:
    for buf in tensors.values():
        if isinstance(buf, np.ndarray):
            buf[...] = 0
        else:
            buf.write(np.zeros(buf.shape, buf.dtype))


def _kv(hp, cp, common, arch) -> Memory:
    from llamir.context.kv_cache import KVCache

    return KVCache(hp, cp.n_ctx_seq, **common)


def _kv_iswa(hp, cp, common, arch) -> Memory:
    from llamir.context.kv_cache_iswa import KVCacheISWA

    return KVCacheISWA(hp, cp.n_ctx_seq, swa_full=cp.swa_full, n_ubatch=cp.n_ubatch, **common)


def _recurrent(hp, cp, common, arch) -> Memory:
    """llama_memory_recurrent: max(1, n_seq_max) cells, f32 r and s rows of the architecture's sizes."""
    from llamir.context.memory_recurrent import RecurrentMemory

    return RecurrentMemory(arch.recurrent_layout(hp, max(1, cp.n_seq_max)), cp.n_seq_max)


def _hybrid(hp, cp, common, arch) -> Memory:
    """llama_memory_hybrid: a KV cache of the attention layers, a recurrent memory of the others."""
    from llamir.context.kv_cache import KVCache
    from llamir.context.memory_hybrid import HybridMemory
    from llamir.context.memory_recurrent import RecurrentMemory

    layout = arch.recurrent_layout(hp, max(1, cp.n_seq_max))
    attn_layers = tuple(il for il in range(hp.n_layer) if il not in layout.layers)
    return HybridMemory(KVCache(hp, cp.n_ctx_seq, layers=attn_layers, **common),
                        RecurrentMemory(layout, cp.n_seq_max))


# The kinds Architecture.create_memory may name; "none": an encoder keeps nothing between batches.
MEMORY_KINDS: dict[str, Callable[..., Memory] | None] = {"kv": _kv, "kv_iswa": _kv_iswa, "recurrent": _recurrent,
                                                         "hybrid": _hybrid, "none": None}


def create_memory(kind: str, hp, cparams, arch=None) -> Memory | None:
    """The memory of `kind` for a context's parameters (llama_model::create_memory); `arch` (the
    model's Architecture) gives a recurrent memory its state sizes."""
    if kind not in MEMORY_KINDS:
        raise ValueError(f"the architecture asks for memory of kind {kind!r}; the context makes "
                         f"{', '.join(sorted(MEMORY_KINDS))}")
    make = MEMORY_KINDS[kind]
    if make is None:
        return None
    common = dict(n_seq_max=cparams.n_seq_max, unified=cparams.kv_unified, type_k=cparams.type_k,
                  type_v=cparams.type_v, v_trans=not cparams.flash_attn, attn_rot=cparams.attn_rot)
    return make(hp, cparams, common, arch)


__all__ = ["MEMORY_KINDS", "Memory", "create_memory", "host_array", "place_tensors", "put_back", "zero_tensors"]
