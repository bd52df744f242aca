"""Backends: the interface, the registry and the built-in devices."""

from llamir.backends.base import Backend, BackendError, Executable
from llamir.backends.registry import available_backends, get_backend, register_backend

__all__ = ["Backend", "BackendError", "Executable", "available_backends", "get_backend", "register_backend"]
