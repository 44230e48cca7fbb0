// Attention on tensor cores, FlashAttention-2 style: forward and backward, causal or not, with grouped-query
// attention, float32 sums and softmax, in one of three formats:
//   bf16     bf16 inputs and outputs; the tensor cores multiply them as they are
//   TF32     float32 inputs and outputs, which the tensor cores read as TF32 (10 of float32's 23 mantissa bits)
//   3xTF32   float32 inputs and outputs at float32's accuracy: each operand x is split into two TF32 values,
//            big = x rounded to TF32 and small = the rest rounded to TF32, and each product of two is made of
//            three on the tensor cores, small·big + big·small + big·big (small·small is below float32's
//            precision): three times TF32's tensor work
// Each kernel takes Element, its storage type (bfloat16 or float), and Format, how it multiplies: Element itself
// for bf16 and TF32, Tf32x3 for 3xTF32 (float storage). The tensors, with Element as the storage type:
//   q, out, dout, dq: (B, H, T, D) Element;  k, v, dk, dv: (B, H_kv, T, D) Element;  lse, row_dot: (B, H, T) float32.
// Each Element tensor is given as the array that holds it and a HeadLayout (below) that says where in it the
// tensor lies: contiguous (B, H, T, D) is one layout; q, k, v sliced from one (B, T, 3 H D) product's output
// and out written into a (B, T, H D) array are others, read and written where they lie, without a copy.
// Query head h reads key and value head h / (H / H_kv) of the same batch element (H_kv = H: one each).
// S = scale q kᵀ, P = softmax(S) over the visible keys (causal: query t sees keys 0..t), out = P v, and
// lse = log Σ_j e^S of each row, which the backward uses to recompute P. Grid: blockIdx.x is the head (the
// query head b H + h, or for the dk, dv pass the key/value head b H_kv + h_kv), blockIdx.y a tile of rows.
//
// Every product runs in steps of a warp-wide 16 x 8 += 16 x 16 · 16 x 8 (Fragments<Format>, below): one
// mma.sync.m16n8k16 in bf16, two mma.sync.m16n8k8 in TF32, six in 3xTF32 (kernels/include/mma.cuh).
// A warp owns 16 rows of each product: queries in the forward and in the dq pass, keys in the dk, dv pass.
// A block of WARPS warps owns 16 WARPS rows and walks along the other axis a tile at a time.
//  - Tiles live in shared memory as [row][D + PADDING] Element, as in global memory plus 16 bytes (bf16) or 32
//    (float), so that the rows a warp reads at once start on different banks.
//  - They arrive by cp.async, two stages: the next tile is in flight while the warps multiply this one.
//  - A fragments are read from tiles stored as A's rows; B fragments from tiles stored as B's columns (K in
//    Q Kᵀ) or as B's rows (V in P V). The forward reads its queries' fragments once and keeps them in
//    registers (3xTF32's reads them again for each key tile: KEEP_QUERIES); the backward reads its A
//    fragments again for each tile, where registers are short (the dk, dv pass holds two 16 x D sums).
//  - The FlashAttention-2 trick: the float32 result fragments of two neighbouring 16 x 8 products (S, or
//    P after the softmax) hold, lane for lane, exactly the elements of the A fragment of the next 16 x 16
//    step. P is rounded to the input format (3xTF32: split into its two parts) in registers and multiplied
//    by V without a trip through shared memory.
//  - The dk, dv pass computes the transposed products, Sᵀ = K Qᵀ and dPᵀ = V dOᵀ, so that its 16 keys are
//    the rows of the result and Pᵀ, dSᵀ are again A fragments for dV += Pᵀ dO and dK += dSᵀ Q.
// Exponentials are exp2f of scores in log2 units: e^(x - m) = 2^(x log2 e - m log2 e).
// Deterministic: every output element is summed by one thread in a fixed order, no atomics, so the bits
// are the same on every run; dk and dv of a key/value head are summed over the query heads of its group
// one after the other by the same block.
#include <cuda_bf16.h>
#include <math_constants.h>   // CUDART_L2E_F = log2(e), CUDART_LN2_F = ln(2), as floats
#include "mma.cuh"
#include "special_values.cuh"
#include "storage.cuh"
#include "warp.cuh"

typedef __nv_bfloat16 bfloat16;

// The key/value head that query head `head` (b * heads + h) reads: head h / (heads / kv_heads) of batch b.
__device__ __forceinline__ long long kv_head_of(long long head, int heads, int kv_heads)
{
    return head / heads * kv_heads + head % heads / (heads / kv_heads);
}

// Where a (B, heads, T, D) tensor's elements lie in its array: head h of batch element b starts at element
// offset + b batch + h head, its rows are `row` elements apart, and each row's D elements are contiguous.
// The offset and the strides are multiples of 16 bytes, so that every row starts on 16 bytes, as cp.async's
// copies need.
struct HeadLayout {
    long long offset, batch, head, row;

    // The first element of head number `index` (b heads + h).
    __device__ __forceinline__ long long start(long long index, int heads) const
    {
        return offset + index / heads * batch + index % heads * head;
    }
};

// Start copying rows first_row .. first_row + ROWS - 1 of a (T, D) matrix whose rows are row_stride elements
// apart into a shared tile whose rows are STRIDE apart, 16 bytes per cp.async; rows at or past T become
// zeros (a copy that reads 0 bytes fills its 16 with zeros).
template <int ROWS, int D, int STRIDE, int THREADS, typename Element>
__device__ __forceinline__ void copy_rows_async(Element* tile, const Element* matrix, long long row_stride,
                                                int first_row, int T)
{
    constexpr int PER_COPY = 16 / sizeof(Element), COPIES_PER_ROW = D / PER_COPY;
#pragma unroll
    for (int copy = threadIdx.x; copy < ROWS * COPIES_PER_ROW; copy += THREADS) {
        const int row = copy / COPIES_PER_ROW, column = copy % COPIES_PER_ROW * PER_COPY;
        const bool inside = first_row + row < T;
        const Element* source = inside ? matrix + (first_row + row) * row_stride + column : matrix;
        cp_async_16(shared_address(tile + row * STRIDE + column), source, inside ? 16 : 0);
    }
}

