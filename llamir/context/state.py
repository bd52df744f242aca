"""Saving and restoring a context's state in llama.cpp's binary layout (little-endian), as
llama.cpp 0.3.36 writes it.

Whole context (llama_state_get_data, and session files: magic 'ggsn', version 10): the
architecture name, then the memory. Session files of version 9, which llamir wrote before, hold
the outputs between the two (n_outputs, each row's batch position, the logits, the embeddings);
they are still read, and restore those outputs too.
One sequence (llama_state_seq_get_data): an 8-byte prefix (the magic 0xaf143cd8 and the seq id),
then the memory's part for that sequence. Sequence files (magic 'ggsq', version 3; version 2 is
read too, its layout is the same) hold the memory's part without the prefix.
The memory is, per KV cache, n_stream, and per stream the cell count, each cell's position and
sequence ids, then per layer the K rows and the V rows (or, for a transposed V, each embedding
row's elements per cell range).

Reading is staged: the whole blob is parsed and checked against this context first, and only
then applied, so a truncated, corrupted or mismatched state leaves the context exactly as it
was (llama.cpp clears the cache instead; here nothing already held is lost). A version 10 state
has no outputs, so a successful load drops the context's (llama.cpp keeps the previous batch's,
which no longer belong to the memory): decode a token to get logits again.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from llamir.context.batch import ubatch_reserve
from llamir.context.kv_cache import KVCache, is_masked_swa
from llamir.frontend.graph_kv import cache_k_name, cache_v_name

SESSION_MAGIC, SESSION_VERSION = 0x6767736E, 10       # 'ggsn'
SESSION_VERSION_WITH_OUTPUTS = 9                      # llamir's older files: outputs before the memory
STATE_SEQ_MAGIC, STATE_SEQ_VERSION = 0x67677371, 3    # 'ggsq'
STATE_SEQ_VERSIONS_READ = (2, 3)                      # the same layout
SEQ_STATE_MAGIC = 0xAF143CD8                          # llama.cpp's io_magic, first in a sequence blob
STATE_SEQ_FLAGS_PARTIAL_ONLY = 1


class StateError(ValueError):
    """A state blob or file that cannot be restored into this context; nothing was changed."""


class Writer:
    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def pack(self, fmt: str, *values) -> None:
        self.parts.append(struct.pack("<" + fmt, *values))

    def string(self, s: str) -> None:
        data = s.encode()
        self.pack("I", len(data))
        self.parts.append(data)

    def raw(self, data) -> None:
        self.parts.append(bytes(memoryview(np.ascontiguousarray(data)).cast("B")))

    def getvalue(self) -> bytes:
        return b"".join(self.parts)


class Reader:
    def __init__(self, data: bytes):
        self.data, self.pos = memoryview(data), 0

    def unpack(self, fmt: str, what: str):
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.data):
            raise StateError(f"truncated state: {what} needs {size} bytes at byte {self.pos}, "
                             f"{len(self.data) - self.pos} left")
        values = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += size
        return values[0] if len(values) == 1 else values

    def string(self, what: str) -> str:
        n = self.unpack("I", what + " length")
        return bytes(self.bytes(n, what)).decode("utf-8", errors="replace")

    def bytes(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise StateError(f"truncated state: {what} needs {n} bytes at byte {self.pos}, "
                             f"{len(self.data) - self.pos} left")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out


# -- KV cache ------------------------------------------------------------------------------------
def _ranges(mask: np.ndarray) -> list[tuple[int, int]]:
    """[begin, end) runs of True cells."""
    idx = np.nonzero(mask)[0]
    if not len(idx):
        return []
    breaks = np.nonzero(np.diff(idx) != 1)[0]
    starts = np.concatenate([[idx[0]], idx[breaks + 1]])
    ends = np.concatenate([idx[breaks] + 1, [idx[-1] + 1]])
    return list(zip(starts.tolist(), ends.tolist()))


def write_cache(w: Writer, cache: KVCache, seq_id: int = -1) -> None:
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
            k = cache.buffers[cache_k_name(il)][s]
            w.pack("iQ", int(lay.type_k.ggml_type), lay.type_k.row_bytes(hp.n_embd_k_gqa(il)))
            for b, e in ranges:
                w.raw(k[b:e])
        for il in lay.layers:
            v = cache.buffers[cache_v_name(il)][s]
            if not lay.v_trans:
                w.pack("iQ", int(lay.type_v.ggml_type), lay.type_v.row_bytes(hp.n_embd_v_gqa(il)))
                for b, e in ranges:
                    w.raw(v[b:e])
            else:
                w.pack("iII", int(lay.type_v.ggml_type), lay.type_v.type_size, hp.n_embd_v_gqa(il))
                for j in range(hp.n_embd_v_gqa(il)):
                    for b, e in ranges:
                        w.raw(v[j, b:e])


@dataclass
class StreamState:
    cells: list[tuple[int, list[int]]]
    k: dict[int, np.ndarray] = field(default_factory=dict)   # layer -> rows [count, row storage]
    v: dict[int, np.ndarray] = field(default_factory=dict)   # layer -> rows, or [gqa, count] if transposed


def read_cache(r: Reader, cache: KVCache, seq_id: int) -> list[StreamState | None]:
    """Parse and check one cache's state; nothing is applied."""
    hp, lay = cache.hp, cache.layout
    n_stream = r.unpack("I", "n_stream")
    if n_stream != cache.n_stream:
        raise StateError(f"n_stream mismatch: the state has {n_stream}, this context {cache.n_stream}")
    out: list[StreamState | None] = []
    for _ in range(n_stream):
        count = r.unpack("I", "cell_count")
        if not count:
            out.append(None)
            continue
        if count > cache.kv_size:
            raise StateError(f"not enough cells in kv cache: the state has {count}, the cache {cache.kv_size}")
        cells = []
        for _ in range(count):
            pos, n_ids = r.unpack("iI", "cell")
            if seq_id != -1 and n_ids != 1:
                raise StateError("invalid seq_id-agnostic kv cell")
            if n_ids > cache.n_seq_max:
                raise StateError(f"a cell lists {n_ids} sequences (n_seq_max {cache.n_seq_max})")
            ids = [r.unpack("i", "seq id") for _ in range(n_ids)]
            for sid in ids:
                if seq_id == -1 and not 0 <= sid < cache.n_seq_max:
                    raise StateError(f"invalid seq_id, {sid} is out of range [0, {cache.n_seq_max})")
            cells.append((pos, ids))
        st = StreamState(cells)
        v_trans, n_layer = r.unpack("II", "v_trans, n_layer")
        if n_layer != len(lay.layers):
            raise StateError(f"mismatched layer count ({n_layer} instead of {len(lay.layers)})")
        if bool(v_trans) != lay.v_trans:
            raise StateError("incompatible V transposition")
        for il in lay.layers:
            k_type, k_row = r.unpack("iQ", "key type and row size")
            want_row = lay.type_k.row_bytes(hp.n_embd_k_gqa(il))
            if k_type != int(lay.type_k.ggml_type) or k_row != want_row:
                raise StateError(f"mismatched key type or row size in layer {il} ({k_type}/{k_row} instead of "
                                 f"{int(lay.type_k.ggml_type)}/{want_row})")
            st.k[il] = _rows(r, count, k_row, cache.buffers[cache_k_name(il)].dtype, f"layer {il} keys")
        for il in lay.layers:
            gqa = hp.n_embd_v_gqa(il)
            buf = cache.buffers[cache_v_name(il)]
            if not lay.v_trans:
                v_type, v_row = r.unpack("iQ", "value type and row size")
                want_row = lay.type_v.row_bytes(gqa)
                if v_type != int(lay.type_v.ggml_type) or v_row != want_row:
                    raise StateError(f"mismatched value type or row size in layer {il}")
                st.v[il] = _rows(r, count, v_row, buf.dtype, f"layer {il} values")
            else:
                v_type, el, n_embd = r.unpack("iII", "value type, element size, gqa")
                if v_type != int(lay.type_v.ggml_type) or el != lay.type_v.type_size or n_embd != gqa:
                    raise StateError(f"mismatched value type, element size or GQA size in layer {il}")
                st.v[il] = _rows(r, gqa, count * el, buf.dtype, f"layer {il} values")
        out.append(st)
    return out


