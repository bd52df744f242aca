"""The split pictures: the layer picture (rows, device legend, split bands, copies with bytes), the
node-level DOT graph of a layer range, and PNG output through graphviz / rsvg-convert."""

from __future__ import annotations

import re
import shutil
import struct
import xml.etree.ElementTree as ET

import pytest

from llamir.backends import backend_from_spec
from llamir.cli_splits import plan_model
from llamir.frontend.placement import PlacementParams
from llamir.sched.draw import plan_to_svg
from llamir.sched.draw_graph import plan_to_dot
from llamir.sched.layers import parse_layers, rows_title
from llamir.sched.plan import InputCopy, format_bytes
from llamir.sched.render import RenderError, render_dot, svg_to_png

SVG = "{http://www.w3.org/2000/svg}"


def plan_of(model, n_gpu_layers: int, overrides=()):
    devices = [backend_from_spec("sim:gpu0"), backend_from_spec("cpu")]
    params = PlacementParams(n_gpu_layers=n_gpu_layers, overrides=tuple(overrides))
    return plan_model(model, devices, params, n_tokens=1, n_ctx=64).plan


@pytest.fixture(scope="module")
def half_plan(tiny_llama):
    """Layer 0 on the CPU, layer 1 and the output on gpu0: 2 splits, copies into split 1."""
    return plan_of(tiny_llama, 2)


@pytest.fixture(scope="module")
def ffn_on_cpu_plan(tiny_llama):
    """Everything on gpu0 but layer 1's FFN up matrix: a split inside a layer."""
    return plan_of(tiny_llama, -1, [(r"blk\.1\.ffn_up", "cpu")])


def groups(root, cls: str):
    return [g for g in root.iter(f"{SVG}g") if g.get("class") == cls]


def texts(element) -> list[str]:
    return ["".join(t.itertext()) for t in element.iter(f"{SVG}text")]


@pytest.mark.parametrize("plan_name", ["half_plan", "ffn_on_cpu_plan"])
def test_layer_picture_rows_legend_bands_and_copies(request, tiny_llama, plan_name):
    plan = request.getfixturevalue(plan_name)
    root = ET.fromstring(plan_to_svg(plan))
    n_layer = tiny_llama.hparams.n_layer
    rows = [t.text for t in root.iter(f"{SVG}text") if t.get("class") == "row"]
    assert rows == ["input", *(f"layer {i}" for i in range(n_layer)), "output"]
    legend = [texts(g)[0] for g in groups(root, "legend")]
    assert [entry.split(" (")[0] for entry in legend] == plan.labels
    bands = groups(root, "band")
    assert [int(g.get("data-split")) for g in bands] == list(range(plan.n_splits)) and plan.n_splits > 1
    for band, split in zip(bands, plan.splits, strict=True):
        assert f"split {split.index}: {plan.labels[split.backend]}" in " ".join(texts(band) + [band[0].text])
    copies = groups(root, "copy")
    expected = [(plan.label(i), c.nbytes) for s in plan.splits for i, c in zip(s.inputs, s.copies, strict=True)]
    assert len(copies) == plan.n_split_copies == len(expected) > 0
    drawn = sorted((texts(g)[0].split(":")[0], int(g.get("data-bytes"))) for g in copies)
    assert drawn == sorted(expected)
    for g in copies:
        assert texts(g)[0].endswith(", " + format_bytes(int(g.get("data-bytes"))))
    total = [t for t in texts(root) if t.startswith("total:")]
    assert total == [
        f"total: {plan.n_splits} splits, {plan.n_split_copies} copies, {format_bytes(sum(b for _, b in expected))}"
        f" moved per batch, est. {plan.est_seconds * 1e3:.3f} ms"
    ]


def test_bands_span_the_rows_of_their_layers(half_plan):
    """-ngl 2 of 2 layers + output: split 0 (cpu) holds the input row and layer 0; split 1 (gpu0) starts
    with layer 0's last residual add (as llama.cpp's expansion puts it next to its gpu0 user)."""
    root = ET.fromstring(plan_to_svg(half_plan))
    row_y = {t.text: float(t.get("y")) for t in root.iter(f"{SVG}text") if t.get("class") == "row"}
    assert half_plan.labels[half_plan.splits[0].backend] == "cpu" and half_plan.n_splits == 2
    assert half_plan.assignment[id(half_plan.find("l_out-0"))] == 0  # backend 0 is gpu0
    spans = (["input", "layer 0"], ["layer 0", "layer 1", "output"])
    for band, inside in zip(groups(root, "band"), spans, strict=True):
        rect = band.find(f"{SVG}rect")
        top, bottom = float(rect.get("y")), float(rect.get("y")) + float(rect.get("height"))
        assert all(top < row_y[r] < bottom for r in inside)
        assert not any(top < y < bottom for r, y in row_y.items() if r not in inside)


def layer_by_position(plan, layer: int):
    """An oracle independent of the layer attribution: layer L's nodes follow l_out-(L-1) up to l_out-L."""
    nodes = plan.graph.nodes
    names = [n.name for n in nodes]
    start = names.index(f"l_out-{layer - 1}") + 1 if layer else names.index("inp_embd") + 1
    return nodes[start : names.index(f"l_out-{layer}") + 1]


