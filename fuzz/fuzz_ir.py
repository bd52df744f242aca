"""Coverage-guided fuzzing of the IR parser with atheris (issue 9).

    python fuzz/fuzz_ir.py --seconds 300                   # fuzz for five minutes
    python fuzz/fuzz_ir.py --seconds 60 --corpus DIR --crashes DIR --keep-going --seed 7
    python fuzz/fuzz_ir.py --replay fuzz/crashes/ir/crash-*     # rerun saved inputs, show what they do

Every input is checked as the suite's property tests check mutated texts (tests/ir/test_text_fuzz.py):
parse_graph either returns a graph that verifies and prints back to a text that parses to the same
graph, or raises ParseError with a message naming the line. Anything else (another exception, a
failed round trip, a message without a line, an input running past --timeout seconds or using more
than --rss-limit-mb) is a finding, written to the crashes directory as libFuzzer names it
(crash-<sha1>, timeout-<sha1>, oom-<sha1>). The corpus directory keeps every input that reached new
code; it is seeded with tests/golden/**/*.ir and grows from run to run.

The fuzzer runs in a child process (libFuzzer ends its process when the time is up); this process
counts the runs and prints one summary line, with the traceback of each finding. Needs
`pip install atheris`.
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import sys
from pathlib import Path

from llamir.testing import libfuzzer

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"
DEFAULT_CORPUS = ROOT / "fuzz" / "corpus" / "ir"
DEFAULT_CRASHES = ROOT / "fuzz" / "crashes" / "ir"

MESSAGE = re.compile(r"line \d+(, column \d+)?: \S|empty IR text$|missing closing '\}': the text ends at line \d+ ")


# -- the property every input must keep -------------------------------------------------------
def check(data: bytes) -> str:
    """Raise (AssertionError or whatever escaped parse_graph) unless `data` parses to a verified
    graph that round-trips or is refused with a ParseError naming the line; returns what happened."""
    from llamir.ir import ParseError, fingerprint, parse_graph, print_graph, verify

    try:
        graph = parse_graph(data)
    except ParseError as err:
        message = str(err)
        assert MESSAGE.match(message), f"a ParseError that names no line: {message!r}"
        return f"refused: {message[:200]}"
    verify(graph)
    printed = print_graph(graph)
    again = parse_graph(printed)
    assert print_graph(again) == printed, "the printed graph does not print back the same"
    assert fingerprint(again) == fingerprint(graph), "the fingerprint changed over a round trip"
    return f"parsed: graph {graph.name} with {len(graph.leafs)} leaves, {len(graph.nodes)} nodes"


# -- a mutator that knows the grammar's tokens ---------------------------------------------------
TOKEN = re.compile(r'"(?:[^"\\\n]|\\.)*"|[A-Za-z_0-9.+\-]+|\s+|.', re.DOTALL)
SPECIAL = [
    "9" * 30, str(2**63), str(2**63 - 1), str(2**31), "-1", "-0", "0", "1e999", "1e-999", "nan", "-nan",
    "inf", "-inf", "NaN", "-0.0", "0x10", "1_000", "5e-324", "ü", "٣", "²", "\u2028", "\x85", "\x00",
    "\ufeff", "\t", "\r", "\n", "\\", "\\u00", "{", "}", "(", ")", "[", "]", ",", "=", ":", "%", '"', "#",
    "*", "[" * 64, "graph", "return", "input", "weight", "state", "leaf", "none", "true", "false", "T",
    "n_kv", "f32", "q8_0", "i32", "view", "permute", "reshape", "rope_ext", "shape", "strides", "offset",
    "axes", "eps", "%0", "%99", "0*T", "T*T", "4*n_kv",
]


def mutate_tokens(text: str, rng: random.Random) -> str:
    """One to three token- or line-level edits (delete, duplicate, swap, replace, insert)."""
    for _ in range(rng.randint(1, 3)):
        tokens = TOKEN.findall(text)
        if not tokens:
            return rng.choice(SPECIAL)
        i, j = rng.randrange(len(tokens)), rng.randrange(len(tokens))
        kind = rng.randrange(8)
        if kind == 0:
            del tokens[i]
        elif kind == 1:
            tokens.insert(i, tokens[i])
        elif kind == 2:
            tokens[i], tokens[j] = tokens[j], tokens[i]
        elif kind in (3, 4):
            tokens[i] = rng.choice(SPECIAL) if kind == 3 else tokens[j]
        elif kind == 5:
            tokens.insert(i, rng.choice(SPECIAL))
        else:
            lines = text.split("\n")
            a, b = rng.randrange(len(lines)), rng.randrange(len(lines))
            if kind == 6:
                lines.insert(b, lines[a])
            else:
                lines[a], lines[b] = lines[b], lines[a]
            tokens = ["\n".join(lines)]
        text = "".join(tokens)
    return text


def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
    import atheris

    rng = random.Random(seed)
    if rng.random() < 0.4:
        return atheris.Mutate(data, max_size)
    text = mutate_tokens(data.decode("utf-8", "surrogateescape"), rng)
    try:
        out = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        out = text.encode("utf-8", "surrogatepass")
    return out[:max_size]


# -- the child process: libFuzzer through atheris --------------------------------------------------
def worker(libfuzzer_args: list[str]) -> None:
    import atheris

    # no atheris.enabled_hooks: its RegEx proxy cannot take match(text, pos), which the parser's
    # cursor calls; the token-aware mutator below gives the fuzzer the grammar instead
    with atheris.instrument_imports(include=["llamir.ir"]):
        import llamir.ir  # noqa: F401  (instrumented for coverage)

    def test_one_input(data: bytes) -> None:
        check(data)

    atheris.Setup([sys.argv[0], *libfuzzer_args], test_one_input, custom_mutator=custom_mutator)
    atheris.Fuzz()


# -- this process: seed, run, summarise -----------------------------------------------------------
def seed_corpus(corpus: Path) -> int:
    """Copy each golden .ir file into the corpus unless it is there; the number of files in it."""
    corpus.mkdir(parents=True, exist_ok=True)
    for path in sorted(GOLDEN.rglob("*.ir")):
        target = corpus / f"golden-{path.relative_to(GOLDEN).as_posix().replace('/', '-')}"
        if not target.exists():
            shutil.copyfile(path, target)
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
    p.add_argument("--timeout", type=int, default=10, help="seconds one input may take before it is a finding")
    p.add_argument("--rss-limit-mb", type=int, default=2048, dest="rss_limit_mb")
    p.add_argument("--max-len", type=int, default=16384, dest="max_len", help="longest input in bytes")
    p.add_argument("--seed", type=int, default=None, help="libFuzzer's random seed")
    p.add_argument("--replay", nargs="+", metavar="FILE", help="check these inputs once each and report")
    args = p.parse_args(argv)
    if args.replay:
        return replay(args.replay)
    if args.seconds < 1:
        p.error(f"--seconds must be at least 1, got {args.seconds}")
    args.corpus, args.crashes = args.corpus.resolve(), args.crashes.resolve()
    return libfuzzer.drive("fuzz_ir", Path(__file__).resolve(), args, seed_corpus)


if __name__ == "__main__":
    sys.exit(main())
