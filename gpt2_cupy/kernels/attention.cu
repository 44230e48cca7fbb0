// Causal self-attention, fused (FlashAttention-2 style), forward and backward, in float32.
//   q, k, v, out, dout, dq, dk, dv: (heads, T, D), one (T, D) matrix per head, rows of D floats;
//   lse (log-sum-exp of each row of scores) and rowdot (rowsum(dout * out)): (heads, T).
// Two variants, a template flag:
//   softmax:  S = q kᵀ / √D, P = softmax(S) over the visible keys, out = P v;
//   RELU:     S = q kᵀ / √D, P = max(S, 0) on the visible keys, no normalisation, out = P v.
// causal = 1: query t sees keys 0..t. S and P are never written to memory: a block holds a tile of them
// in registers and shared memory, uses it, and moves on, so the extra memory is O(T) (lse, rowdot).
//
// Work layout, the same in every kernel: a block of 256 threads handles ROWS "rows" (queries in the
// forward and in the dq kernel, keys in the dk, dv kernel; ROWS = 64 or 128, a template parameter)
// against tiles of 64 "columns" (keys, or queries). The threads form a 16 x 16 grid: thread
// (row_group, column_group) = (threadIdx.x / 16, threadIdx.x % 16) owns rows row_group + 16 r
// (r < ROWS / 16) and columns column_group + 16 c (c < 4) of each tile: a 2-D micro-tile of
// ROWS / 16 x 4 scores, held in registers (4 x 4 or 8 x 4).
// Why 2-D: a score is a dot product of a row and a column over D. Per 4 steps of D, the thread reads one
// float4 of each of its rows and of each of its columns from shared memory and does (ROWS / 16) x 4 x 4
// multiply-adds with them. Shared memory delivers 128 bytes a cycle to a multiprocessor, whose FMA units
// do 128 multiply-adds a cycle: the multiply-adds set the pace only below 1 byte per multiply-add. A
// warp's float4 reads of its 16 different columns are 256 bytes, 2 passes of 128; its reads of a row
// are 2 addresses (2 row groups), one pass. Per 4 steps of D, for a warp: 4 x 2 + (ROWS / 16) passes of
// 128 bytes for 32 x (ROWS / 16) x 16 multiply-adds: 0.75 bytes per multiply-add with 4 x 4 micro-tiles,
// 0.5 with 8 x 4. (One row per warp against 2 columns per lane, 8 x 2 per thread, took 2 x 4 + 8 passes
// for 32 x 64: 1 byte per multiply-add, as fast as shared memory can go.)
// The products that sum over a tile's columns (P v, dS k, Pᵀ dout, dSᵀ q) take the same rows and
// D / 16 consecutive columns of the result (accumulators in registers): per 4 columns j of the tile, one
// float4 of P per row and one float4 (float2 at D = 32) of values per j, the same count of passes.
// A row's 64 scores sit in the 16 lanes of one half-warp (same row_group): row maxima and sums are 4
// shuffle steps. Tiles of q, k, v, dout live in shared memory as [rows][D + 4] floats, as in global memory
// plus 4 floats of padding: the 16 different rows that a warp reads at once (as float4s) then start 4
// banks apart, and fill 2 passes of 128 bytes, the fewest possible.
// Exponentials use __expf, the hardware's approximate exp2 after one multiplication by log2(e): a few
// instructions instead of expf's exact sequence. Its error grows with |x|, but every argument here is
// x = S - max <= 0 or S - lse <= 0, and where |x| is large the term e^x is too small to count.
// The tiles take 71 to 142 KB of shared memory, more than the 48 KB a kernel may declare statically:
// they are carved out of one extern __shared__ array, whose size the launch gives.
// Registers: __launch_bounds__(256, blocks) holds the compiler to the registers that `blocks` blocks
// per multiprocessor can have (65536 / (blocks * 256)), the number of blocks their shared memory allows
// (228 KB per multiprocessor on an H100).
#define COLUMNS 64                 // columns (keys, or queries) per tile
#define THREADS 256
#define GROUPS 16                  // the threads form a GROUPS x GROUPS grid
#define COLUMNS_PER_THREAD (COLUMNS / GROUPS)
#define PAD 4
#define WEIGHTS_PAD 16             // P and dS tiles: rows of 64 + 16 floats, see store_micro_tile
#define FULL_MASK 0xffffffffu
#define NEGATIVE_INFINITY __uint_as_float(0xff800000u)  // NVRTC has no math.h, so no INFINITY

