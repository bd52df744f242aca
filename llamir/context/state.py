"""Saving and restoring a context's state in llama.cpp's binary layout (little-endian), as
llama.cpp 0.3.36 writes it.

Whole context (llama_state_get_data, and session files: magic 'ggsn', version 10): the
architecture name, then the memory. Session files of version 9, which llamir wrote before, hold
the outputs between the two (n_outputs, each row's batch position, the logits, the embeddings);
they are still read, and restore those outputs too.
One sequence (llama_state_seq_get_data): an 8-byte prefix (the magic 0xaf143cd8 and the seq id),
then the memory's part for that sequence. Sequence files (magic 'ggsq', version 3; version 2 is
read too, its layout is the same) hold the memory's part without the prefix.
The memory's part is llamir.context.state_kv's.

Reading is staged: the arguments, then the whole blob are parsed and checked against this
context first, and only then applied, so a truncated, corrupted or mismatched state raises
StateError (naming the field, the value and the byte offset) and leaves the context exactly as
it was (llama.cpp clears the cache instead; here nothing already held is lost). A version 10
state has no outputs, so a successful load drops the context's (llama.cpp keeps the previous
batch's, which no longer belong to the memory): decode a token to get logits again.

Where llamir is stricter than llama.cpp 0.3.36, which would misbehave or abort:
- trailing bytes after a blob are refused (llama.cpp ignores them);
- a sequence call takes a seq id in [0, n_seq_max): -1 makes llama.cpp replace every sequence
  with the blob's, an id in [n_seq_max, 256) of a unified cache makes a sequence no batch may
  use, and larger or negative ids (or n_seq_max and up without kv_unified) abort the process;
- the checks that state_kv lists (positions, repeated or misplaced seq ids).
One behaviour differs by choice: a sequence state without cells empties dest_seq_id, where
llama.cpp leaves what dest_seq_id held.
"""

from __future__ import annotations

import operator
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llamir.context.batch import LLAMA_MAX_SEQ
from llamir.context.state_io import Reader, StateError, Writer
from llamir.context.state_kv import STATE_SEQ_FLAGS_PARTIAL_ONLY, SeqSource

__all__ = ["StateError", "STATE_SEQ_FLAGS_PARTIAL_ONLY"]

SESSION_MAGIC, SESSION_VERSION = 0x6767736E, 10       # 'ggsn'
SESSION_VERSION_WITH_OUTPUTS = 9                      # llamir's older files: outputs before the memory
STATE_SEQ_MAGIC, STATE_SEQ_VERSION = 0x67677371, 3    # 'ggsq'
STATE_SEQ_VERSIONS_READ = (2, 3)                      # the same layout
SEQ_STATE_MAGIC = 0xAF143CD8                          # llama.cpp's io_magic, first in a sequence blob
FILE_HEADER = 12                                      # magic, version, token count
_INT32 = np.iinfo(np.int32)


