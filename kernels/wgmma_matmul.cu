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
// A block computes a 128 x BLOCK_N tile of C (BLOCK_N 256, or 128 where 256-wide tiles would leave
// multiprocessors idle), walking along K one slice of 128 bytes per row at a time, with warps of two trades:
//  - one copy warp, of which one thread issues the copies: each slice of 64 bf16 (32 float32) along K travels
//    to shared memory by the copy engine (TMA, kernels/include/tma.cuh), one bulk tensor copy per tile (per
//    64 columns of an MN-major tile), in the 128-byte swizzle the wgmma descriptors name: a K-major tile as rows
//    of 128 bytes of k (chunk c of row r at chunk c ^ (r % 8) of the row), an MN-major tile as rows of 64
//    values of m or n, one row per k (chunk c of row k at chunk c ^ (k % 8)); the engine writes zeros past the
//    matrix's edges;
//  - a ring of STAGES slices in shared memory, each with two mbarriers: "full" completes when the copies'
//    bytes have landed, "empty" when both consumer warpgroups are done multiplying it, so the copy warp may
//    fill it again; the copy warp runs up to STAGES slices ahead;
//  - two consumer warpgroups: warpgroup w multiplies rows 64w .. 64w + 63 of the tile by all BLOCK_N columns,
//    per slice four wgmma m64nBLOCK_Nk16 (k = 0, 16, 32, 48; TF32: k8 at k = 0, 8, 16, 24) issued together
//    and left running while it waits for the next slice; BLOCK_N / 2 float32 accumulators per thread. No
//    thread of theirs spends an instruction on a copy, and no __syncthreads stops them;
//  - blocks take their tiles down the columns of groups of GROUP_M rows of tiles, so that blocks running
//    at the same time share tiles of A and B in the L2 cache;
//  - split K (a grid of gridDim.y stretches of K, for a product with few tiles and a long K, the weight
//    gradient's sum over B*T rows): stretch s writes its partial sums to its own M x N slab of C, at
//    C + s M N; the launcher then adds the slabs in stretch order, so the result is the same every run
//    (atomic adds would land in whatever order the blocks finish).
#include <cuda_bf16.h>
#include "storage.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

constexpr int BLOCK_M = 128;                // rows of C per block: one consumer warpgroup per 64
constexpr int ROW_BYTES = 128;              // one swizzled row: a slice of K, 64 bf16 or 32 float32
template <typename Element> constexpr int SLICE_K = ROW_BYTES / sizeof(Element);   // elements of K per slice
constexpr int CONSUMERS = BLOCK_M / 64;     // warpgroups that multiply
constexpr int CONSUMER_THREADS = 128 * CONSUMERS;
constexpr int THREADS = CONSUMER_THREADS + 32;   // and one warp that copies
constexpr int STAGE_ROOM = 192 * 1024;      // shared memory for the stages: as many as fit in it
constexpr int GROUP_M = 8;                  // rows of tiles per group of blocks
constexpr int STORE_BATCH = 8;              // pairs of results per thread whose old values load together
constexpr int ATOM_BYTES = 8 * ROW_BYTES;   // a swizzle atom: 8 rows of 128 bytes, one repeat of the pattern
constexpr int MN_BOX = 64;                  // an MN-major box: 64 values of m (n) by 64 of k
constexpr int MN_BOX_BYTES = MN_BOX * ROW_BYTES;
static_assert(MN_BOX_BYTES == MN_BOX / 8 * ATOM_BYTES, "an MN-major box is a column of atoms of 8 values of k");
static_assert(128 / 4 % STORE_BATCH == 0, "a thread's BLOCK_N / 4 pairs of results make whole batches");
static_assert(GROUP_M >= 1, "a group of blocks holds at least one row of tiles");

