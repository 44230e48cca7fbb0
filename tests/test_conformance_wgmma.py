"""Conformance: Hopper's wgmma through inline PTX, in small kernels of one warpgroup, checked against float64.

wgmma.mma_async m64nNk16 with bf16 A and B read from shared memory through matrix descriptors (every swizzle
mode, K-major and, with imm-trans-a / imm-trans-b 1, MN-major), D in the accumulator fragment layout of the
PTX ISA; wgmma.fence, commit_group, wait_group; and the wrappers of kernels/include/wgmma.cuh as
kernels/wgmma_matmul.cu uses them (a 64-wide swizzled tile, four steps of k along it, in both majors); and
wgmma.mma_async m64nNk8 .tf32 from K-major 128-byte swizzled tiles of float32, which the tensor core reads by
their upper 19 bits (the low 13 ignored: rounded toward zero to TF32). On a
GPU (an H100 or H200: wgmma needs compute capability 9.0, and the kernels compile for sm_90a) these check our
reading of the PTX ISA; on the CPU, that the executor reads shared memory and places results as the GPU does.

The test lays out each matrix in shared memory itself, from its own reading of the ISA's canonical layouts
(layout_offsets below), in an image whose unused bytes hold bf16 NaNs: a descriptor read the wrong way picks
up a NaN or the wrong element. With small integers as inputs every sum is exact in float32, so the result is
compared bit for bit; with random inputs, within MMA_TOLERANCE of the sum of magnitudes (the order and
precision of the tensor core's accumulation are unspecified).
"""

import numpy as np
import pytest

from gpt2_cupy import backend

ml_dtypes = pytest.importorskip("ml_dtypes")


def _is_hopper():
    return backend.xp.cuda.Device().compute_capability == "90"


pytestmark = pytest.mark.skipif(backend.name == "cuda" and not _is_hopper(),
                                reason="wgmma needs compute capability 9.0 (H100, H200)")

OPTIONS = ("-arch=sm_90a",)
MMA_TOLERANCE = 2.0 ** -20   # 8 float32 units of the sum of magnitudes, as for mma.sync
SWIZZLE_WIDTH = {"none": 0, "32B": 32, "64B": 64, "128B": 128}
SWIZZLE_MODE = {"none": 0, "128B": 1, "64B": 2, "32B": 3}   # the descriptor's bits 62-63
NAN_BITS = 0x7FC0                                             # a bf16 NaN, in every byte no element uses


def bf16(x):
    return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16)


