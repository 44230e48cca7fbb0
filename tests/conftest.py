"""Shared pieces of the test suite.

Tests run on whichever backend gpt2_cupy.backend picked (GPT2_CUPY_BACKEND=cuda|cpu, or cuda when a GPU is
there). Tests about the CPU executor itself carry the `cpu_only` marker and are skipped on a GPU.
"""

import numpy as np
import pytest

from gpt2_cupy import backend


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu_only: checks the CPU executor itself; skipped on a GPU")


def pytest_report_header(config):
    return f"gpt2_cupy backend: {backend.name}"


def pytest_collection_modifyitems(config, items):
    if backend.name == "cpu":
        return
    skip = pytest.mark.skip(reason=f"checks the CPU executor; the active backend is {backend.name}")
    for item in items:
        if "cpu_only" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng():
    """A random generator with a fixed seed, so that every run sees the same data."""
    return np.random.default_rng(20240601)


@pytest.fixture
def to_device():
    """A copy of a numpy array on the backend (a cupy array on a GPU, a new numpy array on the CPU).

    Always a copy, on both backends: a kernel that writes into it must not change the test's reference.
    """

    def copy(array):
        # np.array, not np.ascontiguousarray: the latter turns a 0-d array (a loss) into shape (1,)
        return backend.xp.array(np.array(array, order="C"), copy=True)

    return copy


@pytest.fixture
def to_host():
    """Copy a backend array back into numpy (waits for launched kernels to finish)."""

    def copy(array):
        backend.synchronize()
        return backend.asnumpy(array)

    return copy
