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
// Each Element tensor is given as the array that holds it and a HeadLayout (head_layout.cuh) that says where in it the
// tensor lies: contiguous (B, H, T, D) is one layout; q, k, v sliced from one (B, T, 3 H D) product's output
// and out written into a (B, T, H D) array are others, read and written where they lie, without a copy.
// Query head h reads key and value head h / (H / H_kv) of the same batch element (H_kv = H: one each).
// S = scale q kᵀ, P = softmax(S) over the visible keys (causal: query t sees keys 0..t), out = P v, and
// lse = log Σ_j e^S of each row, which the backward uses to recompute P. Grid: blockIdx.x is the head (the
// query head b H + h, or for the dk, dv pass the key/value head b H_kv + h_kv), blockIdx.y a tile of rows.
//
// Every product runs in steps of a warp-wide 16 x 8 += 16 x 16 · 16 x 8 (Fragments<Format>, below): one
// mma.sync.m16n8k16 in bf16, two mma.sync.m16n8k8 in TF32, six in 3xTF32 (kernels/include/mma.cuh).
// A warp owns STRIPS strips of 16 rows (one A fragment's height each) of each product: queries in the
// forward and in the dq pass, keys in the dk, dv pass. A block of WARPS warps owns 16 STRIPS WARPS rows and
// walks along the other axis a tile at a time.
//  - Tiles live in shared memory as [row][D + PADDING] Element, as in global memory plus 16 bytes (bf16) or 32
//    (float), so that the rows a warp reads at once start on different banks.
//  - They arrive by cp.async, two stages: the next tile is in flight while the warps multiply this one.
//  - Each B fragment a warp reads from shared memory is multiplied by the A fragments of all its strips.
//    A bf16 m16n8k16 does 2048 multiply-adds on the 256 bytes of its B fragment; an SM's shared memory
//    delivers 128 bytes a cycle and its tensor cores about 1024 multiply-adds a cycle through mma.sync, so
//    with one strip a warp waits on shared memory as long as on its tensor cores. Two strips halve the
//    bytes per multiply-add, for twice the registers (the sums and the products of both strips), and so
//    fewer warps per SM: gpt2_cupy/ops/tensor_core_attention.py says which pass and shape gain by it.
//  - A fragments are read from tiles stored as A's rows; B fragments from tiles stored as B's columns (K in
//    Q Kᵀ) or as B's rows (V in P V). The forward reads its queries' fragments once and keeps them in
//    registers (3xTF32's reads them again for each key tile: KEEP_QUERIES); the backward reads its A
//    fragments again for each tile, 16 columns at a time, where registers are short (the dk, dv pass
//    holds two 16 x D sums per strip).
//  - The FlashAttention-2 trick: the float32 result fragments of two neighbouring 16 x 8 products (S, or
//    P after the softmax) hold, lane for lane, exactly the elements of the A fragment of the next 16 x 16
//    step. P is rounded to the input format (3xTF32: split into its two parts) in registers and multiplied
//    by V without a trip through shared memory.
//  - The dk, dv pass computes the transposed products, Sᵀ = K Qᵀ and dPᵀ = V dOᵀ, so that its keys are
//    the rows of the result and Pᵀ, dSᵀ are again A fragments for dV += Pᵀ dO and dK += dSᵀ Q.
// Exponentials are exp2f of scores in log2 units: e^(x - m) = 2^(x log2 e - m log2 e). CuPy compiles every
// kernel with -ftz=true, under which each exp2f is a single MUFU.EX2.
// Deterministic: every output element is summed by one thread in a fixed order, no atomics, so the bits
// are the same on every run; dk and dv of a key/value head are summed over the query heads of its group
// one after the other by the same block.
#include <cuda_bf16.h>
#include <math_constants.h>   // CUDART_L2E_F = log2(e), CUDART_LN2_F = ln(2), as floats
#include "head_layout.cuh"   // HeadLayout (chapter 08): its offset and strides here multiples of 16 bytes,
                              // so that every row starts on 16 bytes, as cp.async's copies need
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

// Start copying rows first_row .. first_row + ROWS - 1 of a (T, D) matrix whose rows are row_stride elements
// apart into a shared tile whose rows are STRIDE apart, 16 bytes per cp.async; rows at or past T become
// zeros (a copy that reads 0 bytes fills its 16 with zeros). A round of copies takes THREADS / (D / 8)
// rows (bf16: 16 bytes are 8 elements), thread i the same 16 bytes of each: the loop counts rounds, a
// number known at compile time, so that it unrolls into straight-line code, and the thread's source moves
// on by the same stride each round instead of being computed again from its row.
template <int ROWS, int D, int STRIDE, int THREADS, typename Element>
__device__ __forceinline__ void copy_rows_async(Element* tile, const Element* matrix, long long row_stride,
                                                int first_row, int T)
{
    constexpr int PER_COPY = 16 / sizeof(Element), COPIES_PER_ROW = D / PER_COPY;
    static_assert(THREADS % COPIES_PER_ROW == 0, "a round copies whole rows");
    constexpr int ROWS_PER_ROUND = THREADS / COPIES_PER_ROW, ROUNDS = (ROWS + ROWS_PER_ROUND - 1) / ROWS_PER_ROUND;
    const int first = threadIdx.x / COPIES_PER_ROW, column = threadIdx.x % COPIES_PER_ROW * PER_COPY;
    const Element* source = matrix + (first_row + first) * row_stride + column;
#pragma unroll
    for (int round = 0; round < ROUNDS; ++round, source += ROWS_PER_ROUND * row_stride) {
        const int row = first + round * ROWS_PER_ROUND;
        if (ROWS % ROWS_PER_ROUND != 0 && row >= ROWS) break;
        const bool inside = first_row + row < T;
        cp_async_16(shared_address(tile + row * STRIDE + column), inside ? source : matrix, inside ? 16 : 0);
    }
}

