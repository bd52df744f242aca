"""Backend registries, after ggml-backend's reg/device layers.

A registry (BackendReg) names a backend kind, enumerates its devices (name, description, type,
free/total memory, capabilities, and why one is unusable) and initialises a backend on one with
options. The built-ins are numpy, numpy-fast, llvm, sim and null; plugins add theirs through the
`llamir.backends` entry-point group (the entry point gives a BackendReg class or instance; they
are loaded lazily, on the first lookup that needs them).

Device specs, for the scheduler and the CLI:

    NAME[:INDEX][:KEY=VALUE]...     vulkan:0, cuda:1, llvm:threads=1, numpy:numerics=avx2
    cpu                             the numpy reference on the host CPU
    sim:NAME[:KEY=VALUE]...         a simulated device (llamir.backends.sim.spec)
    null[:NAME]                     claims every op, runs nothing
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, ClassVar

from llamir.backends.base import Backend, BackendError, Device

ENTRY_POINT_GROUP = "llamir.backends"


class SpecError(ValueError):
    """A device spec that cannot be parsed; the message quotes the spec and the bad part."""


@dataclass(frozen=True)
class Option:
    """A KEY=VALUE option of a spec: the keyword it becomes, how its text is read, and help."""

    keyword: str
    parse: Callable[[str], Any]
    help: str = ""


def parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("yes", "true", "on", "1"):
        return True
    if low in ("no", "false", "off", "0"):
        return False
    raise ValueError(f"expected yes or no, got {text!r}")


def parse_threads(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"must be >= 1, got {text!r}")
    return value


class BackendReg(abc.ABC):
    """One kind of backend: its devices, and backends made on them (ggml_backend_reg)."""

    name: ClassVar[str] = "?"
    description: ClassVar[str] = ""
    options: ClassVar[Mapping[str, Option]] = {}

    @abc.abstractmethod
    def devices(self) -> list[Device]:
        """The devices this registry can make backends on (ggml_backend_reg_dev_get)."""

    @abc.abstractmethod
    def init_backend(self, device: Device, **options) -> Backend:
        """A new backend on `device` (ggml_backend_dev_init), with keyword options."""

    def device(self, index: int) -> Device:
        devices = self.devices()
        if not devices:
            raise BackendError(f"backend {self.name} has no devices")
        if not 0 <= index < len(devices):
            raise BackendError(f"backend {self.name} has devices 0..{len(devices) - 1}, not {index}")
        dev = devices[index]
        if dev.unusable:
            raise BackendError(f"device {self.name}:{index} ({dev.name}) cannot be used: {dev.unusable}")
        return dev

    def backend(self, index: int = 0, **options) -> Backend:
        """A backend on device `index` with keyword options; a clear error for an unknown one."""
        dev = self.device(index)
        try:
            return self.init_backend(dev, **options)
        except TypeError as err:
            if not options:
                raise
            raise BackendError(f"backend {self.name!r} does not take the options {', '.join(options)}: {err}") from None

    def from_spec(self, spec: str, fields: list[str]) -> Backend:
        """A backend from the spec's fields after the name: [INDEX][:KEY=VALUE]..."""
        index = 0
        if fields and "=" not in fields[0]:
            try:
                index = int(fields[0])
            except ValueError:
                raise SpecError(
                    f"device spec {spec!r}: {fields[0]!r} is neither a device index nor KEY=VALUE"
                ) from None
            fields = fields[1:]
        options: dict[str, Any] = {}
        for field in fields:
            key, eq, text = field.partition("=")
            if not eq:
                raise SpecError(f"device spec {spec!r}: {field!r} is not KEY=VALUE")
            option = self.options.get(key)
            if option is None:
                known = ", ".join(sorted(self.options)) or "none"
                raise SpecError(f"device spec {spec!r}: backend {self.name} has no option {key!r} (options: {known})")
            if option.keyword in options:
                raise SpecError(f"device spec {spec!r}: {key} is given twice")
            try:
                options[option.keyword] = option.parse(text)
            except ValueError as err:
                raise SpecError(f"device spec {spec!r}: {key}={text}: {err}") from None
        try:
            return self.backend(index, **options)
        except BackendError as err:
            raise SpecError(f"device spec {spec!r}: {err}") from None


# -- built-in registries ----------------------------------------------------------------------------
def _numerics(text: str):
    from llamir.ir.numerics import numerics_named

    return numerics_named(text)


_CPU_OPTIONS = {
    "threads": Option("n_threads", parse_threads, "threads (default: the CPUs this process may use)"),
    "numerics": Option("numerics", _numerics, "the ggml build whose arithmetic it reproduces (avx512, avx2)"),
}


class NumpyReg(BackendReg):
    name = "numpy"
    description = "the numpy reference interpreter (ggml's CPU arithmetic, bit for bit)"
    options = _CPU_OPTIONS
    exact: ClassVar[bool] = True

    def devices(self) -> list[Device]:
        from llamir.backends.base import cpu_device

        return [cpu_device()]

    def init_backend(self, device: Device, **options) -> Backend:
        from llamir.backends.numpy import NumpyBackend

        return NumpyBackend(device, exact=self.exact, **options)


class NumpyFastReg(NumpyReg):
    name = "numpy-fast"
    description = "the numpy interpreter with BLAS matmuls (within float32 rounding of the reference)"
    exact = False