# -- arguments -------------------------------------------------------------------------------------
def _integer(value, what: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise StateError(f"{what} must be an integer, got {type(value).__name__} {value!r}") from None


def check_seq_id(ctx, seq_id, what: str = "seq_id") -> int:
    """A sequence of this context: 0 <= seq_id < n_seq_max (see the module notes on llama.cpp)."""
    seq_id = _integer(seq_id, what)
    n_seq_max = ctx.cparams.n_seq_max
    if seq_id == -1:
        raise StateError(f"{what} -1: a sequence state is of one sequence, in [0, {n_seq_max}) "
                         f"(llama.cpp would replace every sequence; use state_get_data/state_set_data "
                         f"for the whole context)")
    if not 0 <= seq_id < n_seq_max:
        raise StateError(f"{what} {seq_id} is out of range [0, {n_seq_max})")
    return seq_id


def check_flags(flags) -> int:
    flags = _integer(flags, "flags")
    if flags < 0:
        raise StateError(f"flags {flags} must be non-negative")
    return flags


def as_bytes(data, what: str = "state data") -> bytes:
    """The bytes of a bytes-like state (bytes, bytearray, memoryview, a uint8 array)."""
    if isinstance(data, (bytes, bytearray)):
        return bytes(data)
    if isinstance(data, memoryview):
        return data.tobytes()
    if isinstance(data, np.ndarray) and data.dtype == np.uint8:
        return data.tobytes()
    raise StateError(f"{what} must be bytes, got {type(data).__name__}")


def _path(path) -> Path:
    try:
        return Path(path)
    except TypeError:
        raise StateError(f"path must be a str or os.PathLike, got {type(path).__name__} {path!r}") from None


def _tokens(tokens) -> np.ndarray:
    """A file's tokens: a flat sequence of int32 values (as llama_token is)."""
    try:
        arr = np.asarray(tokens)
    except (TypeError, ValueError) as err:
        raise StateError(f"tokens must be a flat sequence of integers: {err}") from None
    if arr.ndim != 1:
        raise StateError(f"tokens must be a flat sequence of integers, got an array of shape {arr.shape}")
    if not arr.size:
        return np.zeros(0, dtype="<i4")
    if arr.dtype.kind not in "iu":
        raise StateError(f"tokens must be integers, got {arr.dtype} values")
    bad = np.flatnonzero((arr < _INT32.min) | (arr > _INT32.max))
    if len(bad):
        raise StateError(f"tokens[{int(bad[0])}] = {arr[bad[0]]} is not an int32")
    return arr.astype("<i4")


# -- files -----------------------------------------------------------------------------------------
def write_file(path, magic: int, version: int, tokens, body: bytes) -> int:
    w = Writer()
    w.pack("II", magic, version)
    tokens = _tokens(tokens)
    w.pack("I", len(tokens))
    w.raw(tokens)
    w.parts.append(body)
    data = w.getvalue()
    path = _path(path)
    try:
        path.write_bytes(data)
    except (OSError, ValueError) as err:      # ValueError: a NUL byte in the path
        raise StateError(f"cannot write {path}: {getattr(err, 'strerror', None) or err}") from None
    return len(data)


def read_file(path, magic: int, versions: tuple[int, ...], n_token_capacity,
              kind: str) -> tuple[int, list[int], Reader]:
    """The header of a `kind` file: (its version, its tokens, a reader of the body after them)."""
    n_token_capacity = _integer(n_token_capacity, "n_token_capacity")
    if n_token_capacity < 0:
        raise StateError(f"n_token_capacity {n_token_capacity} must be non-negative")
    path = _path(path)
    try:
        data = path.read_bytes()
    except (OSError, ValueError) as err:      # ValueError: a NUL byte in the path
        raise StateError(f"cannot read {path}: {getattr(err, 'strerror', None) or err}") from None
    r = Reader(data)
    try:
        got_magic, got_version = r.unpack("II", "magic and version")
        if got_magic != magic or got_version not in versions:
            raise StateError(f"unknown (magic, version) for {kind} file: {got_magic:08x}, {got_version} "
                             f"(expected {magic:08x}, {' or '.join(map(str, versions))})")
        n = r.unpack("I", "token count")
        if n > n_token_capacity:
            raise StateError(f"token count in {kind} file exceeded capacity! {n} > {n_token_capacity}")
        tokens = np.frombuffer(bytes(r.bytes(4 * n, "tokens")), dtype="<i4").tolist()
    except StateError as err:
        raise StateError(f"{path}: {err}") from None
    return got_version, tokens, Reader(bytes(r.data[r.pos:]), base=r.offset)


def save_file(ctx, path, tokens) -> int:
    """llama_state_save_file: 'ggsn', version 10, the tokens, then the whole state; the bytes written."""
    return write_file(path, SESSION_MAGIC, SESSION_VERSION, tokens, write_state(ctx))


def load_file(ctx, path, n_token_capacity) -> list[int]:
    """llama_state_load_file: a version 10 file, or a version 9 one with its outputs; every byte
    must be used. Returns the tokens."""
    versions = (SESSION_VERSION_WITH_OUTPUTS, SESSION_VERSION)
    version, tokens, r = read_file(path, SESSION_MAGIC, versions, n_token_capacity, "session")
    try:
        _read_state(ctx, r, with_outputs=version == SESSION_VERSION_WITH_OUTPUTS)
    except StateError as err:
        raise StateError(f"{path}: {err}") from None
    return tokens


def save_seq_file(ctx, path, seq_id, tokens) -> int:
    """llama_state_seq_save_file: 'ggsq', version 3, the tokens, then the sequence's memory (without
    the blob's 8-byte prefix); the bytes written."""
    seq_id = check_seq_id(ctx, seq_id)
    return write_file(path, STATE_SEQ_MAGIC, STATE_SEQ_VERSION, tokens, _seq_memory(ctx, seq_id, 0))


def load_seq_file(ctx, path, dest_seq_id, n_token_capacity) -> list[int]:
    """llama_state_seq_load_file into dest_seq_id (versions 2 and 3). Returns the tokens."""
    dest_seq_id = check_seq_id(ctx, dest_seq_id, "dest_seq_id")
    _, tokens, r = read_file(path, STATE_SEQ_MAGIC, STATE_SEQ_VERSIONS_READ, n_token_capacity, "sequence state")
    try:
        _read_seq_memory(ctx, r, dest_seq_id, 0, SeqSource())
    except StateError as err:
        raise StateError(f"{path}: {err}") from None
    return tokens


# -- the whole context -----------------------------------------------------------------------------
def write_state(ctx) -> bytes:
    """llama_state_get_data: the architecture name, then the memory."""
    w = Writer()
    w.string(ctx.model.hparams.arch)
    if ctx.memory is not None:   # a memory-less encoder's state is its architecture name alone
        ctx.memory.state_write(w)
    return w.getvalue()


def read_state(ctx, data) -> int:
    """llama_state_set_data: parse and check everything, then replace the memory (and drop the
    outputs, which the state does not hold). Returns the bytes read."""
    return _read_state(ctx, Reader(as_bytes(data)), with_outputs=False)


@dataclass
class SavedOutputs:
    """The outputs of a version 9 state: each row's batch position, its logits and embeddings."""

    positions: np.ndarray
    logits: np.ndarray   # n_outputs * n_vocab values, or none
    embd: np.ndarray     # n_outputs * n_embd values, or none


def _read_state(ctx, r: Reader, with_outputs: bool) -> int:
    at = r.offset
    arch = r.string("model arch")
    if arch != ctx.model.hparams.arch:
        raise StateError(f"wrong model arch: '{arch}' instead of '{ctx.model.hparams.arch}' (byte {at})")
    outputs = _read_outputs(r, ctx) if with_outputs else None
    states = ctx.memory.state_parse(r, None) if ctx.memory is not None else None
    r.expect_end("state")
    _apply_outputs(ctx.outputs, outputs)
    if ctx.memory is not None:
        ctx.memory.state_apply(states, -1)
    return r.pos


def _read_outputs(r: Reader, ctx) -> SavedOutputs:
    out, n_batch = ctx.outputs, ctx.cparams.n_batch
    at = r.offset
    n_outputs = r.unpack("I", "n_outputs")
    if n_outputs > n_batch:
        raise StateError(f"too many output rows: {n_outputs} > {n_batch} (byte {at})")
    at = r.offset
    positions = np.frombuffer(bytes(r.bytes(4 * n_outputs, "output positions")), dtype="<i4")
    bad = np.flatnonzero((positions < 0) | (positions >= n_batch))
    if len(bad):
        raise StateError(f"invalid output id, {int(positions[bad[0]])} does not fit in batch size of {n_batch} "
                         f"(output {int(bad[0])}, byte {at + 4 * int(bad[0])})")
    if len(np.unique(positions)) != n_outputs:
        raise StateError(f"output positions repeat a batch position: {positions.tolist()} (byte {at})")
    at = r.offset
    n_logits = r.unpack("Q", "logits size")
    if n_logits not in (0, n_outputs * out.n_vocab) or (n_logits and not out.has_logits):
        raise StateError(f"logits size {n_logits} does not match {n_outputs} rows of {out.n_vocab} (byte {at})")
    logits = np.frombuffer(bytes(r.bytes(4 * n_logits, "logits")), dtype="<f4")
    at = r.offset
    n_embd = r.unpack("Q", "embeddings size")
    if n_embd not in (0, n_outputs * out.n_embd) or (n_embd and not out.has_embd):
        raise StateError(f"embeddings size {n_embd} does not match this context (byte {at})")
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
def write_seq_state(ctx, seq_id, flags=0) -> bytes:
    """llama_state_seq_get_data: the magic and the seq id, then the sequence's memory."""
    seq_id, flags = check_seq_id(ctx, seq_id), check_flags(flags)
    return struct.pack("<Ii", SEQ_STATE_MAGIC, seq_id) + _seq_memory(ctx, seq_id, flags)


def read_seq_state(ctx, data, dest_seq_id, flags=0) -> int:
    """llama_state_seq_set_data into dest_seq_id (the id in the prefix is the source's, which every
    cell must carry). Returns the bytes read."""
    dest_seq_id, flags = check_seq_id(ctx, dest_seq_id, "dest_seq_id"), check_flags(flags)
    r = Reader(as_bytes(data))
    magic = r.unpack("I", "sequence state magic")
    if magic != SEQ_STATE_MAGIC:
        raise StateError(f"wrong sequence state magic: {magic:08x} instead of {SEQ_STATE_MAGIC:08x} (byte 0)")
    src = r.unpack("i", "sequence id")
    if not 0 <= src < LLAMA_MAX_SEQ:
        raise StateError(f"invalid seq_id, {src} is out of range [0, {LLAMA_MAX_SEQ}): the sequence id (byte 4)")
    return _read_seq_memory(ctx, r, dest_seq_id, flags, SeqSource(src))


def _seq_memory(ctx, seq_id: int, flags: int) -> bytes:
    w = Writer()
    if ctx.memory is not None:
        ctx.memory.state_write(w, seq_id, flags)
    return w.getvalue()


def _read_seq_memory(ctx, r: Reader, dest_seq_id: int, flags: int, source: SeqSource) -> int:
    if ctx.memory is None:
        r.expect_end("sequence state")
        return r.pos
    states = ctx.memory.state_parse(r, source, flags)
    r.expect_end("sequence state")
    ctx.memory.state_apply(states, dest_seq_id)
    return r.pos
