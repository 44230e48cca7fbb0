// The fragments of mma.sync.m16n8k16 in bf16 (mma.cuh), read straight from row-major (rows, D) bf16 matrices
// in global memory, as chapter 16b's attention steps read Q, K, V and dO. Lane 4g + t of a warp holds, of an
// A fragment, rows g and g + 8 at columns 2t, 2t + 1 and 2t + 8, 2t + 9; of a B fragment whose k index runs
// along a matrix's rows, that row's two neighbours (one 32-bit load); whose k index runs down a column, two
// 16-bit loads. Rows at or past `rows` read as zeros, so a ragged T needs no other special case.
#ifndef GPT2_CUPY_BF16_FRAGMENTS_CUH
#define GPT2_CUPY_BF16_FRAGMENTS_CUH

// Two neighbouring bf16 of `row` (columns col, col + 1) as one register, the lower column in the low half.
template <int D>
__device__ __forceinline__ unsigned row_pair(const unsigned short* matrix, int row, int col, int rows)
{
    return row < rows ? *reinterpret_cast<const unsigned*>(matrix + (long long)row * D + col) : 0u;
}

// Two bf16 of one column (rows row, row + 1) as one register, the lower row in the low half.
template <int D>
__device__ __forceinline__ unsigned column_pair(const unsigned short* matrix, int row, int col, int rows)
{
    unsigned low = row < rows ? matrix[(long long)row * D + col] : 0u;
    unsigned high = row + 1 < rows ? matrix[(long long)(row + 1) * D + col] : 0u;
    return low | (high << 16);
}

// The A fragments of the strip of 16 rows from row0, all D columns: D / 16 fragments of 16 x 16.
template <int D>
__device__ __forceinline__ void strip_fragments(unsigned (&a)[D / 16][4], const unsigned short* matrix, int row0, int rows)
{
    int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    for (int s = 0; s < D / 16; ++s) {
        for (int i = 0; i < 4; ++i) {   // a[0]: (g, 2t)  a[1]: (g + 8, 2t)  a[2]: (g, 2t + 8)  a[3]: (g + 8, 2t + 8)
            a[s][i] = row_pair<D>(matrix, row0 + g + 8 * (i % 2), 16 * s + 2 * t + 8 * (i / 2), rows);
        }
    }
}

// Two floats as one register of two bf16, each rounded to nearest with ties to even (finite values), `low`
// in the low half: the order of an A fragment's pair, so an accumulator's (c[0], c[1]) becomes one register.
__device__ __forceinline__ unsigned bf16_pair(float low, float high)
{
    unsigned l = __float_as_uint(low), h = __float_as_uint(high);
    return ((l + 0x7FFFu + ((l >> 16) & 1u)) >> 16) | (((h + 0x7FFFu + ((h >> 16) & 1u)) >> 16) << 16);
}

#endif  // GPT2_CUPY_BF16_FRAGMENTS_CUH