class LLVMReg(BackendReg):
    name = "llvm"
    description = "native code for the host CPU through llvmlite (LLVM JIT)"
    options = {
        **_CPU_OPTIONS,
        "cache": Option("disk_cache", parse_bool, "keep compiled code on disk (default yes)"),
    }

    def devices(self) -> list[Device]:
        from llamir.backends.base import cpu_device
        from llamir.backends.llvm.target import host_target

        return [cpu_device("cpu", f"host CPU (LLVM JIT, {host_target().describe()})")]

    def init_backend(self, device: Device, **options) -> Backend:
        from llamir.backends.llvm import LLVMBackend

        return LLVMBackend(**options)


class SimReg(BackendReg):
    name = "sim"
    description = "simulated devices: a chosen op set run through numpy, every copy counted"

    def devices(self) -> list[Device]:
        from llamir.backends.sim import SimBackend

        return [SimBackend().device]

    def init_backend(self, device: Device, **options) -> Backend:
        from llamir.backends.sim import SimBackend

        return SimBackend(**options)

    def from_spec(self, spec: str, fields: list[str]) -> Backend:
        from llamir.backends.sim import SimBackend

        return SimBackend.from_spec(spec)


class NullReg(BackendReg):
    name = "null"
    description = "claims every op and runs nothing (walks multi-device paths without hardware)"

    def devices(self) -> list[Device]:
        from llamir.backends.null import NullBackend

        return [NullBackend().device]

    def init_backend(self, device: Device, **options) -> Backend:
        from llamir.backends.null import NullBackend

        return NullBackend(**options)

    def from_spec(self, spec: str, fields: list[str]) -> Backend:
        from llamir.backends.null import NullBackend

        if len(fields) > 1:
            raise SpecError(f"device spec {spec!r}: null takes one field, a device name")
        return NullBackend(fields[0] if fields else "null")


BUILTINS: dict[str, BackendReg] = {
    reg.name: reg for reg in (NumpyReg(), LLVMReg(), NumpyFastReg(), SimReg(), NullReg())
}
_registered: dict[str, BackendReg] = {}
_plugins: dict[str, Callable[[], BackendReg]] | None = None
_loaded: dict[str, BackendReg] = {}
_broken: dict[str, str] = {}


def register_backend(reg: BackendReg) -> None:
    """Add a registry in this process (plugins normally use the entry point instead)."""
    if not isinstance(reg, BackendReg):
        raise TypeError(f"register_backend takes a BackendReg, got {type(reg).__name__}")
    _registered[reg.name] = reg


def _plugin_entry_points() -> dict[str, Callable[[], BackendReg]]:
    global _plugins
    if _plugins is None:
        _plugins = {ep.name: ep.load for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return _plugins


def _load_plugin(name: str) -> BackendReg:
    if name not in _loaded:
        try:
            obj = _plugin_entry_points()[name]()
            reg = obj() if isinstance(obj, type) else obj
        except Exception as err:  # noqa: BLE001 - a broken plugin must not take the others down
            _broken[name] = f"{type(err).__name__}: {err}"
            raise BackendError(f"plugin backend {name!r} failed to load: {_broken[name]}") from err
        if not isinstance(reg, BackendReg):
            raise BackendError(f"plugin backend {name!r}: its entry point gives a {type(reg).__name__}, "
                               f"not a llamir.backends.BackendReg")
        _loaded[name] = reg
    return _loaded[name]


def reload_plugins() -> None:
    """Look at the entry points again (after a plugin was installed into this environment)."""
    global _plugins
    _plugins = None
    _loaded.clear()
    _broken.clear()


def available_backends() -> list[str]:
    return sorted(set(BUILTINS) | set(_registered) | set(_plugin_entry_points()))


def get_registry(name: str) -> BackendReg:
    """The registry of a backend name; a clear error lists the known names."""
    if name in _registered:
        return _registered[name]
    if name in BUILTINS:
        return BUILTINS[name]
    if name in _plugin_entry_points():
        return _load_plugin(name)
    raise BackendError(f"unknown backend {name!r}; available: {', '.join(available_backends())}")


def get_backend(name: str, device: int = 0, **options) -> Backend:
    """A new backend by name on device `device`, made with keyword `options` (the CPU backends
    take `numerics` and `n_threads`); a clear error lists the known names, or says which option
    a backend refuses."""
    return get_registry(name).backend(device, **options)


def backend_from_spec(spec: str) -> Backend:
    """A backend from its text spec (see the module docstring)."""
    text = spec.strip()
    if not text:
        raise SpecError("empty device spec")
    head, *fields = text.split(":")
    if head == "cpu":
        if fields:
            raise SpecError(f"device spec {spec!r}: the CPU takes no options (use numpy:KEY=VALUE)")
        head = "numpy"
    try:
        reg = get_registry(head)
    except BackendError as err:
        raise SpecError(f"device spec {spec!r}: {err}") from None
    return reg.from_spec(text, fields)


__all__ = [
    "BUILTINS",
    "ENTRY_POINT_GROUP",
    "BackendReg",
    "Option",
    "SpecError",
    "available_backends",
    "backend_from_spec",
    "get_backend",
    "get_registry",
    "parse_bool",
    "parse_threads",
    "register_backend",
    "reload_plugins",
]
