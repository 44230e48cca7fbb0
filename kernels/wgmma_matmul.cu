// C = op(A) op(B) (+ bias) (+ C) on Hopper's tensor cores through wgmma, for bf16 A and B, row-major as they
// lie in memory, in every layout of the Linear layer's three products (x: (B*T, C_in), W: (C_out, C_in)),
// or for float32 A and B read as TF32 (K-major only, see below):
//   forward      y  = x Wᵀ    A = x  (M x K, k contiguous: K-major), B = W (N x K, K-major)
//   input grad   dx = dy W    A = dy (K-major),                       B = W (K x N, n contiguous: N-major)
//   weight grad  dW = dyᵀ x   A = dy (K x M, m contiguous: M-major),  B = x (K x N, N-major)
// An MN-major operand is not transposed in memory: wgmma reads it so (imm-trans 1). C is M x N, row-major,
// float32 or bf16. Sums are float32; bias (N float32s, or null) is added to each row and, with accumulate,
// C's old values, before the one rounding to C's type. Any M, N, K; each operand's rows (its contiguous
// dimension) whole 16-byte chunks: a multiple of 8 bf16, or 4 float32.
// The same kernel takes float32 A and B (Element = float) for wgmma's .tf32 instruction: a 128-byte swizzled
// row then holds 32 values of k instead of 64, so a slice is 32 long, and each of its four wgmma is k8
// instead of k16 (32 bytes of each row either way, so the descriptors step alike). PTX allows .tf32 operands
// K-major only (no imm-trans): x Wᵀ as it lies; other layouts are first copied K-major by tf32_operand_rows,
// below, which also makes 3xTF32's operands.
// Compiled for sm_90a: RawModule(code, options=("-arch=sm_90a",)).
//
// A block of 256 threads, two warpgroups, computes a 128 x BLOCK_N tile of C (BLOCK_N 256, or 128 where
// 256-wide tiles would leave multiprocessors idle), walking along K one slice of 128 bytes per row at a time:
//  - each slice of 64 bf16 (32 float32) along K travels to shared memory by cp.async, 16 bytes per copy, in
//    the 128-byte swizzle the wgmma descriptors name: a K-major tile as rows of 128 bytes of k (chunk c of
//    row r lands at chunk c ^ (r % 8) of the row), an MN-major tile as rows of 64 values of m or n, one row per k
//    (chunk c of row k at chunk c ^ (k % 8)), in atoms of 64 x 8; copies past an edge write zeros;
//  - STAGES slices live in shared memory: while the tensor cores multiply slice s, slices s + 1 and s + 2 are
//    on their way;
//  - warpgroup w multiplies rows 64w .. 64w + 63 of the tile by all BLOCK_N columns: per slice four wgmma
//    m64nBLOCK_Nk16 (k = 0, 16, 32, 48; TF32: k8 at k = 0, 8, 16, 24), issued together and left running
//    while the threads start the next copies; BLOCK_N / 2 float32 accumulators per thread;
//  - blocks take their tiles down the columns of groups of GROUP_M rows of tiles, so that blocks running
//    at the same time share tiles of A and B in the L2 cache;
//  - split K (a grid of gridDim.y stretches of K, for a product with few tiles and a long K, the weight
//    gradient's sum over B*T rows): stretch s writes its partial sums to its own M x N slab of C, at
//    C + s M N; the launcher then adds the slabs in stretch order, so the result is the same every run
//    (atomic adds would land in whatever order the blocks finish).
#include <cuda_bf16.h>
#include "wgmma.cuh"