// Load rows first_row .. first_row + ROWS - 1 of a (T, D) matrix into tile[ROWS][D + PAD]; rows past T are
// zero. Consecutive threads read consecutive float4s: each warp's load is four whole 128-byte lines, in a
// quarter of the instructions of float-by-float loads. Rows of D floats keep every float4 aligned, in
// global memory (cupy's arrays start on 256-byte boundaries) and in the tile (D + PAD is a multiple of 4).
template <int ROWS, int D>
__device__ void load_tile(float* tile, const float* matrix, int first_row, int T)
{
    for (int index = threadIdx.x; index < ROWS * D / 4; index += THREADS) {
        int row = index / (D / 4), column = 4 * (index % (D / 4));
        int global_row = first_row + row;
        float4 value = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (global_row < T) value = *reinterpret_cast<const float4*>(&matrix[(long long)global_row * D + column]);
        *reinterpret_cast<float4*>(&tile[row * (D + PAD) + column]) = value;
    }
}

// 4 or 2 consecutive floats of shared or global memory in one float4 or float2 access (the thread's
// D / 16 consecutive columns at D = 64 or 32).
__device__ void load_consecutive(float (&value)[4], const float* from)
{
    float4 four = *reinterpret_cast<const float4*>(from);
    value[0] = four.x; value[1] = four.y; value[2] = four.z; value[3] = four.w;
}

__device__ void load_consecutive(float (&value)[2], const float* from)
{
    float2 two = *reinterpret_cast<const float2*>(from);
    value[0] = two.x; value[1] = two.y;
}

__device__ void store_consecutive(float* to, const float (&value)[4])
{
    *reinterpret_cast<float4*>(to) = make_float4(value[0], value[1], value[2], value[3]);
}

__device__ void store_consecutive(float* to, const float (&value)[2])
{
    *reinterpret_cast<float2*>(to) = make_float2(value[0], value[1]);
}

// The same, added into global memory with atomicAdd: one vector atomic (float4, float2) on compute
// capability 9.0 and later, a quarter (a half) of the atomic instructions; before that, one per float.
__device__ void atomic_add_consecutive(float* to, const float (&value)[4])
{
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
    atomicAdd(reinterpret_cast<float4*>(to), make_float4(value[0], value[1], value[2], value[3]));
#else
    for (int c = 0; c < 4; c++) atomicAdd(to + c, value[c]);
#endif
}

__device__ void atomic_add_consecutive(float* to, const float (&value)[2])
{
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
    atomicAdd(reinterpret_cast<float2*>(to), make_float2(value[0], value[1]));
#else
    for (int c = 0; c < 2; c++) atomicAdd(to + c, value[c]);
#endif
}