// The same for COUNT floats first .. first + COUNT - 1 of a length-T vector, 4 bytes per copy.
template <int COUNT, int THREADS>
__device__ __forceinline__ void copy_floats_async(float* tile, const float* vector, int first, int T)
{
    for (int i = threadIdx.x; i < COUNT; i += THREADS) {
        const bool inside = first + i < T;
        cp_async_4(shared_address(tile + i), inside ? vector + first + i : vector, inside ? 4 : 0);
    }
}

// How a warp reads and multiplies tiles in each format, one 16 x 16 step of k at a time:
//   rows(a, tile, k0)                 the A fragment of 16 rows of a tile, columns k0 .. k0 + 15
//   columns(b, tile, k0)              B fragments of two n8 tiles (n = 0..7, 8..15) at k = k0 .. k0 + 15 from a
//                                     tile whose rows are B's columns (K's rows are the columns of Kᵀ)
//   columns_transposed(b, tile, n0)   the same from a tile whose rows are B's rows (V in P V: 16 keys are k,
//                                     head dimensions n0 .. n0 + 15 are n)
//   multiply(first, second, a, b)     first += a b (n = 0..7), second += a b (n = 8..15)
//   weights(a, left, right)           the A fragment made of two neighbouring 16 x 8 float32 results: left
//                                     (columns 0..7) and right (8..15), rounded to the input format (3xTF32:
//                                     as they are, for multiply to split)
//   KEEP_QUERIES                      whether the forward keeps its queries' A fragments in registers from one
//                                     key tile to the next
// STRIDE is the tile's row stride in elements. Fragment element names: g = lane / 4, t = lane % 4.
template <typename Format>
struct Fragments;

// bf16: ldmatrix reads 8 rows of 16 bytes at once; lane 8q + r names row r of ldmatrix's matrix q. Rows D / 8
// + 1 (an odd number of) 16-byte groups apart start on 8 different groups of 4 banks (of the 8 a 128-byte
// line has), so the 8 rows are read in one pass. The fragments are mma.cuh's mma_m16n8k16_bf16's.
template <>
struct Fragments<bfloat16> {
    static constexpr int PADDING = 8;        // bf16 after each row: 16 bytes
    static constexpr int A = 4, B = 4;       // registers of an A fragment, of two n8 tiles' B fragments
    static constexpr bool KEEP_QUERIES = true;   // the forward reads its queries' A fragments once

    // Matrices q = rows 0-7 and 8-15 at k0, then at k0 + 8: a[0] = (g, 2t..2t+1), a[1] = (g + 8, ..), a[2],
    // a[3] at k + 8.
    template <int STRIDE>
    static __device__ __forceinline__ void rows(unsigned (&a)[A], const bfloat16* tile, int k0)
    {
        const int lane = threadIdx.x % 32;
        ldmatrix_x4(a, shared_address(tile + (lane % 16) * STRIDE + k0 + lane / 16 * 8));
    }

    // Matrices q = rows 0-7 at k0 and k0 + 8, then rows 8-15 at k0 and k0 + 8. b[0] = (2t..2t+1, g): row g,
    // elements 2t, 2t+1.
    template <int STRIDE>
    static __device__ __forceinline__ void columns(unsigned (&b)[B], const bfloat16* tile, int k0)
    {
        const int lane = threadIdx.x % 32;
        ldmatrix_x4(b, shared_address(tile + (lane / 16 * 8 + lane % 8) * STRIDE + k0 + lane / 8 % 2 * 8));
    }

    // ldmatrix.trans hands each lane two neighbours down a column: rows 2t and 2t + 1 of column g.
    template <int STRIDE>
    static __device__ __forceinline__ void columns_transposed(unsigned (&b)[B], const bfloat16* tile, int n0)
    {
        const int lane = threadIdx.x % 32;
        ldmatrix_x4_trans(b, shared_address(tile + (lane / 8 % 2 * 8 + lane % 8) * STRIDE + n0 + lane / 16 * 8));
    }

    static __device__ __forceinline__ void multiply(float (&first)[4], float (&second)[4], const unsigned (&a)[A],
                                                    const unsigned (&b)[B])
    {
        const unsigned b_first[2] = {b[0], b[1]}, b_second[2] = {b[2], b[3]};
        mma_m16n8k16_bf16(first, a, b_first);
        mma_m16n8k16_bf16(second, a, b_second);
    }

    // a[0] = (g, 2t..2t+1) is elements 0, 1 of left, a[1] = (g + 8, 2t..2t+1) its elements 2, 3, and a[2],
    // a[3] the same of right; each pair rounded to bf16 (to nearest, ties to even), the first in the low half.
    static __device__ __forceinline__ void weights(unsigned (&a)[A], const float (&left)[4], const float (&right)[4])
    {
        a[0] = pair(left[0], left[1]);
        a[1] = pair(left[2], left[3]);
        a[2] = pair(right[0], right[1]);
        a[3] = pair(right[2], right[3]);
    }

    static __device__ __forceinline__ unsigned pair(float low, float high)
    {
        return (unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(low)) |
               ((unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(high)) << 16);
    }
};

// float, on TF32's m16n8k8: a 16 x 16 step is two of them, and the order of k inside the step is ours to
// choose, as long as A and B agree. Taking k = 2t and 2t + 1 (then 2t + 8, 2t + 9) where m16n8k8 puts t and
// t + 4 gives each lane the same elements as bf16's layout: a row's two neighbours, one 8-byte load, and
// the 16 x 8 results of S, in the order they lie, are the A fragment of P V. Operands read from shared
// memory go in as they are (the tensor core reads a float's upper 19 bits: TF32 rounded toward zero, as
// wgmma's TF32 does); P and dS, made in registers, are rounded to nearest (cvt.rna) on the way.
// With rows D + 8 floats apart (8 banks on), the 16 lanes of a half warp read their 8 bytes from 16
// different pairs of banks; a transposed read hits 2 lanes per bank.
template <>
struct Fragments<float> {
    static constexpr int PADDING = 8;        // floats after each row: 32 bytes
    static constexpr int A = 8, B = 8;
    static constexpr bool KEEP_QUERIES = true;

