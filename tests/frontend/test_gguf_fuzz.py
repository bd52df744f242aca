"""Property tests: a mutated GGUF file either loads into a usable model or is refused with
ModelError, never another exception, a hang or a huge allocation.

The mutations start from small valid files written by llamir.frontend.synth and are made on the
container's own records (gguf_craft, independent of llamir's reader): flipped header bytes,
truncations, lying counts, metadata values rewritten (their type, their contents, or plausible
values of the right type), duplicated keys and tensors, moved offsets, reshaped or re-typed
tensors, extra tensors. A model that loads must decode three tokens on the numpy backend.
fuzz/fuzz_gguf.py runs the same property coverage-guided (atheris) for as long as you like.
"""

from __future__ import annotations

import collections
import importlib.util
import math
import random
import struct
import time
import tracemalloc
from pathlib import Path

import pytest
from gguf_craft import ARRAY, BOOL, F32, F64, KV, SCALAR_FMT, STRING, U8, U32, Gguf, TensorInfo, parse, string
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import llamir
from llamir.frontend.model import ModelError, load_model
from llamir.frontend.synth import SynthSpec, write_model

TINY = dict(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, n_vocab=300)
SEED_SPECS = {
    "llama": SynthSpec(arch="llama", **TINY),
    "qwen2-q8_0": SynthSpec(arch="qwen2", dtype="q8_0", **TINY),
    "qwen3-f16": SynthSpec(arch="qwen3", dtype="f16", tied=True, **TINY),
    "gemma3-swa": SynthSpec(arch="gemma3", **(TINY | {"n_layer": 2}), sliding_window=8, swa_pattern=2),
}
# NaN/inf hparams that llama.cpp accepts make numpy warn while decoding; the property is about errors
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
MAX_PARSE_BYTES = 64 << 20      # what loading may allocate (the seeds are ~100 KB; tensors are mapped)
MAX_SECONDS = 20                # per case: a hang shows as far more
FUZZ = settings(max_examples=250, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> dict[str, bytes]:
    folder = tmp_path_factory.mktemp("seeds")
    return {name: write_model(folder / f"{name}.gguf", spec).read_bytes() for name, spec in SEED_SPECS.items()}


@pytest.fixture(scope="module")
def case_path(tmp_path_factory):
    return tmp_path_factory.mktemp("cases") / "case.gguf"


def check_loads_or_refuses(path) -> str:
    """The property: ModelError, or a model that decodes; bounded time and allocation."""
    start = time.perf_counter()
    tracemalloc.start()
    try:
        model = load_model(path)
    except ModelError as err:
        assert str(err), "a refusal must say why"
        return "refused"
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < MAX_PARSE_BYTES, f"loading allocated {peak} bytes"
    ctx = llamir.Context(model, n_ctx=32, n_batch=8, backend="numpy")
    n_vocab = model.hparams.n_vocab
    rc = ctx.decode(llamir.Batch.from_tokens([t % n_vocab for t in (1, 2, 3)]))
    assert rc == 0, f"decode returned {rc}: {ctx.last_error}"
    assert ctx.get_logits().shape == (1, n_vocab)
    assert time.perf_counter() - start < MAX_SECONDS
    return "loaded"


# ------------------------------------------------------------------ mutations of the container

def _scalar_value(draw, vtype: int) -> bytes:
    fmt = SCALAR_FMT[vtype]
    if vtype in (F32, F64):
        return struct.pack(fmt, draw(st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -1.0, 1e-5, 1e30])))
    if vtype == BOOL:
        return bytes([draw(st.sampled_from([0, 1, 2, 255]))])
    return draw(st.binary(min_size=struct.calcsize(fmt), max_size=struct.calcsize(fmt)))


def _any_value(draw) -> tuple[int, bytes]:
    """A value of any GGUF type id, valid ones and not (arrays of arrays in gguf-py's layout too)."""
    vtype = draw(st.sampled_from([*SCALAR_FMT, STRING, ARRAY, 13, -1]))
    if vtype in SCALAR_FMT:
        return vtype, _scalar_value(draw, vtype)
    if vtype == STRING:
        return vtype, string(draw(st.binary(max_size=12)))
    if vtype != ARRAY:
        return vtype, b""
    item = draw(st.sampled_from([*SCALAR_FMT, STRING, ARRAY, 13]))
    count = draw(st.sampled_from([0, 1, 2, 300, 2**32, 2**62]))
    head = struct.pack("<iQ", item, count)
    if item == STRING:
        return vtype, head + b"".join(string(b"ab") for _ in range(min(count, 4)))
    if item == ARRAY:   # gguf-py writes each inner array as item type, count, items
        return vtype, head + struct.pack("<iQ", U32, 1) + struct.pack("<I", 7)
    if item not in SCALAR_FMT:
        return vtype, head
    size = struct.calcsize(SCALAR_FMT[item])
    return vtype, head + draw(st.binary(min_size=0, max_size=size * min(count, 64)))