// dot[r][c] = <rows[row_group + 16r], columns[column_group + 16c]> over D: the thread's micro-tile of a
// (ROWS, D) tile times a (64, D) tile transposed. Each float4 read serves 4 (row) or ROWS / 16 (column)
// dot products.
template <int D, int ROWS_PER_THREAD>
__device__ void tile_dots(float dot[ROWS_PER_THREAD][COLUMNS_PER_THREAD], const float* rows, const float* columns)
{
    int row_group = threadIdx.x / GROUPS, column_group = threadIdx.x % GROUPS;
    for (int r = 0; r < ROWS_PER_THREAD; r++)
        for (int c = 0; c < COLUMNS_PER_THREAD; c++) dot[r][c] = 0.0f;
#pragma unroll
    for (int i = 0; i < D; i += 4) {
        float4 column[COLUMNS_PER_THREAD];
        for (int c = 0; c < COLUMNS_PER_THREAD; c++)
            column[c] = *reinterpret_cast<const float4*>(&columns[(column_group + GROUPS * c) * (D + PAD) + i]);
        for (int r = 0; r < ROWS_PER_THREAD; r++) {
            float4 a = *reinterpret_cast<const float4*>(&rows[(row_group + GROUPS * r) * (D + PAD) + i]);
            for (int c = 0; c < COLUMNS_PER_THREAD; c++) {
                dot[r][c] += a.x * column[c].x;  // one multiply-add each
                dot[r][c] += a.y * column[c].y;
                dot[r][c] += a.z * column[c].z;
                dot[r][c] += a.w * column[c].w;
            }
        }
    }
}

// accumulator[r][c] += Σ_j weights[row_group + 16r][j] * values[j][column_group * D/16 + c]: the thread's
// rows of a (ROWS, 64) tile of weights (P or dS, rows WEIGHTS_STRIDE floats apart) times a (64, D) tile of
// values; the thread owns D / 16 consecutive columns of each of its rows. Per 4 steps of j: one float4 of
// weights per row, 4 reads of values, ROWS / 16 x D / 16 x 4 multiply-adds.
template <int D, int ROWS_PER_THREAD, int WEIGHTS_STRIDE = COLUMNS + WEIGHTS_PAD>
__device__ void tile_accumulate(float accumulator[ROWS_PER_THREAD][D / GROUPS], const float* weights,
                                const float* values)
{
    int row_group = threadIdx.x / GROUPS, column_group = threadIdx.x % GROUPS;
#pragma unroll
    for (int j = 0; j < COLUMNS; j += 4) {
        float value[4][D / GROUPS];
        for (int jj = 0; jj < 4; jj++)
            load_consecutive(value[jj], &values[(j + jj) * (D + PAD) + column_group * (D / GROUPS)]);
        for (int r = 0; r < ROWS_PER_THREAD; r++) {
            float4 weight = *reinterpret_cast<const float4*>(&weights[(row_group + GROUPS * r) * WEIGHTS_STRIDE + j]);
            for (int c = 0; c < D / GROUPS; c++) {
                accumulator[r][c] += weight.x * value[0][c];
                accumulator[r][c] += weight.y * value[1][c];
                accumulator[r][c] += weight.z * value[2][c];
                accumulator[r][c] += weight.w * value[3][c];
            }
        }
    }
}

// Maximum and sum over the 16 lanes of a half-warp, the threads that share a row.
__device__ float row_max(float value)
{
    for (int offset = GROUPS / 2; offset > 0; offset /= 2) value = fmaxf(value, __shfl_xor_sync(FULL_MASK, value, offset));
    return value;
}

__device__ float row_sum(float value)
{
    for (int offset = GROUPS / 2; offset > 0; offset /= 2) value += __shfl_xor_sync(FULL_MASK, value, offset);
    return value;
}

// Write the thread's rows of a (ROWS, D) accumulator, times `factor`, to rows first_row + ... of matrix.
template <int D, int ROWS_PER_THREAD>
__device__ void store_rows(float* matrix, float accumulator[ROWS_PER_THREAD][D / GROUPS], int first_row, int T,
                           float factor)
{
    int row_group = threadIdx.x / GROUPS, column_group = threadIdx.x % GROUPS;
    for (int r = 0; r < ROWS_PER_THREAD; r++) {
        int row = first_row + row_group + GROUPS * r;
        float scaled[D / GROUPS];
        for (int c = 0; c < D / GROUPS; c++) scaled[c] = factor * accumulator[r][c];
        if (row < T) store_consecutive(&matrix[(long long)row * D + column_group * (D / GROUPS)], scaled);
    }
}

