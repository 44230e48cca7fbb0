// C = op(A) @ op(B), or C += op(A) @ op(B), in float32, every matrix row-major and contiguous;
// op(X) is X or its transpose, chosen at compile time. op(A) is M x K, op(B) is K x N, C is M x N.
// blockIdx.z picks one product of a batch (batch_stride_* floats apart), or, with k_per_split > 0, one
// stretch of K of a single product (split-K): each stretch writes its partial sums to its own M x N slab
// of C, and matmul_sum_splits adds the slabs up.
//
// A block of 256 threads computes a 128 x 128 tile of C, stepping through K eight at a time:
//  - both slices (128 x 8 of op(A), 8 x 128 of op(B)) are kept in shared memory k-major, tile[k][i],
//    so a thread reads four neighbouring values of either with one float4 load;
//  - each thread computes 8 x 8 outputs, as four 4 x 4 quads 16 rows and 32 columns apart, which
//    makes the eight warps cover 32 x 64 sub-tiles with conflict-free float4 loads from shared memory;
//  - two shared buffers: while the block multiplies one slice, the next one travels from global
//    memory into registers, and is stored into the other buffer afterwards (one __syncthreads per slice).
// VECTOR_LOADS: the contiguous dimension of A, B and C is a multiple of 4 and every pointer is 16-byte
// aligned, so global memory is read and written as float4; otherwise float by float.

constexpr int TILE_M = 128;   // rows of C per block (and columns: the tile is square)
constexpr int TILE_K = 8;     // depth of one slice of K
constexpr int THREADS = 256;
constexpr int PADDING = 4;    // floats added to each shared row: see store_slice
constexpr int LOADS_PER_THREAD = TILE_M * TILE_K / 4 / THREADS;  // float4s of each slice per thread

// Four consecutive floats of a row-major rows x cols matrix, from (row, col) on; zero outside it.
template <bool VECTOR_LOADS>
__device__ __forceinline__ float4 load_four(const float* matrix, int rows, int cols, int row, int col)
{
    float4 value = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (row >= rows) return value;
    const float* start = matrix + (long long)row * cols + col;
    if (VECTOR_LOADS) {
        // cols is a multiple of 4 and so is col: the four are all inside the row or all outside
        if (col < cols) value = *reinterpret_cast<const float4*>(start);
    } else {
        if (col + 0 < cols) value.x = start[0];
        if (col + 1 < cols) value.y = start[1];
        if (col + 2 < cols) value.z = start[2];
        if (col + 3 < cols) value.w = start[3];
    }
    return value;
}

// One slice of op(X) from global memory into registers. X is stored rows x cols. K_ALONG_ROWS: k runs
// along the stored rows (A as given, or B transposed), so the slice is 128 stored rows by 8 values of k;
// otherwise it is 8 stored rows (values of k) by 128. `outer` is the slice's first row of op(A)
// (or column of op(B)), k0 its first k.
template <bool K_ALONG_ROWS, bool VECTOR_LOADS>
__device__ __forceinline__ void load_slice(const float* X, int rows, int cols, int outer, int k0,
                                           float4 (&staged)[LOADS_PER_THREAD])
{
#pragma unroll
    for (int i = 0; i < LOADS_PER_THREAD; ++i) {
        int chunk = threadIdx.x + i * THREADS;
        if (K_ALONG_ROWS) {
            staged[i] = load_four<VECTOR_LOADS>(X, rows, cols, outer + chunk / (TILE_K / 4), k0 + chunk % (TILE_K / 4) * 4);
        } else {
            staged[i] = load_four<VECTOR_LOADS>(X, rows, cols, k0 + chunk / (TILE_M / 4), outer + chunk % (TILE_M / 4) * 4);
        }
    }
}

// The staged slice into shared memory, k-major: tile[k][i]. When k ran along the stored rows the four
// values of a float4 belong to four different k and are written one by one (a transpose on the way);
// the padding shifts each tile row by 4 banks, so those writes from one warp hit 32 different banks.
template <bool K_ALONG_ROWS>
__device__ __forceinline__ void store_slice(float (*tile)[TILE_M + PADDING], const float4 (&staged)[LOADS_PER_THREAD])
{
#pragma unroll
    for (int i = 0; i < LOADS_PER_THREAD; ++i) {
        int chunk = threadIdx.x + i * THREADS;
        if (K_ALONG_ROWS) {
            int outer = chunk / (TILE_K / 4), k = chunk % (TILE_K / 4) * 4;
            tile[k + 0][outer] = staged[i].x;
            tile[k + 1][outer] = staged[i].y;
            tile[k + 2][outer] = staged[i].z;
            tile[k + 3][outer] = staged[i].w;
        } else {
            int k = chunk / (TILE_M / 4), outer = chunk % (TILE_M / 4) * 4;
            *reinterpret_cast<float4*>(&tile[k][outer]) = staged[i];
        }
    }
}

// Four results into C at (row, col..col+3), added to what is there when accumulate is set.
template <bool VECTOR_LOADS>
__device__ __forceinline__ void store_four(float* C, int M, int N, int row, int col, float4 value, int accumulate)
{
    if (row >= M) return;
    float* start = C + (long long)row * N + col;
    if (VECTOR_LOADS) {
        if (col >= N) return;
        if (accumulate) {
            float4 old = *reinterpret_cast<const float4*>(start);
            value.x += old.x; value.y += old.y; value.z += old.z; value.w += old.w;
        }
        *reinterpret_cast<float4*>(start) = value;
    } else {
        float v[4] = {value.x, value.y, value.z, value.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (col + j < N) start[j] = accumulate ? start[j] + v[j] : v[j];
        }
    }
}