constexpr int BLOCK_M = 128;                // rows of C per block: one warpgroup per 64
constexpr int ROW_BYTES = 128;              // one swizzled row: a slice of K, 64 bf16 or 32 float32
template <typename Element> constexpr int SLICE_K = ROW_BYTES / sizeof(Element);   // elements of K per slice
constexpr int WARPGROUPS = BLOCK_M / 64;
constexpr int THREADS = 128 * WARPGROUPS;
constexpr int STAGES = 4;                   // slices in shared memory
static_assert(STAGES >= 3, "a slice being multiplied, one whose products may still run, and one on its way");
constexpr int GROUP_M = 8;                  // rows of tiles per group of blocks
constexpr int STORE_BATCH = 8;              // pairs of results per thread whose old values load together
constexpr int ATOM_BYTES = 8 * ROW_BYTES;         // an MN-major swizzle atom: 64 values of m (n) by 8 of k
static_assert(ATOM_BYTES == 1024, "an atom is one repeat of the 128-byte swizzle: tiles of atoms stay aligned to it");
static_assert(128 / 4 % STORE_BATCH == 0, "a thread's BLOCK_N / 4 pairs of results make whole batches");
static_assert(GROUP_M >= 1, "a group of blocks holds at least one row of tiles");

// Bytes of one slice of a tile of ROWS rows of A (or of B's columns): the same in both layouts and both types.
__host__ __device__ constexpr int tile_bytes(int rows) { return rows * ROW_BYTES; }
// Dynamic shared memory per block: the stages, and room to start them on 1024 bytes (193 KB for BLOCK_N 256,
// 129 KB for 128). Every tile is a multiple of 1024 bytes, where the swizzle pattern repeats.
__host__ __device__ constexpr int shared_bytes(int block_n)
{
    return STAGES * (tile_bytes(BLOCK_M) + tile_bytes(block_n)) + 1024;
}
static_assert(shared_bytes(256) <= 227 * 1024, "a block of an H100 or H200 has at most 227 KB of shared memory");

// Start copying rows first_row .. first_row + ROWS - 1, one slice of k from k0 of a K-major `matrix` (rows x K,
// k contiguous) into the tile at shared address `tile`, swizzled. Eight threads copy one row's 128 bytes:
// consecutive threads read consecutive global memory. A chunk outside the matrix, or at or past k_end (the
// end of this block's stretch of K), is zero-filled (K is a multiple of a chunk's 8 bf16 or 4 float32: a
// chunk is all in or all out).
template <int ROWS, typename Element>
__device__ __forceinline__ void copy_tile_k_major(unsigned tile, const Element* matrix, int rows, int K,
                                                  int first_row, int k0, int k_end)
{
    constexpr int CHUNKS = ROWS * ROW_BYTES / 16, CHUNK_ELEMENTS = 16 / sizeof(Element);
    static_assert(CHUNKS % THREADS == 0, "every thread copies the same number of chunks");
#pragma unroll
    for (int i = 0; i < CHUNKS / THREADS; ++i) {
        const int chunk = threadIdx.x + i * THREADS;
        const int row = chunk / 8, column = chunk % 8;   // column: which 16 bytes of the row
        const int matrix_row = first_row + row, k = k0 + CHUNK_ELEMENTS * column;
        const bool inside = matrix_row < rows && k < k_end;
        const Element* source = inside ? matrix + (long long)matrix_row * K + k : matrix;
        cp_async_16(tile + row * ROW_BYTES + (column ^ (row % 8)) * 16, source, inside ? 16 : 0);
    }
}

// The same for an MN-major `matrix` (K x columns, each k's row of m or n contiguous): columns first_column ..
// first_column + COLUMNS - 1 of rows k0 .. k0 + 63 into the tile, as swizzle atoms of 64 columns by 8 rows of
// k (8 rows of 128 bytes): the COLUMNS / 64 atoms of rows k .. k + 7 side by side, then those of the next 8.
// Consecutive threads copy consecutive 16 bytes of one row of the matrix. bf16 only (TF32 has no MN-major).
template <int COLUMNS>
__device__ __forceinline__ void copy_tile_mn_major(unsigned tile, const __nv_bfloat16* matrix, int columns,
                                                   int first_column, int k0, int k_end)
{
    constexpr int CHUNKS_PER_K = COLUMNS / 8, CHUNKS = SLICE_K<__nv_bfloat16> * CHUNKS_PER_K;
    static_assert(CHUNKS % THREADS == 0, "every thread copies the same number of chunks");
#pragma unroll
    for (int i = 0; i < CHUNKS / THREADS; ++i) {
        const int chunk = threadIdx.x + i * THREADS;
        const int k = chunk / CHUNKS_PER_K, piece = chunk % CHUNKS_PER_K;   // piece: 8 values of m (n)
        const int atom = piece / 8, column = piece % 8;
        const int matrix_column = first_column + 8 * piece, matrix_row = k0 + k;
        const bool inside = matrix_column < columns && matrix_row < k_end;
        const __nv_bfloat16* source = inside ? matrix + (long long)matrix_row * columns + matrix_column : matrix;
        const unsigned atom_place = (k / 8 * (COLUMNS / 64) + atom) * ATOM_BYTES;
        const unsigned place = atom_place + k % 8 * ROW_BYTES + (column ^ (k % 8)) * 16;
        cp_async_16(tile + place, source, inside ? 16 : 0);
    }
}

