"""The memory base class and the kinds an architecture chooses (llama_model::create_memory)."""

from __future__ import annotations

import pytest

import llamir
from llamir.context.kv_cache import KVCache
from llamir.context.kv_cache_iswa import KVCacheISWA
from llamir.context.memory import MEMORY_KINDS, Memory, create_memory
from llamir.frontend.synth import SynthSpec, write_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("mem")
    return {
        "llama": llamir.load_model(write_model(d / "l.gguf", SynthSpec(n_layer=2))),
        "gemma3": llamir.load_model(write_model(d / "g.gguf", SynthSpec(arch="gemma3", n_layer=2, n_embd=64, n_head=2,
                                                                         n_head_kv=1, sliding_window=8,
                                                                         swa_pattern=2))),
    }


@pytest.mark.parametrize("arch,kind,cls", [("llama", "kv", KVCache), ("gemma3", "kv_iswa", KVCacheISWA)])
def test_the_architecture_chooses_the_memory(models, arch, kind, cls):
    model = models[arch]
    assert model.arch.create_memory(model.hparams) == kind
    assert model.arch.create_memory(model.hparams, causal=False) == "none"
    ctx = llamir.Context(model, n_ctx=64)
    memory = ctx.memory
    assert type(memory) is cls and isinstance(memory, Memory)
    assert memory.layouts == tuple(c.layout for c in memory.caches)
    assert ctx.graph_config(True).memory == memory.layouts
    assert set(memory.buffers) == {name for c in memory.caches for name in c.tensors}
    assert memory.total_bytes() == sum(t.nbytes for t in memory.buffers.values())


def test_an_unknown_kind_is_a_clear_error(models):
    model = models["llama"]
    ctx = llamir.Context(model, n_ctx=64)
    with pytest.raises(ValueError, match="kind 'paged'; the context makes hybrid, kv, kv_iswa, none, recurrent"):
        create_memory("paged", model.hparams, ctx.cparams)
    assert create_memory("none", model.hparams, ctx.cparams) is None
    assert set(MEMORY_KINDS) == {"kv", "kv_iswa", "recurrent", "hybrid", "none"}


def test_a_memory_kind_implements_the_sequence_operations():
    class Partial(Memory):
        @property
        def caches(self):
            return ()

    with pytest.raises(TypeError, match="abstract"):
        Partial()
