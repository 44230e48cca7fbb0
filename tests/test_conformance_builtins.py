"""Conformance of CUDA's built-ins and headers: block votes, warp reductions, cooperative groups, half and
bfloat16, conversion intrinsics, math functions and constants, and what a GPU refuses to compile.

Like tests/test_conformance.py, every test runs on the active backend, so the same file checks the CPU
executor and, on a machine with an NVIDIA GPU, CuPy itself. References are independent of both: numpy's
float16 for half, exact rational arithmetic (fractions) for rounding, bit patterns for bfloat16.
"""

import math
from fractions import Fraction

import numpy as np
import pytest

from gpt2_cupy import backend


def run(code, name, grid, block, *arguments):
    """Compile `name` from `code`, launch it, and wait."""
    kernel = backend.RawKernel(code, name)
    kernel(grid, block, arguments)
    backend.synchronize()


def device(array):
    return backend.xp.asarray(np.ascontiguousarray(array))


def host(array):
    backend.synchronize()
    return backend.asnumpy(array)


# ---------------------------------------------------------------------------------------------------------
# Block-wide votes: __syncthreads_count / _and / _or
# ---------------------------------------------------------------------------------------------------------

BLOCK_VOTES = r"""
extern "C" __global__ void block_votes(const int* predicate, int* out)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int p = predicate[i];
    // Called back to back with different predicates: each call must count its own.
    int count = __syncthreads_count(p);
    int count_of_odd = __syncthreads_count(threadIdx.x & 1);
    int every = __syncthreads_and(p);
    int some = __syncthreads_or(p);
    int count_again = __syncthreads_count(!p);
    out[5 * i + 0] = count;
    out[5 * i + 1] = count_of_odd;
    out[5 * i + 2] = every;
    out[5 * i + 3] = some;
    out[5 * i + 4] = count_again;
}
"""


