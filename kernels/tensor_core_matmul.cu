// C = op(A) @ op(B), or C += op(A) @ op(B), on tensor cores with float32 sums; op(X) is X or its transpose,
// chosen at compile time. op(A) is M x K, op(B) is K x N, C is M x N, row-major and contiguous. Stored rows
// of A and B are lda and ldb elements apart. blockIdx.z picks one product of a batch (batch_stride_* elements
// apart). Three ways to multiply:
//   tf32_matmul<1, ...>  TF32: each float rounded to 10 mantissa bits, one mma per tile (about 1e-3 relative)
//   tf32_matmul<3, ...>  3xTF32: each float split into big + small TF32 parts, three mmas per tile
//                        (big·big + big·small + small·big; small·small is below float32's precision)
//   bf16_matmul<...>     bf16 inputs (8 mantissa bits), from float_to_bf16's copies or a bf16 model; its
//                        output C is float32 (the sums as they are) or bf16 (rounded once, after adding a
//                        float32 bias: the Linear layer of a model trained in bf16)
//
// A block of 256 threads (8 warps) computes a 128 x 128 tile of C, walking along K 32 at a time:
//  - each operand's 128 x 32 slice travels to shared memory by cp.async, STAGES slices in flight, kept
//    as it is stored (no transpose on the way): k-contiguous ("K_CONTIGUOUS", A as given or B transposed)
//    or m/n-contiguous; rows are padded so that the fragment loads below hit 32 different banks;
//  - each warp computes a 64 x 32 part of the tile as 4 x 4 mma tiles of 16 x 8, its fragments read by
//    ldmatrix (bf16 in both layouts, with .trans where the layout needs it; TF32 k-contiguous) or by one
//    32-bit load per element (TF32 m/n-contiguous: ldmatrix moves 16-bit values, its .trans cannot
//    transpose 32-bit ones).
// WIDE_COPIES: rows start on 16 bytes (ld a multiple of 16 bytes, arrays aligned), so slices move in
// 16-byte copies; otherwise (float32 only) in 4-byte ones. Outside the matrices the copies write zeros.
#include "mma.cuh"
#include "storage.cuh"

constexpr int TILE = 128;    // rows and columns of C per block
constexpr int DEPTH = 32;    // elements of K per slice
constexpr int STAGES = 3;    // slices in flight
static_assert(STAGES >= 2, "the pipeline needs a slice in flight while another one is multiplied");
constexpr int THREADS = 256;
constexpr int WARP_ROWS = 64, WARP_COLUMNS = 32;               // a warp's part of the tile
constexpr int M_TILES = WARP_ROWS / 16, N_TILES = WARP_COLUMNS / 8;  // its mma tiles

// A bf16 value (<cuda_bf16.h>'s type, through storage.cuh): the arrays are ml_dtypes' bfloat16, or uint16
// holding the same bits. The products never look at its value: cp.async and ldmatrix move its 16 bits.
typedef __nv_bfloat16 bf16;

// Shared-memory rows of a slice: k-contiguous slices are TILE rows of DEPTH elements, the others DEPTH rows
// of TILE elements. Padding: a k-contiguous row is 16 bytes longer, so 8 consecutive rows start on 8
// different groups of 4 banks (ldmatrix reads 8 rows of 16 bytes at once; TF32's a[0] loads read rows g
// at word t). An m/n-contiguous row of floats is 32 bytes longer, so that row t, column g lands on bank
// 8t + g (TF32's one-element loads); of bf16, 16 bytes (ldmatrix.trans again reads 8 rows of 16 bytes).
template <typename Element, bool K_CONTIGUOUS>
struct Slice {
    static constexpr int ROWS = K_CONTIGUOUS ? TILE : DEPTH;
    static constexpr int COLUMNS = K_CONTIGUOUS ? DEPTH : TILE;
    static constexpr int PADDING = (K_CONTIGUOUS || sizeof(Element) == 2 ? 16 : 32) / sizeof(Element);
    static constexpr int STRIDE = COLUMNS + PADDING;   // elements from one shared row to the next
    static constexpr int ELEMENTS = ROWS * STRIDE;
};