    // The lane's two neighbours of row g + 8 eighth, at k = k0 + 8 half + 2t and the next: one 8-byte load.
    template <int STRIDE>
    static __device__ __forceinline__ float2 neighbours(const float* tile, int eighth, int k0, int half)
    {
        const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
        return *reinterpret_cast<const float2*>(tile + (g + 8 * eighth) * STRIDE + k0 + 8 * half + 2 * t);
    }

    // a[0..3]: the first m16n8k8's (g, 2t), (g + 8, 2t), (g, 2t + 1), (g + 8, 2t + 1); a[4..7] the same at k + 8.
    template <int STRIDE>
    static __device__ __forceinline__ void rows(unsigned (&a)[A], const float* tile, int k0)
    {
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int row = 0; row < 2; ++row) {
                const float2 pair = neighbours<STRIDE>(tile, row, k0, half);
                a[4 * half + row] = __float_as_uint(pair.x);
                a[4 * half + row + 2] = __float_as_uint(pair.y);
            }
    }

    // b[0..1]: column g of the first n8 tile at k = 2t, 2t + 1; b[2..3] at 2t + 8, 2t + 9; b[4..7] the same
    // for the second tile (rows g + 8).
    template <int STRIDE>
    static __device__ __forceinline__ void columns(unsigned (&b)[B], const float* tile, int k0)
    {
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const float2 pair = neighbours<STRIDE>(tile, n, k0, half);
                b[4 * n + 2 * half] = __float_as_uint(pair.x);
                b[4 * n + 2 * half + 1] = __float_as_uint(pair.y);
            }
    }

    template <int STRIDE>
    static __device__ __forceinline__ void columns_transposed(unsigned (&b)[B], const float* tile, int n0)
    {
        const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                b[4 * n + k] = __float_as_uint(tile[(2 * t + k % 2 + 8 * (k / 2)) * STRIDE + n0 + 8 * n + g]);
            }
    }

    static __device__ __forceinline__ void multiply(float (&first)[4], float (&second)[4], const unsigned (&a)[A],
                                                    const unsigned (&b)[B])
    {
        const unsigned a_low[4] = {a[0], a[1], a[2], a[3]}, a_high[4] = {a[4], a[5], a[6], a[7]};
        const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]}, b2[2] = {b[4], b[5]}, b3[2] = {b[6], b[7]};
        mma_m16n8k8_tf32(first, a_low, b0);
        mma_m16n8k8_tf32(first, a_high, b1);
        mma_m16n8k8_tf32(second, a_low, b2);
        mma_m16n8k8_tf32(second, a_high, b3);
    }

    static __device__ __forceinline__ void weights(unsigned (&a)[A], const float (&left)[4], const float (&right)[4])
    {
        in_rows_order(a, left, right, [](float x) { return to_tf32(x); });
    }

    // A result's elements are (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1): reordered as rows() reads,
    // each made a register by as_register.
    template <typename AsRegister>
    static __device__ __forceinline__ void in_rows_order(unsigned (&a)[A], const float (&left)[4],
                                                         const float (&right)[4], AsRegister as_register)
    {
        const float* halves[2] = {left, right};
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            a[4 * half] = as_register(halves[half][0]);
            a[4 * half + 1] = as_register(halves[half][2]);
            a[4 * half + 2] = as_register(halves[half][1]);
            a[4 * half + 3] = as_register(halves[half][3]);
        }
    }
};

// 3xTF32: tiles are read as for TF32 (Fragments<float>), and each step splits the floats it multiplies, A's and
// B's alike: x = big + small (mma.cuh's split_tf32), so that a b = small·big + big·small + big·big, up to the
// dropped small·small. P and dS stay float32 until the step splits them. A tensor core adds an mma's products
// into its accumulator aligned to the largest of them, the bits below cut off, and cuts the sum toward zero;
// over the many mmas of a long sum (three times TF32's) those cuts all lean one way and add up past float32's
// rounding. So each step's six products for an n8 tile are summed from zero, and the CUDA cores add that part
// to the running sum, rounded to nearest.
struct Tf32x3;

template <>
struct Fragments<Tf32x3> : Fragments<float> {
    // Split once and kept across key tiles, the forward's queries would take twice TF32's registers (and
    // spill at D = 128): the forward reads them from the shared tile again for each key tile instead.
    static constexpr bool KEEP_QUERIES = false;

    // P and dS as they are, in rows()'s order: multiply splits them.
    static __device__ __forceinline__ void weights(unsigned (&a)[A], const float (&left)[4], const float (&right)[4])
    {
        in_rows_order(a, left, right, [](float x) { return __float_as_uint(x); });
    }

    // TF32's four m16n8k8 (Fragments<float>::multiply), each as three: a[0..3] is A at the first 8 of k,
    // a[4..7] at the next 8; b[0..1] and b[2..3] the first n8 tile's B at those, b[4..7] the second tile's.
    static __device__ __forceinline__ void multiply(float (&first)[4], float (&second)[4], const unsigned (&a)[A],
                                                    const unsigned (&b)[B])
    {
        unsigned a_big[2][4], a_small[2][4], b_big[4][2], b_small[4][2];
#pragma unroll
        for (int e = 0; e < A; ++e) split_tf32(__uint_as_float(a[e]), a_big[e / 4][e % 4], a_small[e / 4][e % 4]);
#pragma unroll
        for (int e = 0; e < B; ++e) split_tf32(__uint_as_float(b[e]), b_big[e / 2][e % 2], b_small[e / 2][e % 2]);
        six_products(first, a_big, a_small, b_big, b_small, 0);
        six_products(second, a_big, a_small, b_big, b_small, 2);
    }