// The same for COUNT floats first .. first + COUNT - 1 of a length-T vector, 4 bytes per copy.
template <int COUNT, int THREADS>
__device__ __forceinline__ void copy_floats_async(float* tile, const float* vector, int first, int T)
{
#pragma unroll
    for (int round = 0; round < (COUNT + THREADS - 1) / THREADS; ++round) {
        const int i = round * THREADS + threadIdx.x;
        if (COUNT % THREADS != 0 && i >= COUNT) break;
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

    // One conversion instruction (cvt.rn.bf16x2.f32) rounds both.
    static __device__ __forceinline__ unsigned pair(float low, float high)
    {
        const __nv_bfloat162 both = __floats2bfloat162_rn(low, high);
        return *reinterpret_cast<const unsigned*>(&both);
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

// The chunks of 16 columns c in [begin, end) that one strip of 16 rows multiplies: the others are hidden
// from all 16 of its rows (causal, or past T), and are neither read nor multiplied.
struct ChunkRange {
    int begin, end;

    __device__ __forceinline__ bool has(int c) const { return c >= begin && c < end; }
};

// Whether strip `strip` multiplies chunk c. On a tile that needs no masking (MASKED false), every strip
// multiplies every chunk, and that is known at compile time: the unrolled loops then have no branches,
// and the compiler can load the next fragments from shared memory while the tensor cores multiply these
// (a branch between them would make it wait for each load).
template <bool MASKED, int STRIPS>
__device__ __forceinline__ bool multiplies(const ChunkRange (&chunks)[STRIPS], int strip, int c)
{
    return !MASKED || chunks[strip].has(c);
}

// Whether some strip multiplies chunk c.
template <bool MASKED, int STRIPS>
__device__ __forceinline__ bool some_strip_multiplies(const ChunkRange (&chunks)[STRIPS], int c)
{
    bool some = false;
#pragma unroll
    for (int strip = 0; strip < STRIPS; ++strip) some = some || multiplies<MASKED>(chunks, strip, c);
    return some;
}

// A warp owns STRIPS strips of 16 rows (one A fragment's height each). One 16-wide step of k of a product
// of the warp's rows by the transpose of b_rows (COLUMNS rows of length D): for each strip s,
// product[s] (16 x COLUMNS, as COLUMNS / 8 result fragments) += a[s][step] (the strip's A fragment at
// columns k0 .. k0 + 15) times b_rows' columns k0 .. k0 + 15, over the chunks of 16 columns in chunks[s]
// (all of them when MASKED is false). Each B fragment is read from shared memory once and multiplied by
// every strip's A fragment: with two strips, a warp reads half the shared memory per mma.sync. Loops run
// over compile-time bounds, fully unrolled, so that the fragments stay in registers (an array indexed at
// run time goes to local memory); the chunk ranges are conditions inside.
template <typename Format, int D, int COLUMNS, bool MASKED, int STRIPS, int STEPS, typename Element>
__device__ __forceinline__ void multiply_step(float (&product)[STRIPS][COLUMNS / 8][4],
                                              const unsigned (&a)[STRIPS][STEPS][Fragments<Format>::A], int step,
                                              const Element* b_rows, int k0, const ChunkRange (&chunks)[STRIPS])
{
    using F = Fragments<Format>;
    constexpr int STRIDE = tile_stride<Element, D>();
#pragma unroll
    for (int c = 0; c < COLUMNS / 16; ++c) {
        if (!some_strip_multiplies<MASKED>(chunks, c)) continue;
        unsigned b[F::B];
        F::template columns<STRIDE>(b, b_rows + 16 * c * STRIDE, k0);
#pragma unroll
        for (int strip = 0; strip < STRIPS; ++strip) {
            if (multiplies<MASKED>(chunks, strip, c))
                F::multiply(product[strip][2 * c], product[strip][2 * c + 1], a[strip][step], b);
        }
    }
}

template <int STRIPS, int COLUMNS>
__device__ __forceinline__ void set_to_zero(float (&product)[STRIPS][COLUMNS / 8][4])
{
#pragma unroll
    for (int strip = 0; strip < STRIPS; ++strip)
#pragma unroll
        for (int j = 0; j < COLUMNS / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) product[strip][j][e] = 0.0f;
}

// The whole product, the strips' rows of length D given as their A fragments a[s][i] (columns 16 i ..
// 16 i + 15), held in registers; chunks that strip s does not multiply stay zero.
template <typename Format, int D, int COLUMNS, bool MASKED, int STRIPS, typename Element>
__device__ __forceinline__ void multiply_by_rows(float (&product)[STRIPS][COLUMNS / 8][4],
                                                 const unsigned (&a)[STRIPS][D / 16][Fragments<Format>::A],
                                                 const Element* b_rows, const ChunkRange (&chunks)[STRIPS])
{
    set_to_zero<STRIPS, COLUMNS>(product);
#pragma unroll
    for (int i = 0; i < D / 16; ++i) multiply_step<Format, D, COLUMNS, MASKED>(product, a, i, b_rows, 16 * i, chunks);
}

// The A fragments of the warp's STRIPS strips of 16 rows of length D of a shared tile (rows: the first of
// them), for every 16 columns.
template <typename Format, int D, int STRIPS, typename Element>
__device__ __forceinline__ void row_fragments(unsigned (&a)[STRIPS][D / 16][Fragments<Format>::A], const Element* rows)
{
    constexpr int STRIDE = tile_stride<Element, D>();
#pragma unroll
    for (int strip = 0; strip < STRIPS; ++strip)
#pragma unroll
        for (int i = 0; i < D / 16; ++i) {
            Fragments<Format>::template rows<STRIDE>(a[strip][i], rows + 16 * strip * STRIDE, 16 * i);
        }
}

// The whole product with the strips' A fragments read from a shared tile (a_rows: the first of the warp's
// rows) one step of k at a time, so that registers hold only that step's.
template <typename Format, int D, int COLUMNS, bool MASKED, int STRIPS, typename Element>
__device__ __forceinline__ void multiply_shared_rows(float (&product)[STRIPS][COLUMNS / 8][4], const Element* a_rows,
                                                     const Element* b_rows, const ChunkRange (&chunks)[STRIPS])
{
    constexpr int STRIDE = tile_stride<Element, D>();
    set_to_zero<STRIPS, COLUMNS>(product);
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
        unsigned a[STRIPS][1][Fragments<Format>::A];
#pragma unroll
        for (int strip = 0; strip < STRIPS; ++strip) {
            Fragments<Format>::template rows<STRIDE>(a[strip][0], a_rows + 16 * strip * STRIDE, 16 * i);
        }
        multiply_step<Format, D, COLUMNS, MASKED>(product, a, 0, b_rows, 16 * i, chunks);
    }
}

// For each strip s: sum[s] (16 x D) += weights[s] (16 x COLUMNS, the result fragments of multiply_by_rows)
// times value_rows (COLUMNS rows of length D), over the chunks of 16 columns in chunks[s]: fragments 2c
// and 2c + 1 of the weights are the A fragment of chunk c. Each B fragment is read once for every strip.
template <typename Format, int D, int COLUMNS, bool MASKED, int STRIPS, typename Element>
__device__ __forceinline__ void accumulate_weighted_rows(float (&sum)[STRIPS][D / 8][4],
                                                         const float (&weights)[STRIPS][COLUMNS / 8][4],
                                                         const Element* value_rows, const ChunkRange (&chunks)[STRIPS])
{
    using F = Fragments<Format>;
    constexpr int STRIDE = tile_stride<Element, D>();
#pragma unroll
    for (int c = 0; c < COLUMNS / 16; ++c) {
        if (!some_strip_multiplies<MASKED>(chunks, c)) continue;
        unsigned a[STRIPS][F::A];
#pragma unroll
        for (int strip = 0; strip < STRIPS; ++strip) {
            F::weights(a[strip], weights[strip][2 * c], weights[strip][2 * c + 1]);
        }
#pragma unroll
        for (int n0 = 0; n0 < D; n0 += 16) {
            unsigned b[F::B];
            F::template columns_transposed<STRIDE>(b, value_rows + 16 * c * STRIDE, n0);
#pragma unroll
            for (int strip = 0; strip < STRIPS; ++strip) {
                if (multiplies<MASKED>(chunks, strip, c))
                    F::multiply(sum[strip][n0 / 8], sum[strip][n0 / 8 + 1], a[strip], b);
            }
        }
    }
}

// Write the warp's STRIPS strips of 16 rows of a 16 x D sum each, times `factor`, to rows first_row + ...
// of a (T, D) matrix whose rows are row_stride elements apart. Result element e of fragment n of strip s
// is row 16 s + g + 8 (e / 2), column 8n + 2t + e % 2: elements 0, 1 and 2, 3 are neighbours, one store
// each (storage.cuh's store_pair).
template <int D, int STRIPS, typename Element>
__device__ __forceinline__ void store_fragment_rows(Element* matrix, long long row_stride,
                                                    const float (&sum)[STRIPS][D / 8][4], int first_row, int T,
                                                    float factor)
{
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int strip = 0; strip < STRIPS; ++strip)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = first_row + 16 * strip + g + 8 * half;
            if (row >= T) continue;
#pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                store_pair(matrix + row * row_stride + 8 * n + 2 * t, factor * sum[strip][n][2 * half],
                           factor * sum[strip][n][2 * half + 1]);
            }
        }
}

