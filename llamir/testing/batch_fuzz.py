"""Valid, invalid and failing batches and sequence operations, checked against a witness context:
the programs and the check shared by tests/context/test_batch_fuzz.py (hypothesis, bounded) and
fuzz/fuzz_batch.py (a timed run that keeps its failing cases).

A program is a list of JSON-able operations run on a subject context and, where they succeed, on
a witness context of the same parameters that never sees what the subject refuses:
- ("decode", parts, interleave, logits, seed, corrupt, fault): tokens for each part (a tuple of
  sequence ids and a count) continuing what the memory holds, interleaved or one part after the
  other, maybe corrupted after the Batch was made (a field replaced or an entry changed) and
  maybe with a fault injected into the subject's ubatch loop (a backend error, out of memory,
  an internal error after the outputs were written, an error right after cells were taken);
- ("seq", name, *args): a memory sequence operation, valid or not;
- ("fill", seq_id, n): n tokens into a sequence, n_batch at a time (to wrap a sliding window).
After every operation exactly one of:
- accepted (0): the witness, given the same batch or call, accepts it too, and gives the same
  logits bit for bit;
- refused (any other status, or SeqOpError from a sequence operation): the subject's memory
  (every cell, head, pending shift), outputs and state bytes are as before, and the status is the
  one the corruption or fault calls for.
Any exception out of decode is a failure. Subject and witness hold the same state bytes after
every operation, and a last decode on each sequence gives both the same logits.
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

import llamir
from llamir.backends import BackendError
from llamir.context.batch import POS_LIMIT
from llamir.context.kv_cache import SeqOpError

# corruption kind -> (the status it must give, a word the error must name); None: it may turn out valid
CORRUPTIONS: dict[str, tuple[int, str] | None] = {
    "token_past_vocab": (-1, "token"), "token_negative": (-1, "token"), "token_float": (-1, "token"),
    "token_2**63": (-1, "token"), "tokens_str": (-1, "tokens"), "tokens_2d": (-1, "tokens"),
    "tokens_none": (-1, "tokens and embd"), "pos_negative": (-1, "pos"), "pos_past_int32": (-1, "pos"),
    "pos_limit": (-1, "pos"), "pos_float": (-1, "pos"), "pos_short": (-1, "positions"),
    "pos_scalar": (-1, "pos"), "seq_past_max": (-1, "seq_id"), "seq_negative": (-1, "seq_id"),
    "seq_empty": (-1, "seq_ids"), "seq_short": (-1, "seq_id lists"), "seq_str": (-1, "seq_ids"),
    "seq_2**63": (-1, "seq_ids"), "logits_str": (-1, "logits"), "logits_2": (-1, "logits"),
    "logits_short": (-1, "logits"), "too_many_tokens": (-1, "n_batch"), "not_a_batch": (-1, "Batch"),
    "embd_width": (-1, "embd"), "pos_gap": None, "pos_start": None, "pos_swap": None, "seq_couple": None,
}
# fault kind -> the status it must give when it fires
FAULTS = {"run_error": -3, "run_oom": -2, "extract_error": -3, "apply_error": -3}
SEQ_CALLS = ("seq_rm", "seq_cp", "seq_keep", "seq_add", "seq_div", "seq_pos_min", "seq_pos_max")


@dataclass(frozen=True)
class FuzzConfig:
    """A model and the context parameters both contexts are made with."""

    name: str
    arch: str
    params: tuple[tuple[str, object], ...]
    sliding_window: int | None = None

    @property
    def kwargs(self) -> dict:
        return dict(self.params)


CONFIGS = {
    "unified": FuzzConfig("unified", "llama", (("n_ctx", 256), ("n_batch", 32), ("n_ubatch", 8), ("n_seq_max", 3),
                                               ("kv_unified", True))),
    "streams": FuzzConfig("streams", "llama", (("n_ctx", 512), ("n_batch", 32), ("n_ubatch", 8), ("n_seq_max", 2),
                                               ("kv_unified", False))),
    "iswa": FuzzConfig("iswa", "gemma3", (("n_ctx", 512), ("n_batch", 64), ("n_ubatch", 16), ("n_seq_max", 2),
                                          ("kv_unified", True), ("swa_full", False)), sliding_window=6),
}


def write_config_model(config: FuzzConfig, directory) -> llamir.Model:
    from llamir.frontend.synth import SynthSpec, write_model

    spec = SynthSpec(arch=config.arch, n_layer=2 if config.arch == "gemma3" else 1, n_embd=32, n_head=2, n_head_kv=1,
                     n_ff=32, sliding_window=config.sliding_window, swa_pattern=2)
    return llamir.load_model(write_model(f"{directory}/{config.name}.gguf", spec))


class Failure(AssertionError):
    """An invariant did not hold; the message names the operation."""


# -- the two contexts --------------------------------------------------------------------------------
class BatchFuzzer:
    """A subject and a witness context over one model; run(program) checks every operation."""

    def __init__(self, model: llamir.Model, config: FuzzConfig, backend: str = "llvm"):
        self.model, self.config = model, config
        params = {"flash_attn": "off", **config.kwargs}
        self.subject = llamir.Context(model, backend=backend, **params)
        self.witness = llamir.Context(model, backend=backend, **params)
        self.n_seq_max = self.subject.n_seq_max
        self.n_seq_ids = 256 if self.subject.cparams.kv_unified else self.n_seq_max   # valid ids for seq ops
        self.counts = {"accepted": 0, "refused": 0, "faults fired": 0}

    def reset(self) -> None:
        """Both contexts as new (their compiled graphs kept): a program replays on its own."""
        from llamir.context.outputs import Outputs

        hp = self.model.hparams
        for ctx in (self.subject, self.witness):
            ctx.memory.clear(True)
            cp = ctx.cparams
            ctx.outputs = Outputs(hp.n_vocab, hp.n_embd, cp.n_batch, cp.n_seq_max, has_embd=cp.embeddings)
            ctx.abort_callback = None

    def run(self, program: list) -> None:
        """Reset both contexts, run every operation, then decode one token on every sequence."""
        self.reset()
        for i, op in enumerate(program):
            try:
                getattr(self, "_" + op[0])(*op[1:])
                self._same_state()
            except Failure as err:
                raise Failure(f"operation {i} {op!r}: {err}") from None
        for s in range(self.n_seq_max):
            try:
                self._decode([[(s,), 1]], False, "last", 0, None, None)
            except Failure as err:
                raise Failure(f"final decode on sequence {s}: {err}") from None

    # -- decode ---------------------------------------------------------------------------------
    def _decode(self, parts, interleave, logits, seed, corrupt, fault) -> None:
        pending = self.subject.memory.has_pending_update()
        before = _snapshot(self.subject)
        with self._fault(fault) as fired:
            status = self.subject.decode(self._batch(self.subject, parts, interleave, logits, seed, corrupt))
        expect = CORRUPTIONS.get(corrupt[0]) if corrupt else None
        if fired:
            self.counts["faults fired"] += 1
            _require(status == FAULTS[fault[0]], f"fault {fault} gave {status}, not {FAULTS[fault[0]]}: "
                     f"{self.subject.last_error}")
        elif expect is not None:
            _require(status == expect[0], f"corruption {corrupt} gave {status}: {self.subject.last_error}")
            _require(expect[1] in self.subject.last_error, f"{self.subject.last_error!r} names no {expect[1]!r}")
        else:
            _require(status in (0, 1, -1), f"status {status}: {self.subject.last_error}")
        if status != 0:
            self.counts["refused"] += 1
            if pending and not self.subject.memory.has_pending_update():
                # decode applies pending K-shifts and stream copies first, as llama.cpp's does, and they
                # stay (they change no logits): the rest is as before, that is as the witness once updated
                self.witness.memory_update()
                self._same_state()
                _require(_snapshot(self.subject)[2:] == before[2:], f"status {status} changed the outputs")
            else:
                _require(_snapshot(self.subject) == before, f"status {status} changed the subject")
            return
        self.counts["accepted"] += 1
        wstatus = self.witness.decode(self._batch(self.witness, parts, interleave, logits, seed, corrupt))
        _require(wstatus == 0, f"the witness gave {wstatus} ({self.witness.last_error}) for a batch the subject took")
        mine, theirs = _outputs(self.subject), _outputs(self.witness)
        _require(mine[0] == theirs[0] and np.array_equal(mine[1], theirs[1], equal_nan=True),
                 "the outputs differ from the witness's")

    def _batch(self, ctx, parts, interleave, logits, seed, corrupt):
        """The batch an operation describes, positions continuing ctx's memory."""
        rng = random.Random(seed)
        nxt: dict[int, int] = {}
        runs = []
        for ids, n in parts:
            ids = tuple(ids)
            first = ids[0]
            start = nxt.get(first, ctx.memory.seq_pos_max(first) + 1)
            nxt[first] = start + n
            runs.append([(rng.randrange(3, self.model.hparams.n_vocab), start + k, ids) for k in range(n)])
        if corrupt and corrupt[0] == "too_many_tokens":
            ids = runs[0][0][2][:1] if runs and runs[0] else (0,)     # one sequence: nothing else to refuse
            start = ctx.memory.seq_pos_max(ids[0]) + 1
            runs = [[(rng.randrange(3, 500), start + k, ids) for k in range(self.subject.n_batch + 1)]]
        order = _interleave(runs) if interleave else [t for run in runs for t in run]
        if not order:
            order = [(1, ctx.memory.seq_pos_max(0) + 1, (0,))]
        n = len(order)
        if logits in ("last", "all", "none"):
            flags = [logits == "all" or (logits == "last" and i == n - 1) for i in range(n)]
        else:
            flags = [bool(rng.getrandbits(1)) for _ in range(n)]
        batch = llamir.Batch(tokens=[t for t, _, _ in order], pos=[p for _, p, _ in order],
                             seq_ids=[ids for _, _, ids in order], logits=flags)
        return self._corrupt(batch, corrupt, rng) if corrupt else batch

    def _corrupt(self, batch, corrupt, rng):
        kind, arg = corrupt
        n = len(batch.tokens)
        i = arg % n
        tokens, pos = batch.tokens.tolist(), batch.pos.tolist()
        seq_ids, flags = list(batch.seq_ids), batch.logits.tolist()
        n_vocab = self.model.hparams.n_vocab
        if kind == "token_past_vocab":
            tokens[i] = n_vocab + arg % 1000
        elif kind == "token_negative":
            tokens[i] = -1 - arg % 1000
        elif kind == "token_float":
            tokens[i] = tokens[i] + 0.5
        elif kind == "token_2**63":
            tokens[i] = 2**63 + arg
        elif kind == "tokens_str":
            tokens = "".join(map(str, tokens))
        elif kind == "tokens_2d":
            tokens = np.array(tokens * 2).reshape(2, n)
        elif kind == "tokens_none":
            tokens = None
        elif kind == "pos_negative":
            pos[i] = -1 - arg % 5
        elif kind == "pos_past_int32":
            pos[i] = 2**31 + arg % 7
        elif kind == "pos_limit":
            pos[i] = POS_LIMIT + 1
        elif kind == "pos_float":
            pos[i] = float(pos[i])
        elif kind == "pos_short":
            pos = pos[:-1]
        elif kind == "pos_scalar":
            pos = pos[0]
        elif kind == "pos_gap":
            pos[i] += 1 + arg % 3
        elif kind == "pos_start":
            pos = [p + 1 + arg % 4 for p in pos]
        elif kind == "pos_swap":
            j = rng.randrange(n)
            pos[i], pos[j] = pos[j], pos[i]
        elif kind == "seq_past_max":
            seq_ids[i] = (*seq_ids[i], self.n_seq_ids + arg % 3)
        elif kind == "seq_negative":
            seq_ids[i] = (-1 - arg % 3,)
        elif kind == "seq_empty":
            seq_ids[i] = ()
        elif kind == "seq_short":
            seq_ids = seq_ids[:-1]
        elif kind == "seq_str":
            seq_ids[i] = str(seq_ids[i][0])
        elif kind == "seq_2**63":
            seq_ids[i] = (2**63 + arg,)
        elif kind == "seq_couple":
            seq_ids[i] = (*seq_ids[i], arg % self.n_seq_max)
        elif kind == "logits_str":
            flags[i] = str(flags[i])
        elif kind == "logits_2":
            flags[i] = 2 + arg % 3
        elif kind == "logits_short":
            flags = flags[:-1]
        elif kind == "not_a_batch":
            return tokens
        elif kind == "embd_width":
            return llamir.Batch(embd=np.zeros((n, self.model.hparams.n_embd + 1 + arg % 3), np.float32))
        elif kind != "too_many_tokens":
            raise ValueError(f"unknown corruption {kind!r}")
        batch.tokens, batch.pos, batch.seq_ids, batch.logits = tokens, pos, seq_ids, flags   # after construction
        return batch

    @contextmanager
    def _fault(self, fault):
        """Make the subject fail at its k-th call of one step of decode; yields [] that is
        non-empty once the fault fired."""
        fired: list[int] = []
        if not fault:
            yield fired
            return
        kind, k = fault
        ctx = self.subject
        calls = [0]

        def at_k() -> bool:
            calls[0] += 1
            if calls[0] == k + 1:
                fired.append(1)
                return True
            return False

        if kind in ("run_error", "run_oom"):
            target, name = ctx.runner, "run"
        elif kind == "extract_error":
            target, name = ctx, "_extract"
        else:
            target, name = getattr(ctx.memory, "base", ctx.memory), "apply_ubatch"
        original = getattr(target, name)

        def faulty(*args, **kwargs):
            if kind == "run_error" and at_k():
                raise BackendError("kernel get_rows: row index 99999 out of range (injected)")
            if kind == "run_oom" and at_k():
                raise MemoryError("injected")
            out = original(*args, **kwargs)
            if kind in ("extract_error", "apply_error") and at_k():   # after the step did its work
                raise (TypeError if kind == "extract_error" else ValueError)(f"injected after {name}")
            return out

        setattr(target, name, faulty)
        try:
            yield fired
        finally:
            delattr(target, name)

    # -- sequence operations and fills ----------------------------------------------------------
    def _seq(self, name, *args) -> None:
        before = _snapshot(self.subject)
        try:
            got = getattr(self.subject.memory, name)(*args)
        except SeqOpError:
            self.counts["refused"] += 1
            _require(_snapshot(self.subject) == before, f"a refused {name} changed the memory")
            return
        self.counts["accepted"] += 1
        want = getattr(self.witness.memory, name)(*args)
        _require(got == want, f"{name} returned {got} for the subject, {want} for the witness")

    def _fill(self, seq_id, n) -> None:
        n_batch = self.subject.n_batch
        for start in range(0, n, n_batch):
            self._decode([[(seq_id,), min(n_batch, n - start)]], False, "last", start, None, None)

    def _same_state(self) -> None:
        _require(_memory(self.subject) == _memory(self.witness), "the memory differs from the witness's")
        _require(self.subject.state_get_data() == self.witness.state_get_data(),
                 "the state bytes differ from the witness's")