    // sum += a b for n8 tile b[n], b[n + 1] (its two halves of k): the part summed from zero, the small
    // corrections first, while it is small.
    static __device__ __forceinline__ void six_products(float (&sum)[4], const unsigned (&a_big)[2][4],
                                                        const unsigned (&a_small)[2][4], const unsigned (&b_big)[4][2],
                                                        const unsigned (&b_small)[4][2], int n)
    {
        float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            mma_m16n8k8_tf32(part, a_small[half], b_big[n + half]);
            mma_m16n8k8_tf32(part, a_big[half], b_small[n + half]);
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) mma_m16n8k8_tf32(part, a_big[half], b_big[n + half]);
#pragma unroll
        for (int e = 0; e < 4; ++e) sum[e] += part[e];
    }
};

// The row stride of a shared tile of rows of D elements (3xTF32 reads float tiles as TF32 does).
template <typename Element, int D>
__host__ __device__ constexpr int tile_stride()
{
    return D + Fragments<Element>::PADDING;
}

// product (16 x COLUMNS, as COLUMNS / 8 result fragments) = the warp's 16 rows of length D (their A
// fragments, a) times the transpose of b_rows (COLUMNS rows of length D), for the chunks of 16 columns c
// in [begin, end); the other chunks are left at zero. Loops run over compile-time bounds, fully unrolled,
// so that the fragments stay in registers (an array indexed at run time goes to local memory); the chunk
// range is a condition inside.
template <typename Format, int D, int COLUMNS, typename Element>
__device__ __forceinline__ void multiply_by_rows(float (&product)[COLUMNS / 8][4],
                                                 const unsigned (&a)[D / 16][Fragments<Format>::A],
                                                 const Element* b_rows, int begin, int end)
{
    using F = Fragments<Format>;
    constexpr int STRIDE = tile_stride<Element, D>();
#pragma unroll
    for (int j = 0; j < COLUMNS / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) product[j][e] = 0.0f;
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
#pragma unroll
        for (int c = 0; c < COLUMNS / 16; ++c) {
            if (c < begin || c >= end) continue;
            unsigned b[F::B];
            F::template columns<STRIDE>(b, b_rows + 16 * c * STRIDE, 16 * i);
            F::multiply(product[2 * c], product[2 * c + 1], a[i], b);
        }
    }
}

// The A fragments of 16 rows of length D of a shared tile (rows: the first of them), for every 16 columns.
template <typename Format, int D, typename Element>
__device__ __forceinline__ void row_fragments(unsigned (&a)[D / 16][Fragments<Format>::A], const Element* rows)
{
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
        Fragments<Format>::template rows<tile_stride<Element, D>()>(a[i], rows, 16 * i);
    }
}

// multiply_by_rows with the 16 rows' A fragments read from a shared tile first (a_rows: the first of them).
template <typename Format, int D, int COLUMNS, typename Element>
__device__ __forceinline__ void multiply_shared_rows(float (&product)[COLUMNS / 8][4], const Element* a_rows,
                                                     const Element* b_rows, int begin, int end)
{
    unsigned a[D / 16][Fragments<Format>::A];
    row_fragments<Format, D>(a, a_rows);
    multiply_by_rows<Format, D, COLUMNS>(product, a, b_rows, begin, end);
}

// sum (16 x D) += weights (16 x COLUMNS, the result fragments of multiply_by_rows) times value_rows
// (COLUMNS rows of length D), over the chunks of 16 columns c in [begin, end): fragments 2c and 2c + 1 of
// the weights are the A fragment of chunk c.
template <typename Format, int D, int COLUMNS, typename Element>
__device__ __forceinline__ void accumulate_weighted_rows(float (&sum)[D / 8][4], const float (&weights)[COLUMNS / 8][4],
                                                         const Element* value_rows, int begin, int end)
{
    using F = Fragments<Format>;
    constexpr int STRIDE = tile_stride<Element, D>();
#pragma unroll
    for (int c = 0; c < COLUMNS / 16; ++c) {
        if (c < begin || c >= end) continue;
        unsigned a[F::A];
        F::weights(a, weights[2 * c], weights[2 * c + 1]);
#pragma unroll
        for (int n0 = 0; n0 < D; n0 += 16) {
            unsigned b[F::B];
            F::template columns_transposed<STRIDE>(b, value_rows + 16 * c * STRIDE, n0);
            F::multiply(sum[n0 / 8], sum[n0 / 8 + 1], a, b);
        }
    }
}

// Write the warp's 16 rows of a 16 x D sum, times `factor`, to rows first_row + ... of a (T, D) matrix whose
// rows are row_stride elements apart. Result element e of fragment n is row g + 8 (e / 2), column 8n + 2t + e % 2:
// elements 0, 1 and 2, 3 are neighbours, one store each (storage.cuh's store_pair).
template <int D, typename Element>
__device__ __forceinline__ void store_fragment_rows(Element* matrix, long long row_stride, const float (&sum)[D / 8][4],
                                           int first_row, int T, float factor)
{
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int row = first_row + g + 8 * half;
        if (row >= T) continue;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            store_pair(matrix + row * row_stride + 8 * n + 2 * t, factor * sum[n][2 * half], factor * sum[n][2 * half + 1]);
        }
    }
}

