"""Property tests (issue 9): valid, invalid and failing batches and sequence operations against a
witness context that never sees what the subject refuses (llamir.testing.batch_fuzz).

Every refused decode or sequence operation leaves the subject's memory, K/V data, outputs and
state bytes exactly as before; every accepted one gives the witness's logits bit for bit; nothing
but a status comes out of decode. Three memories: one unified cache with three sequences, two
per-sequence streams (split_equal), and an iSWA cache whose window wraps (reused cells).
fuzz/fuzz_batch.py runs the same check for as long as it is given.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import llamir
from llamir.testing.batch_fuzz import CONFIGS, CORRUPTIONS, FAULTS, BatchFuzzer, random_program, write_config_model

EXAMPLES = {"unified": 40, "streams": 30, "iswa": 10}
SEEDED = {"unified": 200, "streams": 160, "iswa": 50}    # programs from random_program, fixed seeds


@pytest.fixture(scope="module")
def fuzzers(tmp_path_factory):
    directory = tmp_path_factory.mktemp("batch_fuzz")
    return {name: BatchFuzzer(write_config_model(config, directory), config) for name, config in CONFIGS.items()}


def ops(config_name: str):
    config = CONFIGS[config_name]
    n_seq = config.kwargs["n_seq_max"]
    n_batch = config.kwargs["n_batch"]
    unified = config.kwargs["kv_unified"]
    n_ids = 256 if unified else n_seq
    seq = st.integers(0, n_seq - 1)
    ids = st.tuples(seq) | (st.lists(seq, min_size=2, max_size=3).map(tuple) if unified else st.nothing())
    part = st.tuples(ids, st.integers(1, 6) | st.integers(1, n_batch))
    corrupt = st.tuples(st.sampled_from(sorted(CORRUPTIONS)), st.integers(0, 999))
    fault = st.tuples(st.sampled_from(sorted(FAULTS)), st.sampled_from([0, 0, 1, 2]))
    trouble = st.sampled_from(["fault", "corrupt", "fault", "none"]).flatmap(
        lambda kind: st.tuples(corrupt if kind == "corrupt" else st.none(), fault if kind == "fault" else st.none()))
    decode = st.builds(lambda parts, interleave, logits, seed, tf: ("decode", parts, interleave, logits, seed, *tf),
                       st.lists(part, min_size=1, max_size=3), st.booleans(),
                       st.sampled_from(["last", "all", "none", "random"]), st.integers(0, 2**16), trouble)
    any_seq = seq | st.sampled_from([-1, -2, n_ids, 2**63, "0", 1.5])
    pos = st.integers(-1, 40) | st.sampled_from([2**31, -2**31 - 1])
    seq_op = st.one_of(
        st.tuples(st.just("seq"), st.just("seq_rm"), any_seq, pos, pos),
        st.tuples(st.just("seq"), st.just("seq_cp"), any_seq, any_seq, st.sampled_from([-1, 3]), st.just(-1)),
        st.tuples(st.just("seq"), st.just("seq_keep"), any_seq),
        st.tuples(st.just("seq"), st.just("seq_add"), any_seq, pos, pos,
                  st.integers(-8, 8) | st.sampled_from([2**31 - 1, 2**40])),
        st.tuples(st.just("seq"), st.just("seq_div"), any_seq, pos, pos, st.integers(-2, 3)),
        st.tuples(st.just("seq"), st.sampled_from(["seq_pos_min", "seq_pos_max"]), any_seq))
    fill = st.tuples(st.just("fill"), seq, st.integers(200, 300)) if config.sliding_window else st.nothing()
    return st.lists(st.one_of(decode, decode, seq_op, fill), min_size=1, max_size=8)


def _run(fuzzers, name, program):
    fuzzers[name].run([list(op) for op in program])


@settings(max_examples=EXAMPLES["unified"], deadline=None, suppress_health_check=list(HealthCheck))
@given(program=ops("unified"))
def test_unified_cache_programs(fuzzers, program):
    _run(fuzzers, "unified", program)


@settings(max_examples=EXAMPLES["streams"], deadline=None, suppress_health_check=list(HealthCheck))
@given(program=ops("streams"))
def test_per_sequence_streams_programs(fuzzers, program):
    _run(fuzzers, "streams", program)


@settings(max_examples=EXAMPLES["iswa"], deadline=None, suppress_health_check=list(HealthCheck))
@given(program=ops("iswa"))
def test_iswa_programs(fuzzers, program):
    _run(fuzzers, "iswa", program)


@pytest.mark.parametrize("name", sorted(SEEDED))
def test_seeded_random_programs(fuzzers, name):
    """The timed fuzzer's programs, a fixed number from fixed seeds: faults and corruptions are
    more frequent than in hypothesis's draws, and a failure names the program to replay."""
    fuzzer = fuzzers[name]
    rng = random.Random(f"llamir batch fuzz {name}")
    for _ in range(SEEDED[name]):
        fuzzer.run(random_program(rng, fuzzer))


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_fault_after_the_window_wrapped_puts_reused_cells_and_their_kv_back(fuzzers, fault):
    """The SWA cache reuses cells its sequence can no longer see; a failed batch that took such
    cells gives them back with their K/V rows (the state bytes compare those), then decodes on as
    the witness does."""
    fuzzer = fuzzers["iswa"]
    fuzzer.reset()
    fuzzer._fill(0, 300)                                   # 300 tokens through a 256-cell window cache
    swa = fuzzer.subject.memory.swa.v_cells[0]
    assert swa.get_used() == swa.size                      # every cell used: the next ones are reuses
    before = fuzzer.subject.state_get_data()
    fuzzer._decode([[(0,), 40]], False, "all", 7, None, (fault, 1))
    assert fuzzer.subject.state_get_data() == before
    fuzzer._decode([[(0,), 40]], False, "all", 7, None, None)    # accepted: the witness's logits
    fuzzer._same_state()


def test_the_fuzzer_counts_what_it_did(fuzzers):
    counts = fuzzers["unified"].counts
    assert counts["accepted"] > 0 and counts["refused"] > 0, counts


def test_numpy_backend_too(tmp_path):
    """The same check on the numpy reference (no compile step; the interpreter's own errors)."""
    config = CONFIGS["unified"]
    fuzzer = BatchFuzzer(write_config_model(config, tmp_path), config, backend="numpy")
    rng = random.Random(9)
    for _ in range(6):
        fuzzer.run(random_program(rng, fuzzer))
    assert np.sum(list(fuzzer.counts.values())) > 0
    assert isinstance(fuzzer.subject, llamir.Context)
