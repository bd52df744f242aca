"""Batches, their validation (llama_batch_allocr::init) and ubatch splits (llama-batch.cpp)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

log = logging.getLogger("llamir")

LLAMA_MAX_SEQ = 256
I32_MIN, I32_MAX = -2**31, 2**31 - 1        # llama_token, llama_pos and llama_seq_id are int32
POS_LIMIT = I32_MAX - 1                     # the largest position: a cell's pos + 1 must fit
_EMPTY_POS = np.zeros(0, dtype=np.int32)
_EMPTY_POS.flags.writeable = False
_EMPTY_OUTPUT = np.zeros(0, dtype=bool)
_EMPTY_OUTPUT.flags.writeable = False


class BatchError(ValueError):
    """An invalid batch; decode turns it into status -1. The message names the bad entry."""


# -- field checks ----------------------------------------------------------------------------------
# A Batch's fields are checked when it is made and again by decode and encode (a field may have
# been replaced or changed since): each check takes whatever is there and returns the field's one
# canonical form, or raises BatchError naming the field, the index and the value.

def is_integer(value) -> bool:
    """A Python or numpy integer; not a bool (True is an int to Python, never an id here)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _short(value) -> str:
    text = repr(value.item() if isinstance(value, np.generic) else value)
    return text if len(text) <= 60 else text[:57] + "..."


def _items(name: str, value) -> list:
    """The elements of a list-like field (a str, a mapping or a scalar is not one)."""
    if isinstance(value, (str, bytes, bytearray, dict)) or not isinstance(value, Iterable):
        raise BatchError(f"{name} must be a list, got {type(value).__name__} {_short(value)}")
    if isinstance(value, np.ndarray) and value.ndim != 1:
        raise BatchError(f"{name} must be one-dimensional, got an array of shape {value.shape}")
    try:
        return list(value)
    except Exception as err:  # noqa: BLE001 - a user's iterable may raise anything
        raise BatchError(f"{name} could not be read as a list: {type(err).__name__}: {err}") from None


def _int32_at(name: str, i, value) -> int:
    """`value` as an int, if it is an integer in llama.cpp's int32 range."""
    if type(value) is not int:
        if not is_integer(value):
            raise BatchError(f"{name}[{i}] = {_short(value)} is not an integer")
        value = int(value)
    if not I32_MIN <= value <= I32_MAX:
        raise BatchError(f"{name}[{i}] = {value} is out of range (an int32: {I32_MIN}..{I32_MAX})")
    return value


_INT64, _BOOL = np.dtype(np.int64), np.dtype(bool)
_SMALL = 32     # arrays up to this long are range-checked in Python: a numpy reduction costs more


def _min_max(value: np.ndarray) -> tuple:
    if len(value) == 1:
        x = value.item()
        return x, x
    if len(value) <= _SMALL:
        items = value.tolist()
        return min(items), max(items)
    return value.min(), value.max()


def int_array(name: str, value) -> np.ndarray:
    """A 1-D int64 array of `value`'s elements, each an integer in llama.cpp's int32 range."""
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "iu":
        if len(value):
            lo, hi = _min_max(value)
            if lo < I32_MIN or hi > I32_MAX:
                i = int(np.flatnonzero((value < I32_MIN) | (value > I32_MAX))[0])
                _int32_at(name, i, value[i])
        return value if value.dtype == _INT64 else value.astype(np.int64)
    if type(value) is list and all(type(x) is int for x in value):   # plain Python ints: the common case
        if value and (min(value) < I32_MIN or max(value) > I32_MAX):
            i = next(i for i, x in enumerate(value) if not I32_MIN <= x <= I32_MAX)
            _int32_at(name, i, value[i])
        return np.array(value, dtype=np.int64).reshape(-1)
    items = _items(name, value)
    return np.array([_int32_at(name, i, x) for i, x in enumerate(items)], dtype=np.int64)


