"""Mutated state blobs and files, checked against llama.cpp: the generator and the check shared by
tests/context/test_state_fuzz.py (hypothesis, bounded) and fuzz/fuzz_state.py (a timed run).

A case takes a good state of one of four kinds (whole blob, sequence blob, session file,
sequence file) from a source context, mutates it (bit flips, truncations, extensions, rewrites
of a parsed field: positions, seq ids, counts, types, sizes, versions) and loads it into a
victim context that holds something else. Then exactly one of:
- refused: StateError, and the victim is bit for bit as before (KV buffers, cells, heads,
  outputs, state bytes) and decodes its next tokens as a witness that never saw the case;
- loaded: llama.cpp, given the victim's state before the case, loads the same bytes too; both
  engines then hold the same state bytes and sequence ranges, and decode the same next token of
  every sequence to the same logits (bit for bit where the numerics are the oracle build's).
Any other exception is a failure. state_get_data() is called after every case.
"""

from __future__ import annotations

import random
import struct
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

import llamir
from llamir.context.state import (
    SESSION_MAGIC,
    SESSION_VERSION_WITH_OUTPUTS,
    STATE_SEQ_MAGIC,
    STATE_SEQ_VERSION,
    StateError,
)
from llamir.context.state_kv import caches_of
from llamir.testing.llama_cpp import LlamaCppOracle, oracle_numerics

KINDS = ("state", "seq", "session file", "seq file")
SOURCE = [int(t) for t in np.random.RandomState(11).randint(3, 500, size=21)]   # the source's sequence 0
OTHER = [int(t) for t in np.random.RandomState(12).randint(3, 500, size=6)]     # the source's sequence 1
BASE = [int(t) for t in np.random.RandomState(13).randint(3, 500, size=7)]      # the victim's sequence 0
HELD = [40, 41, 42, 43]                                                          # the victim's sequence 1
NEXT = 11
CAPACITY = 64
POS_LAST = 2**31 - 2      # the largest position a loaded state may hold; its next token cannot be decoded


# -- fields of a good state ------------------------------------------------------------------------
@dataclass(frozen=True)
class Field:
    """One integer of a state, where it lies and what it means."""

    offset: int
    fmt: str      # struct code: i, I or Q
    name: str
    cache: int = 0  # which cache of the memory (0 base, 1 SWA); 0 outside the memory too

    def read(self, data: bytes) -> int:
        return struct.unpack_from("<" + self.fmt, data, self.offset)[0]


class _Walker:
    def __init__(self, data: bytes, offset: int = 0):
        self.data, self.pos, self.fields, self.cache = data, offset, [], 0

    def take(self, fmt: str, name: str) -> int:
        f = Field(self.pos, fmt, name, self.cache)
        self.fields.append(f)
        self.pos += struct.calcsize("<" + fmt)
        return f.read(self.data)

    def skip(self, n: int) -> None:
        self.pos += n

    def memory(self, n_caches: int) -> None:
        for self.cache in range(n_caches):
            for _ in range(self.take("I", "n_stream")):
                count = self.take("I", "cell_count")
                if count:
                    self.stream(count)

    def stream(self, count: int) -> None:
        for _ in range(count):
            self.take("i", "pos")
            for _ in range(self.take("I", "n_seq_id")):
                self.take("i", "seq_id")
        v_trans = self.take("I", "v_trans")
        n_layer = self.take("I", "n_layer")
        for _ in range(n_layer):
            self.take("i", "k_type")
            self.skip(count * self.take("Q", "k_row_size"))
        for _ in range(n_layer):
            self.take("i", "v_type")
            if not v_trans:
                self.skip(count * self.take("Q", "v_row_size"))
            else:
                el = self.take("I", "v_el_size")
                self.skip(self.take("I", "v_gqa") * count * el)

    def file_header(self) -> None:
        self.take("I", "file_magic")
        self.take("I", "file_version")
        for _ in range(self.take("I", "n_tokens")):
            self.take("i", "token")


