"""Applying pending memory updates (llama_kv_cache::update): stream copies queued by seq_cp
across streams, then the K-shift that re-ropes cached keys after seq_add / seq_div."""

from __future__ import annotations

import logging

import numpy as np

from llamir.context.kv_cache import KVCache, SeqOpError
from llamir.frontend.arch.base import ROPE_NONE
from llamir.frontend.graph_kv import build_shift_graph

log = logging.getLogger("llamir")


class MemoryUpdater:
    """Owns the compiled K-shift graphs (one per cache) and runs updates on a backend."""

    def __init__(self, model, backend, rope_params):
        self.model, self.backend, self.rope = model, backend, rope_params
        self._shift: dict[int, tuple] = {}

    def caches(self, memory) -> tuple[KVCache, ...]:
        return memory.caches

    def update(self, memory) -> bool:
        """Apply every pending update; True when something changed."""
        changed = False
        for cache in self.caches(memory):
            if cache.pending_copies:
                self._copy_streams(cache)
                changed = True
            if any(cells.has_shift for cells in cache.v_cells):
                if not cache.get_can_shift():   # each cache's own, as llama_kv_cache::update (not the iSWA's)
                    raise SeqOpError("seq_add/seq_div: the current KV cache / model configuration does not "
                                     "support K-shift")
                self._k_shift(cache)
                changed = True
        return changed

    @staticmethod
    def _copy_streams(cache: KVCache) -> None:
        for src, dst in cache.pending_copies:
            for name in cache.buffers:
                array = cache.host(name)
                array[dst] = array[src]
                cache.put_back(name, array)
        cache.pending_copies.clear()

    def _k_shift(self, cache: KVCache) -> None:
        if self.model.arch.rope_type == ROPE_NONE:   # llama.cpp builds no shift graph: no key to re-rope
            for cells in cache.v_cells:
                cells.reset_shift()
            return
        hp = self.model.hparams
        key = id(cache)
        if key not in self._shift:
            graph = build_shift_graph(hp, cache.layout, self.model.arch.rope_type, self.rope,
                                      lambda il: self.model.arch.rope_freq_base(hp, self.rope, il))
            self._shift[key] = (graph, self.backend.compile(graph))
        graph, run = self._shift[key]
        shifts = np.concatenate([np.where(c.pos >= 0, c.shift, 0) for c in cache.v_cells]).astype(np.int32)
        values = {"k_shift": shifts, "k_shift_rows": np.arange(len(shifts), dtype=np.int64)}
        names = [leaf.name for leaf in graph.leafs_of_kind("state")]
        values.update({name: cache.host(name) for name in names})   # a device's tensors: copies
        run(values, {})
        for name in names:
            cache.put_back(name, values[name])
        for cells in cache.v_cells:
            cells.reset_shift()
        log.info("K-shift applied to %d cells", int(np.count_nonzero(shifts)))
