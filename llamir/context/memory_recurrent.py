"""Recurrent memory (llama_memory_recurrent): one cell per sequence holding the r (conv) and s
(scan) state of every recurrent layer, for Mamba-like models.

The cells double as per-sequence metadata: cells[seq].tail is the cell holding sequence seq's
state. find_slot gives each ubatch sequence a cell it owns alone, swaps the cells so that the
ubatch's sequences sit at head, head + 1, ..., and records for every cell of the range the row
its state is in (src0) or, for a cell with no state yet, rs_z, a cell no state comes from: the
graph (llamir.frontend.graph_rs) then moves the states into their cells' rows, zeroing those.

A state has no history, so seq_rm can only drop a sequence's state whole: a range that cuts the
last position off (0 < p0 <= pos < p1) fails and changes nothing, as in llama.cpp (with
n_rs_seq = 0: llamir keeps no per-token snapshots for rollback).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from llamir.context.batch import BatchAllocator, UBatch
from llamir.context.kv_cache import MemoryStatus, SeqOpError, seq_int32, seq_positions
from llamir.context.memory import Memory, host_array, place_tensors, put_back, zero_tensors
from llamir.frontend.graph_rs import RSLayout, cache_r_name, cache_s_name

log = logging.getLogger("llamir")


@dataclass
class Cell:
    """mem_cell: the last position, where its state comes from, and the sequences it holds; `tail`
    is metadata of the sequence with this cell's index (the cell holding its state)."""

    pos: int = -1
    src: int = -1
    src0: int = -1
    tail: int = -1
    seq_id: set[int] = field(default_factory=set)

    def is_empty(self) -> bool:
        return not self.seq_id

    def copy(self) -> Cell:
        return Cell(self.pos, self.src, self.src0, self.tail, set(self.seq_id))


@dataclass
class CellsRecord:
    """The cells and counters as they were (prepare's and a rollback's copy)."""

    cells: list[Cell]
    head: int
    used: int
    n: int
    rs_z: int


