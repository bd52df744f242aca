"""Fixtures of the frontend tests: llama.cpp's vocab files (fetched once, never skipped)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizer_fixtures import VocabFilesUnavailable, vocab_files_dir


@pytest.fixture(scope="session")
def vocab_dir() -> Path:
    try:
        return vocab_files_dir()
    except VocabFilesUnavailable as err:   # never skip: CI must fetch them
        pytest.fail(f"llama.cpp vocab files are unavailable: {err}")
