"""The unified KV cache (llama_kv_cache): buffers, cells per stream, slots, masks, sequence ops.

The graph side (leaves, stores, views) is llamir.frontend.graph_kv; this module owns the
memory and fills the graph inputs from a ubatch: attn_inp_k_idxs, attn_inp_v_idxs and
attn_inp_kq_mask.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from llamir.backends.base import TensorData
from llamir.context.batch import I32_MAX, I32_MIN, LLAMA_MAX_SEQ, POS_LIMIT, BatchAllocator, UBatch, is_integer
from llamir.context.kv_cells import CellsSnapshot, KVCells
from llamir.context.memory import Memory, host_array, place_tensors, put_back, zero_tensors
from llamir.frontend.graph_kv import KVLayout, cache_k_name, cache_v_name
from llamir.frontend.hparams import HParams
from llamir.ir import F16, DType
from llamir.ir.interp import storage_dtype, storage_shape
from llamir.sched.plan import TensorBuffer

log = logging.getLogger("llamir")
POS_MAX = np.iinfo(np.int32).max


class SeqOpError(ValueError):
    """A memory sequence operation with an argument llama.cpp would assert (abort) on; nothing
    was changed."""


def seq_int32(op: str, name: str, value) -> int:
    """A sequence operation's integer argument, checked (SeqOpError: what llama.cpp would take as
    something else, or truncate)."""
    if not is_integer(value):
        raise SeqOpError(f"{op}: {name} = {value!r} is not an integer")
    if not I32_MIN <= value <= I32_MAX:
        raise SeqOpError(f"{op}: {name} = {int(value)} is out of the int32 range")
    return int(value)


def seq_positions(op: str, p0, p1) -> tuple[int, int]:
    """[p0, p1) with llama.cpp's conventions: p0 < 0 is 0, p1 < 0 is +inf."""
    p0, p1 = seq_int32(op, "p0", p0), seq_int32(op, "p1", p1)
    return (max(p0, 0), POS_MAX if p1 < 0 else p1)


class MemoryStatus(IntEnum):
    SUCCESS = 0
    NO_UPDATE = 1
    FAILED_PREPARE = 2
    FAILED_COMPUTE = 3


