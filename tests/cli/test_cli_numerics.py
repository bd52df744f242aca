"""`--numerics` on the commands that run a model: the logits of the chosen build of llama.cpp
(recorded from both builds in tests/data/oracle_logits), whatever this host is."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from llamir.cli import main
from llamir.frontend.synth import write_model
from llamir.ir.numerics import PROFILES

DATA = Path(__file__).parents[1] / "data" / "oracle_logits"


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_logits_follow_the_chosen_build(tmp_path, profile):
    spec = importlib.util.spec_from_file_location("recorded_builds",
                                                  DATA.parents[1] / "context" / "test_recorded_builds.py")
    recorded = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, recorded)
    spec.loader.exec_module(recorded)
    path = write_model(tmp_path / "m.gguf", recorded.MODELS["llama-f32"].spec)
    out = tmp_path / "logits.npy"
    tokens = ",".join(map(str, recorded.PROMPT))
    assert main(["logits", str(path), "--tokens", tokens, "--out", str(out), "--numerics", profile,
                 "--n-ctx", str(recorded.N_CTX)]) == 0
    with np.load(DATA / f"{profile}.npz") as f:
        want = f["llama-f32/batch"]
    np.testing.assert_array_equal(np.load(out), want)


def test_unknown_profile_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["logits", str(tmp_path / "x.gguf"), "--tokens", "1", "--out", str(tmp_path / "y.npy"),
              "--numerics", "sse4"])
    assert "invalid choice: 'sse4'" in capsys.readouterr().err
