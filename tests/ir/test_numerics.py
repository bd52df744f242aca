"""Numerics profiles: names, the host default (the build llama.cpp makes for this CPU), and the
LLAMIR_NUMERICS override."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from llamir.ir.numerics import AVX2, AVX512, PROFILES, numerics_named


def _default(env: dict) -> subprocess.CompletedProcess:
    code = "from llamir.ir.numerics import host_numerics; print(host_numerics())"
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True)


def test_profiles_by_name():
    assert PROFILES == {"avx512": AVX512, "avx2": AVX2}
    assert (AVX512.lanes, AVX512.step, AVX2.lanes, AVX2.step) == (16, 64, 8, 32)
    assert numerics_named("avx2") is AVX2 and numerics_named(AVX512) is AVX512
    with pytest.raises(ValueError, match="unknown numerics profile 'neon'; choose one of avx512, avx2"):
        numerics_named("neon")


def test_host_default_follows_the_cpu_flags_llama_cpp_builds_for():
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split()
    want = "avx512" if "avx512f" in flags else "avx2"
    assert _default({"LLAMIR_NUMERICS": ""}).stdout.strip() == want


def test_environment_override():
    assert _default({"LLAMIR_NUMERICS": "avx2"}).stdout.strip() == "avx2"
    assert _default({"LLAMIR_NUMERICS": "avx512"}).stdout.strip() == "avx512"
    bad = _default({"LLAMIR_NUMERICS": "sse2"})
    assert bad.returncode != 0 and "LLAMIR_NUMERICS='sse2' is not a numerics profile" in bad.stderr
