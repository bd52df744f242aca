"""Coverage-guided fuzzing of the GGUF loader with atheris (issue 9).

    python fuzz/fuzz_gguf.py --seconds 300                  # fuzz for five minutes
    python fuzz/fuzz_gguf.py --seconds 60 --corpus DIR --crashes DIR --keep-going --seed 7
    python fuzz/fuzz_gguf.py --replay fuzz/crashes/gguf/crash-*   # rerun saved inputs, show what they do

Every input is checked as the suite's property tests check mutated files (tests/frontend/
test_gguf_fuzz.py): load_model either refuses it with a ModelError, or returns a model that
decodes three tokens on the numpy backend (and a vocab-only load refuses or succeeds the same
way). Anything else (another exception, a failed decode, an input running past --timeout seconds
or using more than --rss-limit-mb) is a finding, written to the crashes directory as libFuzzer
names it (crash-<sha1>, timeout-<sha1>, oom-<sha1>). The corpus directory keeps every input that
reached new code; it is seeded with small models written by llamir.frontend.synth (llama, qwen2
q8_0, qwen3 f16 tied, gemma3 with sliding-window layers) and grows from run to run.

Next to libFuzzer's byte mutations, a GGUF-aware mutator edits the header (where the key/values
and tensor infos are, a few KB before the tensor data): libFuzzer's mutations confined to it,
duplicated, dropped or swapped key/value and tensor-info records, and integer fields set to edge
values. The fuzzer runs in a child process (libFuzzer ends its process when the time is up); this
process counts the runs and prints one summary line, with the traceback of each finding. Needs
`pip install atheris`.
"""

from __future__ import annotations

import argparse
import os
import random
import struct
import sys
import tempfile
from pathlib import Path

from llamir.testing import libfuzzer

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CORPUS = ROOT / "fuzz" / "corpus" / "gguf"
DEFAULT_CRASHES = ROOT / "fuzz" / "crashes" / "gguf"
SEED_SPECS = {  # tiny, so that most of each input is header and a decode is quick
    "llama": dict(arch="llama"),
    "qwen2-q8_0": dict(arch="qwen2", dtype="q8_0"),
    "qwen3-f16-tied": dict(arch="qwen3", dtype="f16", tied=True),
    "gemma3-swa": dict(arch="gemma3", n_layer=2, sliding_window=8, swa_pattern=2),
}
TINY = dict(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, n_vocab=300)


# -- the property every input must keep -------------------------------------------------------
def check(data: bytes) -> str:
    """Raise (AssertionError or whatever escaped llamir) unless `data` is refused with a ModelError
    or loads into a model that decodes; returns what happened."""
    import llamir
    from llamir.frontend.model import ModelError, load_model

    path = _case_path()
    path.write_bytes(data)
    try:
        vocab_model = load_model(path, vocab_only=True)
        assert vocab_model.vocab.n_tokens > 0
    except ModelError as err:
        assert str(err), "a refusal must say why"
    try:
        model = load_model(path)
    except ModelError as err:
        assert str(err), "a refusal must say why"
        return f"refused: {str(err)[:200]}"
    ctx = llamir.Context(model, n_ctx=32, n_batch=8, backend="numpy")
    n_vocab = model.hparams.n_vocab
    rc = ctx.decode(llamir.Batch.from_tokens([t % n_vocab for t in (1, 2, 3)]))
    assert rc == 0, f"decode returned {rc}: {ctx.last_error}"
    assert ctx.get_logits().shape == (1, n_vocab)
    return f"loaded: {model!r}, decoded"


_CASE: Path | None = None


def _case_path() -> Path:
    """One scratch file per process (in /dev/shm when there is one), removed at exit."""
    global _CASE
    if _CASE is None:
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, name = tempfile.mkstemp(prefix="fuzz-gguf-", suffix=".gguf", dir=folder)
        os.close(fd)
        _CASE = Path(name)
        import atexit

        atexit.register(lambda: _CASE.unlink(missing_ok=True))
    return _CASE


# -- a mutator that knows the container ------------------------------------------------------------
SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
EDGE_INTS = [0, 1, 2, 3, 7, 8, 9, 13, 31, 32, 33, 63, 64, 255, 256, 511, 512, 513, 2**31 - 1, 2**31, 2**32 - 1,
             2**32, 2**62, 2**63 - 1, 2**64 - 1]


def split_header(data: bytes) -> tuple[list[tuple[int, int]], list[tuple[int, int]], int] | None:
    """The byte spans of the key/value records and tensor infos, and where they end; None when
    the header does not parse (libFuzzer's own mutations take over then)."""
    try:
        n_tensors, n_kv = struct.unpack_from("<qq", data, 8)
        if not (0 <= n_tensors < 4096 and 0 <= n_kv < 4096):
            return None
        pos, kvs, infos = 24, [], []
        for _ in range(n_kv):
            start = pos
            (n,) = struct.unpack_from("<Q", data, pos)
            pos += 8 + n
            (vtype,) = struct.unpack_from("<i", data, pos)
            pos = _skip_value(data, pos + 4, vtype)
            if pos > len(data):
                return None
            kvs.append((start, pos))
        for _ in range(n_tensors):
            start = pos
            (n,) = struct.unpack_from("<Q", data, pos)
            pos += 8 + n
            (n_dims,) = struct.unpack_from("<I", data, pos)
            pos += 4 + 8 * n_dims + 12
            infos.append((start, pos))
        return (kvs, infos, pos) if pos <= len(data) else None
    except (struct.error, KeyError, OverflowError):
        return None


