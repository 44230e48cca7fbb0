"""Conformance of CuPy's launch conventions that unseen kernels rely on: block sizes of 0, and what
max_dynamic_shared_size_bytes reports. Run on whichever backend is active, like test_conformance.py."""

import numpy as np
import pytest

from gpt2_cupy import backend

BLOCK_SHAPE = r"""
extern "C" __global__ void block_shape(int* out)
{
    atomicAdd(&out[0], 1);  // how many threads ran
    out[1] = blockDim.x;
    out[2] = blockDim.y;
    out[3] = blockDim.z;
}
"""


@pytest.mark.parametrize("block", [(0,), (0, 0), (4, 0), (0, 2, 0)])
def test_a_block_of_zero_threads_along_an_axis_runs_one_there(block):
    """CuPy launches max(1, n) threads along each axis of a block, as it does blocks along a grid's."""
    out = backend.xp.zeros(4, dtype=np.int32)
    backend.RawKernel(BLOCK_SHAPE, "block_shape")((1,), block, (out,))
    shape = [max(1, size) for size in block + (1,) * (3 - len(block))]
    assert backend.asnumpy(out).tolist() == [int(np.prod(shape))] + shape


STATIC_SHARED = r"""
extern "C" __global__ void with_static_shared(float* out)
{
    __shared__ float staged[STATIC_FLOATS];
    extern __shared__ float dynamic[];
    staged[threadIdx.x] = (float)threadIdx.x;
    dynamic[threadIdx.x] = 2.0f * threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = staged[threadIdx.x] + dynamic[threadIdx.x];
}
"""


@pytest.mark.parametrize("static_floats", [32, 256, 4096])
def test_max_dynamic_shared_size_bytes_reports_48_kib_less_the_static_arrays(static_floats):
    kernel = backend.RawKernel(STATIC_SHARED, "with_static_shared", options=(f"-DSTATIC_FLOATS={static_floats}",))
    assert kernel.max_dynamic_shared_size_bytes == 48 * 1024 - 4 * static_floats
    out = backend.xp.zeros(32, dtype=np.float32)
    kernel((1,), (32,), (out,), shared_mem=kernel.max_dynamic_shared_size_bytes)  # all of it is allowed
    assert backend.asnumpy(out).tolist() == [3.0 * t for t in range(32)]


def test_raising_max_dynamic_shared_size_bytes_lets_a_launch_use_it():
    kernel = backend.RawKernel(STATIC_SHARED, "with_static_shared", options=("-DSTATIC_FLOATS=32",))
    kernel.max_dynamic_shared_size_bytes = 100 * 1024
    assert kernel.max_dynamic_shared_size_bytes == 100 * 1024
    out = backend.xp.zeros(32, dtype=np.float32)
    kernel((1,), (32,), (out,), shared_mem=100 * 1024)
    assert backend.asnumpy(out).tolist() == [3.0 * t for t in range(32)]


@pytest.mark.skipif(backend.name != "cpu", reason="the executor's message; CuPy raises the driver's error")
def test_raising_it_past_227_kib_with_the_static_arrays_is_refused_by_name():
    from gpt2_cupy.cpu import LaunchError

    kernel = backend.RawKernel(STATIC_SHARED, "with_static_shared", options=("-DSTATIC_FLOATS=256",))
    kernel.max_dynamic_shared_size_bytes = 227 * 1024 - 1024  # exactly what is left
    with pytest.raises(LaunchError, match=r"with_static_shared.*at most 231424 bytes.*1024 bytes of __shared__"):
        kernel.max_dynamic_shared_size_bytes = 227 * 1024 - 1020
