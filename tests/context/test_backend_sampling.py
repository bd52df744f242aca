"""Backend samplers (the seed's llama_context sampling): chains attached per sequence, their
in-graph prefix lowered into the decode graph, the sampled results per output row; checked
against the same chains sampling on the CPU."""

from __future__ import annotations

import numpy as np
import pytest

import llamir
from llamir.frontend.synth import SynthSpec, write_model
from llamir.sampling import Chain, Dist, Greedy, MinP, Temp, TopK, TopP, Typical

PROMPTS = ([5, 17, 40, 3, 99], [12, 7, 250, 31])


def common_chain(seed: int) -> Chain:
    return Chain([TopK(40), TopP(0.95, 1), MinP(0.05, 1), Temp(0.8), Dist(seed)])


CHAINS = {
    "common": lambda: (common_chain(1234), common_chain(99)),
    "greedy+topk-dist": lambda: (Chain([Greedy()]), Chain([TopK(10), Temp(0.7), Dist(42)])),
    "partial": lambda: (Chain([TopK(20), Typical(0.9, 1), Dist(7)]), Chain([TopK(5), Temp(0.0), Dist(3)])),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_model(tmp_path_factory.mktemp("bsmpl") / "m.gguf", SynthSpec(arch="llama", n_layer=2, seed=3))
    return llamir.load_model(path)


def _generate(ctx, chains, n: int, backend: bool) -> list[list[int]]:
    """Both sequences' prompts in one batch, then one token per sequence per batch; each chain
    samples its sequence's output row (on the CPU from the logits, or continuing from what the
    graph sampled)."""
    tokens = [p for p in PROMPTS[0] + PROMPTS[1]]
    pos = list(range(len(PROMPTS[0]))) + list(range(len(PROMPTS[1])))
    seqs = [(0,)] * len(PROMPTS[0]) + [(1,)] * len(PROMPTS[1])
    logits = [False] * len(tokens)
    logits[len(PROMPTS[0]) - 1] = logits[-1] = True
    assert ctx.decode(llamir.Batch(tokens=tokens, pos=pos, seq_ids=seqs, logits=logits)) == 0, ctx.last_error
    rows = [len(PROMPTS[0]) - 1, len(tokens) - 1]
    out: list[list[int]] = [[], []]
    next_pos = [len(PROMPTS[0]), len(PROMPTS[1])]
    for _ in range(n):
        picks = [chains[s].sample(ctx, rows[s]) for s in (0, 1)]
        if backend:
            for s in (0, 1):
                assert ctx.get_sampled_token_ith(rows[s]) in (picks[s], -1)
        for s in (0, 1):
            out[s].append(picks[s])
        assert ctx.decode(llamir.Batch(tokens=picks, pos=next_pos, seq_ids=[(0,), (1,)], logits=[True, True])) == 0, \
            ctx.last_error
        next_pos = [p + 1 for p in next_pos]
        rows = [0, 1]
    return out


@pytest.mark.parametrize("backend", ["numpy", "llvm"])
@pytest.mark.parametrize("which", list(CHAINS))
def test_backend_sampling_draws_the_cpus_tokens(model, backend, which):
    """Two sequences in one batch, each with its chain: sampled in the graph (the chain's prefix;
    the CPU continues a partial one) or on the CPU, the same tokens for the same seeds."""
    cpu_chains, gpu_chains = CHAINS[which](), CHAINS[which]()
    cpu = llamir.Context(model, n_ctx=256, n_seq_max=2, kv_unified=True, backend=backend)
    want = _generate(cpu, cpu_chains, 48, backend=False)
    ctx = llamir.Context(model, n_ctx=256, n_seq_max=2, kv_unified=True, backend=backend,
                         samplers={0: gpu_chains[0], 1: gpu_chains[1]})
    got = _generate(ctx, gpu_chains, 48, backend=True)
    assert got == want


def test_the_sampled_section_and_its_getters(model):
    chain = Chain([TopK(8), Temp(0.5), Dist(5)])
    ctx = llamir.Context(model, n_ctx=64, samplers={0: chain}, backend="numpy")
    assert ctx.decode(llamir.Batch.from_tokens([5, 6, 7], logits="last")) == 0
    token = ctx.get_sampled_token_ith(2)
    assert 0 <= token < model.hparams.n_vocab
    probs, cands = ctx.get_sampled_probs_ith(2), ctx.get_sampled_candidates_ith(2)
    assert ctx.get_sampled_probs_count_ith(2) == ctx.get_sampled_candidates_count_ith(2) == 8
    assert np.isclose(probs.sum(), 1.0, atol=1e-5) and token in cands
    row = ctx.get_logits_ith(2)
    assert list(cands) == list(np.argsort(-row, kind="stable")[:8])   # top_k's candidates, largest first
    assert chain.sample(ctx, 2) == token                                # the CPU takes the graph's pick


def test_two_outputs_of_one_sequence_are_refused(model):
    ctx = llamir.Context(model, n_ctx=64, samplers={0: Chain([Greedy()])}, backend="numpy")
    assert ctx.decode(llamir.Batch.from_tokens([5, 6, 7], logits="all")) == -1
    assert ctx.last_error == "backend sampling requires at most one output token per sequence (seq_id 0 had 2)"
    assert ctx.memory.seq_pos_max(0) == -1                             # nothing was taken


def test_mixed_batch_and_set_sampler(model):
    """Sequence 0 sampled in the graph, sequence 1 on the CPU from its logits; detaching the
    sampler brings back plain decodes."""
    ctx = llamir.Context(model, n_ctx=128, n_seq_max=2, kv_unified=True, backend="numpy")
    assert ctx.set_sampler(0, Chain([Greedy()])) is True
    batch = llamir.Batch(tokens=[5, 6, 9, 10], pos=[0, 1, 0, 1], seq_ids=[(0,), (0,), (1,), (1,)],
                         logits=[False, True, False, True])
    assert ctx.decode(batch) == 0, ctx.last_error
    assert ctx.get_sampled_token_ith(1) == int(np.argmax(ctx.get_logits_ith(1)))
    assert ctx.get_sampled_token_ith(3) == -1 and ctx.get_sampled_probs_ith(3) is None
    assert Chain([Greedy()]).sample(ctx, 3) == int(np.argmax(ctx.get_logits_ith(3)))
    assert ctx.set_sampler(0, None) is False
    assert ctx.decode(llamir.Batch(tokens=[1, 2], pos=[2, 2], seq_ids=[(0,), (1,)], logits=[True, True])) == 0
    assert ctx.get_sampled_token_ith(0) == -1


def test_a_context_refuses_what_is_not_a_chain(model):
    with pytest.raises(ValueError, match="must be of type llamir.sampling.Chain"):
        llamir.Context(model, n_ctx=64, samplers={0: Greedy()}, backend="numpy")


def test_backend_sampling_through_the_scheduler(model):
    """The model on a simulated device (the scheduler's split path, whose outputs include views
    such as the sampled token): the same tokens as CPU sampling."""
    from llamir.frontend.placement import PlacementParams

    cpu_chains, dev_chains = CHAINS["common"](), CHAINS["common"]()
    want = _generate(llamir.Context(model, n_ctx=256, n_seq_max=2, kv_unified=True), cpu_chains, 12, backend=False)
    ctx = llamir.Context(model, n_ctx=256, n_seq_max=2, kv_unified=True, devices=["sim:gpu0"],
                         placement=PlacementParams(n_gpu_layers=99), samplers=dict(enumerate(dev_chains)))
    assert _generate(ctx, dev_chains, 12, backend=True) == want
    assert ctx.get_sampled_token_ith(0) != -1



def test_sampled_rows_follow_the_batch_order(tmp_path):
    """A recurrent model splits the batch by sequence, so its output rows come out of batch order
    and are swapped back lazily: the sampled section follows the logits."""
    path = write_model(tmp_path / "mamba.gguf", SynthSpec(arch="mamba", n_layer=2, n_embd=64, seed=3))
    model = llamir.load_model(path)
    ctx = llamir.Context(model, n_ctx=64, n_seq_max=2, backend="numpy",
                         samplers={0: Chain([Greedy()]), 1: Chain([TopK(3), Greedy()])})
    batch = llamir.Batch(tokens=[5, 9, 10, 6], pos=[0, 0, 1, 1], seq_ids=[(0,), (1,), (1,), (0,)],
                         logits=[False, False, True, True])
    assert ctx.decode(batch) == 0, ctx.last_error
    assert ctx.outputs.swaps                               # rows were written seq 0 first
    for i in (2, 3):
        assert ctx.get_sampled_token_ith(i) == int(np.argmax(ctx.get_logits_ith(i)))
    assert ctx.get_sampled_candidates_count_ith(2) == 3 and ctx.get_sampled_candidates_count_ith(3) == 0
