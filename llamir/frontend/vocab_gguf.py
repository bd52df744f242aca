"""The metadata of a GGUF file, for loading vocabularies (now the one reader in gguf_file.py)."""

from llamir.frontend.gguf_file import read_metadata

__all__ = ["read_metadata"]
