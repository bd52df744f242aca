"""The legacy quantized matmuls (q4_0, q4_1, q5_0, q5_1, q8_0) on 256-bit targets against the numpy
reference, bit for bit: AVX2 only (vpmaddubsw + vpmaddwd, Zen 3) and AVX2 + AVX-VNNI (vpdpbusd on
ymm), in both numerics profiles: packed weights, quantized KV caches (MatMulQDirect) and experts.
Corner bytes included: q8_0 weights of -128 (the one value vpmaddubsw's sign trick cannot take) and
NaN activations (which quantize to -128)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from shared_backends import shared_backend
from test_ops_matmul_quant import rows, weight  # the same weights and activations as the host's tests

from llamir.backends.llvm import LLVMBackend
from llamir.backends.llvm.target import AVX2_ONLY_DROPS, avx2_only_target, host_target, restricted_target
from llamir.ir import F32, I32, GraphBuilder, dtype_named, run_graph

f32 = np.float32
LEGACY = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"]
ROWS = (1, 2, 3, 4, 5, 7, 8, 13, 64)
HOST_AVXVNNI = host_target().has("avxvnni")


def isa_target(isa: str):
    """"avx2": Zen 3 (no AVX-512, VNNI or GFNI); "avxvnni": that with AVX-VNNI (needs a host that has it)."""
    if isa == "avx2":
        return avx2_only_target()
    return restricted_target(host_target(), tuple(d for d in AVX2_ONLY_DROPS if d != "avxvnni"))


def backend(profile: str, isa: str) -> LLVMBackend:
    if isa == "avxvnni" and not HOST_AVXVNNI:
        pytest.skip("the host has no AVX-VNNI (its code generation is checked by test_avxvnni_codegen)")
    return shared_backend(profile, isa_target(isa))


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(11)


def assert_same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    canon = f32(np.nan)
    got, want = np.where(np.isnan(got), canon, got), np.where(np.isnan(want), canon, want)
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape)
    differ = got.view(np.uint32) != want.view(np.uint32)
    assert not differ.any(), f"{what}: {int(differ.sum())} of {got.size} values differ"


def weight_graph(name: str, m: int, k: int):
    g = GraphBuilder("q", dims=["T"])
    g.output("y", g.mul_mat(g.weight("w", [m, k], dtype_named(name)), g.input("x", ["T", k], F32)))
    return g.graph


def check_rows(profile: str, isa: str, graph, w: np.ndarray, k: int, rng, spoil=None) -> None:
    run = backend(profile, isa).compile(graph)
    for n in ROWS:
        x = rows(rng, n, k)
        if spoil is not None:
            spoil(x)
        want = run_graph(graph, {"w": w, "x": x}, {"T": n}, numerics=profile)["y"]
        assert_same(run({"w": w, "x": x}, {"T": n})["y"], want, f"{profile} {isa} N={n}")


@pytest.mark.parametrize("isa", ["avx2", "avxvnni"])
@pytest.mark.parametrize("profile", ["avx512", "avx2"])
@pytest.mark.parametrize("name", LEGACY)
@pytest.mark.parametrize("m,k", [(64, 512), (40, 256)])     # ggml repacks q4_0 (M % 8 == 0), M % 16 != 0
def test_packed_weights(rng, isa, profile, name, m, k):
    check_rows(profile, isa, weight_graph(name, m, k), weight(rng, name, m, k), k, rng)


@pytest.mark.parametrize("isa", ["avx2", "avxvnni"])
@pytest.mark.parametrize("name", LEGACY)
def test_nan_and_inf_activations(rng, isa, name):
    """A NaN quantizes to -128 without reaching the block's amax: exact products against it."""
    def spoil(x):
        for r in range(x.shape[0]):
            x[r, rng.integers(0, x.shape[1], 1 + r % 3)] = (np.nan, np.inf, -np.inf)[r % 3]

    check_rows("avx2", isa, weight_graph(name, 40, 512), weight(rng, name, 40, 512), 512, rng, spoil)


