"""Property tests: mutated state blobs and files (llamir.testing.state_fuzz: bit flips,
truncations, extensions, rewrites of positions, seq ids, counts, types, sizes and versions) either
load as llama.cpp loads the same bytes (same state bytes, sequence ranges and next logits), or
raise StateError and leave the context bit for bit as a witness that never saw them. Bounded to a
few seconds per context layout; fuzz/fuzz_state.py runs the same generator for as long as asked.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamir.testing.state_fuzz import HypothesisChooser, draw_case, standard_envs

pytestmark = pytest.mark.llama_cpp

# cases per layout: a case costs about 40 ms (flash attention's numpy reference: 130 ms)
EXAMPLES = {"llama-streams": 70, "llama-unified-fa": 30, "gemma3-iswa": 70}


@pytest.fixture(scope="module")
def env_of(tmp_path_factory):
    makers, made = standard_envs(tmp_path_factory.mktemp("state_fuzz")), {}

    def get(name: str):
        if name not in made:
            made[name] = makers[name]()
        return made[name]

    yield get
    for env in made.values():
        env.close()


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_mutated_states_load_like_llama_cpp_or_change_nothing(env_of, name):
    env = env_of(name)
    outcomes: Counter[str] = Counter()

    @settings(max_examples=EXAMPLES[name], deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def run(data):
        outcomes[env.check(draw_case(HypothesisChooser(data), env.good, env.fields))] += 1

    run()
    assert outcomes["refused"] and outcomes["loaded"], outcomes   # both sides of the property were exercised