def _typed_value(draw, kv: KV) -> bytes:
    """A plausible but wrong value of the same type: the hparams' range edges, odd vocab arrays."""
    if kv.vtype == U32:
        return struct.pack("<I", draw(st.sampled_from([0, 1, 2, 3, 5, 7, 8, 16, 31, 33, 64, 299, 300, 301, 511, 512,
                                                       513, 2**31, 2**32 - 1])))
    if kv.vtype in (F32, BOOL):
        return _scalar_value(draw, kv.vtype)
    if kv.vtype == STRING:
        return string(draw(st.sampled_from(["", "llama", "gpt2", "bert", "qwen2", "gemma3", "yarn", "none",
                                             "longrope", "\0", "<|im_start|>"])))
    if kv.vtype != ARRAY:
        return kv.raw
    item, count = struct.unpack_from("<iQ", kv.raw)
    keep = draw(st.integers(0, count + 3))
    if item == STRING:
        items, pos = [], 12
        for _ in range(count):
            (n,) = struct.unpack_from("<Q", kv.raw, pos)
            items.append(kv.raw[pos + 8:pos + 8 + n])
            pos += 8 + n
        items = (items * 2)[:keep]
        if items and draw(st.booleans()):
            items[draw(st.integers(0, len(items) - 1))] = draw(st.sampled_from([b"", b" ", b"\n", b"\xff", items[0]]))
        return struct.pack("<iQ", item, len(items)) + b"".join(string(x) for x in items)
    size = struct.calcsize(SCALAR_FMT[item])
    body = (kv.raw[12:] * 2)[:keep * size]
    return struct.pack("<iQ", item, len(body) // size) + body


@st.composite
def metadata_mutation(draw, g: Gguf) -> Gguf:
    g = g.copy()
    i = draw(st.integers(0, len(g.kvs) - 1))
    kv = g.kvs[i]
    how = draw(st.sampled_from(["typed", "typed", "retype", "drop", "duplicate", "rename", "alignment"]))
    if how == "typed":
        g.kvs[i] = KV(kv.key, kv.vtype, _typed_value(draw, kv))
    elif how == "retype":
        g.kvs[i] = KV(kv.key, *_any_value(draw))
    elif how == "drop":
        del g.kvs[i]
    elif how == "duplicate":
        g.kvs.insert(draw(st.integers(0, len(g.kvs))), kv)
    elif how == "rename":
        key = draw(st.sampled_from([b"", kv.key + b"\0x", kv.key.upper(), b"\xff\xfe", b"general.alignment"]))
        g.kvs[i] = KV(key, kv.vtype, kv.raw)
    else:
        vtype = draw(st.sampled_from([U32, U8, BOOL, F32, STRING]))
        value = draw(st.sampled_from([0, 1, 8, 16, 32, 48, 64, 255]))
        if vtype == STRING:
            raw = string(str(value))
        elif vtype == BOOL:
            raw = bytes([value & 1])
        else:
            raw = struct.pack(SCALAR_FMT[vtype], float(value) if vtype == F32 else value)
        g = g.set("general.alignment", vtype, raw)
    return g


@st.composite
def tensor_mutation(draw, g: Gguf) -> Gguf:
    g = g.copy()
    i = draw(st.integers(0, len(g.tensors) - 1))
    t = g.tensors[i]
    how = draw(st.sampled_from(["offset", "ne", "dims", "ggml_type", "drop", "duplicate", "extra", "rename"]))
    if how == "offset":
        t.offset = draw(st.sampled_from([0, t.offset + 32, max(0, t.offset - 32), t.offset + 1, len(g.blob), 2**63]))
    elif how == "ne":
        t.ne[draw(st.integers(0, len(t.ne) - 1))] = draw(st.sampled_from([0, 1, 2, 7, 64, -1, 2**40, 2**62]))
    elif how == "dims":
        t.ne = draw(st.sampled_from([[], t.ne + [1], t.ne + [1, 1, 1], t.ne[::-1]]))
    elif how == "ggml_type":
        t.ggml_type = draw(st.sampled_from([0, 1, 2, 4, 8, 12, 16, 30, 31, 39, 42, 43, -1]))
    elif how == "drop":
        del g.tensors[i]
    elif how == "duplicate":
        g.tensors.insert(draw(st.integers(0, len(g.tensors))), TensorInfo(t.name, list(t.ne), t.ggml_type, t.offset))
    elif how == "extra":
        name = draw(st.sampled_from([b"foo.weight", b"blk.0.ffn_up.bias", b"blk.9.attn_norm.weight",
                                     b"rope_freqs.weight", b"output.bias", b"x" * 63]))
        g.tensors.append(TensorInfo(name, [8], 0, len(g.blob)))
        g.blob += bytes(32)
    else:
        t.name = draw(st.sampled_from([b"", t.name + b"\0", b"x" * 64, g.tensors[0].name]))
    return g


@st.composite
def byte_mutation(draw, data: bytes, header_size: int) -> bytes:
    how = draw(st.sampled_from(["flip", "flip", "truncate", "count"]))
    if how == "truncate":
        return data[:draw(st.integers(0, len(data) - 1))]
    if how == "count":
        at = draw(st.sampled_from([8, 16]))   # n_tensors, n_kv
        value = draw(st.sampled_from([-1, 0, 1, 2**31, 2**40, 2**63 - 1]))
        delta = draw(st.sampled_from([None, -1, 1]))
        (old,) = struct.unpack_from("<q", data, at)
        return data[:at] + struct.pack("<q", old + delta if delta else value) + data[at + 8:]
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 8))):
        pos = draw(st.integers(0, header_size - 1))
        out[pos] ^= 1 << draw(st.integers(0, 7))
    return bytes(out)