def flag_array(name: str, value) -> np.ndarray:
    """A 1-D bool array of `value`'s flags: each True/False or 1/0 (a string is never a flag)."""
    if isinstance(value, str):
        raise BatchError(f"{name} must be a list of flags, got the string {value!r} "
                         f"(Batch.from_tokens takes 'last', 'all' or 'none')")
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "biu":
        if value.dtype.kind != "b" and len(value):
            lo, hi = _min_max(value)
            if lo < 0 or hi > 1:
                i = int(np.flatnonzero((value < 0) | (value > 1))[0])
                raise BatchError(f"{name}[{i}] = {value[i]} is not a flag (True/False or 1/0)")
        return value if value.dtype == _BOOL else value.astype(bool)
    items = _items(name, value)
    for i, x in enumerate(items):
        if not (isinstance(x, (bool, np.bool_)) or (is_integer(x) and x in (0, 1))):
            raise BatchError(f"{name}[{i}] = {_short(x)} is not a flag (True/False or 1/0)")
    return np.array(items, dtype=bool).reshape(-1)


def seq_id_lists(name: str, value) -> list[tuple[int, ...]]:
    """One tuple of sequence ids per token; a token given a single id gets a one-id tuple."""
    out = []
    checked = None      # the last canonical tuple: a batch repeats one (Batch.from_tokens), checked once
    for i, ids in enumerate(value if type(value) is list else _items(name, value)):
        if ids is checked:
            pass
        elif type(ids) is tuple and all(type(s) is int and I32_MIN <= s <= I32_MAX for s in ids):
            checked = ids                          # already canonical: the common, fast case
        elif is_integer(ids):
            ids = (_int32_at(name, i, ids),)
        else:
            ids = tuple(_int32_at(f"{name}[{i}]", j, s) for j, s in enumerate(_items(f"{name}[{i}]", ids)))
        if not ids:
            raise BatchError(f"{name}[{i}] is empty: token {i} belongs to no sequence")
        out.append(ids)
    return out


def embd_array(name: str, value) -> np.ndarray:
    """A C-contiguous float32 [n_tokens, n_embd] array of real numbers."""
    if not isinstance(value, np.ndarray):
        if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable):
            raise BatchError(f"{name} must be [n_tokens, n_embd] numbers, got {type(value).__name__}")
        try:
            value = np.asarray(value)
        except (ValueError, TypeError) as err:
            raise BatchError(f"{name} is not a rectangular array of numbers: {err}") from None
    if value.ndim != 2:
        raise BatchError(f"{name} must be [n_tokens, n_embd], got shape {value.shape}")
    if value.dtype.kind not in "fiu" and value.size:
        raise BatchError(f"{name} must hold real numbers, got a {value.dtype} array")
    with np.errstate(over="ignore"):           # a float64 beyond float32's range becomes inf, as a cast in C
        return np.ascontiguousarray(value, dtype=np.float32)


class BatchFields(NamedTuple):
    """A batch's fields, checked and in their canonical types (what the allocator reads)."""

    tokens: np.ndarray | None        # int64 [n_tokens]
    embd: np.ndarray | None          # float32 [n_tokens, n_embd]
    pos: np.ndarray | None           # int64 [n_tokens]
    seq_ids: list[tuple[int, ...]] | None
    logits: np.ndarray | None        # bool [n_tokens]

    @property
    def n_tokens(self) -> int:
        return len(self.tokens) if self.tokens is not None else len(self.embd)


def check_fields(tokens, embd, pos, seq_ids, logits) -> BatchFields:
    """Every field checked (kinds, int32 ranges, lengths); what needs a model or a memory (the
    vocab size, n_seq_max, positions against the cache) is BatchAllocator.init's."""
    tokens = None if tokens is None else int_array("tokens", tokens)
    embd = None if embd is None else embd_array("embd", embd)
    if (tokens is None) == (embd is None):
        raise BatchError("a batch needs exactly one of tokens and embd")
    n = len(tokens) if tokens is not None else len(embd)
    if pos is not None:
        pos = int_array("pos", pos)
        if len(pos) != n:
            raise BatchError(f"{len(pos)} positions for {n} tokens")
    if seq_ids is not None:
        seq_ids = seq_id_lists("seq_ids", seq_ids)
        if len(seq_ids) != n:
            raise BatchError(f"{len(seq_ids)} seq_id lists for {n} tokens")
    if logits is not None:
        logits = flag_array("logits", logits)
        if len(logits) != n:
            raise BatchError(f"{len(logits)} logits flags for {n} tokens")
    return BatchFields(tokens, embd, pos, seq_ids, logits)