// Write the thread's micro-tile of a (ROWS, 64) tile to tile[ROWS][64 + WEIGHTS_PAD] in shared memory.
// A warp writes 2 rows at once, 16 floats of each: rows 80 floats apart start 16 banks apart, so the 32
// floats fall in 32 different banks (with rows 68 floats apart, 4 banks, half of them would share one).
template <int ROWS_PER_THREAD>
__device__ void store_micro_tile(float* tile, float value[ROWS_PER_THREAD][COLUMNS_PER_THREAD])
{
    int row_group = threadIdx.x / GROUPS, column_group = threadIdx.x % GROUPS;
    for (int r = 0; r < ROWS_PER_THREAD; r++)
        for (int c = 0; c < COLUMNS_PER_THREAD; c++)
            tile[(row_group + GROUPS * r) * (COLUMNS + WEIGHTS_PAD) + column_group + GROUPS * c] = value[r][c];
}

// The same micro-tile written transposed, to tile[64][ROWS + PAD]: the thread's (row, column) entry goes to
// row `column`, column `row`. A warp writes 16 columns x 2 rows: with rows ROWS + 4 floats apart, 16 banks
// of 32, two floats per bank (rows 80 floats apart, as store_micro_tile's, would put 8 on one bank).
template <int ROWS_PER_THREAD>
__device__ void store_micro_tile_transposed(float* tile, float value[ROWS_PER_THREAD][COLUMNS_PER_THREAD])
{
    constexpr int STRIDE = GROUPS * ROWS_PER_THREAD + PAD;
    int row_group = threadIdx.x / GROUPS, column_group = threadIdx.x % GROUPS;
    for (int r = 0; r < ROWS_PER_THREAD; r++)
        for (int c = 0; c < COLUMNS_PER_THREAD; c++)
            tile[(column_group + GROUPS * c) * STRIDE + row_group + GROUPS * r] = value[r][c];
}

