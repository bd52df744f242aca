"""The CUDA plugin's tests run on the emulated device (tests/conftest.py picks the driver)."""

from __future__ import annotations

import pytest

from llamir.backends import get_backend, get_registry


@pytest.fixture(scope="session")
def cuda():
    device = get_registry("cuda").devices()[0]
    assert not device.unusable, f"the CUDA device is not usable: {device.unusable}"
    return get_backend("cuda")
