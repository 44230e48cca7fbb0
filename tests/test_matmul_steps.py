"""Chapter 01's four steps from register blocking to the package's kernel (kernels/steps/), against float64."""

import numpy as np
import pytest

from gpt2_cupy import kernels
from gpt2_cupy.testing import relative_error

TOLERANCE = 1e-4  # chapter 01's: a sum of K float32 products, K <= 516
STEPS = ["matmul_float4", "matmul_transposed_a", "matmul_warp_tiles", "matmul_double_buffered"]


def blocks(n, size):
    return (n + size - 1) // size


@pytest.mark.parametrize("name", STEPS)
@pytest.mark.parametrize("M, N, K", [(1, 4, 4), (127, 68, 36), (130, 132, 516), (257, 260, 8)])
def test_step_matches_float64(name, M, N, K, rng, to_device, to_host):
    """Sizes that leave ragged 128 x 128 tiles and slices of K; N and K multiples of 4, as the steps need."""
    a = rng.standard_normal((M, K), dtype=np.float32)
    b = rng.standard_normal((K, N), dtype=np.float32)
    c = to_device(np.full((M, N), np.nan, dtype=np.float32))  # every element must be written
    kernels.function(f"steps/{name}", name)((blocks(N, 128), blocks(M, 128)), (256,),
                                            (c, to_device(a), to_device(b), np.int32(M), np.int32(N), np.int32(K)))
    assert relative_error(to_host(c), a.astype(np.float64) @ b.astype(np.float64)) < TOLERANCE
