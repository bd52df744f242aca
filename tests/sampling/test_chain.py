"""The chain and samplers' contract: std::mt19937's reference values, clone and reset semantics, the
duck-typed sampler protocol (and the lazy Grammar), perf counters, and bad parameters refused."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

import llamir
from llamir.sampling import (
    LLAMA_DEFAULT_SEED,
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
from llamir.sampling.rng import Mt19937, canonical_double, canonical_float


def rows(n_vocab: int, steps: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(n_vocab) * 2).astype(np.float32) for _ in range(steps)]


def test_mt19937_reference_values():
    """The C++ standard's check value: the 10000th output of a default-constructed std::mt19937."""
    assert Mt19937().next(10000)[-1] == 4123659995
    assert Mt19937(1).next(1)[0] == 1791095845          # std::mt19937(1)()


def test_canonical_values_are_in_unit_interval_and_use_one_or_two_draws():
    a, b = Mt19937(7), Mt19937(7)
    canonical_double(a)
    b.next(2)
    assert a.next(1)[0] == b.next(1)[0]
    canonical_float(a)
    b.next(1)
    assert a.next(1)[0] == b.next(1)[0]
    r0, r1 = Mt19937(9).next(2)
    assert canonical_double(Mt19937(9)) == (float(r0) + float(r1) * 2.0**32) / 2.0**64


def full_chain(vocab, seed: int) -> Chain:
    n = vocab.n_tokens
    return Chain([Penalties(n, 32, 1.2, 0.1, 0.1), Dry(vocab, 0.8, 1.75, 2, 64, ["\n", ":"]), TopNSigma(2.0),
                  TopK(60), Typical(0.97, 1), TopP(0.95, 1), MinP(0.02, 1), XTC(0.5, 0.05, 1, seed),
                  TempExt(0.9, 0.2, 1.0), Dist(seed)])


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    from llamir.frontend.synth import SynthSpec, write_model

    path = write_model(tmp_path_factory.mktemp("chain") / "v.gguf", SynthSpec(arch="qwen2", n_layer=1))
    return llamir.load_model(path, vocab_only=True).vocab


@pytest.mark.parametrize("make", [
    lambda v: full_chain(v, 3),
    lambda v: Chain([Temp(0.9), Mirostat(v.n_tokens, 4, 5.0, 0.1, 100)]),
    lambda v: Chain([Temp(0.9), MirostatV2(5, 4.0, 0.2)]),
])
def test_a_clone_continues_identically_and_independently(vocab, make):
    chain = make(vocab)
    data = rows(vocab.n_tokens, 80)
    for row in data[:30]:
        chain.sample_logits(row)
    twin = chain.clone()
    assert [chain.sample_logits(r) for r in data[30:]] == [twin.sample_logits(r) for r in data[30:]]
    assert twin.perf().n_sample == 50 and chain.perf().n_sample == 80   # a clone's counters start at zero


def test_reset_starts_a_seeded_chain_over(vocab):
    data = rows(vocab.n_tokens, 40, seed=1)
    chain = full_chain(vocab, 8)
    first = [chain.sample_logits(r) for r in data]
    chain.reset()
    assert [chain.sample_logits(r) for r in data] == first
    fresh = full_chain(vocab, 8)
    assert [fresh.sample_logits(r) for r in data] == first


def test_random_seed_is_drawn_per_sampler_and_reported():
    a, b = Dist(), Dist()
    assert a.seed == b.seed == LLAMA_DEFAULT_SEED and a.seed_cur != b.seed_cur
    assert Chain([TopK(3), Dist(77)]).seed == 77
    assert Chain([Dist(77), Mirostat(10, 5, 5.0, 0.1)]).seed == 5
    assert Chain([TopK(3)]).seed == LLAMA_DEFAULT_SEED
    chain = Chain([Dist()])
    assert chain.seed == chain.samplers[0].seed_cur


class BanToken:
    """A sampler that is not a llamir Sampler: it only has the protocol's five members."""

    name = "ban"

    def __init__(self, token: int):
        self.token, self.seen = token, []

    def apply(self, cur: TokenDataArray) -> None:
        cur.logits[cur.ids == self.token] = -np.inf

    def accept(self, token: int) -> None:
        self.seen.append(token)

    def reset(self) -> None:
        self.seen = []

    def clone(self) -> BanToken:
        twin = BanToken(self.token)
        twin.seen = list(self.seen)
        return twin


def test_chain_takes_any_object_with_the_sampler_protocol():
    row = np.zeros(8, dtype=np.float32)
    row[3] = 5.0
    ban = BanToken(3)
    chain = Chain([ban, Greedy()])
    token = chain.sample_logits(row)
    assert token == 0 and ban.seen == [0]
    twin = chain.clone()
    assert twin.samplers[0] is not ban and twin.samplers[0].seen == ban.seen
    chain.reset()
    assert ban.seen == []
    with pytest.raises(TypeError, match="not a sampler"):
        Chain([object()])
    with pytest.raises(TypeError, match="not a sampler"):
        chain.add(types.SimpleNamespace(name="half", apply=lambda cur: None))


