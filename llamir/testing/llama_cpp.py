"""llama.cpp as the oracle, through llama-cpp-python's low-level C bindings.

`LlamaCppOracle` opens one model with one context and exposes exactly the knobs a comparison
needs: batch/ubatch sizes, KV cache types, flash attention, how a prompt is fed, and the memory's
sequence operations. `llama_cpp` is imported lazily so that `import llamir.testing` works without it.

Outputs in this llama.cpp version are chosen per token through `llama_batch.logits` (there is no
context-wide `logits_all` any more); `llama_get_logits_ith(i)` indexes the batch position `i`.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from llamir.ir.dtypes import dtype_named

FeedMode = Literal["batch", "incremental", "ubatch"]

_backend_ready = False
_log_callback: Any = None  # keeps the ctypes callback alive for as long as llama.cpp may call it


def nmse(a: np.ndarray, b: np.ndarray) -> float:
    """Normalised mean squared error of `a` against the reference `b`: sum((a-b)^2) / sum(b^2)."""
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a64.shape != b64.shape:
        raise ValueError(f"nmse of arrays with different shapes {a64.shape} and {b64.shape}")
    return float(np.sum((a64 - b64) ** 2) / np.sum(b64**2))


def oracle_numerics():
    """The numerics profile of the llama.cpp build installed as the oracle, from its own
    llama_print_system_info() (not from this CPU: a wheel may have been built elsewhere)."""
    from llamir.ir.numerics import AVX2, AVX512

    info = _lib().llama_print_system_info().decode()
    flags = dict(re.findall(r"(\w+) = (\d)", info))
    if flags.get("AVX512") == "1":
        return AVX512
    if flags.get("AVX2") == "1" and flags.get("FMA") == "1":
        return AVX2
    raise RuntimeError(f"the llama.cpp oracle is built for neither AVX-512 nor AVX2+FMA: {info.strip()}")


def relative_position_bucket(x: int, y: int, n_buckets: int, bidirectional: bool) -> int:
    """llama.cpp's own llama_relative_position_bucket(x, y, n_buckets, bidirectional) (t5's bucket
    of key position x for query position y), called through its exported C++ symbol."""
    global _bucket_fn
    if _bucket_fn is None:
        import llama_cpp.llama_cpp as bindings

        fn = bindings._lib._Z30llama_relative_position_bucketiimb   # (int32, int32, uint64, bool) -> int32
        fn.restype = ctypes.c_int32
        fn.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_uint64, ctypes.c_bool]
        _bucket_fn = fn
    return int(_bucket_fn(x, y, n_buckets, bidirectional))


_bucket_fn: Any = None


def _lib():
    """The llama_cpp module, with the backend initialised and its logging silenced once."""
    global _backend_ready, _log_callback
    import llama_cpp

    if not _backend_ready:
        _log_callback = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
        llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        _backend_ready = True
    return llama_cpp


class LlamaCppOracle:
    """One llama.cpp model + context; use as a context manager (or call close())."""

    def __init__(self, model_path: str | Path, *, n_ctx: int = 512, n_batch: int = 512,
                 n_ubatch: int | None = None, n_threads: int = 2, type_k: str = "f16",
                 type_v: str = "f16", flash_attn: bool = False, n_seq_max: int = 1,
                 kv_unified: bool = False, embeddings: bool = False, pooling: str | None = None,
                 causal: bool | None = None, swa_full: bool = True):
        lib = _lib()
        self._lib = lib
        self.model_path = Path(model_path)
        self.n_batch = n_batch
        self.n_ubatch = n_ubatch if n_ubatch is not None else n_batch
        mparams = lib.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self._model = lib.llama_model_load_from_file(str(self.model_path).encode(), mparams)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {self.model_path}")
        self._ctx = None
        self._batch = None
        try:
            cparams = lib.llama_context_default_params()
            cparams.n_ctx = n_ctx
            cparams.n_batch = n_batch
            cparams.n_ubatch = self.n_ubatch
            cparams.n_seq_max = n_seq_max
            cparams.n_threads = n_threads
            cparams.n_threads_batch = n_threads
            cparams.type_k = int(dtype_named(type_k).ggml_type)
            cparams.type_v = int(dtype_named(type_v).ggml_type)
            cparams.flash_attn_type = (lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                                       else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED)
            cparams.kv_unified = kv_unified
            cparams.swa_full = swa_full
            cparams.no_perf = True
            cparams.embeddings = embeddings
            if pooling is not None:
                cparams.pooling_type = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}[pooling]
            if causal is not None:
                cparams.attention_type = 0 if causal else 1
            self._ctx = lib.llama_init_from_model(self._model, cparams)
            if not self._ctx:
                raise RuntimeError(f"llama.cpp could not create a context for {self.model_path} "
                                   f"(n_ctx={n_ctx}, n_batch={n_batch}, n_ubatch={self.n_ubatch}, "
                                   f"type_k={type_k}, type_v={type_v}, flash_attn={flash_attn})")
            self.n_ctx = int(lib.llama_n_ctx(self._ctx))
            self._vocab = lib.llama_model_get_vocab(self._model)
            self.n_vocab = int(lib.llama_vocab_n_tokens(self._vocab))
            self._mem = lib.llama_get_memory(self._ctx)
            self._batch = lib.llama_batch_init(n_batch, 0, max(1, n_seq_max))
        except BaseException:
            self.close()
            raise

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        lib = self._lib
        if self._batch is not None:
            lib.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            lib.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            lib.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> LlamaCppOracle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- decoding ------------------------------------------------------------------------------

    def decode(self, tokens: Sequence[int], pos0: int = 0, seq_id: int = 0,
               logits: Literal["all", "last"] | Sequence[bool] = "last") -> int:
        """One llama_decode of `tokens` at positions pos0.. in `seq_id`; returns llama.cpp's status."""
        n = len(tokens)
        if not 0 < n <= self.n_batch:
            raise ValueError(f"decode of {n} tokens; this context takes 1..{self.n_batch} per call")
        if logits == "all":
            flags = [True] * n
        elif logits == "last":
            flags = [False] * (n - 1) + [True]
        else:
            flags = [bool(f) for f in logits]
            if len(flags) != n:
                raise ValueError(f"logits has {len(flags)} flags for {n} tokens")
        b = self._batch
        b.n_tokens = n
        for i, token in enumerate(tokens):
            b.token[i] = int(token)
            b.pos[i] = pos0 + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq_id
            b.logits[i] = flags[i]
        return int(self._lib.llama_decode(self._ctx, b))

    def decode_batch(self, tokens: Sequence[int], pos: Sequence[int], seq_ids: Sequence[Sequence[int]],
                     logits: Sequence[bool]) -> int:
        """One llama_decode of a general batch: per token a position, its sequence ids and a flag."""
        n = len(tokens)
        if not 0 < n <= self.n_batch or not len(pos) == len(seq_ids) == len(logits) == n:
            raise ValueError(f"decode_batch: {n} tokens, {len(pos)} positions, {len(seq_ids)} seq_id lists, "
                             f"{len(logits)} flags (1..{self.n_batch} tokens per call)")
        b = self._batch
        b.n_tokens = n
        for i in range(n):
            b.token[i] = int(tokens[i])
            b.pos[i] = int(pos[i])
            b.n_seq_id[i] = len(seq_ids[i])
            for j, s in enumerate(seq_ids[i]):
                b.seq_id[i][j] = int(s)
            b.logits[i] = bool(logits[i])
        return int(self._lib.llama_decode(self._ctx, b))

    def embeddings_seq(self, seq_id: int) -> np.ndarray:
        """The pooled embedding of a sequence after the last decode/encode."""
        n_embd = int(self._lib.llama_model_n_embd(self._model))
        ptr = self._lib.llama_get_embeddings_seq(self._ctx, seq_id)
        if not ptr:
            raise IndexError(f"llama.cpp has no pooled embedding for sequence {seq_id}")
        return np.ctypeslib.as_array(ptr, shape=(n_embd,)).copy()

    def embeddings_ith(self, i: int) -> np.ndarray:
        n_embd = int(self._lib.llama_model_n_embd(self._model))
        ptr = self._lib.llama_get_embeddings_ith(self._ctx, i)
        if not ptr:
            raise IndexError(f"llama.cpp has no embedding for batch position {i}")
        return np.ctypeslib.as_array(ptr, shape=(n_embd,)).copy()

    def encode_batch(self, tokens: Sequence[int], pos: Sequence[int] | None = None,
                     seq_ids: Sequence[Sequence[int]] | None = None) -> int:
        """One llama_encode of `tokens` (positions 0.. and sequence 0 unless given); its status."""
        pos = range(len(tokens)) if pos is None else pos
        seq_ids = [(0,)] * len(tokens) if seq_ids is None else seq_ids
        b = self._batch
        b.n_tokens = len(tokens)
        for i in range(len(tokens)):
            b.token[i], b.pos[i], b.n_seq_id[i] = int(tokens[i]), int(pos[i]), len(seq_ids[i])
            for j, s in enumerate(seq_ids[i]):
                b.seq_id[i][j] = int(s)
            b.logits[i] = True
        return int(self._lib.llama_encode(self._ctx, b))

    def has_encoder(self) -> bool:
        return bool(self._lib.llama_model_has_encoder(self._model))

    def decoder_start_token(self) -> int:
        """llama_model_decoder_start_token: the model's decoder_start_token_id (-1 when unset)."""
        return int(self._lib.llama_model_decoder_start_token(self._model))

    def logits_ith(self, i: int) -> np.ndarray:
        """A copy of the logits of batch position `i` of the last decode (negative counts from the end)."""
        ptr = self._lib.llama_get_logits_ith(self._ctx, i)
        if not ptr:
            raise IndexError(f"llama.cpp has no logits for batch position {i} of the last decode")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def eval_logits(self, tokens: Sequence[int], mode: FeedMode = "batch") -> np.ndarray:
        """float32 [n_tokens, n_vocab] logits of `tokens` fed from an empty memory.

        "batch": one llama_decode (must fit n_ubatch); "incremental": one token per decode;
        "ubatch": one llama_decode with n_ubatch < n_tokens <= n_batch, so llama.cpp splits it.
        """
        n = len(tokens)
        if mode == "batch" and n > self.n_ubatch:
            raise ValueError(f"batch mode with {n} tokens > n_ubatch={self.n_ubatch} would be split")
        if mode == "ubatch" and not self.n_ubatch < n <= self.n_batch:
            raise ValueError(f"ubatch mode needs n_ubatch={self.n_ubatch} < {n} tokens "
                             f"<= n_batch={self.n_batch}")
        if mode not in ("batch", "incremental", "ubatch"):
            raise ValueError(f"unknown feed mode {mode!r}")
        self.clear()
        out = np.empty((n, self.n_vocab), dtype=np.float32)
        if mode == "incremental":
            for i, token in enumerate(tokens):
                self._check(self.decode([token], pos0=i), f"decode of token {i}")
                out[i] = self.logits_ith(0)
        else:
            self._check(self.decode(tokens, logits="all"), f"decode of {n} tokens")
            for i in range(n):
                out[i] = self.logits_ith(i)
        return out

    def greedy(self, prompt_tokens: Sequence[int], n: int) -> list[int]:
        """The `n` argmax tokens after the prompt (fed in one decode), one token per decode."""
        self.clear()
        self._check(self.decode(prompt_tokens), "prompt decode")
        generated: list[int] = []
        pos = len(prompt_tokens)
        for _ in range(n):
            token = int(np.argmax(self.logits_ith(-1)))
            generated.append(token)
            if len(generated) == n:
                break
            self._check(self.decode([token], pos0=pos), f"decode at position {pos}")
            pos += 1
        return generated

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"llama.cpp {what} returned {status}")

    # -- adapters (llama.h's llama_adapter_lora_init, llama_set_adapters_lora, llama_set_adapter_cvec) --

    def lora_init(self, path: str | Path):
        """llama_adapter_lora_init: a handle of the adapter (freed with the model); RuntimeError when
        llama.cpp refuses the file."""
        handle = self._lib.llama_adapter_lora_init(self._model, str(path).encode())
        if not handle:
            raise RuntimeError(f"llama.cpp refused the LoRA adapter {path}")
        return handle

    def set_adapters_lora(self, adapters: Sequence[Any], scales: Sequence[float]) -> int:
        """llama_set_adapters_lora: replace the context's adapters (an empty list clears them)."""
        lib = self._lib
        n = len(adapters)
        handles = (lib.llama_adapter_lora_p_ctypes * max(1, n))(*adapters)
        values = (ctypes.c_float * max(1, n))(*scales)
        return int(lib.llama_set_adapters_lora(self._ctx, handles if n else None, n, values if n else None))

    def set_adapter_cvec(self, data: np.ndarray | None, n_embd: int = 0, il_start: int = 0, il_end: int = 0) -> int:
        """llama_set_adapter_cvec: data [n_embd * n] floats from layer 1 on, applied to il_start..il_end
        (inclusive); None turns the vector off. 0 ok, -1 refused."""
        if data is None:
            return int(self._lib.llama_set_adapter_cvec(self._ctx, None, 0, n_embd, il_start, il_end))
        buf = np.ascontiguousarray(data, dtype=np.float32)
        ptr = buf.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        return int(self._lib.llama_set_adapter_cvec(self._ctx, ptr, buf.size, n_embd, il_start, il_end))

    def adapter_meta_val_str(self, adapter, key: str) -> str | None:
        """llama_adapter_meta_val_str: a scalar metadata value of the adapter as text (None: absent)."""
        buf = ctypes.create_string_buffer(256)
        n = self._lib.llama_adapter_meta_val_str(adapter, key.encode(), buf, len(buf))
        return None if n < 0 else buf.value.decode()

    def alora_invocation_tokens(self, adapter) -> list[int]:
        lib = self._lib
        n = int(lib.llama_adapter_get_alora_n_invocation_tokens(adapter))
        return list(lib.llama_adapter_get_alora_invocation_tokens(adapter)[:n]) if n else []

    # -- tokenizer -----------------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """llama.cpp's token ids for `text`."""
        data = text.encode("utf-8")
        capacity = len(data) + 8
        for _ in range(2):
            buf = (self._lib.llama_token * capacity)()
            n = self._lib.llama_tokenize(self._vocab, data, len(data), buf, capacity,
                                         add_special, parse_special)
            if n >= 0:
                return list(buf[:n])
            capacity = -n
        raise RuntimeError(f"llama_tokenize failed for {text[:40]!r}")

    def detokenize(self, tokens: Sequence[int], remove_special: bool = False,
                   unparse_special: bool = False) -> str:
        """llama.cpp's text for `tokens` (invalid UTF-8 replaced)."""
        arr = (self._lib.llama_token * max(1, len(tokens)))(*tokens)
        capacity = 16 * len(tokens) + 16
        for _ in range(2):
            buf = ctypes.create_string_buffer(capacity)
            n = self._lib.llama_detokenize(self._vocab, arr, len(tokens), buf, capacity,
                                           remove_special, unparse_special)
            if n >= 0:
                return buf.raw[:n].decode("utf-8", errors="replace")
            capacity = -n
        raise RuntimeError("llama_detokenize failed")

    def token_piece(self, token: int, special: bool = True) -> bytes:
        """The raw bytes of one token."""
        buf = ctypes.create_string_buffer(256)
        n = self._lib.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            raise RuntimeError(f"token {token} has a piece longer than 256 bytes")
        return buf.raw[:n]

    # -- memory (KV cache) sequence operations -------------------------------------------------

    def clear(self) -> None:
        """Empty the memory (all sequences, data too)."""
        self._lib.llama_memory_clear(self._mem, True)

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        return bool(self._lib.llama_memory_seq_rm(self._mem, seq_id, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        self._lib.llama_memory_seq_cp(self._mem, src, dst, p0, p1)

    def seq_keep(self, seq_id: int) -> None:
        self._lib.llama_memory_seq_keep(self._mem, seq_id)

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        self._lib.llama_memory_seq_add(self._mem, seq_id, p0, p1, delta)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        self._lib.llama_memory_seq_div(self._mem, seq_id, p0, p1, d)

    def seq_pos_min(self, seq_id: int) -> int:
        return int(self._lib.llama_memory_seq_pos_min(self._mem, seq_id))

    def seq_pos_max(self, seq_id: int) -> int:
        return int(self._lib.llama_memory_seq_pos_max(self._mem, seq_id))

    # -- state (llama_state_*): blobs as bytes; a refused load gives 0, False or None -----------

    def state_get_data(self) -> bytes:
        buf = (ctypes.c_uint8 * self._lib.llama_state_get_size(self._ctx))()
        n = self._lib.llama_state_get_data(self._ctx, buf, len(buf))
        return bytes(buf)[:n]

    def state_set_data(self, data: bytes) -> int:
        return int(self._lib.llama_state_set_data(self._ctx, (ctypes.c_uint8 * len(data)).from_buffer_copy(data),
                                                  len(data)))

    def state_seq_get_data(self, seq_id: int) -> bytes:
        buf = (ctypes.c_uint8 * self._lib.llama_state_seq_get_size(self._ctx, seq_id))()
        n = self._lib.llama_state_seq_get_data(self._ctx, buf, len(buf), seq_id)
        return bytes(buf)[:n]

    def state_seq_set_data(self, data: bytes, dest_seq_id: int) -> int:
        src = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        return int(self._lib.llama_state_seq_set_data(self._ctx, src, len(data), dest_seq_id))

    def state_save_file(self, path: str | Path, tokens: Sequence[int]) -> bool:
        arr = (self._lib.llama_token * len(tokens))(*tokens)
        return bool(self._lib.llama_state_save_file(self._ctx, str(path).encode(), arr, len(tokens)))

    def state_load_file(self, path: str | Path, n_token_capacity: int) -> list[int] | None:
        arr, n = (self._lib.llama_token * n_token_capacity)(), ctypes.c_size_t(0)
        ok = self._lib.llama_state_load_file(self._ctx, str(path).encode(), arr, n_token_capacity, ctypes.byref(n))
        return list(arr[:n.value]) if ok else None

    def state_seq_save_file(self, path: str | Path, seq_id: int, tokens: Sequence[int]) -> int:
        arr = (self._lib.llama_token * len(tokens))(*tokens)
        return int(self._lib.llama_state_seq_save_file(self._ctx, str(path).encode(), seq_id, arr, len(tokens)))

    def state_seq_load_file(self, path: str | Path, dest_seq_id: int, n_token_capacity: int) -> list[int] | None:
        arr, n = (self._lib.llama_token * n_token_capacity)(), ctypes.c_size_t(0)
        read = self._lib.llama_state_seq_load_file(self._ctx, str(path).encode(), dest_seq_id, arr,
                                                   n_token_capacity, ctypes.byref(n))
        return list(arr[:n.value]) if read else None


class OracleContext:
    """The slice of llamir.Context that llamir.context.perplexity drives, backed by llama.cpp, so
    the same llama-perplexity loop can score llama.cpp's logits."""

    def __init__(self, oracle: LlamaCppOracle):
        self.oracle = oracle
        self.memory = self
        self.last_error = ""
        self._n_outputs = 0

    def clear(self, data: bool = True) -> None:
        self.oracle.clear()

    def decode(self, batch) -> int:
        flags = [bool(f) for f in batch.logits]
        self._n_outputs = sum(flags)
        return self.oracle.decode_batch(batch.tokens.tolist(), batch.pos.tolist(), batch.seq_ids, flags)

    def get_logits(self) -> np.ndarray:
        ptr = self.oracle._lib.llama_get_logits(self.oracle._ctx)
        return np.ctypeslib.as_array(ptr, shape=(self._n_outputs, self.oracle.n_vocab)).copy()


def llama_cpp_perplexity(model_path, tokens, bos, n_ctx: int, n_batch: int = 2048, n_ubatch: int = 512,
                         n_chunks: int = -1, flash_attn: bool = True, n_threads: int = 2):
    """llama-perplexity's number for `tokens`, with llama.cpp computing every logit."""
    from llamir.context.perplexity import perplexity

    oracles = []

    def make(n_ctx_total: int, batch: int, n_seq: int):
        o = LlamaCppOracle(model_path, n_ctx=n_ctx_total, n_batch=batch, n_ubatch=min(n_ubatch, batch),
                           n_seq_max=n_seq, flash_attn=flash_attn, n_threads=n_threads)
        oracles.append(o)
        return OracleContext(o)

    try:
        return perplexity(make, tokens, bos, n_ctx, n_batch, n_chunks)
    finally:
        for o in oracles:
            o.close()
