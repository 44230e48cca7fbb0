// Causal self-attention, fused (FlashAttention-2 style), forward and backward, in float32.
//   q, out, dout, dq: (B, H, T, d), one (T, d) matrix per query head, rows of d floats; heads = B H;
//   k, v, dk, dv: (B, H / group, T, d), one matrix per key-value head (below);
//   lse (log-sum-exp of each row of scores) and rowdot (rowsum(dout * out)): (heads, T), C-contiguous.
// Each of q, k, v, out, dout, dq, dk, dv is given as the array that holds it and a HeadLayout (head_layout.cuh):
// its heads are read and written where they lie, so q, k and v cut from one product's output need no copy,
// nor out on its way to the next product.
// Two variants, a template flag:
//   softmax:  S = q kᵀ / √d, P = softmax(S) over the visible keys, out = P v;
//   RELU:     S = q kᵀ / √d, P = max(S, 0) on the visible keys, no normalisation, out = P v.
// causal = 1: query t sees keys 0..t. The _general kernels (softmax) also take PyTorch's scale, attn_mask and
// dropout_p (see "What the general kernels add" below). S and P are never written to memory: a block holds a
// tile of them in registers and shared memory, uses it, and moves on, so the extra memory is O(T) (lse, rowdot).
//
// Head sizes. The tiles are D floats wide, D = 32, 64, 128 or 256, a template parameter: the loops over D
// unroll and each thread's accumulators (D / 8 floats per row) live in registers. The head size d, a
// launch argument, is any number from 1 to D: a tile holds the d columns of a row followed by D - d zeros
// (load_tile), zeros add nothing to a dot product q·k, and their columns of the results are not written
// (store_rows). A head of 80 floats runs in the kernel for 128, at the cost of 128-wide products.
// Grouped-query attention. group = heads of q per head of k and v (1 without grouping): query head h reads
// key-value head h / group, with no copy of k and v per query head. With q (B, H, T, d) and k, v
// (B, H / group, T, d), head h of sequence b is matrix b H + h of q and matrix b H / group + h / group
// = (b H + h) / group of k and v: the flat index divided by the group. dk and dv of a key-value head sum
// over the group's query heads: its blocks loop over them, in order, so the sums have a fixed order.
//
// Work layout, the same in every kernel: a block handles ROWS "rows" (queries in the forward and in the
// dq kernel, keys in the dk, dv kernel; ROWS = 32, 64 or 128, a template parameter) against tiles of 64
// "columns" (keys, or queries). Each thread owns a 2-D micro-tile of 4 rows x 8 columns of each tile,
// held in registers: rows row_group + (ROWS / 4) r (r < 4) and columns column_group + 8 c (c < 8). The
// block has ROWS / 4 row groups x 8 column groups = 2 ROWS threads (64 to 256); a warp holds 4 row groups
// and all 8 column groups, so a row's 64 scores belong to 8 lanes of one warp.
// Why 2-D: a score is a dot product of a row and a column over D. Per 4 steps of D, the thread reads one
// float4 of each of its 4 rows and 8 columns from shared memory and does 4 x 8 x 4 multiply-adds with them.
// Which lanes sit where matters (thread_row_group below): shared memory serves a warp's float4 reads a
// quarter-warp (8 lanes) at a time, 128 bytes per pass (a wavefront); quarters share a pass only where
// they read different banks, and a value that several quarters read costs a pass in each.
// The products that sum over a tile's columns (P v, dS k, Pᵀ dout, dSᵀ q) take the same rows and
// D / 8 columns of the result (accumulators in registers): per 4 columns j of the tile, one float4 of P per
// row and D / 32 float4s of values per j.
// Tiles of q, k, v, dout live in shared memory as [rows][D + 4] floats, a row as in global memory plus 4
// floats of padding, so that consecutive rows start 4 banks apart.
// Exponentials use exp2f, the hardware's approximate 2^x (MUFU.EX2): scores stay unscaled, and
// e^((s - m) / √d) = 2^(s log2(e) / √d - m log2(e) / √d) is one multiply-add and one exp2 per score.
// Only the tiles that cross the diagonal (or the end of the sequence) are masked element by element; the
// others take a version of the same loop without the comparisons (a template flag, MASKED).
// A tile on the diagonal (ROWS = 64: its rows and columns are the same 64 positions) has one quadrant
// masked whole, the 32 queries 0-31 against the 32 keys 32-63: the forward and the two backward passes skip
// those products (QUADRANT below).
// The tiles take 45 to 213 KiB of shared memory, more than the 48 KiB a kernel may declare statically:
// they are carved out of one extern __shared__ array, whose size the launch gives. A block may have at most
// 227 KiB: at D = 256 the backward's four tiles of 64 rows would take 278 KiB, so it runs with ROWS = 32.
// Registers: __launch_bounds__(threads, blocks) holds the compiler to the registers that `blocks` blocks
// per multiprocessor can have (65536 / (blocks * threads)), the number of blocks their shared memory allows
// (228 KiB per multiprocessor on an H100): from D = 128 the tiles take more than half of it, one block.
#include "warp.cuh"
#include "special_values.cuh"
#include "float_groups.cuh"
#include "head_layout.cuh"
#include "philox.cuh"

#define COLUMNS 64                 // columns (keys, or queries) per tile
#define ROWS_PER_THREAD 4
#define COLUMN_GROUPS 8
#define COLUMNS_PER_THREAD (COLUMNS / COLUMN_GROUPS)
#define THREADS_FOR(ROWS) ((ROWS) / ROWS_PER_THREAD * COLUMN_GROUPS)
#define PAD 4
#define WEIGHTS_STRIDE (COLUMNS + 8)  // P and dS tiles: rows of 64 + 8 floats, see store_micro_tile
#define LOG2E 1.4426950408889634f
#define FORWARD_BLOCKS(D, ROWS) ((D) >= 128 ? 1 : (ROWS) == 64 ? 3 : 2)   // per multiprocessor, see above
#define BACKWARD_BLOCKS(D, ROWS) ((D) >= 128 ? 1 : (ROWS) == 64 ? 2 : 1)

// The quadrant of a diagonal tile whose products a tile product skips (a template parameter, QUADRANT).
// Where the rows are queries and the columns keys (forward, dq), the masked quadrant is the upper right:
// rows 0-31, columns 32-63; where the rows are keys (dk, dv), it is the lower left: rows 32-63, columns 0-31.
// With ROWS = 64, a thread's micro-tile rows r < 2 are rows 0-31 of the tile and its columns c < 4 are
// columns 0-31, so the test below is on compile-time constants and costs nothing: a quarter of the diagonal
// tile's multiply-adds are simply not there.
#define NO_QUADRANT 0
#define UPPER_RIGHT 1
#define LOWER_LEFT 2
__device__ __forceinline__ bool in_skipped_quadrant(int quadrant, int r, bool second_half_column)
{
    bool first_half_row = r < ROWS_PER_THREAD / 2;
    return (quadrant == UPPER_RIGHT && first_half_row && second_half_column) ||
           (quadrant == LOWER_LEFT && !first_half_row && !second_half_column);
}

// Lane l of a warp is row group 4 warp + l % 4, column group l / 4: a quarter-warp holds all 4 of the warp's
// row groups and 2 column groups. Per 4 steps of D the warp reads 8 columns (float4s of 8 different
// columns, in 8 different bank groups: each quarter reads 2, and the 4 quarters share one pass) and 4 rows
// (every quarter reads the same 4 rows: 4 passes): 8 x 1 + 4 x 4 = 24 passes for 32 x 128 multiply-adds.
// With the lanes in the other order (a quarter = 1 row group x 8 column groups), the same reads take
// 8 x 4 + 4 x 1 = 36 passes. Measured (Nsight Compute, per instruction, H100), a column read takes 2 passes,
// not 1: the quarters of each half-warp share a pass, the two halves do not. 8 x 2 + 4 x 4 = 32 passes.
__device__ int thread_row_group() { return (threadIdx.x / 32) * 4 + threadIdx.x % 4; }
__device__ int thread_column_group() { return (threadIdx.x % 32) / 4; }