// Forward. grid = (heads, ⌈T/ROWS⌉): a block owns ROWS queries of one head and loops over the key tiles,
// keeping for each row the running maximum m and (per thread) the running sum l of exp(S - m), the online
// softmax of chapter 04: when the maximum grows, what was summed so far, l and the output, is rescaled
// by exp(m_old - m_new). Causal: the loop stops at the tile holding the block's last query, so tiles
// entirely above the diagonal are never touched; only tiles crossing the diagonal are masked element by
// element. Query tiles are taken last first: with the causal mask they have the most key tiles, and
// starting them early keeps the GPU from ending on a few long blocks.
// Shared memory: a q tile of ROWS x (D + 4) floats, k and v tiles of 64 x (D + 4), a ROWS x 80 tile of P.
template <int D, bool RELU, int ROWS>
__global__ void __launch_bounds__(THREADS, (ROWS == 64 ? 3 : 2)) attention_forward(float* out, float* lse,
    const float* q, const float* k, const float* v, int T, int causal)
{
    constexpr int ROWS_PER_THREAD = ROWS / GROUPS;
    extern __shared__ __align__(16) float shared[];
    float* q_tile = shared;
    float* k_tile = q_tile + ROWS * (D + PAD);
    float* v_tile = k_tile + COLUMNS * (D + PAD);
    float* p_tile = v_tile + COLUMNS * (D + PAD);
    const float scale = rsqrtf((float)D);
    int row_group = threadIdx.x / GROUPS, column_group = threadIdx.x % GROUPS;
    long long head = blockIdx.x;
    int first_query = (gridDim.y - 1 - blockIdx.y) * ROWS;
    q += head * T * D; k += head * T * D; v += head * T * D; out += head * T * D;
    if (!RELU) lse += head * T;  // the ReLU variant saves no log-sum-exp

    load_tile<ROWS, D>(q_tile, q, first_query, T);
    float o[ROWS_PER_THREAD][D / GROUPS] = {};
    float running_max[ROWS_PER_THREAD], running_sum[ROWS_PER_THREAD];
    for (int r = 0; r < ROWS_PER_THREAD; r++) { running_max[r] = NEGATIVE_INFINITY; running_sum[r] = 0.0f; }

    int last_key = causal ? min(first_query + ROWS - 1, T - 1) : T - 1;
    for (int first_key = 0; first_key <= last_key; first_key += COLUMNS) {
        __syncthreads();  // everyone is done with the previous tiles
        load_tile<COLUMNS, D>(k_tile, k, first_key, T);
        load_tile<COLUMNS, D>(v_tile, v, first_key, T);
        __syncthreads();
        float s[ROWS_PER_THREAD][COLUMNS_PER_THREAD];
        tile_dots<D, ROWS_PER_THREAD>(s, q_tile, k_tile);
        for (int r = 0; r < ROWS_PER_THREAD; r++) {
            int query = first_query + row_group + GROUPS * r;
            float p[COLUMNS_PER_THREAD];
            bool visible[COLUMNS_PER_THREAD];
            float tile_max = NEGATIVE_INFINITY;
            for (int c = 0; c < COLUMNS_PER_THREAD; c++) {
                int key = first_key + column_group + GROUPS * c;
                visible[c] = key < T && (!causal || key <= query);
                s[r][c] *= scale;
                if (visible[c]) tile_max = fmaxf(tile_max, s[r][c]);
            }
            if (RELU) {
                for (int c = 0; c < COLUMNS_PER_THREAD; c++) p[c] = visible[c] && s[r][c] > 0.0f ? s[r][c] : 0.0f;
            } else {
                // Key 0 is in the first tile and visible to every row, so the maximum is finite from then on.
                float new_max = fmaxf(running_max[r], row_max(tile_max));
                float correction = __expf(running_max[r] - new_max);  // exp(-inf) = 0 on the first tile
                running_sum[r] *= correction;
                for (int c = 0; c < COLUMNS_PER_THREAD; c++) {
                    p[c] = visible[c] ? __expf(s[r][c] - new_max) : 0.0f;
                    running_sum[r] += p[c];
                }
                for (int c = 0; c < D / GROUPS; c++) o[r][c] *= correction;
                running_max[r] = new_max;
            }
            for (int c = 0; c < COLUMNS_PER_THREAD; c++) s[r][c] = p[c];
        }
        store_micro_tile<ROWS_PER_THREAD>(p_tile, s);
        __syncwarp();  // a thread reads back only rows of p_tile that its own warp wrote
        tile_accumulate<D, ROWS_PER_THREAD>(o, p_tile, v_tile);
    }
    float factor[ROWS_PER_THREAD];
    for (int r = 0; r < ROWS_PER_THREAD; r++) {
        int query = first_query + row_group + GROUPS * r;
        factor[r] = 1.0f;
        if (!RELU) {
            float sum = row_sum(running_sum[r]);
            factor[r] = 1.0f / sum;
            if (column_group == 0 && query < T) lse[query] = running_max[r] + logf(sum);
        }
        for (int c = 0; c < D / GROUPS; c++) o[r][c] *= factor[r];
    }
    store_rows<D, ROWS_PER_THREAD>(out, o, first_query, T, 1.0f);
}

// rowdot[i] = Σ_d dout[i][d] * out[i][d], the softmax backward's row sum (D_i in FlashAttention-2):
// Σ_j P_ij dP_ij = Σ_j P_ij <dout_i, v_j> = <dout_i, out_i>. A warp per row.
extern "C" __global__ void attention_backward_rowdot(float* rowdot, const float* dout, const float* out, int rows, int D)
{
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;  // the whole warp leaves together
    float sum = 0.0f;
    for (int d = lane; d < D; d += 32) sum += dout[(long long)row * D + d] * out[(long long)row * D + d];
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(FULL_MASK, sum, offset);
    if (lane == 0) rowdot[row] = sum;
}