// Start copying one slice of a stored matrix (rows x columns, row stride ld) into `slice`: its rows
// first_row.. and columns first_column.. . Each copy reads the elements inside the matrix and zero-fills
// the rest, so a slice past an edge holds zeros, which add nothing to the sums.
template <typename Element, bool K_CONTIGUOUS, bool WIDE_COPIES>
__device__ __forceinline__ void copy_slice(Element* slice, const Element* matrix, int rows, int columns, int ld,
                                           int first_row, int first_column)
{
    typedef Slice<Element, K_CONTIGUOUS> Shape;
    constexpr int PER_COPY = WIDE_COPIES ? 16 / sizeof(Element) : 1;
    constexpr int COPIES_PER_ROW = Shape::COLUMNS / PER_COPY;
#pragma unroll
    for (int copy = threadIdx.x; copy < Shape::ROWS * COPIES_PER_ROW; copy += THREADS) {
        const int row = copy / COPIES_PER_ROW, column = copy % COPIES_PER_ROW * PER_COPY;
        const int matrix_row = first_row + row, matrix_column = first_column + column;
        const int inside = matrix_row < rows ? max(0, min(PER_COPY, columns - matrix_column)) : 0;
        const Element* source = inside > 0 ? matrix + (long long)matrix_row * ld + matrix_column : matrix;
        const unsigned destination = shared_address(slice + row * Shape::STRIDE + column);
        if (WIDE_COPIES) {
            cp_async_16(destination, source, inside * (int)sizeof(Element));
        } else {
            cp_async_4(destination, source, inside * (int)sizeof(Element));
        }
    }
}

// TF32 fragments of the warp's A (rows first_row..+15) and B (columns first_column..+7) for k = k0..k0+7,
// as float32 bits; the caller rounds or splits them. Element (i, k) of op(A) sits at slice[i][k] when
// k-contiguous, else at slice[k][i]; likewise (k, j) of op(B) at slice[j][k] or slice[k][j].
template <bool K_CONTIGUOUS>
__device__ __forceinline__ void tf32_a_fragment(unsigned (&a)[4], const float* slice, int first_row, int k0)
{
    typedef Slice<float, K_CONTIGUOUS> Shape;
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    if (K_CONTIGUOUS) {
        // four 8 x 4 blocks of floats: rows 0-7 and 8-15 at k0, then at k0 + 4; lane 8q + r names row r of block q
        ldmatrix_x4(a, shared_address(slice + (first_row + lane % 16) * Shape::STRIDE + k0 + lane / 16 * 4));
    } else {
        const float* column = slice + first_row + g;
        a[0] = __float_as_uint(column[(k0 + t) * Shape::STRIDE]);
        a[1] = __float_as_uint(column[(k0 + t) * Shape::STRIDE + 8]);
        a[2] = __float_as_uint(column[(k0 + t + 4) * Shape::STRIDE]);
        a[3] = __float_as_uint(column[(k0 + t + 4) * Shape::STRIDE + 8]);
    }
}

template <bool K_CONTIGUOUS>
__device__ __forceinline__ void tf32_b_fragment(unsigned (&b)[2], const float* slice, int first_column, int k0)
{
    typedef Slice<float, K_CONTIGUOUS> Shape;
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    if (K_CONTIGUOUS) {
        // two 8 x 4 blocks: columns 0-7 at k0 and at k0 + 4 (lanes 16-31 repeat 0-15's valid addresses)
        ldmatrix_x2(b, shared_address(slice + (first_column + lane % 8) * Shape::STRIDE + k0 + lane / 8 % 2 * 4));
    } else {
        b[0] = __float_as_uint(slice[(k0 + t) * Shape::STRIDE + first_column + g]);
        b[1] = __float_as_uint(slice[(k0 + t + 4) * Shape::STRIDE + first_column + g]);
    }
}