// One operand's slice: ROWS rows of A (m), or of B's columns (n), starting at `first`, in its layout; a
// float32 operand (read as TF32) is K-major.
template <int ROWS, bool MN_MAJOR>
__device__ __forceinline__ void copy_operand_slice(unsigned tile, const __nv_bfloat16* matrix, int extent, int K,
                                                   int first, int k0, int k_end)
{
    if (MN_MAJOR) copy_tile_mn_major<ROWS>(tile, matrix, extent, first, k0, k_end);
    else copy_tile_k_major<ROWS>(tile, matrix, extent, K, first, k0, k_end);
}

template <int ROWS, bool MN_MAJOR>
__device__ __forceinline__ void copy_operand_slice(unsigned tile, const float* matrix, int extent, int K,
                                                   int first, int k0, int k_end)
{
    static_assert(!MN_MAJOR, "wgmma's .tf32 operands are K-major only");
    copy_tile_k_major<ROWS>(tile, matrix, extent, K, first, k0, k_end);
}

// The descriptor of step `k_step` (16 bf16, or 8 TF32 values of k) of a slice's tile of ROWS rows (or
// columns), for its rows `first_row` .. + 63 (A's warpgroup rows) or all of them (B). K-major: 32 bytes along
// each swizzled row per step. MN-major: atoms ATOM_BYTES apart along m (n), ROWS / 64 atoms apart along k; a
// step is two atoms of k.
template <int ROWS, bool MN_MAJOR>
__device__ __forceinline__ unsigned long long slice_descriptor(unsigned tile, int first_row, int k_step)
{
    constexpr int K_GROUP_BYTES = ROWS / 64 * ATOM_BYTES;   // from 8 values of k to the next
    if (MN_MAJOR) return matrix_descriptor_128b_mn(tile + first_row / 64 * ATOM_BYTES + 2 * K_GROUP_BYTES * k_step,
                                                   ATOM_BYTES, K_GROUP_BYTES);
    return matrix_descriptor_128b(tile + first_row * ROW_BYTES + 32 * k_step);
}

// One wgmma of the block's width: m64n256 for 128 accumulators per thread, m64n128 for 64; k16 for bf16
// elements, k8 for float32 ones read as TF32 (K-major only). The last argument, the type of the elements, picks
// the instruction.
template <bool A_MN_MAJOR, bool B_MN_MAJOR>
__device__ __forceinline__ void wgmma_step(float (&d)[128], unsigned long long a, unsigned long long b,
                                           const __nv_bfloat16*)
{
    wgmma_m64n256k16_bf16<A_MN_MAJOR, B_MN_MAJOR>(d, a, b);
}

template <bool A_MN_MAJOR, bool B_MN_MAJOR>
__device__ __forceinline__ void wgmma_step(float (&d)[64], unsigned long long a, unsigned long long b,
                                           const __nv_bfloat16*)
{
    wgmma_m64n128k16_bf16<A_MN_MAJOR, B_MN_MAJOR>(d, a, b);
}

template <bool A_MN_MAJOR, bool B_MN_MAJOR>
__device__ __forceinline__ void wgmma_step(float (&d)[128], unsigned long long a, unsigned long long b, const float*)
{
    static_assert(!A_MN_MAJOR && !B_MN_MAJOR, "wgmma's .tf32 operands are K-major only");
    wgmma_m64n256k8_tf32(d, a, b);
}

