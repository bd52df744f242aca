"""Where llamir keeps files between runs: the default model, rewritten models, compiled code.

`LLAMIR_CACHE_DIR` overrides the platform's user cache directory; this is the one place it is read.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

CACHE_DIR_ENV = "LLAMIR_CACHE_DIR"


def cache_dir() -> Path:
    """The llamir cache directory ($LLAMIR_CACHE_DIR, else the user cache dir), created on demand."""
    override = os.environ.get(CACHE_DIR_ENV)
    path = Path(override).expanduser() if override else Path(platformdirs.user_cache_dir("llamir"))
    path.mkdir(parents=True, exist_ok=True)
    return path