// bf16 fragments for k = k0..k0+15, both layouts through ldmatrix: lane 8q + r names row r of 8 x 8 block q.
template <bool K_CONTIGUOUS>
__device__ __forceinline__ void bf16_a_fragment(unsigned (&a)[4], const bf16* slice, int first_row, int k0)
{
    typedef Slice<bf16, K_CONTIGUOUS> Shape;
    const int lane = threadIdx.x % 32, block = lane / 8, r = lane % 8;
    if (K_CONTIGUOUS) {
        // blocks: rows 0-7 and 8-15 at k0, then at k0 + 8
        ldmatrix_x4(a, shared_address(slice + (first_row + lane % 16) * Shape::STRIDE + k0 + lane / 16 * 8));
    } else {
        // stored k-major: block q holds k0 + 8 (q / 2) + r, rows first_row + 8 (q % 2) .. +7, transposed on the way
        ldmatrix_x4_trans(a, shared_address(slice + (k0 + block / 2 * 8 + r) * Shape::STRIDE + first_row + block % 2 * 8));
    }
}

template <bool K_CONTIGUOUS>
__device__ __forceinline__ void bf16_b_fragment(unsigned (&b)[2], const bf16* slice, int first_column, int k0)
{
    typedef Slice<bf16, K_CONTIGUOUS> Shape;
    const int lane = threadIdx.x % 32, block = lane / 8 % 2, r = lane % 8;
    if (K_CONTIGUOUS) {
        ldmatrix_x2(b, shared_address(slice + (first_column + r) * Shape::STRIDE + k0 + block * 8));
    } else {
        ldmatrix_x2_trans(b, shared_address(slice + (k0 + block * 8 + r) * Shape::STRIDE + first_column));
    }
}

// One slice's products for the warp: its 4 x 4 mma tiles, DEPTH / 8 steps of TF32 or DEPTH / 16 of bf16.
template <int PRODUCTS, bool A_K_CONTIGUOUS, bool B_K_CONTIGUOUS>
__device__ __forceinline__ void multiply_slice(float (&acc)[M_TILES][N_TILES][4], const float* a_slice,
                                               const float* b_slice, int warp_row, int warp_column)
{
#pragma unroll
    for (int k0 = 0; k0 < DEPTH; k0 += 8) {
        unsigned a_big[M_TILES][4], a_small[M_TILES][4], b_big[N_TILES][2], b_small[N_TILES][2];
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) {
            tf32_a_fragment<A_K_CONTIGUOUS>(a_big[i], a_slice, warp_row + 16 * i, k0);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                if (PRODUCTS == 3) split_tf32(__uint_as_float(a_big[i][e]), a_big[i][e], a_small[i][e]);
                else a_big[i][e] = to_tf32(__uint_as_float(a_big[i][e]));
            }
        }
#pragma unroll
        for (int j = 0; j < N_TILES; ++j) {
            tf32_b_fragment<B_K_CONTIGUOUS>(b_big[j], b_slice, warp_column + 8 * j, k0);
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                if (PRODUCTS == 3) split_tf32(__uint_as_float(b_big[j][e]), b_big[j][e], b_small[j][e]);
                else b_big[j][e] = to_tf32(__uint_as_float(b_big[j][e]));
            }
        }
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) {
#pragma unroll
            for (int j = 0; j < N_TILES; ++j) {
                if (PRODUCTS == 3) {  // the small corrections first, while the sum is still small
                    mma_m16n8k8_tf32(acc[i][j], a_small[i], b_big[j]);
                    mma_m16n8k8_tf32(acc[i][j], a_big[i], b_small[j]);
                }
                mma_m16n8k8_tf32(acc[i][j], a_big[i], b_big[j]);
            }
        }
    }
}

template <int PRODUCTS, bool A_K_CONTIGUOUS, bool B_K_CONTIGUOUS>
__device__ __forceinline__ void multiply_slice(float (&acc)[M_TILES][N_TILES][4], const bf16* a_slice,
                                               const bf16* b_slice, int warp_row, int warp_column)
{
#pragma unroll
    for (int k0 = 0; k0 < DEPTH; k0 += 16) {
        unsigned a[M_TILES][4], b[N_TILES][2];
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) bf16_a_fragment<A_K_CONTIGUOUS>(a[i], a_slice, warp_row + 16 * i, k0);
#pragma unroll
        for (int j = 0; j < N_TILES; ++j) bf16_b_fragment<B_K_CONTIGUOUS>(b[j], b_slice, warp_column + 8 * j, k0);
#pragma unroll
        for (int i = 0; i < M_TILES; ++i)
#pragma unroll
            for (int j = 0; j < N_TILES; ++j) mma_m16n8k16_bf16(acc[i][j], a[i], b[j]);
    }
}