// The probability and score gradient of one (query, key) pair in the backward, both variants:
//   softmax:  P = exp(S - lse_query) recomputed from the saved log-sum-exp, dS = P (dP - rowdot_query);
//   RELU:     P = max(S, 0), dS = dP where S > 0, else 0 (ReLU's derivative; no row sum to subtract).
template <bool RELU>
__device__ void probability_and_gradient(float& p, float& ds, float score, float dp, bool visible,
                                         float query_lse, float query_rowdot)
{
    if (!visible) { p = 0.0f; ds = 0.0f; return; }
    if (RELU) {
        p = score > 0.0f ? score : 0.0f;
        ds = score > 0.0f ? dp : 0.0f;
    } else {
        p = __expf(score - query_lse);
        ds = p * (dp - query_rowdot);
    }
}

// Backward, first pass: dk and dv. grid = (heads, ⌈T/ROWS⌉): a block owns ROWS keys (rows; columns =
// queries) and loops over the query tiles that see them, from the diagonal down (causal) to T:
//   dv_j += Σ_i P_ij dout_i,  dk_j += Σ_i dS_ij q_i / √D.
// Every dk, dv element is summed by one thread in a fixed order: no atomics, the same bits every run.
// P (transposed: rows = keys) goes through one shared tile, then dS through the same tile.
// DQ_ATOMIC: the one-pass backward. The block also adds each query tile's share of dq,
// dq_i += Σ_j dS_ij k_j / √D over its 64 keys (ROWS = 64), into dq with atomicAdd: dq must hold zeros
// before the launch, and the dq pass is not needed. dS goes to a second tile, transposed (rows = queries),
// which every warp reads whole: a __syncthreads between writing and reading it. The blocks that share a
// query tile add into it in whatever order they run: dq's bits vary from run to run.
// Shared memory: k, v tiles of ROWS x (D + 4) floats, q, dout tiles of 64 x (D + 4), a ROWS x 80 tile, and
// with DQ_ATOMIC a 64 x (ROWS + 4) tile.
template <int D, bool RELU, int ROWS, bool DQ_ATOMIC>
__global__ void __launch_bounds__(THREADS, (ROWS == 64 ? 2 : 1)) attention_backward_dk_dv(float* dk, float* dv,
    float* dq, const float* dout, const float* q, const float* k, const float* v, const float* lse,
    const float* rowdot, int T, int causal)
{
    static_assert(!DQ_ATOMIC || ROWS == COLUMNS, "the one-pass dq takes tiles of 64 keys");
    constexpr int ROWS_PER_THREAD = ROWS / GROUPS;
    extern __shared__ __align__(16) float shared[];
    float* k_tile = shared;
    float* v_tile = k_tile + ROWS * (D + PAD);
    float* q_tile = v_tile + ROWS * (D + PAD);
    float* dout_tile = q_tile + COLUMNS * (D + PAD);
    float* weights_tile = dout_tile + COLUMNS * (D + PAD);  // P, then dS, transposed
    float* ds_by_query = weights_tile + ROWS * (COLUMNS + WEIGHTS_PAD);  // DQ_ATOMIC: dS, rows = queries
    const float scale = rsqrtf((float)D);
    int row_group = threadIdx.x / GROUPS, column_group = threadIdx.x % GROUPS;
    long long head = blockIdx.x;
    int first_key = blockIdx.y * ROWS;
    q += head * T * D; k += head * T * D; v += head * T * D; dout += head * T * D;
    dk += head * T * D; dv += head * T * D; dq += head * T * D;
    if (!RELU) { lse += head * T; rowdot += head * T; }

    load_tile<ROWS, D>(k_tile, k, first_key, T);
    load_tile<ROWS, D>(v_tile, v, first_key, T);
    float dk_rows[ROWS_PER_THREAD][D / GROUPS] = {}, dv_rows[ROWS_PER_THREAD][D / GROUPS] = {};
    // first_key is a multiple of 64: the first query tile that sees the block's keys starts there.
    for (int first_query = causal ? first_key : 0; first_query < T; first_query += COLUMNS) {
        __syncthreads();
        load_tile<COLUMNS, D>(q_tile, q, first_query, T);
        load_tile<COLUMNS, D>(dout_tile, dout, first_query, T);
        __syncthreads();
        float query_lse[COLUMNS_PER_THREAD], query_rowdot[COLUMNS_PER_THREAD];
        for (int c = 0; c < COLUMNS_PER_THREAD; c++) {
            int query = first_query + column_group + GROUPS * c;
            query_lse[c] = !RELU && query < T ? lse[query] : 0.0f;
            query_rowdot[c] = !RELU && query < T ? rowdot[query] : 0.0f;
        }
        float p[ROWS_PER_THREAD][COLUMNS_PER_THREAD], ds[ROWS_PER_THREAD][COLUMNS_PER_THREAD];
        tile_dots<D, ROWS_PER_THREAD>(p, k_tile, q_tile);      // S_ij / scale, row j = key, column i = query
        tile_dots<D, ROWS_PER_THREAD>(ds, v_tile, dout_tile);  // dP_ij = <dout_i, v_j>
        for (int r = 0; r < ROWS_PER_THREAD; r++) {
            int key = first_key + row_group + GROUPS * r;
            for (int c = 0; c < COLUMNS_PER_THREAD; c++) {
                int query = first_query + column_group + GROUPS * c;
                bool visible = query < T && key < T && (!causal || key <= query);
                probability_and_gradient<RELU>(p[r][c], ds[r][c], scale * p[r][c], ds[r][c], visible,
                                               query_lse[c], query_rowdot[c]);
            }
        }
        store_micro_tile<ROWS_PER_THREAD>(weights_tile, p);
        __syncwarp();  // a thread reads back only rows its own warp wrote
        tile_accumulate<D, ROWS_PER_THREAD>(dv_rows, weights_tile, dout_tile);
        __syncwarp();  // the warp is done with P before dS overwrites it
        store_micro_tile<ROWS_PER_THREAD>(weights_tile, ds);
        if (DQ_ATOMIC) store_micro_tile_transposed<ROWS_PER_THREAD>(ds_by_query, ds);
        __syncwarp();
        tile_accumulate<D, ROWS_PER_THREAD>(dk_rows, weights_tile, q_tile);
        if (DQ_ATOMIC) {
            __syncthreads();  // every warp's part of the transposed dS tile is written
            float dq_part[COLUMNS / GROUPS][D / GROUPS] = {};  // rows = the tile's 64 queries
            tile_accumulate<D, COLUMNS / GROUPS, ROWS + PAD>(dq_part, ds_by_query, k_tile);
            for (int r = 0; r < COLUMNS / GROUPS; r++) {
                int query = first_query + row_group + GROUPS * r;
                float scaled[D / GROUPS];
                for (int c = 0; c < D / GROUPS; c++) scaled[c] = scale * dq_part[r][c];
                if (query < T) atomic_add_consecutive(&dq[(long long)query * D + column_group * (D / GROUPS)], scaled);
            }
        }
    }
    store_rows<D, ROWS_PER_THREAD>(dk, dk_rows, first_key, T, scale);
    store_rows<D, ROWS_PER_THREAD>(dv, dv_rows, first_key, T, 1.0f);
}

