"""Conformance: tensor cores through inline PTX, as the public tutorials write them.

mma.sync, ldmatrix, cp.async and cvt.rna.tf32.f32 in small kernels, each checked against float64 numpy.
Like tests/test_conformance.py these run on whichever backend is active: on a GPU they check our reading of
the PTX ISA, on the CPU that the executor behaves as the GPU does.

Exact where PTX defines the result (cvt.rna.tf32.f32, ldmatrix, cp.async move bits). Where it does not (the
order and precision of a tensor core's accumulation), D = A·B + C is checked within
    MMA_TOLERANCE · (|C| + Σ|A_ik·B_kj|)
of float64 on the inputs as the tensor core reads them (each product of two tf32, bf16 or f16 values is exact
in fp32). Each test also checks that its data tells the right answer from the likely wrong ones (another
fragment layout, TF32 rounded rather than truncated) by more than that tolerance.

bf16 travels as its bits in uint16 arrays (numpy has no bfloat16) and is decoded here with bit operations.
"""

import numpy as np
import pytest

from gpt2_cupy import backend
from gpt2_cupy.precision import tf32_split

# 8 fp32 units in the last place of the sum of magnitudes: far below what a wrong layout or wrong rounding
# of the inputs gives, above any order of fp32 accumulation of 16 terms.
MMA_TOLERANCE = 2.0 ** -20


def mma_reference(a, b, c):
    """(float64 A·B + C, its tolerance) for inputs already as the tensor core reads them."""
    a, b, c = (np.asarray(x, dtype=np.float64) for x in (a, b, c))
    return a @ b + c, MMA_TOLERANCE * (np.abs(a) @ np.abs(b) + np.abs(c))


def assert_mma_close(got, a, b, c, wrong_inputs=()):
    """got = A·B + C within the tolerance; and for each (a, b) in wrong_inputs, what those would give is
    further away than the tolerance (so that this data could catch that mistake)."""
    expected, tolerance = mma_reference(a, b, c)
    error = np.abs(got.astype(np.float64) - expected)
    assert np.all(error <= tolerance), f"largest error {error.max():.3g} where the tolerance is {tolerance.max():.3g}"
    for wrong_a, wrong_b in wrong_inputs:
        wrong, _ = mma_reference(wrong_a, wrong_b, c)
        assert np.any(np.abs(wrong - expected) > tolerance), "the data cannot tell this result from a wrong one"


def tf32_nearest_away(x):
    """float64 values of float32 x rounded to 10 mantissa bits, to nearest, ties away from zero (overflow to inf)."""
    x = np.asarray(x, dtype=np.float32).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        magnitude = np.floor(np.abs(x) / tf32_unit(x) + 0.5) * tf32_unit(x)
        magnitude = np.where(magnitude > (2.0 - 2.0 ** -10) * 2.0 ** 127, np.inf, magnitude)
    return np.where(np.isfinite(x), np.copysign(magnitude, x), x)


def tf32_toward_zero(x):
    """float64 values of float32 x with the mantissa cut to 10 bits."""
    x = np.asarray(x, dtype=np.float32).astype(np.float64)
    with np.errstate(invalid="ignore"):
        magnitude = np.floor(np.abs(x) / tf32_unit(x)) * tf32_unit(x)
    return np.where(np.isfinite(x), np.copysign(magnitude, x), x)


def tf32_unit(x):
    """The unit in the last place of TF32 (10 mantissa bits) at each float64 x; subnormals share the
    smallest normal number's."""
    _, exponent = np.frexp(x)
    return np.ldexp(1.0, np.maximum(exponent - 1, -126) - 10)


def bf16_bits(x):
    """The bf16 nearest (ties to even) each float32 of x, as uint16 bits."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_values(bits):
    """float64 values of bf16 bits."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


# ---------------------------------------------------------------------------------------------------------
# mma.sync m16n8k8, TF32: one tile, fragments loaded by hand (PTX ISA, "Matrix Fragments for mma.m16n8k8")
# ---------------------------------------------------------------------------------------------------------

MMA_TF32_TILE = r"""
extern "C" __global__ void mma_tf32_tile(const float* A, const float* B, const float* C, float* D, int round_inputs)
{
    // A is 16x8 row-major, B is 8x8 (k, n) row-major, C and D are 16x8 row-major; one warp.
    unsigned lane = threadIdx.x, group = lane >> 2, member = lane & 3;
    float a_values[4] = {A[group * 8 + member], A[(group + 8) * 8 + member],
                         A[group * 8 + member + 4], A[(group + 8) * 8 + member + 4]};
    float b_values[2] = {B[member * 8 + group], B[(member + 4) * 8 + group]};
    unsigned a[4], b[2];
    for (int i = 0; i < 4; ++i) {
        if (round_inputs) asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(a[i]) : "f"(a_values[i]));
        else a[i] = __float_as_uint(a_values[i]);
    }
    for (int i = 0; i < 2; ++i) {
        if (round_inputs) asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(b[i]) : "f"(b_values[i]));
        else b[i] = __float_as_uint(b_values[i]);
    }
    int row = group, column = 2 * member;
    float c[4] = {C[row * 8 + column], C[row * 8 + column + 1], C[(row + 8) * 8 + column], C[(row + 8) * 8 + column + 1]};
    float d[4];
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
                   "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
    D[row * 8 + column] = d[0];
    D[row * 8 + column + 1] = d[1];
    D[(row + 8) * 8 + column] = d[2];
    D[(row + 8) * 8 + column + 1] = d[3];
}
"""