def test_grammar_is_imported_only_when_asked_for(monkeypatch):
    import llamir.sampling

    fake = types.ModuleType("llamir.sampling.grammar")
    fake.Grammar = type("Grammar", (), {})
    monkeypatch.setitem(sys.modules, "llamir.sampling.grammar", fake)
    from llamir.sampling import Grammar

    assert Grammar is fake.Grammar
    with pytest.raises(AttributeError, match="no attribute 'Grammer'"):
        llamir.sampling.Grammer   # noqa: B018


def test_importing_sampling_does_not_import_the_grammar():
    import subprocess

    code = "import sys, llamir.sampling; print('llamir.sampling.grammar' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=llamir.__path__[0] + "/..")
    assert out.stdout.strip() == "False"


def test_perf_counts_accepted_tokens_and_times_only_when_asked():
    data = rows(500, 10)
    quiet, timed = Chain([TopK(10), Dist(1)]), Chain([TopK(10), Dist(1)], no_perf=False)
    for row in data:
        quiet.sample_logits(row)
        timed.sample_logits(row)
    assert quiet.perf().n_sample == timed.perf().n_sample == 10
    assert quiet.perf().t_sample_ms == 0 and timed.perf().t_sample_ms > 0
    timed.perf_reset()
    assert timed.perf().n_sample == 0 and timed.perf().t_sample_ms == 0


def test_a_chain_that_selects_nothing_says_so():
    with pytest.raises(RuntimeError, match="no token was selected"):
        Chain([TopK(5)]).sample_logits(np.ones(10, dtype=np.float32))


@pytest.mark.parametrize("build, message", [
    (lambda: TopK(1.5), "TopK: k must be an integer"),
    (lambda: TopK(2**31), "TopK: k must be an integer"),
    (lambda: TopP(float("nan"), 1), "TopP: p must be a number, got nan"),
    (lambda: TopP(0.9, -1), "TopP: min_keep must be an integer in \\[0"),
    (lambda: MinP("0.1", 1), "MinP: p must be a number"),
    (lambda: Typical(0.5, 1.0), "Typical: min_keep must be an integer"),
    (lambda: Temp(None), "Temp: t must be a number"),
    (lambda: TempExt(0.8, float("nan"), 1.0), "TempExt: delta must be a number"),
    (lambda: Dist(-1), "Dist: seed must be an integer in \\[0, 2\\^32\\)"),
    (lambda: Dist(2**32), "Dist: seed must be"),
    (lambda: XTC(0.5, 0.1, 1, -3), "XTC: seed must be"),
    (lambda: Mirostat(0, 1, 5.0, 0.1, 100), "Mirostat: n_vocab must be an integer in \\[1"),
    (lambda: Mirostat(100, 1, 5.0, 0.1, 0), "Mirostat: m must be an integer in \\[1"),
    (lambda: MirostatV2(1, float("nan"), 0.1), "MirostatV2: tau must be a number"),
    (lambda: Penalties(100, -1, 1.1, 0.0, 0.0), "Penalties: penalty_last_n must be an integer in \\[0"),
    (lambda: Penalties(100, 64, 0.0, 0.0, 0.0), "Penalties: penalty_repeat must be finite and greater than 0"),
    (lambda: Penalties(100, 64, 1.0, float("inf"), 0.0), "Penalties: penalty_freq must be finite"),
    (lambda: LogitBias(10, [(10, 1.0)]), "LogitBias: token must be an integer in \\[0, 9\\]"),
    (lambda: LogitBias(10, {3: float("nan")}), "LogitBias: bias of token 3 must be a number"),
    (lambda: Dry(None, 0.8, 1.75, 2, 64, ["\n"]), "Dry: a vocab is needed"),
    (lambda: Dry(None, 0.8, 1.75, 2, -1), "Dry: dry_penalty_last_n must be an integer in \\[0"),
    (lambda: Dry(None, 0.8, 1.75, 2, 64, "\n"), "Dry: seq_breakers must be a list"),
    (lambda: Chain([], no_perf=1), "Chain: no_perf must be a bool"),
])
def test_bad_parameters_are_refused_by_name(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_off_parameters_give_llama_cpps_empty_samplers():
    assert [s.name for s in (TopK(0), TopP(1.0, 1), MinP(0.0, 1), Typical(1.0, 1), Temp(1.0),
                             TempExt(1.0, 0.0, 1.0), XTC(0.0, 0.1, 1, 0), TopNSigma(-1.0),
                             Penalties(10, 0, 1.1, 0, 0), Dry(None, 0.0, 1.75, 2, 64), LogitBias(10, []))] == [
        "?top-k", "?top-p", "?min-p", "?typical", "?temp", "?temp-ext", "?xtc", "?top-n-sigma", "?penalties",
        "?dry", "?logit-bias"]
    cur = TokenDataArray.from_logits(np.arange(5, dtype=np.float32))
    TopK(0).apply(cur)
    assert cur.size == 5 and not cur.sorted


def test_token_data_array_checks_its_fields():
    with pytest.raises(ValueError, match="differ in length"):
        TokenDataArray(np.arange(3), np.zeros(2), np.zeros(3))
    with pytest.raises(ValueError, match="must be 1-D"):
        TokenDataArray.from_logits(np.zeros((2, 3)))
    cur = TokenDataArray.from_logits([1.0, 3.0, 2.0])
    assert cur.ids.dtype == np.int32 and cur.logits.dtype == np.float32 and cur.selected == -1 and not cur.sorted