def check_batch(batch) -> BatchFields:
    """A Batch's fields as they are now (decode and encode check again: fields may have changed)."""
    if not isinstance(batch, Batch):
        raise BatchError(f"decode needs a llamir.Batch, got {type(batch).__name__}")
    return check_fields(batch.tokens, batch.embd, batch.pos, batch.seq_ids, batch.logits)


@dataclass
class Batch:
    """llama_batch: tokens (or embeddings), positions, sequence ids and output flags per token.

    `pos` None: positions continue what the memory holds for each token's first sequence.
    `seq_ids` None: every token is in sequence 0. `logits` None: only the last token outputs.
    Integers may be Python or numpy ones, within int32; flags are bools or 0/1. A bad field raises
    BatchError here, and decode checks the fields again (returning -1) in case they changed.
    """

    tokens: np.ndarray | None = None
    embd: np.ndarray | None = None
    pos: np.ndarray | None = None
    seq_ids: list[tuple[int, ...]] | None = None
    logits: np.ndarray | None = None

    def __post_init__(self) -> None:
        f = check_fields(self.tokens, self.embd, self.pos, self.seq_ids, self.logits)
        self.tokens, self.embd, self.pos, self.seq_ids, self.logits = f.tokens, f.embd, f.pos, f.seq_ids, f.logits

    @property
    def n_tokens(self) -> int:
        data = self.tokens if self.tokens is not None else self.embd
        try:
            return len(data)
        except TypeError:
            raise BatchError(f"the batch's tokens/embd ({type(data).__name__}) have no length") from None

    @classmethod
    def from_tokens(cls, tokens: Sequence[int], pos0: int | None = 0, seq_id: int | Sequence[int] = 0,
                    logits: str | Sequence[bool] = "last") -> Batch:
        """One sequence (or a token set shared by several) at consecutive positions from pos0
        (pos0=None: continue the memory). logits: "last", "all", "none" or one flag per token."""
        if (type(tokens) is list and len(tokens) == 1 and type(tokens[0]) is int and type(seq_id) is int
                and type(logits) is str and logits == "last" and (pos0 is None or type(pos0) is int)
                and I32_MIN <= tokens[0] <= I32_MAX and I32_MIN <= seq_id <= I32_MAX
                and (pos0 is None or I32_MIN <= pos0 <= I32_MAX)):
            # a generated token, the common call: the same fields as below, in fewer steps
            batch = cls.__new__(cls)
            batch.tokens, batch.embd, batch.seq_ids = np.array(tokens, dtype=np.int64), None, [(seq_id,)]
            batch.pos = None if pos0 is None else np.array([pos0], dtype=np.int64)
            batch.logits = np.ones(1, dtype=bool)
            return batch
        tokens = int_array("tokens", tokens)
        n = len(tokens)
        ids = (_int32_at("seq_id", 0, seq_id),) if is_integer(seq_id) else \
            tuple(_int32_at("seq_id", j, s) for j, s in enumerate(_items("seq_id", seq_id)))
        if isinstance(logits, str):
            if logits not in ("last", "all", "none"):
                raise BatchError(f"logits must be 'last', 'all', 'none' or a list of flags, got {logits!r}")
            flags = np.zeros(n, dtype=bool)
            if logits == "all":
                flags[:] = True
            elif logits == "last" and n:
                flags[-1] = True
        else:
            flags = flag_array("logits", logits)
        pos = None
        if pos0 is not None:
            if not is_integer(pos0):
                raise BatchError(f"pos0 = {_short(pos0)} is not an integer")
            if not I32_MIN <= int(pos0) <= I32_MAX - max(n - 1, 0):
                raise BatchError(f"pos0 = {int(pos0)} puts positions out of the int32 range for {n} tokens")
            pos = np.arange(int(pos0), int(pos0) + n, dtype=np.int64)
        if len(flags) != n:
            raise BatchError(f"{len(flags)} logits flags for {n} tokens")
        # every field is already in its checked, canonical form: skip __post_init__'s second pass
        batch = cls.__new__(cls)
        batch.tokens, batch.embd, batch.pos, batch.seq_ids, batch.logits = tokens, None, pos, [ids] * n, flags
        return batch


