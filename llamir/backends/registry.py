"""Backends by name: the built-ins, plus plugins registered under the `llamir.backends`
entry-point group (loaded lazily, on first lookup of an unknown name), and device specs
(`cpu`, `null[:NAME]`, `sim:NAME[:KEY=VALUE]...`, or any backend name) for the scheduler."""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points

from llamir.backends.base import Backend, BackendError

ENTRY_POINT_GROUP = "llamir.backends"


def _numpy(**options) -> Backend:
    from llamir.backends.numpy import NumpyBackend

    return NumpyBackend(**options)


def _numpy_fast(**options) -> Backend:
    from llamir.backends.numpy import NumpyBackend

    return NumpyBackend(exact=False, **options)


def _lazy(module: str, cls: str) -> Callable[..., Backend]:
    def make(**options) -> Backend:
        import importlib

        return getattr(importlib.import_module(module), cls)(**options)

    return make


BUILTINS: dict[str, Callable[..., Backend]] = {
    "numpy": _numpy,
    "llvm": _lazy("llamir.backends.llvm", "LLVMBackend"),
    "numpy-fast": _numpy_fast,
    "sim": _lazy("llamir.backends.sim", "SimBackend"),
    "null": _lazy("llamir.backends.null", "NullBackend"),
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


def get_backend(name: str, **options) -> Backend:
    """A new backend instance by name, made with `options` (the CPU backends take `numerics` and
    `n_threads`); a clear error lists the known names, or says which option a backend refuses."""
    if name in BUILTINS:
        factory = BUILTINS[name]
    else:
        plugins = _load_plugins()
        if name not in plugins:
            raise BackendError(f"unknown backend {name!r}; available: {', '.join(available_backends())}")
        factory = plugins[name]()
        if not callable(factory):
            if options:
                raise BackendError(f"backend {name!r} is an instance and takes no options ({', '.join(options)})")
            return factory
    try:
        return factory(**options)
    except TypeError as err:
        if not options:
            raise
        raise BackendError(f"backend {name!r} does not take the options {', '.join(options)}: {err}") from None


def backend_from_spec(spec: str) -> Backend:
    """A device for the scheduler from its text spec:

    cpu | numpy          the host CPU (numpy reference)
    null | null:NAME     claims every op, runs nothing
    sim:NAME[:KEY=VAL]   a simulated device (see llamir.backends.sim.spec)
    NAME                 any registered backend or plugin (llvm, cuda, ...)
    """
    from llamir.backends.sim.spec import SpecError

    text = spec.strip()
    if not text:
        raise SpecError("empty device spec")
    head, _, rest = text.partition(":")
    if head in ("cpu", "numpy"):
        if rest:
            raise SpecError(f"device spec {spec!r}: the CPU takes no options")
        return _numpy()
    if head == "null":
        from llamir.backends.null import NullBackend

        return NullBackend(rest or "null")
    if head == "sim":
        from llamir.backends.sim import SimBackend

        return SimBackend.from_spec(text)
    if rest:
        raise SpecError(
            f"device spec {spec!r}: unknown device kind {head!r} (cpu, null[:NAME], "
            f"sim:NAME[:KEY=VALUE]..., or a backend: {', '.join(available_backends())})"
        )
    try:
        return get_backend(head)
    except BackendError as err:
        raise SpecError(f"device spec {spec!r}: {err}") from None