def _rows(r: Reader, n: int, row_bytes: int, dtype: np.dtype, what: str) -> np.ndarray:
    data = np.frombuffer(bytes(r.bytes(n * row_bytes, what)), dtype=np.uint8).reshape(n, row_bytes)
    return data.view(dtype) if dtype != np.uint8 else data


def apply_cache(cache: KVCache, streams: list[StreamState | None], seq_id: int) -> None:
    """Commit a parsed state (whole cache when seq_id == -1, else into seq_id's stream)."""
    lay = cache.layout
    if seq_id == -1:
        cache.clear(data=True)
    for s, st in enumerate(streams):
        if st is None:
            continue
        strm = s if seq_id == -1 else cache.seq_to_stream[seq_id]
        cells = cache.v_cells[strm]
        if seq_id == -1:
            idxs = np.arange(len(st.cells))
            for i, (pos, ids) in enumerate(st.cells):
                cells.pos_set(i, pos)
                for sid in ids:
                    cells.seq_add(i, sid)
            cache.v_heads[strm] = 0
        else:
            idxs = place_sequence(cache, st, seq_id)
        for il in lay.layers:
            cache.buffers[cache_k_name(il)][strm][idxs] = st.k[il]
            if lay.v_trans:
                cache.buffers[cache_v_name(il)][strm][:, idxs] = st.v[il]
            else:
                cache.buffers[cache_v_name(il)][strm][idxs] = st.v[il]