def run_mma_tf32_tile(a, b, c, round_inputs, to_device, to_host):
    kernel = backend.RawKernel(MMA_TF32_TILE, "mma_tf32_tile")
    out = to_device(np.full((16, 8), np.nan, dtype=np.float32))
    kernel((1,), (32,), (to_device(a), to_device(b), to_device(c), out, np.int32(round_inputs)))
    return to_host(out)


def test_mma_m16n8k8_tf32_with_inputs_rounded_by_cvt_rna(rng, to_device, to_host):
    """D = A·B + C with A and B rounded to TF32 (cvt.rna.tf32.f32) in the kernel."""
    a, b = rng.uniform(-1, 1, (16, 8)).astype(np.float32), rng.uniform(-1, 1, (8, 8)).astype(np.float32)
    c = rng.uniform(-1, 1, (16, 8)).astype(np.float32)
    got = run_mma_tf32_tile(a, b, c, True, to_device, to_host)
    assert_mma_close(got, tf32_nearest_away(a), tf32_nearest_away(b), c,
                     wrong_inputs=[(tf32_toward_zero(a), tf32_toward_zero(b)), (a, b), (a[::-1], b)])


def test_mma_m16n8k8_tf32_ignores_the_low_13_bits_of_unconverted_inputs(rng, to_device, to_host):
    """fp32 bits passed to a .tf32 operand as they are: the tensor core reads the sign, exponent and top 10
    mantissa bits and ignores the other 13, so each input is cut toward zero (not rounded)."""
    a, b = rng.uniform(-1, 1, (16, 8)).astype(np.float32), rng.uniform(-1, 1, (8, 8)).astype(np.float32)
    c = rng.uniform(-1, 1, (16, 8)).astype(np.float32)
    got = run_mma_tf32_tile(a, b, c, False, to_device, to_host)
    assert_mma_close(got, tf32_toward_zero(a), tf32_toward_zero(b), c,
                     wrong_inputs=[(tf32_nearest_away(a), tf32_nearest_away(b)), (a, b)])


def test_mma_m16n8k8_tf32_places_every_element_where_ptx_says(to_device, to_host):
    """With A and B of one-hot rows and columns, each D element names the A row and B column it came from."""
    a = np.zeros((16, 8), dtype=np.float32)
    b = np.zeros((8, 8), dtype=np.float32)
    for row in range(16):
        a[row, row % 8] = row + 1          # exact in TF32
    for k in range(8):
        b[k, :] = 2.0 ** (k + 4) * np.arange(1, 9)
    c = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)  # integers: every sum has at most 19 bits, exact in fp32
    got = run_mma_tf32_tile(a, b, c, False, to_device, to_host)
    np.testing.assert_array_equal(got, (a.astype(np.float64) @ b + c).astype(np.float32))


# ---------------------------------------------------------------------------------------------------------
# cvt.rna.tf32.f32: bit-exact, ties away from zero
# ---------------------------------------------------------------------------------------------------------

CVT_RNA_TF32 = r"""
extern "C" __global__ void to_tf32(const float* x, unsigned* out, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        unsigned bits;
        asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(bits) : "f"(x[i]));
        out[i] = bits;
    }
}
"""

TF32_EDGE_CASES = {
    0x3F801000: "tie between 1 and 1 + 2^-10: away from zero, to 1 + 2^-10 (to even would give 1)",
    0xBF801000: "the same tie, negative",
    0x3F803000: "tie between 1 + 2^-10 and 1 + 2^-9 (both ways agree)",
    0x3F800FFF: "just below a tie",
    0x3F801001: "just above a tie",
    0x3FFFF000: "tie that carries into the exponent: 2",
    0x7F7FE000: "largest TF32 value",
    0x7F7FEFFF: "just below the tie past the largest value",
    0x7F7FF000: "tie past the largest value: infinity",
    0x7F7FFFFF: "largest float: infinity",
    0xFF7FFFFF: "most negative float: -infinity",
    0x7F800000: "infinity",
    0xFF800000: "-infinity",
    0x00000000: "zero",
    0x80000000: "-0 keeps its sign",
    0x00000001: "smallest subnormal: 0",
    0x00001000: "subnormal tie: away from zero",
    0x00001FFF: "subnormal above a tie",
    0x007FFFFF: "largest subnormal: rounds to the smallest normal",
    0x807FF000: "negative subnormal tie",
    0x00800000: "smallest normal",
}


