"""Conformance of inline PTX as CUTLASS, LeetCUDA and ggml write it, beside the forms of
tests/test_conformance_tensor_cores.py:

- ldmatrix with its qualifiers in CUTLASS's order (`ldmatrix.sync.aligned.x4.trans.m8n8.shared.b16`), which ptxas
  takes as it takes the PTX ISA's (`...m8n8.x4.trans.shared.b16`): both orders load the same registers;
- stmatrix (sm_90), ldmatrix's store, in both orders, as LeetCUDA's and CUTLASS's epilogues write it;
- mma.sync m16n8k16 and m16n8k8 with f16 accumulators (`.f16.f16.f16.f16`: C and D two halves to a register).

Each kernel runs on the active backend; the results are compared with numpy, exactly (the inputs are small
integers, whose products and sums f16 holds exactly, whatever the tensor core's order of accumulation).
"""

import numpy as np
import pytest

from gpt2_cupy import backend
from test_conformance_tensor_cores import assert_each_lane_got_its_elements

# Four 8x8 matrices of 16-bit values in shared memory; lane 8m + r gives the address of row r of matrix m, and
# each lane writes out the four registers it receives. LOAD is the ldmatrix instruction, as written.
LDMATRIX = r"""
extern "C" __global__ void load_matrices(const unsigned short* matrices, unsigned* out)
{
    __shared__ __align__(16) unsigned short tile[32][8];
    const unsigned lane = threadIdx.x;
    for (int i = lane; i < 32 * 8; i += 32) tile[i / 8][i % 8] = matrices[i];
    __syncwarp();
    const unsigned row_address = __cvta_generic_to_shared(&tile[lane][0]);
    unsigned r[4] = {0, 0, 0, 0};
#if COUNT == 1
    asm volatile(LOAD " {%0}, [%1];" : "=r"(r[0]) : "r"(row_address));
#elif COUNT == 2
    asm volatile(LOAD " {%0, %1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(row_address));
#else
    asm volatile(LOAD " {%0, %1, %2, %3}, [%4];" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(row_address));
#endif
    for (int m = 0; m < 4; ++m) out[lane * 4 + m] = r[m];
}
"""

# (the instruction as CUTLASS writes it, registers, transposed)
CUTLASS_ORDER = [
    ("ldmatrix.sync.aligned.x1.m8n8.shared.b16", 1, False),
    ("ldmatrix.sync.aligned.x2.m8n8.shared.b16", 2, False),
    ("ldmatrix.sync.aligned.x4.m8n8.shared.b16", 4, False),
    ("ldmatrix.sync.aligned.x1.trans.m8n8.shared.b16", 1, True),
    ("ldmatrix.sync.aligned.x2.trans.m8n8.shared.b16", 2, True),
    ("ldmatrix.sync.aligned.x4.trans.m8n8.shared.b16", 4, True),
]


@pytest.mark.parametrize("instruction, count, transpose", CUTLASS_ORDER, ids=[i for i, _, _ in CUTLASS_ORDER])
def test_ldmatrix_in_cutlass_order_loads_what_the_isa_order_loads(instruction, count, transpose, to_device, to_host):
    """Lane l receives, in register m, elements 2(l%4) and 2(l%4)+1 of row l/4 of matrix m (the lower in the low
    16 bits); with .trans, those of column l/4."""
    matrices = np.arange(4 * 8 * 8, dtype=np.uint16).reshape(4, 8, 8) + 0x100
    kernel = backend.RawKernel(LDMATRIX, "load_matrices", options=(f"-DCOUNT={count}", f'-DLOAD="{instruction}"'))
    out = to_device(np.zeros((32, 4), dtype=np.uint32))
    kernel((1,), (32,), (to_device(matrices), out))
    assert_each_lane_got_its_elements(to_host(out), matrices, count, transpose)


# Each lane stores registers that say who holds them (matrix m, lane l, half i: (m << 12) | (l << 4) | i) with
# STORE, lane 8m + r giving the address of row r of matrix m; the shared tile, all ones before, is copied out.
STMATRIX = r"""
extern "C" __global__ void store_matrices(unsigned short* out)
{
    __shared__ __align__(16) unsigned short tile[32][8];
    const unsigned lane = threadIdx.x;
    for (int i = lane; i < 32 * 8; i += 32) tile[i / 8][i % 8] = 0xffff;
    __syncwarp();
    unsigned r[4];
    for (int m = 0; m < 4; ++m) r[m] = (m << 12 | lane << 4) | (m << 12 | lane << 4 | 1) << 16;
    const unsigned row_address = __cvta_generic_to_shared(&tile[lane][0]);
#if COUNT == 1
    asm volatile(STORE " [%0], {%1};" :: "r"(row_address), "r"(r[0]));
#elif COUNT == 2
    asm volatile(STORE " [%0], {%1, %2};" :: "r"(row_address), "r"(r[0]), "r"(r[1]));
#else
    asm volatile(STORE " [%0], {%1, %2, %3, %4};" :: "r"(row_address), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]));
#endif
    __syncwarp();
    for (int i = lane; i < 32 * 8; i += 32) out[i] = tile[i / 8][i % 8];
}
"""

STMATRIX_FORMS = [(f"stmatrix.sync.aligned.{order}.b16", count, transpose)
                  for count in (1, 2, 4) for transpose in (False, True)
                  for order in (f"m8n8.x{count}{'.trans' if transpose else ''}.shared",      # the PTX ISA's
                                f"x{count}{'.trans' if transpose else ''}.m8n8.shared")]     # CUTLASS's


