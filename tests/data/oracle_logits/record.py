"""Record llama.cpp's logits on the models of tests/context/test_recorded_builds.py, from whichever
llama-cpp-python build is importable, into <profile>.npz beside this file.

Both builds run on an AVX-512 host: the installed AVX-512 wheel, and an AVX2-only one built into
a directory of its own, e.g.

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
        -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
        pip install --no-cache-dir --no-deps --target /tmp/avx2 llama-cpp-python==0.3.36
    python tests/data/oracle_logits/record.py                         # avx512.npz
    PYTHONPATH=/tmp/avx2 python tests/data/oracle_logits/record.py    # avx2.npz

Each file holds, per model, the GGUF's sha256 (the test regenerates the file and checks it) and
the logits of every feeding the test compares.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent


def main() -> int:
    spec = importlib.util.spec_from_file_location("recorded", HERE.parents[1] / "context" / "test_recorded_builds.py")
    recorded = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = recorded   # dataclasses look their module up there
    spec.loader.exec_module(recorded)
    from llamir.frontend.synth import write_model
    from llamir.testing.llama_cpp import oracle_numerics

    profile = oracle_numerics().name
    arrays: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, model in recorded.MODELS.items():
            path = write_model(Path(tmp) / f"{name}.gguf", model.spec)
            arrays[f"{name}/sha256"] = np.array(hashlib.sha256(path.read_bytes()).hexdigest())
            for feed in recorded.FEEDS:
                arrays[f"{name}/{feed}"] = recorded.llama_cpp_feed(path, model, feed)
    out = HERE / f"{profile}.npz"
    np.savez_compressed(out, **arrays)
    print(f"wrote {out} ({out.stat().st_size} bytes) from llama.cpp built for {profile}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