template <bool A_MN_MAJOR, bool B_MN_MAJOR>
__device__ __forceinline__ void wgmma_step(float (&d)[64], unsigned long long a, unsigned long long b, const float*)
{
    static_assert(!A_MN_MAJOR && !B_MN_MAJOR, "wgmma's .tf32 operands are K-major only");
    wgmma_m64n128k8_tf32(d, a, b);
}

// Stores into C, float32 or bf16 (rounded to nearest, ties to even). A pair of neighbours in a row is one
// 8-byte (4-byte) store; it needs an even N, so that every row starts on a multiple of that size.
__device__ __forceinline__ float load_one(const float* in) { return *in; }
__device__ __forceinline__ float load_one(const __nv_bfloat16* in) { return __bfloat162float(*in); }
__device__ __forceinline__ void store_one(float* out, float x) { *out = x; }
__device__ __forceinline__ void store_one(__nv_bfloat16* out, float x) { *out = __float2bfloat16_rn(x); }

__device__ __forceinline__ void store_pair(float* out, float x, float y)
{
    *reinterpret_cast<float2*>(out) = make_float2(x, y);
}

__device__ __forceinline__ void store_pair(__nv_bfloat16* out, float x, float y)
{
    *reinterpret_cast<__nv_bfloat162*>(out) = __floats2bfloat162_rn(x, y);
}