# -- snapshots -----------------------------------------------------------------------------------------
def _memory(ctx) -> tuple:
    """Every cell's position, sequences and pending shift, and the heads, of every cache."""
    out = []
    for cache in ctx.memory.caches:
        out.append(tuple(cache.v_heads))
        for cells in cache.v_cells:
            out.append((cells.pos.tobytes(), cells.seq.tobytes(), cells.shift.tobytes(), cells.has_shift,
                        cells.get_used(), cells.used_max_p1()))
    return tuple(out)


def _outputs(ctx) -> tuple:
    n = ctx.n_outputs
    rows = ctx.get_logits()[:n].copy() if n else np.zeros((0, 0), np.float32)
    ids = tuple(ctx.outputs.output_ids.tolist())
    return (n, ids), rows


def _snapshot(ctx) -> tuple:
    """What a refused operation must leave as it was: the memory, the K/V data of used cells (the
    state bytes), the outputs."""
    (meta, rows) = _outputs(ctx)
    return _memory(ctx), ctx.state_get_data(), meta, rows.tobytes()


def _interleave(runs: list[list]) -> list:
    out = []
    for k in range(max((len(r) for r in runs), default=0)):
        out += [r[k] for r in runs if k < len(r)]
    return out


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise Failure(message)


# -- random programs (the timed fuzzer; the test suite draws them with hypothesis) ----------------------
def random_program(rng: random.Random, fuzzer: BatchFuzzer, max_ops: int = 8) -> list:
    return [random_op(rng, fuzzer) for _ in range(rng.randint(1, max_ops))]