def _skip_value(data: bytes, pos: int, vtype: int) -> int:
    if vtype == 8:
        return pos + 8 + struct.unpack_from("<Q", data, pos)[0]
    if vtype == 9:
        item, count = struct.unpack_from("<iQ", data, pos)
        pos += 12
        if item == 8:
            for _ in range(count):
                pos += 8 + struct.unpack_from("<Q", data, pos)[0]
                if pos > len(data):
                    break
            return pos
        return pos + SCALAR_SIZES[item] * count
    return pos + SCALAR_SIZES[vtype]


def mutate_records(data: bytes, rng: random.Random) -> bytes:
    """A record-level edit of the header: counts follow the records unless the edit is a lying count."""
    parts = split_header(data)
    if parts is None:
        return data
    kvs, infos, end = parts
    records = kvs if (rng.random() < 0.6 or not infos) else infos
    if not records:
        return data
    spans = [data[a:b] for a, b in records]
    i, j = rng.randrange(len(spans)), rng.randrange(len(spans))
    kind = rng.randrange(5)
    if kind == 0:
        spans.insert(j, spans[i])                     # duplicated key or tensor name
    elif kind == 1:
        del spans[i]
    elif kind == 2:
        spans[i], spans[j] = spans[j], spans[i]       # reordered (tensor offsets then disagree)
    elif kind == 3:                                   # an integer field at the end of a record: a value or an offset
        raw = bytearray(spans[i])
        width = rng.choice([4, 8])
        if len(raw) >= width:
            raw[-width:] = (rng.choice(EDGE_INTS) % 2 ** (8 * width)).to_bytes(width, "little")
        spans[i] = bytes(raw)
    head = bytearray(data[:24])
    if kind == 4:                                     # a lying count
        at = rng.choice([8, 16])
        head[at:at + 8] = struct.pack("<q", rng.choice([-1, 0, len(kvs) + 1, len(infos) + 1, 2**40, 2**63 - 1]))
    else:
        count = struct.pack("<q", len(spans))
        if records is kvs:
            head[16:24] = count
        else:
            head[8:16] = count
    first, last = records[0][0], records[-1][1]
    return bytes(head) + data[24:first] + b"".join(spans) + data[last:end] + data[end:]


def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
    import atheris

    rng = random.Random(seed)
    choice = rng.random()
    if choice < 0.35:
        return atheris.Mutate(data, max_size)
    if choice < 0.7:                                  # libFuzzer's mutations, on the header only
        parts = split_header(data)
        end = parts[2] if parts else min(len(data), 4096)
        head = atheris.Mutate(data[:end], end + 64)
        return (head + data[end:])[:max_size]
    return mutate_records(data, rng)[:max_size]


# -- the child process: libFuzzer through atheris --------------------------------------------------
def worker(libfuzzer_args: list[str]) -> None:
    import warnings

    import atheris

    # NaN/inf hparams that llama.cpp accepts make numpy warn while decoding; the property is about errors
    warnings.simplefilter("ignore", RuntimeWarning)
    with atheris.instrument_imports(include=["llamir.frontend"]):
        import llamir.frontend.model  # noqa: F401  (instrumented for coverage)
        import llamir.frontend.vocab  # noqa: F401
    import llamir  # noqa: F401  (the rest, uninstrumented: the decode is checked, not explored)

    def test_one_input(data: bytes) -> None:
        check(data)

    atheris.Setup([sys.argv[0], *libfuzzer_args], test_one_input, custom_mutator=custom_mutator)
    atheris.Fuzz()


# -- this process: seed, run, summarise -----------------------------------------------------------
def seed_corpus(corpus: Path) -> int:
    """Write each synth seed model into the corpus unless it is there; the number of files in it."""
    from llamir.frontend.synth import SynthSpec, write_model

    corpus.mkdir(parents=True, exist_ok=True)
    for name, spec in SEED_SPECS.items():
        target = corpus / f"synth-{name}"
        if not target.exists():
            with tempfile.TemporaryDirectory() as tmp:
                target.write_bytes(write_model(Path(tmp) / "seed.gguf", SynthSpec(**(TINY | spec))).read_bytes())
    return sum(1 for p in corpus.iterdir() if p.is_file())


def replay(paths: list[str]) -> int:
    """Run `check` on kept inputs (finding files, corpus entries); 1 if any fails."""
    return libfuzzer.replay(paths, check)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker(argv[2:] if argv[1:2] == ["--"] else argv[1:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", "--time", type=int, default=60, dest="seconds", help="how long to fuzz (default 60)")
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help=f"corpus directory (default {DEFAULT_CORPUS})")
    p.add_argument("--crashes", type=Path, default=DEFAULT_CRASHES,
                   help=f"where findings go (default {DEFAULT_CRASHES})")
    p.add_argument("--keep-going", action="store_true", dest="keep_going",
                   help="after a finding, fuzz on for the rest of --seconds")
    p.add_argument("--timeout", type=int, default=20, help="seconds one input may take before it is a finding")
    p.add_argument("--rss-limit-mb", type=int, default=2048, dest="rss_limit_mb")
    p.add_argument("--max-len", type=int, default=1 << 18, dest="max_len", help="longest input in bytes")
    p.add_argument("--seed", type=int, default=None, help="libFuzzer's random seed")
    p.add_argument("--replay", nargs="+", metavar="FILE", help="check these inputs once each and report")
    args = p.parse_args(argv)
    if args.replay:
        return replay(args.replay)
    if args.seconds < 1:
        p.error(f"--seconds must be at least 1, got {args.seconds}")
    args.corpus, args.crashes = args.corpus.resolve(), args.crashes.resolve()
    return libfuzzer.drive("fuzz_gguf", Path(__file__).resolve(), args, seed_corpus)


if __name__ == "__main__":
    sys.exit(main())