// The whole product for one block, either element type: the pipeline of slices, then the store, into a C of
// float or bf16 (Output), with bias[column] added to each sum when bias is not null.
template <typename Element, int PRODUCTS, bool TRANSPOSE_A, bool TRANSPOSE_B, bool WIDE_COPIES, typename Output>
__device__ __forceinline__ void block_product(Output* C, const Element* A, const Element* B, const float* bias,
                                              int M, int N, int K, int lda, int ldb, int accumulate, Element* shared)
{
    constexpr bool A_K_CONTIGUOUS = !TRANSPOSE_A, B_K_CONTIGUOUS = TRANSPOSE_B;
    typedef Slice<Element, A_K_CONTIGUOUS> ASlice;
    typedef Slice<Element, B_K_CONTIGUOUS> BSlice;
    Element* a_slices = shared;                                // STAGES slices of A, then STAGES of B
    Element* b_slices = shared + STAGES * ASlice::ELEMENTS;
    const int m0 = blockIdx.y * TILE, n0 = blockIdx.x * TILE;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int warp_row = warp / 4 * WARP_ROWS, warp_column = warp % 4 * WARP_COLUMNS;

    // Slice s covers k = s * DEPTH.. . Stored shapes: A is M x K (K x M transposed), B is K x N (N x K).
    auto start_slice = [&](int s) {
        const int stage = s % STAGES, k0 = s * DEPTH;
        if (A_K_CONTIGUOUS) copy_slice<Element, true, WIDE_COPIES>(a_slices + stage * ASlice::ELEMENTS, A, M, K, lda, m0, k0);
        else copy_slice<Element, false, WIDE_COPIES>(a_slices + stage * ASlice::ELEMENTS, A, K, M, lda, k0, m0);
        if (B_K_CONTIGUOUS) copy_slice<Element, true, WIDE_COPIES>(b_slices + stage * BSlice::ELEMENTS, B, N, K, ldb, n0, k0);
        else copy_slice<Element, false, WIDE_COPIES>(b_slices + stage * BSlice::ELEMENTS, B, K, N, ldb, k0, n0);
    };

    float acc[M_TILES][N_TILES][4];
#pragma unroll
    for (int i = 0; i < M_TILES; ++i)
#pragma unroll
        for (int j = 0; j < N_TILES; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

    // Fill the pipeline: STAGES - 1 slices in flight before the first multiply. Every thread commits a group
    // per slice, even an empty one past the end, so that "all but the newest STAGES - 2 groups" always
    // means "up to this slice".
    const int slices = (K + DEPTH - 1) / DEPTH;
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < slices) start_slice(s);
        cp_async_commit();
    }
    for (int s = 0; s < slices; ++s) {
        cp_async_wait<STAGES - 2>();  // this thread's copies of slice s have landed
        __syncthreads();              // and everyone's; and everyone is done with slice s - 1's stage
        // The stage that held slice s - 1 is free: refill it with slice s + STAGES - 1 while we multiply.
        if (s + STAGES - 1 < slices) start_slice(s + STAGES - 1);
        cp_async_commit();
        const int stage = s % STAGES;
        if (PRODUCTS == 3) {
            // A tensor core adds into its accumulator with the addends aligned to the largest and the bits
            // below cut off, so small corrections added into a large running sum are lost. 3xTF32 sums
            // each slice from zero, where the corrections keep their bits, and adds the slice to the
            // running sum on the CUDA cores, rounded to nearest.
            float slice_sum[M_TILES][N_TILES][4] = {};
            multiply_slice<PRODUCTS, A_K_CONTIGUOUS, B_K_CONTIGUOUS>(
                slice_sum, a_slices + stage * ASlice::ELEMENTS, b_slices + stage * BSlice::ELEMENTS, warp_row, warp_column);
#pragma unroll
            for (int i = 0; i < M_TILES; ++i)
#pragma unroll
                for (int j = 0; j < N_TILES; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[i][j][e] += slice_sum[i][j][e];
        } else {
            multiply_slice<PRODUCTS, A_K_CONTIGUOUS, B_K_CONTIGUOUS>(
                acc, a_slices + stage * ASlice::ELEMENTS, b_slices + stage * BSlice::ELEMENTS, warp_row, warp_column);
        }
    }

    // d[0], d[1] of tile (i, j) are row g, columns 2t and 2t + 1; d[2], d[3] the same 8 rows further down.
    // The bias and an accumulated C are added to the float32 sum, so a bf16 C is rounded once.
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int i = 0; i < M_TILES; ++i) {
#pragma unroll
        for (int j = 0; j < N_TILES; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = m0 + warp_row + 16 * i + g + 8 * (e / 2);
                const int column = n0 + warp_column + 8 * j + 2 * t + e % 2;
                if (row < M && column < N) {
                    Output* out = C + (long long)row * N + column;
                    const float sum = bias ? acc[i][j][e] + bias[column] : acc[i][j][e];
                    *out = from_float<Output>(accumulate ? to_float(*out) + sum : sum);
                }
            }
        }
    }
}