// Bytes of one slice of a tile of ROWS rows of A (or of B's columns): the same in both layouts and both types.
__host__ __device__ constexpr int tile_bytes(int rows) { return rows * ROW_BYTES; }
__host__ __device__ constexpr int stage_bytes(int block_n) { return tile_bytes(BLOCK_M) + tile_bytes(block_n); }
// Slices in shared memory: 4 of a 128 x 256 tile (48 KB each), 6 of a 128 x 128 one.
__host__ __device__ constexpr int stages(int block_n) { return STAGE_ROOM / stage_bytes(block_n); }
// Dynamic shared memory per block: the stages, and room to start them on 1024 bytes, where the swizzle
// pattern repeats (every tile is a multiple of 1024 bytes, so each stays aligned to it).
__host__ __device__ constexpr int shared_bytes(int block_n) { return stages(block_n) * stage_bytes(block_n) + 1024; }
static_assert(shared_bytes(256) <= 227 * 1024, "a block of an H100 or H200 has at most 227 KB of shared memory");

// Start the copy of one operand's slice into `tile`: ROWS rows of A (m), or of B's columns (n), from `first`,
// k from k0. A K-major operand (rows x K in memory) is one box of ROWS rows by one slice of k; each row lands as
// 128 swizzled bytes, the layout matrix_descriptor_128b reads. An MN-major one (K x rows in memory) is ROWS / 64
// boxes of 64 rows of k by 64 values of m (n), side by side: each box eight swizzle atoms of 8 values of k.
template <int ROWS, bool MN_MAJOR>
__device__ __forceinline__ void load_operand_slice(unsigned tile, const TensorMap& map, int first, int k0,
                                                   unsigned barrier)
{
    if (MN_MAJOR) {
#pragma unroll
        for (int box = 0; box < ROWS / MN_BOX; ++box)
            tma_load_2d(tile + box * MN_BOX_BYTES, map, first + box * MN_BOX, k0, barrier);
    } else {
        tma_load_2d(tile, map, k0, first, barrier);
    }
}

