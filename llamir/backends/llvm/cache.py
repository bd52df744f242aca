"""The compile cache: object code by (graph fingerprint, target, code version), in memory and on
disk under llamir.paths.cache_dir()/llvm; one entry per kernel (shared by every split and model
that uses the same kernel) and one per split's entry function. In memory it also keeps the last
splits linked, so that compiling the same graph again (a second context on a model) only binds.

A disk entry is `MAGIC | sha256(payload) | payload`; an entry that fails the check (truncated,
corrupted, another format) is deleted and rebuilt, never loaded.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import tempfile
from collections import OrderedDict
from pathlib import Path

import llvmlite

log = logging.getLogger("llamir")

MAGIC = b"LLAMIRO1"


@functools.cache
def code_version() -> str:
    """A hash of this backend's sources and llvmlite's version: code from older sources is stale."""
    h = hashlib.sha256(llvmlite.__version__.encode())
    root = Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


class CompileCache:
    LINKED = 32     # linked splits kept in memory (graph, plan and loaded code each)

    def __init__(self, directory: Path | None):
        self.directory = directory
        self.memory: dict[str, bytes] = {}
        self.linked: OrderedDict[str, tuple] = OrderedDict()
        self.hits = self.misses = self.rejected = 0

    def loaded_split(self, key: str) -> tuple | None:
        """What keep_split kept under `key` (the most recent LINKED), or None."""
        entry = self.linked.get(key)
        if entry is not None:
            self.linked.move_to_end(key)
            self.hits += 1
        return entry

    def keep_split(self, key: str, entry: tuple) -> None:
        self.linked[key] = entry
        self.linked.move_to_end(key)
        while len(self.linked) > self.LINKED:
            self.linked.popitem(last=False)

    @staticmethod
    def key(fingerprint: str, target_key: str, variant: str) -> str:
        text = f"{fingerprint}|{target_key}|{variant}|{code_version()}"
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def get(self, key: str) -> bytes | None:
        obj = self.memory.get(key)
        if obj is not None:
            self.hits += 1
            return obj
        obj = self._read(key)
        if obj is not None:
            self.memory[key] = obj
            self.hits += 1
        else:
            self.misses += 1
        return obj

    def put(self, key: str, obj: bytes) -> None:
        self.memory[key] = obj
        if self.directory is None:
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            payload = MAGIC + hashlib.sha256(obj).digest() + obj
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
            os.replace(tmp, self.path(key))
        except OSError as err:  # a read-only or full cache dir only costs speed
            log.warning("llvm compile cache: cannot write %s: %s", self.directory, err)

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.o"

    def _read(self, key: str) -> bytes | None:
        if self.directory is None:
            return None
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        head = len(MAGIC) + 32
        digest = data[len(MAGIC):head]
        if len(data) < head or data[:len(MAGIC)] != MAGIC or hashlib.sha256(data[head:]).digest() != digest:
            self.rejected += 1
            log.warning("llvm compile cache: discarding corrupt entry %s", path)
            try:
                path.unlink()
            except OSError:
                pass
            return None
        return data[head:]
