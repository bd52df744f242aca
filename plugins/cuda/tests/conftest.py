"""Test setup for the CUDA plugin: the `gpu` marker (cases that need a real NVIDIA GPU)."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a real GPU; skipped without one")
