"""Backends: the interface, the registry and the built-in devices."""

from llamir.backends.base import (
    Backend,
    BackendError,
    Buffer,
    BufferType,
    BufferUsage,
    Device,
    DeviceCaps,
    DeviceType,
    Event,
    Executable,
)
from llamir.backends.registry import available_backends, backend_from_spec, get_backend, register_backend

__all__ = [
    "Backend",
    "BackendError",
    "Buffer",
    "BufferType",
    "BufferUsage",
    "Device",
    "DeviceCaps",
    "DeviceType",
    "Event",
    "Executable",
    "available_backends",
    "backend_from_spec",
    "get_backend",
    "register_backend",
]
