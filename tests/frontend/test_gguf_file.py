"""GGUFFile against gguf.GGUFReader (an independent reader of the same container)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from llamir.frontend.gguf_file import GGUFError, GGUFFile
from llamir.frontend.synth import SynthSpec, write_model


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "q8_0", "q4_1"])
def test_metadata_and_tensors_match_gguf_reader(tmp_path, dtype):
    path = write_model(tmp_path / "m.gguf", SynthSpec(dtype=dtype, n_layer=1))
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        want = field.contents()
        got = ours.metadata[key]
        if isinstance(want, list):
            assert list(got) == pytest.approx(want) if not isinstance(want[0], str) else list(got) == want
        else:
            assert got == pytest.approx(want) if isinstance(want, float) else got == want
    assert set(ours.tensors) == {t.name for t in ref.tensors}
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert mine.shape == tuple(int(n) for n in reversed(t.shape.tolist()))
        want = np.asarray(t.data).view(np.uint8).reshape(-1)
        np.testing.assert_array_equal(mine.data.view(np.uint8).reshape(-1), want)


def test_bad_alignment_and_dims_are_named(tmp_path):
    path = write_model(tmp_path / "m.gguf", SynthSpec(n_layer=1))
    data = bytearray(path.read_bytes())
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data[:4]) + (7).to_bytes(4, "little") + bytes(data[8:]))
    with pytest.raises(GGUFError, match="GGUF version 7 is not supported"):
        GGUFFile(bad)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFError, match="too short"):
        GGUFFile(empty)
