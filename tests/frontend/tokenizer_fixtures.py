"""Shared helpers of the tokenizer tests: llama.cpp's vocab-only GGUF files and their test vectors,
fetched once into the llamir cache; cached Vocab loads; llama-cpp-python as the oracle.

The vocab files ship in the llama-cpp-python sdist (vendor/llama.cpp/models/ggml-vocab-*), so a
fresh machine gets them with `pip download`; only those members are extracted.
"""

from __future__ import annotations

import ctypes
import functools
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from llamir.frontend.unicode import BYTE_TO_UNICODE, byte_encode
from llamir.frontend.vocab import Vocab
from llamir.paths import cache_dir

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
VOCAB_MEMBER = "/vendor/llama.cpp/models/ggml-vocab-"

# vocab files of llama.cpp's tree with .inp/.out vectors, and those without
WITH_VECTORS = ["bert-bge", "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4", "gpt-2",
                "llama-bpe", "llama-spm", "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder"]
WITHOUT_VECTORS = ["aquila", "baichuan", "gpt-neox", "nomic-bert-moe"]
ALL_VOCABS = sorted(WITH_VECTORS + WITHOUT_VECTORS)   # all 19 of llama.cpp's models/ggml-vocab-*.gguf
LARGE = {"command-r", "gemma-4", "llama-bpe", "nomic-bert-moe", "qwen2", "qwen35"}   # vocabs of 128k+ tokens


class VocabFilesUnavailable(RuntimeError):
    """The llama.cpp vocab files could not be fetched."""


@functools.cache
def vocab_files_dir() -> Path:
    """The directory of ggml-vocab-* files, downloading and extracting them on first use."""
    target = cache_dir() / "llama-vocab" / LLAMA_CPP_PYTHON.split("==")[1]
    if (target / ".complete").exists():
        return target
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               LLAMA_CPP_PYTHON, "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        sdists = list(Path(tmp).glob("*.tar.gz"))
        if done.returncode != 0 or not sdists:
            raise VocabFilesUnavailable(
                f"`{' '.join(cmd)}` failed with exit status {done.returncode}:\n{done.stderr[-2000:]}")
        staging = Path(tmp) / "vocab"
        staging.mkdir()
        with tarfile.open(sdists[0]) as tar:
            for member in tar:
                if VOCAB_MEMBER in member.name and member.isfile():
                    name = Path(member.name).name           # flat: never trust member paths
                    with tar.extractfile(member) as src, open(staging / name, "wb") as dst:
                        shutil.copyfileobj(src, dst)
        if not list(staging.glob("ggml-vocab-*.gguf")):
            raise VocabFilesUnavailable(f"{sdists[0].name} has no {VOCAB_MEMBER}* files")
        (staging / ".complete").touch()
        if (target / ".complete").exists():   # another test process finished first
            return target
        shutil.rmtree(target, ignore_errors=True)   # a partial leftover
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            staging.rename(target)
        except OSError:
            if not (target / ".complete").exists():
                raise
    return target


def vocab_path(name: str) -> Path:
    return vocab_files_dir() / f"ggml-vocab-{name}.gguf"


@functools.cache
def load_vocab(path: Path) -> Vocab:
    return Vocab.from_file(path)


def read_vectors(path: Path) -> list[tuple[bytes, list[int]]]:
    """The (input, expected ids) pairs of <vocab>.gguf.inp/.out, read as test-tokenizer-0.cpp does."""
    raw = path.with_name(path.name + ".inp").read_bytes()
    lines = path.with_name(path.name + ".out").read_bytes().split(b"\n")
    sep = b"\n__ggml_vocab_test__\n"
    inputs, pos = [], 0
    while pos < len(raw):
        nxt = raw.find(sep, pos)
        if nxt < 0:
            inputs.append(raw[pos:])
            break
        inputs.append(raw[pos:nxt])
        pos = nxt + len(sep)
    return [(text, [int(t) for t in line.split()]) for text, line in zip(inputs, lines, strict=False)]


