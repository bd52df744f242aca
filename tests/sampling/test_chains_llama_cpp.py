"""Whole sampler chains against llama.cpp's: with the same seed, 150 steps of apply + accept pick the
same tokens (the history samplers see every pick), and a clone taken midway continues identically."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_same_candidates

import llamir
from llamir.sampling import (
    XTC,
    Chain,
    Dist,
    Dry,
    Greedy,
    LogitBias,
    MinP,
    Mirostat,
    MirostatV2,
    Penalties,
    Temp,
    TempExt,
    TokenDataArray,
    TopK,
    TopNSigma,
    TopP,
    Typical,
)

pytestmark = pytest.mark.llama_cpp

BREAKERS = ["\n", ":", "\"", "*"]
STEPS = 150


class Source:
    """Logits that depend on the previous token (a fixed random bigram table plus noise), peaked
    enough that picks repeat and the penalties and DRY have something to do."""

    def __init__(self, n_vocab: int, seed: int = 0, scale: float = 2.5):
        rng = np.random.default_rng(seed)
        self.table = (rng.standard_normal((64, n_vocab)) * scale).astype(np.float32)
        self.table[:, :8] += np.float32(3.0)            # a few tokens are likely everywhere
        self.noise = np.random.default_rng(seed + 1)

    def logits(self, prev: int) -> np.ndarray:
        row = self.table[prev % 64] + self.noise.standard_normal(self.table.shape[1]).astype(np.float32) * 0.3
        return np.round(row * 8).astype(np.float32) / np.float32(8)   # ties on purpose


def common_chain(oracle, vocab, llama_vocab, n_vocab: int, seed: int, **over):
    """llama.cpp's default common chain order with every sampler switched on."""
    p = dict(penalties=(n_vocab, 64, 1.1, 0.05, 0.1), dry=(0.8, 1.75, 2, 64), top_n_sigma=1.5, top_k=40,
             typical=(0.95, 1), top_p=(0.95, 1), min_p=(0.05, 1), xtc=(0.3, 0.1, 1, seed), temp_ext=(0.8, 0.3, 1.0))
    p.update(over)
    ours = Chain([Penalties(*p["penalties"]), Dry(vocab, *p["dry"], BREAKERS), TopNSigma(p["top_n_sigma"]),
                  TopK(p["top_k"]), Typical(*p["typical"]), TopP(*p["top_p"]), MinP(*p["min_p"]), XTC(*p["xtc"]),
                  TempExt(*p["temp_ext"]), Dist(seed)])
    theirs = oracle.chain([
        oracle.new("penalties", *p["penalties"]), oracle.new("dry", llama_vocab, *p["dry"], BREAKERS),
        oracle.new("top_n_sigma", p["top_n_sigma"]), oracle.new("top_k", p["top_k"]),
        oracle.new("typical", *p["typical"]), oracle.new("top_p", *p["top_p"]), oracle.new("min_p", *p["min_p"]),
        oracle.new("xtc", *p["xtc"]), oracle.new("temp_ext", *p["temp_ext"]), oracle.new("dist", seed)])
    return ours, theirs


def run_both(oracle, ours, theirs, source: Source, steps: int = STEPS) -> list[int]:
    prev, picked = 0, []
    for step in range(steps):
        row = source.logits(prev)
        mine, want = ours.sample_logits(row), oracle.sample_logits(theirs, row)
        assert mine == want, f"step {step}: picked {mine}, llama.cpp {want} (so far {picked})"
        picked.append(mine)
        prev = mine
    return picked


@pytest.fixture(scope="module")
def vocabs(vocab_model):
    return llamir.load_model(vocab_model, vocab_only=True).vocab


@pytest.mark.parametrize("seed", [0, 42, 2**31 + 7])
def test_default_common_chain_picks_llama_cpps_tokens(llama_samplers, vocab_model, vocabs, seed):
    n = vocabs.n_tokens
    ours, theirs = common_chain(llama_samplers, vocabs, llama_samplers.vocab(vocab_model), n, seed)
    picked = run_both(llama_samplers, ours, theirs, Source(n, seed))
    assert len(set(picked)) > 5, "the chain kept picking one token: the case exercises too little"
    assert ours.perf().n_sample == llama_samplers.fns["llama_perf_sampler"](theirs).n_sample == STEPS