// The whole product for one block (one tile of C, one stretch of K), into a float32 or bf16 C, from bf16 or
// float32 (TF32) A and B. A_MN_MAJOR: A stored K x M (the weight gradient's dyᵀ), else M x K. B_MN_MAJOR: B
// stored K x N (dy W, dyᵀ x), else N x K (x Wᵀ).
template <int BLOCK_N, bool A_MN_MAJOR, bool B_MN_MAJOR, typename Output, typename Element>
__device__ __forceinline__ void wgmma_block_product(Output* C, const Element* A, const Element* B, int M,
                                                    int N, int K, int k_per_split, const float* bias, bool accumulate)
{
    constexpr int BLOCK_K = SLICE_K<Element>;
    constexpr int K_STEPS = ROW_BYTES / 32;     // wgmma per slice: each reads 32 bytes of every row (k16 bf16, k8 TF32)
    constexpr int A_TILE_BYTES = tile_bytes(BLOCK_M), STAGE_BYTES = A_TILE_BYTES + tile_bytes(BLOCK_N);
    extern __shared__ __align__(1024) unsigned char shared[];
    // The swizzle acts on shared-memory address bits, so each stage starts on 1024 bytes of that address.
    const unsigned stages = (shared_address(shared) + 1023) & ~1023u;

    // This block's tile: groups of GROUP_M rows of tiles, numbered down each column of the group.
    const int tiles_m = (M + BLOCK_M - 1) / BLOCK_M, tiles_n = (N + BLOCK_N - 1) / BLOCK_N;
    const int per_group = GROUP_M * tiles_n, group = blockIdx.x / per_group, in_group = blockIdx.x % per_group;
    const int first_tile_m = group * GROUP_M, group_rows = min(tiles_m - first_tile_m, GROUP_M);
    const int m0 = (first_tile_m + in_group % group_rows) * BLOCK_M, n0 = in_group / group_rows * BLOCK_N;
    const int warpgroup = threadIdx.x / 128;
    // This block's stretch of K: all of it, or stretch blockIdx.y of k_per_split (a multiple of 64).
    const int k_begin = blockIdx.y * k_per_split, k_end = min(K, k_begin + k_per_split);

    auto a_tile = [&](int stage) { return stages + stage * STAGE_BYTES; };
    auto b_tile = [&](int stage) { return stages + stage * STAGE_BYTES + A_TILE_BYTES; };
    auto start_slice = [&](int s) {
        const int k0 = k_begin + s * BLOCK_K;
        copy_operand_slice<BLOCK_M, A_MN_MAJOR>(a_tile(s % STAGES), A, M, K, m0, k0, k_end);
        copy_operand_slice<BLOCK_N, B_MN_MAJOR>(b_tile(s % STAGES), B, N, K, n0, k0, k_end);
    };

    float d[BLOCK_N / 2];
#pragma unroll
    for (int i = 0; i < BLOCK_N / 2; ++i) d[i] = 0.0f;
    fence_accumulators(d);

    // Fill the pipeline: STAGES - 2 slices on their way. Every thread commits one group of copies per slice,
    // even an empty one past the end, so that "all but the newest STAGES - 3 groups" means "up to slice s".
    const int slices = (k_end - k_begin + BLOCK_K - 1) / BLOCK_K;
    for (int s = 0; s < STAGES - 2; ++s) {
        if (s < slices) start_slice(s);
        cp_async_commit();
    }
    for (int s = 0; s < slices; ++s) {
        cp_async_wait<STAGES - 3>();   // this thread's copies of slice s have landed,
        fence_proxy_async_shared();     // where the tensor cores' own reads see them;
        __syncthreads();                // everyone's too, and every warpgroup is done with slice s - 2
        const int stage = s % STAGES;
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < K_STEPS; ++k) {
            const unsigned long long a = slice_descriptor<BLOCK_M, A_MN_MAJOR>(a_tile(stage), 64 * warpgroup, k);
            const unsigned long long b = slice_descriptor<BLOCK_N, B_MN_MAJOR>(b_tile(stage), 0, k);
            wgmma_step<A_MN_MAJOR, B_MN_MAJOR>(d, a, b, A);
        }
        wgmma_commit_group();
        // While they run: slice s + STAGES - 2 into the stage slice s - 2 had.
        if (s + STAGES - 2 < slices) start_slice(s + STAGES - 2);
        cp_async_commit();
        wgmma_wait_group<1>();          // slice s - 1's products are done; slice s's may still run
    }
    wgmma_wait_group<0>();
    fence_accumulators(d);

    // d[i] of warp w (of this warpgroup), lane 4g + t: row 16w + g + 8 ((i / 2) % 2), column 8 (i / 4) + 2t + i % 2.
    // They go out STORE_BATCH pairs at a time: with accumulate, the batch's old values of C are all loaded before
    // any is stored, so that the loads wait for memory together rather than one after another (a store to C
    // might, as far as the compiler knows, change what a later load reads).
    const int warp = threadIdx.x % 128 / 32, lane = threadIdx.x % 32;
    const int first_row = m0 + warpgroup * 64 + warp * 16 + lane / 4, first_column = n0 + 2 * (lane % 4);
    C += (long long)blockIdx.y * M * N;   // this stretch's slab (the only one without split K)
#pragma unroll
    for (int batch = 0; batch < BLOCK_N / 2; batch += 2 * STORE_BATCH) {
        float old[2 * STORE_BATCH];
#pragma unroll
        for (int j = 0; j < 2 * STORE_BATCH; j += 2) {
            const int row = first_row + 8 * ((batch + j) / 2 % 2), column = first_column + 8 * ((batch + j) / 4);
            const Output* out = C + (long long)row * N + column;
            const bool inside = accumulate && row < M && column < N;
            old[j] = inside ? load_one(out) : 0.0f;
            old[j + 1] = inside && column + 1 < N ? load_one(out + 1) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < 2 * STORE_BATCH; j += 2) {
            const int i = batch + j;
            const int row = first_row + 8 * (i / 2 % 2), column = first_column + 8 * (i / 4);
            if (row >= M || column >= N) continue;
            Output* out = C + (long long)row * N + column;
            const bool second = column + 1 < N;
            float x = d[i], y = d[i + 1];
            if (bias != nullptr) {
                x += bias[column];
                if (second) y += bias[column + 1];
            }
            x += old[j];
            y += old[j + 1];
            if (N % 2 == 0) {
                store_pair(out, x, y);   // column is even, so column + 1 < N too
            } else {
                store_one(out, x);
                if (second) store_one(out + 1, y);
            }
        }
    }
}

