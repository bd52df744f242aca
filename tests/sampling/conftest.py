"""llama.cpp's own samplers as the oracle (llamir.testing.llama_cpp_samplers), and the shared checks.

    def test_x(llama_samplers):
        h = llama_samplers.new("top_k", 40)
        out = llama_samplers.apply(h, TokenDataArray.from_logits(row))   # a new TokenDataArray
"""

from __future__ import annotations

import numpy as np
import pytest

from llamir.frontend.synth import SynthSpec, write_model
from llamir.sampling import TokenDataArray
from llamir.testing.llama_cpp_samplers import LlamaSamplers


@pytest.fixture
def llama_samplers():
    oracle = LlamaSamplers()
    yield oracle
    oracle.close()


@pytest.fixture(scope="session")
def vocab_model(tmp_path_factory):
    """A synthetic byte-level BPE vocab (512 tokens) as a GGUF, for the samplers that read a vocab."""
    return write_model(tmp_path_factory.mktemp("sampling") / "vocab.gguf", SynthSpec(arch="qwen2", n_layer=1))


def assert_same_candidates(ours: TokenDataArray, theirs: TokenDataArray, what: str = "") -> None:
    """ids, logits, p, selected and sorted all bit-equal."""
    where = f" ({what})" if what else ""
    assert ours.size == theirs.size, f"{ours.size} candidates, llama.cpp has {theirs.size}{where}"
    assert np.array_equal(ours.ids, theirs.ids), f"candidate ids differ{where}: {ours.ids[:20]} vs {theirs.ids[:20]}"
    np.testing.assert_array_equal(_bits(ours.logits), _bits(theirs.logits), err_msg=f"logits differ{where}")
    np.testing.assert_array_equal(_bits(ours.p), _bits(theirs.p), err_msg=f"p differs{where}")
    assert ours.selected == theirs.selected, f"selected {ours.selected}, llama.cpp {theirs.selected}{where}"
    assert ours.sorted == theirs.sorted, f"sorted {ours.sorted}, llama.cpp {theirs.sorted}{where}"


def _bits(x: np.ndarray) -> np.ndarray:
    """float32 bit patterns, every NaN as one (payloads are not part of the contract)."""
    return np.where(np.isnan(x), np.uint32(0x7FC00000), x.view(np.uint32))
