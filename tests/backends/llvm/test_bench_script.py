"""bench/bench_llvm.py end to end on a tiny model: both engines measured in alternating rounds,
the best of each reported with every round kept, and the table printed (no times asserted)."""

import importlib.util
from pathlib import Path

import pytest

from llamir.frontend.synth import SynthSpec, write_model

pytestmark = pytest.mark.llama_cpp


def _bench_module():
    path = Path(__file__).parents[3] / "bench" / "bench_llvm.py"
    spec = importlib.util.spec_from_file_location("bench_llvm", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_rounds_and_table(tmp_path):
    bench = _bench_module()
    path = write_model(tmp_path / "tiny.gguf", SynthSpec(n_layer=1, dtype="q8_0"))
    report = bench.run({"tiny": path}, threads=1, reps=1, rounds=2)
    entry = report["models"]["tiny"]
    for label, _, _ in bench.TESTS:
        key = "pp_tps" if label.startswith("pp") else "tg_tps"
        for engine in ("llamir", "llama.cpp"):
            result = entry[label][engine]
            assert len(result["rounds_" + key]) == 2
            assert result[key] == max(result["rounds_" + key]) > 0
    assert entry["weight_bytes_per_token"] > 0 and entry["compile_s"]["warm"] > 0
    text = bench.table(report)
    assert "tiny" in text and "tg128" in text and "roofline" in text