def fields_of(kind: str, data: bytes, n_caches: int) -> list[Field]:
    """Every integer field of a good state of `kind`, in order."""
    w = _Walker(data)
    if kind in ("session file", "seq file"):
        w.file_header()
    if kind in ("state", "session file"):
        w.skip(w.take("I", "arch_len"))
    if kind == "seq":
        w.take("I", "seq_magic")
        w.take("i", "src_seq_id")
    w.memory(n_caches)
    if w.pos != len(data):
        raise ValueError(f"walked {w.pos} of {len(data)} bytes of a good {kind} state")
    return w.fields


# -- mutations -------------------------------------------------------------------------------------
class Chooser(Protocol):
    """Where a case's choices come from: hypothesis (shrinkable) or a seeded random.Random."""

    def integer(self, lo: int, hi: int) -> int: ...


class RandomChooser:
    def __init__(self, rng: random.Random):
        self.rng = rng

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)


class HypothesisChooser:
    def __init__(self, data):
        from hypothesis import strategies as st

        self.data, self.st = data, st

    def integer(self, lo: int, hi: int) -> int:
        return self.data.draw(self.st.integers(lo, hi))


def _pick(choose: Chooser, options: Sequence):
    return options[choose.integer(0, len(options) - 1)]


_LIMITS = {"i": (-2**31, 2**31 - 1), "I": (0, 2**32 - 1), "Q": (0, 2**64 - 1)}


