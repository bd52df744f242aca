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
    bandwidths = entry["tg_bandwidth_GBps"]     # measured again before each tg round; the best one is the roof
    assert len(bandwidths) == 2 and entry["roofline_tg_tps"] == max(bandwidths) * 1e9 / entry["weight_bytes_per_token"]
    compile_s = entry["compile_s"]
    assert entry["weight_bytes_per_token"] > 0 and min(compile_s["cold"], compile_s["warm"], compile_s["disk"]) > 0
    assert "miss" in compile_s["cold_detail"][0]["cache"]        # cold starts from an empty cache dir
    assert all(c["cache"] == "hit" for c in compile_s["disk_detail"])
    text = bench.table(report)
    assert "tiny" in text and "tg128" in text and "roofline" in text and "%" in text
    assert "isa host" in text and "llama.cpp installed: CPU :" in text and "LLVM target" in text


def test_bench_at_a_depth(tmp_path):
    """--depth: the same tests with that many tokens in the cache first, for both engines, labelled."""
    bench = _bench_module()
    path = write_model(tmp_path / "tiny.gguf", SynthSpec(n_layer=1, dtype="q8_0"))
    report = bench.run({"tiny": path}, threads=1, reps=1, rounds=1, depth=24)
    entry = report["models"]["tiny"]
    assert [label for label, _, _ in bench.tests(24)] == ["pp128@d24", "pp512@d24", "tg128@d24"]
    for label, _, _ in bench.tests(24):
        for engine in ("llamir", "llama.cpp"):
            assert entry[label][engine]["depth"] == 24
    assert entry["tg128@d24"]["llama.cpp"]["tg_tps"] > 0 and entry["tg128@d24"]["llamir"]["extra"]["token_ms"] > 0
    assert "tg128@d24" in bench.table(report)


def test_bench_avx2_emulation(tmp_path):
    """--isa avx2: llamir without AVX-512 and the avx2 profile, llama.cpp from an AVX2-only build."""
    bench = _bench_module()
    try:
        build = bench.llama_cpp_build("avx2")
    except RuntimeError as err:
        pytest.skip(str(err))
    path = write_model(tmp_path / "tiny.gguf", SynthSpec(n_layer=1, dtype="q4_0"))
    report = bench.run({"tiny": path}, threads=1, reps=1, rounds=1, isa="avx2")
    isa = report["isa"]
    assert "avx512" not in isa["llamir"] and "numerics avx2" in isa["llamir"]
    assert "AVX2 = 1" in isa["llama.cpp"] and "AVX512 = 1" not in isa["llama.cpp"]
    tg = report["models"]["tiny"]["tg128"]["llama.cpp"]
    assert "AVX512 = 1" not in tg["extra"]["system_info"] and tg["tg_tps"] > 0
    if build is not None:
        assert tg["extra"]["llama_cpp"].startswith(build)
    assert "isa avx2" in bench.table(report)
