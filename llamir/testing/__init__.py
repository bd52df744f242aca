"""Test helpers: the llama.cpp oracle harness (llama_cpp itself is imported only when used)."""

from llamir.testing.llama_cpp import LlamaCppOracle, nmse

__all__ = ["LlamaCppOracle", "nmse"]
