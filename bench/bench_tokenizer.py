"""llamir's tokenizer against llama.cpp's on the same vocab files and text, in one table.

    python bench/bench_tokenizer.py [GGUF ...] [--reps 5] [--kib 8]

Without paths it runs every `ggml-vocab-*.gguf` of llama.cpp's tree (fetched into the llamir cache
by the tests' fixture, `tests/frontend/tokenizer_fixtures.py`). The text is the tokenizer tests'
corpus of tricky strings plus random mixes of its pieces (mostly words neither engine has seen),
repeated to about `--kib` KiB. Each engine tokenizes it `--reps` times (parse_special on); the
table gives llamir's first call (its word cache empty, as for a new text) and the best time of
each engine, and whether both gave the same ids.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

TESTS_FRONTEND = Path(__file__).resolve().parents[1] / "tests" / "frontend"


def _fixtures():
    sys.path.insert(0, str(TESTS_FRONTEND))
    import tokenizer_corpus
    import tokenizer_fixtures

    return tokenizer_corpus, tokenizer_fixtures


def bench_text(kib: int) -> bytes:
    corpus, _ = _fixtures()
    text = "\n".join(corpus.CORPUS + corpus.random_strings(300, seed=7)).encode()
    return (text * (1 + kib * 1024 // len(text)))[:kib * 1024].decode("utf-8", "ignore").encode()


def best_time(fn, reps: int) -> tuple[float, list[int]]:
    best, result = float("inf"), []
    for _ in range(reps):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def bench_file(path: Path, text: bytes, reps: int) -> dict[str, object]:
    from llamir.frontend.model import load_model

    _, fixtures = _fixtures()
    start = time.perf_counter()
    vocab = load_model(path, vocab_only=True).vocab
    load_s = time.perf_counter() - start
    oracle = fixtures.Oracle(path)
    first_s, first = best_time(lambda: vocab.tokenize(text, add_special=True, parse_special=True), 1)
    ours_s, ours = best_time(lambda: vocab.tokenize(text, add_special=True, parse_special=True), reps)
    theirs_s, theirs = best_time(lambda: oracle.tokenize(text, True, True), reps)
    return {"file": path.name.removeprefix("ggml-vocab-").removesuffix(".gguf"), "type": vocab.type,
            "pre": vocab.pre or "-", "n_vocab": vocab.n_tokens, "tokens": len(ours), "load_s": load_s,
            "first_s": first_s, "llamir_s": ours_s, "llama_cpp_s": theirs_s, "same": first == ours == theirs}


def print_table(rows: list[dict[str, object]], n_bytes: int, out=sys.stdout) -> None:
    print(f"text: {n_bytes} bytes; first = llamir's first call, best = the best of the repetitions; "
          "ratio = llamir best / llama.cpp best; MB/s of llamir's first call", file=out)
    header = (f"{'vocab':16s} {'type':4s} {'pre':15s} {'n_vocab':>8s} {'tokens':>7s} {'load ms':>8s} "
              f"{'first ms':>9s} {'best ms':>8s} {'llama.cpp ms':>13s} {'ratio':>6s} {'MB/s':>6s}  same ids")
    print(header, file=out)
    print("-" * len(header), file=out)
    for r in rows:
        ratio = r["llamir_s"] / r["llama_cpp_s"] if r["llama_cpp_s"] else float("inf")
        print(f"{r['file']:16s} {r['type']:4s} {r['pre']:15s} {r['n_vocab']:8d} {r['tokens']:7d} "
              f"{r['load_s'] * 1e3:8.1f} {r['first_s'] * 1e3:9.2f} {r['llamir_s'] * 1e3:8.2f} "
              f"{r['llama_cpp_s'] * 1e3:13.2f} {ratio:6.1f} {n_bytes / r['first_s'] / 1e6:6.2f}  "
              f"{'yes' if r['same'] else 'NO'}", file=out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, help="GGUF files (default: llama.cpp's ggml-vocab-*)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions per engine (the best is reported)")
    parser.add_argument("--kib", type=int, default=8, help="size of the text in KiB")
    args = parser.parse_args(argv)
    paths = args.paths or sorted(_fixtures()[1].vocab_files_dir().glob("ggml-vocab-*.gguf"))
    text = bench_text(args.kib)
    rows = [bench_file(path, text, args.reps) for path in paths]
    print_table(rows, len(text))
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