@FUZZ
@given(data=st.data())
def test_metadata_rewrites_load_or_are_refused(seeds, case_path, data):
    g = parse(seeds[data.draw(st.sampled_from(sorted(seeds)))])
    for _ in range(data.draw(st.integers(1, 3))):
        g = data.draw(metadata_mutation(g))
    case_path.write_bytes(g.to_bytes())
    check_loads_or_refuses(case_path)


@FUZZ
@given(data=st.data())
def test_tensor_info_mutations_load_or_are_refused(seeds, case_path, data):
    g = parse(seeds[data.draw(st.sampled_from(sorted(seeds)))])
    for _ in range(data.draw(st.integers(1, 2))):
        g = data.draw(tensor_mutation(g))
    case_path.write_bytes(g.to_bytes())
    check_loads_or_refuses(case_path)


@FUZZ
@given(data=st.data())
def test_flipped_truncated_and_lying_files_load_or_are_refused(seeds, case_path, data):
    raw = seeds[data.draw(st.sampled_from(sorted(seeds)))]
    header_size = len(raw) - len(parse(raw).blob)
    case_path.write_bytes(data.draw(byte_mutation(raw, header_size)))
    check_loads_or_refuses(case_path)


def test_the_seeds_load_and_decode(seeds, case_path):
    for data in seeds.values():
        case_path.write_bytes(data)
        assert check_loads_or_refuses(case_path) == "loaded"


def test_the_atheris_fuzzers_property_and_record_mutator_run_here(tmp_path):
    """fuzz/fuzz_gguf.py's seeds, property and record-level mutator (atheris is needed only to fuzz)."""
    spec = importlib.util.spec_from_file_location("fuzz_gguf", Path(__file__).parents[2] / "fuzz" / "fuzz_gguf.py")
    fuzz_gguf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fuzz_gguf)
    assert fuzz_gguf.seed_corpus(tmp_path) == len(fuzz_gguf.SEED_SPECS)
    seeds = sorted(tmp_path.iterdir())
    assert fuzz_gguf.replay([str(p) for p in seeds]) == 0
    rng = random.Random(0)
    outcomes = collections.Counter()
    for _ in range(200):
        data = fuzz_gguf.mutate_records(rng.choice(seeds).read_bytes(), rng)
        outcomes[fuzz_gguf.check(data).partition(":")[0]] += 1
    assert outcomes["refused"] > 0 and outcomes["loaded"] > 0, outcomes