// The descriptor of step `k_step` (16 bf16, or 8 TF32 values of k) of a slice's tile, for its rows
// `first_row` .. + 63 (A's warpgroup rows) or all of them (B). K-major: 32 bytes along each swizzled row per
// step. MN-major: boxes of 64 values of m (n) MN_BOX_BYTES apart, atoms of 8 values of k ATOM_BYTES apart
// within a box; a step is two atoms.
template <bool MN_MAJOR>
__device__ __forceinline__ unsigned long long slice_descriptor(unsigned tile, int first_row, int k_step)
{
    if (MN_MAJOR) return matrix_descriptor_128b_mn(tile + first_row / MN_BOX * MN_BOX_BYTES + 2 * ATOM_BYTES * k_step,
                                                   MN_BOX_BYTES, ATOM_BYTES);
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

template <int COUNT>
__device__ __forceinline__ void zero_accumulators(float (&d)[COUNT])
{
#pragma unroll
    for (int i = 0; i < COUNT; ++i) d[i] = 0.0f;
    fence_accumulators(d);
}

// total += slice, then slice = 0 for its next products: called after the wgmma_wait_group that covers them.
template <int COUNT>
__device__ __forceinline__ void add_slice(float (&total)[COUNT], float (&slice)[COUNT])
{
    fence_accumulators(slice);
#pragma unroll
    for (int i = 0; i < COUNT; ++i) total[i] += slice[i];
    zero_accumulators(slice);
}

// One item of work: a tile of C and a stretch of K. Items are numbered stretch by stretch; within a stretch,
// tiles go in groups of GROUP_M rows of tiles, numbered down each column of the group, so that blocks working
// at the same time share tiles of A and B in the L2 cache.
struct WorkItem {
    int m0, n0;          // the tile's first row and column of C
    int stretch;         // which stretch of K: its partial sums go to slab `stretch` of C
    int k_begin, slices; // where the stretch starts, and its slices
};

template <int BLOCK_N, int BLOCK_K>
__device__ __forceinline__ WorkItem work_item(int index, int M, int N, int K, int k_per_split)
{
    const int tiles_m = (M + BLOCK_M - 1) / BLOCK_M, tiles_n = (N + BLOCK_N - 1) / BLOCK_N;
    const int tile = index % (tiles_m * tiles_n);
    const int per_group = GROUP_M * tiles_n, group = tile / per_group, in_group = tile % per_group;
    const int first_tile_m = group * GROUP_M, group_rows = min(tiles_m - first_tile_m, GROUP_M);
    WorkItem item;
    item.m0 = (first_tile_m + in_group % group_rows) * BLOCK_M;
    item.n0 = in_group / group_rows * BLOCK_N;
    item.stretch = index / (tiles_m * tiles_n);
    // A stretch is k_per_split long (a multiple of 64, so it ends where a slice ends: copies past K read
    // zeros, and none reads into the next stretch), the last one what remains.
    item.k_begin = item.stretch * k_per_split;
    item.slices = (min(K, item.k_begin + k_per_split) - item.k_begin + BLOCK_K - 1) / BLOCK_K;
    return item;
}

// Items in all: tiles times stretches of K (at least one, for an empty sum).
template <int BLOCK_N>
__device__ __forceinline__ int work_items(int M, int N, int K, int k_per_split)
{
    const int stretches = K > 0 ? (K + k_per_split - 1) / k_per_split : 1;
    return (M + BLOCK_M - 1) / BLOCK_M * ((N + BLOCK_N - 1) / BLOCK_N) * stretches;
}

// Stores a consumer warpgroup's 64 x BLOCK_N results d, rows row0 .. row0 + 63, columns n0 .., into C, float32 or
// bf16, adding bias and (accumulate) C's old values before the one rounding.
// d[i] of warp w (of this warpgroup), lane 4g + t: row 16w + g + 8 ((i / 2) % 2), column 8 (i / 4) + 2t + i % 2.
// They go out STORE_BATCH pairs at a time: with accumulate, the batch's old values of C are all loaded before
// any is stored, so that the loads wait for memory together rather than one after another (a store to C
// might, as far as the compiler knows, change what a later load reads).
template <int BLOCK_N, typename Output>
__device__ __forceinline__ void store_results(Output* C, const float (&d)[BLOCK_N / 2], int row0, int n0, int M,
                                              int N, const float* bias, bool accumulate)
{
    const int warp = threadIdx.x % 128 / 32, lane = threadIdx.x % 32;
    const int first_row = row0 + warp * 16 + lane / 4, first_column = n0 + 2 * (lane % 4);
#pragma unroll
    for (int batch = 0; batch < BLOCK_N / 2; batch += 2 * STORE_BATCH) {
        float old[2 * STORE_BATCH];
#pragma unroll
        for (int j = 0; j < 2 * STORE_BATCH; j += 2) {
            const int row = first_row + 8 * ((batch + j) / 2 % 2), column = first_column + 8 * ((batch + j) / 4);
            const Output* out = C + (long long)row * N + column;
            const bool inside = accumulate && row < M && column < N;
            old[j] = inside ? to_float(out[0]) : 0.0f;
            old[j + 1] = inside && column + 1 < N ? to_float(out[1]) : 0.0f;
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
            // C float32 or bf16 (rounded to nearest, ties to even). A pair of neighbours in a row is one 8-byte
            // (4-byte) store; it needs an even N, so that every row starts on a multiple of that size.
            if (N % 2 == 0) {
                store_pair(out, x, y);   // column is even, so column + 1 < N too
            } else {
                out[0] = from_float<Output>(x);
                if (second) out[1] = from_float<Output>(y);
            }
        }
    }
}

// The whole product, each block taking items of work gridDim.x apart, into a float32 or bf16 C, from bf16 or
// float32 (TF32) A and B, which the tensor maps describe. A_MN_MAJOR: A stored K x M (the weight gradient's
// dyᵀ), else M x K. B_MN_MAJOR: B stored K x N (dy W, dyᵀ x), else N x K (x Wᵀ). The ring of stages runs on
// from one item to the next: while the consumers store one tile, the copy warp fills the stages with the next.
template <int BLOCK_N, bool A_MN_MAJOR, bool B_MN_MAJOR, bool SLICE_SUMS, bool PING_PONG, typename Output,
          typename Element>
__device__ __forceinline__ void wgmma_product(Output* C, const TensorMap& a_map, const TensorMap& b_map, int M, int N,
                                              int K, int k_per_split, const float* bias, bool accumulate,
                                              int k_apart, int slices_per_sum)
{
    constexpr int BLOCK_K = SLICE_K<Element>;
    constexpr int K_STEPS = ROW_BYTES / 32;     // wgmma per slice: each reads 32 bytes of every row (k16 bf16, k8 TF32)
    constexpr int STAGES = stages(BLOCK_N), A_TILE_BYTES = tile_bytes(BLOCK_M), STAGE_BYTES = stage_bytes(BLOCK_N);
    static_assert(STAGES >= 2, "a slice being multiplied and one on its way");
    static_assert(!(PING_PONG && SLICE_SUMS), "slice sums need the registers a ping-pong tile's 128 rows take");
    extern __shared__ __align__(1024) unsigned char shared[];
    // full[s]: stage s holds its slice (the copy warp's arrival, and the bytes of its copies);
    // empty[s]: the consumers are done multiplying stage s (one arrival from each warpgroup that reads it).
    // turn_done (ping-pong): one phase per tile, completed when its warpgroup has issued the tile's products.
    __shared__ __align__(8) unsigned long long barriers[2 * STAGES + 1];
    // The swizzle acts on shared-memory address bits, so each stage starts on 1024 bytes of that address.
    const unsigned stage_memory = (shared_address(shared) + 1023) & ~1023u;
    const unsigned full = shared_address(barriers), empty = full + 8 * STAGES, turn_done = empty + 8 * STAGES;
    if (threadIdx.x == 0) {
        for (int stage = 0; stage < STAGES; ++stage) {
            mbarrier_init(full + 8 * stage, 1);
            mbarrier_init(empty + 8 * stage, PING_PONG ? 1 : CONSUMERS);
        }
        mbarrier_init(turn_done, 1);
        fence_mbarrier_init();
    }
    __syncthreads();
    auto a_tile = [&](int stage) { return stage_memory + stage * STAGE_BYTES; };
    auto b_tile = [&](int stage) { return stage_memory + stage * STAGE_BYTES + A_TILE_BYTES; };
    const int items = work_items<BLOCK_N>(M, N, K, k_per_split);

    // Slice `it` of the block's whole walk (counted on across items) goes through stage it % STAGES, in round
    // it / STAGES of the ring: its barriers' phases of parity (it / STAGES) % 2.
    if (threadIdx.x >= CONSUMER_THREADS) {
        // The copy warp: one thread walks the slices, each into the next stage of the ring once the consumers
        // have released it (in the ring's first round every stage is free: parity 1 of a fresh barrier).
        if (threadIdx.x == CONSUMER_THREADS) {
            int it = 0;
            for (int index = blockIdx.x; index < items; index += gridDim.x) {
                const WorkItem item = work_item<BLOCK_N, BLOCK_K>(index, M, N, K, k_per_split);
                for (int s = 0; s < item.slices; ++s, ++it) {
                    const int stage = it % STAGES;
                    mbarrier_wait(empty + 8 * stage, (it / STAGES & 1) ^ 1);
                    mbarrier_arrive_expect_tx(full + 8 * stage, STAGE_BYTES);
                    const int k0 = item.k_begin + s * BLOCK_K;
                    // 3xTF32's A is [small | big] and B [big | small], each part k_apart / 2 long: the third
                    // part of the product, big times big from k_apart on, reads both big parts again.
                    const bool third = SLICE_SUMS && k0 >= k_apart;
                    load_operand_slice<BLOCK_M, A_MN_MAJOR>(a_tile(stage), a_map, item.m0,
                                                            third ? k0 - k_apart / 2 : k0, full + 8 * stage);
                    load_operand_slice<BLOCK_N, B_MN_MAJOR>(b_tile(stage), b_map, item.n0, third ? k0 - k_apart : k0,
                                                            full + 8 * stage);
                }
            }
        }
        return;
    }

    // The consumers. Without ping-pong, warpgroup w multiplies rows 64w .. 64w + 63 of each tile by all BLOCK_N
    // columns. With it, the warpgroups take whole tiles in turn, each all 128 rows of its tile (two m64 wgmma
    // per step of k), while the copy warp fills the ring in the order of the tiles: a warpgroup's slices land
    // after the other's, so one multiplies while the other stores its results. A warpgroup starts its turn t
    // once the other has issued all of turn t - 1's products (phase t - 1 of turn_done): it then waits for
    // slices at most one round of the ring ahead, as a wait by parity needs.
    constexpr int HALVES = PING_PONG ? 2 : 1;   // 64-row halves of a tile one warpgroup multiplies
    const int warpgroup = threadIdx.x / 128;
    const bool releases = threadIdx.x % 128 == 0;   // the thread that says the warpgroup is done with a stage
    auto first_row = [&](int half) { return 64 * (PING_PONG ? half : warpgroup); };   // of acc[half], in the tile
    int it = 0;
    // Slice `it`'s wgmma into acc, four per half, issued as one group and left running.
    auto issue_slice = [&](float (&acc)[HALVES][BLOCK_N / 2]) {
        const int stage = it % STAGES;
        mbarrier_wait(full + 8 * stage, it / STAGES & 1);   // slice it has landed
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < K_STEPS; ++k) {
            const unsigned long long b = slice_descriptor<B_MN_MAJOR>(b_tile(stage), 0, k);
#pragma unroll
            for (int half = 0; half < HALVES; ++half) {
                const unsigned long long a = slice_descriptor<A_MN_MAJOR>(a_tile(stage), first_row(half), k);
                wgmma_step<A_MN_MAJOR, B_MN_MAJOR>(acc[half], a, b, (const Element*)nullptr);
            }
        }
        wgmma_commit_group();
        ++it;
    };
    // Slice `slice` of the walk is done: its stage may be filled again.
    auto release = [&](int slice) {
        if (releases) mbarrier_arrive(empty + 8 * (slice % STAGES));
    };
    // The walk's next `count` slices into acc: each slice's stage released once its products are done, while
    // the next slice's may still run. The last slice's products may still run on return: finish_slices waits.
    auto issue_slices = [&](float (&acc)[HALVES][BLOCK_N / 2], int count) {
        for (int s = 0; s < count; ++s) {
            issue_slice(acc);
            wgmma_wait_group<1>();
            if (s > 0) release(it - 2);
        }
    };
    auto finish_slices = [&](float (&acc)[HALVES][BLOCK_N / 2], int count) {
        wgmma_wait_group<0>();
#pragma unroll
        for (int half = 0; half < HALVES; ++half) fence_accumulators(acc[half]);
        if (count > 0) release(it - 1);
    };
    int turn = 0;
    for (int index = blockIdx.x; index < items; index += gridDim.x, ++turn) {
        const WorkItem item = work_item<BLOCK_N, BLOCK_K>(index, M, N, K, k_per_split);
        if (PING_PONG) {
            if (turn % CONSUMERS != warpgroup) {   // the other warpgroup's tile: its slices go by
                it += item.slices;
                continue;
            }
            if (turn > 0) mbarrier_wait(turn_done, (turn - 1) & 1);
        }
        float d[HALVES][BLOCK_N / 2];
#pragma unroll
        for (int half = 0; half < HALVES; ++half) zero_accumulators(d[half]);
        if (SLICE_SUMS) {
            // 3xTF32: the slices of k before k_apart (the small corrections, whose sums stay small) go into total
            // on the tensor cores. From k_apart on (big times big), each group of slices_per_sum slices is summed
            // from zero by the tensor cores in d, then added to total on the CUDA cores, in float32 rounded to
            // nearest; the tensor cores wait while that sum is taken.
            float total[HALVES][BLOCK_N / 2];
            zero_accumulators(total[0]);
            const int small = min(item.slices, max(0, (k_apart - item.k_begin + BLOCK_K - 1) / BLOCK_K));
            issue_slices(total, small);
            finish_slices(total, small);
            for (int s = small; s < item.slices; s += slices_per_sum) {
                const int count = min(slices_per_sum, item.slices - s);
                issue_slices(d, count);
                finish_slices(d, count);
                add_slice(total[0], d[0]);
            }
#pragma unroll
            for (int i = 0; i < BLOCK_N / 2; ++i) d[0][i] = total[0][i];
        } else {
            issue_slices(d, item.slices);
            if (PING_PONG && releases) mbarrier_arrive(turn_done);   // the other warpgroup's turn may start
            finish_slices(d, item.slices);
        }
        // This stretch's slab of C (the only one without split K).
#pragma unroll
        for (int half = 0; half < HALVES; ++half)
            store_results<BLOCK_N>(C + (long long)item.stretch * M * N, d[half], item.m0 + first_row(half), item.n0,
                                   M, N, bias, accumulate);
    }
}

