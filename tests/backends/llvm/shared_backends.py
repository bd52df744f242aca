"""LLVM backends the test modules share, one per configuration (numerics profile, target, thread
count), closed after each module (conftest) so that no module keeps another's thread pools."""

from __future__ import annotations

from llamir.backends.llvm import LLVMBackend
from llamir.backends.llvm.target import Target

_OPEN: dict = {}


def shared_backend(numerics: str | None = None, target: Target | None = None, n_threads: int = 2) -> LLVMBackend:
    """The backend of this configuration (code cache in memory only), made on first use."""
    key = (numerics, target, n_threads)
    if key not in _OPEN:
        _OPEN[key] = LLVMBackend(n_threads=n_threads, disk_cache=False, numerics=numerics, target=target)
    return _OPEN[key]


def close_shared_backends() -> None:
    for backend in _OPEN.values():
        backend.close()
    _OPEN.clear()