class RecurrentMemory(Memory):
    """r and s tensors [size, n_embd_r / n_embd_s] per recurrent layer, and size cells."""

    def __init__(self, layout: RSLayout, n_seq_max: int):
        self.layout = layout
        self.size = layout.size
        self.n_seq_max = n_seq_max
        self.cells = [Cell() for _ in range(self.size)]
        self.head = self.used = self.n = 0
        self.rs_z = -1
        self.tensors: dict[str, np.ndarray] = {}
        for il in layout.layers:
            self.tensors[cache_r_name(il)] = np.zeros(layout.r_shape(), dtype=np.float32)
            self.tensors[cache_s_name(il)] = np.zeros(layout.s_shape(), dtype=np.float32)
        log.info("recurrent memory: %d cells, %d layers, R %d and S %d floats per cell and layer", self.size,
                 len(layout.layers), layout.n_embd_r, layout.n_embd_s)

    # -- what the base class reads from caches --------------------------------------------------
    @property
    def caches(self) -> tuple:
        return ()

    @property
    def rs_layout(self) -> RSLayout:
        return self.layout

    @property
    def buffers(self) -> dict:
        return dict(self.tensors)

    def place(self, buffers: Mapping) -> None:
        place_tensors(self.tensors, buffers, "recurrent memory")

    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def has_pending_update(self) -> bool:
        return False   # init_update is always NO_UPDATE: shifting a position moves no data

    def host(self, name: str) -> np.ndarray:
        return host_array(self.tensors[name])

    def put_back(self, name: str, array: np.ndarray) -> None:
        put_back(self.tensors[name], array)

    def rows(self, start: int, stop: int) -> dict[str, np.ndarray]:
        """Copies of rows [start, stop) of every tensor (what a ubatch overwrites)."""
        return {name: self.host(name)[start:stop].copy() for name in self.tensors}

    def write_rows(self, start: int, rows: Mapping[str, np.ndarray]) -> None:
        for name, data in rows.items():
            array = self.host(name)
            array[start:start + len(data)] = data
            self.put_back(name, array)

    # -- records ----------------------------------------------------------------------------------
    def record(self) -> CellsRecord:
        return CellsRecord([c.copy() for c in self.cells], self.head, self.used, self.n, self.rs_z)

    def restore(self, record: CellsRecord) -> None:
        self.cells = [c.copy() for c in record.cells]
        self.head, self.used, self.n, self.rs_z = record.head, record.used, record.n, record.rs_z

    # -- slots ------------------------------------------------------------------------------------
    def find_slot(self, ubatch: UBatch) -> bool:
        """llama_memory_recurrent::find_slot: a contiguous range of cells, one per sequence of the
        (equal-split) ubatch, at head; each cell's state source in src0."""
        cells, size = self.cells, self.size
        n_seq_tokens, n_seqs = ubatch.n_seq_tokens, ubatch.n_seqs
        if self.head > self.used + 2 * n_seqs:
            self.head = 0   # enough unused cells before head: search from the start
        first_ids = [ubatch.seq_ids[s * n_seq_tokens] for s in range(n_seqs)]
        for ids in first_ids:
            for j, seq_id in enumerate(ids):
                if not 0 <= seq_id < size:
                    log.error("find_slot: seq_id=%d >= n_seq_max=%d Try using a bigger --parallel value",
                              seq_id, self.n_seq_max)
                    return False
                if j > 0:   # a sequence that becomes shared leaves its old cell
                    self._detach(seq_id)
        next_empty = self._next_empty(self.head)
        lo, hi = size - 1, 0
        for s, ids in enumerate(first_ids):
            seq = cells[ids[0]]
            owns = seq.tail >= 0 and len(cells[seq.tail].seq_id) == 1
            if not owns:
                empty = cells[next_empty]
                if seq.tail >= 0:   # copy the old tail into the empty cell
                    orig = cells[seq.tail]
                    empty.pos, empty.src = orig.pos, orig.src
                    orig.seq_id.discard(ids[0])
                    empty.seq_id.add(ids[0])
                seq.tail = next_empty
                if s + 1 < n_seqs:
                    next_empty = self._next_empty(next_empty + 1)
            lo, hi = min(lo, seq.tail), max(hi, seq.tail)
        for s, ids in enumerate(first_ids):   # the ubatch's sequence s goes to cell lo + s
            dst, src = lo + s, cells[ids[0]].tail
            if dst != src:
                a, b = cells[dst], cells[src]
                a.pos, b.pos = b.pos, a.pos
                a.src, b.src = b.src, a.src
                a.seq_id, b.seq_id = b.seq_id, a.seq_id
                for c in cells:
                    if c.tail == src:
                        c.tail = dst
                    elif c.tail == dst:
                        c.tail = src
        for s, ids in enumerate(first_ids):
            last_pos = int(ubatch.pos[s * n_seq_tokens + n_seq_tokens - 1])
            cell = cells[lo + s]
            if cell.pos >= 0 and last_pos != cell.pos + n_seq_tokens:
                log.warning("find_slot: non-consecutive token position %d after %d for sequence %d with %d new "
                            "tokens", last_pos, cell.pos, ids[0], n_seq_tokens)
            cell.pos = last_pos
            cell.seq_id = set(ids)
            for seq_id in ids:
                cells[seq_id].tail = lo + s
        refs = np.zeros(size, dtype=np.int64)   # the first cell of the range no state comes from
        for c in cells:
            if c.src >= 0:
                refs[c.src] += 1
        self.rs_z = next((i for i in range(lo, hi + 1) if refs[i] == 0), -1)
        for i in range(lo, hi + 1):
            cell = cells[i]
            if cell.src < 0:
                assert self.rs_z >= 0, "find_slot: no cell of the range is free to be the zero state"
                cell.src0 = self.rs_z
            else:
                cell.src0 = cell.src
            cell.src = i   # its state is moved into its own row
        self.head, self.n = lo, hi - lo + 1
        self.used = sum(not c.is_empty() for c in cells)
        return self.n >= n_seqs

    def _detach(self, seq_id: int) -> None:
        seq = self.cells[seq_id]
        if seq.tail >= 0:
            cell = self.cells[seq.tail]
            cell.seq_id.discard(seq_id)
            seq.tail = -1
            if cell.is_empty():
                cell.pos = cell.src = -1
                self.used -= 1

    def _next_empty(self, start: int) -> int:
        """The first empty cell from `start` on, wrapping around (start itself if none is)."""
        for k in range(self.size):
            i = (start + k) % self.size
            if self.cells[i].is_empty():
                return i
        return start % self.size

    def prepare(self, ubatches: list[UBatch]) -> bool:
        """Whether every ubatch finds a slot, each as if the earlier ones were applied; nothing changes."""
        record = self.record()
        try:
            return all(self.find_slot(ub) for ub in ubatches)
        finally:
            self.restore(record)

    # -- memory interface -------------------------------------------------------------------------
    def init_batch(self, balloc: BatchAllocator, n_ubatch: int, embd_all: bool) -> RecurrentContext:
        """Sequence splits when every token is an output, else sequential equal splits."""
        balloc.split_reset()
        ubatches: list[UBatch] = []
        while True:
            ub = balloc.split_seq(n_ubatch) if embd_all else balloc.split_equal(n_ubatch, True)
            if ub is None or ub.n_tokens == 0:
                break
            ubatches.append(ub)
        if balloc.n_used < balloc.n_tokens or not self.prepare(ubatches):
            return RecurrentContext(self, MemoryStatus.FAILED_PREPARE)
        return RecurrentContext(self, MemoryStatus.SUCCESS, ubatches)

    def init_full(self) -> RecurrentContext:
        """Every cell, for the worst-case reservation (head 0, rs_z 0)."""
        return RecurrentContext(self, MemoryStatus.SUCCESS, full=True)

    def get_can_shift(self) -> bool:
        return True

    def clear(self, data: bool = True) -> None:
        self.cells = [Cell() for _ in range(self.size)]
        self.head = self.used = 0
        if data:
            zero_tensors(self.tensors)

    # -- sequence operations ----------------------------------------------------------------------
    def _tail_cell(self, seq_id: int) -> Cell | None:
        if 0 <= seq_id < self.size and self.cells[seq_id].tail >= 0:
            return self.cells[self.cells[seq_id].tail]
        return None

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Drop [p0, p1) of seq_id. False, with nothing changed, when the range would cut a state
        (0 < p0 <= its position < p1) or the id is outside [0, n_seq_max): llama.cpp compares it
        unsigned, so -1 ("every sequence") is refused too; clear() empties the memory."""
        seq_id = seq_int32("seq_rm", "seq_id", seq_id)
        p0, p1 = seq_positions("seq_rm", p0, p1)
        if not 0 <= seq_id < self.n_seq_max:   # llama.cpp compares it unsigned: -1 (every sequence) too
            log.error("seq_rm: invalid seq_id (%d) - larger than n_seq_max (%d)", seq_id, self.n_seq_max)
            return False
        if seq_id >= self.size:
            return False
        tail = self.cells[seq_id].tail
        if tail >= 0:
            cell = self.cells[tail]
            if 0 < p0 <= cell.pos < p1:
                return False   # a partial erase at the end: the state before p0 is gone
            if p0 <= cell.pos < p1:
                self.cells[seq_id].tail = -1
        new_head = self.size
        for i, cell in enumerate(self.cells):
            if not p0 <= cell.pos < p1:
                continue
            if seq_id in cell.seq_id:
                cell.seq_id.discard(seq_id)
            else:
                continue
            if cell.is_empty():
                if cell.pos >= 0:
                    self.used -= 1
                cell.pos = cell.src = -1
                new_head = min(new_head, i)
        if new_head < self.head:
            self.head = new_head
        return True

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """dst shares src's state cell (the whole state: a range is not a part of it)."""
        src, dst = seq_int32("seq_cp", "src", src), seq_int32("seq_cp", "dst", dst)
        seq_positions("seq_cp", p0, p1)
        if src == dst or not (0 <= src < self.size and 0 <= dst < self.size):
            return
        self._detach(dst)   # dst's own state goes
        tail = self.cells[src].tail
        if tail >= 0:
            self.cells[tail].seq_id.add(dst)
            self.cells[dst].tail = tail

    def seq_keep(self, seq_id: int) -> None:
        seq_id = seq_int32("seq_keep", "seq_id", seq_id)
        new_head = self.size
        for i, cell in enumerate(self.cells):
            if i != seq_id:
                cell.tail = -1
            if seq_id not in cell.seq_id:
                if cell.pos >= 0:
                    self.used -= 1
                cell.pos = cell.src = -1
                cell.seq_id.clear()
                new_head = min(new_head, i)
            else:
                cell.seq_id = {seq_id}
        if new_head < self.head:
            self.head = new_head

    def _tail_in_range(self, op: str, seq_id, p0, p1) -> Cell | None:
        seq_id = seq_int32(op, "seq_id", seq_id)
        p0, p1 = seq_positions(op, p0, p1)
        cell = self._tail_cell(seq_id) if p0 != p1 else None
        if cell is not None and seq_id in cell.seq_id and p0 <= cell.pos < p1:
            return cell
        return None

    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        """Only the state's position moves."""
        shift = seq_int32("seq_add", "shift", shift)
        cell = self._tail_in_range("seq_add", seq_id, p0, p1)
        if shift and cell is not None:
            cell.pos += shift

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        d = seq_int32("seq_div", "d", d)
        if d == 0:
            raise SeqOpError("seq_div: d = 0")
        cell = self._tail_in_range("seq_div", seq_id, p0, p1)
        if d != 1 and cell is not None:
            q = abs(cell.pos) // abs(d)          # C's division, toward zero
            cell.pos = q if (cell.pos >= 0) == (d > 0) else -q

    def seq_pos_min(self, seq_id: int) -> int:
        found = [c.pos for c in self.cells if seq_id in c.seq_id]
        return min(found) if found else -1

    def seq_pos_max(self, seq_id: int) -> int:
        return max((c.pos for c in self.cells if seq_id in c.seq_id), default=-1)

    # -- state ------------------------------------------------------------------------------------
    def state_write(self, writer, seq_id: int = -1, flags: int = 0) -> None:
        from llamir.context import state_recurrent
        from llamir.context.state_kv import check_memory_seq_id

        check_memory_seq_id(self, seq_id)
        state_recurrent.write(writer, self, seq_id)

    def state_parse(self, reader, source, flags: int = 0):
        from llamir.context import state_recurrent

        return state_recurrent.parse(reader, self, source)

    def state_apply(self, parsed, dest_seq_id: int) -> None:
        from llamir.context import state_recurrent
        from llamir.context.state_kv import check_memory_seq_id

        check_memory_seq_id(self, dest_seq_id)
        state_recurrent.apply(self, parsed, dest_seq_id)