// Dynamic shared memory: shared_bytes(BLOCK_N). Grid: (one block per 128 x BLOCK_N tile of C, stretches of K).
// Launched by name: wgmma_matmul<256, false, false, float, __nv_bfloat16> is the Linear forward x Wᵀ from bf16
// into float32; wgmma_matmul<256, false, false, float, float> the same in TF32.
template <int BLOCK_N, bool A_MN_MAJOR, bool B_MN_MAJOR, typename Output, typename Element>
__global__ void __launch_bounds__(THREADS, 1) wgmma_matmul(
    Output* __restrict__ C, const Element* __restrict__ A, const Element* __restrict__ B, int M, int N,
    int K, int k_per_split, const float* __restrict__ bias, bool accumulate)
{
    wgmma_block_product<BLOCK_N, A_MN_MAJOR, B_MN_MAJOR>(C, A, B, M, N, K, k_per_split, bias, accumulate);
}

// The float32 operands of the TF32 products, K-major, in one pass: row r of `out` (rows x segments * segment_k)
// holds row r of op(in) (K values; segment_k is K rounded up to a multiple of 4, so that rows are whole 16-byte
// chunks, the rest zeros) `segments` times one after another, segment s as part (parts >> 2s) & 3 of each value:
//   PART_VALUE  the value itself        (TF32 wgmma then reads its upper 19 bits)
//   PART_BIG    big = cvt.rna.tf32(x)   (mma.cuh's split_tf32)
//   PART_SMALL  small = cvt.rna.tf32(x - big)
// One segment of PART_VALUE is a K-major copy, for an operand that does not lie K-major. For 3xTF32, A's rows
// become [small | big | big] and B's [big | small | big]: one TF32 product over 3 segment_k sums small·big,
// then big·small, then big·big (the small corrections first, while the sum is small); small·small is dropped.
// in: rows x K, k contiguous, or (k_contiguous false: a transposed operand, read as it lies) K x rows.
// Block (32, 8), one 32 x 32 tile of rows by k per block, grid (ceil(segment_k / 32), ceil(rows / 32)): the
// tile is read along in's contiguous dimension, and written along k, through shared memory.
enum TF32Part { PART_VALUE = 0, PART_BIG = 1, PART_SMALL = 2 };
constexpr int TRANSPOSE_TILE = 32;

extern "C" __global__ void tf32_operand_rows(float* __restrict__ out, const float* __restrict__ in, int rows, int K,
                                  int segment_k, bool k_contiguous, int segments, int parts)
{
    __shared__ float tile[TRANSPOSE_TILE][TRANSPOSE_TILE + 1];   // [row][k]; the + 1 spreads a column over banks
    const int k0 = blockIdx.x * TRANSPOSE_TILE, row0 = blockIdx.y * TRANSPOSE_TILE;
    for (int j = threadIdx.y; j < TRANSPOSE_TILE; j += blockDim.y) {
        // threadIdx.x runs along in's contiguous dimension: k, or the rows of a transposed operand
        const int row = k_contiguous ? row0 + j : row0 + threadIdx.x, k = k_contiguous ? k0 + threadIdx.x : k0 + j;
        float x = 0.0f;
        if (row < rows && k < K) x = k_contiguous ? in[(long long)row * K + k] : in[(long long)k * rows + row];
        tile[row - row0][k - k0] = x;
    }
    __syncthreads();
    const long long width = (long long)segments * segment_k;
    for (int j = threadIdx.y; j < TRANSPOSE_TILE; j += blockDim.y) {
        const int row = row0 + j, k = k0 + threadIdx.x;
        if (row >= rows || k >= segment_k) continue;
        const float x = tile[j][threadIdx.x];
        unsigned big, small;
        split_tf32(x, big, small);
        for (int segment = 0; segment < segments; ++segment) {
            const int part = parts >> (2 * segment) & 3;
            out[row * width + (long long)segment * segment_k + k] =
                part == PART_VALUE ? x : __uint_as_float(part == PART_BIG ? big : small);
        }
    }
}