// The key tiles that a block of ROWS queries (first_query ..) sees, KEYS keys each, K and V in two shared
// stages: tile i + 1 is copied while the warps work on tile i. Copies the caller started before (its query
// tiles) join the first group, and have landed when the work first runs. For each tile, each warp whose
// 16 queries (warp_query ..) see some of its keys runs work(first_key, k_tile, v_tile, chunks, masked):
// the chunks of 16 keys (from the first) that it sees, and whether some key is hidden from some of its
// queries (past T, or causal past the query) so that the scores need masking.
template <int D, int ROWS, int KEYS, typename Element, typename Work>
__device__ __forceinline__ void for_each_visible_key_tile(Element* k_tiles, Element* v_tiles, const Element* k,
                                                          const Element* v, long long k_row, long long v_row,
                                                          int first_query, int T, int causal, Work work)
{
    constexpr int THREADS = 2 * ROWS, STRIDE = tile_stride<Element, D>(), TILE_ELEMENTS = KEYS * STRIDE;
    const int warp_query = first_query + 16 * (threadIdx.x / 32);
    const int tiles = ((causal ? min(first_query + ROWS, T) : T) + KEYS - 1) / KEYS;
    auto start_tile = [&](int tile) {
        const int stage = tile % 2;
        copy_rows_async<KEYS, D, STRIDE, THREADS>(k_tiles + stage * TILE_ELEMENTS, k, k_row, tile * KEYS, T);
        copy_rows_async<KEYS, D, STRIDE, THREADS>(v_tiles + stage * TILE_ELEMENTS, v, v_row, tile * KEYS, T);
    };
    start_tile(0);
    cp_async_commit();
    for (int tile = 0; tile < tiles; ++tile) {
        // The stage of tile + 1 was last read at tile - 1, which every warp finished (the barrier below).
        if (tile + 1 < tiles) start_tile(tile + 1);
        cp_async_commit();
        cp_async_wait<1>();  // this thread's copies of this tile have landed (the next may be in flight)
        __syncthreads();     // and everyone's
        const int first_key = tile * KEYS, stage = tile % 2;
        const int visible = min(T, causal ? warp_query + 16 : T) - first_key;  // keys up to T and the last query
        if (warp_query < T && visible > 0) {
            const bool masked = first_key + KEYS > T || (causal && first_key + KEYS - 1 > warp_query);
            work(first_key, k_tiles + stage * TILE_ELEMENTS, v_tiles + stage * TILE_ELEMENTS,
                 min(KEYS / 16, (visible + 15) / 16), masked);
        }
        __syncthreads();     // everyone is done with this stage before it is refilled
    }
}

// ---- forward ----------------------------------------------------------------------------------------

// One key tile of the forward for the warp's 16 queries (first_query ..): S = Q Kᵀ, the online softmax,
// O += P V. Each lane holds rows g and g + 8 of every fragment: row_max and row_sum [0] and [1]. row_max
// is in log2 units; row_sum is the lane's own part of the row's sum (its 2 columns of each fragment),
// added across the 4 lanes of the row once at the end: rescaling multiplies every part alike.
// MASKED: the tile reaches past T or (causal) past the warp's first query, so scores are masked one by
// one. The warp sees the first `chunks` chunks of 16 keys; the rest are hidden from all 16 rows and not
// multiplied.
template <typename Format, int D, int KEYS, bool MASKED, typename Element>
__device__ __forceinline__ void forward_tile(float (&o)[D / 8][4], float (&row_max)[2], float (&row_sum)[2],
                                             const unsigned (&q_fragments)[D / 16][Fragments<Format>::A],
                                             const Element* k_tile, const Element* v_tile, int chunks, int first_key, int first_query, int T,
                                             int causal, float scale_log2)
{
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    float s[KEYS / 8][4];
    multiply_by_rows<Format, D, KEYS>(s, q_fragments, k_tile, 0, chunks);
    // Element e of fragment j: query first_query + g + 8 (e / 2), key first_key + 8j + 2t + e % 2.
#pragma unroll
    for (int j = 0; j < KEYS / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            s[j][e] *= scale_log2;  // scaled before masking: any sign of scale keeps hidden keys at -inf
            const int key = first_key + 8 * j + 2 * t + e % 2, query = first_query + g + 8 * (e / 2);
            if (MASKED && (key >= T || (causal && key > query))) s[j][e] = NEGATIVE_INFINITY;
        }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        float tile_max = NEGATIVE_INFINITY;
#pragma unroll
        for (int j = 0; j < KEYS / 8; ++j) tile_max = fmaxf(tile_max, fmaxf(s[j][2 * half], s[j][2 * half + 1]));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(FULL_MASK, tile_max, 1));  // the 4 lanes of the row
        tile_max = fmaxf(tile_max, __shfl_xor_sync(FULL_MASK, tile_max, 2));
        const float new_max = fmaxf(row_max[half], tile_max);
        // A row that has seen no key yet keeps -inf as its maximum; subtracting 0 instead keeps
        // 2^(-inf - (-inf)) from becoming NaN: its weights and its rescaling are then 2^-inf = 0.
        const float base = new_max == NEGATIVE_INFINITY ? 0.0f : new_max;
        const float rescale = exp2f(row_max[half] - base);
        row_max[half] = new_max;
        row_sum[half] *= rescale;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            o[n][2 * half] *= rescale;
            o[n][2 * half + 1] *= rescale;
        }
#pragma unroll
        for (int j = 0; j < KEYS / 8; ++j)
#pragma unroll
            for (int e = 2 * half; e < 2 * half + 2; ++e) {
                s[j][e] = exp2f(s[j][e] - base);
                row_sum[half] += s[j][e];  // from the float32 weights; P V uses them in the input format
            }
    }
    accumulate_weighted_rows<Format, D, KEYS>(o, s, v_tile, 0, chunks);
}