class Oracle:
    """llama.cpp through llama-cpp-python: a vocab-only model and the raw C API."""

    def __init__(self, path: Path):
        import llama_cpp

        self.lib = llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        self.vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        self.n_tokens = llama_cpp.llama_vocab_n_tokens(self.vocab)

    def tokenize(self, text: bytes, add_special: bool, parse_special: bool) -> list[int]:
        return self.llm.tokenize(text, add_bos=add_special, special=parse_special)

    def token_to_piece(self, token: int, lstrip: int = 0, special: bool = False) -> bytes:
        size = 256
        buf = ctypes.create_string_buffer(size)
        n = self.lib.llama_token_to_piece(self.vocab, token, buf, size, lstrip, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self.lib.llama_token_to_piece(self.vocab, token, buf, -n, lstrip, special)
        return buf.raw[:n]

    def detokenize(self, tokens: list[int], remove_special: bool, unparse_special: bool) -> bytes:
        """llama_detokenize itself (Llama.detokenize re-implements it in Python)."""
        ids = (self.lib.llama_token * max(1, len(tokens)))(*tokens)
        size = 64 + 16 * len(tokens)
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = self.lib.llama_detokenize(self.vocab, ids, len(tokens), buf, size,
                                          remove_special, unparse_special)
            if n >= 0:
                return buf.raw[:n]
            size = -n
        raise AssertionError("llama_detokenize asked for more room twice")

    def special_ids(self) -> dict[str, int | bool]:
        lib, v = self.lib, self.vocab
        names = ["bos", "eos", "eot", "sep", "nl", "pad", "mask",
                 "fim_pre", "fim_suf", "fim_mid", "fim_pad", "fim_rep", "fim_sep"]
        ids: dict[str, int | bool] = {n: getattr(lib, f"llama_vocab_{n}")(v) for n in names}
        for flag in ("add_bos", "add_eos", "add_sep"):
            ids[flag] = bool(getattr(lib, f"llama_vocab_get_{flag}")(v))
        return ids

    def attr(self, token: int) -> int:
        return self.lib.llama_vocab_get_attr(self.vocab, token)

    def eog_ids(self) -> set[int]:
        return {i for i in range(self.n_tokens) if self.lib.llama_vocab_is_eog(self.vocab, i)}


@functools.cache
def oracle(path: Path) -> Oracle:
    return Oracle(path)


def smollm2_path() -> Path:
    """The default SmolLM2 GGUF (downloaded into the llamir cache on first use)."""
    from llamir.frontend.default_model import default_model_path

    return default_model_path(progress=False)


SYNTHETIC_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "</s>", "<s>"]


def write_synthetic_bpe(path: Path, pre: str, texts: list[bytes]) -> Path:
    """A byte-level BPE vocab for pre-tokenizer `pre`: the 256 byte tokens, a merge (in random
    rank order) for every pair of adjacent bytes in `texts`, and a few control tokens. Pairs merge
    only inside a word, so the ids show where the pre-tokenizer split the text."""
    import gguf

    spelled = [byte_encode(text.decode("utf-8", "replace")) for text in texts]
    pairs = sorted({(s[i], s[i + 1]) for s in spelled for i in range(len(s) - 1)})
    random.Random(0).shuffle(pairs)
    tokens = [*BYTE_TO_UNICODE, *(a + b for a, b in pairs), *SYNTHETIC_SPECIALS]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(2048)          # the hparams llama.cpp insists on even for a vocab
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - len(SYNTHETIC_SPECIALS)) + [3] * len(SYNTHETIC_SPECIALS))
    writer.add_token_merges([f"{a} {b}" for a, b in pairs])
    writer.add_bos_token_id(len(tokens) - 1)
    writer.add_eos_token_id(len(tokens) - len(SYNTHETIC_SPECIALS))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