def _values(f: Field, value: int) -> list[int]:
    """Values worth writing into field f (which holds `value`): edges, neighbours, ids and sizes."""
    lo, hi = _LIMITS[f.fmt]
    near = [value - 1, value + 1, value + 2, value * 2, value // 2, 0, 1, 2, 3]
    edges = {"i": [-1, -2, -5, lo, hi, hi - 1, 255, 256, 257, 511, 512],
             "I": [255, 256, 257, 511, 512, 513, hi, 2**31],
             "Q": [hi, 2**63, 2**32]}[f.fmt]
    return sorted({v for v in near + edges if lo <= v <= hi})


@dataclass
class Case:
    kind: str
    dest_seq_id: int
    data: bytes
    steps: list[str] = field(default_factory=list)   # what was done, for reports


def draw_case(choose: Chooser, good: dict[str, bytes], fields: dict[str, list[Field]]) -> Case:
    """A good state of a drawn kind with 1 to 3 mutations."""
    kind = _pick(choose, KINDS)
    data = bytearray(good[kind])
    case = Case(kind, choose.integer(0, 1), b"")
    for _ in range(choose.integer(1, 3)):
        how = choose.integer(0, 9)
        if how <= 3:                                             # rewrite a field (most of what matters)
            f = _pick(choose, fields[kind])
            if f.offset + struct.calcsize("<" + f.fmt) > len(data):
                continue
            value = _pick(choose, _values(f, f.read(bytes(data))))
            if choose.integer(0, 4) == 0:
                value = choose.integer(*_LIMITS[f.fmt])
            struct.pack_into("<" + f.fmt, data, f.offset, value)
            case.steps.append(f"{f.name}@{f.offset} = {value}")
        elif how <= 6 and data:                                  # flip a bit anywhere
            at, bit = choose.integer(0, len(data) - 1), choose.integer(0, 7)
            data[at] ^= 1 << bit
            case.steps.append(f"flip byte {at} bit {bit}")
        elif how <= 8 and data:                                  # truncate
            n = choose.integer(0, len(data) - 1)
            del data[n:]
            case.steps.append(f"truncate to {n}")
        else:                                                    # extend
            extra = bytes(choose.integer(0, 255) for _ in range(choose.integer(1, 12)))
            data += extra
            case.steps.append(f"extend by {extra.hex()}")
    case.data = bytes(data)
    return case


# -- the check -------------------------------------------------------------------------------------
def snapshot(ctx) -> dict[str, object]:
    """Everything a failed load must leave as it was, as bytes."""
    caches = caches_of(ctx.memory)
    out = ctx.outputs
    return {
        "buffers": [(name, buf.tobytes()) for cache in caches for name, buf in cache.buffers.items()],
        "cells": [(c.pos.tobytes(), c.seq.tobytes(), c.shift.tobytes(), c.has_shift, c.get_used(), c.used_max_p1())
                  for cache in caches for c in cache.v_cells],
        "heads": [list(cache.v_heads) for cache in caches],
        "pending": [list(cache.pending_copies) for cache in caches],
        "outputs": (out.logits.tobytes(), out.embd.tobytes(), out.output_ids.tobytes(), out.n_outputs,
                    list(out.swaps), sorted((k, v.tobytes()) for k, v in out.embd_seq.items())),
        "state": ctx.state_get_data(),
    }


class CheckFailure(AssertionError):
    """A case broke the property; the message says how."""


@dataclass
class FuzzEnv:
    """A model, the context parameters both engines use, the good states and the witness."""

    name: str
    model_path: Path
    ctx_params: dict
    n_seq_max: int = 2
    exact: bool = True                  # the architecture computes as llama.cpp does, bit for bit
    tolerance: float = 1e-6             # NMSE allowed otherwise
    tmp: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="state-fuzz-")))

    def __post_init__(self) -> None:
        self.model = llamir.load_model(self.model_path)
        self.n_caches = len(caches_of(self._context().memory))
        oracle_kw = {k: v for k, v in self.ctx_params.items() if k in ("n_ctx", "type_k", "type_v", "kv_unified")}
        oracle_kw["flash_attn"] = self.ctx_params.get("flash_attn") == "on"
        self.oracle = LlamaCppOracle(self.model_path, n_seq_max=self.n_seq_max, **oracle_kw)
        source = self._context()
        self._decode(source, SOURCE, 0, 0, "all")
        self._decode(source, OTHER, 0, 1, "all")
        session, seq_file = self.tmp / "good-session.bin", self.tmp / "good-seq.bin"
        source.state_save_file(session, SOURCE)
        source.state_seq_save_file(seq_file, 0, SOURCE)
        self.good = {"state": source.state_get_data(), "seq": source.state_seq_get_data(0),
                     "session file": session.read_bytes(), "seq file": seq_file.read_bytes()}
        self.fields = {kind: fields_of(kind, data, self.n_caches) for kind, data in self.good.items()}
        witness = self.victim()
        self.before = snapshot(witness)
        self.witness_next = self._next_logits(witness)
        numerics_match = self._context().backend.interp.numerics == oracle_numerics()
        self.bit_exact = self.exact and numerics_match

    def close(self) -> None:
        self.oracle.close()

    def _context(self):
        return llamir.Context(self.model, **{"backend": "numpy", "n_seq_max": self.n_seq_max, **self.ctx_params})

    @staticmethod
    def _decode(ctx, tokens, pos0: int, seq_id: int, logits: str = "last") -> int:
        return ctx.decode(llamir.Batch.from_tokens(tokens, pos0=pos0, seq_id=seq_id, logits=logits))

    def victim(self):
        """A context holding BASE in sequence 0 and HELD in sequence 1, with their outputs."""
        ctx = self._context()
        if self._decode(ctx, BASE, 0, 0, "all") or self._decode(ctx, HELD, 0, 1, "all"):
            raise RuntimeError(f"{self.name}: the victim's decodes failed: {ctx.last_error}")
        return ctx

    def _next_logits(self, ctx) -> list[tuple[int, int, np.ndarray | None]]:
        """Per sequence: (its last position, the decode status of NEXT after it, the logits)."""
        out = []
        for seq_id in range(self.n_seq_max):
            p = ctx.memory.seq_pos_max(seq_id)
            if p >= POS_LAST:
                out.append((p, None, None))
                continue
            status = self._decode(ctx, [NEXT], p + 1, seq_id)
            out.append((p, status, ctx.get_logits_ith(-1).copy() if status == 0 else None))
        return out

    # -- one case ---------------------------------------------------------------------------------
    def load(self, ctx, case: Case) -> None:
        path = self.tmp / "case.bin"
        if case.kind == "state":
            ctx.state_set_data(case.data)
        elif case.kind == "seq":
            ctx.state_seq_set_data(case.data, case.dest_seq_id)
        else:
            path.write_bytes(case.data)
            if case.kind == "session file":
                ctx.state_load_file(path, CAPACITY)
            else:
                ctx.state_seq_load_file(path, case.dest_seq_id, CAPACITY)

    def check(self, case: Case) -> str:
        """Run one case: 'refused', 'loaded', or 'loaded, NaN in KV' (see KNOWN_NAN_DIFFERENCE);
        CheckFailure when the property does not hold."""
        victim = self.victim()
        try:
            self.load(victim, case)
        except StateError as err:
            self._check_untouched(victim, case, err)
            return "refused"
        return self._check_like_llama_cpp(victim, case)

    def _fail(self, case: Case, what: str) -> None:
        raise CheckFailure(f"{self.name}, {case.kind} into seq {case.dest_seq_id} after "
                           f"{'; '.join(case.steps) or 'no change'}: {what}")

    def _check_untouched(self, victim, case: Case, err: StateError) -> None:
        after = snapshot(victim)
        for key, value in self.before.items():
            if after[key] != value:
                self._fail(case, f"refused ({err}) but changed the context's {key}")
        got = self._next_logits(victim)
        for (p, status, logits), (wp, wstatus, wlogits) in zip(got, self.witness_next):
            if (p, status) != (wp, wstatus) or (logits is not None and logits.tobytes() != wlogits.tobytes()):
                self._fail(case, f"refused ({err}) but the next decode differs from the witness's")

    def _oracle_load(self, case: Case) -> bool:
        o = self.oracle
        if o.state_set_data(self.before["state"]) != len(self.before["state"]):
            raise RuntimeError("llama.cpp refused the victim's own state")
        if case.kind in ("seq", "seq file"):
            # llamir empties dest_seq_id even for a state without cells, llama.cpp keeps it then
            o.seq_rm(case.dest_seq_id, -1, -1)
        data = case.data
        if case.kind in ("session file", "seq file"):
            magic, version = struct.unpack_from("<II", data)
            if (magic, version) == (SESSION_MAGIC, SESSION_VERSION_WITH_OUTPUTS):
                self._fail(case, "a version 9 session file (llamir's older layout) loaded; llama.cpp cannot "
                                 "say what it should hold")
            if (magic, version) == (STATE_SEQ_MAGIC, 2):     # llamir's older sequence files: the same layout
                data = struct.pack("<II", magic, STATE_SEQ_VERSION) + data[8:]
        path = self.tmp / "oracle-case.bin"
        if case.kind == "state":
            return o.state_set_data(data) != 0
        if case.kind == "seq":
            return o.state_seq_set_data(data, case.dest_seq_id) != 0
        path.write_bytes(data)
        if case.kind == "session file":
            return o.state_load_file(path, CAPACITY) is not None
        return o.state_seq_load_file(path, case.dest_seq_id, CAPACITY) is not None

    def _check_like_llama_cpp(self, victim, case: Case) -> str:
        if not self._oracle_load(case):
            self._fail(case, "llamir loaded what llama.cpp refuses")
        o = self.oracle
        if victim.state_get_data() != o.state_get_data():
            self._fail(case, "loaded, but the state bytes differ from llama.cpp's after the same load")
        ranges = [(victim.memory.seq_pos_min(s), victim.memory.seq_pos_max(s)) for s in range(self.n_seq_max)]
        theirs = [(o.seq_pos_min(s), o.seq_pos_max(s)) for s in range(self.n_seq_max)]
        if ranges != theirs:
            self._fail(case, f"loaded, but the sequences span {ranges}, llama.cpp's {theirs}")
        nan_in_kv = _kv_holds_nan(victim)
        outcome = "loaded"
        for seq_id, (p, status, logits) in enumerate(self._next_logits(victim)):
            if status is None:
                continue
            want_status = o.decode([NEXT], pos0=p + 1, seq_id=seq_id)
            if status != want_status:
                self._fail(case, f"seq {seq_id}: decode returned {status}, llama.cpp's {want_status}")
            if status != 0:
                continue
            theirs = o.logits_ith(-1)
            if nan_in_kv and np.isnan(logits).all() and np.isfinite(theirs).all():
                outcome = "loaded, NaN in KV"       # KNOWN_NAN_DIFFERENCE
                continue
            self._compare_logits(case, seq_id, logits, theirs)
        return outcome

    def _compare_logits(self, case: Case, seq_id: int, ours: np.ndarray, theirs: np.ndarray) -> None:
        if self.bit_exact:
            if not np.array_equal(ours, theirs, equal_nan=True):
                self._fail(case, f"seq {seq_id}: the next logits differ from llama.cpp's (bit-exact expected)")
            return
        finite = np.isfinite(theirs)
        if not np.array_equal(np.isfinite(ours), finite) or not np.array_equal(ours[~finite], theirs[~finite],
                                                                                 equal_nan=True):
            self._fail(case, f"seq {seq_id}: the next logits' NaN/inf differ from llama.cpp's")
        a, b = ours[finite].astype(np.float64), theirs[finite].astype(np.float64)
        ref = float(np.sum(b * b))
        err = float(np.sum((a - b) ** 2)) / ref if ref else float(np.sum(a * a))
        if err > self.tolerance:
            self._fail(case, f"seq {seq_id}: the next logits are {err:.3g} NMSE from llama.cpp's")