// Load rows first_row .. first_row + ROWS - 1 of a (T, d) matrix whose rows are row_stride floats apart into
// tile[ROWS][D + PAD]; rows past T and columns d .. D - 1 are zero. Consecutive threads read consecutive
// float4s: each warp's load is four whole 128-byte lines, in a quarter of the instructions of float-by-float
// loads. Every float4 is aligned, in global memory (where d is a multiple of 4, the op hands the kernels only
// layouts whose offsets and strides are multiples of 4 floats, in arrays that start on 256 bytes) and in the
// tile (D + PAD is a multiple of 4). A thread copies the same float4 of every ROW_STEP-th row, so its addresses are computed
// once and then step by constants. Dividing a running index into row and column, in 64-bit arithmetic, cost
// about 18 integer instructions per float4 (Nsight Compute): 6 % of the forward's instructions and its time.
// A narrower head (d < D, the same for every thread: one branch, no divergence) reads a float4 where it lies
// inside the row and rows start on 16 bytes (d a multiple of 4), floats otherwise.
template <int ROWS, int D, int THREADS>
__device__ void load_tile(float* tile, const float* matrix, long long row_stride, int first_row, int T, int d)
{
    constexpr int PER_ROW = D / 4, ROW_STEP = THREADS / PER_ROW;  // float4s per row; rows per pass of the block
    static_assert(THREADS % PER_ROW == 0 && ROWS % ROW_STEP == 0, "whole rows per pass, whole passes per tile");
    int row = threadIdx.x / PER_ROW, column = 4 * (threadIdx.x % PER_ROW);
    float* to = tile + row * (D + PAD) + column;
    if (d == D) {
        const float* from = matrix + (first_row + row) * row_stride + column;
#pragma unroll
        for (int pass = 0; pass < ROWS / ROW_STEP; pass++) {
            float4 value = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (first_row + row + pass * ROW_STEP < T)
                value = *reinterpret_cast<const float4*>(from + pass * ROW_STEP * row_stride);
            *reinterpret_cast<float4*>(to + pass * ROW_STEP * (D + PAD)) = value;
        }
        return;
    }
    const float* from = matrix + (first_row + row) * row_stride + column;
    bool whole_float4 = d % 4 == 0;
    // Not unrolled: unrolled too, this loop beside the one above made ptxas spill registers in the forward at
    // D = 64 (`nvcc -Xptxas -v`), the head size GPT-2 trains with.
#pragma unroll 1
    for (int pass = 0; pass < ROWS / ROW_STEP; pass++) {
        float value[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const float* source = from + pass * ROW_STEP * row_stride;
        if (first_row + row + pass * ROW_STEP < T) {
            if (whole_float4) load_group<4>(value, source, column < d);
            else for (int e = 0; e < 4; e++) load_group<1>(value + e, source + e, column + e < d);
        }
        store_group<4>(to + pass * ROW_STEP * (D + PAD), value);
    }
}

// dot[r][c] = <rows[row r], columns[column c]> over D: the thread's micro-tile of a (ROWS, D) tile times a
// (64, D) tile transposed. Each float4 read serves 8 (row) or 4 (column) dot products. The loop over D is
// unrolled 4 times, not fully: fully unrolled, the compiler starts every read early and needs more
// registers than the launch bounds leave. Products in QUADRANT are left at 0.
template <int D, int ROWS, int QUADRANT = NO_QUADRANT>
__device__ void tile_dots(float dot[ROWS_PER_THREAD][COLUMNS_PER_THREAD], const float* rows, const float* columns)
{
    constexpr int ROW_GROUPS = ROWS / ROWS_PER_THREAD;
    int row_group = thread_row_group(), column_group = thread_column_group();
    for (int r = 0; r < ROWS_PER_THREAD; r++)
        for (int c = 0; c < COLUMNS_PER_THREAD; c++) dot[r][c] = 0.0f;
#pragma unroll 4
    for (int i = 0; i < D; i += 4) {
        float4 column[COLUMNS_PER_THREAD];
        for (int c = 0; c < COLUMNS_PER_THREAD; c++)
            column[c] = *reinterpret_cast<const float4*>(&columns[(column_group + COLUMN_GROUPS * c) * (D + PAD) + i]);
        for (int r = 0; r < ROWS_PER_THREAD; r++) {
            float4 a = *reinterpret_cast<const float4*>(&rows[(row_group + ROW_GROUPS * r) * (D + PAD) + i]);
            for (int c = 0; c < COLUMNS_PER_THREAD; c++) {
                if (in_skipped_quadrant(QUADRANT, r, c >= COLUMNS_PER_THREAD / 2)) continue;
                dot[r][c] += a.x * column[c].x;  // one multiply-add each
                dot[r][c] += a.y * column[c].y;
                dot[r][c] += a.z * column[c].z;
                dot[r][c] += a.w * column[c].w;
            }
        }
    }
}

// accumulator[r][4h + e] += Σ_j weights[row r][j] * values[j][4 column_group + 32 h + e]: the thread's
// rows of a (ROWS, 64) tile of weights (P or dS, rows STRIDE floats apart) times a (64, D) tile of values;
// the thread owns D / 8 columns of each of its rows, D / 32 float4s 32 floats apart (the 8 column groups'
// float4s of one row of values are 128 consecutive bytes: one pass). Per 4 steps of j: one float4 of
// weights per row, 4 x D / 32 float4s of values, 4 x D / 8 x 4 multiply-adds.
// With a QUADRANT to skip, the loop over j runs in two halves (0-31, 32-63), each over the rows that have
// weights there, so that which rows take part is known at compile time.
template <int D, int ROWS, int STRIDE = WEIGHTS_STRIDE, int QUADRANT = NO_QUADRANT>
__device__ void tile_accumulate(float accumulator[ROWS_PER_THREAD][D / COLUMN_GROUPS], const float* weights,
                                const float* values)
{
    constexpr int ROW_GROUPS = ROWS / ROWS_PER_THREAD;
    constexpr int CHUNKS = D / (4 * COLUMN_GROUPS);
    constexpr int HALVES = QUADRANT == NO_QUADRANT ? 1 : 2, SPAN = COLUMNS / HALVES;
    int row_group = thread_row_group(), column_group = thread_column_group();
#pragma unroll
    for (int half = 0; half < HALVES; half++) {
#pragma unroll 4
        for (int j = half * SPAN; j < (half + 1) * SPAN; j += 4) {
            float4 value[4][CHUNKS];
            for (int jj = 0; jj < 4; jj++)
                for (int h = 0; h < CHUNKS; h++)
                    value[jj][h] = *reinterpret_cast<const float4*>(
                        &values[(j + jj) * (D + PAD) + 4 * column_group + 4 * COLUMN_GROUPS * h]);
            for (int r = 0; r < ROWS_PER_THREAD; r++) {
                if (in_skipped_quadrant(QUADRANT, r, half == 1)) continue;
                float4 w = *reinterpret_cast<const float4*>(&weights[(row_group + ROW_GROUPS * r) * STRIDE + j]);
                for (int h = 0; h < CHUNKS; h++) {
                    float* a = &accumulator[r][4 * h];
                    a[0] += w.x * value[0][h].x; a[0] += w.y * value[1][h].x; a[0] += w.z * value[2][h].x; a[0] += w.w * value[3][h].x;
                    a[1] += w.x * value[0][h].y; a[1] += w.y * value[1][h].y; a[1] += w.z * value[2][h].y; a[1] += w.w * value[3][h].y;
                    a[2] += w.x * value[0][h].z; a[2] += w.y * value[1][h].z; a[2] += w.z * value[2][h].z; a[2] += w.w * value[3][h].z;
                    a[3] += w.x * value[0][h].w; a[3] += w.y * value[1][h].w; a[3] += w.z * value[2][h].w; a[3] += w.w * value[3][h].w;
                }
            }
        }
    }
}

// Maximum and sum over the 8 lanes that share a row: lanes l, l ^ 4, l ^ 8, ... (the same l % 4).
__device__ float row_max(float value)
{
    for (int offset = 4; offset < 32; offset *= 2) value = fmaxf(value, __shfl_xor_sync(FULL_MASK, value, offset));
    return value;
}

__device__ float row_sum(float value)
{
    for (int offset = 4; offset < 32; offset *= 2) value += __shfl_xor_sync(FULL_MASK, value, offset);
    return value;
}

// The first of the 4 columns of the thread's float4 h of a row of results: D / 32 float4s 32 floats apart.
__device__ int result_column(int h) { return 4 * thread_column_group() + 4 * COLUMN_GROUPS * h; }

// Write the thread's rows of a (ROWS, D) accumulator, times `factor`, to rows first_row + ... of a (T, d)
// matrix whose rows are row_stride floats apart, the columns below d: a float4 where rows start on 16 bytes
// (d a multiple of 4), else float by float.
template <int D, int ROWS>
__device__ void store_rows(float* matrix, long long row_stride, float accumulator[ROWS_PER_THREAD][D / COLUMN_GROUPS],
                           int first_row, int T, int d, float factor)
{
    bool whole_float4 = d % 4 == 0;
    for (int r = 0; r < ROWS_PER_THREAD; r++) {
        int row = first_row + thread_row_group() + ROWS / ROWS_PER_THREAD * r;
        if (row >= T) continue;
        for (int h = 0; h < D / (4 * COLUMN_GROUPS); h++) {
            int column = result_column(h);
            float scaled[4];
            for (int e = 0; e < 4; e++) scaled[e] = factor * accumulator[r][4 * h + e];
            float* to = matrix + row * row_stride + column;
            if (whole_float4) {
                if (column < d) store_group<4>(to, scaled);
            } else {
                for (int e = 0; e < 4; e++)
                    if (column + e < d) to[e] = scaled[e];
            }
        }
    }
}

// The same, added into global memory with atomicAdd: one float4 atomic on compute capability 9.0 and later
// (a quarter of the atomic instructions); before that, or where rows do not start on 16 bytes, one per float.
template <int D, int ROWS>
__device__ void atomic_add_rows(float* matrix, long long row_stride, float accumulator[ROWS_PER_THREAD][D / COLUMN_GROUPS],
                                int first_row, int T, int d, float factor)
{
    bool whole_float4 = d % 4 == 0;
    for (int r = 0; r < ROWS_PER_THREAD; r++) {
        int row = first_row + thread_row_group() + ROWS / ROWS_PER_THREAD * r;
        if (row >= T) continue;
        for (int h = 0; h < D / (4 * COLUMN_GROUPS); h++) {
            int column = result_column(h);
            const float* a = &accumulator[r][4 * h];
            float* to = matrix + row * row_stride + column;
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
            if (whole_float4) {
                if (column < d)
                    atomicAdd(reinterpret_cast<float4*>(to), make_float4(factor * a[0], factor * a[1], factor * a[2], factor * a[3]));
                continue;
            }
#endif
            for (int e = 0; e < 4; e++)
                if (column + e < d) atomicAdd(to + e, factor * a[e]);
        }
    }
}

// Write the thread's micro-tile of a (ROWS, 64) tile to tile[ROWS][64 + 8] in shared memory. A warp writes
// 4 rows x 8 columns at once: rows 72 floats apart start 8 banks apart, so the 32 floats fall in 32
// different banks.
template <int ROWS>
__device__ void store_micro_tile(float* tile, float value[ROWS_PER_THREAD][COLUMNS_PER_THREAD])
{
    int row_group = thread_row_group(), column_group = thread_column_group();
    for (int r = 0; r < ROWS_PER_THREAD; r++)
        for (int c = 0; c < COLUMNS_PER_THREAD; c++)
            tile[(row_group + ROWS / ROWS_PER_THREAD * r) * WEIGHTS_STRIDE + column_group + COLUMN_GROUPS * c] = value[r][c];
}

// The same micro-tile written transposed, to tile[64][ROWS + PAD]: the thread's (row, column) entry goes to
// row `column`, column `row`. A warp writes 8 columns x 4 rows: rows ROWS + 4 floats apart start 4 banks
// apart, 32 different banks again.
template <int ROWS>
__device__ void store_micro_tile_transposed(float* tile, float value[ROWS_PER_THREAD][COLUMNS_PER_THREAD])
{
    int row_group = thread_row_group(), column_group = thread_column_group();
    for (int r = 0; r < ROWS_PER_THREAD; r++)
        for (int c = 0; c < COLUMNS_PER_THREAD; c++)
            tile[(column_group + COLUMN_GROUPS * c) * (ROWS + PAD) + row_group + ROWS / ROWS_PER_THREAD * r] = value[r][c];
}

// ---- What the general kernels add: PyTorch's scale, attn_mask and dropout_p ----
// The plain kernels (attention_forward, attention_backward_dk_dv, attention_backward_dq) compute softmax(q kᵀ / √d)
// with the causal mask alone. Their _general versions take what scaled_dot_product_attention takes besides:
//   scale:   S = scale q kᵀ, any float. The plain kernels keep scores unscaled and scale inside the exponent,
//            which relies on 1/√d > 0 (the largest score stays the largest); the general ones compute
//            S = scale q kᵀ + mask once per score (scale_and_mask) and then run the same code with a scale of 1.
//   a mask:  Mask = float: added to S; Mask = bool: false removes the key (S = -inf); Mask = void: none. It is
//            (B, H, T, T) seen through strides, 0 along an axis it broadcasts over: one (T, T) mask serves
//            every head without a copy.
//   dropout: each weight P_ij kept with probability 1 - p and then scaled by 1 / (1 - p), from the Philox
//            number of element (b, h, i, j) of (B, H, T, T), flat index ((b H + h) T + i) T + j, of the stream
//            (seed, offset) in rng_state (philox.cuh, chapter 07), plus dropout_start (0 for a whole batch; under
//            data parallelism the index of the rank's first weight in the global batch): the backward
//            regenerates the same mask.
// A row whose every key is masked attends to nothing: its output is 0 and its gradients are 0, as in
// PyTorch's math backend (its _safe_softmax). The forward then saves lse = +inf, which makes every P of the
// row 2^(S - inf) = 0 in the backward, whatever S is.
// These are template flags (GENERAL, Mask, DROPOUT): the plain kernels' instantiations contain none of it.
template <typename Mask>
struct ScoreOptions {
    float scale;                      // the plain kernels' 1/√d, or the caller's
    const Mask* mask;                 // Mask = void: no mask
    long long mask_stride[4];         // in elements: batch, head, query, key
    int heads;                        // H: flat query head `head` is head head % H of sequence head / H
    int T;
    unsigned long long seed, offset;  // dropout's stream, read once from rng_state
    unsigned long long start;         // the stream index of weight (0, 0, 0, 0): a rank's rows' place in the batch
    float dropout_p, keep_scale;      // keep_scale = 1 / (1 - p)
};

__device__ __forceinline__ float mask_term(const void*, long long) { return 0.0f; }
__device__ __forceinline__ float mask_term(const float* mask, long long at) { return mask[at]; }
__device__ __forceinline__ float mask_term(const bool* mask, long long at) { return mask[at] ? 0.0f : NEGATIVE_INFINITY; }

template <typename Mask>
__device__ float mask_value(const ScoreOptions<Mask>& options, long long head, int query, int key)
{
    const long long* stride = options.mask_stride;
    long long at = head / options.heads * stride[0] + head % options.heads * stride[1] + query * stride[2] +
                   key * stride[3];
    return mask_term(options.mask, at);
}

// Whether dropout keeps the weight of (query, key) of a flat query head.
template <typename Mask>
__device__ bool dropout_keeps(const ScoreOptions<Mask>& options, long long head, int query, int key)
{
    unsigned long long index = options.start + ((unsigned long long)head * options.T + query) * options.T + key;
    return philox_uniform(options.seed, options.offset, index) >= options.dropout_p;
}

// The options of the plain kernels: 1/√d, nothing else.
__device__ ScoreOptions<void> plain_options(int d)
{
    ScoreOptions<void> options = {};
    options.scale = rsqrtf((float)d);
    return options;
}

// The options of a general kernel, from its arguments; rng_state is read only where there is dropout.
template <typename Mask, bool DROPOUT>
__device__ ScoreOptions<Mask> general_options(float scale, const Mask* mask, long long batch_stride,
                                              long long head_stride, long long query_stride, long long key_stride,
                                              int heads, int T, const unsigned long long* rng_state, float dropout_p,
                                              unsigned long long dropout_start)
{
    ScoreOptions<Mask> options;
    options.scale = scale;
    options.mask = mask;
    options.mask_stride[0] = batch_stride; options.mask_stride[1] = head_stride;
    options.mask_stride[2] = query_stride; options.mask_stride[3] = key_stride;
    options.heads = heads;
    options.T = T;
    options.seed = DROPOUT ? rng_state[0] : 0;
    options.offset = DROPOUT ? rng_state[1] : 0;
    options.start = DROPOUT ? dropout_start : 0;
    options.dropout_p = dropout_p;
    options.keep_scale = 1.0f / (1.0f - dropout_p);
    return options;
}

// s = scale s + mask over a thread's micro-tile of unscaled scores q·k, in place; ROWS_ARE_QUERIES says which
// of the tile's axes are the queries (the forward and dq: rows; dk, dv: columns). Positions past T (padding)
// are left alone: the kernels mask them anyway, and the mask has no element there.
template <int ROWS, bool ROWS_ARE_QUERIES, typename Mask>
__device__ void scale_and_mask(float s[ROWS_PER_THREAD][COLUMNS_PER_THREAD], const ScoreOptions<Mask>& options,
                               long long head, int first_row, int first_column)
{
    int row_group = thread_row_group(), column_group = thread_column_group();
    for (int r = 0; r < ROWS_PER_THREAD; r++) {
        int row = first_row + row_group + ROWS / ROWS_PER_THREAD * r;
        for (int c = 0; c < COLUMNS_PER_THREAD; c++) {
            int column = first_column + column_group + COLUMN_GROUPS * c;
            int query = ROWS_ARE_QUERIES ? row : column, key = ROWS_ARE_QUERIES ? column : row;
            float term = query < options.T && key < options.T ? mask_value(options, head, query, key) : 0.0f;
            s[r][c] = fmaf(options.scale, s[r][c], term);
        }
    }
}

// The forward's online softmax (or ReLU) over one tile, in place: s holds q·k, unscaled; it becomes P.
// The running maximum m is kept unscaled too (scaling by 1/√d > 0 keeps the order). When the maximum
// grows, what was summed so far, l and the output, is rescaled by e^((m_old - m_new) / √d).
// GENERAL (scores already scaled and masked, scale = 1): a row may have met only masked keys so far, its
// maximum still -inf, where 2^(-inf - (-inf)) would be NaN: nothing is rescaled and its P stay 0.
// DROPOUT: the sum l takes every P (the softmax is of all the weights); the output takes the kept ones, scaled.
template <bool RELU, bool MASKED, int ROWS, int D, bool GENERAL, typename Mask, bool DROPOUT>
__device__ void forward_probabilities(float s[ROWS_PER_THREAD][COLUMNS_PER_THREAD],
                                      float o[ROWS_PER_THREAD][D / COLUMN_GROUPS], float running_max[ROWS_PER_THREAD],
                                      float running_sum[ROWS_PER_THREAD], int first_query, int first_key, int T,
                                      int causal, float scale, const ScoreOptions<Mask>& options, long long head)
{
    const float exp2_scale = scale * LOG2E;
    int row_group = thread_row_group(), column_group = thread_column_group();
    for (int r = 0; r < ROWS_PER_THREAD; r++) {
        int query = first_query + row_group + ROWS / ROWS_PER_THREAD * r;
        bool visible[COLUMNS_PER_THREAD];
        float tile_max = NEGATIVE_INFINITY;
        for (int c = 0; c < COLUMNS_PER_THREAD; c++) {
            int key = first_key + column_group + COLUMN_GROUPS * c;
            visible[c] = !MASKED || (key < T && (!causal || key <= query));
            if (visible[c]) tile_max = fmaxf(tile_max, s[r][c]);
        }
        if (RELU) {
            for (int c = 0; c < COLUMNS_PER_THREAD; c++) s[r][c] = visible[c] && s[r][c] > 0.0f ? scale * s[r][c] : 0.0f;
        } else {
            // Key 0 is in the first tile and visible to every row, so the maximum is finite from then on.
            float new_max = fmaxf(running_max[r], row_max(tile_max));
            bool nothing_seen = GENERAL && new_max == NEGATIVE_INFINITY;
            float correction = nothing_seen ? 1.0f : exp2f((running_max[r] - new_max) * exp2_scale);  // 2^-inf = 0 on the first tile
            float offset = nothing_seen ? 0.0f : new_max * exp2_scale;
            running_sum[r] *= correction;
            for (int c = 0; c < COLUMNS_PER_THREAD; c++) {
                s[r][c] = visible[c] ? exp2f(fmaf(s[r][c], exp2_scale, -offset)) : 0.0f;
                running_sum[r] += s[r][c];
                if (DROPOUT && visible[c]) {
                    int key = first_key + column_group + COLUMN_GROUPS * c;
                    s[r][c] = dropout_keeps(options, head, query, key) ? s[r][c] * options.keep_scale : 0.0f;
                }
            }
            for (int c = 0; c < D / COLUMN_GROUPS; c++) o[r][c] *= correction;
            running_max[r] = new_max;
        }
    }
}

// Forward. grid = (heads, ⌈T/ROWS⌉): a block owns ROWS queries of one head and loops over the key tiles
// of its key-value head, keeping for each row the running maximum m and (per thread) the running sum l of
// exp(S - m), the online softmax of chapter 04. Causal: the loop stops at the tile holding the block's last
// query, so tiles entirely above the diagonal are never touched; only tiles crossing the diagonal are masked
// element by element. Query tiles are taken last first: with the causal mask they have the most key tiles,
// and starting them early keeps the GPU from ending on a few long blocks.
// Shared memory: a q tile of ROWS x (D + 4) floats, k and v tiles of 64 x (D + 4), a ROWS x 72 tile of P.
// The kernel's body, a device function that the plain and the general kernels both run.
template <int D, bool RELU, int ROWS, bool GENERAL, typename Mask, bool DROPOUT>
__device__ __forceinline__ void forward_block(float* out, float* lse, const float* q, const float* k, const float* v,
                                              int T, int causal, int d, int group, int heads, HeadLayout out_at,
                                              HeadLayout q_at, HeadLayout k_at, HeadLayout v_at,
                                              const ScoreOptions<Mask>& options)
{
    constexpr int THREADS = THREADS_FOR(ROWS);
    extern __shared__ __align__(16) float shared[];
    float* q_tile = shared;
    float* k_tile = q_tile + ROWS * (D + PAD);
    float* v_tile = k_tile + COLUMNS * (D + PAD);
    float* p_tile = v_tile + COLUMNS * (D + PAD);
    const float scale = GENERAL ? 1.0f : options.scale;  // the general kernels scale the scores themselves
    long long head = blockIdx.x, key_head = head / group;
    int first_query = (gridDim.y - 1 - blockIdx.y) * ROWS;
    q += q_at.start(head, heads); out += out_at.start(head, heads);
    k += k_at.start(key_head, heads / group); v += v_at.start(key_head, heads / group);
    if (!RELU) lse += head * T;  // the ReLU variant saves no log-sum-exp

    load_tile<ROWS, D, THREADS>(q_tile, q, q_at.row, first_query, T, d);
    float o[ROWS_PER_THREAD][D / COLUMN_GROUPS] = {};
    float running_max[ROWS_PER_THREAD], running_sum[ROWS_PER_THREAD];
    for (int r = 0; r < ROWS_PER_THREAD; r++) { running_max[r] = NEGATIVE_INFINITY; running_sum[r] = 0.0f; }

    int last_key = causal ? min(first_query + ROWS - 1, T - 1) : T - 1;
    for (int first_key = 0; first_key <= last_key; first_key += COLUMNS) {
        __syncthreads();  // everyone is done with the previous tiles
        load_tile<COLUMNS, D, THREADS>(k_tile, k, k_at.row, first_key, T, d);
        load_tile<COLUMNS, D, THREADS>(v_tile, v, v_at.row, first_key, T, d);
        __syncthreads();
        float s[ROWS_PER_THREAD][COLUMNS_PER_THREAD];
        bool diagonal = ROWS == COLUMNS && causal && first_key == first_query;  // its upper right quadrant masked
        if (diagonal) tile_dots<D, ROWS, UPPER_RIGHT>(s, q_tile, k_tile);
        else tile_dots<D, ROWS>(s, q_tile, k_tile);
        if (GENERAL) scale_and_mask<ROWS, true>(s, options, head, first_query, first_key);
        bool masked = (causal && first_key + COLUMNS - 1 > first_query) || first_key + COLUMNS > T;
        if (masked)
            forward_probabilities<RELU, true, ROWS, D, GENERAL, Mask, DROPOUT>(
                s, o, running_max, running_sum, first_query, first_key, T, causal, scale, options, head);
        else
            forward_probabilities<RELU, false, ROWS, D, GENERAL, Mask, DROPOUT>(
                s, o, running_max, running_sum, first_query, first_key, T, causal, scale, options, head);
        store_micro_tile<ROWS>(p_tile, s);
        __syncwarp();  // a thread reads back only rows of p_tile that its own warp wrote
        if (diagonal) tile_accumulate<D, ROWS, WEIGHTS_STRIDE, UPPER_RIGHT>(o, p_tile, v_tile);
        else tile_accumulate<D, ROWS>(o, p_tile, v_tile);
    }
    for (int r = 0; r < ROWS_PER_THREAD; r++) {
        int query = first_query + thread_row_group() + ROWS / ROWS_PER_THREAD * r;
        float factor = 1.0f;
        if (!RELU) {
            float sum = row_sum(running_sum[r]);
            factor = 1.0f / sum;
            float row_lse = running_max[r] * scale + logf(sum);
            if (GENERAL && sum == 0.0f) {  // every key masked: out = 0, and lse = +inf gives P = 0 in the backward
                factor = 0.0f;
                row_lse = -NEGATIVE_INFINITY;
            }
            if (thread_column_group() == 0 && query < T) lse[query] = row_lse;
        }
        for (int c = 0; c < D / COLUMN_GROUPS; c++) o[r][c] *= factor;
    }
    store_rows<D, ROWS>(out, out_at.row, o, first_query, T, d, 1.0f);
}

// heads: H, the query heads of one batch element (B H blocks along x); each array with its HeadLayout.
template <int D, bool RELU, int ROWS>
__global__ void __launch_bounds__(THREADS_FOR(ROWS), FORWARD_BLOCKS(D, ROWS)) attention_forward(float* out,
    float* lse, const float* q, const float* k, const float* v, int T, int causal, int d, int group, int heads,
    HeadLayout out_at, HeadLayout q_at, HeadLayout k_at, HeadLayout v_at)
{
    forward_block<D, RELU, ROWS, false, void, false>(out, lse, q, k, v, T, causal, d, group, heads, out_at, q_at,
                                                     k_at, v_at, plain_options(d));
}

// The forward with a scale, a mask and dropout (softmax only): the mask's strides in elements.
template <int D, int ROWS, typename Mask, bool DROPOUT>
__global__ void __launch_bounds__(THREADS_FOR(ROWS), FORWARD_BLOCKS(D, ROWS)) attention_forward_general(
    float* out, float* lse, const float* q, const float* k, const float* v, int T, int causal, int d, int group,
    int heads, HeadLayout out_at, HeadLayout q_at, HeadLayout k_at, HeadLayout v_at, float scale, const Mask* mask,
    long long mask_batch_stride, long long mask_head_stride, long long mask_query_stride, long long mask_key_stride,
    const unsigned long long* rng_state, float dropout_p, unsigned long long dropout_start)
{
    forward_block<D, false, ROWS, true, Mask, DROPOUT>(out, lse, q, k, v, T, causal, d, group, heads, out_at, q_at,
        k_at, v_at, general_options<Mask, DROPOUT>(scale, mask, mask_batch_stride, mask_head_stride,
                                                   mask_query_stride, mask_key_stride, heads, T, rng_state,
                                                   dropout_p, dropout_start));
}

// rowdot[i] = Σ_c dout[i][c] * out[i][c], the softmax backward's row sum (D_i in FlashAttention-2):
// Σ_j P_ij dP_ij = Σ_j P_ij <dout_i, v_j> = <dout_i, out_i>, for the rows = heads T rows of the heads. A
// half-warp per row, a float4 per lane: one load instruction covers two whole rows at d = 64, where a warp per
// row with a float per lane needed four (measured on an H100 at 98304 rows of 64: 19.7 µs, against 22.8 µs a
// warp per row). Rows of a head size that is not a multiple of 4 do not all start on 16 bytes: a float per lane.
#define HALF_WARP 16
extern "C" __global__ void attention_backward_rowdot(float* rowdot, const float* dout, const float* out, int rows,
                                                     int d, int T, int heads, HeadLayout dout_at, HeadLayout out_at)
{
    long long row = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / HALF_WARP;
    int lane = threadIdx.x % HALF_WARP;
    float sum = 0.0f;
    if (row < rows) {  // no early return: the shuffles below need every lane of the warp
        long long head = row / T, position = row % T;
        const float* dout_row = dout + dout_at.start(head, heads) + position * dout_at.row;
        const float* out_row = out + out_at.start(head, heads) + position * out_at.row;
        if (d % 4 == 0) {
            for (int column = 4 * lane; column < d; column += 4 * HALF_WARP) {
                float4 a = *reinterpret_cast<const float4*>(dout_row + column);
                float4 b = *reinterpret_cast<const float4*>(out_row + column);
                sum += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
            }
        } else {
            for (int column = lane; column < d; column += HALF_WARP) sum += dout_row[column] * out_row[column];
        }
    }
    for (int offset = HALF_WARP / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(FULL_MASK, sum, offset);  // within the half
    if (row < rows && lane == 0) rowdot[row] = sum;
}

// P of one (query, key) pair in the backward, from its unscaled score s = q·k, recomputed from the saved
// log-sum-exp: softmax 2^(s log2(e) / √d - lse log2(e)) (lse2 = lse log2(e)); ReLU max(s / √d, 0).
template <bool RELU>
__device__ float probability(float score, float scale, float lse2)
{
    if (RELU) return score > 0.0f ? scale * score : 0.0f;
    return exp2f(fmaf(score, scale * LOG2E, -lse2));
}

// The gradient of a score from its probability and dP: softmax dS = P (dP - rowdot_query); ReLU dS = dP
// where S > 0 (that is, where P > 0), else 0: ReLU's derivative has no row sum to subtract.
template <bool RELU>
__device__ float score_gradient(float p, float dp, float query_rowdot)
{
    return RELU ? (p > 0.0f ? dp : 0.0f) : p * (dp - query_rowdot);
}

// Whether the backward counts the pair (query, key) of a tile that straddles the diagonal or the end of the
// sequence: both inside the sequence (a tile's rows and columns past T are padding) and, when causal, the key
// not after the query.
__device__ __forceinline__ bool backward_visible(int query, int key, int T, int causal)
{
    return query < T && key < T && (!causal || key <= query);
}

// The dk, dv kernel's tile of P, in place of the scores (rows = keys, columns = queries).
template <bool RELU, bool MASKED, int ROWS>
__device__ void key_probabilities(float s[ROWS_PER_THREAD][COLUMNS_PER_THREAD],
                                  const float query_lse2[COLUMNS_PER_THREAD], int first_key, int first_query, int T,
                                  int causal, float scale)
{
    int row_group = thread_row_group(), column_group = thread_column_group();
    for (int r = 0; r < ROWS_PER_THREAD; r++) {
        int key = first_key + row_group + ROWS / ROWS_PER_THREAD * r;
        for (int c = 0; c < COLUMNS_PER_THREAD; c++) {
            int query = first_query + column_group + COLUMN_GROUPS * c;
            bool visible = !MASKED || backward_visible(query, key, T, causal);
            s[r][c] = visible ? probability<RELU>(s[r][c], scale, query_lse2[c]) : 0.0f;
        }
    }
}

// The dq kernel's tile of dS, in place of dP (rows = queries, columns = keys). DROPOUT: out = (P ⊙ Z) v with
// Z = mask / (1 - p), so the gradient of P is Z ⊙ dP, and dS = P ⊙ (Z ⊙ dP - rowdot): rowdot = <dout, out>
// = Σ_j P_ij Z_ij dP_ij is still the row sum that the softmax backward subtracts.
template <bool RELU, bool MASKED, int ROWS, typename Mask, bool DROPOUT>
__device__ void query_gradients(const float s[ROWS_PER_THREAD][COLUMNS_PER_THREAD],
                                float ds[ROWS_PER_THREAD][COLUMNS_PER_THREAD], const float row_lse2[ROWS_PER_THREAD],
                                const float row_rowdot[ROWS_PER_THREAD], int first_query, int first_key, int T,
                                int causal, float scale, const ScoreOptions<Mask>& options, long long head)
{
    int row_group = thread_row_group(), column_group = thread_column_group();
    for (int r = 0; r < ROWS_PER_THREAD; r++) {
        int query = first_query + row_group + ROWS / ROWS_PER_THREAD * r;
        for (int c = 0; c < COLUMNS_PER_THREAD; c++) {
            int key = first_key + column_group + COLUMN_GROUPS * c;
            bool visible = !MASKED || backward_visible(query, key, T, causal);
            float p = visible ? probability<RELU>(s[r][c], scale, row_lse2[r]) : 0.0f;
            float dp = ds[r][c];
            if (DROPOUT) dp = visible && dropout_keeps(options, head, query, key) ? dp * options.keep_scale : 0.0f;
            ds[r][c] = score_gradient<RELU>(p, dp, row_rowdot[r]);
        }
    }
}

// Backward, first pass: dk and dv. grid = (key-value heads, ⌈T/ROWS⌉): a block owns ROWS keys (rows;
// columns = queries) of one key-value head and loops over the query heads of its group, and for each over
// the query tiles that see its keys, from the diagonal down (causal) to T:
//   dv_j += Σ_i P_ij dout_i,  dk_j += Σ_i dS_ij q_i / √d    (i over the group's heads and their queries).
// Every dk, dv element is summed by one thread in a fixed order: no atomics, the same bits every run.
// P (transposed: rows = keys) goes through one shared tile; dS then takes its place, each thread reading
// its own entries of P back to compute them (fewer registers than keeping P).
// DQ_ATOMIC: the one-pass backward. The block also adds each query tile's share of dq,
// dq_i += Σ_j dS_ij k_j / √d over its 64 keys (ROWS = 64), into dq with atomicAdd: dq must hold zeros
// before the launch, and the dq pass is not needed. dS goes to a second tile, transposed (rows = queries),
// which every warp reads whole: a __syncthreads between writing and reading it. The blocks that share a
// query tile add into it in whatever order they run: dq's bits vary from run to run.
// Shared memory: k, v tiles of ROWS x (D + 4) floats, q, dout tiles of 64 x (D + 4), a ROWS x 72 tile, and
// with DQ_ATOMIC a 64 x (ROWS + 4) tile.
// DROPOUT: dv takes P ⊙ Z (the weights the forward used), dS = P ⊙ (Z ⊙ dP - rowdot) (query_gradients): the
// tile holds P ⊙ Z for dv while P stays in registers for dS, and the thread keeps its 32 bits of Z in a word.
template <int D, bool RELU, int ROWS, bool DQ_ATOMIC, bool GENERAL, typename Mask, bool DROPOUT>
__device__ __forceinline__ void backward_dk_dv_block(float* dk, float* dv, float* dq, const float* dout,
    const float* q, const float* k, const float* v, const float* lse, const float* rowdot, int T, int causal, int d,
    int group, int heads, HeadLayout dk_at, HeadLayout dv_at, HeadLayout dq_at, HeadLayout dout_at, HeadLayout q_at,
    HeadLayout k_at, HeadLayout v_at, const ScoreOptions<Mask>& options)
{
    static_assert(!DQ_ATOMIC || ROWS == COLUMNS, "the one-pass dq takes tiles of 64 keys");
    constexpr int THREADS = THREADS_FOR(ROWS);
    extern __shared__ __align__(16) float shared[];
    float* k_tile = shared;
    float* v_tile = k_tile + ROWS * (D + PAD);
    float* q_tile = v_tile + ROWS * (D + PAD);
    float* dout_tile = q_tile + COLUMNS * (D + PAD);
    float* weights_tile = dout_tile + COLUMNS * (D + PAD);  // P, then dS, transposed
    float* ds_by_query = weights_tile + ROWS * WEIGHTS_STRIDE;  // DQ_ATOMIC: dS, rows = queries
    const float scale = options.scale;                         // of the gradients
    const float exponent_scale = GENERAL ? 1.0f : scale;       // of the scores in P (general: already scaled)
    int row_group = thread_row_group(), column_group = thread_column_group();
    long long key_head = blockIdx.x;
    int first_key = blockIdx.y * ROWS, key_heads = heads / group;
    k += k_at.start(key_head, key_heads); v += v_at.start(key_head, key_heads);
    dk += dk_at.start(key_head, key_heads); dv += dv_at.start(key_head, key_heads);

    load_tile<ROWS, D, THREADS>(k_tile, k, k_at.row, first_key, T, d);
    load_tile<ROWS, D, THREADS>(v_tile, v, v_at.row, first_key, T, d);
    float dk_rows[ROWS_PER_THREAD][D / COLUMN_GROUPS] = {}, dv_rows[ROWS_PER_THREAD][D / COLUMN_GROUPS] = {};
    for (int member = 0; member < group; member++) {
        long long head = key_head * group + member;  // the query head
        const float* head_q = q + q_at.start(head, heads);
        const float* head_dout = dout + dout_at.start(head, heads);
        const float* head_lse = lse + (RELU ? 0 : head * T);  // the ReLU variant has no lse or rowdot
        const float* head_rowdot = rowdot + (RELU ? 0 : head * T);
        float* head_dq = dq + dq_at.start(head, heads);
        // The first query that sees the block's keys is first_key: the query tiles start there.
        for (int first_query = causal ? first_key : 0; first_query < T; first_query += COLUMNS) {
            __syncthreads();
            load_tile<COLUMNS, D, THREADS>(q_tile, head_q, q_at.row, first_query, T, d);
            load_tile<COLUMNS, D, THREADS>(dout_tile, head_dout, dout_at.row, first_query, T, d);
            __syncthreads();
            float query_lse2[COLUMNS_PER_THREAD], query_rowdot[COLUMNS_PER_THREAD];
            for (int c = 0; c < COLUMNS_PER_THREAD; c++) {
                int query = first_query + column_group + COLUMN_GROUPS * c;
                query_lse2[c] = !RELU && query < T ? head_lse[query] * LOG2E : 0.0f;
                query_rowdot[c] = !RELU && query < T ? head_rowdot[query] : 0.0f;
            }
            float s[ROWS_PER_THREAD][COLUMNS_PER_THREAD];
            // A diagonal tile's lower left quadrant is masked. The one-pass kernel does not skip it: with a second
            // copy of its products it grew from 68 to 126 KB of machine code, and forward + backward got slower
            // (1.313 ms against 1.306 on the H100), although the kernel alone was 2 % faster.
            bool diagonal = !DQ_ATOMIC && ROWS == COLUMNS && causal && first_query == first_key;
            if (diagonal) tile_dots<D, ROWS, LOWER_LEFT>(s, k_tile, q_tile);  // row j = key, column i = query
            else tile_dots<D, ROWS>(s, k_tile, q_tile);
            if (GENERAL) scale_and_mask<ROWS, false>(s, options, head, first_key, first_query);
            bool masked = (causal && first_query < first_key + ROWS - 1) || first_query + COLUMNS > T || first_key + ROWS > T;
            if (masked) key_probabilities<RELU, true, ROWS>(s, query_lse2, first_key, first_query, T, causal, exponent_scale);
            else key_probabilities<RELU, false, ROWS>(s, query_lse2, first_key, first_query, T, causal, exponent_scale);
            unsigned int kept = 0;  // DROPOUT: bit 8 r + c, whether Z of the thread's entry (r, c) is nonzero
            if (DROPOUT) {
                float dropped[ROWS_PER_THREAD][COLUMNS_PER_THREAD];
                for (int r = 0; r < ROWS_PER_THREAD; r++) {
                    int key = first_key + row_group + ROWS / ROWS_PER_THREAD * r;
                    for (int c = 0; c < COLUMNS_PER_THREAD; c++) {
                        int query = first_query + column_group + COLUMN_GROUPS * c;
                        bool keep = query < T && key < T && dropout_keeps(options, head, query, key);
                        kept |= (unsigned int)keep << (COLUMNS_PER_THREAD * r + c);
                        dropped[r][c] = keep ? s[r][c] * options.keep_scale : 0.0f;
                    }
                }
                store_micro_tile<ROWS>(weights_tile, dropped);
            } else {
                store_micro_tile<ROWS>(weights_tile, s);
            }
            __syncwarp();  // a thread reads back only rows its own warp wrote
            float ds[ROWS_PER_THREAD][COLUMNS_PER_THREAD];
            if (diagonal) {
                tile_accumulate<D, ROWS, WEIGHTS_STRIDE, LOWER_LEFT>(dv_rows, weights_tile, dout_tile);
                tile_dots<D, ROWS, LOWER_LEFT>(ds, v_tile, dout_tile);  // dP_ij = <dout_i, v_j>
            } else {
                tile_accumulate<D, ROWS>(dv_rows, weights_tile, dout_tile);
                tile_dots<D, ROWS>(ds, v_tile, dout_tile);
            }
            __syncwarp();  // the warp is done reading P before dS overwrites it
            for (int r = 0; r < ROWS_PER_THREAD; r++) {
                for (int c = 0; c < COLUMNS_PER_THREAD; c++) {
                    float& place = weights_tile[(row_group + ROWS / ROWS_PER_THREAD * r) * WEIGHTS_STRIDE +
                                                column_group + COLUMN_GROUPS * c];
                    if (DROPOUT) {
                        bool keep = (kept >> (COLUMNS_PER_THREAD * r + c)) & 1u;
                        ds[r][c] = score_gradient<RELU>(s[r][c], keep ? ds[r][c] * options.keep_scale : 0.0f,
                                                        query_rowdot[c]);
                    } else {
                        ds[r][c] = score_gradient<RELU>(place, ds[r][c], query_rowdot[c]);
                    }
                    place = ds[r][c];
                }
            }
            if (DQ_ATOMIC) store_micro_tile_transposed<ROWS>(ds_by_query, ds);
            __syncwarp();
            if (diagonal) tile_accumulate<D, ROWS, WEIGHTS_STRIDE, LOWER_LEFT>(dk_rows, weights_tile, q_tile);
            else tile_accumulate<D, ROWS>(dk_rows, weights_tile, q_tile);
            if (DQ_ATOMIC) {
                __syncthreads();  // every warp's part of the transposed dS tile is written
                float dq_part[ROWS_PER_THREAD][D / COLUMN_GROUPS] = {};  // rows = the tile's 64 queries
                tile_accumulate<D, COLUMNS, ROWS + PAD>(dq_part, ds_by_query, k_tile);
                atomic_add_rows<D, COLUMNS>(head_dq, dq_at.row, dq_part, first_query, T, d, scale);
            }
        }
    }
    store_rows<D, ROWS>(dk, dk_at.row, dk_rows, first_key, T, d, scale);
    store_rows<D, ROWS>(dv, dv_at.row, dv_rows, first_key, T, d, 1.0f);
}

template <int D, bool RELU, int ROWS, bool DQ_ATOMIC>
__global__ void __launch_bounds__(THREADS_FOR(ROWS), BACKWARD_BLOCKS(D, ROWS)) attention_backward_dk_dv(float* dk,
    float* dv, float* dq, const float* dout, const float* q, const float* k, const float* v, const float* lse,
    const float* rowdot, int T, int causal, int d, int group, int heads, HeadLayout dk_at, HeadLayout dv_at,
    HeadLayout dq_at, HeadLayout dout_at, HeadLayout q_at, HeadLayout k_at, HeadLayout v_at)
{
    backward_dk_dv_block<D, RELU, ROWS, DQ_ATOMIC, false, void, false>(dk, dv, dq, dout, q, k, v, lse, rowdot, T,
        causal, d, group, heads, dk_at, dv_at, dq_at, dout_at, q_at, k_at, v_at, plain_options(d));
}

template <int D, int ROWS, bool DQ_ATOMIC, typename Mask, bool DROPOUT>
__global__ void __launch_bounds__(THREADS_FOR(ROWS), BACKWARD_BLOCKS(D, ROWS)) attention_backward_dk_dv_general(
    float* dk, float* dv, float* dq, const float* dout, const float* q, const float* k, const float* v,
    const float* lse, const float* rowdot, int T, int causal, int d, int group, int heads, HeadLayout dk_at,
    HeadLayout dv_at, HeadLayout dq_at, HeadLayout dout_at, HeadLayout q_at, HeadLayout k_at, HeadLayout v_at,
    float scale, const Mask* mask, long long mask_batch_stride, long long mask_head_stride,
    long long mask_query_stride, long long mask_key_stride, const unsigned long long* rng_state, float dropout_p,
    unsigned long long dropout_start)
{
    backward_dk_dv_block<D, false, ROWS, DQ_ATOMIC, true, Mask, DROPOUT>(dk, dv, dq, dout, q, k, v, lse, rowdot, T,
        causal, d, group, heads, dk_at, dv_at, dq_at, dout_at, q_at, k_at, v_at,
        general_options<Mask, DROPOUT>(scale, mask, mask_batch_stride, mask_head_stride, mask_query_stride,
                                       mask_key_stride, heads, T, rng_state, dropout_p, dropout_start));
}

// Backward, second pass: dq. grid = (heads, ⌈T/ROWS⌉): a block owns ROWS queries (rows; columns = keys)
// and loops over the key tiles of its key-value head that they see, as the forward does:
// dq_i = Σ_j dS_ij k_j / √d. A separate pass recomputes S and dP once more (7 T x T x d products in the
// backward instead of 5), but each dq element
// is summed by one thread in a fixed order, where adding into dq with atomics from the dk, dv kernel
// would sum in whatever order the blocks happen to run: this way training is bit-reproducible.
// Shared memory: q, dout tiles of ROWS x (D + 4) floats, k, v tiles of 64 x (D + 4), a ROWS x 72 tile of dS.
template <int D, bool RELU, int ROWS, bool GENERAL, typename Mask, bool DROPOUT>
__device__ __forceinline__ void backward_dq_block(float* dq, const float* dout, const float* q, const float* k,
    const float* v, const float* lse, const float* rowdot, int T, int causal, int d, int group, int heads,
    HeadLayout dq_at, HeadLayout dout_at, HeadLayout q_at, HeadLayout k_at, HeadLayout v_at,
    const ScoreOptions<Mask>& options)
{
    constexpr int THREADS = THREADS_FOR(ROWS);
    extern __shared__ __align__(16) float shared[];
    float* q_tile = shared;
    float* dout_tile = q_tile + ROWS * (D + PAD);
    float* k_tile = dout_tile + ROWS * (D + PAD);
    float* v_tile = k_tile + COLUMNS * (D + PAD);
    float* ds_tile = v_tile + COLUMNS * (D + PAD);
    const float scale = options.scale;                         // of the gradients
    const float exponent_scale = GENERAL ? 1.0f : scale;       // of the scores in P (general: already scaled)
    long long head = blockIdx.x, key_head = head / group;
    int first_query = (gridDim.y - 1 - blockIdx.y) * ROWS;  // longest first, as in the forward
    q += q_at.start(head, heads); dout += dout_at.start(head, heads); dq += dq_at.start(head, heads);
    k += k_at.start(key_head, heads / group); v += v_at.start(key_head, heads / group);
    if (!RELU) { lse += head * T; rowdot += head * T; }

    load_tile<ROWS, D, THREADS>(q_tile, q, q_at.row, first_query, T, d);
    load_tile<ROWS, D, THREADS>(dout_tile, dout, dout_at.row, first_query, T, d);
    float row_lse2[ROWS_PER_THREAD], row_rowdot[ROWS_PER_THREAD];
    for (int r = 0; r < ROWS_PER_THREAD; r++) {
        int query = first_query + thread_row_group() + ROWS / ROWS_PER_THREAD * r;
        row_lse2[r] = !RELU && query < T ? lse[query] * LOG2E : 0.0f;
        row_rowdot[r] = !RELU && query < T ? rowdot[query] : 0.0f;
    }
    float dq_rows[ROWS_PER_THREAD][D / COLUMN_GROUPS] = {};
    int last_key = causal ? min(first_query + ROWS - 1, T - 1) : T - 1;
    for (int first_key = 0; first_key <= last_key; first_key += COLUMNS) {
        __syncthreads();
        load_tile<COLUMNS, D, THREADS>(k_tile, k, k_at.row, first_key, T, d);
        load_tile<COLUMNS, D, THREADS>(v_tile, v, v_at.row, first_key, T, d);
        __syncthreads();
        float s[ROWS_PER_THREAD][COLUMNS_PER_THREAD], ds[ROWS_PER_THREAD][COLUMNS_PER_THREAD];
        bool diagonal = ROWS == COLUMNS && causal && first_key == first_query;  // its upper right quadrant masked
        if (diagonal) {
            tile_dots<D, ROWS, UPPER_RIGHT>(s, q_tile, k_tile);
            tile_dots<D, ROWS, UPPER_RIGHT>(ds, dout_tile, v_tile);  // dP, turned into dS in place below
        } else {
            tile_dots<D, ROWS>(s, q_tile, k_tile);
            tile_dots<D, ROWS>(ds, dout_tile, v_tile);
        }
        if (GENERAL) scale_and_mask<ROWS, true>(s, options, head, first_query, first_key);
        bool masked = (causal && first_key + COLUMNS - 1 > first_query) || first_key + COLUMNS > T || first_query + ROWS > T;
        if (masked)
            query_gradients<RELU, true, ROWS, Mask, DROPOUT>(s, ds, row_lse2, row_rowdot, first_query, first_key, T,
                                                             causal, exponent_scale, options, head);
        else
            query_gradients<RELU, false, ROWS, Mask, DROPOUT>(s, ds, row_lse2, row_rowdot, first_query, first_key, T,
                                                              causal, exponent_scale, options, head);
        store_micro_tile<ROWS>(ds_tile, ds);
        __syncwarp();
        if (diagonal) tile_accumulate<D, ROWS, WEIGHTS_STRIDE, UPPER_RIGHT>(dq_rows, ds_tile, k_tile);
        else tile_accumulate<D, ROWS>(dq_rows, ds_tile, k_tile);
    }
    store_rows<D, ROWS>(dq, dq_at.row, dq_rows, first_query, T, d, scale);
}

template <int D, bool RELU, int ROWS>
__global__ void __launch_bounds__(THREADS_FOR(ROWS), BACKWARD_BLOCKS(D, ROWS)) attention_backward_dq(float* dq,
    const float* dout, const float* q, const float* k, const float* v, const float* lse, const float* rowdot, int T,
    int causal, int d, int group, int heads, HeadLayout dq_at, HeadLayout dout_at, HeadLayout q_at, HeadLayout k_at,
    HeadLayout v_at)
{
    backward_dq_block<D, RELU, ROWS, false, void, false>(dq, dout, q, k, v, lse, rowdot, T, causal, d, group, heads,
                                                         dq_at, dout_at, q_at, k_at, v_at, plain_options(d));
}

template <int D, int ROWS, typename Mask, bool DROPOUT>
__global__ void __launch_bounds__(THREADS_FOR(ROWS), BACKWARD_BLOCKS(D, ROWS)) attention_backward_dq_general(
    float* dq, const float* dout, const float* q, const float* k, const float* v, const float* lse,
    const float* rowdot, int T, int causal, int d, int group, int heads, HeadLayout dq_at, HeadLayout dout_at,
    HeadLayout q_at, HeadLayout k_at, HeadLayout v_at, float scale, const Mask* mask, long long mask_batch_stride,
    long long mask_head_stride, long long mask_query_stride, long long mask_key_stride,
    const unsigned long long* rng_state, float dropout_p, unsigned long long dropout_start)
{
    backward_dq_block<D, false, ROWS, true, Mask, DROPOUT>(dq, dout, q, k, v, lse, rowdot, T, causal, d, group,
        heads, dq_at, dout_at, q_at, k_at, v_at,
        general_options<Mask, DROPOUT>(scale, mask, mask_batch_stride, mask_head_stride, mask_query_stride,
                                       mask_key_stride, heads, T, rng_state, dropout_p, dropout_start));
}
