"""Backends by name: the built-ins, plus plugins registered under the `llamir.backends`
entry-point group (loaded lazily, on first lookup of an unknown name)."""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points

from llamir.backends.base import Backend, BackendError

ENTRY_POINT_GROUP = "llamir.backends"


def _numpy() -> Backend:
    from llamir.backends.numpy import NumpyBackend

    return NumpyBackend()


def _lazy(module: str, cls: str) -> Callable[[], Backend]:
    def make() -> Backend:
        import importlib

        return getattr(importlib.import_module(module), cls)()
    return make


BUILTINS: dict[str, Callable[[], Backend]] = {
    "numpy": _numpy,
    "llvm": _lazy("llamir.backends.llvm", "LLVMBackend"),
}
_plugins: dict[str, Callable[[], Backend]] | None = None


def register_backend(name: str, factory: Callable[[], Backend]) -> None:
    BUILTINS[name] = factory


def _load_plugins() -> dict[str, Callable[[], Backend]]:
    global _plugins
    if _plugins is None:
        _plugins = {ep.name: ep.load for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return _plugins


def available_backends() -> list[str]:
    return sorted(set(BUILTINS) | set(_load_plugins()))


def get_backend(name: str) -> Backend:
    """A new backend instance by name; a clear error lists the known ones."""
    if name in BUILTINS:
        return BUILTINS[name]()
    plugins = _load_plugins()
    if name in plugins:
        factory = plugins[name]()
        return factory() if callable(factory) else factory
    raise BackendError(f"unknown backend {name!r}; available: {', '.join(available_backends())}")