def run_to_tf32(bits, to_device, to_host):
    kernel = backend.RawKernel(CVT_RNA_TF32, "to_tf32")
    x = np.asarray(bits, dtype=np.uint32).view(np.float32)
    out = to_device(np.zeros(x.size, dtype=np.uint32))
    kernel(((x.size + 127) // 128,), (128,), (to_device(x), out, np.int32(x.size)))
    return to_host(out)


def test_cvt_rna_tf32_edge_cases_bit_exact(to_device, to_host):
    """Ties, overflow, infinities, signed zeros and subnormals round to nearest, ties away from zero."""
    bits = np.array(list(TF32_EDGE_CASES), dtype=np.uint32)
    got = run_to_tf32(bits, to_device, to_host)
    expected = tf32_nearest_away(bits.view(np.float32)).astype(np.float32).view(np.uint32)
    for value, result, wanted in zip(bits, got, expected):
        assert result == wanted, f"{value:#010x} ({TF32_EDGE_CASES[int(value)]}): got {result:#010x}, expected {wanted:#010x}"
    assert expected[0] == 0x3F802000 and expected[8] == 0x7F800000  # the reference itself rounds ties away


def test_cvt_rna_tf32_random_bit_patterns_bit_exact(rng, to_device, to_host):
    """Every finite and infinite float32 class, at random: the result has 10 mantissa bits, rounded as numpy says."""
    bits = rng.integers(0, 2 ** 32, 20000, dtype=np.uint64).astype(np.uint32)
    bits = bits[~np.isnan(bits.view(np.float32))]
    got = run_to_tf32(bits, to_device, to_host)
    np.testing.assert_array_equal(got, tf32_nearest_away(bits.view(np.float32)).astype(np.float32).view(np.uint32))


def test_cvt_rna_tf32_of_nan_clears_the_low_bits_without_rounding(to_device, to_host):
    """PTX does not say which bits a NaN gives. Measured on an H200: the 13 low bits are cleared, with no
    rounding, so a NaN whose payload lies only in those bits becomes infinity."""
    bits = np.array([0x7FC00000, 0xFFC00001, 0x7F800001, 0x7FFFFFFF, 0xFF801000], dtype=np.uint32)
    got = run_to_tf32(bits, to_device, to_host)
    assert [hex(v) for v in got] == [hex(v) for v in bits & 0xFFFFE000]
    assert np.isinf(got.view(np.float32)[2])


# ---------------------------------------------------------------------------------------------------------
# ldmatrix: which lane receives which element (PTX ISA, "Warp-level matrix load instruction: ldmatrix")
# ---------------------------------------------------------------------------------------------------------

LDMATRIX = r"""
extern "C" __global__ void load_matrices(const unsigned short* matrices, unsigned* out)
{
    // Four 8x8 matrices of 16-bit values, each row 16 bytes, rows of matrix m at rows 8m..8m+7 of a padded tile.
    __shared__ __align__(16) unsigned short tile[32][8 + 8];
    unsigned lane = threadIdx.x;
    for (int i = lane; i < 32 * 8; i += 32) tile[i / 8][i % 8] = matrices[i];
    __syncwarp();
    unsigned row_address = __cvta_generic_to_shared(&tile[lane][0]);  // lane 8m + r: row r of matrix m
    unsigned r[4] = {0, 0, 0, 0};
    if (COUNT == 1)
        asm volatile("ldmatrix.sync.aligned.m8n8.x1" TRANS ".shared.b16 {%0}, [%1];" : "=r"(r[0]) : "r"(row_address));
    if (COUNT == 2)
        asm volatile("ldmatrix.sync.aligned.m8n8.x2" TRANS ".shared.b16 {%0, %1}, [%2];"
                     : "=r"(r[0]), "=r"(r[1]) : "r"(row_address));
    if (COUNT == 4)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4" TRANS ".shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(row_address));
    for (int m = 0; m < 4; ++m) out[lane * 4 + m] = r[m];
}
"""


@pytest.mark.parametrize("count", [1, 2, 4])
@pytest.mark.parametrize("transpose", [False, True])
def test_ldmatrix_gives_each_lane_its_elements(count, transpose, to_device, to_host):
    """Lane l receives, in register m, elements 2(l%4) and 2(l%4)+1 of row l/4 of matrix m (the lower one in
    the low 16 bits); with .trans, those of column l/4 (rows 2(l%4) and 2(l%4)+1)."""
    matrices = np.arange(4 * 8 * 8, dtype=np.uint16).reshape(4, 8, 8) + 0x100
    options = (f"-DCOUNT={count}", f"-DTRANS=\"{'.trans' if transpose else ''}\"")
    kernel = backend.RawKernel(LDMATRIX, "load_matrices", options=options)
    out = to_device(np.zeros((32, 4), dtype=np.uint32))
    kernel((1,), (32,), (to_device(matrices), out))
    assert_each_lane_got_its_elements(to_host(out), matrices, count, transpose)


def assert_each_lane_got_its_elements(got, matrices, count, transpose):
    """got[lane, m]: the register m of each lane after an ldmatrix of `count` of the 8x8 `matrices` (0 past count)."""
    lanes = np.arange(32)
    for m in range(count):
        seen = matrices[m].T if transpose else matrices[m]
        low, high = seen[lanes // 4, 2 * (lanes % 4)], seen[lanes // 4, 2 * (lanes % 4) + 1]
        np.testing.assert_array_equal(got[:, m], low.astype(np.uint32) | high.astype(np.uint32) << 16, err_msg=f"matrix {m}")
    np.testing.assert_array_equal(got[:, count:], 0)


# ---------------------------------------------------------------------------------------------------------
# mma.sync m16n8k16 and m16n8k8, bf16 and f16: fragments from padded shared memory through ldmatrix
# ---------------------------------------------------------------------------------------------------------

MMA_16BIT_TILE = r"""
// A is 16xK row-major, B is given transposed (8xK: row n holds column n of B, the ".col" layout) and C, D
// are 16x8 row-major, all 16-bit values as their bits; one warp. Rows are padded by 8 elements (16 bytes).
extern "C" __global__ void mma_tile(const unsigned short* A, const unsigned short* B_columns, const float* C, float* D)
{
    __shared__ __align__(16) unsigned short a_tile[16][K + 8];
    __shared__ __align__(16) unsigned short b_tile[8][K + 8];
    unsigned lane = threadIdx.x;
    for (int i = lane; i < 16 * K; i += 32) a_tile[i / K][i % K] = A[i];
    for (int i = lane; i < 8 * K; i += 32) b_tile[i / K][i % K] = B_columns[i];
    __syncwarp();
    unsigned a[4], b[2];
    int row = lane >> 2, column = 2 * (lane & 3);
    float c[4] = {C[row * 8 + column], C[row * 8 + column + 1], C[(row + 8) * 8 + column], C[(row + 8) * 8 + column + 1]};
    float d[4];
#if K == 16
    // A's four 8x8 quarters: rows 0-7 and 8-15 of columns 0-7, then of columns 8-15.
    unsigned a_row = __cvta_generic_to_shared(&a_tile[lane % 16][(lane / 16) * 8]);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(a_row));
    unsigned b_row = __cvta_generic_to_shared(&b_tile[lane % 8][((lane / 8) % 2) * 8]);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];" : "=r"(b[0]), "=r"(b[1]) : "r"(b_row));
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE ".f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
                   "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
#else
    unsigned a_row = __cvta_generic_to_shared(&a_tile[lane % 16][0]);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];" : "=r"(a[0]), "=r"(a[1]) : "r"(a_row));
    unsigned b_row = __cvta_generic_to_shared(&b_tile[lane % 8][0]);
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];" : "=r"(b[0]) : "r"(b_row));
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32." TYPE "." TYPE ".f32 "
                 "{%0, %1, %2, %3}, {%4, %5}, {%6}, {%7, %8, %9, %10};"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(b[0]), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
#endif
    D[row * 8 + column] = d[0];
    D[row * 8 + column + 1] = d[1];
    D[(row + 8) * 8 + column] = d[2];
    D[(row + 8) * 8 + column + 1] = d[3];
}
"""


def sixteen_bit(values, kind):
    """(uint16 bits, float64 values) of float values in bf16 or f16."""
    if kind == "bf16":
        bits = bf16_bits(values)
        return bits, bf16_values(bits)
    halves = np.asarray(values, dtype=np.float32).astype(np.float16)
    return halves.view(np.uint16), halves.astype(np.float64)


@pytest.mark.parametrize("k", [16, 8])
@pytest.mark.parametrize("kind", ["bf16", "f16"])
def test_mma_16_bit_inputs_from_ldmatrix(k, kind, rng, to_device, to_host):
    """D = A·B + C for m16n8k16 and m16n8k8 with bf16 or f16 A and B, loaded by ldmatrix.x4/x2/x1."""
    a_bits, a = sixteen_bit(rng.uniform(-2, 2, (16, k)), kind)
    b_bits, b = sixteen_bit(rng.uniform(-2, 2, (k, 8)), kind)
    c = rng.uniform(-1, 1, (16, 8)).astype(np.float32)
    kernel = backend.RawKernel(MMA_16BIT_TILE, "mma_tile", options=(f"-DK={k}", f'-DTYPE="{kind}"'))
    out = to_device(np.full((16, 8), np.nan, dtype=np.float32))
    kernel((1,), (32,), (to_device(a_bits), to_device(np.ascontiguousarray(b_bits.T)), to_device(c), out))
    assert_mma_close(to_host(out), a, b, c, wrong_inputs=[(a[::-1], b), (a, b[::-1]), (a[:, ::-1], b)])


# ---------------------------------------------------------------------------------------------------------
# cp.async: a double-buffered tile load (commit_group, wait_group 1), with the source size that zero-fills
# ---------------------------------------------------------------------------------------------------------

CP_ASYNC_DOUBLE_BUFFER = r"""
// 64 threads sum a vector of n floats in tiles of 256: thread t's result for tile j is the sum of elements
// t, t + 64, t + 128 and t + 192 of the tile, which other threads copied. The next tile is in flight while
// this one is summed. Elements past n are zero-filled by the copy's source size.
extern "C" __global__ void tile_sums(const float* x, float* sums, int n, int tiles)
{
    __shared__ __align__(16) float buffer[2][256];
    int t = threadIdx.x;
    auto issue = [&](int tile) {
        int first = tile * 256 + 4 * t;
        for (int part = 0; part < 16 / COPY_BYTES; ++part) {
            int element = first + part * (COPY_BYTES / 4);
            int valid = n - element < 0 ? 0 : (n - element > COPY_BYTES / 4 ? COPY_BYTES / 4 : n - element);
            unsigned destination = __cvta_generic_to_shared(&buffer[tile % 2][4 * t + part * (COPY_BYTES / 4)]);
            const float* source = valid > 0 ? x + element : x;
            asm volatile("cp.async." CACHE ".shared.global [%0], [%1], %2, %3;\n"
                         :: "r"(destination), "l"(source), "n"(COPY_BYTES), "r"(valid * 4));
        }
    };
    issue(0);
    asm volatile("cp.async.commit_group;\n" ::);
    for (int tile = 0; tile < tiles; ++tile) {
        if (tile + 1 < tiles) issue(tile + 1);
        asm volatile("cp.async.commit_group;\n" ::);
        asm volatile("cp.async.wait_group 1;\n" ::);  // all but the newest group have landed: this tile
        __syncthreads();
        const float* current = buffer[tile % 2];
        sums[tile * 64 + t] = ((current[t] + current[t + 64]) + current[t + 128]) + current[t + 192];
        __syncthreads();  // everyone has read this buffer before the next issue overwrites it
    }
}
"""


@pytest.mark.parametrize("cache, copy_bytes", [("cg", 16), ("ca", 16), ("ca", 8), ("ca", 4)])
def test_cp_async_double_buffered_tiles_with_zero_fill(cache, copy_bytes, rng, to_device, to_host):
    """Each tile arrives by its wait_group 1, and the bytes past the source size are zeros."""
    n, tiles = 5 * 256 - 37, 5
    x = rng.integers(-1000, 1000, n).astype(np.float32)  # integers: every sum is exact
    kernel = backend.RawKernel(CP_ASYNC_DOUBLE_BUFFER, "tile_sums",
                               options=(f"-DCOPY_BYTES={copy_bytes}", f'-DCACHE="{cache}"'))
    sums = to_device(np.full(tiles * 64, np.nan, dtype=np.float32))
    kernel((1,), (64,), (to_device(x), sums, np.int32(n), np.int32(tiles)))
    padded = np.concatenate([x, np.zeros(tiles * 256 - n, dtype=np.float32)]).reshape(tiles, 4, 64)
    np.testing.assert_array_equal(to_host(sums).reshape(tiles, 64), padded.sum(axis=1))


CP_ASYNC_READ_TOO_EARLY = r"""
extern "C" __global__ void read_before_wait(const float* x, float* before, float* after)
{
    __shared__ __align__(16) float staged[4];
    if (threadIdx.x == 0) {
        for (int i = 0; i < 4; ++i) staged[i] = -1.0f;
        unsigned destination = __cvta_generic_to_shared(staged);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(destination), "l"(x));
        asm volatile("cp.async.commit_group;\n" ::);
        for (int i = 0; i < 4; ++i) before[i] = staged[i];   // too early: the copy may not have landed
        asm volatile("cp.async.wait_all;\n" ::);
        for (int i = 0; i < 4; ++i) after[i] = staged[i];
    }
}
"""


@pytest.mark.cpu_only
def test_cp_async_lands_at_the_wait_on_the_cpu(to_device, to_host):
    """The executor makes each copy land at the wait that covers it, the latest moment a GPU allows: a read
    before the wait sees the old bytes (on a GPU it may see either), a read after it the new ones."""
    x = np.array([1, 2, 3, 4], dtype=np.float32)
    before, after = to_device(np.zeros(4, dtype=np.float32)), to_device(np.zeros(4, dtype=np.float32))
    backend.RawKernel(CP_ASYNC_READ_TOO_EARLY, "read_before_wait")((1,), (32,), (to_device(x), before, after))
    np.testing.assert_array_equal(to_host(before), [-1, -1, -1, -1])
    np.testing.assert_array_equal(to_host(after), x)


# ---------------------------------------------------------------------------------------------------------
# A whole product: 64x64x64 bf16 through a two-stage cp.async pipeline, ldmatrix and mma.sync
# ---------------------------------------------------------------------------------------------------------

GEMM_BF16 = r"""
// C = A·B for 64x64 bf16 A (row-major) and B (given by columns: B_columns[n][k]), fp32 C; 4 warps, each
// a 32x32 part of C as 2x4 tiles of 16x8. K goes by 32 through two shared-memory stages: A's are unpadded
// 64-byte rows whose 16-byte chunks are XOR-swizzled on the shared address, B's are padded by 16 bytes.
#define DEPTH 32
extern "C" __global__ void gemm_bf16(const unsigned short* A, const unsigned short* B_columns, float* C)
{
    __shared__ __align__(128) unsigned short a_stage[2][64][DEPTH];
    __shared__ __align__(16) unsigned short b_stage[2][64][DEPTH + 8];
    int t = threadIdx.x, warp = t / 32, lane = t % 32;
    unsigned a_base = __cvta_generic_to_shared(&a_stage[0][0][0]);
    auto a_address = [&](int stage, int row, int chunk) {
        unsigned address = a_base + (stage * 64 + row) * DEPTH * 2 + chunk * 16;
        return address ^ (((row >> 1) & 3) << 4);  // chunk c of row r is stored at chunk c ^ ((r / 2) % 4)
    };
    auto load = [&](int stage, int k0) {
        for (int piece = t; piece < 64 * 4; piece += 128) {
            int row = piece / 4, chunk = piece % 4;
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n"
                         :: "r"(a_address(stage, row, chunk)), "l"(A + row * 64 + k0 + chunk * 8));
            unsigned b_destination = __cvta_generic_to_shared(&b_stage[stage][row][chunk * 8]);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n"
                         :: "r"(b_destination), "l"(B_columns + row * 64 + k0 + chunk * 8));
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
    float acc[2][4][4] = {};
    int warp_row = (warp / 2) * 32, warp_column = (warp % 2) * 32;
    load(0, 0);
    for (int step = 0; step < 64 / DEPTH; ++step) {
        if (step + 1 < 64 / DEPTH) {
            load((step + 1) % 2, (step + 1) * DEPTH);
            asm volatile("cp.async.wait_group 1;\n" ::);
        } else {
            asm volatile("cp.async.wait_group 0;\n" ::);
        }
#ifndef FORGET_BARRIER
        __syncthreads();  // every thread's copies have landed, not only this thread's
#endif
        int stage = step % 2;
        for (int kk = 0; kk < DEPTH / 16; ++kk) {
            unsigned a[2][4], b[4][2];
            for (int mi = 0; mi < 2; ++mi)
                asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                             : "=r"(a[mi][0]), "=r"(a[mi][1]), "=r"(a[mi][2]), "=r"(a[mi][3])
                             : "r"(a_address(stage, warp_row + 16 * mi + lane % 16, 2 * kk + lane / 16)));
            for (int ni = 0; ni < 4; ++ni) {
                unsigned address = __cvta_generic_to_shared(
                    &b_stage[stage][warp_column + 8 * ni + lane % 8][16 * kk + ((lane / 8) % 2) * 8]);
                asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];"
                             : "=r"(b[ni][0]), "=r"(b[ni][1]) : "r"(address));
            }
            for (int mi = 0; mi < 2; ++mi)
                for (int ni = 0; ni < 4; ++ni)
                    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                                 : "+f"(acc[mi][ni][0]), "+f"(acc[mi][ni][1]), "+f"(acc[mi][ni][2]), "+f"(acc[mi][ni][3])
                                 : "r"(a[mi][0]), "r"(a[mi][1]), "r"(a[mi][2]), "r"(a[mi][3]),
                                   "r"(b[ni][0]), "r"(b[ni][1]));
        }
        __syncthreads();  // everyone is done with this stage before a later load overwrites it
    }
    for (int mi = 0; mi < 2; ++mi)
        for (int ni = 0; ni < 4; ++ni)
            for (int i = 0; i < 4; ++i)
                C[(warp_row + 16 * mi + lane / 4 + 8 * (i / 2)) * 64 + warp_column + 8 * ni + 2 * (lane % 4) + i % 2] = acc[mi][ni][i];
}
"""


def run_gemm_bf16(a_bits, b_bits, to_device, to_host, options=(), **checks):
    out = to_device(np.full((64, 64), np.nan, dtype=np.float32))
    kernel = backend.RawKernel(GEMM_BF16, "gemm_bf16", options=options)
    kernel((1,), (128,), (to_device(a_bits), to_device(np.ascontiguousarray(b_bits.T)), out), **checks)
    return to_host(out)


def test_gemm_64_bf16_through_cp_async_ldmatrix_and_mma(rng, to_device, to_host):
    """The tutorial kernel's whole path: swizzled and padded stages filled by cp.async, read by ldmatrix, and four
    chained m16n8k16 products per output tile (each rounds its sum to fp32: four times the one-tile tolerance)."""
    a_bits, b_bits = bf16_bits(rng.uniform(-1, 1, (64, 64))), bf16_bits(rng.uniform(-1, 1, (64, 64)))
    got = run_gemm_bf16(a_bits, b_bits, to_device, to_host)
    a, b = bf16_values(a_bits), bf16_values(b_bits)
    expected = a @ b
    tolerance = 4 * MMA_TOLERANCE * (np.abs(a) @ np.abs(b))
    error = np.abs(got - expected)
    assert np.all(error <= tolerance), f"largest error {error.max():.3g}"
    assert np.all(np.abs(a[:, ::-1] @ b - expected).max() > tolerance.max())


@pytest.mark.cpu_only
def test_gemm_64_bf16_passes_the_race_check(rng, to_device, to_host):
    """The executor's own bookkeeping (shared-memory windows, each thread's copy queue) is no race."""
    a_bits, b_bits = bf16_bits(rng.uniform(-1, 1, (64, 64))), bf16_bits(rng.uniform(-1, 1, (64, 64)))
    got = run_gemm_bf16(a_bits, b_bits, to_device, to_host, check_races=True, check_bounds=True)
    a, b = bf16_values(a_bits), bf16_values(b_bits)
    assert np.all(np.abs(got - a @ b) <= 4 * MMA_TOLERANCE * (np.abs(a) @ np.abs(b)))


@pytest.mark.cpu_only
def test_race_check_reports_reading_other_threads_copies_without_a_barrier(rng, to_device, to_host):
    """cp.async.wait_group waits for the calling thread's copies only: reading what other threads copied needs
    a __syncthreads() after the wait, and the race check says so."""
    from gpt2_cupy.cpu import RaceError
    a_bits, b_bits = bf16_bits(rng.uniform(-1, 1, (64, 64))), bf16_bits(rng.uniform(-1, 1, (64, 64)))
    with pytest.raises(RaceError, match="shared memory"):
        run_gemm_bf16(a_bits, b_bits, to_device, to_host, options=("-DFORGET_BARRIER",), check_races=True)


# ---------------------------------------------------------------------------------------------------------
# What the CPU executor refuses, and how it says so
# ---------------------------------------------------------------------------------------------------------

UNKNOWN_INSTRUCTION = r"""
extern "C" __global__ void fence(float* out)
{
    out[threadIdx.x] = 1.0f;
    asm volatile("tcgen05.fence::before_thread_sync;\n" ::: "memory");
}
"""

CLUSTER_BARRIER = r"""
extern "C" __global__ void hopper(float* out)
{
    float value = out[threadIdx.x];
    asm volatile("barrier.cluster.arrive;\n"
                 "barrier.cluster.wait;\n" ::: "memory");
    out[threadIdx.x] = value;
}
"""


@pytest.mark.cpu_only
@pytest.mark.parametrize("code, name, instruction, line", [(UNKNOWN_INSTRUCTION, "fence", "tcgen05.fence::before_thread_sync", 5),
                                                          (CLUSTER_BARRIER, "hopper", "barrier.cluster.arrive", 5)])
def test_unknown_ptx_instruction_is_a_compile_error_naming_it_and_its_line(code, name, instruction, line):
    from gpt2_cupy.cpu import CompileError
    with pytest.raises(CompileError) as caught:
        backend.RawKernel(code, name)((1,), (32,), (np.zeros(32, dtype=np.float32),))
    message = str(caught.value)
    assert f"kernel.cu:{line}:" in message and f"'{instruction}'" in message, message
    assert f"{line:4d} | " in message and "does not know" in message, message


@pytest.mark.cpu_only
def test_unknown_operand_is_a_compile_error():
    from gpt2_cupy.cpu import CompileError
    code = r"""
extern "C" __global__ void special(unsigned* out)
{
    unsigned value;
    asm("mov.u32 %0, %%smid;" : "=r"(value));
    out[threadIdx.x] = value;
}
"""
    with pytest.raises(CompileError, match=r"kernel.cu:5:.*PTX operand '%smid'"):
        backend.RawKernel(code, "special")((1,), (32,), (np.zeros(32, dtype=np.uint32),))


@pytest.mark.cpu_only
def test_mma_in_a_warp_of_fewer_than_32_threads_is_a_kernel_error(to_device):
    """mma.sync is .aligned: all 32 lanes take part. A block of 16 threads cannot run it."""
    from gpt2_cupy.cpu import KernelError
    a = np.ones((16, 8), dtype=np.float32)
    with pytest.raises(KernelError, match=r"kernel.cu:\d+.*mma.sync: all 32 lanes"):
        backend.RawKernel(MMA_TF32_TILE, "mma_tf32_tile")(
            (1,), (16,), (a, np.ones((8, 8), dtype=np.float32), a, np.zeros_like(a), np.int32(0)))


@pytest.mark.cpu_only
def test_ldmatrix_from_an_address_not_in_shared_memory_is_a_kernel_error():
    from gpt2_cupy.cpu import KernelError
    code = r"""
extern "C" __global__ void bad_address(unsigned* out)
{
    unsigned r;
    unsigned address = 0x12345670u;  // never produced by __cvta_generic_to_shared
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];" : "=r"(r) : "r"(address));
    out[threadIdx.x] = r;
}
"""
    with pytest.raises(KernelError, match="ldmatrix: a row address is not a shared-memory address"):
        backend.RawKernel(code, "bad_address")((1,), (32,), (np.zeros(32, dtype=np.uint32),))


# ---------------------------------------------------------------------------------------------------------
# The address idioms of CUTLASS-style code: cvta.to.shared in asm, .reg blocks, predicated copies
# ---------------------------------------------------------------------------------------------------------

CUTLASS_IDIOMS = r"""
__device__ unsigned shared_address(const void* pointer)
{
    unsigned address;
    asm("{\n"
        "  .reg .u64 address64;\n"
        "  cvta.to.shared.u64 address64, %1;\n"
        "  cvt.u32.u64 %0, address64;\n"
        "}\n" : "=r"(address) : "l"(pointer));
    return address;
}

__device__ void copy_if(unsigned destination, const void* source, bool wanted)
{
    asm volatile("{\n"
                 "  .reg .pred p;\n"
                 "  setp.ne.b32 p, %0, 0;\n"
                 "  @p cp.async.ca.shared.global [%1], [%2], 16;\n"
                 "}\n" :: "r"((int)wanted), "r"(destination), "l"(source));
}

extern "C" __global__ void guarded_copies(const float* x, float* out)
{
    __shared__ __align__(16) float staged[32][4];
    int t = threadIdx.x;
    for (int i = 0; i < 4; ++i) staged[t][i] = -1.0f;
    copy_if(shared_address(&staged[t][0]), x + 4 * t, t % 3 != 0);
    asm volatile("cp.async.wait_all;\n" ::);
    __syncthreads();
    for (int i = 0; i < 4; ++i) out[4 * t + i] = staged[31 - t][i];
}
"""


def test_cvta_to_shared_and_predicated_cp_async(rng, to_device, to_host):
    """A shared address made by cvta.to.shared in a .reg block, and cp.async under a setp predicate:
    threads whose predicate is false copy nothing."""
    x = rng.integers(0, 100, 128).astype(np.float32)
    out = to_device(np.zeros(128, dtype=np.float32))
    backend.RawKernel(CUTLASS_IDIOMS, "guarded_copies")((1,), (32,), (to_device(x), out))
    staged = np.where((np.arange(32) % 3 != 0)[:, None], x.reshape(32, 4), -1)
    np.testing.assert_array_equal(to_host(out).reshape(32, 4), staged[::-1])


def test_inline_ptx_in_an_included_header_runs_and_its_errors_name_the_header(tmp_path, rng, to_device, to_host):
    """The asm wrappers of a header on the include path (as kernels/include/ holds them) run as the kernel's
    own do; an instruction the executor does not know is reported at the header's line."""
    (tmp_path / "tf32.cuh").write_text(
        "__device__ __forceinline__ unsigned int to_tf32_bits(float x)\n{\n    unsigned int bits;\n"
        '    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(bits) : "f"(x));\n    return bits;\n}\n')
    code = ('#include "tf32.cuh"\nextern "C" __global__ void through_header(unsigned int* out, const float* x, int n)\n'
            "{\n    int i = blockIdx.x * blockDim.x + threadIdx.x;\n    if (i < n) out[i] = to_tf32_bits(x[i]);\n}\n")
    x = rng.normal(size=1000).astype(np.float32)
    out = to_device(np.zeros(x.size, dtype=np.uint32))
    backend.RawKernel(code, "through_header", options=(f"-I{tmp_path}",))((8,), (128,), (out, to_device(x), np.int32(x.size)))
    np.testing.assert_array_equal(to_host(out), tf32_nearest_away(x).astype(np.float32).view(np.uint32))

    if backend.name == "cpu":
        from gpt2_cupy.cpu import CompileError

        (tmp_path / "unknown.cuh").write_text('__device__ void fence() {\n    asm volatile("tcgen05.fence::before_thread_sync;");\n}\n')
        unknown = '#include "unknown.cuh"\nextern "C" __global__ void k() { fence(); }\n'
        with pytest.raises(CompileError, match=r"unknown\.cuh:2: error: .*tcgen05\.fence::before_thread_sync"):
            backend.RawKernel(unknown, "k", options=(f"-I{tmp_path}",))((1,), (32,), ())


SPLIT_TF32 = r"""
#include "mma.cuh"
extern "C" __global__ void split(unsigned* big, unsigned* small, const float* x, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        unsigned b, s;
        split_tf32(x[i], b, s);
        big[i] = b;
        small[i] = s;
    }
}
"""


def test_split_tf32_of_subnormals_flushes_as_a_gpu_does(rng, to_device, to_host):
    """3xTF32's split (mma.cuh's split_tf32: big = cvt.rna(x), small = cvt.rna(x - big)) where x or x - big is
    subnormal: cvt.rna reads a subnormal whole, the subtraction reads and writes one as a zero of its sign
    (CuPy's -ftz=true). gpt2_cupy.precision.tf32_split models both; on an H100 it matched 216384 such values."""
    sign = rng.integers(0, 2, 6000).astype(np.uint32) << 31
    subnormals = rng.integers(1, 0x800000, 3000, dtype=np.uint64).astype(np.uint32)
    near_smallest_normal = rng.integers(0x800000, 0x1800000, 3000, dtype=np.uint64).astype(np.uint32)
    bits = np.concatenate([subnormals, near_smallest_normal]) | sign
    x = bits.view(np.float32)
    big, small = (to_device(np.zeros(x.size, dtype=np.uint32)) for _ in range(2))
    backend.RawKernel(SPLIT_TF32, "split")(((x.size + 255) // 256,), (256,), (big, small, to_device(x), np.int32(x.size)))
    expected_big, expected_small = (v.astype(np.float32).view(np.uint32) for v in tf32_split(x))
    np.testing.assert_array_equal(to_host(big), expected_big)
    np.testing.assert_array_equal(to_host(small), expected_small)
    assert np.any((to_host(small) == 0) & (np.abs(x.astype(np.float64) - expected_big.view(np.float32)) > 0))