@pytest.mark.parametrize("over", [dict(top_k=0, top_n_sigma=-1.0), dict(top_k=0, top_p=(0.9, 1), min_p=(0.0, 1)),
                                  dict(temp_ext=(0.0, 0.0, 1.0)), dict(typical=(1.0, 1), xtc=(0.0, 0.1, 1, 0))])
def test_common_chain_variants(llama_samplers, vocab_model, vocabs, over):
    """Without top-k (every later sampler sees the whole vocab), greedy by temp 0, samplers switched off."""
    n = vocabs.n_tokens
    ours, theirs = common_chain(llama_samplers, vocabs, llama_samplers.vocab(vocab_model), n, 7, **over)
    run_both(llama_samplers, ours, theirs, Source(n, 3), steps=120)


@pytest.mark.parametrize("n_vocab", [512, 5000])
@pytest.mark.parametrize("version", [1, 2])
def test_mirostat_chains(llama_samplers, n_vocab, version):
    seed = 11
    if version == 1:
        ours = Chain([Temp(0.8), Mirostat(n_vocab, seed, 5.0, 0.1, 100)])
        theirs = llama_samplers.chain([llama_samplers.new("temp", 0.8),
                                       llama_samplers.new("mirostat", n_vocab, seed, 5.0, 0.1, 100)])
    else:
        ours = Chain([Temp(0.8), MirostatV2(seed, 5.0, 0.1)])
        theirs = llama_samplers.chain([llama_samplers.new("temp", 0.8),
                                       llama_samplers.new("mirostat_v2", seed, 5.0, 0.1)])
    run_both(llama_samplers, ours, theirs, Source(n_vocab, 1, scale=1.5), steps=120)


def test_greedy_and_biased_chains(llama_samplers):
    n = 1000
    biases = [(5, -np.inf), (17, 1.5)]
    ours = Chain([LogitBias(n, biases), Penalties(n, 32, 1.5, 0.0, 0.0), TopK(50), Greedy()])
    theirs = llama_samplers.chain([llama_samplers.new("logit_bias", n, biases),
                                   llama_samplers.new("penalties", n, 32, 1.5, 0.0, 0.0),
                                   llama_samplers.new("top_k", 50), llama_samplers.new("greedy")])
    picked = run_both(llama_samplers, ours, theirs, Source(n, 4), steps=120)
    assert 5 not in picked


def test_a_clone_continues_like_llama_cpps_clone(llama_samplers, vocab_model, vocabs):
    n = vocabs.n_tokens
    ours, theirs = common_chain(llama_samplers, vocabs, llama_samplers.vocab(vocab_model), n, 99)
    source = Source(n, 9)
    picked = run_both(llama_samplers, ours, theirs, source, steps=60)
    twin, twin_c = ours.clone(), llama_samplers.clone(theirs)
    prev = picked[-1]
    for step in range(60):
        row = source.logits(prev)
        a, b = twin.sample_logits(row), llama_samplers.sample_logits(twin_c, row)
        assert a == b == ours.sample_logits(row) == llama_samplers.sample_logits(theirs, row), f"step {step}"
        prev = a


def test_chain_candidates_equal_after_every_step(llama_samplers):
    """The chain's final candidates (not just the pick) match llama.cpp's chain's, step after step."""
    n, seed = 3000, 5
    ours = Chain([Penalties(n, 16, 1.2, 0.0, 0.0), TopK(200), TopP(0.9, 2), TempExt(0.9, 0.4, 1.5), Dist(seed)])
    theirs = llama_samplers.chain([llama_samplers.new("penalties", n, 16, 1.2, 0.0, 0.0),
                                   llama_samplers.new("top_k", 200), llama_samplers.new("top_p", 0.9, 2),
                                   llama_samplers.new("temp_ext", 0.9, 0.4, 1.5), llama_samplers.new("dist", seed)])
    source, prev = Source(n, 6), 0
    for step in range(100):
        row = source.logits(prev)
        mine, want = TokenDataArray.from_logits(row), None
        want = llama_samplers.apply(theirs, mine)
        ours.apply(mine)
        assert_same_candidates(mine, want, f"step {step}")
        prev = mine.selected_token
        ours.accept(prev)
        llama_samplers.accept(theirs, prev)


