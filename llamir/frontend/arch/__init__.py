"""Architectures, one file each; importing this package registers them all."""

# one line per architecture module (registration on import)
from llamir.frontend.arch import (
    bert,  # noqa: F401
    gemma2,  # noqa: F401
    gemma3,  # noqa: F401
    gpt2,  # noqa: F401
    jamba,  # noqa: F401
    llama,  # noqa: F401
    mamba,  # noqa: F401
    phi3,  # noqa: F401
    qwen2,  # noqa: F401
    qwen2moe,  # noqa: F401
    qwen3,  # noqa: F401
    qwen3moe,  # noqa: F401
    stablelm,  # noqa: F401
    starcoder2,  # noqa: F401
    t5,  # noqa: F401
)
from llamir.frontend.arch.base import ARCHS, ArchError, Architecture, TensorSpec, register_arch

__all__ = ["ARCHS", "ArchError", "Architecture", "TensorSpec", "register_arch"]
