"""State interop with llama.cpp (llama-cpp-python 0.3.36): what one engine saves, the other loads.

Each case decodes a prompt in one engine, moves its state to the other (a session file, a
sequence file, a whole-context blob or a sequence blob), and decodes one more token on both
sides: the logits must agree (bit for bit where llamir's reference runs the oracle build's
numerics profile, within 1e-6 NMSE otherwise), the tokens stored in a file must come back, and
the loaded state must serialise again to the bytes that were loaded. llamir's older files
(session version 9 with outputs, sequence version 2) are built from llama.cpp's state and must
still load into llamir, which llama.cpp refuses.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import llamir
from llamir.frontend.synth import SynthSpec, write_model
from llamir.testing.llama_cpp import LlamaCppOracle, nmse, oracle_numerics

pytestmark = pytest.mark.llama_cpp

SESSION_MAGIC, SEQ_FILE_MAGIC, SEQ_BLOB_MAGIC = 0x6767736E, 0x67677371, 0xAF143CD8  # 'ggsn', 'ggsq', io_magic
TOKENS = [int(t) for t in np.random.RandomState(3).randint(3, 500, size=21)]
OTHER = [int(t) for t in np.random.RandomState(4).randint(3, 500, size=6)]    # what the destination held
NEXT = 11
N_CTX, N_SEQ = 512, 2       # two sequences, a stream each: 256 cells per stream in both engines


@dataclass(frozen=True)
class Case:
    spec: SynthSpec
    type_kv: str
    flash_attn: bool
    exact_arch: bool = True   # llamir computes this architecture as llama.cpp does, bit for bit


F16_LLAMA = SynthSpec(arch="llama", dtype="f16", n_layer=2, n_head_kv=2, seed=5)
CASES = {
    "f16-kv": Case(F16_LLAMA, "f16", False),                 # V transposed in the cache
    "f16-kv-flash-attn": Case(F16_LLAMA, "f16", True),       # V by rows
    "f32-kv": Case(F16_LLAMA, "f32", False),
    "q4_0-weights": Case(SynthSpec(arch="qwen3", dtype="q4_0", n_layer=2, n_head_kv=2, seed=6), "f16", False),
    # two caches (full and sliding window); llamir's gemma3 is within 1e-7 NMSE of llama.cpp, not exact
    "gemma3-iswa": Case(SynthSpec(arch="gemma3", n_layer=7, sliding_window=8, seed=7), "f16", False,
                        exact_arch=False),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("state_interop")


def _model_path(model_dir: Path, case: Case) -> Path:
    path = model_dir / f"{case.spec.arch}-{case.spec.dtype}-{case.spec.seed}.gguf"
    if not path.exists():
        write_model(path, case.spec)
    return path


class Llamir:
    """llamir's Context on the numpy reference, with the oracle's thread count."""

    def __init__(self, path: Path, case: Case):
        self.ctx = llamir.Context(llamir.load_model(path), backend="numpy", n_threads=2, n_ctx=N_CTX,
                                  n_seq_max=N_SEQ, type_k=case.type_kv, type_v=case.type_kv,
                                  flash_attn="on" if case.flash_attn else "off")
        self.state = self.ctx          # state_* calls with llama.cpp's names
        self.exact = case.exact_arch and self.ctx.backend.interp.numerics == oracle_numerics()

    def last_logits(self, tokens, pos0: int, seq_id: int) -> np.ndarray:
        assert self.ctx.decode(llamir.Batch.from_tokens(tokens, pos0=pos0, seq_id=seq_id)) == 0, self.ctx.last_error
        return self.ctx.get_logits_ith(-1).copy()

    def seq_pos_max(self, seq_id: int) -> int:
        return self.ctx.memory.seq_pos_max(seq_id)

    def close(self) -> None:
        pass


class LlamaCpp:
    """llama.cpp with the same context parameters."""

    def __init__(self, path: Path, case: Case):
        self.state = LlamaCppOracle(path, n_ctx=N_CTX, n_seq_max=N_SEQ, type_k=case.type_kv, type_v=case.type_kv,
                                    flash_attn=case.flash_attn)

    def last_logits(self, tokens, pos0: int, seq_id: int) -> np.ndarray:
        assert self.state.decode(tokens, pos0=pos0, seq_id=seq_id) == 0
        return self.state.logits_ith(-1)

    def seq_pos_max(self, seq_id: int) -> int:
        return self.state.seq_pos_max(seq_id)

    def close(self) -> None:
        self.state.close()


@pytest.fixture
def engines(model_dir):
    opened = []

    def make(kind: str, case: Case):
        engine = (Llamir if kind == "llamir" else LlamaCpp)(_model_path(model_dir, case), case)
        opened.append(engine)
        return engine

    yield make
    for engine in opened:
        engine.close()


def assert_logits_agree(ours: np.ndarray, llama_cpps: np.ndarray, engine: Llamir) -> None:
    """Identical when llamir computes as the oracle build does (same numerics profile, an exact
    architecture), else within 1e-6 NMSE."""
    err = nmse(ours, llama_cpps)
    if engine.exact:
        assert err == 0.0, f"NMSE {err:.3g}: not bit-exact with llama.cpp ({oracle_numerics()} on both sides)"
    else:
        assert err <= 1e-6, f"NMSE {err:.3g} (numerics {engine.ctx.backend.interp.numerics}, "\
                            f"the oracle's {oracle_numerics()})"


def file_header(path: Path) -> tuple[int, int, list[int]]:
    data = path.read_bytes()
    magic, version, n = struct.unpack_from("<III", data)
    return magic, version, np.frombuffer(data[12:12 + 4 * n], dtype="<i4").tolist()


def move_state(what: str, src, dst, tmp_path: Path, dest_seq: int = 0) -> bytes:
    """Save sequence 0's state (or the whole context's) in `src` and load it in `dst` (a sequence
    into `dest_seq`); returns the memory bytes that were moved."""
    path = tmp_path / "state.bin"
    if what == "session file":
        src.state.state_save_file(path, TOKENS)
        assert file_header(path) == (SESSION_MAGIC, 10, TOKENS)
        assert dst.state.state_load_file(path, 64) == TOKENS
        return path.read_bytes()[12 + 4 * len(TOKENS):]
    if what == "sequence file":
        src.state.state_seq_save_file(path, 0, TOKENS)
        assert file_header(path) == (SEQ_FILE_MAGIC, 3, TOKENS)
        assert dst.state.state_seq_load_file(path, dest_seq, 64) == TOKENS
        return path.read_bytes()[12 + 4 * len(TOKENS):]
    if what == "state blob":
        blob = src.state.state_get_data()
        assert dst.state.state_set_data(blob) == len(blob)
        return blob
    blob = src.state.state_seq_get_data(0)
    assert struct.unpack_from("<Ii", blob) == (SEQ_BLOB_MAGIC, 0)
    assert dst.state.state_seq_set_data(blob, dest_seq) == len(blob)
    return blob[8:]


def assert_next_logits_agree(src, dst, dest_seq: int) -> None:
    """Both engines decode NEXT after TOKENS, the source in sequence 0, the destination in dest_seq."""
    got = dst.last_logits([NEXT], len(TOKENS), dest_seq)
    want = src.last_logits([NEXT], len(TOKENS), 0)
    llamir_side, ours, theirs = (src, want, got) if isinstance(src, Llamir) else (dst, got, want)
    assert_logits_agree(ours, theirs, llamir_side)


WHAT = ["session file", "sequence file", "state blob", "sequence blob"]
DIRECTIONS = {"llamir-to-llama.cpp": ("llamir", "llama.cpp"), "llama.cpp-to-llamir": ("llama.cpp", "llamir")}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("direction", list(DIRECTIONS))
@pytest.mark.parametrize("what", WHAT, ids=[w.replace(" ", "-") for w in WHAT])
def test_state_moves_between_engines(engines, tmp_path, case, direction, what):
    """Sequence 0 (or the whole context) of one engine into sequence 0 of the other, whose
    sequence 1 held something else: a whole load replaces it, a sequence load keeps it."""
    src, dst = (engines(kind, CASES[case]) for kind in DIRECTIONS[direction])
    src.last_logits(TOKENS, 0, 0)
    dst.last_logits(OTHER, 0, 1)
    moved = move_state(what, src, dst, tmp_path)
    whole = what in ("session file", "state blob")
    reloaded = dst.state.state_get_data() if whole else dst.state.state_seq_get_data(0)[8:]
    assert reloaded == moved
    assert dst.seq_pos_max(0) == len(TOKENS) - 1
    assert dst.seq_pos_max(1) == (-1 if whole else len(OTHER) - 1)
    assert_next_logits_agree(src, dst, 0)


@pytest.mark.parametrize("direction", list(DIRECTIONS))
@pytest.mark.parametrize("what", ["sequence file", "sequence blob"])
def test_sequence_lands_in_another_sequence(engines, tmp_path, direction, what):
    """Sequence 0 of one engine into sequence 1 (the second stream) of the other."""
    src, dst = (engines(kind, CASES["f16-kv"]) for kind in DIRECTIONS[direction])
    src.last_logits(TOKENS, 0, 0)
    dst.last_logits(OTHER, 0, 0)
    move_state(what, src, dst, tmp_path, dest_seq=1)
    assert (dst.seq_pos_max(0), dst.seq_pos_max(1)) == (len(OTHER) - 1, len(TOKENS) - 1)
    assert_next_logits_agree(src, dst, 1)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_same_decode_gives_llama_cpps_state_bytes(engines, tmp_path, case):
    """Both engines decode the same two sequences: their states have the same layout and size,
    and the same bytes where the arithmetic is the oracle's."""
    ours, theirs = engines("llamir", CASES[case]), engines("llama.cpp", CASES[case])
    for engine in (ours, theirs):
        engine.last_logits(TOKENS, 0, 0)
        engine.last_logits(OTHER, 0, 1)
    pairs = [(ours.state.state_get_data(), theirs.state.state_get_data())]
    pairs += [(ours.state.state_seq_get_data(s), theirs.state.state_seq_get_data(s)) for s in (0, 1)]
    ours.state.state_save_file(tmp_path / "ours.bin", TOKENS)
    theirs.state.state_save_file(tmp_path / "theirs.bin", TOKENS)
    pairs.append(((tmp_path / "ours.bin").read_bytes(), (tmp_path / "theirs.bin").read_bytes()))
    for mine, llama_cpps in pairs:
        assert len(mine) == len(llama_cpps)
        if ours.exact:
            assert mine == llama_cpps