// Dynamic shared memory: shared_bytes(BLOCK_N). Block: THREADS. Grid: at most one block per item of work (tile
// of C and stretch of K); one per multiprocessor is the most that run at once. a_map: A's tensor map, boxes of
// BLOCK_M rows by one slice of k (K-major) or of 64 x 64 (MN-major); b_map the same for B with BLOCK_N rows.
// SLICE_SUMS (3xTF32; 128-wide tiles, for the registers of two sums): A's rows are [small | big] and B's
// [big | small] (tf32_operand_rows), each part k_apart / 2 long, and the product runs over K = 3 k_apart / 2:
// small·big, big·small, then big·big from k = k_apart on, reading the big parts again. Those last slices are
// summed apart, slices_per_sum at a time, on the tensor cores and added on the CUDA cores (a tensor core adding
// into a large sum cuts off the low bits of what it adds); k_apart and slices_per_sum are unused without it.
// PING_PONG: the consumer warpgroups take whole tiles in turn. Launched by name: wgmma_matmul<256, false, false,
// false, false, float, __nv_bfloat16> is the Linear forward x Wᵀ from bf16 into float32 on 256-wide tiles;
// wgmma_matmul<256, false, false, false, false, float, float> the same in TF32.
template <int BLOCK_N, bool A_MN_MAJOR, bool B_MN_MAJOR, bool SLICE_SUMS, bool PING_PONG, typename Output,
          typename Element>