@dataclass
class UbatchUndo:
    """What applying one ubatch changed: the cells before it, and the rows its graph overwrites."""

    record: CellsRecord
    start: int
    rows: dict[str, np.ndarray]


class RecurrentContext:
    """llama_memory_recurrent_context: the ubatches of one batch, placed one by one."""

    def __init__(self, memory: RecurrentMemory, status: MemoryStatus, ubatches: list[UBatch] | None = None,
                 full: bool = False):
        self.memory, self.status, self.ubatches, self.full = memory, status, ubatches or [], full
        self.i_cur = 0
        self.applied: list[UbatchUndo] = []

    def next(self) -> bool:
        self.i_cur += 1
        return self.i_cur < len(self.ubatches)

    def apply(self) -> bool:
        """find_slot for the current ubatch; the cells before and the rows the graph will write
        are kept for a rollback."""
        mem = self.memory
        record = mem.record()
        mem.find_slot(self.ubatches[self.i_cur])
        self.applied.append(UbatchUndo(record, mem.head, mem.rows(mem.head, mem.head + mem.n)))
        return True

    def rollback(self, keep: int = 0) -> None:
        """Undo every applied ubatch after the first `keep`, newest first: cells and rows as before."""
        while len(self.applied) > keep:
            undo = self.applied.pop()
            self.memory.restore(undo.record)
            self.memory.write_rows(undo.start, undo.rows)

    def get_ubatch(self) -> UBatch:
        return self.ubatches[self.i_cur]

    def contexts(self) -> list:
        return []   # no KV cache

    @property
    def recurrent(self) -> RecurrentContext:
        """The recurrent part of this memory context (itself; a hybrid one has two parts)."""
        return self

    @property
    def head(self) -> int:
        return 0 if self.full else self.memory.head

    @property
    def n_rs(self) -> int:
        return self.memory.size if self.full else self.memory.n

    @property
    def rs_z(self) -> int:
        return 0 if self.full else self.memory.rs_z

    def s_copy(self) -> np.ndarray:
        """Per cell of the range, the row its state is in (the zero state's for a new one)."""
        if self.full:
            return np.arange(self.memory.size, dtype=np.int32)
        cells = self.memory.cells
        return np.array([cells[self.head + i].src0 for i in range(self.n_rs)], dtype=np.int32)

    def bindings(self, n_tokens: int) -> dict[str, int]:
        ub = self.get_ubatch()
        return {"rs_seqs": ub.n_seqs, "rs_seq_tokens": ub.n_seq_tokens, "n_rs": self.n_rs}


__all__ = ["Cell", "RecurrentContext", "RecurrentMemory"]