def _v9_session_file(path: Path, arch: str, logits_row: np.ndarray, state_blob: bytes) -> None:
    """llamir's version 9 session file: tokens, the arch, one output row (the last token's logits),
    no embeddings, then the memory (llama.cpp's version 10 blob after its arch string)."""
    arch_bytes = struct.pack("<I", len(arch)) + arch.encode()
    assert state_blob.startswith(arch_bytes)
    path.write_bytes(struct.pack("<III", SESSION_MAGIC, 9, len(TOKENS)) + np.asarray(TOKENS, "<i4").tobytes()
                     + arch_bytes + struct.pack("<Ii", 1, len(TOKENS) - 1)
                     + struct.pack("<Q", logits_row.size) + logits_row.astype("<f4").tobytes()
                     + struct.pack("<Q", 0) + state_blob[len(arch_bytes):])


@pytest.mark.parametrize("case", ["f16-kv", "f16-kv-flash-attn", "q4_0-weights"])
def test_llamirs_older_files_still_load(engines, tmp_path, case):
    """Session version 9 (outputs restored too) and sequence version 2 files, made from llama.cpp's
    state, load into llamir and continue as llama.cpp does; llama.cpp itself refuses them."""
    src = engines("llama.cpp", CASES[case])
    last = src.last_logits(TOKENS, 0, 0)
    v9, v2 = tmp_path / "v9.bin", tmp_path / "v2.bin"
    _v9_session_file(v9, CASES[case].spec.arch, last, src.state.state_get_data())
    v2.write_bytes(struct.pack("<III", SEQ_FILE_MAGIC, 2, len(TOKENS)) + np.asarray(TOKENS, "<i4").tobytes()
                   + src.state.state_seq_get_data(0)[8:])
    want = src.last_logits([NEXT], len(TOKENS), 0)

    whole = engines("llamir", CASES[case])
    whole.last_logits(OTHER, 0, 0)
    assert whole.ctx.state_load_file(v9, 64) == TOKENS
    np.testing.assert_array_equal(whole.ctx.get_logits_ith(len(TOKENS) - 1), last)
    np.testing.assert_array_equal(whole.ctx.get_logits(), last[None])
    assert_logits_agree(whole.last_logits([NEXT], len(TOKENS), 0), want, whole)

    one = engines("llamir", CASES[case])
    one.last_logits(OTHER, 0, 0)
    assert one.ctx.state_seq_load_file(v2, 1, 64) == TOKENS
    assert (one.seq_pos_max(0), one.seq_pos_max(1)) == (len(OTHER) - 1, len(TOKENS) - 1)
    assert_logits_agree(one.last_logits([NEXT], len(TOKENS), 1), want, one)

    refuser = engines("llama.cpp", CASES[case])
    assert refuser.state.state_load_file(v9, 64) is None
    assert refuser.state.state_seq_load_file(v2, 1, 64) is None
