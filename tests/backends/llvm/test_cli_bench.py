"""`llamir bench`: one JSON object with pp_tps and tg_tps (no times are asserted)."""

from __future__ import annotations

import json

import pytest

from llamir.cli import main
from llamir.frontend.synth import SynthSpec, write_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("bench") / "tiny.gguf", SynthSpec(n_layer=1, dtype="q8_0"))


def test_bench_json(tiny, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("LLAMIR_CACHE_DIR", str(tmp_path))
    assert main(["bench", str(tiny), "-p", "8", "-n", "4", "--reps", "1", "--threads", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["engine"] == "llamir-llvm" and out["pp_tokens"] == 8 and out["tg_tokens"] == 4
    assert out["pp_tps"] > 0 and out["tg_tps"] > 0 and len(out["tg_token_ms"]) == 4
    assert out["extra"]["native_ms"] > 0 and out["extra"]["compile"]
    # a generated token through the token lane and through the general path
    assert out["extra"]["token_ms"] > 0 and out["extra"]["token_general_ms"] > 0


def test_bench_table_and_skipping_a_phase(tiny, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("LLAMIR_CACHE_DIR", str(tmp_path))
    assert main(["bench", str(tiny), "-p", "0", "-n", "3", "--threads", "2"]) == 0
    text = capsys.readouterr().out
    assert "tg3" in text and "pp" not in text.split("\n", 1)[1]


def test_bench_missing_model_is_an_error(capsys):
    assert main(["bench", "/nonexistent/model.gguf"]) == 1
    assert "model file not found" in capsys.readouterr().err


def test_bench_at_a_depth(tiny, capsys, monkeypatch, tmp_path):
    """-d: every timed prompt and generation runs after the cache holds that many tokens, and
    the positions carry on from there (llama-bench -d)."""
    import llamir

    monkeypatch.setenv("LLAMIR_CACHE_DIR", str(tmp_path))
    seen = []
    decode = llamir.Context.decode

    def spy(self, batch):
        seen.append((batch.n_tokens, int(batch.pos[0]) if batch.pos is not None else 0))
        return decode(self, batch)

    monkeypatch.setattr(llamir.Context, "decode", spy)
    assert main(["bench", str(tiny), "-p", "8", "-n", "4", "-d", "40", "--reps", "1", "--threads", "1",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["depth"] == 40 and out["pp_tps"] > 0 and out["tg_tps"] > 0
    fills = [i for i, (n, pos) in enumerate(seen) if (n, pos) == (40, 0)]
    assert fills and all(seen[i + 1][1] == 40 for i in fills)     # each fill is followed by a decode at 40
    assert {pos for n, pos in seen if n == 8} == {40}              # prompts start at the depth
    assert {pos for n, pos in seen if n == 1} == set(range(40, 44))
    assert main(["bench", str(tiny), "-n", "4", "-d", "-1"]) == 1
    assert "depth -1" in capsys.readouterr().err
