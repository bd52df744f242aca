"""The CUDA plugin as llamir sees it: found through its entry point, listed by `llamir backends`,
unusable with the reason where there is no driver, and its emulated device."""

from __future__ import annotations

import os
import subprocess
import sys

import llamir_cuda
import numpy as np

from llamir.backends import backend_from_spec, get_backend
from llamir.cli import main


def _cli(*args, **env):
    run = {k: v for k, v in os.environ.items() if not k.startswith("LLAMIR_CUDA")}
    run.update(env)
    return subprocess.run([sys.executable, "-m", "llamir.cli", *args], capture_output=True, text=True, env=run)


def test_found_through_the_entry_point_and_listed(cuda, capsys):
    assert cuda.name == "cuda" and not cuda.is_cpu and not cuda.device.buffer_type().is_host
    assert llamir_cuda.driver_name() == "emulator"  # tests/conftest.py
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "cuda:0  cuda0" in out and "llamir SIMT emulator" in out


def test_without_a_driver_cuda_is_listed_unusable_with_the_reason():
    """No libcuda (here: a path that does not exist, as on a machine without NVIDIA's driver):
    `llamir backends` lists cuda0 as not usable and says why; asking for it fails with that."""
    env = {"LLAMIR_CUDA_LIBRARY": "/nonexistent/libcuda.so.1"}
    listed = _cli("backends", **env)
    assert listed.returncode == 0, listed.stderr
    line = next(ln for ln in listed.stdout.splitlines() if "cuda0" in ln)
    assert "not usable" in line and "/nonexistent/libcuda.so.1" in line, line
    asked = _cli("test-backend-ops", "-b", "cuda", "-o", "add", **env)
    assert asked.returncode != 0 and "/nonexistent/libcuda.so.1" in asked.stdout + asked.stderr


def test_an_unknown_driver_name_is_a_reason_too():
    listed = _cli("backends", LLAMIR_CUDA_DRIVER="opencl")
    line = next(ln for ln in listed.stdout.splitlines() if "cuda0" in ln)
    assert "not usable" in line and "LLAMIR_CUDA_DRIVER must be one of libcuda, emulator" in line, line




def test_backend_options_from_a_spec(cuda):
    be = backend_from_spec("cuda:0:offload=8:graphs=off")
    assert (be.name, be.offload_batch, be.use_graphs) == ("cuda", 8, False)
    assert get_backend("cuda").use_graphs is True


def test_async_copies_through_the_pinned_arena(cuda):
    """Host -> device copies staged in the backend's pinned arena: more than it holds (it drains
    the stream and reuses itself) and more than one copy at once (it grows); all land."""
    from llamir.backends import TensorData

    rng = np.random.default_rng(0)
    buf = cuda.device.buffer_type().alloc_buffer(8 << 20)
    chunks = [rng.integers(0, 255, n, dtype=np.uint8) for n in (700_000, 700_000, 3_000_000, 5, 1_500_000)]
    offset = 0
    for chunk in chunks:
        td = TensorData(buf, offset, (chunk.size,), np.dtype(np.uint8), (1,), chunk.size)
        cuda.set_tensor_async(td, chunk)
        offset += chunk.size
    cuda.synchronize()
    np.testing.assert_array_equal(buf.get_bytes(0, offset), np.concatenate(chunks))
    assert cuda._arena.nbytes >= 3_000_000