// The key tiles that a block of WARPS warps of 16 STRIPS queries each (first_query ..) sees, KEYS keys
// each, K and V in two shared stages: tile i + 1 is copied while the warps work on tile i. Copies the
// caller started before (its query tiles) join the first group, and have landed when the work first runs.
// For each tile, each warp whose queries (warp_query ..) see some of its keys runs
// work(first_key, k_tile, v_tile, chunks, masked): for each strip of 16 queries, the chunks of 16 keys
// (from the first) that it sees, and whether some key is hidden from some of the warp's queries (past T,
// or causal past the query) so that the scores need masking.
template <int D, int WARPS, int STRIPS, int KEYS, typename Element, typename Work>
__device__ __forceinline__ void for_each_visible_key_tile(Element* k_tiles, Element* v_tiles, const Element* k,
                                                          const Element* v, long long k_row, long long v_row,
                                                          int first_query, int T, int causal, Work work)
{
    constexpr int THREADS = 32 * WARPS, ROWS = 16 * STRIPS * WARPS;
    constexpr int STRIDE = tile_stride<Element, D>(), TILE_ELEMENTS = KEYS * STRIDE;
    const int warp_query = first_query + 16 * STRIPS * (threadIdx.x / 32);
    const int tiles = ((causal ? min(first_query + ROWS, T) : T) + KEYS - 1) / KEYS;
    auto start_tile = [&](int tile) {
        const int stage = tile % 2;
        copy_rows_async<KEYS, D, STRIDE, THREADS>(k_tiles + stage * TILE_ELEMENTS, k, k_row, tile * KEYS, T);
        copy_rows_async<KEYS, D, STRIDE, THREADS>(v_tiles + stage * TILE_ELEMENTS, v, v_row, tile * KEYS, T);
    };
    start_tile(0);
    cp_async_commit();
    for (int tile = 0; tile < tiles; ++tile) {
        cp_async_wait<0>();  // this thread's copies of this tile have landed
        __syncthreads();     // and everyone's; and every warp is done with tile - 1, whose stage is refilled now
        if (tile + 1 < tiles) start_tile(tile + 1);
        cp_async_commit();
        const int first_key = tile * KEYS, stage = tile % 2;
        ChunkRange chunks[STRIPS];
        bool seen = false;
#pragma unroll
        for (int strip = 0; strip < STRIPS; ++strip) {
            const int strip_query = warp_query + 16 * strip;
            // keys up to T and (causal) up to the strip's last query; none for a strip wholly past T
            const int visible = strip_query < T ? min(T, causal ? strip_query + 16 : T) - first_key : 0;
            chunks[strip] = ChunkRange{0, min(KEYS / 16, max(0, (visible + 15) / 16))};
            seen = seen || chunks[strip].end > 0;
        }
        if (seen) {
            const bool masked = first_key + KEYS > T || (causal && first_key + KEYS - 1 > warp_query);
            work(first_key, k_tiles + stage * TILE_ELEMENTS, v_tiles + stage * TILE_ELEMENTS, chunks, masked);
        }
    }
}

