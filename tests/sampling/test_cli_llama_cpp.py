"""`llamir run` with sampler flags prints what llama.cpp generates with common_sampler_init's chain for
those flags on its own logits (the prompt accepted into the chain first, as llama-completion does)."""

from __future__ import annotations

import numpy as np
import pytest

import llamir
from llamir.cli import main
from llamir.frontend.synth import SynthSpec, write_model
from llamir.testing.llama_cpp import LlamaCppOracle, oracle_numerics

pytestmark = pytest.mark.llama_cpp
BREAKERS = ["\n", ":", "\"", "*"]


def llama_cpp_generate(oracle, samplers, path, prompt: list[int], n: int, eog) -> list[int]:
    with LlamaCppOracle(path, n_ctx=2048) as o:
        for t in prompt:
            samplers.accept(oracle, t)
        assert o.decode(prompt) == 0
        out, pos = [], len(prompt)
        for _ in range(n):
            token = samplers.sample_logits(oracle, np.array(o.logits_ith(-1), dtype=np.float32))
            if eog(token):
                break
            out.append(token)
            assert o.decode([token], pos0=pos) == 0
            pos += 1
    return out


@pytest.mark.parametrize("backend", ["numpy", "llvm"])
@pytest.mark.parametrize("flags", [
    ["--seed", "5", "--temp", "0.9", "--repeat-penalty", "1.3", "--repeat-last-n", "16", "--dry-multiplier", "0.8",
     "--top-k", "30", "--min-p", "0.02"],
    ["--seed", "8", "--mirostat", "2", "--mirostat-ent", "3"],
])
def test_run_generates_llama_cpps_tokens(llama_samplers, tmp_path, capsys, flags, backend):
    path = write_model(tmp_path / "m.gguf", SynthSpec(arch="qwen3", n_layer=2))
    model = llamir.load_model(path)
    vocab, n = model.vocab, model.vocab.n_tokens
    assert main(["run", str(path), "-p", "Hello", "-n", "24", "--backend", backend,
                 "--numerics", oracle_numerics().name, *flags]) == 0
    printed = capsys.readouterr().out
    s, lv = llama_samplers, llama_samplers.vocab(path)
    if "--mirostat" in flags:
        chain = s.chain([s.new("temp", 0.8), s.new("mirostat_v2", 8, 3.0, 0.1)])
    else:
        chain = s.chain([s.new("penalties", n, 16, 1.3, 0.0, 0.0), s.new("dry", lv, 0.8, 1.75, 2, 64, BREAKERS),
                         s.new("top_n_sigma", -1.0), s.new("top_k", 30), s.new("typical", 1.0, 0),
                         s.new("top_p", 0.95, 0), s.new("min_p", 0.02, 0), s.new("xtc", 0.0, 0.1, 0, 5),
                         s.new("temp_ext", 0.9, 0.0, 1.0), s.new("dist", 5)])
    prompt = vocab.tokenize("Hello", add_special=True, parse_special=True)
    tokens = llama_cpp_generate(chain, s, path, prompt, 24, vocab.is_eog)
    assert len(tokens) > 3
    assert printed == "Hello" + vocab.detokenize(tokens) + "\n"