def place_sequence(cache: KVCache, st: StreamState, seq_id: int) -> np.ndarray:
    """seq_rm(dest), then find a slot for the cells as a ubatch and occupy it; the cells are put back
    as they were if no slot is found."""
    snapshot = ([c.snapshot() for c in cache.v_cells], list(cache.v_heads))
    cache.seq_rm(seq_id, -1, -1)
    ub = ubatch_reserve(len(st.cells), 1)
    ub.pos[:] = [pos for pos, _ in st.cells]
    ub.seq_ids = [(seq_id,)] * len(st.cells)
    ub.seq_id_unq = [seq_id]
    sinfo = cache.find_slot(ub, cont=False)
    if sinfo is None:
        for c, snap in zip(cache.v_cells, snapshot[0]):
            c.restore(snap)
        cache.v_heads = snapshot[1]
        raise StateError(f"failed to find {len(st.cells)} available cells in the kv cache")
    cache.apply_ubatch(sinfo, ub)
    return sinfo.idxs[0]


def caches_of(memory, flags: int = 0) -> tuple[KVCache, ...]:
    caches = getattr(memory, "caches", (memory,))
    if flags & STATE_SEQ_FLAGS_PARTIAL_ONLY and len(caches) > 1:
        return caches[1:]  # only the SWA part
    return caches


def check_seq_fits(cache: KVCache, streams: list[StreamState | None], seq_id: int) -> None:
    """Before anything changes: a single-sequence restore must find room once seq_id is dropped."""
    for st in streams:
        if st is None:
            continue
        cells = cache.stream_of(seq_id)
        free = int(np.count_nonzero((cells.pos < 0) | (cells.seq[:, seq_id] & (cells.seq.sum(axis=1) == 1))))
        if len(st.cells) > free:
            raise StateError(f"failed to find {len(st.cells)} available cells in the kv cache ({free} free)")


# -- files -----------------------------------------------------------------------------------------
def write_file(path: str | Path, magic: int, version: int, tokens, body: bytes) -> int:
    w = Writer()
    w.pack("II", magic, version)
    tokens = np.asarray(tokens, dtype=np.int32)
    w.pack("I", len(tokens))
    w.raw(tokens)
    w.parts.append(body)
    data = w.getvalue()
    Path(path).write_bytes(data)
    return len(data)