def random_op(rng: random.Random, fuzzer: BatchFuzzer) -> tuple:
    roll = rng.random()
    n_seq = fuzzer.n_seq_max
    if roll < 0.55:
        parts = []
        for _ in range(rng.randint(1, 3)):
            first = rng.randrange(n_seq)
            ids = (first,)
            if fuzzer.subject.cparams.kv_unified and rng.random() < 0.2:
                ids = (first, *rng.sample(range(n_seq), rng.randint(1, n_seq)))
            parts.append([ids, rng.choice([1, 1, 2, 3, rng.randint(1, fuzzer.subject.n_batch)])])
        trouble = rng.random()
        corrupt = [rng.choice(list(CORRUPTIONS)), rng.randrange(1000)] if trouble < 0.4 else None
        fault = [rng.choice(list(FAULTS)), rng.choice([0, 0, 1, 2])] if 0.4 <= trouble < 0.7 else None
        logits = rng.choice(["last", "all", "none", "random"])
        return ("decode", parts, rng.random() < 0.5, logits, rng.randrange(2**16), corrupt, fault)
    if roll < 0.7 and fuzzer.config.sliding_window:    # past the window cache's size: reused cells
        return ("fill", rng.randrange(n_seq), rng.randint(1, 300))
    name = rng.choice(SEQ_CALLS)
    seq = rng.choice([rng.randrange(n_seq), rng.randrange(n_seq), -1, -2, fuzzer.n_seq_ids, 2**63, "0"])
    pos = lambda: rng.choice([-1, rng.randint(0, 40), rng.randint(0, 40), 2**31])   # noqa: E731
    if name in ("seq_pos_min", "seq_pos_max", "seq_keep"):
        return ("seq", name, seq)
    if name == "seq_rm":
        return ("seq", name, seq, pos(), pos())
    if name == "seq_cp":
        return ("seq", name, seq, rng.choice([rng.randrange(n_seq), seq, 256]), rng.choice([-1, -1, 3]), -1)
    if name == "seq_add":
        return ("seq", name, seq, pos(), pos(), rng.choice([rng.randint(-8, 8), 2**31 - 1, 2**40]))
    return ("seq", name, seq, pos(), pos(), rng.choice([1, 2, 3, 0, -2]))