template <bool TRANSPOSE_A, bool TRANSPOSE_B, bool VECTOR_LOADS>
__global__ void __launch_bounds__(256, 2) matmul(
    float* __restrict__ C, const float* __restrict__ A, const float* __restrict__ B, int M, int N, int K,
    long long batch_stride_a, long long batch_stride_b, long long batch_stride_c, int k_per_split, int accumulate)
{
    __shared__ __align__(16) float a_tiles[2][TILE_K][TILE_M + PADDING];
    __shared__ __align__(16) float b_tiles[2][TILE_K][TILE_M + PADDING];
    A += blockIdx.z * batch_stride_a;
    B += blockIdx.z * batch_stride_b;
    C += blockIdx.z * batch_stride_c;
    const int m0 = blockIdx.y * TILE_M;
    const int n0 = blockIdx.x * TILE_M;
    // The stretch of K this block sums over (k_per_split is a multiple of TILE_K).
    const int k_begin = k_per_split > 0 ? blockIdx.z * k_per_split : 0;
    const int k_end = k_per_split > 0 ? min(K, k_begin + k_per_split) : K;
    // Stored shapes: A is M x K (or K x M when transposed), B is K x N (or N x K).
    const int a_rows = TRANSPOSE_A ? K : M, a_cols = TRANSPOSE_A ? M : K;
    const int b_rows = TRANSPOSE_B ? N : K, b_cols = TRANSPOSE_B ? K : N;

    // Warp w covers rows (w / 2) * 32 .. +31 and columns (w % 2) * 64 .. +63 of the tile; inside it, lane l
    // owns the 4 x 4 quads at rows first_row + {0, 16} and columns first_col + {0, 32}.
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int first_row = (warp / 2) * 32 + (lane / 8) * 4;
    const int first_col = (warp % 2) * 64 + (lane % 8) * 4;

    float acc[8][8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;

    float4 a_staged[LOADS_PER_THREAD], b_staged[LOADS_PER_THREAD];
    load_slice<!TRANSPOSE_A, VECTOR_LOADS>(A, a_rows, a_cols, m0, k_begin, a_staged);
    load_slice<TRANSPOSE_B, VECTOR_LOADS>(B, b_rows, b_cols, n0, k_begin, b_staged);
    store_slice<!TRANSPOSE_A>(a_tiles[0], a_staged);
    store_slice<TRANSPOSE_B>(b_tiles[0], b_staged);
    __syncthreads();

    const int slices = (k_end - k_begin + TILE_K - 1) / TILE_K;
    for (int slice = 0; slice < slices; ++slice) {
        const int current = slice % 2;
        const bool more = slice + 1 < slices;
        if (more) {  // start the next slice's global loads; their latency hides behind the FMAs below
            const int k0 = k_begin + (slice + 1) * TILE_K;
            load_slice<!TRANSPOSE_A, VECTOR_LOADS>(A, a_rows, a_cols, m0, k0, a_staged);
            load_slice<TRANSPOSE_B, VECTOR_LOADS>(B, b_rows, b_cols, n0, k0, b_staged);
        }
#pragma unroll
        for (int k = 0; k < TILE_K; ++k) {
            const float4 a_low = *reinterpret_cast<const float4*>(&a_tiles[current][k][first_row]);
            const float4 a_high = *reinterpret_cast<const float4*>(&a_tiles[current][k][first_row + 16]);
            const float4 b_low = *reinterpret_cast<const float4*>(&b_tiles[current][k][first_col]);
            const float4 b_high = *reinterpret_cast<const float4*>(&b_tiles[current][k][first_col + 32]);
            const float a[8] = {a_low.x, a_low.y, a_low.z, a_low.w, a_high.x, a_high.y, a_high.z, a_high.w};
            const float b[8] = {b_low.x, b_low.y, b_low.z, b_low.w, b_high.x, b_high.y, b_high.z, b_high.w};
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] += a[i] * b[j];
        }
        if (more) {  // the other buffer was last read before the previous __syncthreads: free to overwrite
            store_slice<!TRANSPOSE_A>(a_tiles[1 - current], a_staged);
            store_slice<TRANSPOSE_B>(b_tiles[1 - current], b_staged);
        }
        __syncthreads();
    }

#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int row = m0 + first_row + (i < 4 ? i : 16 + i - 4);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int col = n0 + first_col + 32 * half;
            const float4 value = make_float4(acc[i][4 * half], acc[i][4 * half + 1], acc[i][4 * half + 2], acc[i][4 * half + 3]);
            store_four<VECTOR_LOADS>(C, M, N, row, col, value, accumulate);
        }
    }
}

// Split-K, second step: C = the sum of the `splits` partial products (+ C when accumulate), count floats
// each, added in a fixed order so that the result does not depend on which block finished first.
extern "C" __global__ void matmul_sum_splits(float* C, const float* partial, int count, int splits, int accumulate)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) {
        float sum = accumulate ? C[i] : 0.0f;
        for (int split = 0; split < splits; ++split) {
            sum += partial[(long long)split * count + i];
        }
        C[i] = sum;
    }
}