def read_file(path: str | Path, magic: int, versions: tuple[int, ...], n_token_capacity: int,
              kind: str) -> tuple[int, list[int], bytes]:
    """The header of a `kind` file: (its version, its tokens, the body after them)."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise StateError(f"cannot read {path}: {err.strerror or err}") from None
    r = Reader(data)
    got_magic, got_version = r.unpack("II", "magic and version")
    if got_magic != magic or got_version not in versions:
        raise StateError(f"{path}: unknown (magic, version) for {kind} file: {got_magic:08x}, {got_version} "
                         f"(expected {magic:08x}, {' or '.join(map(str, versions))})")
    n = r.unpack("I", "token count")
    if n > n_token_capacity:
        raise StateError(f"{path}: token count in {kind} file exceeded capacity! {n} > {n_token_capacity}")
    tokens = np.frombuffer(bytes(r.bytes(4 * n, "tokens")), dtype="<i4").tolist()
    return got_version, tokens, bytes(r.data[r.pos:])


def save_file(ctx, path: str | Path, tokens) -> int:
    """llama_state_save_file: 'ggsn', version 10, the tokens, then the whole state; the bytes written."""
    return write_file(path, SESSION_MAGIC, SESSION_VERSION, tokens, write_state(ctx))


def load_file(ctx, path: str | Path, n_token_capacity: int) -> list[int]:
    """llama_state_load_file: a version 10 file, or a version 9 one with its outputs; every byte
    must be used. Returns the tokens."""
    versions = (SESSION_VERSION_WITH_OUTPUTS, SESSION_VERSION)
    version, tokens, body = read_file(path, SESSION_MAGIC, versions, n_token_capacity, "session")
    try:
        _read_state(ctx, body, with_outputs=version == SESSION_VERSION_WITH_OUTPUTS)
    except StateError as err:
        raise StateError(f"{path}: {err}") from None
    return tokens


def save_seq_file(ctx, path: str | Path, seq_id: int, tokens) -> int:
    """llama_state_seq_save_file: 'ggsq', version 3, the tokens, then the sequence's memory (without
    the blob's 8-byte prefix); the bytes written."""
    return write_file(path, STATE_SEQ_MAGIC, STATE_SEQ_VERSION, tokens, _seq_memory(ctx, seq_id, 0))


def load_seq_file(ctx, path: str | Path, dest_seq_id: int, n_token_capacity: int) -> list[int]:
    """llama_state_seq_load_file into dest_seq_id (versions 2 and 3). Returns the tokens."""
    _, tokens, body = read_file(path, STATE_SEQ_MAGIC, STATE_SEQ_VERSIONS_READ, n_token_capacity, "sequence state")
    try:
        _read_seq_memory(ctx, Reader(body), dest_seq_id, 0)
    except StateError as err:
        raise StateError(f"{path}: {err}") from None
    return tokens


# -- the whole context -----------------------------------------------------------------------------
def write_state(ctx) -> bytes:
    """llama_state_get_data: the architecture name, then the memory."""
    w = Writer()
    w.string(ctx.model.hparams.arch)
    ctx.memory.state_write(w)
    return w.getvalue()


def read_state(ctx, data: bytes) -> int:
    """llama_state_set_data: parse and check everything, then replace the memory (and drop the
    outputs, which the state does not hold). Returns the bytes read."""
    return _read_state(ctx, data, with_outputs=False)


@dataclass
class SavedOutputs:
    """The outputs of a version 9 state: each row's batch position, its logits and embeddings."""

    positions: np.ndarray
    logits: np.ndarray   # n_outputs * n_vocab values, or none
    embd: np.ndarray     # n_outputs * n_embd values, or none


def _read_state(ctx, data: bytes, with_outputs: bool) -> int:
    r = Reader(data)
    arch = r.string("model arch")
    if arch != ctx.model.hparams.arch:
        raise StateError(f"wrong model arch: '{arch}' instead of '{ctx.model.hparams.arch}'")
    outputs = _read_outputs(r, ctx) if with_outputs else None
    staged = [(cache, read_cache(r, cache, -1)) for cache in caches_of(ctx.memory)]
    if r.pos != len(r.data):
        raise StateError(f"{len(r.data) - r.pos} unexpected bytes after the state")
    _apply_outputs(ctx.outputs, outputs)
    for cache, streams in staged:
        apply_cache(cache, streams, -1)
    return r.pos