@pytest.mark.parametrize("isa", ["avx2", "avxvnni"])
def test_q8_0_weights_of_minus_128(rng, isa):
    """-128 weight bytes (never made by ggml's quantizer, legal in a file) against negative
    activations: the sign trick would give +128 * x there (the int16 products take every byte)."""
    w = weight(rng, "q8_0", 48, 256)
    blocks = w.reshape(48, -1, 34)
    blocks[5, 2, 2 + 7] = 0x80
    blocks[17, 0, 2:34] = 0x80
    blocks[40, 7, 2 + 31] = 0x80

    def negative(x):
        x[:, :] = -np.abs(x)

    check_rows("avx2", isa, weight_graph("q8_0", 48, 256), w, 256, rng, negative)


def test_q8_0_pairs_layout(rng):
    """The AVX2 q8_0 layout: per (group, block, chunk, half of 8 rows), the rows' values 0 and 1,
    then their values 2 and 3, as signed bytes; then the 16 rows' f16 scales (zero rows past M)."""
    from llamir.backends.llvm.kernels.repack import Q8_0_PAIRS, G, repack

    m, k = 40, 256
    w = weight(rng, "q8_0", m, k)
    blocks = w.reshape(m, -1, 34)
    blocks[3, 1, 2 + 5] = 0x80
    packed = repack(w, Q8_0_PAIRS)
    assert packed.shape == (3, k // 32, 16 * 32 + 2 * G)
    for g, blk, c, h, pair, r, v in [(0, 0, 0, 0, 0, 0, 0), (0, 1, 1, 0, 0, 3, 1), (1, 3, 7, 1, 1, 7, 1),
                                     (2, 7, 4, 0, 1, 5, 0), (2, 2, 2, 1, 0, 1, 1), (1, 5, 3, 1, 1, 0, 0)]:
        row, value = 16 * g + 8 * h + r, 4 * c + 2 * pair + v
        want = blocks[row, blk, 2 + value] if row < m else 0
        assert packed[g, blk, 64 * c + 32 * h + 16 * pair + 2 * r + v] == want, (g, blk, c, h, pair, r, v)
    assert packed[0, 1, 64 * 1 + 2 * 3 + 1] == 0x80        # row 3, value 5: chunk 1, pair 0, second value
    for g, blk, r in [(0, 0, 0), (1, 4, 15), (2, 6, 7), (2, 6, 8)]:
        row = 16 * g + r
        want = blocks[row, blk, 0:2] if row < m else [0, 0]
        assert list(packed[g, blk, 512 + 2 * r:512 + 2 * r + 2]) == list(want), (g, blk, r)


@pytest.mark.parametrize("profile", ["avx512", "avx2"])
def test_q8_0_long_rows_and_many_groups(rng, profile):
    """Rows of K longer than one pass's block of K (and not a multiple of it), more weight groups than
    share one widening of the activations, every tile remainder: same bits as the reference."""
    from llamir.backends.llvm.kernels.matmul_quant import PAIRS_GROUP_BYTES, PAIRS_K_BLOCKS
    from llamir.backends.llvm.kernels.repack import Q8_0_PAIRS

    k = 32 * (PAIRS_K_BLOCKS + 13)
    per_block = PAIRS_GROUP_BYTES // ((k // 32) * Q8_0_PAIRS.block_bytes)
    m = 16 * (2 * per_block + 3) + 8
    check_rows(profile, "avx2", weight_graph("q8_0", m, k), weight(rng, "q8_0", m, k), k, rng)


@pytest.mark.parametrize("isa", ["avx2", "avxvnni"])
@pytest.mark.parametrize("name", LEGACY)
def test_quantized_kv_cache(rng, isa, name):
    """A quantized K cache (never repacked): vec_dot's lanes, raw blocks, -128 bytes and NaN q included."""
    g = GraphBuilder("kq", dims=["T"])
    k = g.input("k", [2, 43, 128], dtype_named(name))          # rows in fours and leftovers
    g.output("y", g.mul_mat(k, g.permute(g.input("q", ["T", 4, 128], F32), 1, 0, 2)))
    cache = weight(rng, name, 2, 43, 128)
    if name == "q8_0":
        cache.reshape(2, 43, -1, 34)[0, 3, 1, 2:10] = 0x80
        cache.reshape(2, 43, -1, 34)[1, 42, 0, 2:5] = 0x80
    run = backend("avx2", isa).compile(g.graph)
    for n in (1, 7):
        x = rows(rng, n, 4, 128)
        x[n - 1, 1, 5] = np.nan
        want = run_graph(g.graph, {"k": cache, "q": x}, {"T": n}, numerics="avx2")["y"]
        assert_same(run({"k": cache, "q": x}, {"T": n})["y"], want, f"{name} cache {isa} {n} tokens")


@pytest.mark.parametrize("isa", ["avx2", "avxvnni"])
@pytest.mark.parametrize("kind", ["weight", "input"])
@pytest.mark.parametrize("name", LEGACY)
def test_experts(rng, isa, kind, name):
    n_expert, m, k, n_tokens = 4, 32, 256, 9
    g = GraphBuilder("moe")
    leaf = g.weight if kind == "weight" else g.input
    e = leaf("e", [n_expert, m, k], dtype_named(name))
    g.output("y", g.mul_mat_id(e, g.input("x", [n_tokens, 1, k], F32), g.input("ids", [n_tokens, 2], I32)))
    values = {"e": weight(rng, name, n_expert, m, k), "x": rows(rng, n_tokens, 1, k),
              "ids": rng.integers(0, n_expert, (n_tokens, 2)).astype(np.int32)}
    want = run_graph(g.graph, values, numerics="avx2")["y"]
    assert_same(backend("avx2", isa).compile(g.graph)(values, {})["y"], want, f"{name} experts ({kind})")


_CODEGEN = """
from llamir.backends.llvm import LLVMBackend
from llamir.backends.llvm.target import Target, avx2_only_target
from llamir.ir import F32, GraphBuilder, dtype_named
base = avx2_only_target()
t = Target(base.triple, base.cpu, base.features.replace("-avxvnni", "+avxvnni"))
assert t.vnni and not t.vnni512, t.features
be = LLVMBackend(n_threads=1, disk_cache=False, numerics="avx2", target=t)
for name in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0"):
    g = GraphBuilder("q", dims=["T"])
    g.output("y", g.mul_mat(g.weight("w", [40, 256], dtype_named(name)), g.input("x", ["T", 256], F32)))
    be.compile(g.graph)
print("compiled")
"""


def test_avxvnni_codegen():
    """The AVX-VNNI kernels compile for a target that has it (in a subprocess: an instruction LLVM
    cannot select aborts the process), whether or not this host could run them."""
    done = subprocess.run([sys.executable, "-c", _CODEGEN], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-2000:]


@pytest.mark.parametrize("profile", ["avx2", "avx512"])
def test_q8_0_model_reproduces_the_recorded_builds(tmp_path, profile):
    """A whole q8_0 model on the Zen 3 target gives the logits recorded from that profile's x86 build
    of llama.cpp (tests/data/oracle_logits, see tests/context/test_recorded_builds.py), bit for bit."""
    import hashlib
    from pathlib import Path

    import llamir
    from llamir.frontend.synth import SynthSpec, write_model

    name = "llama-q8_0-f32kv"
    with np.load(Path(__file__).parents[2] / "data" / "oracle_logits" / f"{profile}.npz") as f:
        digest, want = str(f[f"{name}/sha256"]), f[f"{name}/batch"]
    path = write_model(tmp_path / f"{name}.gguf", SynthSpec(arch="llama", dtype="q8_0", n_embd=256, n_ff=512, seed=16))
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest, "synth wrote a different file"
    prompt = [int(t) for t in np.random.RandomState(5).randint(3, 500, size=40)]
    ctx = llamir.Context(llamir.load_model(path), backend=backend(profile, "avx2"), numerics=profile, n_ctx=256,
                         n_batch=64, n_ubatch=64, flash_attn="off", type_k="f32", type_v="f32")
    assert ctx.decode(llamir.Batch.from_tokens(prompt, logits="all")) == 0, ctx.last_error
    assert_same(ctx.get_logits().copy(), want, f"q8_0 model, {profile} profile, AVX2-only target")