def test_sample_from_a_context_row(llama_samplers, tmp_path):
    """chain.sample(ctx, idx) samples the context's output row idx, as llama_sampler_sample does."""
    from llamir.frontend.synth import SynthSpec, write_model

    model = llamir.load_model(write_model(tmp_path / "m.gguf", SynthSpec(arch="llama", n_layer=1)))
    ctx = llamir.Context(model, n_ctx=64, backend="numpy")
    assert ctx.decode(llamir.Batch.from_tokens([1, 5, 9, 3], logits="all")) == 0
    ours = Chain([TopK(20), Temp(0.7), Dist(3)])
    theirs = llama_samplers.chain([llama_samplers.new("top_k", 20), llama_samplers.new("temp", 0.7),
                                   llama_samplers.new("dist", 3)])
    for idx in (-1, 0, 2):
        assert ours.sample(ctx, idx) == llama_samplers.sample_logits(theirs, ctx.get_logits_ith(idx))


def test_reset_and_seed_as_llama_cpp(llama_samplers, vocab_model, vocabs):
    """After reset both chains start over (history cleared, RNGs reseeded); get_seed agrees."""
    n = vocabs.n_tokens
    ours, theirs = common_chain(llama_samplers, vocabs, llama_samplers.vocab(vocab_model), n, 21)
    first = run_both(llama_samplers, ours, theirs, Source(n, 2), steps=40)
    ours.reset()
    llama_samplers.reset(theirs)
    assert run_both(llama_samplers, ours, theirs, Source(n, 2), steps=40) == first
    assert ours.seed == llama_samplers.get_seed(theirs) == 21
    miro = Chain([Temp(0.5), Mirostat(n, 13, 5.0, 0.1)])
    miro_c = llama_samplers.chain([llama_samplers.new("temp", 0.5),
                                   llama_samplers.new("mirostat", n, 13, 5.0, 0.1, 100)])
    assert miro.seed == llama_samplers.get_seed(miro_c) == 13


class EvenTokens:
    """A stand-in grammar (the sampler protocol only): odd token ids are not allowed."""

    name = "even"

    def __init__(self):
        self.accepted = []

    def apply(self, cur: TokenDataArray) -> None:
        cur.logits[cur.ids % 2 == 1] = -np.inf

    def accept(self, token: int) -> None:
        assert token % 2 == 0, f"the grammar was fed token {token}, which it does not allow"
        self.accepted.append(token)

    def reset(self) -> None:
        self.accepted = []

    def clone(self):
        twin = EvenTokens()
        twin.accepted = list(self.accepted)
        return twin


def test_common_sampler_checks_the_pick_against_the_grammar(llama_samplers, vocab_model, vocabs):
    """common_sampler_sample: the chain's pick is kept when the grammar allows it; otherwise the chain
    runs again (its draws included) on the grammar-masked candidates. llama.cpp's chain, driven the
    same way, picks the same tokens; the grammar sees only generated tokens."""
    from llamir.sampling.common import CommonSampler, SamplingParams, build_chain

    n = vocabs.n_tokens
    params = SamplingParams(seed=17, penalty_repeat=1.2, top_k=50, temp=1.1)
    grammar = EvenTokens()
    ours = CommonSampler(build_chain(vocabs, params), grammar)
    theirs = llama_samplers.chain([
        llama_samplers.new("penalties", n, 64, 1.2, 0.0, 0.0), llama_samplers.new("top_k", 50),
        llama_samplers.new("top_p", 0.95, 0), llama_samplers.new("min_p", 0.05, 0),
        llama_samplers.new("temp_ext", 1.1, 0.0, 1.0), llama_samplers.new("dist", 17)])
    assert ours.describe() == ("logits -> penalties -> ?dry -> ?top-n-sigma -> top-k -> ?typical -> top-p -> "
                               "min-p -> ?xtc -> temp-ext -> dist ")
    for t in (4, 9, 4):
        ours.accept(t, is_generated=False)
        llama_samplers.accept(theirs, t)
    source, prev, refused, generated = Source(n, 12), 0, 0, []
    for step in range(80):
        row = source.logits(prev)
        token = llama_samplers.apply(theirs, TokenDataArray.from_logits(row)).selected_token
        if token % 2:
            refused += 1
            masked = TokenDataArray.from_logits(row)
            grammar.apply(masked)
            token = llama_samplers.apply(theirs, masked).selected_token
        llama_samplers.accept(theirs, token)
        mine = ours.sample_logits(row)
        ours.accept(mine)
        assert mine == token, f"step {step}"
        generated.append(token)
        prev = token
    assert refused > 5 and grammar.accepted == generated
    assert list(ours.prev) == ([4, 9, 4] + generated)[-64:]
