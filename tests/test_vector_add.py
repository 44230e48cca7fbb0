"""kernels/steps/vector_add.cu (chapter 00) against float64 numpy, on sizes that are not multiples of the block size.

float32 addition rounds the exact sum once, so every element must lie within 2^-24 (relative) of the float64
sum, and equal numpy's own float32 sum bit for bit.
"""

import numpy as np
import pytest

from gpt2_cupy import backend, kernels
from gpt2_cupy.ops.arrays import ceil_div

SIZES = [1, 31, 255, 257, 1000, 65_537]
UNIT_ROUNDOFF = 2.0**-24


def random_pair(rng, n):
    return rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n, dtype=np.float32)


def assert_rounded_sum(out, a, b):
    """out is a + b computed in float32: the float64 sum rounded once."""
    exact = a.astype(np.float64) + b.astype(np.float64)
    error = np.abs(out.astype(np.float64) - exact)
    worst = int(np.argmax(error - UNIT_ROUNDOFF * np.abs(exact)))
    assert np.all(error <= UNIT_ROUNDOFF * np.abs(exact)), (
        f"element {worst}: got {out[worst]!r}, exact sum {exact[worst]!r}")
    np.testing.assert_array_equal(out, a + b)


def launched_sum(kernel_name, n, blocks, threads_per_block, rng, to_device, to_host):
    """(out, a, b) after one launch of kernel_name on n random elements; out starts as NaN everywhere."""
    a, b = random_pair(rng, n)
    out = to_device(np.full(n, np.nan, dtype=np.float32))
    kernel = kernels.function("steps/vector_add", kernel_name)
    kernel((blocks,), (threads_per_block,), (out, to_device(a), to_device(b), np.int32(n)))
    return to_host(out), a, b


@pytest.mark.parametrize("threads_per_block", [32, 256, 1024])
@pytest.mark.parametrize("n", SIZES)
def test_vector_add_matches_float64(n, threads_per_block, rng, to_device, to_host):
    blocks = ceil_div(n, threads_per_block)
    assert_rounded_sum(*launched_sum("vector_add", n, blocks, threads_per_block, rng, to_device, to_host))


@pytest.mark.parametrize("blocks", [1, 3, 7])
@pytest.mark.parametrize("n", SIZES)
def test_grid_stride_with_a_grid_smaller_than_the_data(n, blocks, rng, to_device, to_host):
    """A grid of blocks * 128 threads; for most sizes far fewer threads than elements."""
    assert_rounded_sum(*launched_sum("vector_add_grid_stride", n, blocks, 128, rng, to_device, to_host))


@pytest.mark.parametrize("n", [1, 257, 1000])
def test_grid_stride_with_a_grid_larger_than_the_data(n, rng, to_device, to_host):
    blocks = ceil_div(n, 128) + 5
    assert_rounded_sum(*launched_sum("vector_add_grid_stride", n, blocks, 128, rng, to_device, to_host))


@pytest.mark.parametrize("kernel_name, blocks", [("vector_add", 4), ("vector_add_grid_stride", 2)])
def test_nothing_is_written_past_n(kernel_name, blocks, rng, to_device, to_host):
    """The threads past n (the last block's spare ones) leave memory beyond element n - 1 alone."""
    kernel = kernels.function("steps/vector_add", kernel_name)
    n, spare = 1000, 200  # 4 blocks of 256 threads: 24 threads past n
    a, b = random_pair(rng, n + spare)
    out = to_device(np.full(n + spare, np.nan, dtype=np.float32))
    kernel((blocks,), (256,), (out, to_device(a), to_device(b), np.int32(n)))
    out = to_host(out)
    assert_rounded_sum(out[:n], a[:n], b[:n])
    assert np.all(np.isnan(out[n:])), f"elements past n written: {np.flatnonzero(~np.isnan(out[n:]))[:5] + n}"


@pytest.mark.skipif(backend.name != "cpu", reason="the bounds check exists on the CPU executor only")
def test_vector_add_passes_the_bounds_check(rng, to_device, to_host):
    """On the CPU executor, no thread of a grid with spare threads touches memory outside the arrays."""
    a, b = random_pair(rng, 1000)
    out = np.zeros(1000, dtype=np.float32)
    with backend.checks(bounds=True):
        kernels.function("steps/vector_add", "vector_add")((4,), (256,), (out, a, b, np.int32(1000)))
        kernels.function("steps/vector_add", "vector_add_grid_stride")((3,), (100,), (out, a, b, np.int32(1000)))
    assert_rounded_sum(out, a, b)
