"""`llamir splits`: text, JSON and SVG output on a tiny llama, --explain, and clear errors."""

from __future__ import annotations

import json

import pytest

from llamir.cli import main


@pytest.fixture(scope="module")
def model_path(tiny_llama):
    return str(tiny_llama.path)


def run(capsys, *args):
    code = main(["splits", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_text_plan_buffers_and_explain(capsys, model_path):
    code, out, _ = run(
        capsys,
        model_path,
        "--device",
        "sim:gpu0:mem=1GiB",
        "--n-ctx",
        "64",
        "--explain",
        "result_output",
        "--explain",
        "inp_embd",
    )
    assert code == 0
    assert (
        "total: 2 splits" in out and "compute buffers (reserved for batches of 64, 31, 1 tokens): gpu0" in out
    )
    assert "explain: result_output (mul_mat) on gpu0: [1.wgt] weight output.weight is in gpu0 memory" in out
    assert "explain: inp_embd (get_rows) on cpu: [1.wgt]" in out


def test_json_has_plan_placement_and_buffers(capsys, model_path):
    code, out, _ = run(
        capsys,
        model_path,
        "--device",
        "sim:gpu0",
        "--n-gpu-layers",
        "2",
        "--n-ctx",
        "64",
        "--override-tensor",
        r"blk\.1\.ffn_up=cpu",
        "--format",
        "json",
    )
    doc = json.loads(out)
    assert code == 0 and doc["layers"] == ["cpu", "gpu0"] and doc["output_layer"] == "gpu0"
    assert doc["weights"]["blk.1.ffn_up.weight"] == {
        "device": "cpu",
        "reason": r"override blk\.1\.ffn_up=cpu",
    }
    assert doc["plan"]["totals"]["n_splits"] == len(doc["plan"]["splits"]) == 4
    assert set(doc["compute_buffers"]) == {"gpu0", "cpu"}


def test_svg_is_the_layer_picture(capsys, model_path, tmp_path):
    import xml.etree.ElementTree as ET

    out_file = tmp_path / "plan.svg"
    code, _, _ = run(
        capsys, model_path, "--device", "sim:gpu0", "-ngl", "2", "--n-ctx", "64", "--format", "svg",
        "--out", str(out_file),
    )
    root = ET.fromstring(out_file.read_text())  # well-formed
    rows = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text") if t.get("class") == "row"]
    assert code == 0 and rows == ["input", "layer 0", "layer 1", "output"]
    assert {g.get("class") for g in root.iter("{http://www.w3.org/2000/svg}g")} >= {"legend", "band", "copy"}


def test_png_of_the_plan_and_of_a_layer(capsys, model_path, tmp_path):
    for extra, name in (([], "plan.png"), (["--layers", "1"], "layer1.png")):
        out_file = tmp_path / name
        code, _, err = run(
            capsys, model_path, "--device", "sim:gpu0", "-ngl", "2", "--n-ctx", "64", "--format", "png",
            "--out", str(out_file), *extra,
        )
        data = out_file.read_bytes()
        assert code == 0 and data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", err
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        assert 300 < width < 3000 and 200 < height < 10000


def test_dot_of_chosen_layers(capsys, model_path):
    code, out, _ = run(capsys, model_path, "--device", "sim:gpu0", "-ngl", "2", "--n-ctx", "64",
                       "--format", "dot", "--layers", "1,output")
    assert code == 0 and out.startswith('digraph "llama" {') and out.rstrip().endswith("}")
    assert "layer 1, output" in out and 'label="mul_mat\\nresult_output"' in out
    assert "attn_norm-1" in out and 'attn_norm-0"' not in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--device", "sim:gpu0:ops=nope"], "unknown op 'nope'"),
        (["--device", "warp9"], "unknown backend 'warp9'"),
        (["--device", "sim:gpu0:mem=16KiB"], "not enough memory on gpu0"),
        (["--override-tensor", "ffn=gpu3"], "no device named 'gpu3'"),
        (["--override-tensor", "ffn"], "expected REGEX=DEVICE"),
        (["--device", "sim:gpu0:ops=all,-set_rows"], "cannot run set_rows"),
        (["--explain", "no_such_node"], "no value named 'no_such_node'"),
        (["--n-tokens", "0"], "--n-tokens must be at least 1, got 0"),  # issue 9: -1 leaked a ValueError
        (["--n-tokens", "65"], "--n-tokens 65 is more than one ubatch holds (the smaller of --n-ctx 64"),
        (["--n-outputs", "2"], "--n-outputs must be in 0..1 (the batch's tokens), got 2"),
        (["--n-ubatch", "-1"], "--n-ubatch must be at least 1, got -1"),
        (["--tensor-split", "nan"], "every share must be a finite number >= 0, got nan"),
        (["--format", "svg", "--layers", "2"], "--layers '2': '2' is outside the model's layers 0-1"),
        (["--format", "png", "--layers", "1-x"], "'1-x' is not a layer, a range A-B, 'input' or 'output'"),
        (["--layers", "1"], "--layers chooses what a picture shows: give --format svg, png, dot"),
    ],
)
def test_bad_input_is_one_clear_line(capsys, model_path, args, message):
    code, _, err = run(capsys, model_path, "--n-ctx", "64", *args)
    assert code == 1 and message in err and err.count("\n") == 1


def test_missing_drawing_tool_is_one_clear_line(capsys, model_path, monkeypatch, tmp_path):
    import shutil

    monkeypatch.setattr(shutil, "which", lambda tool: None)
    code, _, err = run(capsys, model_path, "--n-ctx", "64", "--format", "png", "--out", str(tmp_path / "p.png"))
    assert code == 1 and "needs `rsvg-convert` from the librsvg2-bin package" in err and err.count("\n") == 1
    assert not (tmp_path / "p.png").exists()