KNOWN_NAN_DIFFERENCE = """\
A loaded state may hold a NaN in its K/V rows (a flipped exponent bit). When a NaN V element
reaches the attention output, llama.cpp's next logits stay finite and llamir's are all NaN: the
output projection's q8_0 activation quantizer (ggml-cpu's AVX quantize_row_q8_0) takes amax with
maxps, which drops a NaN lane, and turns the NaN into -128 (cvtps_epi32 gives INT_MIN, packs
saturate), where llamir.ir.quants._q8_x86 lets the NaN through. That is an arithmetic difference
of the quantizer, not of the state: such cases still check the state bytes, the sequence ranges
and the decode status against llama.cpp, and are counted apart."""


def _kv_holds_nan(ctx) -> bool:
    return any(buf.dtype.kind == "f" and bool(np.isnan(buf).any())
               for cache in caches_of(ctx.memory) for buf in cache.buffers.values())


def standard_envs(model_dir: Path) -> dict[str, callable]:
    """The contexts the fuzzing covers, as makers: a llama model with a non-unified cache and a
    transposed V, the same with a unified cache and flash attention (V by rows), and gemma3's
    two caches (iSWA)."""
    from llamir.frontend.synth import SynthSpec, write_model

    def path(name: str, spec: SynthSpec) -> Path:
        p = model_dir / f"{name}.gguf"
        if not p.exists():
            write_model(p, spec)
        return p

    llama = SynthSpec(arch="llama", dtype="q8_0", n_layer=2, seed=21)
    gemma = SynthSpec(arch="gemma3", n_layer=2, swa_pattern=2, sliding_window=8, seed=22)
    common = {"n_ctx": 512, "type_k": "f16", "type_v": "f16"}
    return {
        "llama-streams": lambda: FuzzEnv("llama-streams", path("llama", llama), {**common, "flash_attn": "off"}),
        "llama-unified-fa": lambda: FuzzEnv("llama-unified-fa", path("llama", llama),
                                            {**common, "flash_attn": "on", "kv_unified": True}),
        "gemma3-iswa": lambda: FuzzEnv("gemma3-iswa", path("gemma3", gemma), {**common, "flash_attn": "off"},
                                       exact=False),
    }
