"""`llamir bench --isa`: the LLVM target and numerics an emulated AVX2-only CPU gets, and llama.cpp
measured from the AVX2-only build in a subprocess (no times asserted)."""

from __future__ import annotations

import json

import pytest

from llamir.backends.llvm.target import AVX2_ONLY_DROPS
from llamir.cli import main
from llamir.cli_bench import cpu_isa, llama_cpp_build, llvm_options
from llamir.frontend.synth import SynthSpec, write_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("bench") / "tiny.gguf", SynthSpec(n_layer=1, dtype="q8_0"))


def test_avx2_options_drop_avx512_vnni_and_gfni():
    options = llvm_options("avx2")
    target = options["target"]
    assert options["numerics"] == "avx2"
    assert not target.avx512 and not target.vnni and target.has("avx2") and target.fma
    assert not any(f.startswith(AVX2_ONLY_DROPS) for f in target.feature_set)
    assert not target.has("avx10.1") and not target.has("gfni")
    assert llvm_options("host") == {}
    with pytest.raises(ValueError, match="unknown isa"):
        llvm_options("sse2")


def test_cpu_isa_names_the_vector_flags():
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split()
    text = cpu_isa()
    assert ("avx2" in text) == ("avx2" in flags) and ("avx512f" in text) == ("avx512f" in flags)


def test_bench_isa_avx2_llamir(tiny, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("LLAMIR_CACHE_DIR", str(tmp_path))
    assert main(["bench", str(tiny), "-p", "8", "-n", "2", "--reps", "1", "--threads", "1", "--isa", "avx2",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["extra"]["isa"].endswith("avx2, numerics avx2") and out["tg_tps"] > 0


@pytest.mark.llama_cpp
def test_bench_isa_avx2_llama_cpp(tiny, capsys):
    try:
        build = llama_cpp_build("avx2")
    except RuntimeError as err:
        pytest.skip(str(err))
    assert main(["bench", str(tiny), "-p", "8", "-n", "2", "--reps", "1", "--threads", "1", "--isa", "avx2",
                 "--backend", "llama.cpp", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "AVX2 = 1" in out["extra"]["system_info"] and "AVX512 = 1" not in out["extra"]["system_info"]
    if build is not None:
        assert out["extra"]["llama_cpp"].startswith(build)
    assert out["pp_tps"] > 0 and out["tg_tps"] > 0


def test_bench_isa_avx2_only_for_llvm(tiny, capsys):
    assert main(["bench", str(tiny), "-n", "1", "-p", "0", "--backend", "numpy", "--isa", "avx2"]) == 1
    assert "applies to the llvm backend" in capsys.readouterr().err
