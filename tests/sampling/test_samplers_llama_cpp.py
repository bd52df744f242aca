"""Every sampler against llama.cpp's own on the same candidates: after each llama_sampler_apply the
ids, logits, p, selected and sorted are bit-equal (vocab sizes around llama.cpp's 128 / 1024
thresholds, ties, infinities, sorted and unsorted inputs)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_same_candidates

import llamir
from llamir.sampling import (
    XTC,
    Dist,
    Dry,
    Greedy,
    Infill,
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

CLASSES = {"greedy": Greedy, "dist": Dist, "top_k": TopK, "top_p": TopP, "min_p": MinP, "typical": Typical,
           "temp": Temp, "temp_ext": TempExt, "xtc": XTC, "top_n_sigma": TopNSigma, "mirostat": Mirostat,
           "mirostat_v2": MirostatV2, "penalties": Penalties, "logit_bias": LogitBias}

SIZES = [1, 2, 9, 128, 129, 700, 1025, 5000, 32000]
KINDS = ["normal", "ties", "coarse", "inf"]


def make_logits(kind: str, n: int, seed: int = 0) -> np.ndarray:
    """normal: distinct-ish floats; ties: a 0.25 grid (many equal values); coarse: a handful of values;
    inf: normal with a fifth of them -inf (and the first one kept finite)."""
    rng = np.random.default_rng(seed * 1000 + n)
    x = rng.normal(0, 4, n).astype(np.float32)
    if kind == "ties":
        x = np.round(x * 4) / 4
    elif kind == "coarse":
        x = rng.integers(-3, 3, n).astype(np.float32)
    elif kind == "inf":
        x[rng.random(n) < 0.2] = -np.inf
        x[0] = 1.0
    return x.astype(np.float32)


def both(oracle, name: str, *args):
    return CLASSES[name](*args), oracle.new(name, *args)


def check_apply(oracle, ours, theirs, cur: TokenDataArray, what: str) -> TokenDataArray:
    want = oracle.apply(theirs, cur)
    got = cur.copy()
    ours.apply(got)
    assert_same_candidates(got, want, what)
    return want


STATELESS = [
    ("greedy",), ("top_k", 1), ("top_k", 5), ("top_k", 40), ("top_k", 128), ("top_k", 129), ("top_k", 300),
    ("top_k", 0), ("top_p", 0.5, 1), ("top_p", 0.95, 1), ("top_p", 0.999, 10), ("top_p", 0.3, 0), ("top_p", 1.0, 1),
    ("min_p", 0.05, 1), ("min_p", 0.3, 5), ("min_p", 0.99, 50), ("min_p", 0.0, 1), ("min_p", 2.0, 1),
    ("typical", 0.5, 1), ("typical", 0.9, 3), ("typical", 0.2, 0), ("temp", 0.7), ("temp", 0.0), ("temp", -1.0),
    ("temp", 2.5), ("temp_ext", 0.8, 0.0, 1.0), ("temp_ext", 0.8, 0.5, 1.0), ("temp_ext", 1.2, 0.3, 2.0),
    ("temp_ext", 0.3, 0.5, 0.5), ("top_n_sigma", 1.0), ("top_n_sigma", 2.5), ("top_n_sigma", 0.0),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", SIZES)
def test_stateless_samplers_leave_llama_cpps_candidates(llama_samplers, kind, n):
    row = make_logits(kind, n)
    for spec in STATELESS:
        ours, theirs = both(llama_samplers, *spec)
        assert ours.name == llama_samplers.name(theirs).decode()
        check_apply(llama_samplers, ours, theirs, TokenDataArray.from_logits(row), f"{spec} on {kind}[{n}]")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [9, 129, 1025, 5000])
def test_samplers_on_sorted_and_reduced_candidates(llama_samplers, kind, n):
    """Each sampler after another (top-k, temp, softmax-ing ones): the input is the previous output,
    sorted or not, shorter than the vocab, its ids no longer their positions."""
    row = make_logits(kind, n, seed=1)
    firsts = [("top_k", 300), ("typical", 0.95, 1), ("penalties", n, 64, 1.3, 0.1, 0.2), ("xtc", 1.0, 0.01, 1, 5)]
    for first in firsts:
        a, b = both(llama_samplers, *first)
        if first[0] == "penalties":
            for t in range(0, n, 3):
                a.accept(t)
                llama_samplers.accept(b, t)
        cur = check_apply(llama_samplers, a, b, TokenDataArray.from_logits(row), f"{first} on {kind}[{n}]")
        for spec in STATELESS:
            ours, theirs = both(llama_samplers, *spec)
            check_apply(llama_samplers, ours, theirs, cur, f"{spec} after {first} on {kind}[{n}]")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [2, 9, 129, 1025, 5000])
def test_random_samplers_draw_as_llama_cpp(llama_samplers, kind, n):
    """dist, xtc and the mirostats, applied ten times each on one state: the same draws each time."""
    specs = [("dist", 1234), ("dist", 0), ("xtc", 0.5, 0.1, 1, 7), ("xtc", 1.0, 0.05, 2, 9),
             ("mirostat", n, 3, 5.0, 0.1, 100), ("mirostat", n, 4, 3.0, 0.5, 2), ("mirostat_v2", 5, 5.0, 0.1),
             ("mirostat_v2", 6, 1.0, 0.3)]
    for spec in specs:
        ours, theirs = both(llama_samplers, *spec)
        for step in range(10):
            row = make_logits(kind, n, seed=step)
            check_apply(llama_samplers, ours, theirs, TokenDataArray.from_logits(row), f"{spec} step {step}")


def test_penalties_see_the_accepted_history(llama_samplers):
    n = 300
    rng = np.random.default_rng(3)
    specs = [(n, 64, 1.3, 0.0, 0.0), (n, 8, 1.0, 0.5, 0.25), (n, 16, 0.7, -0.2, 1.5), (n, 0, 1.5, 0.1, 0.1),
             (n, 64, 1.0, 0.0, 0.0)]
    for spec in specs:
        ours, theirs = both(llama_samplers, "penalties", *spec)
        assert ours.name == llama_samplers.name(theirs).decode()
        for step in range(40):
            token = int(rng.integers(0, 20))
            ours.accept(token)
            llama_samplers.accept(theirs, token)
            row = make_logits("ties", n, seed=step)
            check_apply(llama_samplers, ours, theirs, TokenDataArray.from_logits(row), f"penalties{spec} step {step}")


def test_logit_bias(llama_samplers):
    n = 200
    biases = [(3, 2.5), (7, -np.inf), (3, -1.0), (150, 0.75), (199, -3.0)]
    ours, theirs = both(llama_samplers, "logit_bias", n, biases)
    row = make_logits("normal", n)
    check_apply(llama_samplers, ours, theirs, TokenDataArray.from_logits(row), "logit bias in id order")
    shuffled = TokenDataArray.from_logits(row)
    shuffled.take(np.random.default_rng(0).permutation(n)[:150])       # ids away from their positions
    check_apply(llama_samplers, ours, theirs, shuffled, "logit bias on shuffled candidates")
    empty, empty_c = both(llama_samplers, "logit_bias", n, [])
    assert empty.name == llama_samplers.name(empty_c).decode() == "?logit-bias"


def test_dry_tokenizes_its_breakers_and_penalises_repeats(llama_samplers, vocab_model):
    vocab = llamir.load_model(vocab_model, vocab_only=True).vocab
    llama_vocab = llama_samplers.vocab(vocab_model)
    n = vocab.n_tokens
    rng = np.random.default_rng(5)
    split_the = vocab.tokenize(" t", add_special=False) + vocab.tokenize("he", add_special=False)
    pattern = [int(t) for t in rng.integers(0, n, 6)] + vocab.tokenize(": the", add_special=False) + split_the
    for spec in [(1.5, 1.75, 2, 64, ["\n", ":", "\"", "*"]), (0.8, 1.1, 1, 32, [" the", "ing"]),
                 (2.0, 3.0, 3, 100, []), (0.0, 1.75, 2, 64, ["\n"])]:
        ours = Dry(vocab, *spec)
        theirs = llama_samplers.new("dry", llama_vocab, *spec)
        assert ours.name == llama_samplers.name(theirs).decode()
        for step in range(60):
            token = pattern[step % len(pattern)] if step % 11 else int(rng.integers(0, n))
            ours.accept(token)
            llama_samplers.accept(theirs, token)
            row = make_logits("normal", n, seed=step)
            check_apply(llama_samplers, ours, theirs, TokenDataArray.from_logits(row), f"dry{spec[:4]} step {step}")


def test_infill(llama_samplers, vocab_model):
    vocab = llamir.load_model(vocab_model, vocab_only=True).vocab
    ours, theirs = Infill(vocab), llama_samplers.new("infill", llama_samplers.vocab(vocab_model))
    eog = sorted(vocab.eog_ids)
    rng = np.random.default_rng(2)
    for step in range(30):
        row = make_logits("normal", vocab.n_tokens, seed=step)
        row[eog] += np.float32(step % 4 * 3.0)                   # sometimes EOG wins outright
        cur = TokenDataArray.from_logits(row)
        top_k, top_k_c = both(llama_samplers, "top_k", int(rng.integers(2, 40)))
        cur = check_apply(llama_samplers, top_k, top_k_c, cur, "top-k before infill")
        check_apply(llama_samplers, ours, theirs, cur, f"infill step {step}")
