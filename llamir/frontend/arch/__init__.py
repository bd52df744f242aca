"""Architectures, one file each; importing this package registers them all."""

from llamir.frontend.arch import gemma3, llama, qwen2, qwen3  # noqa: F401  (registration)
from llamir.frontend.arch.base import ARCHS, ArchError, Architecture, TensorSpec, register_arch

__all__ = ["ARCHS", "ArchError", "Architecture", "TensorSpec", "register_arch"]
