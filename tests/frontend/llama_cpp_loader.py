"""llama.cpp's own loader as the oracle of what a GGUF file may be: `llama_model_load_from_file`
(and optionally one decode) in a subprocess, since a bad file can make llama.cpp abort."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

_CHILD = r'''
import ctypes, math, sys
import llama_cpp

logs = []
callback = llama_cpp.llama_log_callback(lambda level, text, data: logs.append(text.decode(errors="replace")))
llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
llama_cpp.llama_backend_init()
params = llama_cpp.llama_model_default_params()
params.n_gpu_layers = 0
params.vocab_only = sys.argv[2] == "1"
model = llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), params)
errors = [line for line in "".join(logs).splitlines() if "error" in line or "failed" in line]
print("LOADED" if model else "REFUSED", " | ".join(errors[-2:]), flush=True)
if model and sys.argv[3] == "1":
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_threads = 64, 8, 1
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    batch = llama_cpp.llama_batch_get_one((llama_cpp.llama_token * 3)(1, 2, 3), 3)
    rc = llama_cpp.llama_decode(ctx, batch) if ctx else -99
    finite = False
    if rc == 0:
        n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        logits = llama_cpp.llama_get_logits_ith(ctx, -1)
        finite = all(math.isfinite(logits[i]) for i in range(n_vocab))
    print("DECODED", rc, "finite" if finite else "nonfinite", flush=True)
'''


@dataclass(frozen=True)
class LlamaCppLoad:
    """What llama.cpp made of a file: loaded or refused (or aborted: crashed), and one decode."""

    loaded: bool
    crashed: bool          # the process died (GGML_ASSERT / abort) before or while decoding
    log: str               # llama.cpp's last error lines
    decode_rc: int | None = None
    finite_logits: bool | None = None


def llama_cpp_load(path: str | Path, *, decode: bool = False, vocab_only: bool = False) -> LlamaCppLoad:
    """Load `path` with llama.cpp in a fresh process (and decode 3 tokens when `decode`)."""
    env = os.environ | {"GGML_NO_BACKTRACE": "1"}   # an abort would otherwise attach gdb, slowly
    run = subprocess.run([sys.executable, "-c", _CHILD, str(path), "1" if vocab_only else "0",
                          "1" if decode else "0"], capture_output=True, text=True, timeout=300, env=env)
    lines = run.stdout.splitlines()
    status = next((line for line in lines if line.startswith(("LOADED", "REFUSED"))), None)
    if status is None:
        return LlamaCppLoad(False, True, run.stderr[-500:])
    decoded = next((line.split() for line in lines if line.startswith("DECODED")), None)
    if decode and status.startswith("LOADED") and decoded is None:
        return LlamaCppLoad(True, True, run.stderr[-500:])
    return LlamaCppLoad(status.startswith("LOADED"), False, status.partition(" ")[2],
                        int(decoded[1]) if decoded else None, decoded[2] == "finite" if decoded else None)
