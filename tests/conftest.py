"""Fixtures shared by test modules."""

from __future__ import annotations

import pytest

import fakegpu


@pytest.fixture(scope="session")
def fakes(tmp_path_factory) -> dict[str, str]:
    """Paths of the fake libnccl.so.2 and libcudart.so.13, built once per session."""
    return fakegpu.build(tmp_path_factory.mktemp("fake-libs"))