// ---- forward ----------------------------------------------------------------------------------------

// One key tile of the forward for the warp's STRIPS strips of 16 queries (first_query ..): S = Q Kᵀ, the
// online softmax, O += P V. Each lane holds rows g and g + 8 of every fragment of each strip: row_max and
// row_sum [strip][0] and [strip][1]. row_max is in log2 units; row_sum is the lane's own part of the row's
// sum (its 2 columns of each fragment), added across the 4 lanes of the row once at the end: rescaling
// multiplies every part alike. MASKED: the tile reaches past T or (causal) past the warp's first query, so
// scores are masked one by one. Strip s multiplies the chunks of 16 keys in chunks[s]; the rest are hidden
// from all 16 of its rows.
template <typename Format, int D, int KEYS, int STRIPS, bool MASKED, typename Element>
__device__ __forceinline__ void forward_tile(float (&o)[STRIPS][D / 8][4], float (&row_max)[STRIPS][2],
                                             float (&row_sum)[STRIPS][2],
                                             const unsigned (&q_fragments)[STRIPS][D / 16][Fragments<Format>::A],
                                             const Element* k_tile, const Element* v_tile,
                                             const ChunkRange (&chunks)[STRIPS], int first_key, int first_query,
                                             int T, int causal, float scale_log2)
{
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    float s[STRIPS][KEYS / 8][4];
    multiply_by_rows<Format, D, KEYS, MASKED>(s, q_fragments, k_tile, chunks);
#pragma unroll
    for (int strip = 0; strip < STRIPS; ++strip) {
        // Element e of fragment j: query first_query + 16 strip + g + 8 (e / 2), key first_key + 8j + 2t + e % 2.
#pragma unroll
        for (int j = 0; j < KEYS / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[strip][j][e] *= scale_log2;  // scaled before masking: any sign of scale keeps hidden keys at -inf
                const int key = first_key + 8 * j + 2 * t + e % 2, query = first_query + 16 * strip + g + 8 * (e / 2);
                if (MASKED && (key >= T || (causal && key > query))) s[strip][j][e] = NEGATIVE_INFINITY;
            }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float tile_max = NEGATIVE_INFINITY;
#pragma unroll
            for (int j = 0; j < KEYS / 8; ++j) {
                tile_max = fmaxf(tile_max, fmaxf(s[strip][j][2 * half], s[strip][j][2 * half + 1]));
            }
            tile_max = fmaxf(tile_max, __shfl_xor_sync(FULL_MASK, tile_max, 1));  // the 4 lanes of the row
            tile_max = fmaxf(tile_max, __shfl_xor_sync(FULL_MASK, tile_max, 2));
            const float new_max = fmaxf(row_max[strip][half], tile_max);
            // A row that has seen no key yet keeps -inf as its maximum; subtracting 0 instead keeps
            // 2^(-inf - (-inf)) from becoming NaN: its weights and its rescaling are then 2^-inf = 0.
            const float base = new_max == NEGATIVE_INFINITY ? 0.0f : new_max;
            const float rescale = exp2f(row_max[strip][half] - base);
            row_max[strip][half] = new_max;
            row_sum[strip][half] *= rescale;
#pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                o[strip][n][2 * half] *= rescale;
                o[strip][n][2 * half + 1] *= rescale;
            }
#pragma unroll
            for (int j = 0; j < KEYS / 8; ++j)
#pragma unroll
                for (int e = 2 * half; e < 2 * half + 2; ++e) {
                    s[strip][j][e] = exp2f(s[strip][j][e] - base);
                    row_sum[strip][half] += s[strip][j][e];  // float32 weights; P V uses them in the input format
                }
        }
    }
    accumulate_weighted_rows<Format, D, KEYS, MASKED>(o, s, v_tile, chunks);
}