__global__ void __launch_bounds__(THREADS, 1) wgmma_matmul(
    Output* __restrict__ C, const __grid_constant__ TensorMap a_map, const __grid_constant__ TensorMap b_map,
    int M, int N, int K, int k_per_split, const float* __restrict__ bias, bool accumulate, int k_apart,
    int slices_per_sum)
{
    wgmma_product<BLOCK_N, A_MN_MAJOR, B_MN_MAJOR, SLICE_SUMS, PING_PONG, Output, Element>(
        C, a_map, b_map, M, N, K, k_per_split, bias, accumulate, k_apart, slices_per_sum);
}

// The float32 operands of the TF32 products, K-major, in one pass: row r of `out` (rows x segments * segment_k)
// holds row r of op(in) (K values; segment_k is K rounded up to a multiple of 4, so that rows are whole 16-byte
// chunks, the rest zeros) `segments` times one after another, segment s as part (parts >> 2s) & 3 of each value:
//   PART_VALUE  the value itself        (TF32 wgmma then reads its upper 19 bits)
//   PART_BIG    big = cvt.rna.tf32(x)   (mma.cuh's split_tf32)
//   PART_SMALL  small = cvt.rna.tf32(x - big)
// One segment of PART_VALUE is a K-major copy, for an operand that does not lie K-major. For 3xTF32, A's rows
// become [small | big] and B's [big | small]: one TF32 product over 3 segment_k sums small·big, then
// big·small, then big·big, reading the big parts again (the small corrections first, while the sum is small);
// small·small is dropped.
// in: rows x K, k contiguous, or (k_contiguous false: a transposed operand, read as it lies) K x rows.
//
// A pass that does no arithmetic to speak of runs at the speed of memory, if enough bytes are on their way:
// at ~3 TB/s and about a microsecond from request to data under load, an H100 needs some 3 MB in flight, over
// 20 KB per multiprocessor. So each thread moves 16-byte float4s (a quarter of the instructions of single
// floats) and issues all of its loads before it waits for any. Block: OPERAND_THREADS; grid (ceil(segment_k /
// OPERAND_TILE), ceil(rows / OPERAND_TILE)): a block makes one OPERAND_TILE x OPERAND_TILE tile of op(in), rows
// by k, each thread four float4s of it: 64 bytes in flight per thread, 64 KB per 1024 threads. Both sides of
// the tile are walked in lines of 32 floats: 8 lanes of a warp cover one 128-byte line of memory, and a warp 4
// lines at once, so that every line the memory system fetches or writes is used whole.
//  - k contiguous: row r of op(in) is row r of in, so a thread reads its float4s of a row and writes them,
//    split, to the same place in `out`: no shared memory.
//  - transposed: a line of in is one k across the tile's rows; the block reads it along the rows, parks it in
//    shared memory, and reads it back along k, as `out` wants it, one float per lane per instruction.
//    tile[k][row] is OPERAND_TILE + 1 floats wide: storing, the 8 lanes of a line are 4 rows (4 banks) apart
//    and the warp's 4 lines of k 65 floats (1 bank) apart; reading back, the 8 lanes of a row are 4 values of k
//    apart (4 banks) and the warp's 4 rows 1 bank apart: both times 32 lanes, 32 banks. (64 wide, the 8 lanes
//    reading down k would all hit one bank.)
// Every value is written from registers to all of its segments, the split computed once.
// A float4 load needs 16-byte alignment: rows of `out` always have it (segment_k is a multiple of 4 and the
// array is fresh), but a line of in starts on 16 bytes only if in does and its length is a multiple of 4 (in
// may be a view into an array). Four single floats, still read by neighbouring lanes, take the float4's place
// in a line that does not, and at the line's end.
// On GPT-2's operands this runs at most of a device-to-device copy's rate, about twice that of 32 x 32 tiles
// moved a float at a time (bench/design_choices.json).
enum TF32Part { PART_VALUE = 0, PART_BIG = 1, PART_SMALL = 2 };
constexpr int OPERAND_TILE = 64;            // rows and k of op(in) per block
constexpr int OPERAND_THREADS = 256;
constexpr int LINE_FLOATS = 32;             // a warp's stretch of a line: 8 lanes of a float4, 128 bytes
constexpr int LINE_LANES = LINE_FLOATS / 4;
constexpr int LINES_PER_PASS = OPERAND_THREADS / LINE_LANES;           // lines the block covers at once
constexpr int STRETCHES = OPERAND_TILE / LINE_FLOATS;                  // stretches of a line across the tile
constexpr int QUADS_PER_THREAD = OPERAND_TILE * OPERAND_TILE / 4 / OPERAND_THREADS;
static_assert(QUADS_PER_THREAD == STRETCHES * (OPERAND_TILE / LINES_PER_PASS), "the threads' float4s tile the tile");
static_assert((OPERAND_TILE + 1) % 32 == 1, "each next line of the tile starts one bank further");