def layer_ops_by_position(plan, layer: int) -> set[int]:
    return {plan.ids[id(n)] for n in layer_by_position(plan, layer) if not n.op.is_view}


def dot_nodes(dot: str, cls: str) -> set[int]:
    return {int(m.group(1)) for m in re.finditer(rf'^\s+v(\d+) \[.*class="{cls}"', dot, re.M)}


def test_node_graph_holds_exactly_the_chosen_layers(tiny_llama):
    plan = plan_of(tiny_llama, 2)
    dot = plan_to_dot(plan, parse_layers("1", tiny_llama.hparams.n_layer))
    assert dot_nodes(dot, "op") == layer_ops_by_position(plan, 1)
    outside = dot_nodes(dot, "outside")
    for name in ("l_out-0", "inp_pos", "attn_inp_kq_mask"):  # read from outside the layer, marked so
        assert plan.ids[id(plan.find(name))] in outside
    assert plan.ids[id(plan.find("l_out-0"))] not in dot_nodes(dot, "op")
    clusters = re.findall(r'label="split (\d+): (\w+)', dot)
    assert clusters == [("1", "gpu0")]
    copy_labels = re.findall(r'label="copy ([^"\\]+)\\n(\w+) -> (\w+)\\n([^"]+)", shape=note', dot)
    read = {c for n in layer_by_position(plan, 1) for c in plan.inputs_of(n) if isinstance(c, InputCopy)}
    expected = {(plan.label(c.src), "cpu", "gpu0", format_bytes(c.nbytes)) for c in read}
    assert set(copy_labels) == expected and len(expected) == 5  # inp_pos, k/v idxs, kq_mask, out_ids


def test_node_graph_of_two_layers_and_the_output(tiny_llama):
    plan = plan_of(tiny_llama, 2)
    dot = plan_to_dot(plan, parse_layers("0-1,output", tiny_llama.hparams.n_layer))
    every_op = {plan.ids[id(n)] for n in plan.graph.nodes if not n.op.is_view}
    inp_embd = plan.ids[id(plan.find("inp_embd"))]
    assert dot_nodes(dot, "op") == every_op - {inp_embd}  # the input row was not chosen
    assert inp_embd in dot_nodes(dot, "outside")
    assert re.findall(r"cluster_split_(\d+)", dot) == ["0", "1"]


def test_parse_layers_and_titles():
    assert parse_layers("3-5", 30) == {3, 4, 5} and parse_layers("4", 30) == {4}
    assert parse_layers("28-29,output", 30) == {28, 29, "output"}
    assert rows_title({"output", 3, 4, 5, 9}) == "layers 3-5, layer 9, output"
    for bad, message in [("5-3", "outside the model's layers 0-29"), ("30", "outside"), ("x", "not a layer")]:
        with pytest.raises(ValueError, match=message):
            parse_layers(bad, 30)


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_layer_picture_png_is_drawn_one_to_one(half_plan):
    svg = plan_to_svg(half_plan)
    root = ET.fromstring(svg)
    assert png_size(svg_to_png(svg)) == (int(root.get("width")), int(root.get("height")))


def test_node_graph_renders_as_svg_and_png(half_plan):
    dot = plan_to_dot(half_plan, {1})
    root = ET.fromstring(render_dot(dot, "svg"))
    titles = {g.find(f"{SVG}title").text for g in root.iter(f"{SVG}g") if g.get("class", "").startswith("node")}
    assert {f"v{i}" for i in dot_nodes(dot, "op")} <= titles
    width, height = png_size(render_dot(dot, "png"))
    assert 200 < width < 5000 and 200 < height < 20000


def test_missing_tool_names_the_package(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda tool: None)
    with pytest.raises(RenderError, match="apt-get install graphviz"):
        render_dot("digraph g {}", "png")
    with pytest.raises(RenderError, match="apt-get install librsvg2-bin"):
        svg_to_png("<svg/>")


@pytest.mark.slow
def test_smollm2_ngl10_picture():
    """The picture the docs describe: 30 layer rows, the split at layer 20, 7 copies."""
    import llamir
    from llamir.frontend.default_model import default_model_path

    model = llamir.load_model(default_model_path(progress=False))
    devices = [backend_from_spec("sim:gpu0"), backend_from_spec("cpu")]
    plan = plan_model(model, devices, PlacementParams(n_gpu_layers=10), n_tokens=1, n_ctx=4096).plan
    root = ET.fromstring(plan_to_svg(plan))
    rows = [t.text for t in root.iter(f"{SVG}text") if t.get("class") == "row"]
    assert len(rows) == 32 and rows[21] == "layer 20"
    assert len(groups(root, "band")) == 2 and len(groups(root, "copy")) == 7
    segments = [(g.get("data-split"), g.find(f"{SVG}title").text) for g in groups(root, "segment")]
    assert ("1", "layer 20: 1 ops in split 1 on gpu0") in segments  # the residual add of layer 20
    assert int(root.get("width")) < 1600 and int(root.get("height")) < 1200