def layout_offsets(rows, depth, swizzle, leading, stride, element_bytes=2):
    """Byte offset from the matrix's start of element (row, k), for a K-major rows x depth matrix of bf16 (or of
    4-byte tf32) (PTX ISA, "Shared Memory Matrix Layout"): core matrices of 8 rows of 16 bytes; chunk = the
    element's byte offset along the row // 16 is its 16-byte column.
    Without swizzle, core matrices are `leading` bytes apart along k and `stride` bytes apart down the rows.
    With a swizzle of W bytes, the 8 rows of a group are W bytes apart, chunks are adjacent, groups `stride`
    apart, and the offset's bits 4.. are XOR-ed with its bits 7.. (one bit for 32B, two for 64B, three for
    128B): the matrix starts on a multiple of 8 W, so offset bits are address bits."""
    row, k = np.arange(rows)[:, None], np.arange(depth)[None, :]
    chunk, within = k * element_bytes // 16, k * element_bytes % 16
    width = SWIZZLE_WIDTH[swizzle]
    if width == 0:
        return (row // 8) * stride + chunk * leading + (row % 8) * 16 + within
    offset = (row // 8) * stride + (row % 8) * width + chunk * 16 + within
    return offset ^ (((offset >> 7) & (width // 16 - 1)) << 4)


def image(matrix, swizzle, leading, stride):
    """The shared-memory bytes of a K-major bf16 matrix (rows x depth), as uint16, padded to 1024 bytes."""
    offsets = layout_offsets(*matrix.shape, swizzle, leading, stride)
    size = -(-(offsets.max() + 2) // 1024) * 1024
    halves = np.full(size // 2, NAN_BITS, dtype=np.uint16)
    halves[offsets // 2] = bf16(matrix).view(np.uint16)
    return halves


def descriptor_fields(swizzle, leading, stride):
    """A descriptor's bits other than the start address: leading and stride byte offsets / 16, swizzle mode."""
    return np.uint64((leading >> 4) << 16 | (stride >> 4) << 32 | SWIZZLE_MODE[swizzle] << 62)


def fragment_indices(n):
    """(row, column) of each accumulator register i of each thread t of the warpgroup (PTX ISA, "Matrix Fragments
    for wgmma.mma_async.m64nNk16"): warp w holds rows 16w..16w+15; lane 4g + t holds, in register i, row
    16w + g + 8 ((i // 2) % 2) and column 8 (i // 4) + 2t + i % 2."""
    thread, i = np.arange(128)[:, None], np.arange(n // 2)[None, :]
    warp, g, t = thread // 32, thread % 32 // 4, thread % 4
    return 16 * warp + g + 8 * (i // 2 % 2), 8 * (i // 4) + 2 * t + i % 2


def test_fragment_indices_cover_the_tile_once():
    """The layout written above gives each of the 64 x N elements to exactly one register of one thread."""
    rows, columns = fragment_indices(256)
    counts = np.zeros((64, 256), int)
    np.add.at(counts, (rows, columns), 1)
    assert np.all(counts == 1)


# ---------------------------------------------------------------------------------------------------------
# One m64nNk16 product from shared-memory images the test lays out
# ---------------------------------------------------------------------------------------------------------

# Kernel lines that copy the two images into dynamic shared memory at `base` (1024-byte aligned) and
# b_offset bytes after it, then make them visible to the tensor cores.
IMAGES_TO_SHARED = """    extern __shared__ __align__(1024) unsigned char shared[];
    const unsigned base = (shared_address(shared) + 1023) & ~1023u;
    unsigned short* tiles = reinterpret_cast<unsigned short*>(shared + (base - shared_address(shared)));
    for (int i = threadIdx.x; i < a_halves; i += blockDim.x) tiles[i] = a_image[i];
    for (int i = threadIdx.x; i < b_halves; i += blockDim.x) tiles[b_offset / 2 + i] = b_image[i];
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
"""


def tile_kernel(n, scale_a=1, scale_b=1, fence=True):
    """One warpgroup, one wgmma.mma_async m64n{n}k16: D = (scale_a A)(scale_b B) + C, or without C when scale_d is
    0. A (64 x 16) and B (n x 16: row j holds column j of B) are copied from the images into shared memory at
    1024 bytes, B b_offset bytes after A; C and D are 64 x n row-major, read and written in the fragment layout."""
    registers = ", ".join(f"%{i}" for i in range(n // 2))
    operands = ", ".join(f'"+f"(d[{i}])' for i in range(n // 2))
    fence_line = 'asm volatile("wgmma.fence.sync.aligned;" ::: "memory");' if fence else ""
    return rf"""
#include "mma.cuh"

extern "C" __global__ void wgmma_tile(float* D, const float* C, const unsigned short* a_image, int a_halves,
                                      const unsigned short* b_image, int b_halves, unsigned long long a_fields,
                                      unsigned long long b_fields, int b_offset, int scale_d)
{{
{IMAGES_TO_SHARED}    const unsigned long long a_descriptor = ((base & 0x3FFFF) >> 4) | a_fields;
    const unsigned long long b_descriptor = (((base + b_offset) & 0x3FFFF) >> 4) | b_fields;
    const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    float d[{n // 2}];
    for (int i = 0; i < {n // 2}; ++i) d[i] = C[(16 * warp + g + 8 * (i / 2 % 2)) * {n} + 8 * (i / 4) + 2 * t + i % 2];
    {fence_line}
    asm volatile("{{\n"
                 ".reg .pred p;\n"
                 "setp.ne.b32 p, %{n // 2 + 2}, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{registers}}}, %{n // 2}, %{n // 2 + 1}, "
                 "p, {scale_a}, {scale_b}, 0, 0;\n"
                 "}}\n"
                 : {operands}
                 : "l"(a_descriptor), "l"(b_descriptor), "r"(scale_d));
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    for (int i = 0; i < {n // 2}; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
    for (int i = 0; i < {n // 2}; ++i) D[(16 * warp + g + 8 * (i / 2 % 2)) * {n} + 8 * (i / 4) + 2 * t + i % 2] = d[i];
}}
"""


# (swizzle, leading byte offset, stride byte offset, N): the no-swizzle layout with core matrices packed along
# k first and along the rows first; each swizzle with its 8-row groups packed.
LAYOUTS = [("none", 128, 256, 128), ("none", 2048, 128, 64), ("32B", 16, 256, 64), ("64B", 16, 512, 128),
           ("128B", 16, 1024, 128)]


def run_tile(a, b, c, swizzle, leading, stride, scale_d=True, scale_a=1, scale_b=1, threads=128, fence=True,
             b_offset=None):
    n = b.shape[0]
    a_image, b_image = image(a, swizzle, leading, stride), image(b, swizzle, leading, stride)
    b_offset = 2 * a_image.size if b_offset is None else b_offset
    shared = 1024 + b_offset + 2 * b_image.size
    kernel = backend.RawKernel(tile_kernel(n, scale_a, scale_b, fence), "wgmma_tile", options=OPTIONS)
    if shared > kernel.max_dynamic_shared_size_bytes:
        kernel.max_dynamic_shared_size_bytes = shared
    xp = backend.xp
    out = xp.full((64, n), np.nan, dtype=np.float32)
    fields = descriptor_fields(swizzle, leading, stride)
    kernel((1,), (threads,), (out, xp.asarray(c, dtype=np.float32), xp.asarray(a_image), np.int32(a_image.size),
                              xp.asarray(b_image), np.int32(b_image.size), fields, fields, np.int32(b_offset),
                              np.int32(scale_d)), shared_mem=shared)
    return backend.asnumpy(out)


def as_read(x):
    """float64 values of x as the tensor core reads it: rounded to bf16."""
    return bf16(x).astype(np.float64)


@pytest.mark.parametrize("swizzle, leading, stride, n", LAYOUTS)
def test_wgmma_reads_each_layout_and_places_each_result_bit_exact(swizzle, leading, stride, n, rng):
    """Small integers in A, B and C: every sum is exact, so D = A·B + C to the bit, whatever the order of
    accumulation. A wrong descriptor field, swizzle or fragment index reads a NaN or the wrong element."""
    a = rng.integers(-4, 5, (64, 16)).astype(np.float32)
    b = rng.integers(-4, 5, (n, 16)).astype(np.float32)
    c = rng.integers(-64, 65, (64, n)).astype(np.float32)
    got = run_tile(a, b, c, swizzle, leading, stride)
    np.testing.assert_array_equal(got, (a.astype(np.float64) @ b.T.astype(np.float64) + c).astype(np.float32))


@pytest.mark.parametrize("swizzle, leading, stride, n", [LAYOUTS[0], LAYOUTS[-1]])
def test_wgmma_random_inputs_within_the_tolerance(swizzle, leading, stride, n, rng):
    """Random bf16 inputs: D within MMA_TOLERANCE of the sum of magnitudes of float64 A·B + C; the tolerance is
    tight enough that A or B read transposed, or unrounded float32 inputs, fall outside it."""
    a, b = rng.standard_normal((64, 16)), rng.standard_normal((n, 16))
    c = rng.standard_normal((64, n)).astype(np.float32)
    got = run_tile(a, b, c, swizzle, leading, stride).astype(np.float64)
    a64, b64 = as_read(a), as_read(b)
    expected = a64 @ b64.T + c
    tolerance = MMA_TOLERANCE * (np.abs(a64) @ np.abs(b64).T + np.abs(c))
    assert np.all(np.abs(got - expected) <= tolerance), np.abs(got - expected).max()
    unrounded = a.astype(np.float32).astype(np.float64) @ b.astype(np.float32).astype(np.float64).T + c
    assert np.any(np.abs(unrounded - expected) > tolerance)


def test_scale_d_false_ignores_the_accumulator_and_minus_one_negates(rng):
    """scale-d false (a predicate from the kernel's argument): D = A·B, C's values ignored; imm-scale-a -1
    negates A's elements."""
    a = rng.integers(-4, 5, (64, 16)).astype(np.float32)
    b = rng.integers(-4, 5, (128, 16)).astype(np.float32)
    c = np.full((64, 128), 1e6, dtype=np.float32)
    got = run_tile(a, b, c, "128B", 16, 1024, scale_d=False, scale_a=-1)
    np.testing.assert_array_equal(got, -(a.astype(np.float64) @ b.T).astype(np.float32))


# ---------------------------------------------------------------------------------------------------------
# MN-major operands (imm-trans 1): two steps of k accumulating, each operand in its own layout
# ---------------------------------------------------------------------------------------------------------

def mn_major_offsets(rows, depth, swizzle, leading, stride):
    """Byte offset of element (row, k) of an MN-major bf16 matrix, row being m of A or n of B (PTX ISA, "Shared
    Memory Matrix Layout", "Leading / Stride Dimension Byte Offset" for MN-major): for each k, 8 consecutive
    rows fill 16 bytes. Without swizzle (interleave), core matrices of 8 rows by 8 of k (each k's 16 bytes
    one after the other) lie `stride` bytes apart down the rows and `leading` bytes apart along k. With a
    swizzle of W bytes, W / 2 rows fill one swizzled row of W bytes per k, 8 values of k make one atom; atoms
    lie `leading` bytes apart down the rows and `stride` bytes apart along k; bits 4.. XOR-ed as for K-major."""
    row, k = np.arange(rows)[:, None], np.arange(depth)[None, :]
    within = 2 * (row % 8)
    width = SWIZZLE_WIDTH[swizzle]
    if width == 0:
        return (row // 8) * stride + (k // 8) * leading + (k % 8) * 16 + within
    atom = width // 2
    offset = (row // atom) * leading + (k // 8) * stride + (k % 8) * width + (row % atom) // 8 * 16 + within
    return offset ^ (((offset >> 7) & (width // 16 - 1)) << 4)


def layout_image(matrix, major, swizzle, leading, stride):
    """The shared-memory bytes of a bf16 matrix (rows x depth) in either major, as uint16, padded to 1024 bytes."""
    place = mn_major_offsets if major == "MN" else layout_offsets
    offsets = place(*matrix.shape, swizzle, leading, stride)
    size = -(-(offsets.max() + 2) // 1024) * 1024
    halves = np.full(size // 2, NAN_BITS, dtype=np.uint16)
    halves[offsets // 2] = bf16(matrix).view(np.uint16)
    return halves


def second_step_bytes(major, swizzle, leading, stride):
    """How far the descriptor's start moves for k = 16..31: the unswizzled offset of element (0, 16)."""
    if major == "MN":
        return 2 * (leading if swizzle == "none" else stride)
    return 2 * leading if swizzle == "none" else 32


def two_step_kernel(n, transpose_a, transpose_b):
    """One warpgroup, two wgmma.mma_async m64n{n}k16 (k = 0..15, then 16..31 with each start moved by its step),
    both accumulating into D from zero, with the given imm-trans-a and imm-trans-b."""
    registers = ", ".join(f"%{i}" for i in range(n // 2))
    operands = ", ".join(f'"+f"(d[{i}])' for i in range(n // 2))
    return rf"""
#include "mma.cuh"

extern "C" __global__ void two_steps(float* D, const unsigned short* a_image, int a_halves, const unsigned short* b_image,
                                     int b_halves, unsigned long long a_fields, unsigned long long b_fields, int b_offset,
                                     int a_step, int b_step)
{{
{IMAGES_TO_SHARED}    float d[{n // 2}];
    for (int i = 0; i < {n // 2}; ++i) d[i] = 0.0f;
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    for (int step = 0; step < 2; ++step) {{
        const unsigned long long a_descriptor = (((base + step * a_step) & 0x3FFFF) >> 4) | a_fields;
        const unsigned long long b_descriptor = (((base + b_offset + step * b_step) & 0x3FFFF) >> 4) | b_fields;
        asm volatile("wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{registers}}}, %{n // 2}, %{n // 2 + 1}, "
                     "1, 1, 1, {transpose_a}, {transpose_b};"
                     : {operands}
                     : "l"(a_descriptor), "l"(b_descriptor));
    }}
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    for (int i = 0; i < {n // 2}; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
    const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    for (int i = 0; i < {n // 2}; ++i) D[(16 * warp + g + 8 * (i / 2 % 2)) * {n} + 8 * (i / 4) + 2 * t + i % 2] = d[i];
}}
"""


def packed_layout(major, swizzle, rows, depth=32):
    """(swizzle, leading, stride) of a matrix packed without gaps. MN-major swizzled: atoms of 8 values of k one
    after the other along k, then the next W / 2 rows; interleaved: core matrices down the rows first. A
    K-major partner takes the 128-byte swizzle, whose rows hold all 32 values of k."""
    width = SWIZZLE_WIDTH[swizzle]
    if major == "K":
        return "128B", 16, 1024
    if width == 0:
        return swizzle, rows // 8 * 128, 128
    return swizzle, depth // 8 * 8 * width, 8 * width


def run_two_steps(a, b, a_major, b_major, swizzle):
    """D = A B over k = 0..31 from A (64 x 32) and B given as n x 32 (row j: column j of B), each in its major;
    `swizzle` is the MN-major operands' swizzle."""
    n = b.shape[0]
    a_swizzle, a_leading, a_stride = packed_layout(a_major, swizzle, 64)
    b_swizzle, b_leading, b_stride = packed_layout(b_major, swizzle, n)
    a_image = layout_image(a, a_major, a_swizzle, a_leading, a_stride)
    b_image = layout_image(b, b_major, b_swizzle, b_leading, b_stride)
    b_offset = 2 * a_image.size
    shared = 1024 + b_offset + 2 * b_image.size
    kernel = backend.RawKernel(two_step_kernel(n, int(a_major == "MN"), int(b_major == "MN")), "two_steps",
                               options=OPTIONS)
    if shared > kernel.max_dynamic_shared_size_bytes:
        kernel.max_dynamic_shared_size_bytes = shared
    xp = backend.xp
    out = xp.full((64, n), np.nan, dtype=np.float32)
    kernel((1,), (128,), (out, xp.asarray(a_image), np.int32(a_image.size), xp.asarray(b_image),
                          np.int32(b_image.size), descriptor_fields(a_swizzle, a_leading, a_stride),
                          descriptor_fields(b_swizzle, b_leading, b_stride), np.int32(b_offset),
                          np.int32(second_step_bytes(a_major, a_swizzle, a_leading, a_stride)),
                          np.int32(second_step_bytes(b_major, b_swizzle, b_leading, b_stride))), shared_mem=shared)
    return backend.asnumpy(out)


MAJORS = [("MN", "K"), ("K", "MN"), ("MN", "MN")]


@pytest.mark.parametrize("swizzle", ["none", "32B", "64B", "128B"])
@pytest.mark.parametrize("a_major, b_major", MAJORS)
def test_mn_major_operands_two_k_steps_bit_exact(a_major, b_major, swizzle, rng):
    """imm-trans-a / imm-trans-b 1 read A (M-major) or B (N-major) in every swizzle mode; B is 128 wide, so
    its rows span two 128-byte atoms (the leading byte offset) and four 32-byte ones. Small integers: exact."""
    a = rng.integers(-4, 5, (64, 32)).astype(np.float32)
    b = rng.integers(-4, 5, (128, 32)).astype(np.float32)
    got = run_two_steps(a, b, a_major, b_major, swizzle)
    np.testing.assert_array_equal(got, (a.astype(np.float64) @ b.T.astype(np.float64)).astype(np.float32))


@pytest.mark.parametrize("a_major, b_major", MAJORS)
def test_mn_major_operands_random_inputs_within_the_tolerance(a_major, b_major, rng):
    """Random bf16 inputs, 128-byte swizzle: within twice MMA_TOLERANCE (two steps, each rounded) of float64 A·B."""
    a, b = rng.standard_normal((64, 32)), rng.standard_normal((64, 32))
    got = run_two_steps(a, b, a_major, b_major, "128B").astype(np.float64)
    a64, b64 = as_read(a), as_read(b)
    expected = a64 @ b64.T
    tolerance = 2 * MMA_TOLERANCE * (np.abs(a64) @ np.abs(b64).T)
    assert np.all(np.abs(got - expected) <= tolerance), np.abs(got - expected).max()


# ---------------------------------------------------------------------------------------------------------
# The wrappers of kernels/include/wgmma.cuh, as kernels/wgmma_matmul.cu uses them
# ---------------------------------------------------------------------------------------------------------

WARPGROUP_TILE = r"""
#include "wgmma.cuh"

// One warpgroup: A's image (64 rows of 128 bytes) and B's (N_WIDE rows of 128 bytes) copied into dynamic shared
// memory at 1024 bytes, B 8192 bytes after A; D = the sum over k < steps of PRODUCT (a wrapper of wgmma.cuh, its
// descriptors moved along by k), from zero; D written out as 64 x N_WIDE, row-major, from the fragment layout.
extern "C" __global__ void warpgroup_tile(float* D, const unsigned short* a_image, const unsigned short* b_image, int steps)
{
    extern __shared__ __align__(1024) unsigned char shared[];
    const unsigned base = (shared_address(shared) + 1023) & ~1023u;
    unsigned short* tiles = reinterpret_cast<unsigned short*>(shared + (base - shared_address(shared)));
    for (int i = threadIdx.x; i < (64 + N_WIDE) * 64; i += 128) tiles[i] = i < 64 * 64 ? a_image[i] : b_image[i - 64 * 64];
    fence_proxy_async_shared();
    __syncthreads();
    float d[N_WIDE / 2];
    for (int i = 0; i < N_WIDE / 2; ++i) d[i] = 0.0f;
    fence_accumulators(d);
    wgmma_fence();
    for (int k = 0; k < steps; ++k) PRODUCT;
    wgmma_commit_group();
    wgmma_wait_group<0>();
    fence_accumulators(d);
    const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    for (int i = 0; i < N_WIDE / 2; ++i) D[(16 * warp + g + 8 * (i / 2 % 2)) * N_WIDE + 8 * (i / 4) + 2 * t + i % 2] = d[i];
}
"""
# K-major tiles in the 128-byte swizzle: each step 32 bytes further along every row (16 bf16, or 8 tf32)
K_MAJOR_STEP = "matrix_descriptor_128b(base + 32 * k), matrix_descriptor_128b(base + 8192 + 32 * k)"


def run_warpgroup_tile(product, n, a_image, b_image, steps=4):
    """D (64 x n) of WARPGROUP_TILE with PRODUCT `product`, from images of 64 and n rows of 128 bytes."""
    code = WARPGROUP_TILE.replace("N_WIDE", str(n)).replace("PRODUCT", product)
    kernel = backend.RawKernel(code, "warpgroup_tile", options=OPTIONS)
    shared = 1024 + (64 + n) * 128
    kernel.max_dynamic_shared_size_bytes = shared
    xp = backend.xp
    out = xp.full((64, n), np.nan, dtype=np.float32)
    assert a_image.nbytes == 64 * 128 and b_image.nbytes == n * 128   # packed: no gaps between rows or atoms
    kernel((1,), (128,), (out, xp.asarray(a_image.view(np.uint16)), xp.asarray(b_image.view(np.uint16)),
                          np.int32(steps)), shared_mem=shared)
    return backend.asnumpy(out)


def run_header_tile(a, b):
    """A (64 x 64) and B (256 x 64), K-major with the 128-byte swizzle; D = A Bᵀ through four
    wgmma_m64n256k16_bf16, one per step of 16 along k (the descriptors' start 32 bytes further each time)."""
    return run_warpgroup_tile(f"wgmma_m64n256k16_bf16(d, {K_MAJOR_STEP})", 256, image(a, "128B", 16, 1024),
                              image(b, "128B", 16, 1024))


def test_header_wrappers_accumulate_four_k_steps_of_a_swizzled_tile(rng):
    """matrix_descriptor_128b on a 1024-byte aligned tile, plus 32 bytes per step of k: the four products add up
    to A Bᵀ over all 64 of k, exact for small integers."""
    a = rng.integers(-3, 4, (64, 64)).astype(np.float32)
    b = rng.integers(-3, 4, (256, 64)).astype(np.float32)
    np.testing.assert_array_equal(run_header_tile(a, b), (a.astype(np.float64) @ b.T).astype(np.float32))


def test_header_wrappers_k_steps_are_not_interchangeable(rng):
    """The data can tell the steps apart: one nonzero column of k per row group, so a step that read another
    step's columns (a wrong start address or swizzle) changes the result."""
    a = np.zeros((64, 64), np.float32)
    b = rng.integers(1, 4, (256, 64)).astype(np.float32)
    for row in range(64):
        a[row, (row * 7) % 64] = row % 5 + 1
    np.testing.assert_array_equal(run_header_tile(a, b), (a.astype(np.float64) @ b.T).astype(np.float32))


@pytest.mark.parametrize("n", [128, 256])
def test_header_mn_major_descriptor_and_transposed_wrappers(n, rng):
    """matrix_descriptor_128b_mn (LBO: one 64-wide atom to the next, 1024 bytes; SBO: N / 64 atoms) with
    wgmma_m64n{n}k16_bf16<1, 1>: A stored K x M and B stored K x N, as the weight gradient dyᵀ x reads them."""
    a = rng.integers(-3, 4, (64, 64)).astype(np.float32)    # A: m x k
    b = rng.integers(-3, 4, (n, 64)).astype(np.float32)     # B's columns: n x k
    # A stored as atoms of 64 x 8 (LBO 1024 to the next 64 of m), SBO one atom along k; B's SBO N / 64 atoms
    product = (f"wgmma_m64n{n}k16_bf16<1, 1>(d, matrix_descriptor_128b_mn(base + 2048 * k, 1024, 1024), "
               f"matrix_descriptor_128b_mn(base + 8192 + {n // 64} * 2048 * k, 1024, {n // 64} * 1024))")
    images = [layout_image(x, "MN", "128B", 1024, rows // 64 * 1024) for x, rows in ((a, 64), (b, n))]
    got = run_warpgroup_tile(product, n, *images)
    np.testing.assert_array_equal(got, (a.astype(np.float64) @ b.T).astype(np.float32))


# ---------------------------------------------------------------------------------------------------------
# TF32: float32 in shared memory, read by its upper 19 bits, K-major only
# ---------------------------------------------------------------------------------------------------------

NAN_WORD = 0x7FC00000   # a float32 NaN, in the image's words that a correct read never reaches


def tf32_image(matrix, steps):
    """The shared-memory words (uint32) of a K-major float32 matrix (rows x 32) in the 128-byte swizzle, its k
    past 8 steps' worth left as NaN."""
    offsets = layout_offsets(matrix.shape[0], 8 * steps, "128B", 16, 1024, element_bytes=4)
    words = np.full(matrix.shape[0] * 32, NAN_WORD, dtype=np.uint32)
    words[offsets // 4] = np.ascontiguousarray(matrix[:, :8 * steps], dtype=np.float32).view(np.uint32)
    return words


def run_tf32_tile(a, b, steps):
    """D = A Bᵀ over k < 8 steps for float32 A (64 x 32) and B (n x 32: row j holds column j of B), K-major with
    the 128-byte swizzle (a row of 32 floats per row), through `steps` wgmma_m64n{n}k8_tf32 whose descriptors
    start 32 bytes (8 floats) further each step, as kernels/wgmma_matmul.cu walks a float32 slice."""
    n = b.shape[0]
    return run_warpgroup_tile(f"wgmma_m64n{n}k8_tf32(d, {K_MAJOR_STEP})", n, tf32_image(a, steps),
                              tf32_image(b, steps), steps)


def upper_19_bits(x):
    """float32 x as a .tf32 operand reads it: sign, exponent and top 10 mantissa bits, the low 13 cleared."""
    return (np.asarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)


def with_low_bits(rng, values):
    """float32 values (exact in TF32) with their low 13 bits set to 0x1000 .. 0x1FFF: at least half a TF32 unit,
    so that rounding to nearest would move each one a unit away from what truncation gives."""
    bits = np.asarray(values, np.float32).view(np.uint32) & np.uint32(0xFFFFE000)
    return (bits | rng.integers(0x1000, 0x2000, bits.shape).astype(np.uint32)).view(np.float32)


@pytest.mark.parametrize("n", [128, 256])
@pytest.mark.parametrize("steps", [2, 4])
def test_tf32_wgmma_reads_the_upper_19_bits_bit_exact(n, steps, rng):
    """Small integers with garbage in their low 13 bits: the tensor core reads the integers (every sum then
    exact in float32), where the values as stored, or rounded to nearest TF32, give other sums. Two steps of k8
    leave the rest of each 128-byte row NaN: a descriptor that reads past its step picks one up."""
    a = with_low_bits(rng, rng.integers(-7, 8, (64, 32)))
    b = with_low_bits(rng, rng.integers(-7, 8, (n, 32)))
    depth = 8 * steps
    expected = upper_19_bits(a[:, :depth]) @ upper_19_bits(b[:, :depth]).T
    as_stored = a[:, :depth].astype(np.float64) @ b[:, :depth].T
    assert np.all(expected == np.round(expected)) and np.any(expected != as_stored)
    np.testing.assert_array_equal(run_tf32_tile(a, b, steps), expected.astype(np.float32))


def test_tf32_wgmma_k_steps_are_not_interchangeable(rng):
    """One nonzero k per row of A: a step reading another step's 8 floats (a wrong start or swizzle) changes D."""
    a = np.zeros((64, 32), np.float32)
    for row in range(64):
        a[row, (row * 7) % 32] = row % 5 + 1
    b = rng.integers(1, 4, (128, 32)).astype(np.float32)
    np.testing.assert_array_equal(run_tf32_tile(a, b, 4), (a.astype(np.float64) @ b.T).astype(np.float32))


def test_tf32_wgmma_random_inputs_within_the_tolerance(rng):
    """Random values whose low 13 bits are at least half a TF32 unit: against float64 of their upper 19 bits
    within MMA_TOLERANCE of the sum of magnitudes; the values as stored, and rounded to nearest TF32, are far
    outside it (the check tells truncation from the other readings)."""
    from gpt2_cupy.precision import tf32_values
    a = with_low_bits(rng, rng.standard_normal((64, 32)))
    b = with_low_bits(rng, rng.standard_normal((128, 32)))
    got = run_tf32_tile(a, b, 4).astype(np.float64)
    tolerance = MMA_TOLERANCE * (np.abs(upper_19_bits(a)) @ np.abs(upper_19_bits(b)).T)
    assert np.all(np.abs(got - upper_19_bits(a) @ upper_19_bits(b).T) <= tolerance)
    for other in (a.astype(np.float64) @ b.T.astype(np.float64), tf32_values(a) @ tf32_values(b).T):
        assert np.mean(np.abs(got - other) > tolerance) > 0.9


# ---------------------------------------------------------------------------------------------------------
# What the CPU executor refuses, and how it says so
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.cpu_only
def test_a_descriptor_reaching_outside_dynamic_shared_memory_is_a_kernel_error():
    from gpt2_cupy.cpu import KernelError
    a, b, c = np.ones((64, 16)), np.ones((64, 16)), np.zeros((64, 64), np.float32)
    kernel = backend.RawKernel(tile_kernel(64), "wgmma_tile", options=OPTIONS)
    fields = descriptor_fields("none", 128, 256)
    huge_stride = descriptor_fields("none", 128, 0x3FFF << 4)   # the largest: 8 row groups 256 KB apart
    a_image, b_image = image(a, "none", 128, 256), image(b, "none", 128, 256)
    with pytest.raises(KernelError, match="matrix B's descriptor reaches outside the block's dynamic shared memory"):
        kernel((1,), (128,), (np.zeros((64, 64), np.float32), c, a_image, np.int32(a_image.size), b_image,
                              np.int32(b_image.size), fields, huge_stride, np.int32(2 * a_image.size), np.int32(1)),
               shared_mem=8192)


@pytest.mark.cpu_only
def test_a_swizzled_matrix_off_its_pattern_is_a_kernel_error():
    """The executor runs swizzled matrices that start in the first row of their swizzle pattern; B placed 128
    bytes past a 1024-byte boundary (with base offset 0) is refused rather than guessed at."""
    from gpt2_cupy.cpu import KernelError
    a, b, c = np.ones((64, 16)), np.ones((128, 16)), np.zeros((64, 128), np.float32)
    with pytest.raises(KernelError, match="first row of their swizzle pattern"):
        run_tile(a, b, c, "128B", 16, 1024, b_offset=8192 + 128)


@pytest.mark.cpu_only
def test_a_block_of_fewer_than_128_threads_is_a_kernel_error():
    from gpt2_cupy.cpu import KernelError
    a, b, c = np.ones((64, 16)), np.ones((64, 16)), np.zeros((64, 64), np.float32)
    with pytest.raises(KernelError, match="all 128 threads of a warpgroup"):
        run_tile(a, b, c, "none", 128, 256, threads=64)


@pytest.mark.cpu_only
def test_wgmma_without_a_fence_is_a_kernel_error():
    from gpt2_cupy.cpu import KernelError
    a, b, c = np.ones((64, 16)), np.ones((64, 16)), np.zeros((64, 64), np.float32)
    with pytest.raises(KernelError, match="no wgmma.fence before it"):
        run_tile(a, b, c, "none", 128, 256, fence=False)


STATIC_TILES = r"""
extern "C" __global__ void static_tiles(float* D)
{
    __shared__ __align__(1024) unsigned short tiles[2 * 64 * 16];
    for (int i = threadIdx.x; i < 2 * 64 * 16; i += 128) tiles[i] = 0x3F80;   // 1.0 in bf16
    __syncthreads();
    const unsigned address = (unsigned)__cvta_generic_to_shared(tiles);
    const unsigned long long fields = (128ull >> 4) << 16 | (256ull >> 4) << 32;
    const unsigned long long a = ((address & 0x3FFFF) >> 4) | fields, b = (((address + 2048) & 0x3FFFF) >> 4) | fields;
    float d[32] = {};
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, "
                 "%10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, "
                 "%30, %31}, %32, %33, 1, 1, 1, 0, 0;"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "l"(a), "l"(b));
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    D[threadIdx.x] = d[0];
}
"""


@pytest.mark.cpu_only
def test_tiles_in_static_shared_memory_are_a_kernel_error():
    """A descriptor holds 18 bits of address; the executor finds the matrix in the block's dynamic shared memory
    and refuses a block that never took the address of a pointer into it, rather than reading other bytes."""
    from gpt2_cupy.cpu import KernelError
    with pytest.raises(KernelError, match=r"static __shared__ arrays are not supported"):
        backend.RawKernel(STATIC_TILES, "static_tiles", options=OPTIONS)((1,), (128,), (np.zeros(128, np.float32),))


DIFFERENT_DESCRIPTORS = STATIC_TILES.replace("static_tiles", "different_descriptors").replace(
    "__shared__ __align__(1024) unsigned short tiles[2 * 64 * 16];",
    "extern __shared__ __align__(1024) unsigned short tiles[];").replace(
    "(address + 2048)", "(address + 2048 + 16 * (threadIdx.x / 64))")


EXITED_THREAD = DIFFERENT_DESCRIPTORS.replace("different_descriptors", "exited_thread").replace(
    "(address + 2048 + 16 * (threadIdx.x / 64))", "(address + 2048)").replace(
    'asm volatile("wgmma.fence.sync.aligned;" ::: "memory");',
    'if (threadIdx.x == 77) return;\n    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");')


@pytest.mark.cpu_only
def test_a_thread_of_the_warpgroup_that_exited_is_a_kernel_error():
    from gpt2_cupy.cpu import KernelError
    assert "threadIdx.x == 77" in EXITED_THREAD
    with pytest.raises(KernelError, match="all 128 threads of a warpgroup"):
        backend.RawKernel(EXITED_THREAD, "exited_thread", options=OPTIONS)(
            (1,), (128,), (np.zeros(128, np.float32),), shared_mem=8192)


@pytest.mark.cpu_only
def test_threads_of_a_warpgroup_giving_different_descriptors_is_a_kernel_error():
    from gpt2_cupy.cpu import KernelError
    with pytest.raises(KernelError, match="different matrix descriptors"):
        backend.RawKernel(DIFFERENT_DESCRIPTORS, "different_descriptors", options=OPTIONS)(
            (1,), (128,), (np.zeros(128, np.float32),), shared_mem=8192)


@pytest.mark.cpu_only
def test_wgmma_without_sm_90a_is_a_compile_error_naming_the_instruction_and_the_option():
    """As NVRTC refuses wgmma for sm_90 (what CuPy picks for an H100 or H200), the executor refuses it unless the
    module is compiled with -arch=sm_90a."""
    from gpt2_cupy.cpu import CompileError
    with pytest.raises(CompileError) as caught:
        backend.RawKernel(tile_kernel(64), "wgmma_tile").compile()
    message = str(caught.value)
    assert "'wgmma.fence.sync.aligned'" in message and "sm_90a" in message and "kernel.cu:" in message, message


@pytest.mark.cpu_only
@pytest.mark.parametrize("instruction, words", [
    ("wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1}, %2, %3, 1, 1, 1;",
     "does not run 'wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3'"),
    ("wgmma.mma_async.sync.aligned.m64n64k16.f32.tf32.tf32 {%0, %1}, %2, %3, 1, 1, 1;",
     "does not run 'wgmma.mma_async.sync.aligned.m64n64k16.f32.tf32.tf32'"),
    ("wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 {%0, %1}, %2, %3, 1, 1, 1, 0, 0;",
     "tf32 operands are K-major only: PTX gives the .tf32 variant no imm-trans"),
    ("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1}, {%2, %2, %2, %2}, %3, 1, 1, 1, 0;",
     "A in registers"),
])
def test_wgmma_variants_the_executor_does_not_run_are_compile_errors_naming_them(instruction, words):
    from gpt2_cupy.cpu import CompileError
    code = (f'extern "C" __global__ void variant(float* out, unsigned long long a, unsigned long long b)\n{{\n'
            f'    float d0 = 0, d1 = 0;\n    unsigned r = 0;\n'
            f'    asm volatile("{instruction}" : "+f"(d0), "+f"(d1) : "r"(r), "l"(b));\n    out[0] = d0 + d1;\n}}\n')
    with pytest.raises(CompileError, match=words):
        backend.RawKernel(code, "variant", options=OPTIONS)((1,), (128,), (np.zeros(1, np.float32), np.uint64(0),
                                                                       np.uint64(0)))