// Dynamic shared memory: STAGES slices of A and of B (the launcher asks for shared_bytes<...>()).
template <int PRODUCTS, bool TRANSPOSE_A, bool TRANSPOSE_B, bool WIDE_COPIES>
__global__ void __launch_bounds__(THREADS) tf32_matmul(
    float* __restrict__ C, const float* __restrict__ A, const float* __restrict__ B, int M, int N, int K, int lda,
    int ldb, long long batch_stride_a, long long batch_stride_b, long long batch_stride_c, int accumulate)
{
    extern __shared__ __align__(16) unsigned char shared_bytes[];
    block_product<float, PRODUCTS, TRANSPOSE_A, TRANSPOSE_B, WIDE_COPIES, float>(
        C + blockIdx.z * batch_stride_c, A + blockIdx.z * batch_stride_a, B + blockIdx.z * batch_stride_b,
        nullptr, M, N, K, lda, ldb, accumulate, reinterpret_cast<float*>(shared_bytes));
}

// Output: float (C holds the float32 sums) or bf16 (rounded once). bias: C_out floats, or null for none.
template <bool TRANSPOSE_A, bool TRANSPOSE_B, typename Output = float>
__global__ void __launch_bounds__(THREADS) bf16_matmul(
    Output* __restrict__ C, const bf16* __restrict__ A, const bf16* __restrict__ B, const float* __restrict__ bias,
    int M, int N, int K, int lda, int ldb, long long batch_stride_a, long long batch_stride_b,
    long long batch_stride_c, int accumulate)
{
    extern __shared__ __align__(16) unsigned char shared_bytes[];
    block_product<bf16, 1, TRANSPOSE_A, TRANSPOSE_B, true, Output>(
        C + blockIdx.z * batch_stride_c, A + blockIdx.z * batch_stride_a, B + blockIdx.z * batch_stride_b,
        bias, M, N, K, lda, ldb, accumulate, reinterpret_cast<bf16*>(shared_bytes));
}

// out (rows x ld, ld >= columns) = x (rows x columns, float32) in bf16, rounded to nearest (ties to even),
// zeros in the columns past x's: bf16 rows of a multiple of 8 elements start on 16 bytes. NaN stays NaN.
extern "C" __global__ void float_to_bf16(bf16* out, const float* x, int rows, int columns, int ld)
{
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= (long long)rows * ld) return;
    const int row = i / ld, column = i % ld;
    unsigned bits = 0;
    if (column < columns) {
        bits = __float_as_uint(x[(long long)row * columns + column]);
        const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
        // adding 0x7fff and the lowest kept bit carries into the kept bits exactly when the dropped ones
        // are above half, or at half with the kept part odd
        bits = nan ? (bits | 0x00400000u) : bits + 0x7fffu + ((bits >> 16) & 1u);
    }
    out[i] = __ushort_as_bfloat16((unsigned short)(bits >> 16));
}