// out, lse from q, k, v. Dynamic shared memory: the query tile, then two stages of K and of V.
template <typename Element, int D, int WARPS, int KEYS, typename Format = Element>
__global__ void __launch_bounds__(32 * WARPS) tensor_core_attention_forward(
    Element* __restrict__ out, float* __restrict__ lse, const Element* __restrict__ q,
    const Element* __restrict__ k, const Element* __restrict__ v, int T, int heads, int kv_heads, float scale,
    int causal, HeadLayout out_at, HeadLayout q_at, HeadLayout k_at, HeadLayout v_at)
{
    static_assert(D % 16 == 0 && KEYS % 16 == 0, "fragments are 16 wide");
    constexpr int ROWS = 16 * WARPS, THREADS = 32 * WARPS, STRIDE = tile_stride<Element, D>();
    extern __shared__ __align__(16) unsigned char shared_bytes[];
    Element* q_tile = reinterpret_cast<Element*>(shared_bytes);
    Element* k_tiles = q_tile + ROWS * STRIDE;
    Element* v_tiles = k_tiles + 2 * KEYS * STRIDE;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const long long head = blockIdx.x, kv_head = kv_head_of(head, heads, kv_heads);
    const int first_query = (gridDim.y - 1 - blockIdx.y) * ROWS;  // causal: the longest rows start first
    const int warp_query = first_query + 16 * warp;
    q += q_at.start(head, heads); out += out_at.start(head, heads); lse += head * T;
    k += k_at.start(kv_head, kv_heads); v += v_at.start(kv_head, kv_heads);
    const float scale_log2 = scale * CUDART_L2E_F;

    float o[D / 8][4] = {};
    float row_max[2] = {NEGATIVE_INFINITY, NEGATIVE_INFINITY}, row_sum[2] = {0.0f, 0.0f};
    unsigned q_fragments[D / 16][Fragments<Format>::A];  // the warp's queries, read once (every warp sees key 0)
    copy_rows_async<ROWS, D, STRIDE, THREADS>(q_tile, q, q_at.row, first_query, T);
    for_each_visible_key_tile<D, ROWS, KEYS>(k_tiles, v_tiles, k, v, k_at.row, v_at.row, first_query, T, causal,
        [&](int first_key, const Element* k_tile, const Element* v_tile, int chunks, bool masked) {
            if (first_key == 0 || !Fragments<Format>::KEEP_QUERIES)
                row_fragments<Format, D>(q_fragments, q_tile + 16 * warp * STRIDE);
            if (masked)
                forward_tile<Format, D, KEYS, true>(o, row_max, row_sum, q_fragments, k_tile, v_tile, chunks,
                                                    first_key, warp_query, T, causal, scale_log2);
            else
                forward_tile<Format, D, KEYS, false>(o, row_max, row_sum, q_fragments, k_tile, v_tile, chunks,
                                                     first_key, warp_query, T, causal, scale_log2);
        });

    if (warp_query >= T) return;
    float inverse_sum[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        float total = row_sum[half];
        total += __shfl_xor_sync(FULL_MASK, total, 1);
        total += __shfl_xor_sync(FULL_MASK, total, 2);
        inverse_sum[half] = 1.0f / total;
        const int query = warp_query + g + 8 * half;
        if (t == 0 && query < T) lse[query] = (row_max[half] + log2f(total)) * CUDART_LN2_F;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            o[n][2 * half] *= inverse_sum[half];
            o[n][2 * half + 1] *= inverse_sum[half];
        }
    }
    store_fragment_rows<D>(out, out_at.row, o, warp_query, T, 1.0f);
}

// ---- backward ---------------------------------------------------------------------------------------
// dV = Pᵀ dO, dP = dO Vᵀ, dS = P ⊙ (dP - row_dot) with row_dot = rowsum(dO ⊙ O), dQ = scale dS K,
// dK = scale dSᵀ Q. Two passes, each summing its own outputs: dk, dv (a block per tile of keys, looping
// over queries) and dq (a block per tile of queries, looping over keys); S and dP are computed in both.

// row_dot[i] = Σ_d dout[i][d] out[i][d] for each of `rows` = B heads T rows of length d, in float32, reading
// dout and out where dout_at and out_at say. A row takes d / 8 lanes, each moving 8 elements of both
// (storage.cuh's groups: 16 bytes of bf16, 32 of float): a warp takes 32 / (d / 8) rows.
template <typename Element>
__global__ void tensor_core_attention_row_dot(float* row_dot, const Element* dout, const Element* out, int rows, int d,
                                              int T, int heads, HeadLayout dout_at, HeadLayout out_at)
{
    constexpr int GROUP = 8;
    const int lanes = d / GROUP, part = threadIdx.x % lanes;
    const long long row = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / lanes;
    float sum = 0.0f;
    if (row < rows) {
        float gradient[GROUP], value[GROUP];
        load_as_float<GROUP>(gradient, dout + dout_at.start(row / T, heads) + row % T * dout_at.row + GROUP * part, true);
        load_as_float<GROUP>(value, out + out_at.start(row / T, heads) + row % T * out_at.row + GROUP * part, true);
        for (int w = 0; w < GROUP; ++w) {
            sum += gradient[w] * value[w];
        }
    }
    for (int offset = lanes / 2; offset > 0; offset /= 2) {  // the row's lanes are neighbours in the warp
        sum += __shfl_xor_sync(FULL_MASK, sum, offset);
    }
    if (part == 0 && row < rows) row_dot[row] = sum;
}