// out, lse from q, k, v: a block of WARPS warps of 16 STRIPS queries each. Dynamic shared memory: the
// query tile, then two stages of K and of V.
template <typename Element, int D, int WARPS, int KEYS, int STRIPS, typename Format = Element>
__global__ void __launch_bounds__(32 * WARPS) tensor_core_attention_forward(
    Element* __restrict__ out, float* __restrict__ lse, const Element* __restrict__ q,
    const Element* __restrict__ k, const Element* __restrict__ v, int T, int heads, int kv_heads, float scale,
    int causal, HeadLayout out_at, HeadLayout q_at, HeadLayout k_at, HeadLayout v_at)
{
    static_assert(D % 16 == 0 && KEYS % 16 == 0, "fragments are 16 wide");
    constexpr int WARP_ROWS = 16 * STRIPS, ROWS = WARP_ROWS * WARPS, THREADS = 32 * WARPS;
    constexpr int STRIDE = tile_stride<Element, D>();
    extern __shared__ __align__(16) unsigned char shared_bytes[];
    Element* q_tile = reinterpret_cast<Element*>(shared_bytes);
    Element* k_tiles = q_tile + ROWS * STRIDE;
    Element* v_tiles = k_tiles + 2 * KEYS * STRIDE;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const long long head = blockIdx.x, kv_head = kv_head_of(head, heads, kv_heads);
    const int first_query = (gridDim.y - 1 - blockIdx.y) * ROWS;  // causal: the longest rows start first
    const int warp_query = first_query + WARP_ROWS * warp;
    q += q_at.start(head, heads); out += out_at.start(head, heads); lse += head * T;
    k += k_at.start(kv_head, kv_heads); v += v_at.start(kv_head, kv_heads);
    const float scale_log2 = scale * CUDART_L2E_F;

    float o[STRIPS][D / 8][4] = {};
    float row_max[STRIPS][2], row_sum[STRIPS][2];
#pragma unroll
    for (int strip = 0; strip < STRIPS; ++strip)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            row_max[strip][half] = NEGATIVE_INFINITY;
            row_sum[strip][half] = 0.0f;
        }
    unsigned q_fragments[STRIPS][D / 16][Fragments<Format>::A];  // the warp's queries: read once, at key 0 (all see it)
    copy_rows_async<ROWS, D, STRIDE, THREADS>(q_tile, q, q_at.row, first_query, T);
    for_each_visible_key_tile<D, WARPS, STRIPS, KEYS>(k_tiles, v_tiles, k, v, k_at.row, v_at.row, first_query, T,
        causal, [&](int first_key, const Element* k_tile, const Element* v_tile, const ChunkRange (&chunks)[STRIPS],
                    bool masked) {
            if (first_key == 0 || !Fragments<Format>::KEEP_QUERIES)
                row_fragments<Format, D>(q_fragments, q_tile + WARP_ROWS * warp * STRIDE);
            if (masked)
                forward_tile<Format, D, KEYS, STRIPS, true>(o, row_max, row_sum, q_fragments, k_tile, v_tile, chunks,
                                                            first_key, warp_query, T, causal, scale_log2);
            else
                forward_tile<Format, D, KEYS, STRIPS, false>(o, row_max, row_sum, q_fragments, k_tile, v_tile, chunks,
                                                             first_key, warp_query, T, causal, scale_log2);
        });

    if (warp_query >= T) return;
