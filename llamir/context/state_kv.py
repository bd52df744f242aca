"""The KV cache's part of a state (llama_kv_cache::state_write / state_read), in llama.cpp's layout.

Per cache: n_stream, and per stream the cell count, each cell's position and sequence ids, then
per layer the K rows and the V rows (or, for a transposed V, each embedding row's elements per
cell range).

Reading is two steps. `read_memory` parses and checks a whole memory's part (every cache) and
changes nothing; `apply_memory` then commits it. What is checked, beyond llama.cpp's own checks
(stream and layer counts, cell counts, seq ids of a whole state, types and row sizes):
- positions lie in [0, 2**31 - 1): llama.cpp takes any int32, and a negative one corrupts its
  cells; 2**31 - 1 is the "to the end" bound of seq_rm/seq_add ranges, which never reach it;
- a cell lists no sequence twice, and in a non-unified cache stream s holds only sequence s
  (llama.cpp accepts both and then keeps cells no sequence operation finds);
- a sequence state's cells lie in one stream and all carry the source's id, in [0, 256)
  (llama.cpp ignores the ids; cells in several streams would each replace the last);
- a sequence state must find room (as find_slot finds it) in every cache, or nothing changes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

from llamir.context.batch import LLAMA_MAX_SEQ, ubatch_reserve
from llamir.context.kv_cache import KVCache, is_masked_swa
from llamir.context.kv_cells import CellsSnapshot, KVCells
from llamir.context.state_io import Reader, StateError, Writer
from llamir.frontend.graph_kv import cache_k_name, cache_v_name

POS_END = int(np.iinfo(np.int32).max)   # positions are below it
STATE_SEQ_FLAGS_PARTIAL_ONLY = 1


def caches_of(memory, flags: int = 0) -> tuple[KVCache, ...]:
    """The caches a state holds, in order: base then SWA (only the SWA one with PARTIAL_ONLY)."""
    caches = memory.caches
    if flags & STATE_SEQ_FLAGS_PARTIAL_ONLY and len(caches) > 1:
        return caches[1:]
    return caches


# -- writing ---------------------------------------------------------------------------------------
def _ranges(mask: np.ndarray) -> list[tuple[int, int]]:
    """[begin, end) runs of True cells."""
    idx = np.nonzero(mask)[0]
    if not len(idx):
        return []
    breaks = np.nonzero(np.diff(idx) != 1)[0]
    starts = np.concatenate([[idx[0]], idx[breaks + 1]])
    ends = np.concatenate([idx[breaks] + 1, [idx[-1] + 1]])
    return list(zip(starts.tolist(), ends.tolist()))


def write_memory(w: Writer, memory, seq_id: int = -1, flags: int = 0) -> None:
    for cache in caches_of(memory, flags):
        write_cache(w, cache, seq_id)


def write_cache(w: Writer, cache: KVCache, seq_id: int = -1) -> None:
    """llama_kv_cache::state_write: every used cell (seq_id -1), or the cells of seq_id that its
    sliding window still sees."""
    hp, lay = cache.hp, cache.layout
    w.pack("I", cache.n_stream)
    for s, cells in enumerate(cache.v_cells):
        mask = cells.pos >= 0
        if seq_id != -1:
            mask &= cells.seq[:, seq_id]
            if cache.n_swa:
                mask &= ~is_masked_swa(cache.n_swa, cache.swa_type, cells.pos, cells.seq_pos_max(seq_id))
        ranges = _ranges(mask)
        count = sum(e - b for b, e in ranges)
        w.pack("I", count)
        if not count:
            continue
        for b, e in ranges:
            for i in range(b, e):
                ids = [seq_id] if seq_id != -1 else np.nonzero(cells.seq[i, :cache.n_seq_max])[0].tolist()
                w.pack("iI", int(cells.pos[i]), len(ids))
                for sid in ids:
                    w.pack("i", sid)
        w.pack("II", int(lay.v_trans), len(lay.layers))
        for il in lay.layers:
            k = cache.host(cache_k_name(il))[s]
            w.pack("iQ", int(lay.type_k.ggml_type), lay.type_k.row_bytes(hp.n_embd_k_gqa(il)))
            for b, e in ranges:
                w.raw(k[b:e])
        for il in lay.layers:
            v = cache.host(cache_v_name(il))[s]
            if not lay.v_trans:
                w.pack("iQ", int(lay.type_v.ggml_type), lay.type_v.row_bytes(hp.n_embd_v_gqa(il)))
                for b, e in ranges:
                    w.raw(v[b:e])
            else:
                w.pack("iII", int(lay.type_v.ggml_type), lay.type_v.type_size, hp.n_embd_v_gqa(il))
                for j in range(hp.n_embd_v_gqa(il)):
                    for b, e in ranges:
                        w.raw(v[j, b:e])


# -- parsing and checking --------------------------------------------------------------------------
@dataclass
class SeqSource:
    """A sequence restore: the id every cell must carry (the blob prefix's, else the first cell's)."""

    seq_id: int | None = None


@dataclass
class StreamState:
    """One stream's parsed cells and rows, shaped as the cache's rows."""

    stream: int
    pos: np.ndarray                                          # [count] int32
    seqs: list[tuple[int, ...]]                              # each cell's sequences (a whole restore)
    k: dict[int, np.ndarray] = field(default_factory=dict)   # layer -> [count, row]
    v: dict[int, np.ndarray] = field(default_factory=dict)   # layer -> [count, row], or [gqa, count]


@dataclass
class CacheState:
    cache: KVCache
    streams: list[StreamState]                               # the streams with cells


def read_memory(r: Reader, memory, source: SeqSource | None, flags: int = 0) -> list[CacheState]:
    """Parse and check a memory's part of a state: a whole one (source None) or one sequence's.
    Nothing is changed."""
    return [read_cache(r, cache, source) for cache in caches_of(memory, flags)]


def read_cache(r: Reader, cache: KVCache, source: SeqSource | None) -> CacheState:
    at = r.offset
    n_stream = r.unpack("I", "n_stream")
    if n_stream != cache.n_stream:
        raise StateError(f"n_stream mismatch: the state has {n_stream}, this context {cache.n_stream} (byte {at})")
    streams = []
    for s in range(n_stream):
        at = r.offset
        count = r.unpack("I", f"stream {s} cell_count")
        if not count:
            continue
        if count > cache.kv_size:
            raise StateError(f"not enough cells in kv cache: stream {s} of the state has {count} cells "
                             f"(byte {at}), the cache {cache.kv_size}")
        pos, seqs = _read_cells(r, cache, s, count, source)
        st = StreamState(s, pos, seqs)
        _read_rows(r, cache, st)
        streams.append(st)
    if source is not None and len(streams) > 1:
        raise StateError(f"a sequence state has cells in streams {[st.stream for st in streams]}; "
                         f"a sequence lives in one stream")
    return CacheState(cache, streams)


def _read_cells(r: Reader, cache: KVCache, s: int, count: int,
                source: SeqSource | None) -> tuple[np.ndarray, list[tuple[int, ...]]]:
    pos = np.empty(count, dtype=np.int32)
    seqs: list[tuple[int, ...]] = []
    for i in range(count):
        where = f"stream {s} cell {i} (byte {r.offset})"
        p, n_ids = r.unpack("iI", f"stream {s} cell {i}")
        if not 0 <= p < POS_END:
            raise StateError(f"{where}: position {p} is out of range [0, {POS_END})")
        pos[i] = p
        if source is not None:
            seqs.append(_read_source_id(r, where, n_ids, source))
            continue
        if n_ids > cache.n_seq_max:
            raise StateError(f"{where} lists {n_ids} sequences (n_seq_max {cache.n_seq_max})")
        ids = r.unpack(f"{n_ids}i", f"{where} seq ids") if n_ids else ()
        ids = (ids,) if n_ids == 1 else tuple(ids)
        for sid in ids:
            if not 0 <= sid < cache.n_seq_max:
                raise StateError(f"invalid seq_id, {sid} is out of range [0, {cache.n_seq_max}): {where}")
            if cache.n_stream > 1 and sid != s:
                raise StateError(f"{where} holds sequence {sid}, but stream {s} of a non-unified cache "
                                 f"holds only sequence {s}")
        if len(set(ids)) != len(ids):
            raise StateError(f"{where} lists a sequence twice: {list(ids)}")
        seqs.append(ids)
    return pos, seqs


def _read_source_id(r: Reader, where: str, n_ids: int, source: SeqSource) -> tuple[int, ...]:
    if n_ids != 1:
        raise StateError(f"invalid seq_id-agnostic kv cell: {where} lists {n_ids} sequences, "
                         f"a sequence state's cells exactly 1")
    sid = r.unpack("i", f"{where} seq id")
    if not 0 <= sid < LLAMA_MAX_SEQ:
        raise StateError(f"invalid seq_id, {sid} is out of range [0, {LLAMA_MAX_SEQ}): {where}")
    if source.seq_id is None:
        source.seq_id = sid
    elif sid != source.seq_id:
        raise StateError(f"{where} holds sequence {sid}, but this is the state of sequence {source.seq_id}")
    return (sid,)


def _read_rows(r: Reader, cache: KVCache, st: StreamState) -> None:
    hp, lay, count = cache.hp, cache.layout, len(st.pos)
    at = r.offset
    v_trans, n_layer = r.unpack("II", f"stream {st.stream} v_trans and n_layer")
    if n_layer != len(lay.layers):
        raise StateError(f"mismatched layer count ({n_layer} instead of {len(lay.layers)}, byte {at + 4})")
    if bool(v_trans) != lay.v_trans:
        raise StateError(f"incompatible V transposition: v_trans {v_trans} (byte {at}), this context's V is "
                         f"{'' if lay.v_trans else 'not '}transposed")
    for il in lay.layers:
        want = (int(lay.type_k.ggml_type), lay.type_k.row_bytes(hp.n_embd_k_gqa(il)))
        _check_header(r, "iQ", il, ("key type", "key row size"), want)
        st.k[il] = _rows(r, count, want[1], cache.buffers[cache_k_name(il)], f"layer {il} keys")
    for il in lay.layers:
        gqa, buf = hp.n_embd_v_gqa(il), cache.buffers[cache_v_name(il)]
        if not lay.v_trans:
            want = (int(lay.type_v.ggml_type), lay.type_v.row_bytes(gqa))
            _check_header(r, "iQ", il, ("value type", "value row size"), want)
            st.v[il] = _rows(r, count, want[1], buf, f"layer {il} values")
        else:
            want = (int(lay.type_v.ggml_type), lay.type_v.type_size, gqa)
            _check_header(r, "iII", il, ("value type", "value element size", "value GQA size"), want)
            st.v[il] = _rows(r, gqa, count * want[1], buf, f"layer {il} values")


def _check_header(r: Reader, fmt: str, il: int, names: tuple[str, ...], want: tuple[int, ...]) -> None:
    """A layer's row header (type, then sizes) must be this cache's."""
    at = r.offset
    got = r.unpack(fmt, f"layer {il} {', '.join(names)}")
    for name, value, expected, size in zip(names, got, want, (struct.calcsize("<" + c) for c in fmt)):
        if value != expected:
            raise StateError(f"mismatched {name} in layer {il}: {value} instead of {expected} (byte {at})")
        at += size


def _rows(r: Reader, n: int, row_bytes: int, buf: np.ndarray, what: str) -> np.ndarray:
    """n rows of row_bytes, in the storage dtype of `buf` (a [n_stream, rows, row] cache buffer)."""
    data = np.frombuffer(bytes(r.bytes(n * row_bytes, what)), dtype=np.uint8).reshape(n, row_bytes)
    return data.view(buf.dtype) if buf.dtype != np.uint8 else data


# -- applying --------------------------------------------------------------------------------------
def apply_memory(states: list[CacheState], dest_seq_id: int) -> None:
    """Commit parsed states: the whole memory (dest_seq_id -1), or one sequence into dest_seq_id
    (each cache's cells of dest_seq_id are replaced). A sequence that finds no room in some cache
    raises StateError with every cache as it was."""
    if dest_seq_id == -1:
        for cs in states:
            _apply_whole(cs)
    else:
        _apply_sequence(states, dest_seq_id)


def _apply_whole(cs: CacheState) -> None:
    cache = cs.cache
    cache.clear(data=True)
    for st in cs.streams:
        cells = cache.v_cells[st.stream]
        cells.restore(_cells_of(cells, st))
        _write_rows(cache, st, st.stream, np.arange(len(st.pos)))


def _cells_of(cells: KVCells, st: StreamState) -> CellsSnapshot:
    """Cells 0..count-1 holding the state's cells, the rest empty (llama.cpp's whole restore)."""
    pos = np.full(cells.size, -1, dtype=np.int32)
    pos[:len(st.pos)] = st.pos
    seq = np.zeros_like(cells.seq)
    for i, ids in enumerate(st.seqs):
        seq[i, list(ids)] = True
    return CellsSnapshot(pos, seq, np.zeros_like(cells.shift), False)


def _apply_sequence(states: list[CacheState], dest: int) -> None:
    saved = [(cs.cache, [c.snapshot() for c in cs.cache.v_cells], list(cs.cache.v_heads)) for cs in states]
    writes = []
    try:
        for cs in states:
            cs.cache.seq_rm(dest, -1, -1)
            for st in cs.streams:
                writes.append((cs.cache, st, *_place(cs.cache, st, dest)))
    except BaseException:
        for cache, snapshots, heads in saved:
            for cells, snap in zip(cache.v_cells, snapshots):
                cells.restore(snap)
            cache.v_heads = heads
        raise
    for cache, st, strm, idxs in writes:
        _write_rows(cache, st, strm, idxs)


def _place(cache: KVCache, st: StreamState, dest: int) -> tuple[int, np.ndarray]:
    """Find a slot for the cells as a ubatch of dest and occupy it (llama.cpp's find_slot and
    apply_ubatch); the stream and the cell indices."""
    n = len(st.pos)
    ub = ubatch_reserve(n, 1)
    ub.pos[:] = st.pos
    ub.seq_ids = [(dest,)] * n
    ub.seq_id_unq = [dest]
    sinfo = cache.find_slot(ub, cont=False)
    if sinfo is None:
        raise StateError(f"failed to find {n} available cells in the kv cache ({cache.kv_size} cells)")
    cache.apply_ubatch(sinfo, ub)
    return sinfo.strm[0], sinfo.idxs[0]


def _write_rows(cache: KVCache, st: StreamState, strm: int, idxs: np.ndarray) -> None:
    for il in cache.layout.layers:
        k_name, v_name = cache_k_name(il), cache_v_name(il)
        k = cache.host(k_name)
        k[strm][idxs] = st.k[il]
        cache.put_back(k_name, k)
        v = cache.host(v_name)
        if cache.layout.v_trans:
            v[strm][:, idxs] = st.v[il]
        else:
            v[strm][idxs] = st.v[il]
        cache.put_back(v_name, v)


def check_memory_seq_id(memory, seq_id) -> None:
    """Memory.state_read/state_write's seq_id (any kind of memory): -1 (every cell) or a sequence
    below n_seq_max."""
    n_seq_max = memory.n_seq_max if hasattr(memory, "n_seq_max") else caches_of(memory)[0].n_seq_max
    if not (isinstance(seq_id, (int, np.integer)) and (seq_id == -1 or 0 <= seq_id < n_seq_max)):
        raise StateError(f"seq_id {seq_id!r} is neither -1 (every sequence) nor in [0, {n_seq_max})")