extern "C" __global__ void __launch_bounds__(OPERAND_THREADS) tf32_operand_rows(
    float* __restrict__ out, const float* __restrict__ in, int rows, int K, int segment_k, bool k_contiguous,
    int segments, int parts)
{
    __shared__ float tile[OPERAND_TILE][OPERAND_TILE + 1];   // [k][row] of a transposed operand
    const int k0 = blockIdx.x * OPERAND_TILE, row0 = blockIdx.y * OPERAND_TILE;
    // Float4 q of this thread: floats line_start(q) .. + 3 of line line_of(q) of the tile (a line: a row of
    // op(in) in the k direction, or a k of in in the rows' direction).
    auto line_of = [](int q) { return (int)threadIdx.x / LINE_LANES + q / STRETCHES * LINES_PER_PASS; };
    auto line_start = [](int q) { return (int)threadIdx.x % LINE_LANES * 4 + q % STRETCHES * LINE_FLOATS; };
    // Floats start .. start + 3 of a line of in of `length` floats, zeros past its end or if it is outside in.
    auto load_four = [](float (&four)[4], const float* line, int start, int length, bool line_inside) {
        if (line_inside && start + 4 <= length && floats_to_boundary(line) == 0) {
            load_group<4>(four, line + start, true);
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) load_group<1>(four + j, line + start + j, line_inside && start + j < length);
        }
    };

    float values[QUADS_PER_THREAD][4];   // float4 q: row row0 + line_of(q) of op(in), k from k0 + line_start(q)
    if (k_contiguous) {
#pragma unroll
        for (int q = 0; q < QUADS_PER_THREAD; ++q) {
            const int row = row0 + line_of(q);
            load_four(values[q], in + (long long)row * K, k0 + line_start(q), K, row < rows);
        }
    } else {
        float read[QUADS_PER_THREAD][4];   // float4 q: k k0 + line_of(q) of in, rows from row0 + line_start(q)
#pragma unroll
        for (int q = 0; q < QUADS_PER_THREAD; ++q) {
            const int k = k0 + line_of(q);
            load_four(read[q], in + (long long)k * rows, row0 + line_start(q), rows, k < K);
        }
#pragma unroll
        for (int q = 0; q < QUADS_PER_THREAD; ++q)
#pragma unroll
            for (int j = 0; j < 4; ++j) tile[line_of(q)][line_start(q) + j] = read[q][j];
        __syncthreads();
#pragma unroll
        for (int q = 0; q < QUADS_PER_THREAD; ++q)
#pragma unroll
            for (int j = 0; j < 4; ++j) values[q][j] = tile[line_start(q) + j][line_of(q)];
    }

    const long long width = (long long)segments * segment_k;
#pragma unroll
    for (int q = 0; q < QUADS_PER_THREAD; ++q) {
        const int row = row0 + line_of(q), k = k0 + line_start(q);
        if (row >= rows || k >= segment_k) continue;   // segment_k is a multiple of 4: a float4 is in or out
        float big[4], small[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            unsigned big_bits, small_bits;
            split_tf32(values[q][j], big_bits, small_bits);
            big[j] = __uint_as_float(big_bits);
            small[j] = __uint_as_float(small_bits);
        }
        float* destination = out + row * width + k;
        for (int segment = 0; segment < segments; ++segment) {
            const int part = parts >> (2 * segment) & 3;
            float group[4];
#pragma unroll
            for (int j = 0; j < 4; ++j)
                group[j] = part == PART_VALUE ? values[q][j] : part == PART_BIG ? big[j] : small[j];
            store_group<4>(destination + (long long)segment * segment_k, group);
        }
    }
}