// One query tile of the dk, dv pass for the warp's 16 keys (first_key ..): Sᵀ = K Qᵀ and dPᵀ = V dOᵀ
// (rows = keys, columns = queries), Pᵀ = 2^(Sᵀ scale log2 e - lse log2 e), dSᵀ = Pᵀ ⊙ (dPᵀ - row_dot),
// then dV += Pᵀ dO and dK += dSᵀ Q. lse_tile and dot_tile hold the tile's queries' lse and row_dot.
// Chunks of 16 queries c in [begin, end) are multiplied; the others are hidden from all 16 keys.
template <typename Format, int D, int QUERIES, bool MASKED, typename Element>
__device__ __forceinline__ void dk_dv_tile(float (&dk_sum)[D / 8][4], float (&dv_sum)[D / 8][4],
                                           const Element* k_rows, const Element* v_rows, const Element* q_tile,
                                           const Element* dout_tile, const float* lse_tile, const float* dot_tile,
                                           int begin, int end, int first_key, int first_query, int T, int causal,
                                           float scale_log2)
{
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    float p[QUERIES / 8][4], ds[QUERIES / 8][4];
    multiply_shared_rows<Format, D, QUERIES>(p, k_rows, q_tile, begin, end);
    multiply_shared_rows<Format, D, QUERIES>(ds, v_rows, dout_tile, begin, end);
    // Element e of fragment j: key first_key + g + 8 (e / 2), query first_query + 8j + 2t + e % 2.
#pragma unroll
    for (int j = 0; j < QUERIES / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int column = 8 * j + 2 * t + e % 2, key = first_key + g + 8 * (e / 2);
            float probability = exp2f(fmaf(p[j][e], scale_log2, -lse_tile[column] * CUDART_L2E_F));
            if (MASKED && (first_query + column >= T || (causal && key > first_query + column))) probability = 0.0f;
            p[j][e] = probability;
            ds[j][e] = probability * (ds[j][e] - dot_tile[column]);
        }
    accumulate_weighted_rows<Format, D, QUERIES>(dv_sum, p, dout_tile, begin, end);
    accumulate_weighted_rows<Format, D, QUERIES>(dk_sum, ds, q_tile, begin, end);
}

// dk, dv of one key/value head's tile of 16 WARPS keys, summed over every query head of its group and
// every query tile that sees them. Dynamic shared memory: the K and V tiles, two stages of Q and dO
// tiles, then two stages of QUERIES floats of lse and of row_dot.
template <typename Element, int D, int WARPS, int QUERIES, typename Format = Element>
__global__ void __launch_bounds__(32 * WARPS) tensor_core_attention_backward_dk_dv(
    Element* __restrict__ dk, Element* __restrict__ dv, const Element* __restrict__ dout,
    const Element* __restrict__ q, const Element* __restrict__ k, const Element* __restrict__ v,
    const float* __restrict__ lse, const float* __restrict__ row_dot, int T, int heads, int kv_heads, float scale,
    int causal, HeadLayout dk_at, HeadLayout dv_at, HeadLayout dout_at, HeadLayout q_at, HeadLayout k_at,
    HeadLayout v_at)
{
    static_assert(D % 16 == 0 && QUERIES % 16 == 0, "fragments are 16 wide");
    constexpr int KEYS = 16 * WARPS, THREADS = 32 * WARPS, STRIDE = tile_stride<Element, D>();
    constexpr int TILE_ELEMENTS = QUERIES * STRIDE;
    extern __shared__ __align__(16) unsigned char shared_bytes[];
    Element* k_tile = reinterpret_cast<Element*>(shared_bytes);
    Element* v_tile = k_tile + KEYS * STRIDE;
    Element* q_tiles = v_tile + KEYS * STRIDE;
    Element* dout_tiles = q_tiles + 2 * TILE_ELEMENTS;
    float* lse_tiles = reinterpret_cast<float*>(dout_tiles + 2 * TILE_ELEMENTS);
    float* dot_tiles = lse_tiles + 2 * QUERIES;
    const int warp = threadIdx.x / 32;
    const long long kv_head = blockIdx.x, group = heads / kv_heads;
    const long long first_head = kv_head / kv_heads * heads + kv_head % kv_heads * group;
    const int first_key = blockIdx.y * KEYS, warp_key = first_key + 16 * warp;
    const float scale_log2 = scale * CUDART_L2E_F;
    // The query tiles that see these keys: causal, from the one holding the first key; in every head of the group.
    const int first_tile = causal ? first_key / QUERIES : 0;
    const int tiles_per_head = (T + QUERIES - 1) / QUERIES - first_tile, steps = group * tiles_per_head;

    auto start_step = [&](int step) {
        const long long head = first_head + step / tiles_per_head;
        const int first_query = (first_tile + step % tiles_per_head) * QUERIES, stage = step % 2;
        copy_rows_async<QUERIES, D, STRIDE, THREADS>(q_tiles + stage * TILE_ELEMENTS, q + q_at.start(head, heads), q_at.row,
                                             first_query, T);
        copy_rows_async<QUERIES, D, STRIDE, THREADS>(dout_tiles + stage * TILE_ELEMENTS, dout + dout_at.start(head, heads),
                                             dout_at.row, first_query, T);
        copy_floats_async<QUERIES, THREADS>(lse_tiles + stage * QUERIES, lse + head * T, first_query, T);
        copy_floats_async<QUERIES, THREADS>(dot_tiles + stage * QUERIES, row_dot + head * T, first_query, T);
    };
    copy_rows_async<KEYS, D, STRIDE, THREADS>(k_tile, k + k_at.start(kv_head, kv_heads), k_at.row, first_key, T);
    copy_rows_async<KEYS, D, STRIDE, THREADS>(v_tile, v + v_at.start(kv_head, kv_heads), v_at.row, first_key, T);
    start_step(0);
    cp_async_commit();

    float dk_sum[D / 8][4] = {}, dv_sum[D / 8][4] = {};
    for (int step = 0; step < steps; ++step) {
        if (step + 1 < steps) start_step(step + 1);  // into the stage step - 1 used, which all warps are done with
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const int first_query = (first_tile + step % tiles_per_head) * QUERIES, stage = step % 2;
        // Chunks of 16 queries that see the warp's keys: causal, from the chunk of its first key; before T.
        const int begin = causal ? max(0, (warp_key - first_query) / 16) : 0;
        const int end = min(QUERIES / 16, (T - first_query + 15) / 16);
        if (warp_key < T && begin < end) {
            const Element* k_rows = k_tile + 16 * warp * STRIDE;
            const Element* v_rows = v_tile + 16 * warp * STRIDE;
            const Element* q_rows = q_tiles + stage * TILE_ELEMENTS;
            const Element* dout_rows = dout_tiles + stage * TILE_ELEMENTS;
            const float* lse_tile = lse_tiles + stage * QUERIES;
            const float* dot_tile = dot_tiles + stage * QUERIES;
            if (first_query + QUERIES > T || (causal && first_query < warp_key + 15))
                dk_dv_tile<Format, D, QUERIES, true>(dk_sum, dv_sum, k_rows, v_rows, q_rows, dout_rows, lse_tile,
                                                     dot_tile, begin, end, warp_key, first_query, T, causal,
                                                     scale_log2);
            else
                dk_dv_tile<Format, D, QUERIES, false>(dk_sum, dv_sum, k_rows, v_rows, q_rows, dout_rows, lse_tile,
                                                      dot_tile, begin, end, warp_key, first_query, T, causal,
                                                      scale_log2);
        }
        __syncthreads();
    }
    store_fragment_rows<D>(dk + dk_at.start(kv_head, kv_heads), dk_at.row, dk_sum, warp_key, T, scale);
    store_fragment_rows<D>(dv + dv_at.start(kv_head, kv_heads), dv_at.row, dv_sum, warp_key, T, 1.0f);
}

