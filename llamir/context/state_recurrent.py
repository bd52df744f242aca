"""The recurrent memory's part of a state (llama_memory_recurrent::state_write / state_read), in
llama.cpp's layout: the cell count, each cell's position and sequence ids (none for one
sequence's state), then s_trans (0) and the layer count, each layer's r rows (type, row size,
rows), then each layer's s rows. A cell's rows come from the row its state is in (src).

As for the KV cache, reading parses and checks everything first (`parse`), then `apply` commits;
a bad blob raises StateError and changes nothing. Beyond llama.cpp's checks (cell counts, seq ids
of a whole state, layer count, types, row sizes, s_trans), positions must lie in [0, 2**31 - 1),
and a sequence's state holds at most one cell (llama.cpp asserts on more).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llamir.context.batch import ubatch_reserve
from llamir.context.memory_recurrent import RecurrentMemory
from llamir.context.state_io import Reader, StateError, Writer
from llamir.frontend.graph_rs import cache_r_name, cache_s_name
from llamir.ir import F32

POS_END = int(np.iinfo(np.int32).max)


def _selected(memory: RecurrentMemory, seq_id: int) -> list[int]:
    return [i for i, c in enumerate(memory.cells)
            if (seq_id == -1 and not c.is_empty()) or seq_id in c.seq_id]


def write(w: Writer, memory: RecurrentMemory, seq_id: int = -1) -> None:
    cells = _selected(memory, seq_id)
    w.pack("I", len(cells))
    for i in cells:
        cell = memory.cells[i]
        ids = sorted(cell.seq_id) if seq_id == -1 else []
        w.pack("iI", cell.pos, len(ids))
        for sid in ids:
            w.pack("i", sid)
    rows = [c.src if c.src >= 0 else i for i, c in ((i, memory.cells[i]) for i in cells)]
    w.pack("II", 0, memory.layout.n_layer)   # every layer counts; those without state write nothing
    for name_of, n_embd in ((cache_r_name, memory.layout.n_embd_r), (cache_s_name, memory.layout.n_embd_s)):
        for il in memory.layout.layers:
            w.pack("iQ", int(F32.ggml_type), 4 * n_embd)
            w.raw(memory.host(name_of(il))[rows])


@dataclass
class RecurrentState:
    """A parsed state: its cells (position, sequences) and their r and s rows per tensor name."""

    pos: np.ndarray
    seqs: list[tuple[int, ...]]
    rows: dict[str, np.ndarray]


def parse(r: Reader, memory: RecurrentMemory, source) -> RecurrentState:
    """Parse and check a whole state (source None) or one sequence's; nothing changes."""
    at = r.offset
    count = r.unpack("I", "cell count")
    if count > memory.size:
        raise StateError(f"not enough cells in the recurrent memory: {count} > {memory.size} (byte {at})")
    if source is not None and count > 1:
        raise StateError(f"a sequence's recurrent state holds one cell, this one {count} (byte {at})")
    pos = np.empty(count, dtype=np.int32)
    seqs: list[tuple[int, ...]] = []
    tails: set[int] = set()
    for i in range(count):
        at = r.offset
        p, n_ids = r.unpack("iI", f"cell {i}")
        if not 0 <= p < POS_END:
            raise StateError(f"cell {i}: position {p} is out of range [0, {POS_END}) (byte {at})")
        if source is not None and n_ids:
            raise StateError(f"cell {i}: invalid seq_id-agnostic cell ({n_ids} ids in a sequence state, byte {at})")
        ids = tuple(r.unpack("i", f"cell {i} seq id") for _ in range(n_ids))
        for sid in ids:
            if not 0 <= sid < memory.n_seq_max:
                raise StateError(f"cell {i}: invalid seq_id, {sid} is out of range [0, {memory.n_seq_max})")
            if sid in tails:
                raise StateError(f"cell {i}: duplicate tail for seq_id {sid}")
            tails.add(sid)
        pos[i] = p
        seqs.append(ids)
    at = r.offset
    s_trans, n_layer = r.unpack("II", "s_trans and layer count")
    if n_layer != memory.layout.n_layer:
        raise StateError(f"mismatched layer count ({n_layer} instead of {memory.layout.n_layer}, byte {at})")
    if s_trans:
        raise StateError(f"incompatible s transposition (byte {at})")
    rows: dict[str, np.ndarray] = {}
    for kind, name_of, n_embd in (("r", cache_r_name, memory.layout.n_embd_r),
                                  ("s", cache_s_name, memory.layout.n_embd_s)):
        for il in memory.layout.layers:
            at = r.offset
            type_i, row_bytes = r.unpack("iQ", f"layer {il} {kind} header")
            if type_i != int(F32.ggml_type):
                raise StateError(f"mismatched {kind} type ({type_i} != {int(F32.ggml_type)}, layer {il}, byte {at})")
            if row_bytes != 4 * n_embd:
                raise StateError(f"mismatched {kind} row size ({row_bytes} != {4 * n_embd}, layer {il}, byte {at})")
            data = bytes(r.bytes(count * row_bytes, f"layer {il} {kind} rows"))
            rows[name_of(il)] = np.frombuffer(data, dtype="<f4").reshape(count, n_embd)
    return RecurrentState(pos, seqs, rows)


def apply(memory: RecurrentMemory, st: RecurrentState, dest_seq_id: int) -> None:
    """Commit a parsed state: the whole memory, or one sequence's state into dest_seq_id (which
    must find a cell, or nothing changes)."""
    count = len(st.pos)
    if dest_seq_id == -1:
        memory.clear(data=True)
        for i in range(count):
            cell = memory.cells[i]
            cell.pos, cell.seq_id = int(st.pos[i]), set(st.seqs[i])
            for sid in st.seqs[i]:
                memory.cells[sid].tail = i
        memory.head, memory.used = 0, count
    else:
        record = memory.record()
        memory.seq_rm(dest_seq_id, -1, -1)
        if count == 0:
            return
        ub = ubatch_reserve(count, 1)
        ub.pos[:] = st.pos
        ub.seq_ids = [(dest_seq_id,)] * count
        ub.seq_id_unq = [dest_seq_id]
        if not memory.find_slot(ub):
            memory.restore(record)
            raise StateError(f"failed to find available cells in the recurrent memory for sequence {dest_seq_id}")
    for i in range(count):
        memory.cells[memory.head + i].src = memory.head + i   # the restored states stay where they are
    memory.write_rows(memory.head, st.rows)


__all__ = ["RecurrentState", "apply", "parse", "write"]