// Backward, second pass: dq. grid = (heads, ⌈T/ROWS⌉): a block owns ROWS queries (rows; columns = keys)
// and loops over the key tiles they see, as the forward does: dq_i = Σ_j dS_ij k_j / √D. A separate pass
// recomputes S and dP once more (7 T x T x D products in the backward instead of 5), but each dq element
// is summed by one thread in a fixed order, where adding into dq with atomics from the dk, dv kernel
// would sum in whatever order the blocks happen to run: this way training is bit-reproducible.
// Shared memory: q, dout tiles of ROWS x (D + 4) floats, k, v tiles of 64 x (D + 4), a ROWS x 80 tile of dS.
template <int D, bool RELU, int ROWS>
__global__ void __launch_bounds__(THREADS, (ROWS == 64 ? 2 : 1)) attention_backward_dq(float* dq, const float* dout,
    const float* q, const float* k, const float* v, const float* lse, const float* rowdot, int T, int causal)
{
    constexpr int ROWS_PER_THREAD = ROWS / GROUPS;
    extern __shared__ __align__(16) float shared[];
    float* q_tile = shared;
    float* dout_tile = q_tile + ROWS * (D + PAD);
    float* k_tile = dout_tile + ROWS * (D + PAD);
    float* v_tile = k_tile + COLUMNS * (D + PAD);
    float* ds_tile = v_tile + COLUMNS * (D + PAD);
    const float scale = rsqrtf((float)D);
    int row_group = threadIdx.x / GROUPS, column_group = threadIdx.x % GROUPS;
    long long head = blockIdx.x;
    int first_query = (gridDim.y - 1 - blockIdx.y) * ROWS;  // longest first, as in the forward
    q += head * T * D; k += head * T * D; v += head * T * D; dout += head * T * D; dq += head * T * D;
    if (!RELU) { lse += head * T; rowdot += head * T; }

    load_tile<ROWS, D>(q_tile, q, first_query, T);
    load_tile<ROWS, D>(dout_tile, dout, first_query, T);
    float row_lse[ROWS_PER_THREAD], row_rowdot[ROWS_PER_THREAD];
    for (int r = 0; r < ROWS_PER_THREAD; r++) {
        int query = first_query + row_group + GROUPS * r;
        row_lse[r] = !RELU && query < T ? lse[query] : 0.0f;
        row_rowdot[r] = !RELU && query < T ? rowdot[query] : 0.0f;
    }
    float dq_rows[ROWS_PER_THREAD][D / GROUPS] = {};
    int last_key = causal ? min(first_query + ROWS - 1, T - 1) : T - 1;
    for (int first_key = 0; first_key <= last_key; first_key += COLUMNS) {
        __syncthreads();
        load_tile<COLUMNS, D>(k_tile, k, first_key, T);
        load_tile<COLUMNS, D>(v_tile, v, first_key, T);
        __syncthreads();
        float s[ROWS_PER_THREAD][COLUMNS_PER_THREAD], ds[ROWS_PER_THREAD][COLUMNS_PER_THREAD];
        tile_dots<D, ROWS_PER_THREAD>(s, q_tile, k_tile);
        tile_dots<D, ROWS_PER_THREAD>(ds, dout_tile, v_tile);  // dP, turned into dS in place below
        for (int r = 0; r < ROWS_PER_THREAD; r++) {
            int query = first_query + row_group + GROUPS * r;
            for (int c = 0; c < COLUMNS_PER_THREAD; c++) {
                int key = first_key + column_group + GROUPS * c;
                bool visible = query < T && key < T && (!causal || key <= query);
                float p;
                probability_and_gradient<RELU>(p, ds[r][c], scale * s[r][c], ds[r][c], visible, row_lse[r],
                                               row_rowdot[r]);
            }
        }
        store_micro_tile<ROWS_PER_THREAD>(ds_tile, ds);
        __syncwarp();
        tile_accumulate<D, ROWS_PER_THREAD>(dq_rows, ds_tile, k_tile);
    }
    store_rows<D, ROWS_PER_THREAD>(dq, dq_rows, first_query, T, scale);
}
