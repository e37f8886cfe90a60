"""Fixtures shared by test modules."""

from __future__ import annotations

import os

import pytest

import fakegpu


@pytest.fixture(scope="session")
def fakes(tmp_path_factory) -> dict[str, str]:
    """Paths of the fake libnccl.so.2 and libcudart.so.13, built once per session."""
    return fakegpu.build(tmp_path_factory.mktemp("fake-libs"))


def pytest_configure(config: pytest.Config) -> None:
    # The ranks of every job the suite starts take the fixed algorithm table, not one
    # measured on a machine as busy as CI's: the same algorithms in every run, and no
    # calibration in each job. tests/test_algorithms.py measures (and tests) its own.
    os.environ.setdefault("RINGPLUG_CALIBRATION", "fixed")