@dataclass
class UBatch:
    """llama_ubatch: a slice of the batch processed by one graph evaluation."""

    equal_seqs: bool
    n_seq_tokens: int
    n_seqs: int
    tokens: np.ndarray | None
    embd: np.ndarray | None
    pos: np.ndarray
    seq_ids: list[tuple[int, ...]]
    output: np.ndarray
    batch_idxs: np.ndarray
    seq_id_unq: list[int] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return len(self.pos)

    @property
    def n_seqs_unq(self) -> int:
        return len(self.seq_id_unq)

    @property
    def n_outputs(self) -> int:
        return int(self.output.sum())

    def seq_idx(self, seq_id: int) -> int:
        return self.seq_id_unq.index(seq_id)


class _SeqPosMax:
    """memory.seq_pos_max(s) (-1 without a memory), asked once per sequence: init reads it for
    the default positions and again for the consistency checks, and the memory does not change
    in between."""

    def __init__(self, memory) -> None:
        self.memory = memory
        self.known: dict[int, int] = {}

    def __call__(self, seq_id: int) -> int:
        p = self.known.get(seq_id)
        if p is None:
            p = self.known[seq_id] = self.memory.seq_pos_max(seq_id) if self.memory is not None else -1
        return p


class BatchAllocator:
    """Validates a batch against the vocab and memory, fills defaults, and splits it."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.tokens: np.ndarray | None = None
        self.embd: np.ndarray | None = None
        self.pos = _EMPTY_POS
        self.seq_ids: list[tuple[int, ...]] = []
        self.output = _EMPTY_OUTPUT
        self.n_outputs = 0
        self.has_cpl = False
        self.seq_sets: list[frozenset[int]] = []
        self.seq_set_map: dict[frozenset[int], list[int]] = {}
        self.seq_pos: dict[int, set[int]] = {}
        self.seq_id_unq: list[int] = []
        self.out_ids: list[int] = []
        self.n_used = 0
        self.used = _EMPTY_OUTPUT

    @property
    def n_tokens(self) -> int:
        return len(self.pos)

    def init(self, batch: Batch, n_vocab: int, memory, n_embd: int, n_seq_max: int, output_all: bool) -> None:
        """llama_batch_allocr::init: raise BatchError with llama.cpp's reason on a bad batch. The
        batch's fields are checked again first (they may have been replaced since it was made)."""
        self.clear()
        if n_seq_max > LLAMA_MAX_SEQ:
            raise BatchError(f"n_seq_max = {n_seq_max} > {LLAMA_MAX_SEQ}")
        fields = check_batch(batch)
        n = fields.n_tokens
        if n == 0:
            raise BatchError("n_tokens == 0")
        if fields.tokens is not None:
            tokens = fields.tokens
            lo, hi = _min_max(tokens)
            if lo < 0 or hi >= n_vocab:
                bad = int(np.flatnonzero((tokens < 0) | (tokens >= n_vocab))[0])
                raise BatchError(f"invalid token[{bad}] = {tokens[bad]} (n_vocab = {n_vocab})")
            self.tokens = tokens.astype(np.int32)
        else:
            if fields.embd.shape[1] != n_embd:
                raise BatchError(f"embd rows have {fields.embd.shape[1]} values, the model needs {n_embd}")
            self.embd = fields.embd
        seq_ids = fields.seq_ids if fields.seq_ids is not None else [(0,)] * n
        first = seq_ids[0]
        # one sequence set for every token (the same tuple: Batch.from_tokens): checked once
        single = n == 1 or all(ids is first for ids in seq_ids)
        for i, ids in enumerate((first,) if single else seq_ids):
            for s, sid in enumerate(ids):
                if sid < 0 or sid >= n_seq_max:
                    raise BatchError(f"invalid seq_id[{i}][{s}] = {sid} >= {n_seq_max}")
        if single:
            first = first if len(first) == 1 else tuple(dict.fromkeys(first))
            self.seq_ids = [first] * n
        else:
            self.seq_ids = [ids if len(ids) == 1 else tuple(dict.fromkeys(ids)) for ids in seq_ids]
        pos_max = _SeqPosMax(memory)
        pos = self._positions(fields.pos, pos_max)
        lo, hi = min(pos), max(pos)
        if lo < 0 or hi > POS_LIMIT:
            bad = next(i for i, p in enumerate(pos) if not 0 <= p <= POS_LIMIT)
            raise BatchError(f"invalid pos[{bad}] = {pos[bad]} (positions are 0..{POS_LIMIT})")
        self.pos = np.array(pos, dtype=np.int32)
        if fields.logits is None:
            self.output = np.zeros(n, dtype=bool)
            self.output[-1] = True
        else:
            self.output = fields.logits.copy()     # the batch's own array may change after decode
        n_outputs = int(np.count_nonzero(self.output)) if n > _SMALL else sum(self.output.tolist())
        if output_all and n_outputs != n:
            log.warning("embeddings required but some input tokens were not marked as outputs -> overriding")
            self.output = np.ones(n, dtype=bool)
            n_outputs = n
        self.n_outputs = n_outputs
        if single:
            self._stats_single(pos)
            self._check_single(memory, pos_max, pos)
        else:
            self._stats(pos)
            self._check_consistency(memory, pos_max, pos)
        self.split_reset()

    def _positions(self, given: np.ndarray | None, pos_max: _SeqPosMax) -> list[int]:
        if given is not None:
            return given.tolist()
        nxt: dict[int, int] = {}  # only the sequences the batch names (llama.cpp fills all n_seq_max)
        pos = []
        for ids in self.seq_ids:
            s = ids[0]
            if s not in nxt:
                nxt[s] = pos_max(s) + 1
            pos.append(nxt[s])
            nxt[s] += 1
        return pos

    def _stats_single(self, pos: list[int]) -> None:
        """_stats when every token has the same sequence set."""
        ids = self.seq_ids[0]
        positions = set(pos)
        self.seq_pos = {sid: set(positions) for sid in ids}
        self.seq_cpl = {(sid, ids[0]) for sid in ids[1:]}
        self.has_cpl = len(ids) > 1
        cur = frozenset(ids)
        self.seq_sets = [cur] * len(pos)
        self.seq_set_map = {cur: list(range(len(pos)))}
        self.seq_id_unq = sorted(ids)

    def _check_single(self, memory, pos_max: _SeqPosMax, pos: list[int]) -> None:
        """_check_consistency when every token has the same sequence set (so no set conflicts):
        the same checks in the same order, with the same messages."""
        self._check_seq_positions(memory, pos_max)
        for i in range(1, len(pos)):
            if pos[i] < pos[i - 1]:
                raise BatchError(f"sequence {self.seq_ids[0][0]} positions are decreasing (not allowed): token {i} has "
                                 f"pos {pos[i]} after pos {pos[i - 1]}")

    def _stats(self, pos: list[int]) -> None:
        self.seq_cpl: set[tuple[int, int]] = set()
        unique: set[int] = set()
        for i, ids in enumerate(self.seq_ids):
            for s, sid in enumerate(ids):
                self.seq_pos.setdefault(sid, set()).add(pos[i])
                if s > 0:
                    self.seq_cpl.add((sid, ids[0]))
                    self.has_cpl = True
            cur = frozenset(ids)
            self.seq_sets.append(cur)
            self.seq_set_map.setdefault(cur, []).append(i)
            unique.update(ids)
        self.seq_id_unq = sorted(unique)

    def seq_pos_min(self, s: int) -> int:
        return min(self.seq_pos[s]) if self.seq_pos.get(s) else -1

    def seq_pos_max(self, s: int) -> int:
        return max(self.seq_pos[s]) if self.seq_pos.get(s) else -1

    def _check_seq_positions(self, memory, pos_max: _SeqPosMax) -> None:
        """Each sequence continues what the memory holds, without gaps; coupled sequences have
        not diverged in the memory."""
        for s in sorted(self.seq_pos):
            p0 = pos_max(s)
            p_min, p_max = self.seq_pos_min(s), self.seq_pos_max(s)
            if p0 >= 0 and p_min != p0 + 1:
                raise BatchError(
                    f"the tokens of sequence {s} in the input batch have inconsistent sequence positions: the "
                    f"memory holds positions up to X = {p0}, the batch starts at Y = {p_min}; "
                    f"it is required that the sequence positions remain consecutive: Y = X + 1")
            if p_max - p_min + 1 > len(self.seq_pos[s]):
                raise BatchError(f"sequence {s} positions are not continuous")
        if memory is not None:
            for s1, s0 in sorted(self.seq_cpl):
                if (memory.seq_pos_min(s0) != memory.seq_pos_min(s1)
                        or pos_max(s0) != pos_max(s1)):
                    raise BatchError(f"sequence {s1} is coupled to {s0} in the input batch, but have diverged")

    def _check_consistency(self, memory, pos_max: _SeqPosMax, pos: list[int]) -> None:
        self._check_seq_positions(memory, pos_max)
        cur_set: dict[int, frozenset[int] | None] = {}
        cur_pos: dict[int, int] = {}
        for i, ids in enumerate(self.seq_ids):
            p = pos[i]
            for sid in ids:
                prev = cur_set.get(sid)
                cur_set[sid] = self.seq_sets[i] if prev is None else prev & self.seq_sets[i]
                if not cur_set[sid]:
                    raise BatchError(f"sequence {sid} belongs to incompatible sequence sets (not allowed)")
                if p < cur_pos.get(sid, -1):
                    raise BatchError(f"sequence {sid} positions are decreasing (not allowed): token {i} has "
                                     f"pos {p} after pos {cur_pos[sid]}")
                cur_pos[sid] = p

    # -- splits -----------------------------------------------------------------------------------
    def split_reset(self) -> None:
        self.out_ids: list[int] = []
        if self.n_used or len(self.used) != self.n_tokens:   # n_used == 0: no token is marked used
            self.n_used = 0
            self.used = np.zeros(self.n_tokens, dtype=bool)

    def split_simple(self, n_ubatch: int) -> UBatch | None:
        """The next unused tokens in batch order, at most n_ubatch."""
        if self.n_used == self.n_tokens:
            return None
        start = int(self.used.argmin()) if self.n_used else 0   # the first unused token
        stop = min(start + n_ubatch, self.n_tokens)
        return self._take(range(start, stop), n_seqs=stop - start, equal_seqs=False)

    def split_equal(self, n_ubatch: int, sequential: bool) -> UBatch | None:
        """Equal-length runs from non-overlapping sequence sets (what recurrent memory needs)."""
        if sequential and self.has_cpl:
            log.error("sequential split is not supported when there are coupled sequences in the input batch "
                      "(you may need to use the -kvu flag)")
            return None
        chosen: list[frozenset[int]] = []
        last_seq = -1
        for i in range(self.n_tokens):
            if self.used[i]:
                continue
            add = all(not (c & self.seq_sets[i]) for c in chosen)
            if sequential:
                add = add and (not chosen or self.seq_ids[i][0] == last_seq + 1)
            if add:
                chosen.append(self.seq_sets[i])
                last_seq = self.seq_ids[i][0]
                if len(chosen) > n_ubatch:
                    break
        if not chosen:
            return None
        cursors = []
        for c in chosen:
            members = self.seq_set_map[c]
            k = 0
            while self.used[members[k]]:
                k += 1
            cursors.append(k)
        per_seq: list[list[int]] = [[] for _ in chosen]
        while all(cursors[s] < len(self.seq_set_map[c]) for s, c in enumerate(chosen)):
            for s, c in enumerate(chosen):
                idx = self.seq_set_map[c][cursors[s]]
                per_seq[s].append(idx)
                self.used[idx] = True
                self.n_used += 1
                cursors[s] += 1
            if (len(per_seq[0]) + 1) * len(chosen) > n_ubatch:
                break
        idxs = [i for run in per_seq for i in run]
        return self._take(idxs, n_seqs=len(chosen), equal_seqs=True, mark=False)

    def split_seq(self, n_ubatch: int) -> UBatch | None:
        """A run starting at the first unused token, then tokens whose set is within the current one."""
        free = np.nonzero(~self.used)[0]
        if not len(free):
            return None
        cur = int(free[0])
        cur_set = self.seq_sets[cur]
        idxs = []
        while True:
            idxs.append(cur)
            self.used[cur] = True
            self.n_used += 1
            if len(idxs) >= n_ubatch:
                break
            cur += 1
            while cur < self.n_tokens and (self.used[cur] or not self.seq_sets[cur] <= cur_set):
                cur += 1
            if cur == self.n_tokens:
                break
            cur_set = self.seq_sets[cur]
        return self._take(idxs, n_seqs=1, equal_seqs=True, mark=False)

    def _take(self, idxs: list[int] | range, n_seqs: int, equal_seqs: bool, mark: bool = True) -> UBatch:
        """The ubatch of tokens `idxs`. A range (a contiguous run) is taken as views: the
        allocator's arrays are replaced, never written, by the next init."""
        if isinstance(idxs, range):
            sel = slice(idxs.start, idxs.stop)
            batch_idxs = np.arange(idxs.start, idxs.stop)
            seq_ids = self.seq_ids[sel]
        else:
            sel = batch_idxs = np.asarray(idxs, dtype=np.int64)
            seq_ids = [self.seq_ids[i] for i in idxs]
        if mark:
            self.used[sel] = True
            self.n_used += len(idxs)
        output = self.output[sel]
        if len(idxs) <= _SMALL:
            self.out_ids.extend(i for i, out in zip(batch_idxs.tolist(), output.tolist()) if out)
        else:
            self.out_ids.extend(batch_idxs[output].tolist())
        # every token of one sequence set (the allocator's stats know it): its ids, sorted
        unique = self.seq_id_unq if len(self.seq_sets) and len(self.seq_set_map) == 1 else \
            sorted({s for ids in seq_ids for s in ids})
        return UBatch(
            equal_seqs=equal_seqs, n_seq_tokens=len(idxs) // n_seqs, n_seqs=n_seqs,
            tokens=None if self.tokens is None else self.tokens[sel],
            embd=None if self.embd is None else self.embd[sel],
            pos=self.pos[sel], seq_ids=seq_ids, output=output, batch_idxs=batch_idxs,
            seq_id_unq=list(unique))


def ubatch_reserve(n_seq_tokens: int, n_seqs: int) -> UBatch:
    """The dummy equal-seqs ubatch used to reserve worst-case graphs (seq ids 0..n_seqs-1)."""
    n = n_seq_tokens * n_seqs
    return UBatch(equal_seqs=True, n_seq_tokens=n_seq_tokens, n_seqs=n_seqs,
                  tokens=np.zeros(n, dtype=np.int32), embd=None, pos=np.zeros(n, dtype=np.int32),
                  seq_ids=[(0,)] * n, output=np.zeros(n, dtype=bool), batch_idxs=np.arange(n),
                  seq_id_unq=list(range(n_seqs)))
