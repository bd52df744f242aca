"""Architectures, one file each; importing this package registers them all."""

# one line per architecture module (registration on import)
from llamir.frontend.arch import (
    gemma3,  # noqa: F401
    llama,  # noqa: F401
    qwen2,  # noqa: F401
    qwen3,  # noqa: F401
)
from llamir.frontend.arch.base import ARCHS, ArchError, Architecture, TensorSpec, register_arch

__all__ = ["ARCHS", "ArchError", "Architecture", "TensorSpec", "register_arch"]
