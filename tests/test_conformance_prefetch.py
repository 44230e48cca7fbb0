"""Conformance of PTX's prefetches: prefetch[.global].{L1,L2}, prefetch.global.L2::{evict_last,evict_normal},
prefetchu.L1, and on compute capability 9.0 the bulk copy engine's cp.async.bulk.prefetch.L2.global (with and
without a cache policy), through inline PTX, as kernels that ask for lines ahead of their reads write them
(CUTLASS's prefetches of the next tiles, say).

They are hints: a kernel that asks for the lines it then reads, and for lines it never reads, computes what it
computes without them. Like tests/test_conformance.py, every test runs on the active backend: on a GPU it
checks that NVRTC takes these forms and the results are untouched; on the CPU, that the executor runs them (as
no-ops) and refuses a bulk prefetch of a size or address that is not a multiple of 16 bytes, as a GPU does.
"""

import numpy as np
import pytest

from gpt2_cupy import backend

# out[i] = 2 x[i] + 1, each thread first asking for its element (and the line 128 bytes on) every way there is,
# and the block's part of x (at most bulk_bytes) by one bulk prefetch, with a cache policy in odd blocks
# (CUTLASS's CacheHintSm90::EVICT_LAST).
PREFETCHED_SCALE = r"""
extern "C" __global__ void prefetched_scale(float* out, const float* x, int n, int bulk_bytes)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    const float* at = x + min(i, n - 33);          // at + 128 bytes still inside x
    asm volatile("prefetch.global.L2 [%0];" :: "l"(at));
    asm volatile("prefetch.global.L1 [%0];" :: "l"(at));
    asm volatile("prefetch.L2 [%0];" :: "l"(at));                 // a generic address
    asm volatile("prefetch.L1 [%0];" :: "l"(at));
    asm volatile("prefetch.global.L2::evict_last [%0];" :: "l"(at));
    asm volatile("prefetch.global.L2::evict_normal [%0];" :: "l"(at));
    asm volatile("prefetchu.L1 [%0];" :: "l"(at));
    asm volatile("{ .reg .u64 a; mov.u64 a, %0; prefetch.global.L2 [a+128]; }" :: "l"(at));
    const float* block_start = x + blockIdx.x * blockDim.x;
    unsigned bytes = (unsigned)min(bulk_bytes, 4 * (n - (int)(blockIdx.x * blockDim.x)));
#if __CUDA_ARCH__ >= 900
    if (threadIdx.x == 0 && blockIdx.x % 2 == 0) {
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(block_start), "r"(bytes) : "memory");
    }
    if (threadIdx.x == 0 && blockIdx.x % 2 == 1) {
        asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;"
                     :: "l"(block_start), "r"(bytes), "l"(0x14F0000000000000ull) : "memory");
    }
#endif
    if (i < n) out[i] = 2.0f * x[i] + 1.0f;
}
"""


def test_prefetched_reads_give_what_the_reads_alone_give(rng, to_device, to_host):
    """Blocks of 128 threads over 1000 elements (the last block part outside, its bulk prefetch 416 bytes):
    every prefetch form, then the reads, equal to numpy's 2 x + 1."""
    n, threads = 1000, 128
    x = rng.normal(size=n).astype(np.float32)
    out = backend.xp.zeros(n, dtype=np.float32)
    kernel = backend.RawKernel(PREFETCHED_SCALE, "prefetched_scale")
    kernel(((n + threads - 1) // threads,), (threads,), (out, to_device(x), np.int32(n), np.int32(4 * threads)))
    np.testing.assert_array_equal(to_host(out), 2.0 * x + 1.0)


@pytest.mark.cpu_only
@pytest.mark.parametrize("bulk_bytes", [4 * 128 - 4, 4 * 128 + 8])
def test_a_bulk_prefetch_of_a_size_not_a_multiple_of_16_is_reported(bulk_bytes, to_device):
    from gpt2_cupy.cpu import KernelError

    out, x = backend.xp.zeros(256, dtype=np.float32), to_device(np.ones(256, np.float32))
    kernel = backend.RawKernel(PREFETCHED_SCALE, "prefetched_scale")
    with pytest.raises(KernelError, match="cp.async.bulk.prefetch.L2: the size and the address must be multiples"):
        kernel((2,), (128,), (out, x, np.int32(256), np.int32(bulk_bytes)))


@pytest.mark.cpu_only
def test_a_bulk_prefetch_from_an_address_not_on_16_bytes_is_reported(to_device):
    from gpt2_cupy.cpu import KernelError

    code = r"""
extern "C" __global__ void off_by_four(const float* x)
{
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], 16;" :: "l"(x + 1) : "memory");
}
"""
    with pytest.raises(KernelError, match="multiples of 16 bytes"):
        backend.RawKernel(code, "off_by_four")((1,), (1,), (to_device(np.zeros(8, np.float32)),))