// One key tile of the dq pass for the warp's 16 queries: S = Q Kᵀ, dP = dO Vᵀ, P from lse, dS, dQ += dS K.
// lse2 and dot: the lane's rows g and g + 8, lse in log2 units.
template <typename Format, int D, int KEYS, bool MASKED, typename Element>
__device__ __forceinline__ void dq_tile(float (&dq_sum)[D / 8][4], const Element* q_rows, const Element* dout_rows,
                                        const Element* k_tile, const Element* v_tile, const float (&lse2)[2],
                                        const float (&dot)[2], int chunks, int first_key, int first_query, int T,
                                        int causal, float scale_log2)
{
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    float p[KEYS / 8][4], ds[KEYS / 8][4];
    multiply_shared_rows<Format, D, KEYS>(p, q_rows, k_tile, 0, chunks);
    multiply_shared_rows<Format, D, KEYS>(ds, dout_rows, v_tile, 0, chunks);
#pragma unroll
    for (int j = 0; j < KEYS / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = first_key + 8 * j + 2 * t + e % 2, query = first_query + g + 8 * (e / 2);
            float probability = exp2f(fmaf(p[j][e], scale_log2, -lse2[e / 2]));
            if (MASKED && (key >= T || (causal && key > query))) probability = 0.0f;
            ds[j][e] = probability * (ds[j][e] - dot[e / 2]);
        }
    accumulate_weighted_rows<Format, D, KEYS>(dq_sum, ds, k_tile, 0, chunks);
}

// dq of one tile of 16 WARPS queries of one head. Dynamic shared memory: the Q and dO tiles, then two
// stages of K and of V.
template <typename Element, int D, int WARPS, int KEYS, typename Format = Element>
__global__ void __launch_bounds__(32 * WARPS) tensor_core_attention_backward_dq(
    Element* __restrict__ dq, const Element* __restrict__ dout, const Element* __restrict__ q,
    const Element* __restrict__ k, const Element* __restrict__ v, const float* __restrict__ lse,
    const float* __restrict__ row_dot, int T, int heads, int kv_heads, float scale, int causal, HeadLayout dq_at,
    HeadLayout dout_at, HeadLayout q_at, HeadLayout k_at, HeadLayout v_at)
{
    static_assert(D % 16 == 0 && KEYS % 16 == 0, "fragments are 16 wide");
    constexpr int ROWS = 16 * WARPS, THREADS = 32 * WARPS, STRIDE = tile_stride<Element, D>();
    extern __shared__ __align__(16) unsigned char shared_bytes[];
    Element* q_tile = reinterpret_cast<Element*>(shared_bytes);
    Element* dout_tile = q_tile + ROWS * STRIDE;
    Element* k_tiles = dout_tile + ROWS * STRIDE;
    Element* v_tiles = k_tiles + 2 * KEYS * STRIDE;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4;
    const long long head = blockIdx.x, kv_head = kv_head_of(head, heads, kv_heads);
    const int first_query = (gridDim.y - 1 - blockIdx.y) * ROWS, warp_query = first_query + 16 * warp;
    q += q_at.start(head, heads); dq += dq_at.start(head, heads); dout += dout_at.start(head, heads);
    lse += head * T; row_dot += head * T;
    k += k_at.start(kv_head, kv_heads); v += v_at.start(kv_head, kv_heads);
    const float scale_log2 = scale * CUDART_L2E_F;

    float lse2[2], dot[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int query = warp_query + g + 8 * half;
        lse2[half] = query < T ? lse[query] * CUDART_L2E_F : 0.0f;
        dot[half] = query < T ? row_dot[query] : 0.0f;
    }
    float dq_sum[D / 8][4] = {};
    copy_rows_async<ROWS, D, STRIDE, THREADS>(q_tile, q, q_at.row, first_query, T);
    copy_rows_async<ROWS, D, STRIDE, THREADS>(dout_tile, dout, dout_at.row, first_query, T);
    for_each_visible_key_tile<D, ROWS, KEYS>(k_tiles, v_tiles, k, v, k_at.row, v_at.row, first_query, T, causal,
        [&](int first_key, const Element* k_tile, const Element* v_tile, int chunks, bool masked) {
            const Element* q_rows = q_tile + 16 * warp * STRIDE;
            const Element* dout_rows = dout_tile + 16 * warp * STRIDE;
            if (masked)
                dq_tile<Format, D, KEYS, true>(dq_sum, q_rows, dout_rows, k_tile, v_tile, lse2, dot, chunks,
                                               first_key, warp_query, T, causal, scale_log2);
            else
                dq_tile<Format, D, KEYS, false>(dq_sum, q_rows, dout_rows, k_tile, v_tile, lse2, dot, chunks,
                                                first_key, warp_query, T, causal, scale_log2);
        });
    store_fragment_rows<D>(dq, dq_at.row, dq_sum, warp_query, T, scale);
}