def is_masked_swa(n_swa: int, swa_type: str, p0, p1):
    """llama_hparams::is_masked_swa (p0 the cell's position, p1 the token's); works on arrays."""
    if swa_type == "standard":
        return p1 - p0 >= n_swa
    if swa_type == "chunked":
        return p0 < (p1 // n_swa) * n_swa
    if swa_type == "symmetric":
        return np.abs(p1 - p0) > n_swa // 2
    return np.zeros(np.broadcast(p0, p1).shape, dtype=bool) if np.ndim(p0) or np.ndim(p1) else False


@dataclass
class UpdateContext:
    """init_update's result: NO_UPDATE when nothing is pending; apply() runs the K-shift and the
    queued stream copies through the context's backend (llama_kv_cache::update)."""

    memory: object
    ctx: object
    status: MemoryStatus

    def apply(self) -> bool:
        return self.ctx._updater.update(self.memory) if self.status == MemoryStatus.SUCCESS else False


def padded_n_kv(size: int, used_max_p1: int) -> int:
    """The cells a stream attends: its used prefix padded to 256 (keeps graphs stable), at most its size."""
    return min(size, max(256, -(-used_max_p1 // 256) * 256))


@dataclass
class SlotInfo:
    """Where a ubatch goes: per used stream, the cell indices of its tokens."""

    strm: list[int]
    idxs: list[np.ndarray]

    @property
    def s0(self) -> int:
        return min(self.strm)

    @property
    def s1(self) -> int:
        return max(self.strm)

    @property
    def n_stream(self) -> int:
        return len(self.strm)


@dataclass
class StreamUndo:
    """One stream's cells as they were before a ubatch was applied: the slot's cells, or the
    whole stream plus the K/V rows of the slot's cells when occupied (SWA) cells are reused."""

    stream: int
    idxs: np.ndarray
    pos: np.ndarray
    seq: np.ndarray
    shift: np.ndarray
    has_shift: bool
    whole: CellsSnapshot | None = None
    rows: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class CellsUndo:
    """What apply_ubatch changed, to put back when the batch fails (KVCache.undo)."""

    heads: list[int]
    streams: list[StreamUndo]


def attn_rot_sizes(hp: HParams, layers: tuple[int, ...], type_k: DType, type_v: DType,
                   allowed: bool = True) -> tuple[int, int]:
    """llama_kv_cache's attn_rot_k / attn_rot_v and the Hadamard sizes of build_input_k_rot /
    build_input_v_rot: a quantized K (V) of a head size that is a multiple of 64 is rotated, K by
    the largest power of two from 64 up that divides the head size, V always by 64 (0: no rotation).
    `allowed` is False under LLAMA_ATTN_ROT_DISABLE."""
    if not allowed or not layers:  # n_embd_head_k_all == 0: a cache without layers
        return 0, 0
    rot_k = rot_v = 0
    if type_k.is_quantized and hp.n_embd_head_k % 64 == 0:
        rot_k = 64
        while hp.n_embd_head_k % (rot_k * 2) == 0:
            rot_k *= 2
    if type_v.is_quantized and hp.n_embd_head_v % 64 == 0:
        rot_v = 64
    return rot_k, rot_v


class KVCache(Memory):
    """K and V tensors for every attention layer, plus the cell metadata of each stream; the
    unified KV cache is a memory of one cache (itself)."""

    def __init__(self, hp: HParams, kv_size: int, n_seq_max: int, unified: bool = True,
                 type_k: DType = F16, type_v: DType = F16, v_trans: bool = True,
                 n_swa: int = 0, swa_type: str = "none", layers: tuple[int, ...] | None = None,
                 suffix: str = "", attn_rot: bool = True):
        """`attn_rot`: whether a quantized cache may be Hadamard-rotated (CParams.attn_rot)."""
        self.hp = hp
        self.kv_size = kv_size
        self.n_seq_max = n_seq_max
        self.unified = unified
        self.n_stream = 1 if unified else n_seq_max
        self.n_swa, self.swa_type = n_swa, swa_type
        layers = tuple(range(hp.n_layer)) if layers is None else tuple(layers)
        rot_k, rot_v = attn_rot_sizes(hp, layers, type_k, type_v, attn_rot)
        log.info("attn_rot_k = %d, attn_rot_v = %d (%s cache)", rot_k, rot_v, suffix or "main")
        self.layout = KVLayout(kv_size=kv_size, type_k=type_k, type_v=type_v, v_trans=v_trans,
                               n_stream=self.n_stream, layers=layers, suffix=suffix, rot_k=rot_k, rot_v=rot_v)
        n_seq_cols = LLAMA_MAX_SEQ if unified else n_seq_max
        self.v_cells = [KVCells(kv_size, n_seq_cols) for _ in range(self.n_stream)]
        self.v_heads = [0] * self.n_stream
        self.seq_to_stream = [0] * LLAMA_MAX_SEQ if unified else list(range(n_seq_max))
        self.tensors: dict[str, np.ndarray | TensorData] = {}  # host arrays, or tensors on a device
        for il in self.layout.layers:
            for name, shape, dtype in ((cache_k_name(il), self.layout.k_shape(hp, il), type_k),
                                       (cache_v_name(il), self.layout.v_shape(hp, il), type_v)):
                self.tensors[name] = np.zeros(storage_shape(shape, dtype), dtype=storage_dtype(dtype))
        self._v_names = {cache_v_name(il) for il in self.layout.layers}
        self.pending_copies: list[tuple[int, int]] = []
        self._v_rows: dict[int, np.ndarray] = {}

    # -- where the tensors live ---------------------------------------------------------------------
    def place(self, buffers: Mapping[str, TensorBuffer]) -> None:
        """Move tensors placed in a device's memory there (llama_kv_cache allocates each layer's
        K and V from its device's buffer type); their contents come along. They stay there: a
        decode reads and writes them on the device, and only state save/load, undo and K-shift
        copy them through the host."""
        place_tensors(self.tensors, buffers, "KV cache")

    @property
    def caches(self) -> tuple[KVCache]:
        return (self,)

    def host(self, name: str) -> np.ndarray:
        """A tensor as a host array: in place for host memory, else a copy (write it back with
        put_back)."""
        return host_array(self.tensors[name])

    def put_back(self, name: str, array: np.ndarray) -> None:
        """After changing host(name)'s array: a device tensor gets the new contents."""
        put_back(self.tensors[name], array)

    # -- sizes ------------------------------------------------------------------------------------
    def get_size(self) -> int:
        return self.kv_size

    def total_bytes(self) -> int:
        return sum(a.nbytes for a in self.tensors.values())

    def get_n_kv(self, sinfo: SlotInfo) -> int:
        """Cells attended: the largest of the slot's streams' (padded_n_kv)."""
        return max(padded_n_kv(self.v_cells[s].size, self.v_cells[s].used_max_p1()) for s in sinfo.strm)

    def stream_of(self, seq_id: int) -> KVCells:
        return self.v_cells[self.seq_to_stream[seq_id]]

    # -- slots ------------------------------------------------------------------------------------
    def find_slot(self, ubatch: UBatch, cont: bool = False) -> SlotInfo | None:
        n_tokens, n_seqs = ubatch.n_tokens, 1
        if self.n_stream > 1:
            n_seqs = ubatch.n_seqs_unq
            n_tokens //= n_seqs
        strm, idxs = [], []
        for s in range(n_seqs):
            seq_id = ubatch.seq_id_unq[s]
            stream = self.seq_to_stream[seq_id]
            cells = self.v_cells[stream]
            if n_tokens > cells.size:
                log.error("find_slot: n_tokens = %d > size = %d", n_tokens, cells.size)
                return None
            if cont or self.n_swa:
                found = self._scan(cells, self._scan_start(stream, n_tokens), n_tokens, cont)
            else:
                found = self.free_cells(stream, n_tokens)
            if found is None:
                return None
            strm.append(stream)
            idxs.append(np.asarray(found, dtype=np.int64))
        return SlotInfo(strm, idxs)

    def free_cells(self, stream: int, n_tokens: int) -> np.ndarray | None:
        """find_slot's cells for n_tokens that need not be contiguous, without SWA (every usable
        cell is an empty one): the first n_tokens empty cells from the stream's head on, wrapping
        round; None when there are fewer."""
        cells = self.v_cells[stream]
        head = self._scan_start(stream, n_tokens)
        if head >= cells.size:                        # where _scan wraps round
            head = 0
        if n_tokens == 1 and cells.pos[head] == -1:   # a generated token, usually
            return np.array([head], dtype=np.int64)
        empty = cells.pos == -1
        found = np.flatnonzero(empty[head:]) + head
        if len(found) < n_tokens:
            found = np.concatenate([found, np.flatnonzero(empty[:head])])
        return found[:n_tokens] if len(found) >= n_tokens else None

    def _scan_start(self, stream: int, n_tokens: int) -> int:
        """Where find_slot's scan starts: the stream's head, or 0 when the head is far past the
        used cells."""
        head = self.v_heads[stream]
        return 0 if head > self.v_cells[stream].get_used() + 2 * n_tokens else head

    def _scan(self, cells: KVCells, head: int, n_tokens: int, cont: bool) -> list[int] | None:
        found: list[int] = []
        n_tested = 0
        n_test = n_tokens if cont else 1
        while True:
            if head + n_test > cells.size:
                n_tested += cells.size - head
                head = 0
                continue
            for _ in range(n_test):
                idx = head
                head += 1
                n_tested += 1
                if self._can_use(cells, idx):
                    found.append(idx)
                elif cont:
                    break
            if len(found) == n_tokens:
                return found
            if cont:
                found.clear()
            if n_tested >= cells.size:
                return None

    def _can_use(self, cells: KVCells, idx: int) -> bool:
        if cells.is_empty(idx):
            return True
        if self.n_swa and cells.seq_count(idx) == 1:
            owner = cells.seq_get(idx)
            return bool(is_masked_swa(self.n_swa, self.swa_type, int(cells.pos[idx]), cells.seq_pos_max(owner) + 1))
        return False

    def apply_ubatch(self, sinfo: SlotInfo, ubatch: UBatch) -> None:
        """Occupy the slot's cells with the ubatch's positions and sequences."""
        overwritten: dict[int, int] = {}
        per = ubatch.n_tokens // sinfo.n_stream
        for s, stream in enumerate(sinfo.strm):
            cells = self.v_cells[stream]
            idxs = sinfo.idxs[s]
            # free cells (the usual case) all at once; a few (a generated token) cell by cell is faster
            if len(idxs) > 8 and cells.pos[idxs].max() < 0:
                cells.occupy(idxs, ubatch.pos[s * per:(s + 1) * per], ubatch.seq_ids[s * per:(s + 1) * per])
                continue
            for ii, idx in enumerate(sinfo.idxs[s]):
                i = s * per + ii
                if not cells.is_empty(idx):
                    owner = cells.seq_get(idx)
                    overwritten[owner] = max(overwritten.get(owner, -1), int(cells.pos[idx]))
                    cells.rm(idx)
                cells.pos_set(idx, int(ubatch.pos[i]))
                for sid in ubatch.seq_ids[i]:
                    cells.seq_add(idx, sid)
        for sid, p_max in sorted(overwritten.items()):
            cells = self.stream_of(sid)
            if cells.seq_pos_min(sid) <= p_max:
                self.seq_rm(sid, cells.seq_pos_min(sid), p_max + 1)
        for s, stream in enumerate(sinfo.strm):
            self.v_heads[stream] = int(sinfo.idxs[s][-1]) + 1

    def save_cells(self, sinfo: SlotInfo) -> CellsUndo:
        """What apply_ubatch(sinfo, ...) is about to change. Free cells only need their metadata
        back (what a failed compute wrote into them is never read: masked, and not in a state);
        reused cells (a sliding window's) also need their K/V rows."""
        streams = []
        for s, stream in enumerate(sinfo.strm):
            cells, idxs = self.v_cells[stream], sinfo.idxs[s]
            # fancy indexing copies already
            undo = StreamUndo(stream, idxs, cells.pos[idxs], cells.seq[idxs], cells.shift[idxs], cells.has_shift)
            if undo.pos.max(initial=-1) >= 0:
                undo.whole = cells.snapshot()
                undo.rows = {name: np.take(self.host(name)[stream], idxs, axis=self._cell_axis(name)).copy()
                             for name in self.tensors}
            streams.append(undo)
        return CellsUndo(list(self.v_heads), streams)

    def _cell_axis(self, name: str) -> int:
        """The axis of a stream's K or V buffer that runs over cells (V is [d, cell] transposed)."""
        return 1 if self.layout.v_trans and name in self._v_names else 0

    def undo(self, record: CellsUndo) -> None:
        """Put back what one apply_ubatch changed (records are undone newest first)."""
        for undo in reversed(record.streams):
            cells = self.v_cells[undo.stream]
            if undo.whole is not None:
                cells.restore(undo.whole)
                for name, rows in undo.rows.items():
                    index = [slice(None)] * rows.ndim
                    index[self._cell_axis(name)] = undo.idxs
                    array = self.host(name)
                    array[undo.stream][tuple(index)] = rows
                    self.put_back(name, array)
                continue
            cells.pos[undo.idxs] = undo.pos
            cells.seq[undo.idxs] = undo.seq
            cells.shift[undo.idxs] = undo.shift
            cells.has_shift = undo.has_shift
            cells.recount()
        self.v_heads = list(record.heads)

    def prepare(self, ubatches: list[UBatch]) -> list[SlotInfo] | None:
        """Find a slot for every ubatch as if the earlier ones were applied; change nothing."""
        if len(ubatches) == 1:  # nothing after it needs to see it applied
            sinfo = self.find_slot(ubatches[0], cont=False)
            return None if sinfo is None else [sinfo]
        snapshot = ([c.snapshot() for c in self.v_cells], list(self.v_heads))
        slots: list[SlotInfo] = []
        try:
            for ub in ubatches:
                sinfo = self.find_slot(ub, cont=False)
                if sinfo is None:
                    return None
                slots.append(sinfo)
                self.apply_ubatch(sinfo, ub)
            return slots
        finally:
            for cells, snap in zip(self.v_cells, snapshot[0]):
                cells.restore(snap)
            self.v_heads = snapshot[1]

    # -- memory interface -------------------------------------------------------------------------
    def init_batch(self, balloc: BatchAllocator, n_ubatch: int, embd_all: bool) -> KVCacheContext:
        balloc.split_reset()
        ubatches: list[UBatch] = []
        while balloc.n_used < balloc.n_tokens:
            ub = balloc.split_simple(n_ubatch) if self.n_stream == 1 else balloc.split_equal(n_ubatch, True)
            if ub is None:
                break
            ubatches.append(ub)
        if balloc.n_used < balloc.n_tokens:
            return KVCacheContext(self, MemoryStatus.FAILED_PREPARE)
        slots = self.prepare(ubatches)
        if slots is None:
            return KVCacheContext(self, MemoryStatus.FAILED_PREPARE)
        return KVCacheContext(self, MemoryStatus.SUCCESS, ubatches, slots)

    def init_full(self) -> KVCacheContext:
        """A context covering every cell of every stream, for worst-case reservation."""
        slot = SlotInfo(list(range(self.n_stream)), [np.arange(1) for _ in range(self.n_stream)])
        ctx = KVCacheContext(self, MemoryStatus.SUCCESS, [], [slot])
        ctx.n_kv = self.kv_size
        return ctx

    def get_can_shift(self) -> bool:
        return True

    def has_pending_update(self) -> bool:
        return bool(self.pending_copies) or any(c.has_shift for c in self.v_cells)

    def clear(self, data: bool = True) -> None:
        for cells in self.v_cells:
            cells.reset()
        self.v_heads = [0] * self.n_stream
        if data:
            zero_tensors(self.tensors)

    # -- sequence operations ---------------------------------------------------------------------
    # llama.cpp GGML_ASSERTs (aborts the process) on a sequence id outside [0, seq_to_stream.size())
    # (-1 allowed by seq_rm), a partial copy across streams, and crashes on seq_div by 0; here
    # each raises SeqOpError before anything changes.

    def _seq(self, op: str, seq_id, allow_all: bool = False) -> int:
        """seq_id checked: an integer in [0, 256) (unified) or [0, n_seq_max); -1 if allow_all."""
        if not is_integer(seq_id):
            raise SeqOpError(f"{op}: seq_id = {seq_id!r} is not an integer")
        n = len(self.seq_to_stream)
        if not (0 <= seq_id < n or (allow_all and seq_id == -1)):
            every = " or -1 (every sequence)" if allow_all else ""
            raise SeqOpError(f"{op}: seq_id = {int(seq_id)} is out of range [0, {n}){every}")
        return int(seq_id)


    def _stream_ids(self, seq_id: int) -> list[int]:
        return [self.seq_to_stream[seq_id]] if seq_id >= 0 else list(range(self.n_stream))

    @staticmethod
    def _range(p0: int, p1: int) -> tuple[int, int]:
        return (max(p0, 0), POS_MAX if p1 < 0 else p1)

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove [p0, p1) of seq_id (every sequence when seq_id is -1). Always True for this cache."""
        seq_id = self._seq("seq_rm", seq_id, allow_all=True)
        p0, p1 = seq_positions("seq_rm", p0, p1)
        for stream in self._stream_ids(seq_id):
            cells = self.v_cells[stream]
            in_range = (cells.pos >= p0) & (cells.pos < p1)
            new_head = cells.size
            for i in np.nonzero(in_range)[0]:
                if seq_id >= 0:
                    freed = cells.seq_has(i, seq_id) and cells.seq_rm(i, seq_id)
                else:
                    cells.rm(i)
                    freed = True
                if freed and new_head == cells.size:
                    new_head = int(i)
            if new_head != cells.size and new_head < self.v_heads[stream]:
                self.v_heads[stream] = new_head
        return True

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        src, dst = self._seq("seq_cp", src), self._seq("seq_cp", dst)
        raw0, raw1 = seq_int32("seq_cp", "p0", p0), seq_int32("seq_cp", "p1", p1)
        s0, s1 = self.seq_to_stream[src], self.seq_to_stream[dst]
        if s0 == s1:
            if src == dst:
                return
            p0, p1 = self._range(raw0, raw1)
            cells = self.v_cells[s0]
            sel = (cells.pos >= p0) & (cells.pos < p1) & cells.seq[:, src]
            cells.seq[sel, dst] = True
            cells.recount()
            return
        full = not ((0 < raw0 < self.kv_size - 1) or (0 < raw1 < self.kv_size - 1))
        if not full:
            raise SeqOpError(f"seq_cp: across streams only whole sequences are copied (p0 = p1 = -1), got "
                             f"p0 = {raw0}, p1 = {raw1}")
        self.pending_copies.append((s0, s1))
        a, b = self.v_cells[s0], self.v_cells[s1]
        b.reset()
        for i in a.cells_of(src):
            b.pos_set(i, int(a.pos[i] - a.shift[i]))
            b.seq_add(i, dst)
            if a.shift[i]:
                b.pos_add(i, int(a.shift[i]))
        self.v_heads[s1] = self.v_heads[s0]

    def seq_keep(self, seq_id: int) -> None:
        seq_id = self._seq("seq_keep", seq_id)
        stream = self.seq_to_stream[seq_id]
        cells = self.v_cells[stream]
        new_head = cells.size
        for i in range(cells.size):
            if cells.seq_keep(i, seq_id) and new_head == cells.size:
                new_head = i
        if new_head != cells.size and new_head < self.v_heads[stream]:
            self.v_heads[stream] = new_head

    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        """Move [p0, p1) of seq_id by `shift`; cells moved below 0 are freed. A shift that would
        take a position past the int32 range is refused (in llama.cpp it overflows)."""
        seq_id = self._seq("seq_add", seq_id)
        p0, p1 = seq_positions("seq_add", p0, p1)
        shift = seq_int32("seq_add", "shift", shift)
        stream = self.seq_to_stream[seq_id]
        cells = self.v_cells[stream]
        if shift == 0 or p0 == p1:
            return
        moved = np.nonzero((cells.pos >= p0) & (cells.pos < p1) & cells.seq[:, seq_id])[0]
        if len(moved) and int(cells.pos[moved].max()) + shift > POS_LIMIT:
            raise SeqOpError(f"seq_add: shift = {shift} moves position {int(cells.pos[moved].max())} of sequence "
                             f"{seq_id} past {POS_LIMIT}")
        pending = cells.shift[moved].astype(np.int64) + shift
        if len(moved) and not I32_MIN <= int(pending.min()) <= int(pending.max()) <= I32_MAX:
            raise SeqOpError(f"seq_add: shift = {shift} overflows the pending K-shift of sequence {seq_id}")
        new_head = cells.size
        for i in moved:
            if cells.pos_add(i, shift) and new_head == cells.size:
                new_head = int(i)
        self.v_heads[stream] = new_head if new_head != cells.size else 0

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """Divide the positions in [p0, p1) of seq_id by d >= 1 (llama.cpp divides by 0 and crashes,
        and a negative d makes negative positions: both are refused)."""
        seq_id = self._seq("seq_div", seq_id)
        p0, p1 = seq_positions("seq_div", p0, p1)
        d = seq_int32("seq_div", "d", d)
        if d <= 0:
            raise SeqOpError(f"seq_div: d = {d}; positions can only be divided by d >= 1")
        cells = self.v_cells[self.seq_to_stream[seq_id]]
        if d == 1 or p0 == p1:
            return
        for i in np.nonzero((cells.pos >= p0) & (cells.pos < p1) & cells.seq[:, seq_id])[0]:
            cells.pos_div(i, d)

    def seq_pos_min(self, seq_id: int) -> int:
        """The smallest position of seq_id in the cache, -1 if it holds none."""
        return self.v_cells[self.seq_to_stream[self._seq("seq_pos_min", seq_id)]].seq_pos_min(int(seq_id))

    def seq_pos_max(self, seq_id: int) -> int:
        """The largest position of seq_id in the cache, -1 if it holds none."""
        return self.v_cells[self.seq_to_stream[self._seq("seq_pos_max", seq_id)]].seq_pos_max(int(seq_id))

    # -- graph inputs -----------------------------------------------------------------------------
    def k_idxs(self, ubatch: UBatch, sinfo: SlotInfo) -> np.ndarray:
        if len(sinfo.strm) == 1 and not sinfo.strm[0]:
            return sinfo.idxs[0]
        parts = [strm * self.kv_size + idx if strm else idx for strm, idx in zip(sinfo.strm, sinfo.idxs)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def v_idxs(self, ubatch: UBatch, sinfo: SlotInfo, n_embd_v_gqa: int) -> np.ndarray:
        if not self.layout.v_trans:
            return self.k_idxs(ubatch, sinfo)
        j = self._v_rows.get(n_embd_v_gqa)
        if j is None:   # the same every call: kept
            j = self._v_rows[n_embd_v_gqa] = np.arange(n_embd_v_gqa, dtype=np.int64)[None, :] * self.kv_size
        if len(sinfo.strm) == 1 and not sinfo.strm[0]:
            return np.add(j, sinfo.idxs[0][:, None]).reshape(-1)
        parts = [(strm * self.kv_size * n_embd_v_gqa + j + idx[:, None]).reshape(-1)
                 for strm, idx in zip(sinfo.strm, sinfo.idxs)]
        return np.concatenate(parts)

    def kq_mask(self, ubatch: UBatch, sinfo: SlotInfo, n_kv: int, causal: bool, alibi: bool = False,
                dtype=np.float32, out: np.ndarray | None = None) -> np.ndarray:
        """[n_stream, 1, T/n_stream, n_kv]: 0 (or -|p0-p1| with ALiBi) where attention is allowed;
        written into `out` when it has that shape and dtype."""
        n_streams = sinfo.n_stream
        per = ubatch.n_tokens // n_streams
        shape = (n_streams, 1, per, n_kv)
        mask = out if out is not None and out.shape == shape and out.dtype == dtype else np.empty(shape, dtype)
        for s, stream in enumerate(sinfo.strm):
            cells = self.v_cells[stream]
            rows = slice(s * per, (s + 1) * per)
            p0 = cells.pos[None, :n_kv]                                               # [1, n_kv]
            p1 = ubatch.pos[rows, None]                                              # [per, 1]
            # a token sees the cells of its first sequence (empty cells belong to none)
            first = [ids[0] for ids in ubatch.seq_ids[rows]]
            if per == 1 and causal and not alibi and self.swa_type == "none":   # one generated token
                out = mask[s, 0, 0]
                allowed = cells.seq[:n_kv, first[0]] & (cells.pos[:n_kv] <= ubatch.pos[s])
                out.fill(-np.inf)
                np.copyto(out, 0, where=allowed)
                continue
            if len(set(first)) == 1:
                allowed = cells.seq[None, :n_kv, first[0]]                          # [1, n_kv]
            else:
                allowed = cells.seq[:n_kv, first].T                                  # [per, n_kv]
            if causal:
                allowed = allowed & (p0 <= p1)
            if self.swa_type != "none":
                allowed = allowed & ~is_masked_swa(self.n_swa, self.swa_type, p0.astype(np.int64),
                                                   p1.astype(np.int64))
            out = mask[s, 0]
            out.fill(-np.inf)
            if alibi:
                np.copyto(out, -np.abs(p0.astype(np.int64) - p1), where=allowed, casting="unsafe")
            else:
                np.copyto(out, 0, where=allowed)
        return mask


@dataclass
class KVCacheContext:
    """llama_kv_cache_context: the ubatches of one batch and their slots, applied one by one."""

    cache: KVCache
    status: MemoryStatus
    ubatches: list[UBatch] = field(default_factory=list)
    slots: list[SlotInfo] = field(default_factory=list)
    i_cur: int = 0
    n_kv: int = 0
    applied: list[CellsUndo] = field(default_factory=list)

    def next(self) -> bool:
        self.i_cur += 1
        return self.i_cur < len(self.ubatches)

    def apply(self) -> bool:
        """The only call that changes the memory: occupy the current ubatch's cells (what it
        changes is recorded, for rollback)."""
        sinfo = self.slots[self.i_cur]
        self.applied.append(self.cache.save_cells(sinfo))
        self.cache.apply_ubatch(sinfo, self.ubatches[self.i_cur])
        self.n_kv = self.cache.get_n_kv(sinfo)
        return True

    def rollback(self, keep: int = 0) -> None:
        """Undo every applied ubatch after the first `keep`, newest first: the cells, the heads
        and the K/V rows of reused cells are as they were before."""
        while len(self.applied) > keep:
            self.cache.undo(self.applied.pop())

    def get_ubatch(self) -> UBatch:
        return self.ubatches[self.i_cur]

    def slot(self) -> SlotInfo:
        return self.slots[self.i_cur]

    def contexts(self) -> list[KVCacheContext]:
        """The per-cache contexts (one here; two for an iSWA memory)."""
        return [self]

    def bindings(self, n_tokens: int) -> dict[str, int]:
        """The graph dims this cache decides: n_kv, and for several streams T_s, ns and s0."""
        out = {self.cache.layout.n_kv_dim: self.n_kv}
        if self.cache.n_stream > 1:
            sinfo = self.slot()
            if sinfo.strm != list(range(sinfo.s0, sinfo.s1 + 1)):
                raise ValueError(f"ubatch streams {sinfo.strm} are not consecutive")
            out.update(T_s=n_tokens // sinfo.n_stream, ns=sinfo.n_stream, s0=sinfo.s0)
        return out