#pragma unroll
    for (int strip = 0; strip < STRIPS; ++strip)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float total = row_sum[strip][half];
            total += __shfl_xor_sync(FULL_MASK, total, 1);
            total += __shfl_xor_sync(FULL_MASK, total, 2);
            const float inverse_sum = 1.0f / total;
            const int query = warp_query + 16 * strip + g + 8 * half;
            if (t == 0 && query < T) lse[query] = (row_max[strip][half] + log2f(total)) * CUDART_LN2_F;
#pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                o[strip][n][2 * half] *= inverse_sum;
                o[strip][n][2 * half + 1] *= inverse_sum;
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

// One query tile of the dk, dv pass for the warp's STRIPS strips of 16 keys (first_key ..): Sᵀ = K Qᵀ and
// dPᵀ = V dOᵀ (rows = keys, columns = queries), Pᵀ = 2^(Sᵀ scale log2 e - lse log2 e), dSᵀ = Pᵀ ⊙ (dPᵀ -
// row_dot), then dV += Pᵀ dO and dK += dSᵀ Q. lse_tile and dot_tile hold the tile's queries' lse and
// row_dot. Strip s multiplies the chunks of 16 queries in chunks[s]; the others are hidden from all 16 of
// its keys.
template <typename Format, int D, int QUERIES, int STRIPS, bool MASKED, typename Element>
__device__ __forceinline__ void dk_dv_tile(float (&dk_sum)[STRIPS][D / 8][4], float (&dv_sum)[STRIPS][D / 8][4],
                                           const Element* k_rows, const Element* v_rows, const Element* q_tile,
                                           const Element* dout_tile, const float* lse_tile, const float* dot_tile,
                                           const ChunkRange (&chunks)[STRIPS], int first_key, int first_query, int T,
                                           int causal, float scale_log2)
{
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    float p[STRIPS][QUERIES / 8][4], ds[STRIPS][QUERIES / 8][4];
    multiply_shared_rows<Format, D, QUERIES, MASKED>(p, k_rows, q_tile, chunks);
    multiply_shared_rows<Format, D, QUERIES, MASKED>(ds, v_rows, dout_tile, chunks);
    // Element e of fragment j of strip s: key first_key + 16 s + g + 8 (e / 2), query first_query + 8j + 2t + e % 2.
#pragma unroll
    for (int strip = 0; strip < STRIPS; ++strip)
#pragma unroll
        for (int j = 0; j < QUERIES / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int column = 8 * j + 2 * t + e % 2, key = first_key + 16 * strip + g + 8 * (e / 2);
                float probability = exp2f(fmaf(p[strip][j][e], scale_log2, -lse_tile[column] * CUDART_L2E_F));
                if (MASKED && (first_query + column >= T || (causal && key > first_query + column))) probability = 0.0f;
                p[strip][j][e] = probability;
                ds[strip][j][e] = probability * (ds[strip][j][e] - dot_tile[column]);
            }
    accumulate_weighted_rows<Format, D, QUERIES, MASKED>(dv_sum, p, dout_tile, chunks);
    accumulate_weighted_rows<Format, D, QUERIES, MASKED>(dk_sum, ds, q_tile, chunks);
}

