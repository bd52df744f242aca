"""Generic test helpers: the `nmse` error measure, golden-text files and the conformance models.

    def test_x(nmse, golden, conformance_model):
        assert nmse(got, want) < 1e-12
        golden("x.ir", text)            # pytest --update-golden rewrites tests/golden/x.ir
        path = conformance_model(case)  # a llamir.testing.conformance Case's GGUF, written once
"""

from __future__ import annotations

import difflib
import os
import pathlib
import tempfile
from collections.abc import Callable

import numpy as np
import pytest

GOLDEN_DIR = pathlib.Path(__file__).parent / "golden"

# The Vulkan plugin runs under the Khronos validation layer for the whole suite (its instance is
# made once per process, so this must hold before any test lists the backends); the loader wants
# a runtime directory.
os.environ.setdefault("LLAMIR_VULKAN_VALIDATE", "1")
# lavapipe compiles each shader variant with LLVM on its first dispatch (llvmpipe's gallivm); with
# its optimization passes off the cold test-backend-ops run on lavapipe takes 422 s instead of
# 570 s (2 Zen 1 cores, SPIR-V already compiled): the cases are small, so the slower shader code
# costs less than the passes. Set before any test loads the driver.
os.environ.setdefault("GALLIVM_PERF", "nopt")
# The CUDA plugin runs on its host emulator unless a GPU run asks for the driver
# (LLAMIR_CUDA_DRIVER=libcuda): the devices are listed once per process, so it is set here.
os.environ.setdefault("LLAMIR_CUDA_DRIVER", "emulator")
if not os.environ.get("XDG_RUNTIME_DIR"):
    os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="llamir-xdg-")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite tests/golden/* with the text the tests produce")


def nmse(actual: np.ndarray, expected: np.ndarray) -> float:
    """sum((a - b)^2) / sum(b^2), in float64; 0 when both are all zero. Shapes must match."""
    a = np.asarray(actual, dtype=np.float64)
    b = np.asarray(expected, dtype=np.float64)
    if a.shape != b.shape:
        raise AssertionError(f"shape {a.shape} != expected {b.shape}")
    err = float(np.sum((a - b) ** 2))
    ref = float(np.sum(b * b))
    if ref == 0.0:
        return 0.0 if err == 0.0 else float("inf")
    return err / ref


@pytest.fixture(scope="session")
def ggml():
    """llama.cpp's own libggml (llamir.testing.libggml), the op-level oracle; missing is a failure."""
    from llamir.testing.libggml import LibGgml

    lib = LibGgml.load()
    assert lib is not None, "llama-cpp-python (with its libggml), the oracle, is not installed"
    return lib


@pytest.fixture(name="nmse")
def nmse_fixture() -> Callable[[np.ndarray, np.ndarray], float]:
    return nmse


@pytest.fixture
def golden(request: pytest.FixtureRequest) -> Callable[[str, str], None]:
    """golden(name, text): assert `text` equals tests/golden/<name> (or rewrite it with
    --update-golden)."""
    update = request.config.getoption("--update-golden")

    def check(name: str, text: str) -> None:
        path = GOLDEN_DIR / name
        if update:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            return
        if not path.exists():
            pytest.fail(f"no golden file {path}; run pytest --update-golden to create it")
        want = path.read_text()
        if text != want:
            diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True),
                                                f"golden/{name}", "actual"))
            pytest.fail(f"output differs from golden/{name} (pytest --update-golden rewrites it):\n{diff}")

    return check


@pytest.fixture(scope="session")
def conformance_llvm():
    """The LLVM backend the architecture conformance tests share (the oracle build's numerics)."""
    from llamir.backends.llvm import LLVMBackend
    from llamir.testing.llama_cpp import oracle_numerics

    backend = LLVMBackend(n_threads=2, disk_cache=False, numerics=oracle_numerics())
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def conformance_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[object], pathlib.Path]:
    """case -> the GGUF of a llamir.testing.conformance Case, written once per session, so the
    reference and LLVM suites (and their memoised logits) share the same files."""
    from llamir.testing.conformance import case_model

    root = tmp_path_factory.mktemp("conformance")
    return lambda case: case_model(root, case)