@pytest.mark.parametrize("instruction, count, transpose", STMATRIX_FORMS, ids=[i for i, _, _ in STMATRIX_FORMS])
def test_stmatrix_stores_where_ldmatrix_loads(instruction, count, transpose, to_device, to_host):
    """Element (r, c) of matrix m comes from lane 4r + c/2, half c%2 of its register m; with .trans element (r, c)
    from lane 4c + r/2, half r%2. Matrices past the count are not written."""
    kernel = backend.RawKernel(STMATRIX, "store_matrices", options=(f"-DCOUNT={count}", f'-DSTORE="{instruction}"'))
    out = to_device(np.zeros(32 * 8, dtype=np.uint16))
    kernel((1,), (32,), (out,))
    expected = np.full((4, 8, 8), 0xffff, dtype=np.uint16)
    for m in range(count):
        for r in range(8):
            for c in range(8):
                lane, half = (4 * c + r // 2, r % 2) if transpose else (4 * r + c // 2, c % 2)
                expected[m, r, c] = m << 12 | lane << 4 | half
    np.testing.assert_array_equal(to_host(out).reshape(4, 8, 8), expected)


# D = A·B + C for one m16n8kK tile with f16 A, B, C and D, one warp. A is 16xK row-major, B is given transposed
# (8xK: row n holds column n of B, the ".col" layout), C and D are 16x8 row-major; all f16, as their bits. The
# fragments are built from the layout the PTX ISA gives (group = lane / 4, member = lane % 4): A's register i
# holds row group + 8 (i % 2), columns 2 member + 8 (i / 2) and the next; B's register i rows (k) 2 member + 8 i
# and the next of column group; C's and D's register i row group + 8 i, columns 2 member and the next.
MMA_HALF_ACCUMULATORS = r"""
__device__ unsigned pair(const unsigned short* low, const unsigned short* high)
{
    return (unsigned)*low | (unsigned)*high << 16;
}

extern "C" __global__ void mma_half(const unsigned short* A, const unsigned short* B_columns,
                                    const unsigned short* C, unsigned short* D)
{
    const int lane = threadIdx.x, group = lane / 4, member = lane % 4;
    unsigned a[4], b[2], c[2], d[2];
    for (int i = 0; i < K / 4; ++i) {
        const unsigned short* at = A + (group + 8 * (i % 2)) * K + 2 * member + 8 * (i / 2);
        a[i] = pair(at, at + 1);
    }
    for (int i = 0; i < K / 8; ++i) {
        const unsigned short* at = B_columns + group * K + 2 * member + 8 * i;
        b[i] = pair(at, at + 1);
    }
    for (int i = 0; i < 2; ++i) c[i] = pair(C + (group + 8 * i) * 8 + 2 * member, C + (group + 8 * i) * 8 + 2 * member + 1);
#if K == 16
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16 {%0, %1}, {%2, %3, %4, %5}, {%6, %7}, {%8, %9};"
                 : "=r"(d[0]), "=r"(d[1])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(c[0]), "r"(c[1]));
#else
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f16.f16.f16.f16 {%0, %1}, {%2, %3}, {%4}, {%5, %6};"
                 : "=r"(d[0]), "=r"(d[1]) : "r"(a[0]), "r"(a[1]), "r"(b[0]), "r"(c[0]), "r"(c[1]));
#endif
    for (int i = 0; i < 2; ++i) {
        D[(group + 8 * i) * 8 + 2 * member] = (unsigned short)d[i];
        D[(group + 8 * i) * 8 + 2 * member + 1] = (unsigned short)(d[i] >> 16);
    }
}
"""


@pytest.mark.parametrize("k", [16, 8])
def test_mma_with_f16_accumulators(k, rng, to_device, to_host):
    a = rng.integers(-4, 5, (16, k)).astype(np.float16)
    b = rng.integers(-4, 5, (k, 8)).astype(np.float16)
    c = (rng.integers(-64, 65, (16, 8)) / 4).astype(np.float16)  # quarters: the sums stay exact in f16
    kernel = backend.RawKernel(MMA_HALF_ACCUMULATORS, "mma_half", options=(f"-DK={k}",))
    out = to_device(np.full((16, 8), 0x7e00, dtype=np.uint16))  # NaN until written
    kernel((1,), (32,), (to_device(a.view(np.uint16)), to_device(np.ascontiguousarray(b.T).view(np.uint16)),
                         to_device(c.view(np.uint16)), out))
    got = to_host(out).view(np.float16).astype(np.float64)
    expected = a.astype(np.float64) @ b.astype(np.float64) + c.astype(np.float64)
    np.testing.assert_array_equal(got, expected)
    # the data tells the layout from its likely mistakes: A's halves or B's rows swapped
    assert not np.array_equal(expected, a[::-1].astype(np.float64) @ b.astype(np.float64) + c)
    assert not np.array_equal(expected, a.astype(np.float64) @ b[::-1].astype(np.float64) + c)


@pytest.mark.cpu_only
def test_an_ldmatrix_qualifier_given_twice_is_refused_with_the_forms_it_runs():
    from gpt2_cupy.cpu import CompileError
    kernel = backend.RawKernel(LDMATRIX, "load_matrices",
                               options=("-DCOUNT=1", '-DLOAD="ldmatrix.sync.aligned.x1.x1.m8n8.shared.b16"'))
    with pytest.raises(CompileError, match=r"ldmatrix\.sync\.aligned\.x1\.x1.*It runs:.*any order"):
        kernel.compile()