// dk, dv of one key/value head's tile of WARPS warps of 16 STRIPS keys each, summed over every query head
// of its group and every query tile that sees them. Dynamic shared memory: the K and V tiles, two stages
// of Q and dO tiles, then two stages of QUERIES floats of lse and of row_dot.
template <typename Element, int D, int WARPS, int QUERIES, int STRIPS, typename Format = Element>
__global__ void __launch_bounds__(32 * WARPS) tensor_core_attention_backward_dk_dv(
    Element* __restrict__ dk, Element* __restrict__ dv, const Element* __restrict__ dout,
    const Element* __restrict__ q, const Element* __restrict__ k, const Element* __restrict__ v,
    const float* __restrict__ lse, const float* __restrict__ row_dot, int T, int heads, int kv_heads, float scale,
    int causal, HeadLayout dk_at, HeadLayout dv_at, HeadLayout dout_at, HeadLayout q_at, HeadLayout k_at,
    HeadLayout v_at)
{
    static_assert(D % 16 == 0 && QUERIES % 16 == 0, "fragments are 16 wide");
    constexpr int WARP_KEYS = 16 * STRIPS, KEYS = WARP_KEYS * WARPS, THREADS = 32 * WARPS;
    constexpr int STRIDE = tile_stride<Element, D>(), TILE_ELEMENTS = QUERIES * STRIDE;
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
    const int first_key = blockIdx.y * KEYS, warp_key = first_key + WARP_KEYS * warp;
    const float scale_log2 = scale * CUDART_L2E_F;
    // The query tiles that see these keys: causal, from the one holding the first key; in every head of the group.
    const int first_tile = causal ? first_key / QUERIES : 0;
    const int tiles_per_head = (T + QUERIES - 1) / QUERIES - first_tile, steps = group * tiles_per_head;

    // The group's query heads lie one after the other, head apart (a multiple of 16 bytes), in the same
    // batch element. Steps walk through them tile by tile; the head and tile of the step to copy next are
    // counted, not divided out of the step's number (64-bit divisions would take as many instructions as
    // the copies themselves).
    const Element* group_q = q + q_at.start(first_head, heads);
    const Element* group_dout = dout + dout_at.start(first_head, heads);
    int copy_member = 0, copy_tile = first_tile;
    auto start_next_step = [&](int stage) {
        const int first_query = copy_tile * QUERIES;
        const long long head = first_head + copy_member;
        copy_rows_async<QUERIES, D, STRIDE, THREADS>(q_tiles + stage * TILE_ELEMENTS, group_q + copy_member * q_at.head,
                                                     q_at.row, first_query, T);
        copy_rows_async<QUERIES, D, STRIDE, THREADS>(dout_tiles + stage * TILE_ELEMENTS,
                                                     group_dout + copy_member * dout_at.head, dout_at.row,
                                                     first_query, T);
        copy_floats_async<QUERIES, THREADS>(lse_tiles + stage * QUERIES, lse + head * T, first_query, T);
        copy_floats_async<QUERIES, THREADS>(dot_tiles + stage * QUERIES, row_dot + head * T, first_query, T);
        if (++copy_tile == first_tile + tiles_per_head) {
            copy_tile = first_tile;
            ++copy_member;
        }
    };
    copy_rows_async<KEYS, D, STRIDE, THREADS>(k_tile, k + k_at.start(kv_head, kv_heads), k_at.row, first_key, T);
    copy_rows_async<KEYS, D, STRIDE, THREADS>(v_tile, v + v_at.start(kv_head, kv_heads), v_at.row, first_key, T);
    start_next_step(0);
    cp_async_commit();

    float dk_sum[STRIPS][D / 8][4] = {}, dv_sum[STRIPS][D / 8][4] = {};
    int tile = first_tile;  // the query tile of this step
    for (int step = 0; step < steps; ++step) {
        cp_async_wait<0>();  // this thread's copies of this step have landed
        __syncthreads();     // and everyone's; and every warp is done with step - 1, whose stage is refilled now
        if (step + 1 < steps) start_next_step((step + 1) % 2);
        cp_async_commit();
        const int first_query = tile * QUERIES, stage = step % 2;
        // For each strip, the chunks of 16 queries that see its keys: causal, from the chunk of its first
        // key; before T. None for a strip wholly past T.
        const int end = min(QUERIES / 16, (T - first_query + 15) / 16);
        ChunkRange chunks[STRIPS];
        bool seen = false;
#pragma unroll
        for (int strip = 0; strip < STRIPS; ++strip) {
            const int strip_key = warp_key + 16 * strip;
            const int begin = causal ? max(0, (strip_key - first_query) / 16) : 0;
            chunks[strip] = strip_key < T ? ChunkRange{begin, end} : ChunkRange{0, 0};
            seen = seen || chunks[strip].begin < chunks[strip].end;
        }
        if (seen) {
            const Element* k_rows = k_tile + WARP_KEYS * warp * STRIDE;
            const Element* v_rows = v_tile + WARP_KEYS * warp * STRIDE;
            const Element* q_rows = q_tiles + stage * TILE_ELEMENTS;
            const Element* dout_rows = dout_tiles + stage * TILE_ELEMENTS;
            const float* lse_tile = lse_tiles + stage * QUERIES;
            const float* dot_tile = dot_tiles + stage * QUERIES;
            if (first_query + QUERIES > T || (causal && first_query < warp_key + WARP_KEYS - 1))
                dk_dv_tile<Format, D, QUERIES, STRIPS, true>(dk_sum, dv_sum, k_rows, v_rows, q_rows, dout_rows,
                                                             lse_tile, dot_tile, chunks, warp_key, first_query, T,
                                                             causal, scale_log2);
            else
                dk_dv_tile<Format, D, QUERIES, STRIPS, false>(dk_sum, dv_sum, k_rows, v_rows, q_rows, dout_rows,
                                                              lse_tile, dot_tile, chunks, warp_key, first_query, T,
                                                              causal, scale_log2);
        }
        if (++tile == first_tile + tiles_per_head) tile = first_tile;  // on to the group's next head
    }
    store_fragment_rows<D>(dk + dk_at.start(kv_head, kv_heads), dk_at.row, dk_sum, warp_key, T, scale);
    store_fragment_rows<D>(dv + dv_at.start(kv_head, kv_heads), dv_at.row, dv_sum, warp_key, T, 1.0f);
}