def test_syncthreads_count_and_or_called_back_to_back(rng):
    """Five block votes in a row, in blocks of 100 threads (not a multiple of 32): count, and, or per block."""
    blocks, threads = 6, 100
    predicate = (rng.random((blocks, threads)) < 0.3).astype(np.int32)
    predicate[1] = 1  # a block where every thread says yes
    predicate[2] = 0  # and one where none does
    predicate[3] *= 7  # any non-zero value counts as true
    out = device(np.full(blocks * threads * 5, -1, dtype=np.int32))
    run(BLOCK_VOTES, "block_votes", (blocks,), (threads,), device(predicate.ravel()), out)
    got = host(out).reshape(blocks, threads, 5)
    yes = (predicate != 0).sum(axis=1)
    expected = np.stack([yes, np.full(blocks, threads // 2), yes == threads, yes > 0, threads - yes], axis=1)
    np.testing.assert_array_equal(got, np.broadcast_to(expected[:, None, :], got.shape).astype(np.int32))


VOTE_AFTER_A_FAULT = r"""
extern "C" __global__ void votes(int* out, int fault)
{
    int first = __syncthreads_count(1);
    if (fault && threadIdx.x == 5) *(volatile int*)16 = 1;  // a bad address: the launch fails here
    int second = __syncthreads_count(1);
    out[threadIdx.x] = first + 1000 * second;
}
"""


@pytest.mark.cpu_only
def test_block_votes_start_clean_after_a_launch_that_failed_between_votes():
    """A block abandoned between two votes leaves no count behind for the next launch (a GPU would lose its
    context instead, so this is the CPU executor's own business)."""
    kernel = backend.RawKernel(VOTE_AFTER_A_FAULT, "votes")
    out = np.zeros(64, dtype=np.int32)
    with pytest.raises(Exception):
        kernel((1,), (64,), (out, np.int32(1)))
    for _ in range(2):
        kernel((1,), (64,), (out, np.int32(0)))
        np.testing.assert_array_equal(out, 64 + 1000 * 64)


# ---------------------------------------------------------------------------------------------------------
# Warp-level: __activemask, __reduce_*_sync, __match_*_sync
# ---------------------------------------------------------------------------------------------------------

WARP_REDUCTIONS = r"""
extern "C" __global__ void warp_reductions(const int* values, int* out)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int v = values[i];
    unsigned int all = __activemask();
    out[8 * i + 0] = (int)all;
    out[8 * i + 1] = __reduce_add_sync(all, v);
    out[8 * i + 2] = __reduce_min_sync(all, v);
    out[8 * i + 3] = __reduce_max_sync(all, v);
    out[8 * i + 4] = (int)__reduce_max_sync(all, (unsigned int)v);  // negative values are large unsigned
    out[8 * i + 5] = (int)__reduce_or_sync(all, (unsigned int)v & 0xff);
    out[8 * i + 6] = (int)__match_any_sync(all, v % 3);
    int same = -1;
    out[8 * i + 7] = (int)__match_all_sync(all, (int)(v > -1000), &same) + 1000 * same;
}
"""


def test_activemask_reduce_and_match_sync_in_a_partial_warp(rng):
    """A block of 48 threads: a full warp and one of 16 lanes. __activemask names the lanes that exist; the
    reductions and matches cover them."""
    threads = 48
    values = rng.integers(-50, 50, threads).astype(np.int32)
    out = device(np.zeros(threads * 8, dtype=np.int32))
    run(WARP_REDUCTIONS, "warp_reductions", (1,), (threads,), device(values), out)
    got = host(out).reshape(threads, 8)
    for warp, lanes in ((0, 32), (1, 16)):
        v = values[32 * warp: 32 * warp + lanes]
        mask = (1 << lanes) - 1
        rows = got[32 * warp: 32 * warp + lanes]
        np.testing.assert_array_equal(rows[:, 0].view(np.uint32), np.uint32(mask))
        np.testing.assert_array_equal(rows[:, 1], v.sum())
        np.testing.assert_array_equal(rows[:, 2], v.min())
        np.testing.assert_array_equal(rows[:, 3], v.max())
        np.testing.assert_array_equal(rows[:, 4].view(np.uint32), v.view(np.uint32).max())
        np.testing.assert_array_equal(rows[:, 5], np.bitwise_or.reduce(v.view(np.uint32) & 0xFF))
        for lane in range(lanes):
            same = sum(1 << k for k in range(lanes) if np.fmod(v[k], 3) == np.fmod(v[lane], 3))  # C's %
            assert np.uint32(rows[lane, 6].view(np.uint32)) == same, f"__match_any_sync, lane {lane}"
        np.testing.assert_array_equal(rows[:, 7], (mask - (1 << 32) if mask >= 1 << 31 else mask) + 1000)


# ---------------------------------------------------------------------------------------------------------
# Cooperative groups
# ---------------------------------------------------------------------------------------------------------

COOPERATIVE_ROWS = r"""
#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
namespace cg = cooperative_groups;

// One warp per row, as llm.c writes it: sum, maximum and minimum of each row.
extern "C" __global__ void row_statistics(float* out, const float* x, int rows, int columns)
{
    cg::thread_block block = cg::this_thread_block();
    cg::thread_block_tile<32> warp = cg::tiled_partition<32>(block);
    int row = blockIdx.x * warp.meta_group_size() + warp.meta_group_rank();
    if (row >= rows) return;
    float sum = 0.0f, largest = -3.0e38f, smallest = 3.0e38f;
    for (int c = warp.thread_rank(); c < columns; c += warp.size()) {
        float v = x[row * columns + c];
        sum += v;
        largest = fmaxf(largest, v);
        smallest = fminf(smallest, v);
    }
    sum = cg::reduce(warp, sum, cg::plus<float>{});
    largest = cg::reduce(warp, largest, cg::greater<float>());
    smallest = cg::reduce(warp, smallest, cg::less<float>());
    if (warp.thread_rank() == 0) {
        out[3 * row + 0] = sum;
        out[3 * row + 1] = largest;
        out[3 * row + 2] = smallest;
    }
}
"""


def test_cooperative_groups_warp_per_row_reduce(rng):
    """cg::reduce with cg::plus, cg::greater and cg::less over a tiled_partition<32>, 4 rows per block of 128."""
    rows, columns = 37, 100
    x = rng.standard_normal((rows, columns)).astype(np.float32)
    out = device(np.zeros(rows * 3, dtype=np.float32))
    run(COOPERATIVE_ROWS, "row_statistics", ((rows + 3) // 4,), (128,), out, device(x), np.int32(rows), np.int32(columns))
    got = host(out).reshape(rows, 3)
    np.testing.assert_allclose(got[:, 0], x.astype(np.float64).sum(axis=1), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[:, 1], x.max(axis=1))
    np.testing.assert_array_equal(got[:, 2], x.min(axis=1))


COOPERATIVE_TILES = r"""
#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
namespace cg = cooperative_groups;

template <int Size>
__device__ void describe_tile(const cg::thread_block& block, int* out, int value)
{
    cg::thread_block_tile<Size> tile = cg::tiled_partition<Size>(block);
    out[0] = tile.thread_rank();
    out[1] = tile.meta_group_rank();
    out[2] = tile.meta_group_size();
    out[3] = (int)tile.size() + 1000 * (int)tile.num_threads();
    out[4] = tile.shfl(value, Size - 1);                 // the tile's last thread
    out[5] = tile.shfl_down(value, 1);                   // the last keeps its own
    out[6] = tile.shfl_up(value, 1);                     // the first keeps its own
    out[7] = tile.shfl_xor(value, 1);
    out[8] = (int)tile.ballot(value % 2 == 0);           // bit k: the tile's thread of rank k
    out[9] = tile.any(value % 5 == 0) + 10 * tile.all(value > 0);
    out[10] = cg::reduce(tile, value, cg::plus<int>());
    tile.sync();
}

extern "C" __global__ void tiles(const int* values, int* out)
{
    cg::thread_block block = cg::this_thread_block();
    int rank = block.thread_rank();
    int value = values[blockIdx.x * block.size() + rank];
    int* mine = out + 12 * 5 * (blockIdx.x * block.num_threads() + rank);
    describe_tile<32>(block, mine + 0, value);
    describe_tile<16>(block, mine + 12, value);
    describe_tile<8>(block, mine + 24, value);
    describe_tile<4>(block, mine + 36, value);
    describe_tile<2>(block, mine + 48, value);
    // The block itself, in three dimensions.
    mine[11] = block.group_index().x + 10 * block.thread_index().y + 100 * block.thread_index().z;
    block.sync();
}
"""


def test_cooperative_groups_tiles_of_32_16_8_4_2(rng):
    """Tiles of every size: ranks, counts, the four shuffles, ballot/any/all and reduce, in a 16x4x2 block."""
    blocks, shape = 2, (16, 4, 2)
    threads = int(np.prod(shape))
    values = rng.integers(1, 1000, blocks * threads).astype(np.int32)
    values[7] = 0  # one value that makes all(value > 0) false in its tiles
    out = device(np.full(blocks * threads * 60, -1, dtype=np.int32))
    run(COOPERATIVE_TILES, "tiles", (blocks,), shape, device(values), out)
    got = host(out).reshape(blocks, threads, 5, 12)
    for b in range(blocks):
        v = values[b * threads:(b + 1) * threads]
        for which, size in enumerate((32, 16, 8, 4, 2)):
            tiles = v.reshape(-1, size)
            rank = np.arange(threads) % size
            tile = np.arange(threads) // size
            rows = got[b, :, which]
            np.testing.assert_array_equal(rows[:, 0], rank)
            np.testing.assert_array_equal(rows[:, 1], tile)
            np.testing.assert_array_equal(rows[:, 2], threads // size)
            np.testing.assert_array_equal(rows[:, 3], size * 1001)
            np.testing.assert_array_equal(rows[:, 4], tiles[tile, size - 1])
            np.testing.assert_array_equal(rows[:, 5], np.where(rank < size - 1, v[np.minimum(np.arange(threads) + 1, threads - 1)], v))
            np.testing.assert_array_equal(rows[:, 6], np.where(rank > 0, v[np.arange(threads) - 1], v))
            np.testing.assert_array_equal(rows[:, 7], v[np.arange(threads) ^ 1])
            ballots = ((tiles % 2 == 0) * (1 << np.arange(size, dtype=np.int64))).sum(axis=1)
            np.testing.assert_array_equal(rows[:, 8].view(np.uint32), ballots[tile].astype(np.uint32))
            votes = (tiles % 5 == 0).any(axis=1) + 10 * (tiles > 0).all(axis=1)
            np.testing.assert_array_equal(rows[:, 9], votes[tile])
            np.testing.assert_array_equal(rows[:, 10], tiles.sum(axis=1)[tile])
        t = np.arange(threads)
        np.testing.assert_array_equal(got[b, :, 0, 11], b + 10 * ((t // 16) % 4) + 100 * (t // 64))


# ---------------------------------------------------------------------------------------------------------
# half and bfloat16: conversions (bit-exact), arithmetic (correctly rounded), comparisons
# ---------------------------------------------------------------------------------------------------------

def round_exactly(value, mantissa_bits, exponent_bits, mode="n"):
    """The bits of a rational `value` rounded in a binary format with that many mantissa and exponent bits
    (16 bits in all): the reference for every 16-bit rounding below. mode: "n" to nearest, ties to even;
    "z" toward zero; "d" down; "u" up."""
    bias = 2 ** (exponent_bits - 1) - 1
    sign = (1 << 15) if value < 0 else 0
    magnitude = abs(Fraction(value))
    if magnitude == 0:
        return sign
    exponent = magnitude.numerator.bit_length() - magnitude.denominator.bit_length()
    if Fraction(2) ** exponent > magnitude:
        exponent -= 1
    exponent = max(exponent, 1 - bias)  # below the normals, the step stays that of the smallest exponent
    steps = magnitude / Fraction(2) ** (exponent - mantissa_bits)
    whole = math.floor(steps)
    rest = steps - whole
    away = mode == "u" and not sign or mode == "d" and sign  # rounding away from zero
    if mode == "n" and (rest > Fraction(1, 2) or (rest == Fraction(1, 2) and whole % 2 == 1)) or away and rest > 0:
        whole += 1
    bits = ((exponent + bias - 1) << mantissa_bits) + whole  # the leading 1 carries into the exponent field
    infinity = (2 ** exponent_bits - 1) << mantissa_bits
    if bits >= infinity:  # past the largest finite value: infinity, unless rounding toward zero
        bits = infinity if mode == "n" or away else infinity - 1
    return sign | bits


def bfloat16_bits_reference(x):
    """float32 -> bfloat16 bits, rounded to nearest even on the bits (NaN: any NaN pattern)."""
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FFF), rounded)


def bfloat16_to_float(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def conversion_inputs(rng):
    """float32 values that test rounding to half and bfloat16: random bits, random values in half's range,
    exact ties between neighbouring halves (and one float ulp either side), and the edges."""
    random_bits = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    in_range = (np.exp2(rng.uniform(-27, 17, 20000)) * rng.choice([-1, 1], 20000)).astype(np.float32)
    halves = rng.integers(0, 0x7BFF, 5000, dtype=np.uint16).view(np.float16).astype(np.float64)
    following = (rng.integers(0, 0x7BFF, 5000, dtype=np.uint16) + 0).astype(np.uint16)
    halves = following.view(np.float16).astype(np.float64)
    ties = ((halves + (following + 1).view(np.float16).astype(np.float64)) / 2).astype(np.float32)
    edges = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 65504.0, 65519.996, 65520.0, -65520.0,
                      2.0**-24, 2.0**-25, np.nextafter(np.float32(2.0**-25), np.float32(1)), 2.0**-26, 2.0**-14,
                      3.0 * 2.0**-26, 1e-40, -1e-45, 3.4028235e38, 1.0009765625, 1.00048828125, 1.00146484375],
                     dtype=np.float32)
    bfloat_ties = (rng.integers(0, 2**31, 5000, dtype=np.uint64).astype(np.uint32) & 0xFFFF0000 | 0x8000).view(np.float32)
    return np.concatenate([random_bits, in_range, ties, np.nextafter(ties, np.float32(np.inf)),
                           np.nextafter(ties, np.float32(-np.inf)), edges, bfloat_ties]).astype(np.float32)


SIXTEEN_BIT_CONVERSIONS = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>

extern "C" __global__ void narrow(const float* x, const double* d, unsigned short* out, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[6 * i + 0] = __half_as_ushort(__float2half(x[i]));
    __half h = x[i];  // the implicit conversion rounds the same way
    out[6 * i + 1] = __half_as_ushort(__float2half_rn(x[i])) ^ __half_as_ushort(h);
    out[6 * i + 2] = __bfloat16_as_ushort(__float2bfloat16(x[i]));
    __nv_bfloat16 b = x[i];
    out[6 * i + 3] = __bfloat16_as_ushort(__float2bfloat16_rn(x[i])) ^ __bfloat16_as_ushort(b);
    out[6 * i + 4] = __half_as_ushort(__double2half(d[i]));
    out[6 * i + 5] = __bfloat16_as_ushort(__double2bfloat16(d[i]));
}

extern "C" __global__ void widen(const unsigned short* bits, float* out, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[2 * i + 0] = __half2float(__ushort_as_half(bits[i]));
    out[2 * i + 1] = __bfloat162float(__ushort_as_bfloat16(bits[i]));
}
"""


def test_float_to_half_and_bfloat16_round_to_nearest_even_bit_exact(rng):
    """__float2half matches numpy's float16 bit for bit (ties to even, subnormals, overflow to inf at
    65520, -0); __float2bfloat16 matches rounding the float's bits; NaN stays NaN."""
    x = conversion_inputs(rng)
    n = len(x)
    out = device(np.zeros(n * 6, dtype=np.uint16))
    with np.errstate(over="ignore"):
        half_reference = x.astype(np.float16)
    with np.errstate(invalid="ignore"):  # signalling NaNs among the random bits
        x64 = x.astype(np.float64)
    run(SIXTEEN_BIT_CONVERSIONS, "narrow", ((n + 255) // 256,), (256,), device(x), device(x64), out, np.int32(n))
    got = host(out).reshape(n, 6)
    nan = np.isnan(x)
    assert np.isnan(got[nan, 0].view(np.float16)).all() and np.isnan(bfloat16_to_float(got[nan, 2])).all()
    np.testing.assert_array_equal(got[~nan, 0], half_reference[~nan].view(np.uint16))
    np.testing.assert_array_equal(got[:, 1], 0)  # __float2half_rn == __float2half == implicit conversion
    np.testing.assert_array_equal(got[~nan, 2], bfloat16_bits_reference(x)[~nan])
    np.testing.assert_array_equal(got[:, 3], 0)


def test_double_to_half_and_bfloat16_round_once(rng):
    """__double2half and __double2bfloat16 round the double directly (not through float, which would round
    twice): doubles just above a tie, by less than a float can hold, must round up."""
    halves = rng.integers(1, 0x7BFF, 300, dtype=np.uint16)
    low, high = halves.view(np.float16).astype(np.float64), (halves + 1).astype(np.uint16).view(np.float16).astype(np.float64)
    bfloats = rng.integers(1, 0x7F7F, 300, dtype=np.uint16)
    b_low, b_high = bfloat16_to_float(bfloats).astype(np.float64), bfloat16_to_float(bfloats + 1).astype(np.float64)
    d = np.concatenate([(low + high) / 2 * (1 + 2.0**-40), (low + high) / 2, (b_low + b_high) / 2 * (1 + 2.0**-40),
                        (b_low + b_high) / 2, rng.standard_normal(200) * 1e3, [1e300, -1e300, 2.0**-30, 1e-320]])
    n = len(d)
    out = device(np.zeros(n * 6, dtype=np.uint16))
    with np.errstate(over="ignore"):
        d32 = d.astype(np.float32)
    run(SIXTEEN_BIT_CONVERSIONS, "narrow", ((n + 255) // 256,), (256,), device(d32), device(d), out, np.int32(n))
    got = host(out).reshape(n, 6)
    np.testing.assert_array_equal(got[:, 4], [round_exactly(Fraction(v), 10, 5) for v in d])
    np.testing.assert_array_equal(got[:, 5], [round_exactly(Fraction(v), 7, 8) for v in d])


def test_every_half_and_bfloat16_widens_exactly():
    """All 65536 bit patterns: __half2float equals numpy's float16 -> float32; __bfloat162float puts the bits
    on top of a float. Every value is exact (NaN stays NaN)."""
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    out = device(np.zeros(65536 * 2, dtype=np.float32))
    run(SIXTEEN_BIT_CONVERSIONS, "widen", (256,), (256,), device(bits), out, np.int32(65536))
    got = host(out).reshape(-1, 2)
    half = bits.view(np.float16).astype(np.float32)
    bfloat = bfloat16_to_float(bits)
    np.testing.assert_array_equal(np.isnan(got[:, 0]), np.isnan(half))
    np.testing.assert_array_equal(got[~np.isnan(half), 0].view(np.uint32), half[~np.isnan(half)].view(np.uint32))
    np.testing.assert_array_equal(np.isnan(got[:, 1]), np.isnan(bfloat))
    np.testing.assert_array_equal(got[~np.isnan(bfloat), 1].view(np.uint32), bfloat[~np.isnan(bfloat)].view(np.uint32))


SIXTEEN_BIT_ARITHMETIC = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>

template <class T>
__device__ void arithmetic(const T* a, const T* b, const T* c, T* out, int* flags, int i)
{
    out[8 * i + 0] = a[i] + b[i];
    out[8 * i + 1] = __hsub(a[i], b[i]);
    out[8 * i + 2] = a[i] * b[i];
    out[8 * i + 3] = __hdiv(a[i], b[i]);
    out[8 * i + 4] = __hfma(a[i], b[i], c[i]);
    out[8 * i + 5] = __hmax(a[i], b[i]);
    out[8 * i + 6] = __hmin(a[i], b[i]);
    out[8 * i + 7] = -a[i];
    flags[i] = (a[i] < b[i]) | (a[i] == b[i]) << 1 | (a[i] != b[i]) << 2 | (a[i] >= b[i]) << 3
             | __hisnan(a[i]) << 4 | (__hisinf(a[i]) != 0) << 5 | __hne(a[i], b[i]) << 6 | __hltu(a[i], b[i]) << 7;
}

extern "C" __global__ void half_arithmetic(const __half* a, const __half* b, const __half* c, __half* out, int* flags, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) arithmetic(a, b, c, out, flags, i);
}

extern "C" __global__ void bfloat16_arithmetic(const __nv_bfloat16* a, const __nv_bfloat16* b, const __nv_bfloat16* c,
                                               __nv_bfloat16* out, int* flags, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) arithmetic(a, b, c, out, flags, i);
}
"""


def sixteen_bit_operands(rng, n, maximum):
    """Bit patterns of three operands: random finite values of mixed scales, with some NaN, inf, 0 and -0."""
    bits = rng.integers(0, maximum + 1, (3, n), dtype=np.uint32).astype(np.uint16)
    bits |= (rng.random((3, n)) < 0.5).astype(np.uint16) << 15
    bits[:, :8] = [[0x7FFF, 0x7C00, 0xFC00, 0x0000, 0x8000, 0x0001, 0x3C00, 0x7FFF]] * 3
    bits[1, :8] = [0x3C00, 0x3C00, 0x7C00, 0x8000, 0x0000, 0x8001, 0x7FFF, 0x7FFF]
    return bits


def value_of(bits, mantissa_bits):
    return bits.view(np.float16).astype(np.float64) if mantissa_bits == 10 else bfloat16_to_float(bits).astype(np.float64)


@pytest.mark.parametrize("name, mantissa_bits, exponent_bits, largest_finite",
                         [("half_arithmetic", 10, 5, 0x7BFF), ("bfloat16_arithmetic", 7, 8, 0x7F7F)])
def test_sixteen_bit_arithmetic_is_correctly_rounded(name, mantissa_bits, exponent_bits, largest_finite, rng):
    """+, -, *, __hfma are rounded once from the exact result (checked with fractions); __hdiv is within one
    unit in the last place; __hmax/__hmin ignore a NaN; negation
    flips the sign; comparisons with NaN are false except != and the unordered ones."""
    n = 1500
    bits = sixteen_bit_operands(rng, n, largest_finite)
    a, b, c = (value_of(v, mantissa_bits) for v in bits)
    out = device(np.zeros(n * 8, dtype=np.uint16))
    flags = device(np.zeros(n, dtype=np.int32))
    # numpy's float16 for __half*; numpy has no bfloat16, so its bits travel as uint16.
    as_array = (lambda v: v.view(np.float16)) if mantissa_bits == 10 else (lambda v: v)
    out = device(as_array(np.zeros(n * 8, dtype=np.uint16)))
    run(SIXTEEN_BIT_ARITHMETIC, name, ((n + 127) // 128,), (128,), *(device(as_array(v)) for v in bits), out, flags, np.int32(n))
    got = host(out).view(np.uint16).reshape(n, 8)
    nan_bits = (2 ** exponent_bits - 1) << mantissa_bits

    def reference(operation, *operands):
        results = []
        for values in zip(*operands):
            if any(math.isnan(v) or math.isinf(v) for v in values):
                with np.errstate(all="ignore"):
                    exact = operation(*(np.float64(v) for v in values))
                results.append(-1 if np.isnan(exact) else round_exactly(0, 0, 1) | (nan_bits | (1 << 15) * (exact < 0)))
                continue
            try:
                exact = operation(*(Fraction(v) for v in values))
                if exact == 0:  # an exact zero takes IEEE's sign rules (-0 - 0 is -0), which float64 follows
                    results.append((1 << 15) * bool(np.signbit(operation(*(np.float64(v) for v in values)))))
                    continue
                results.append(round_exactly(exact, mantissa_bits, exponent_bits))
            except ZeroDivisionError:
                results.append(-1 if values[0] == 0 else nan_bits | (1 << 15) * ((values[0] < 0) != (math.copysign(1, values[1]) < 0)))
        return np.array(results)

    problems = []  # every check runs, so that one run names every column that differs

    def check(wrong, what):
        """Record `what` with the operands of the first rows where `wrong` is true."""
        rows = np.flatnonzero(wrong)
        if rows.size:
            first = ", ".join(f"a,b,c={[hex(v) for v in bits[:, k]]} got {got[k, :].tolist()}" for k in rows[:3])
            problems.append(f"{what}: {rows.size} rows wrong, e.g. {first}")

    def check_rounded(column, expected, what):
        nan = expected == -1
        check(nan & ~(got[:, column] & 0x7FFF > nan_bits), f"{what}: NaN expected")
        check(~nan & (got[:, column] != expected), what)

    check_rounded(0, reference(lambda x, y: x + y, a, b), "a + b")
    check_rounded(1, reference(lambda x, y: x - y, a, b), "__hsub")
    check_rounded(2, reference(lambda x, y: x * y, a, b), "a * b")
    check_rounded(4, reference(lambda x, y, z: x * y + z, a, b, c), "__hfma")
    # A divisor of 2^126 or more (bfloat16 has them) is divided accurately on an H100 as well.
    quotient = got[:, 3]
    division = reference(lambda x, y: x / y, a, b)
    finite = (division != -1) & (division & 0x7FFF < nan_bits) & ((quotient & 0x7FFF) < nan_bits)
    with np.errstate(all="ignore"):  # NaN and inf rows are left out by `finite`
        units = np.abs(value_of(quotient, mantissa_bits) - value_of(division.astype(np.uint16), mantissa_bits))
        unit_in_last_place = np.abs(np.spacing(value_of(division.astype(np.uint16), mantissa_bits).astype(np.float32)))
    check(finite & ~(units <= unit_in_last_place * 2 ** (23 - mantissa_bits)), "__hdiv: more than one ulp")

    with np.errstate(invalid="ignore"):
        expected_max = np.where(np.isnan(a), b, np.where(np.isnan(b), a, np.maximum(a, b)))
        expected_min = np.where(np.isnan(a), b, np.where(np.isnan(b), a, np.minimum(a, b)))
        for column, expected, what in ((5, expected_max, "__hmax"), (6, expected_min, "__hmin")):
            value = value_of(got[:, column], mantissa_bits)  # -0 == 0 here
            check(~((value == expected) | np.isnan(value) & np.isnan(expected)), what)
        # Negation flips the sign bit of every number; of a NaN, PTX's neg leaves which NaN unspecified.
        negated = got[:, 7]
        check(~np.isnan(a) & (negated != bits[0] ^ 0x8000), "-a")
        check(np.isnan(a) & ~(negated & 0x7FFF > nan_bits), "-a of a NaN: NaN expected")
        expected_flags = ((a < b) | (a == b) << 1 | (a != b) << 2 | (a >= b) << 3 | np.isnan(a) << 4 | np.isinf(a) << 5
                          | ((a < b) | (a > b)) << 6 | ~(a >= b) << 7) & 0xFF
    check(host(flags) != expected_flags, "comparison flags")
    assert not problems, "\n".join(problems)


HALF_PAIRS = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>

extern "C" __global__ void pairs(const float* x, float* out, __half* half_total, unsigned short* bfloat_total, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    half2 p = __floats2half2_rn(x[2 * i], x[2 * i + 1]);
    half2 q = __float22half2_rn(make_float2(2.0f, -0.5f));
    half2 r = __hfma2(p, q, __float2half2_rn(1.0f)) + p * q;
    float2 wide = __half22float2(r);
    out[6 * i + 0] = wide.x;
    out[6 * i + 1] = __high2float(r);
    __nv_bfloat162 b = __floats2bfloat162_rn(x[2 * i], x[2 * i + 1]);
    b = __hmul2(b, __float2bfloat162_rn(3.0f));
    out[6 * i + 2] = __low2float(b);
    out[6 * i + 3] = __bfloat1622float2(b).y;
    // NaN from its bits: the <cuda_fp16.h> NVRTC finds beside CuPy may have no CUDART_NAN_FP16 (CUDA 12.2 added it).
    const __half not_a_number = __ushort_as_half((unsigned short)0x7FFFU);
    out[6 * i + 4] = __half2float(__hmax_nan(__low2half(p), not_a_number));
    out[6 * i + 5] = __half2float(__hmax(not_a_number, __high2half(p)));
    // Whole numbers up to 2048 are exact in half, and sums of them too: the atomics' total is exact.
    atomicAdd(half_total, __int2half_rn(i % 4));
    atomicAdd(reinterpret_cast<__nv_bfloat16*>(bfloat_total), __float2bfloat16(i % 2));
}
"""


def test_half2_and_bfloat162_pairs_and_sixteen_bit_atomics(rng):
    """half2/__nv_bfloat162 operate on both halves; __low2float/__high2float pick them; __hmax_nan returns
    NaN, __hmax the other value; atomicAdd on __half and __nv_bfloat16 adds every thread's term."""
    n = 200
    x = rng.uniform(-4, 4, 2 * n).astype(np.float32)
    out = device(np.zeros(n * 6, dtype=np.float32))
    half_total = device(np.zeros(1, dtype=np.float16))
    bfloat_total = device(np.zeros(1, dtype=np.uint16))
    run(HALF_PAIRS, "pairs", (2,), (128,), device(x), out, half_total, bfloat_total, np.int32(n))
    got = host(out).reshape(n, 6)
    p = x.astype(np.float16).reshape(n, 2)
    q = np.array([2.0, -0.5], dtype=np.float16)
    # __hfma2 rounds once; p * q is exact here (a power of two), so each step can be checked in float16.
    fused = np.array([round_exactly(Fraction(float(a)) * Fraction(float(b)) + 1, 10, 5) for a, b in
                      zip(p.ravel(), np.tile(q, n))], dtype=np.uint16).view(np.float16).reshape(n, 2)
    expected = (fused + p * q).astype(np.float32)
    np.testing.assert_array_equal(got[:, 0], expected[:, 0])
    np.testing.assert_array_equal(got[:, 1], expected[:, 1])
    bfloat = bfloat16_to_float(bfloat16_reference_pairs := bfloat16_bits_reference(x)).reshape(n, 2).astype(np.float64)
    times_three = np.array([round_exactly(Fraction(float(v)) * 3, 7, 8) for v in bfloat.ravel()], dtype=np.uint16)
    np.testing.assert_array_equal(got[:, 2:4], bfloat16_to_float(times_three).reshape(n, 2))
    assert np.isnan(got[:, 4]).all()
    np.testing.assert_array_equal(got[:, 5], p[:, 1].astype(np.float32))
    assert host(half_total)[0] == np.float16(sum(i % 4 for i in range(n)))
    assert bfloat16_to_float(host(bfloat_total))[0] == sum(i % 2 for i in range(n))
    assert bfloat16_reference_pairs.size == 2 * n


# ---------------------------------------------------------------------------------------------------------
# Conversion intrinsics: rounding modes and saturation
# ---------------------------------------------------------------------------------------------------------

CONVERSIONS = r"""
extern "C" __global__ void float_to_integer(const float* x, int* as_int, unsigned int* as_uint, long long* as_ll,
                                           unsigned long long* as_ull, long long* libm, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[i];
    as_int[4 * i + 0] = __float2int_rn(v);
    as_int[4 * i + 1] = __float2int_rz(v);
    as_int[4 * i + 2] = __float2int_rd(v);
    as_int[4 * i + 3] = __float2int_ru(v);
    as_uint[4 * i + 0] = __float2uint_rn(v);
    as_uint[4 * i + 1] = __float2uint_rz(v);
    as_uint[4 * i + 2] = __float2uint_rd(v);
    as_uint[4 * i + 3] = __float2uint_ru(v);
    as_ll[4 * i + 0] = __float2ll_rn(v);
    as_ll[4 * i + 1] = __double2ll_rz((double)v);
    as_ll[4 * i + 2] = __double2int_rn((double)v);
    as_ll[4 * i + 3] = __double2uint_rz((double)v);
    as_ull[2 * i + 0] = __float2ull_rn(v);
    as_ull[2 * i + 1] = __double2ull_rd((double)v);
    libm[4 * i + 0] = lrintf(v);
    libm[4 * i + 1] = llrintf(v);
    libm[4 * i + 2] = lroundf(v);
    libm[4 * i + 3] = llroundf(v);
}

extern "C" __global__ void integer_to_float(const long long* values, float* out, double* wide, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    long long v = values[i];
    out[8 * i + 0] = __int2float_rn((int)v);
    out[8 * i + 1] = __int2float_rz((int)v);
    out[8 * i + 2] = __int2float_rd((int)v);
    out[8 * i + 3] = __int2float_ru((int)v);
    out[8 * i + 4] = __uint2float_rn((unsigned int)v);
    out[8 * i + 5] = __ll2float_rn(v);
    out[8 * i + 6] = __ull2float_rn((unsigned long long)v);
    out[8 * i + 7] = __double2float_rd((double)v * 1.0000001);
    wide[i] = __ll2double_rn(v);
}
"""


def test_float_to_integer_rounding_modes_saturate_like_the_gpu():
    """_rn rounds half to even, _rz toward zero, _rd down, _ru up; out of range saturates to the type's limits.
    NaN gives 0 from float to a 32-bit integer, and the value with only the top bit set from a double or to a
    64-bit integer (what PTX's cvt does). lrintf rounds half to even, lroundf half away from zero."""
    x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 2.4, -2.6, 0.0, -0.0, 1e10, -1e10, 3e9, np.inf, -np.inf, np.nan,
                  2147483520.0, -2147483648.0, 8388607.5, 1e19, -1e19, 1.9e19], dtype=np.float32)
    n = len(x)
    buffers = [device(np.zeros(n * k, dtype=t)) for k, t in ((4, np.int32), (4, np.uint32), (4, np.int64), (2, np.uint64))]
    libm = device(np.zeros(n * 4, dtype=np.int64))
    run(CONVERSIONS, "float_to_integer", (1,), (64,), device(x), *buffers, libm, np.int32(n))
    as_int, as_uint, as_ll, as_ull = (host(b).reshape(n, -1) for b in buffers)

    def saturated(rounded, lowest, highest, nan=0):
        """Python integers: rounded clamped to [lowest, highest], NaN to `nan`."""
        return [nan if math.isnan(v) else int(min(max(v, lowest), highest)) for v in rounded]

    x64 = x.astype(np.float64)
    for column, rounding in enumerate((np.rint, np.trunc, np.floor, np.ceil)):
        np.testing.assert_array_equal(as_int[:, column], saturated(rounding(x64), -2**31, 2**31 - 1))
        np.testing.assert_array_equal(as_uint[:, column], saturated(rounding(x64), 0, 2**32 - 1))
    # From a double, or to 64 bits, NaN gives the top bit alone: the smallest signed value, 2^31 or 2^63 unsigned.
    np.testing.assert_array_equal(as_ll[:, 0], saturated(np.rint(x64), -2**63, 2**63 - 1, nan=-2**63))
    np.testing.assert_array_equal(as_ll[:, 1], saturated(np.trunc(x64), -2**63, 2**63 - 1, nan=-2**63))
    np.testing.assert_array_equal(as_ll[:, 2], saturated(np.rint(x64), -2**31, 2**31 - 1, nan=-2**31))
    np.testing.assert_array_equal(as_ll[:, 3], saturated(np.trunc(x64), 0, 2**32 - 1, nan=2**31))
    np.testing.assert_array_equal(as_ull[:, 0], np.array(saturated(np.rint(x64), 0, 2**64 - 1, nan=2**63), dtype=np.uint64))
    np.testing.assert_array_equal(as_ull[:, 1], np.array(saturated(np.floor(x64), 0, 2**64 - 1, nan=2**63), dtype=np.uint64))
    finite = np.abs(x64) < 2**31
    got = host(libm).reshape(n, 4)
    np.testing.assert_array_equal(got[finite, 0], np.rint(x64[finite]))
    np.testing.assert_array_equal(got[finite, 1], np.rint(x64[finite]))
    away = np.sign(x64[finite]) * np.floor(np.abs(x64[finite]) + 0.5)
    np.testing.assert_array_equal(got[finite, 2], away)
    np.testing.assert_array_equal(got[finite, 3], away)


def test_integer_to_float_rounding_modes():
    """Integers too wide for a float's 24 bits: _rn to nearest even, _rz toward zero, _rd down, _ru up;
    unsigned and 64-bit sources; __double2float_rd rounds down."""
    values = np.array([16777217, -16777217, 16777219, 2147483647, -2147483647, 33554435, 5, -5, 0,
                       2**62 + 2**39 + 1, -(2**62) - 1, 2**53 + 1, 4294967295, 9007199254740993], dtype=np.int64)
    n = len(values)
    out = device(np.zeros(n * 8, dtype=np.float32))
    wide = device(np.zeros(n, dtype=np.float64))
    run(CONVERSIONS, "integer_to_float", (1,), (32,), device(values), out, wide, np.int32(n))
    got = host(out).reshape(n, 8)

    def directed(v, mode):
        nearest = np.float32(v)
        exact, rounded = int(v), int(nearest)
        if mode == "z" and abs(rounded) > abs(exact):
            return np.nextafter(nearest, np.float32(0))
        if mode == "d" and rounded > exact:
            return np.nextafter(nearest, np.float32(-np.inf))
        if mode == "u" and rounded < exact:
            return np.nextafter(nearest, np.float32(np.inf))
        return nearest

    as_int = values.astype(np.int32)  # the kernel's (int) cast keeps the low 32 bits
    for column, mode in enumerate("nzdu"):
        np.testing.assert_array_equal(got[:, column], [directed(int(v), mode) for v in as_int], err_msg=f"__int2float_r{mode}")
    np.testing.assert_array_equal(got[:, 4], as_int.view(np.uint32).astype(np.float32))
    np.testing.assert_array_equal(got[:, 5], values.astype(np.float32))
    np.testing.assert_array_equal(got[:, 6], values.view(np.uint64).astype(np.float32))
    for got_value, v in zip(got[:, 7], values):
        product = Fraction(float(v) * 1.0000001)  # the double the kernel rounds down
        assert Fraction(float(got_value)) <= product < Fraction(float(np.nextafter(got_value, np.float32(np.inf)))), \
            "__double2float_rd"
    np.testing.assert_array_equal(host(wide), values.astype(np.float64))


# ---------------------------------------------------------------------------------------------------------
# Math functions, max/min with NaN, <math_constants.h>
# ---------------------------------------------------------------------------------------------------------

MORE_MATH = r"""
extern "C" __global__ void more_math(const float* x, const float* positive, const float* unit, const float* twice,
                                     float* out, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float s, c;
    sincospif(x[i], &s, &c);
    float results[12] = {
        fdividef(x[i], positive[i]), erfinvf(unit[i]), erfcinvf(twice[i]), normcdff(x[i]),
        normcdfinvf(0.5f * twice[i]), rcbrtf(positive[i]), s, c, exp10f(0.25f * x[i]), __saturatef(x[i] / 4.0f),
        __frcp_rn(positive[i]), __fsqrt_rn(positive[i]),
    };
    for (int k = 0; k < 12; ++k) out[k * n + i] = results[k];
}
"""


def within(function, got, target, relative, increasing=True):
    """Whether `target` lies between function() at got shifted by `relative` either way: a test of an inverse
    function's result that allows a few units in the last place of got."""
    spread = relative * np.abs(got) + 1e-30
    low, high = function(got - spread), function(got + spread)
    return (low <= target <= high) if increasing else (high <= target <= low)


def test_inverse_error_functions_normal_cdf_and_friends(rng):
    """erfinvf, erfcinvf, normcdfinvf invert math.erf/erfc to a few ulp (down to tiny tails; erfcinvf of a
    subnormal is inf); normcdff, rcbrtf, exp10f, sincospif, fdividef match float64; __frcp_rn and __fsqrt_rn
    are correctly rounded; __saturatef clamps to [0, 1]."""
    n = 2000
    x = rng.uniform(-8, 8, n).astype(np.float32)
    x[:8] = [0.0, 1.0, -1.5, 0.5, 2.0, -0.5, 7.0, 8.0]  # sinpi/cospi exact there
    positive = np.exp(rng.uniform(-20, 20, n)).astype(np.float32)
    unit = np.tanh(rng.uniform(-6, 6, n)).astype(np.float32)  # (-1, 1), crowding towards both ends
    unit[:4] = [0.0, 1e-30, -0.999999940, 0.5]
    twice = np.exp(rng.uniform(np.log(1e-37), np.log(2), n)).astype(np.float32)  # (0, 2) with tiny values
    twice = np.where(twice >= 2, np.float32(1.0), twice).astype(np.float32)
    twice[:3] = [1.0, 1.9999999, 1e-38]
    out = device(np.zeros(12 * n, dtype=np.float32))
    run(MORE_MATH, "more_math", ((n + 127) // 128,), (128,), device(x), device(positive), device(unit), device(twice), out, np.int32(n))
    got = host(out).reshape(12, n).astype(np.float64)
    x64, p64, u64, t64 = (v.astype(np.float64) for v in (x, positive, unit, twice))
    half_twice = (np.float32(0.5) * twice).astype(np.float64)  # as the kernel rounds it (subnormals lose a bit)
    np.testing.assert_allclose(got[0], x64 / p64, rtol=2e-6)
    # CUDA's erfcinvf takes a subnormal input (below 2^-126, such as 1e-38) for 0: it returns +inf there.
    # normcdfinvf(p) is -sqrt(2) erfcinvf(2p), so where 2p is subnormal the executor returns -inf; a GPU's
    # result there is not checked here: normcdfinvf is checked where 2p is a normal float.
    smallest_normal = np.finfo(np.float32).tiny
    for k in range(n):
        assert within(math.erf, got[1, k], u64[k], 2e-6), f"erfinvf({unit[k]!r}) = {got[1, k]!r}"
        if twice[k] < smallest_normal:
            assert got[2, k] == np.inf, f"erfcinvf({twice[k]!r}) = {got[2, k]!r}, not inf"
        else:
            assert within(math.erfc, got[2, k], t64[k], 2e-6, increasing=False), f"erfcinvf({twice[k]!r}) = {got[2, k]!r}"
        cdf = lambda v: 0.5 * math.erfc(-v / math.sqrt(2))  # noqa: E731
        if 2 * half_twice[k] >= smallest_normal:
            assert within(cdf, got[4, k], half_twice[k], 2e-6), f"normcdfinvf({half_twice[k]!r}) = {got[4, k]!r}"
    np.testing.assert_allclose(got[3], [0.5 * math.erfc(-v / math.sqrt(2)) for v in x64], rtol=2e-6, atol=1e-30)
    np.testing.assert_allclose(got[5], p64 ** (-1 / 3), rtol=5e-7)
    turns = np.remainder(x64, 2.0)  # exact, so the reference keeps its accuracy
    np.testing.assert_allclose(got[6], np.sin(np.pi * turns), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[7], np.cos(np.pi * turns), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[6, :8], [0, 0, 1, 1, 0, -1, 0, 0])
    np.testing.assert_array_equal(got[7, :8], [1, -1, 0, 0, 1, 0, -1, 1])
    np.testing.assert_allclose(got[8], 10.0 ** (0.25 * x64), rtol=2e-6)
    np.testing.assert_array_equal(got[9], np.clip(x / np.float32(4), 0, 1))
    np.testing.assert_array_equal(got[10], np.float32(1) / positive)
    np.testing.assert_array_equal(got[11], np.sqrt(positive))


MAX_MIN_NAN = r"""
extern "C" __global__ void max_min(const float* a, const float* b, float* out, double* wide, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[4 * i + 0] = max(a[i], b[i]);
    out[4 * i + 1] = min(a[i], b[i]);
    out[4 * i + 2] = fmaxf(a[i], b[i]);
    out[4 * i + 3] = __saturatef(a[i]);
    wide[2 * i + 0] = max((double)a[i], (double)b[i]);
    wide[2 * i + 1] = min((double)a[i], b[i]);  // mixed double and float: the double overload
}
"""


def test_max_and_min_of_floats_ignore_nan_as_fmaxf_does():
    """CUDA's max/min on floats are fmaxf/fminf: a NaN argument is ignored (NaN only if both are NaN).
    __saturatef(NaN) is 0."""
    a = np.array([np.nan, 1.0, np.nan, -np.inf, 2.0, -0.5], dtype=np.float32)
    b = np.array([3.0, np.nan, np.nan, 1.0, -7.0, np.inf], dtype=np.float32)
    n = len(a)
    out = device(np.zeros(4 * n, dtype=np.float32))
    wide = device(np.zeros(2 * n, dtype=np.float64))
    run(MAX_MIN_NAN, "max_min", (1,), (32,), device(a), device(b), out, wide, np.int32(n))
    got, got_wide = host(out).reshape(n, 4), host(wide).reshape(n, 2)
    np.testing.assert_array_equal(got[:, 0], np.fmax(a, b))
    np.testing.assert_array_equal(got[:, 1], np.fmin(a, b))
    np.testing.assert_array_equal(got[:, 2], np.fmax(a, b))
    np.testing.assert_array_equal(got[:, 3], [0, 1, 0, 0, 1, 0])
    np.testing.assert_array_equal(got_wide[:, 0], np.fmax(a, b).astype(np.float64))
    np.testing.assert_array_equal(got_wide[:, 1], np.fmin(a, b).astype(np.float64))


MATH_CONSTANTS = r"""
#include <math_constants.h>
extern "C" __global__ void constants(float* single, double* wide)
{
    float s[10] = {CUDART_INF_F, CUDART_NAN_F, CUDART_PI_F, CUDART_SQRT_HALF_F, CUDART_L2E_F, CUDART_LN2_F,
                   CUDART_MAX_NORMAL_F, CUDART_MIN_DENORM_F, CUDART_NEG_ZERO_F, CUDART_TWO_TO_23_F};
    double d[8] = {CUDART_INF, CUDART_NAN, CUDART_PI, CUDART_SQRT_HALF, CUDART_LN2, CUDART_L2E, CUDART_SQRT_2PI,
                   CUDART_PIO2};
    for (int k = 0; k < 10; ++k) single[k] = s[k];
    for (int k = 0; k < 8; ++k) wide[k] = d[k];
}
"""


def test_math_constants_header_names_and_values():
    """<math_constants.h>: CUDART_INF_F, CUDART_NAN_F, CUDART_PI_F, ... and the double CUDART_PI, ... are the
    nearest float (double) to the constant they name."""
    single = device(np.zeros(10, dtype=np.float32))
    wide = device(np.zeros(8, dtype=np.float64))
    run(MATH_CONSTANTS, "constants", (1,), (1,), single, wide)
    s, d = host(single), host(wide)
    assert np.isposinf(s[0]) and np.isnan(s[1]) and np.isposinf(d[0]) and np.isnan(d[1])
    np.testing.assert_array_equal(s[2:8], np.array([math.pi, math.sqrt(0.5), math.log2(math.e), math.log(2),
                                                    np.finfo(np.float32).max, 2.0**-149], dtype=np.float32))
    assert s[8] == 0 and np.signbit(s[8]) and s[9] == 2.0**23
    np.testing.assert_array_equal(d[2:], [math.pi, math.sqrt(0.5), math.log(2), math.log2(math.e),
                                          float("2.50662827463100050241576528481"), math.pi / 2])


# ---------------------------------------------------------------------------------------------------------
# Integer intrinsics, cache-hinted loads and stores, clocks
# ---------------------------------------------------------------------------------------------------------

INTEGER_INTRINSICS = r"""
extern "C" __global__ void integer_intrinsics(const unsigned int* a, const unsigned int* b, unsigned int* out, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned int x = __ldcs(a + i), y = __ldcg(b + i);
    unsigned long long wide = (unsigned long long)x << 32 | y;
    unsigned int r[14] = {
        __byte_perm(x, y, 0x5140), __byte_perm(x, y, 0x3210 + (y & 0x7777)), __funnelshift_l(x, y, y),
        __funnelshift_r(x, y, y), __funnelshift_lc(x, y, y), __funnelshift_rc(x, y, y % 40),
        __brev(x), (unsigned int)(__brevll(wide) >> 16), (unsigned int)(__clz((int)x) + 100 * __clzll((long long)(wide >> (y % 64)))),
        (unsigned int)(__ffs((int)x) + 100 * __popcll(wide)), (unsigned int)__hadd((int)x, (int)y),
        (unsigned int)__rhadd((int)x, (int)y), __umulhi(x, y), (unsigned int)__mul24((int)x, (int)y),
    };
    for (int k = 0; k < 14; ++k) __stcs(out + 14 * i + k, r[k]);
}
"""


def test_integer_intrinsics_byte_perm_funnel_shifts_bit_counts(rng):
    """__byte_perm, the four funnel shifts, __brev/__brevll, __clz/__clzll, __ffs, __popcll, __hadd/__rhadd
    (averages without overflow), __umulhi, __mul24 against Python integers; __ldcs/__ldcg/__stcs move data."""
    n = 300
    a = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    b = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    a[:3], b[:3] = [0, 0xFFFFFFFF, 1], [0, 31, 32]
    out = device(np.zeros(14 * n, dtype=np.uint32))
    run(INTEGER_INTRINSICS, "integer_intrinsics", ((n + 127) // 128,), (128,), device(a), device(b), out, np.int32(n))
    got = host(out).reshape(n, 14)

    def signed(v):
        return v - 2**32 if v >= 2**31 else v

    def byte_perm(x, y, selector):
        source = (y << 32 | x).to_bytes(8, "little")
        return int.from_bytes(bytes(source[(selector >> (4 * k)) & 7] for k in range(4)), "little")

    def clz(v, bits):
        return bits - v.bit_length()

    def low24(v):
        v &= 0xFFFFFF
        return v - 2**24 if v >= 2**23 else v

    for k in range(n):
        x, y = int(a[k]), int(b[k])
        wide = x << 32 | y
        funnel = y << 32 | x  # __funnelshift_*(low, high, shift) shifts high:low
        expected = [
            byte_perm(x, y, 0x5140), byte_perm(x, y, 0x3210 + (y & 0x7777)),
            ((funnel << (y % 32)) >> 32) & 0xFFFFFFFF, (funnel >> (y % 32)) & 0xFFFFFFFF,
            ((funnel << min(y, 32)) >> 32) & 0xFFFFFFFF, (funnel >> min(y % 40, 32)) & 0xFFFFFFFF,
            int(f"{x:032b}"[::-1], 2), (int(f"{wide:064b}"[::-1], 2) >> 16) & 0xFFFFFFFF,
            clz(x, 32) + 100 * clz(wide >> (y % 64), 64), ((x & -x).bit_length()) + 100 * bin(wide).count("1"),
            ((signed(x) + signed(y)) >> 1) & 0xFFFFFFFF, ((signed(x) + signed(y) + 1) >> 1) & 0xFFFFFFFF,
            (x * y) >> 32, (low24(x) * low24(y)) & 0xFFFFFFFF,
        ]
        np.testing.assert_array_equal(got[k], np.array(expected, dtype=np.uint64).astype(np.uint32), err_msg=f"a={x:#x} b={y:#x}")


CLOCKS = r"""
extern "C" __global__ void clocks(long long* out)
{
    long long start = clock64();
    long long coarse = clock();
    __nanosleep(1000);
    __threadfence_system();
    long long end = clock64();
    out[threadIdx.x] = (end >= start) + 2 * (clock() >= coarse || true);
}
"""


def test_clock64_clock_and_nanosleep():
    """clock64() never goes backwards within a thread; clock() and __nanosleep compile and run."""
    out = device(np.zeros(64, dtype=np.int64))
    run(CLOCKS, "clocks", (1,), (64,), out)
    np.testing.assert_array_equal(host(out), 3)


# ---------------------------------------------------------------------------------------------------------
# Refused as a GPU refuses
# ---------------------------------------------------------------------------------------------------------

LONG_LONG_ATOMICS = r"""
extern "C" __global__ void long_long_atomics(unsigned long long* total, long long* largest, const long long* values)
{
    atomicAdd(total, (unsigned long long)values[threadIdx.x]);  // unsigned long long: on every GPU
    atomicMax(largest, values[threadIdx.x]);                     // long long: atomicMin/Max exist
}
"""


def test_long_long_atomics_that_exist_work(rng):
    """atomicAdd on unsigned long long and atomicMax on long long: 64 threads, exact totals."""
    values = rng.integers(-2**40, 2**40, 64)
    total = device(np.zeros(1, dtype=np.uint64))
    largest = device(np.full(1, -2**62, dtype=np.int64))
    run(LONG_LONG_ATOMICS, "long_long_atomics", (1,), (64,), total, largest, device(values))
    assert int(host(total)[0]) == int(values.sum()) % 2**64
    assert host(largest)[0] == values.max()


@pytest.mark.parametrize("code, named", [
    ('extern "C" __global__ void refused(long long* t) { atomicAdd(t, 1LL); }', "atomicAdd"),
    ('extern "C" __global__ void refused(long long* t) { atomicCAS(t, 1LL, 2LL); }', "atomicCAS"),
    ('#include <cstdint>\nextern "C" __global__ void refused(int* t) { t[0] = 1; }', "cstdint"),
    ('#include <cfloat>\nextern "C" __global__ void refused(float* t) { t[0] = FLT_MAX; }', "cfloat"),
    ('#include <climits>\nextern "C" __global__ void refused(int* t) { t[0] = INT_MAX; }', "climits"),
    ('#include <cuda_fp16.h>\nextern "C" __global__ void refused(float* t) { t[0] = __half2float(CUDART_NAN_FP16); }',
     "CUDART_NAN_FP16"),
])
def test_what_nvrtc_refuses_does_not_compile(code, named):
    """atomicAdd/atomicCAS on long long (the GPU has them for unsigned long long only), the C++ library
    headers <cstdint>, <cfloat>, <climits> (NVRTC has none) and CUDART_NAN_FP16 (not in the <cuda_fp16.h>
    NVRTC finds beside CuPy) fail to compile, with a message naming them."""
    with pytest.raises(Exception) as error:
        run(code, "refused", (1,), (1,), device(np.zeros(1, dtype=np.int64)))
    assert named in str(error.value)


COOPERATIVE_SCAN = r"""
#include <cooperative_groups.h>
#include <cooperative_groups/scan.h>
namespace cg = cooperative_groups;

extern "C" __global__ void tile_scans(const int* values, int* out)
{
    cg::thread_block block = cg::this_thread_block();
    auto warp = cg::tiled_partition<32>(block);
    auto eight = cg::tiled_partition<8>(block);
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    out[4 * i + 0] = cg::inclusive_scan(warp, values[i]);
    out[4 * i + 1] = cg::exclusive_scan(warp, values[i], cg::plus<int>());
    out[4 * i + 2] = cg::inclusive_scan(eight, values[i], cg::greater<int>());  // running maximum
    out[4 * i + 3] = cg::exclusive_scan(eight, values[i]);
}
"""


def test_cooperative_groups_inclusive_and_exclusive_scan(rng):
    """cg::inclusive_scan and cg::exclusive_scan over tiles of 32 and 8: prefix sums and a running maximum."""
    blocks, threads = 2, 64
    values = rng.integers(-100, 100, blocks * threads).astype(np.int32)
    out = device(np.zeros(blocks * threads * 4, dtype=np.int32))
    run(COOPERATIVE_SCAN, "tile_scans", (blocks,), (threads,), device(values), out)
    got = host(out).reshape(-1, 4)
    warps, eights = values.reshape(-1, 32), values.reshape(-1, 8)
    np.testing.assert_array_equal(got[:, 0], np.cumsum(warps, axis=1).ravel())
    exclusive = (np.cumsum(warps, axis=1) - warps).ravel()
    not_first = np.arange(len(values)) % 32 != 0  # rank 0 of an exclusive scan: nothing to combine
    np.testing.assert_array_equal(got[not_first, 1], exclusive[not_first])
    np.testing.assert_array_equal(got[:, 2], np.maximum.accumulate(eights, axis=1).ravel())
    not_first_of_eight = np.arange(len(values)) % 8 != 0
    np.testing.assert_array_equal(got[not_first_of_eight, 3], (np.cumsum(eights, axis=1) - eights).ravel()[not_first_of_eight])


DIRECTED_SIXTEEN_BIT = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>

extern "C" __global__ void directed(const float* x, unsigned short* out, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[6 * i + 0] = __half_as_ushort(__float2half_rz(x[i]));
    out[6 * i + 1] = __half_as_ushort(__float2half_rd(x[i]));
    out[6 * i + 2] = __half_as_ushort(__float2half_ru(x[i]));
    out[6 * i + 3] = __bfloat16_as_ushort(__float2bfloat16_rz(x[i]));
    out[6 * i + 4] = __bfloat16_as_ushort(__float2bfloat16_rd(x[i]));
    out[6 * i + 5] = __bfloat16_as_ushort(__float2bfloat16_ru(x[i]));
}
"""


def test_float_to_half_and_bfloat16_directed_rounding(rng):
    """__float2half_rz/_rd/_ru and __float2bfloat16_rz/_rd/_ru round toward zero, down and up: past the
    largest finite value only the direction away from zero reaches infinity."""
    x = conversion_inputs(rng)
    x = x[np.isfinite(x)][::8]  # every kind of input, fewer of them: the reference is exact arithmetic
    x = np.concatenate([x, np.array([70000.0, -70000.0, 65504.5, 1e-30, -1e-30, 3.4e38, -3.4e38], dtype=np.float32)])
    n = len(x)
    out = device(np.zeros(n * 6, dtype=np.uint16))
    run(DIRECTED_SIXTEEN_BIT, "directed", ((n + 255) // 256,), (256,), device(x), out, np.int32(n))
    got = host(out).reshape(n, 6)
    for column, (mantissa_bits, exponent_bits, mode) in enumerate(
            [(10, 5, "z"), (10, 5, "d"), (10, 5, "u"), (7, 8, "z"), (7, 8, "d"), (7, 8, "u")]):
        expected = [round_exactly(Fraction(float(v)), mantissa_bits, exponent_bits, mode) if v != 0
                    else 0x8000 * bool(np.signbit(v)) for v in x]
        mismatched = np.flatnonzero(got[:, column] != expected)
        assert mismatched.size == 0, f"column {column}: {mismatched.size} wrong, first x = {x[mismatched[0]]!r}"


SIXTEEN_BIT_PARAMETERS = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>

extern "C" __global__ void scale(__half* out, unsigned short* bfloat_out, const __half* x, __half factor,
                                 __nv_bfloat16 bfloat_factor, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = x[i] * factor;
    bfloat_out[i] = __bfloat16_as_ushort(__float2bfloat16((float)x[i]) * bfloat_factor);
}
"""


def test_half_and_bfloat16_arrays_and_scalars_as_parameters():
    """A __half* takes a float16 array and a __half parameter a numpy.float16; a __nv_bfloat16 parameter takes
    its bits as a numpy.uint16 (numpy has no bfloat16)."""
    x = np.arange(-5, 6, dtype=np.float16) * np.float16(0.75)
    n = len(x)
    out = device(np.zeros(n, dtype=np.float16))
    bfloat_out = device(np.zeros(n, dtype=np.uint16))
    three = np.uint16(0x4040)  # 3.0 in bfloat16
    run(SIXTEEN_BIT_PARAMETERS, "scale", (1,), (32,), out, bfloat_out, device(x), np.float16(1.5), three, np.int32(n))
    np.testing.assert_array_equal(host(out), x * np.float16(1.5))
    np.testing.assert_array_equal(bfloat16_to_float(host(bfloat_out)), x.astype(np.float32) * 3)


NAN_AND_MODF = r"""
extern "C" __global__ void nan_and_modf(float* out, const float* x)
{
    float whole;
    out[0] = nanf("");
    out[1] = (float)nan("");
    out[2] = modff(x[0], &whole);
    out[3] = whole;
}
"""


def test_nanf_nan_and_modff():
    """nanf("") and nan("") are NaN (the bits may differ: CUDA's is 0x7fffffff, the C library's 0x7fc00000);
    modff splits a float into its fractional and whole parts, both with the sign of the input."""
    out = device(np.zeros(4, dtype=np.float32))
    run(NAN_AND_MODF, "nan_and_modf", (1,), (1,), out, device(np.array([-2.75], dtype=np.float32)))
    got = host(out)
    assert np.isnan(got[0]) and np.isnan(got[1])
    np.testing.assert_array_equal(got[2:], [-0.75, -2.0])


BFLOAT16_ARRAYS = r"""
#include <cuda_bf16.h>

extern "C" __global__ void scale_bfloat16(__nv_bfloat16* out, const __nv_bfloat16* x, float factor, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __float2bfloat16(__bfloat162float(x[i]) * factor);
}
"""


def test_bfloat16_arrays_of_ml_dtypes_pass_to_bfloat16_pointers(rng):
    """An array of ml_dtypes' bfloat16 (the dtype JAX and CuPy use) is a __nv_bfloat16* in a kernel, on both
    backends: each element widened, scaled in float32, rounded back; compared with ml_dtypes' own rounding of
    the float32 product. An array of uint16 holding the bits passes too; a float16 or float32 array does not."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.concatenate([rng.standard_normal(1000) * 10.0 ** rng.integers(-30, 30, 1000),
                        [np.inf, -np.inf, 0.0, -0.0, 3e38]]).astype(np.float32).astype(ml_dtypes.bfloat16)
    n = len(x)
    out = device(np.zeros(n, dtype=ml_dtypes.bfloat16))
    run(BFLOAT16_ARRAYS, "scale_bfloat16", ((n + 255) // 256,), (256,), out, device(x), np.float32(1.5), np.int32(n))
    with np.errstate(over="ignore"):
        expected = (x.astype(np.float32) * np.float32(1.5)).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(host(out).view(np.uint16), expected.view(np.uint16))

    bits_out = device(np.zeros(n, dtype=np.uint16))
    run(BFLOAT16_ARRAYS, "scale_bfloat16", ((n + 255) // 256,), (256,), bits_out, device(x.view(np.uint16)),
        np.float32(1.5), np.int32(n))
    np.testing.assert_array_equal(host(bits_out), expected.view(np.uint16))
    if backend.name == "cpu":  # CuPy passes any array's pointer; the executor refuses what would read as garbage
        with pytest.raises(TypeError, match="read as __nv_bfloat16"):
            run(BFLOAT16_ARRAYS, "scale_bfloat16", (1,), (32,), np.zeros(4, np.float16), np.zeros(4, np.float16),
                np.float32(1.0), np.int32(4))


# ---- float32 subnormals: flushed, as CuPy compiles every kernel with -ftz=true ---------------------------

FLUSHED_ARITHMETIC = r"""
extern "C" __global__ void float_arithmetic(unsigned* out, const float* a, const float* b, const float* c, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[4 * i] = __float_as_uint(a[i] + b[i]);
        out[4 * i + 1] = __float_as_uint(a[i] - b[i]);
        out[4 * i + 2] = __float_as_uint(a[i] * b[i]);
        out[4 * i + 3] = __float_as_uint(fmaf(a[i], b[i], c[i]));
    }
}
"""

SMALLEST_NORMAL = 2.0 ** -126
SUBNORMAL = 2.0 ** -149


def flushed(value):
    """A float32 value as a flushing GPU reads or writes it: a subnormal becomes a zero of its sign."""
    return math.copysign(0.0, value) if 0 < abs(value) < SMALLEST_NORMAL else value


def test_float32_subnormals_are_flushed_to_zeros_of_their_sign():
    """A subnormal float32 operand is read as a zero of its sign, and a subnormal result is written as one
    (measured on an H100: CuPy passes -ftz=true to NVRTC, and x - cvt.rna.tf32(x) of a subnormal x gave +0)."""
    cases = [(-SUBNORMAL, -0.0, 0.0), (SUBNORMAL, 0.0, 1.0), (SMALLEST_NORMAL, 0.5, 0.0), (-SMALLEST_NORMAL, 0.5, 0.0),
             (1.5 * SMALLEST_NORMAL, 2 * SMALLEST_NORMAL, SUBNORMAL), (3 * SUBNORMAL, 2.0 ** 100, 1.0),
             (SMALLEST_NORMAL, 1.0, -SMALLEST_NORMAL), (1.0, 2.0, 3.0)]
    a, b, c = (np.array(column, dtype=np.float32) for column in zip(*cases))
    out = backend.xp.zeros(4 * len(cases), dtype=np.uint32)
    backend.RawKernel(FLUSHED_ARITHMETIC, "float_arithmetic")((1,), (32,), (out, backend.xp.asarray(a),
                                                                            backend.xp.asarray(b),
                                                                            backend.xp.asarray(c), np.int32(len(cases))))
    got = backend.asnumpy(out).reshape(-1, 4)
    for row, (x, y, z) in zip(got, cases):
        x, y, z = flushed(x), flushed(y), flushed(z)
        # every exact result here is a float32 value, so rounding it is only the flush
        expected = [flushed(x + y), flushed(x - y), flushed(x * y), flushed(x * y + z)]
        assert row.tolist() == np.array(expected, dtype=np.float32).view(np.uint32).tolist(), (x, y, z)


# ---------------------------------------------------------------------------------------------------------
# Type punning: one object read through a pointer of another type, as kernels load 16 bytes at once
# ---------------------------------------------------------------------------------------------------------

TYPE_PUNNING = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>

extern "C" __global__ void type_punning(float* out, const __nv_bfloat16* bf16, const __half* half, const float* x)
{
    const uint4 bf16_bits = __ldcs(reinterpret_cast<const uint4*>(bf16));   // a local, read as 8 bf16
    const __nv_bfloat16* bf16_values = reinterpret_cast<const __nv_bfloat16*>(&bf16_bits);
    const uint4 half_bits = *reinterpret_cast<const uint4*>(half);          // and as 8 half
    const __half* half_values = reinterpret_cast<const __half*>(&half_bits);
    float floats[4];
    *reinterpret_cast<float4*>(floats) = *reinterpret_cast<const float4*>(x);   // a float4 into a float array
    unsigned words[4];
    *reinterpret_cast<float4*>(words) = *reinterpret_cast<const float4*>(x);    // and into unsigned words
    for (int i = 0; i < 8; ++i) {
        out[i] = __bfloat162float(bf16_values[i]);
        out[8 + i] = __half2float(half_values[i]);
    }
    for (int i = 0; i < 4; ++i) {
        out[16 + i] = floats[i];
        out[20 + i] = __uint_as_float(words[i]);
    }
}
"""


def test_an_object_read_through_a_pointer_of_another_type_gives_its_bytes(rng):
    """16 bytes loaded at once into a uint4 or a float4 and read as eight bf16, eight half or four floats give
    those bytes' values, as NVCC compiles such a kernel (the executor's compiler must not assume that a read
    through another type cannot see the write)."""
    import ml_dtypes
    bf16 = rng.normal(size=8).astype(ml_dtypes.bfloat16)
    half = rng.normal(size=8).astype(np.float16)
    x = rng.normal(size=4).astype(np.float32)
    out = backend.xp.zeros(24, dtype=np.float32)
    run(TYPE_PUNNING, "type_punning", (1,), (1,), out, device(bf16), device(half), device(x))
    expected = np.concatenate([bf16.astype(np.float32), half.astype(np.float32), x, x])
    np.testing.assert_array_equal(host(out), expected)