def _read_outputs(r: Reader, ctx) -> SavedOutputs:
    out, n_batch = ctx.outputs, ctx.cparams.n_batch
    n_outputs = r.unpack("I", "n_outputs")
    if n_outputs > max(n_batch, ctx.cparams.n_seq_max):
        raise StateError(f"too many output rows: {n_outputs} > {n_batch}")
    positions = np.frombuffer(bytes(r.bytes(4 * n_outputs, "output positions")), dtype="<i4")
    bad = positions[(positions < 0) | (positions >= n_batch)]
    if len(bad):
        raise StateError(f"invalid output id, {int(bad[0])} does not fit in batch size of {n_batch}")
    n_logits = r.unpack("Q", "logits size")
    if n_logits not in (0, n_outputs * out.n_vocab):
        raise StateError(f"logits size {n_logits} does not match {n_outputs} rows of {out.n_vocab}")
    logits = np.frombuffer(bytes(r.bytes(4 * n_logits, "logits")), dtype="<f4")
    n_embd = r.unpack("Q", "embeddings size")
    if n_embd not in (0, n_outputs * out.n_embd) or (n_embd and not out.has_embd):
        raise StateError(f"embeddings size {n_embd} does not match this context")
    embd = np.frombuffer(bytes(r.bytes(4 * n_embd, "embeddings")), dtype="<f4")
    return SavedOutputs(positions, logits, embd)


def _apply_outputs(out, saved: SavedOutputs | None) -> None:
    """The saved outputs in batch order, or none at all; pooled embeddings of the last batch go."""
    out.swaps.clear()
    out.embd_seq.clear()
    if saved is None:
        out.output_ids[:] = -1
        out.n_outputs = 0
        return
    n_outputs = len(saved.positions)
    out.reserve(n_outputs)
    if saved.logits.size:
        out.logits[:n_outputs] = saved.logits.reshape(n_outputs, out.n_vocab)
    if saved.embd.size:
        out.embd[:n_outputs] = saved.embd.reshape(n_outputs, out.n_embd)
    for row, batch_idx in enumerate(saved.positions):
        out.output_ids[batch_idx] = row
    out.n_outputs = n_outputs


# -- one sequence ----------------------------------------------------------------------------------
def write_seq_state(ctx, seq_id: int, flags: int = 0) -> bytes:
    """llama_state_seq_get_data: the magic and the seq id, then the sequence's memory."""
    return struct.pack("<Ii", SEQ_STATE_MAGIC, seq_id) + _seq_memory(ctx, seq_id, flags)


def read_seq_state(ctx, data: bytes, dest_seq_id: int, flags: int = 0) -> int:
    """llama_state_seq_set_data into dest_seq_id (the id in the prefix is the source's, unused).
    Returns the bytes read."""
    r = Reader(data)
    magic = r.unpack("I", "sequence state magic")
    if magic != SEQ_STATE_MAGIC:
        raise StateError(f"wrong sequence state magic: {magic:08x} instead of {SEQ_STATE_MAGIC:08x}")
    r.unpack("i", "sequence id")
    return _read_seq_memory(ctx, r, dest_seq_id, flags)


def _seq_memory(ctx, seq_id: int, flags: int) -> bytes:
    w = Writer()
    ctx.memory.state_write(w, seq_id, flags)
    return w.getvalue()


def _read_seq_memory(ctx, r: Reader, dest_seq_id: int, flags: int) -> int:
    if not 0 <= dest_seq_id < ctx.cparams.n_seq_max and not ctx.cparams.kv_unified:
        raise StateError(f"dest_seq_id {dest_seq_id} is out of range [0, {ctx.cparams.n_seq_max})")
    staged = [(cache, read_cache(r, cache, dest_seq_id)) for cache in caches_of(ctx.memory, flags)]
    if r.pos != len(r.data):
        raise StateError(f"{len(r.data) - r.pos} unexpected bytes after the sequence state")
    for cache, streams in staged:
        check_seq_fits(cache, streams, dest_seq_id)
    for cache, streams in staged:
        if all(st is None for st in streams):
            cache.seq_rm(dest_seq_id, -1, -1)
        apply_cache(cache, streams, dest_seq_id)
    return r.pos