// One key tile of the dq pass for the warp's STRIPS strips of 16 queries: S = Q Kᵀ, dP = dO Vᵀ, P from lse,
// dS, dQ += dS K. lse2 and dot: the lane's rows g and g + 8 of each strip, lse in log2 units.
template <typename Format, int D, int KEYS, int STRIPS, bool MASKED, typename Element>
__device__ __forceinline__ void dq_tile(float (&dq_sum)[STRIPS][D / 8][4], const Element* q_rows,
                                        const Element* dout_rows, const Element* k_tile, const Element* v_tile,
                                        const float (&lse2)[STRIPS][2], const float (&dot)[STRIPS][2],
                                        const ChunkRange (&chunks)[STRIPS], int first_key, int first_query, int T,
                                        int causal, float scale_log2)
{
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    float p[STRIPS][KEYS / 8][4], ds[STRIPS][KEYS / 8][4];
    multiply_shared_rows<Format, D, KEYS, MASKED>(p, q_rows, k_tile, chunks);
    multiply_shared_rows<Format, D, KEYS, MASKED>(ds, dout_rows, v_tile, chunks);
#pragma unroll
    for (int strip = 0; strip < STRIPS; ++strip)
#pragma unroll
        for (int j = 0; j < KEYS / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = first_key + 8 * j + 2 * t + e % 2, query = first_query + 16 * strip + g + 8 * (e / 2);
                float probability = exp2f(fmaf(p[strip][j][e], scale_log2, -lse2[strip][e / 2]));
                if (MASKED && (key >= T || (causal && key > query))) probability = 0.0f;
                ds[strip][j][e] = probability * (ds[strip][j][e] - dot[strip][e / 2]);
            }
    accumulate_weighted_rows<Format, D, KEYS, MASKED>(dq_sum, ds, k_tile, chunks);
}

// dq of one tile of WARPS warps of 16 STRIPS queries each of one head. Dynamic shared memory: the Q and dO
// tiles, then two stages of K and of V.
template <typename Element, int D, int WARPS, int KEYS, int STRIPS, typename Format = Element>
__global__ void __launch_bounds__(32 * WARPS) tensor_core_attention_backward_dq(
    Element* __restrict__ dq, const Element* __restrict__ dout, const Element* __restrict__ q,
    const Element* __restrict__ k, const Element* __restrict__ v, const float* __restrict__ lse,
    const float* __restrict__ row_dot, int T, int heads, int kv_heads, float scale, int causal, HeadLayout dq_at,
    HeadLayout dout_at, HeadLayout q_at, HeadLayout k_at, HeadLayout v_at)
{
    static_assert(D % 16 == 0 && KEYS % 16 == 0, "fragments are 16 wide");
    constexpr int WARP_ROWS = 16 * STRIPS, ROWS = WARP_ROWS * WARPS, THREADS = 32 * WARPS;
    constexpr int STRIDE = tile_stride<Element, D>();
    extern __shared__ __align__(16) unsigned char shared_bytes[];
    Element* q_tile = reinterpret_cast<Element*>(shared_bytes);
    Element* dout_tile = q_tile + ROWS * STRIDE;
    Element* k_tiles = dout_tile + ROWS * STRIDE;
    Element* v_tiles = k_tiles + 2 * KEYS * STRIDE;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4;
    const long long head = blockIdx.x, kv_head = kv_head_of(head, heads, kv_heads);
    const int first_query = (gridDim.y - 1 - blockIdx.y) * ROWS, warp_query = first_query + WARP_ROWS * warp;
    q += q_at.start(head, heads); dq += dq_at.start(head, heads); dout += dout_at.start(head, heads);
    lse += head * T; row_dot += head * T;
    k += k_at.start(kv_head, kv_heads); v += v_at.start(kv_head, kv_heads);
    const float scale_log2 = scale * CUDART_L2E_F;

    float lse2[STRIPS][2], dot[STRIPS][2];
#pragma unroll
    for (int strip = 0; strip < STRIPS; ++strip)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int query = warp_query + 16 * strip + g + 8 * half;
            lse2[strip][half] = query < T ? lse[query] * CUDART_L2E_F : 0.0f;
            dot[strip][half] = query < T ? row_dot[query] : 0.0f;
        }
    float dq_sum[STRIPS][D / 8][4] = {};
    copy_rows_async<ROWS, D, STRIDE, THREADS>(q_tile, q, q_at.row, first_query, T);
    copy_rows_async<ROWS, D, STRIDE, THREADS>(dout_tile, dout, dout_at.row, first_query, T);
    for_each_visible_key_tile<D, WARPS, STRIPS, KEYS>(k_tiles, v_tiles, k, v, k_at.row, v_at.row, first_query, T,
        causal, [&](int first_key, const Element* k_tile, const Element* v_tile, const ChunkRange (&chunks)[STRIPS],
                    bool masked) {
            const Element* q_rows = q_tile + WARP_ROWS * warp * STRIDE;
            const Element* dout_rows = dout_tile + WARP_ROWS * warp * STRIDE;
            if (masked)
                dq_tile<Format, D, KEYS, STRIPS, true>(dq_sum, q_rows, dout_rows, k_tile, v_tile, lse2, dot, chunks,
                                                       first_key, warp_query, T, causal, scale_log2);
            else
                dq_tile<Format, D, KEYS, STRIPS, false>(dq_sum, q_rows, dout_rows, k_tile, v_tile, lse2, dot, chunks,
                                                        first_key, warp_query, T, causal, scale_log2);
        });
    store_fragment_rows<D>(dq, dq_at.row, dq_sum, warp_query, T, scale);
}
