// Causal self-attention, fused (FlashAttention-2 style), forward and backward, in float32.
//   q, k, v, out, dout, dq, dk, dv: (heads, T, D), one (T, D) matrix per head, rows of D floats;
//   lse (log-sum-exp of each row of scores) and rowdot (rowsum(dout * out)): (heads, T).
// Two variants, a template flag:
//   softmax:  S = q kᵀ / √D, P = softmax(S) over the visible keys, out = P v;
//   RELU:     S = q kᵀ / √D, P = max(S, 0) on the visible keys, no normalisation, out = P v.
// causal = 1: query t sees keys 0..t. S and P are never written to memory: a block holds a tile of them
// in registers and shared memory, uses it, and moves on, so the extra memory is O(T) (lse, rowdot).
//
// Work layout, the same in every kernel: a block of 256 threads = 8 warps handles 64 "rows" (queries in
// the forward and in the dq kernel, keys in the dk, dv kernel) against tiles of 64 "columns" (keys, or
// queries). Warp w owns rows w, w + 8, ..., w + 56 (8 rows); lane l owns columns l and l + 32 of the
// current tile. So each thread computes an 8 x 2 block of scores per tile, reusing each value it reads
// from shared memory 2 or 8 times, and a row's 64 scores sit in one warp: row maxima and sums are warp
// shuffles. Tiles of q, k, v, dout live in shared memory as [64][D + 4] floats: a thread reads 4
// consecutive floats (float4) of its own columns, and the 4-float padding puts the 8 threads of each
// quarter-warp on 8 different groups of 4 banks (row stride D + 4 ≡ 4 banks), so float4 reads do not
// conflict; reads of a row's values are the same address for the whole warp (a broadcast).
// Exponentials use __expf, the hardware's approximate exp2 after one multiplication by log2(e): a few
// instructions instead of expf's exact sequence. Its error grows with |x|, but every argument here is
// x = S - max <= 0 or S - lse <= 0, and where |x| is large the term e^x is too small to count.
// The tiles take 44 to 102 KB of shared memory, more than the 48 KB a kernel may declare statically:
// they are carved out of one extern __shared__ array, whose size the launch gives.
// Unrolling and registers: the inner loops over D and over a tile are unrolled 4 steps at a time, so that
// the compiler can issue the next steps' shared-memory reads while this step's multiply-adds run. That
// takes registers, and registers decide how many blocks share a multiprocessor: shared memory lets 3
// forward blocks (67 KB each at D = 64) and 2 backward blocks (85, 102 KB) share one, and
// __launch_bounds__(threads, blocks) holds the compiler to the registers that many blocks can have
// (65536 / (3 * 256) -> 80 a thread for the forward, 128 for the backward). Measured on an H100, this
// beats both the loops as written and fully unrolled ones, though the softmax forward then keeps a few
// values in local memory (spills).
#define TILE 64               // rows per block, columns per tile
#define WARPS 8
#define ROWS_PER_WARP (TILE / WARPS)
#define COLUMNS_PER_LANE (TILE / 32)
#define PAD 4
#define ATTENTION_FORWARD_BLOCKS 3          // blocks per multiprocessor, for __launch_bounds__
#define ATTENTION_BACKWARD_DK_DV_BLOCKS 2
#define ATTENTION_BACKWARD_DQ_BLOCKS 2
#define FULL_MASK 0xffffffffu
#define NEGATIVE_INFINITY __uint_as_float(0xff800000u)  // NVRTC has no math.h, so no INFINITY

// Load rows first_row .. first_row + 63 of a (T, D) matrix into tile[64][D + PAD]; rows past T are zero.
// Consecutive threads read consecutive float4s: each warp's load is four whole 128-byte lines, in a
// quarter of the instructions of float-by-float loads. Rows of D floats keep every float4 aligned, in
// global memory (cupy's arrays start on 256-byte boundaries) and in the tile (D + PAD is a multiple of 4).
template <int D>
__device__ void load_tile(float* tile, const float* matrix, int first_row, int T)
{
    for (int index = threadIdx.x; index < TILE * D / 4; index += WARPS * 32) {
        int row = index / (D / 4), column = 4 * (index % (D / 4));
        int global_row = first_row + row;
        float4 value = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (global_row < T) value = *reinterpret_cast<const float4*>(&matrix[(long long)global_row * D + column]);
        *reinterpret_cast<float4*>(&tile[row * (D + PAD) + column]) = value;
    }
}

// dot[r][c] = <rows[w + 8r], columns[lane + 32c]> over D: the warp's 8 rows against this lane's 2 columns.
template <int D>
__device__ void tile_dots(float dot[ROWS_PER_WARP][COLUMNS_PER_LANE], const float* rows, const float* columns)
{
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int r = 0; r < ROWS_PER_WARP; r++)
        for (int c = 0; c < COLUMNS_PER_LANE; c++) dot[r][c] = 0.0f;
#pragma unroll 4  // see the top of the file
    for (int i = 0; i < D; i += 4) {
        float4 column[COLUMNS_PER_LANE];
        for (int c = 0; c < COLUMNS_PER_LANE; c++)
            column[c] = *reinterpret_cast<const float4*>(&columns[(lane + 32 * c) * (D + PAD) + i]);
        for (int r = 0; r < ROWS_PER_WARP; r++) {
            float4 a = *reinterpret_cast<const float4*>(&rows[(warp + WARPS * r) * (D + PAD) + i]);
            for (int c = 0; c < COLUMNS_PER_LANE; c++)
                dot[r][c] += a.x * column[c].x + a.y * column[c].y + a.z * column[c].z + a.w * column[c].w;
        }
    }
}

// accumulator[r][c] += Σ_j weights[w + 8r][j] * values[j][lane + 32c]: the warp's 8 rows of a (64, 64)
// tile of weights (P or dS) times a (64, D) tile of values; the thread owns D/32 columns of each row.
template <int D>
__device__ void tile_accumulate(float accumulator[ROWS_PER_WARP][D / 32], const float* weights, const float* values)
{
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll 4  // see the top of the file
    for (int j = 0; j < TILE; j += 4) {
        float value[4][D / 32];
        for (int jj = 0; jj < 4; jj++)
            for (int c = 0; c < D / 32; c++) value[jj][c] = values[(j + jj) * (D + PAD) + lane + 32 * c];
        for (int r = 0; r < ROWS_PER_WARP; r++) {
            float4 weight = *reinterpret_cast<const float4*>(&weights[(warp + WARPS * r) * TILE + j]);
            for (int c = 0; c < D / 32; c++)
                accumulator[r][c] += weight.x * value[0][c] + weight.y * value[1][c]
                                   + weight.z * value[2][c] + weight.w * value[3][c];
        }
    }
}

__device__ float warp_max(float value)
{
    for (int offset = 16; offset > 0; offset /= 2) value = fmaxf(value, __shfl_xor_sync(FULL_MASK, value, offset));
    return value;
}

__device__ float warp_sum(float value)
{
    for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(FULL_MASK, value, offset);
    return value;
}

// Write the warp's 8 rows of a (64, D) accumulator, times `factor`, to rows first_row + ... of matrix.
template <int D>
__device__ void store_rows(float* matrix, float accumulator[ROWS_PER_WARP][D / 32], int first_row, int T, float factor)
{
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int r = 0; r < ROWS_PER_WARP; r++) {
        int row = first_row + warp + WARPS * r;
        if (row < T)
            for (int c = 0; c < D / 32; c++) matrix[(long long)row * D + lane + 32 * c] = factor * accumulator[r][c];
    }
}

// Forward. grid = (heads, ⌈T/64⌉): a block owns 64 queries of one head and loops over the key tiles,
// keeping for each row the running maximum m and (per lane) the running sum l of exp(S - m), the online
// softmax of chapter 04: when the maximum grows, what was summed so far, l and the output, is rescaled
// by exp(m_old - m_new). Causal: the loop stops at the tile holding the block's last query, so tiles
// entirely above the diagonal are never touched; only the diagonal tile is masked element by element.
// Query tiles are taken last first: with the causal mask they have the most key tiles, and starting
// them early keeps the GPU from ending on a few long blocks.
// Shared memory: q, k, v tiles of 64 x (D + 4) floats and a 64 x 64 tile of P.
template <int D, bool RELU>
__global__ void __launch_bounds__(WARPS * 32, ATTENTION_FORWARD_BLOCKS) attention_forward(float* out, float* lse, const float* q,
                                                                const float* k, const float* v, int T, int causal)
{
    extern __shared__ __align__(16) float shared[];
    float* q_tile = shared;
    float* k_tile = q_tile + TILE * (D + PAD);
    float* v_tile = k_tile + TILE * (D + PAD);
    float* p_tile = v_tile + TILE * (D + PAD);
    const float scale = rsqrtf((float)D);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    long long head = blockIdx.x;
    int first_query = (gridDim.y - 1 - blockIdx.y) * TILE;
    q += head * T * D; k += head * T * D; v += head * T * D; out += head * T * D;
    if (!RELU) lse += head * T;  // the ReLU variant saves no log-sum-exp

    load_tile<D>(q_tile, q, first_query, T);
    float o[ROWS_PER_WARP][D / 32] = {};
    float running_max[ROWS_PER_WARP], running_sum[ROWS_PER_WARP];
    for (int r = 0; r < ROWS_PER_WARP; r++) { running_max[r] = NEGATIVE_INFINITY; running_sum[r] = 0.0f; }

    int last_key = causal ? min(first_query + TILE - 1, T - 1) : T - 1;
    for (int first_key = 0; first_key <= last_key; first_key += TILE) {
        __syncthreads();  // everyone is done with the previous tiles
        load_tile<D>(k_tile, k, first_key, T);
        load_tile<D>(v_tile, v, first_key, T);
        __syncthreads();
        float s[ROWS_PER_WARP][COLUMNS_PER_LANE];
        tile_dots<D>(s, q_tile, k_tile);
        for (int r = 0; r < ROWS_PER_WARP; r++) {
            int query = first_query + warp + WARPS * r;
            float p[COLUMNS_PER_LANE];
            bool visible[COLUMNS_PER_LANE];
            float tile_max = NEGATIVE_INFINITY;
            for (int c = 0; c < COLUMNS_PER_LANE; c++) {
                int key = first_key + lane + 32 * c;
                visible[c] = key < T && (!causal || key <= query);
                s[r][c] *= scale;
                if (visible[c]) tile_max = fmaxf(tile_max, s[r][c]);
            }
            if (RELU) {
                for (int c = 0; c < COLUMNS_PER_LANE; c++) p[c] = visible[c] && s[r][c] > 0.0f ? s[r][c] : 0.0f;
            } else {
                // Key 0 is in the first tile and visible to every row, so the maximum is finite from then on.
                float new_max = fmaxf(running_max[r], warp_max(tile_max));
                float correction = __expf(running_max[r] - new_max);  // exp(-inf) = 0 on the first tile
                running_sum[r] *= correction;
                for (int c = 0; c < COLUMNS_PER_LANE; c++) {
                    p[c] = visible[c] ? __expf(s[r][c] - new_max) : 0.0f;
                    running_sum[r] += p[c];
                }
                for (int c = 0; c < D / 32; c++) o[r][c] *= correction;
                running_max[r] = new_max;
            }
            for (int c = 0; c < COLUMNS_PER_LANE; c++) p_tile[(warp + WARPS * r) * TILE + lane + 32 * c] = p[c];
        }
        __syncwarp();  // a warp reads back only the rows of p_tile it wrote itself
        tile_accumulate<D>(o, p_tile, v_tile);
    }
    for (int r = 0; r < ROWS_PER_WARP; r++) {
        int query = first_query + warp + WARPS * r;
        float factor = 1.0f;
        if (!RELU) {
            float sum = warp_sum(running_sum[r]);
            factor = 1.0f / sum;
            if (lane == 0 && query < T) lse[query] = running_max[r] + logf(sum);
        }
        if (query < T)
            for (int c = 0; c < D / 32; c++) out[(long long)query * D + lane + 32 * c] = factor * o[r][c];
    }
}

// rowdot[i] = Σ_d dout[i][d] * out[i][d], the softmax backward's row sum (D_i in FlashAttention-2):
// Σ_j P_ij dP_ij = Σ_j P_ij <dout_i, v_j> = <dout_i, out_i>. A warp per row.
extern "C" __global__ void attention_backward_rowdot(float* rowdot, const float* dout, const float* out, int rows, int D)
{
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;  // the whole warp leaves together
    float sum = 0.0f;
    for (int d = lane; d < D; d += 32) sum += dout[(long long)row * D + d] * out[(long long)row * D + d];
    sum = warp_sum(sum);
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

// Backward, first pass: dk and dv. grid = (heads, ⌈T/64⌉): a block owns 64 keys (rows; lanes = queries)
// and loops over the query tiles that see them, from the diagonal down (causal) to T:
//   dv_j += Σ_i P_ij dout_i,  dk_j += Σ_i dS_ij q_i / √D.
// Every dk, dv row is summed by one thread in a fixed order: no atomics, the same bits every run.
// Shared memory: k, v, q, dout tiles of 64 x (D + 4) floats and 64 x 64 tiles of P and dS.
template <int D, bool RELU>
__global__ void __launch_bounds__(WARPS * 32, ATTENTION_BACKWARD_DK_DV_BLOCKS) attention_backward_dk_dv(float* dk, float* dv, const float* dout,
    const float* q, const float* k, const float* v, const float* lse, const float* rowdot, int T, int causal)
{
    extern __shared__ __align__(16) float shared[];
    float* k_tile = shared;
    float* v_tile = k_tile + TILE * (D + PAD);
    float* q_tile = v_tile + TILE * (D + PAD);
    float* dout_tile = q_tile + TILE * (D + PAD);
    float* p_tile = dout_tile + TILE * (D + PAD);
    float* ds_tile = p_tile + TILE * TILE;
    const float scale = rsqrtf((float)D);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    long long head = blockIdx.x;
    int first_key = blockIdx.y * TILE;
    q += head * T * D; k += head * T * D; v += head * T * D; dout += head * T * D;
    dk += head * T * D; dv += head * T * D;
    if (!RELU) { lse += head * T; rowdot += head * T; }

    load_tile<D>(k_tile, k, first_key, T);
    load_tile<D>(v_tile, v, first_key, T);
    float dk_rows[ROWS_PER_WARP][D / 32] = {}, dv_rows[ROWS_PER_WARP][D / 32] = {};
    for (int first_query = causal ? first_key : 0; first_query < T; first_query += TILE) {
        __syncthreads();
        load_tile<D>(q_tile, q, first_query, T);
        load_tile<D>(dout_tile, dout, first_query, T);
        __syncthreads();
        float query_lse[COLUMNS_PER_LANE], query_rowdot[COLUMNS_PER_LANE];
        for (int c = 0; c < COLUMNS_PER_LANE; c++) {
            int query = first_query + lane + 32 * c;
            query_lse[c] = !RELU && query < T ? lse[query] : 0.0f;
            query_rowdot[c] = !RELU && query < T ? rowdot[query] : 0.0f;
        }
        float s[ROWS_PER_WARP][COLUMNS_PER_LANE], dp[ROWS_PER_WARP][COLUMNS_PER_LANE];
        tile_dots<D>(s, k_tile, q_tile);     // S_ij / scale, row j = key, column i = query
        tile_dots<D>(dp, v_tile, dout_tile);  // dP_ij = <dout_i, v_j>
        for (int r = 0; r < ROWS_PER_WARP; r++) {
            int key = first_key + warp + WARPS * r;
            for (int c = 0; c < COLUMNS_PER_LANE; c++) {
                int query = first_query + lane + 32 * c;
                bool visible = query < T && key < T && (!causal || key <= query);
                float p, ds;
                probability_and_gradient<RELU>(p, ds, scale * s[r][c], dp[r][c], visible, query_lse[c], query_rowdot[c]);
                p_tile[(warp + WARPS * r) * TILE + lane + 32 * c] = p;
                ds_tile[(warp + WARPS * r) * TILE + lane + 32 * c] = ds;
            }
        }
        __syncwarp();
        tile_accumulate<D>(dv_rows, p_tile, dout_tile);
        tile_accumulate<D>(dk_rows, ds_tile, q_tile);
    }
    store_rows<D>(dk, dk_rows, first_key, T, scale);
    store_rows<D>(dv, dv_rows, first_key, T, 1.0f);
}

// Backward, second pass: dq. grid = (heads, ⌈T/64⌉): a block owns 64 queries (rows; lanes = keys) and
// loops over the key tiles they see, as the forward does: dq_i = Σ_j dS_ij k_j / √D. A separate pass
// recomputes S and dP once more (7 T x T x D products in the backward instead of 5), but each dq row is
// summed by one thread in a fixed order, where adding into dq with atomics from the dk, dv kernel would
// sum in whatever order the blocks happen to run: this way training is bit-reproducible.
// Shared memory: q, dout, k, v tiles of 64 x (D + 4) floats and a 64 x 64 tile of dS.
template <int D, bool RELU>
__global__ void __launch_bounds__(WARPS * 32, ATTENTION_BACKWARD_DQ_BLOCKS) attention_backward_dq(float* dq, const float* dout, const float* q,
    const float* k, const float* v, const float* lse, const float* rowdot, int T, int causal)
{
    extern __shared__ __align__(16) float shared[];
    float* q_tile = shared;
    float* dout_tile = q_tile + TILE * (D + PAD);
    float* k_tile = dout_tile + TILE * (D + PAD);
    float* v_tile = k_tile + TILE * (D + PAD);
    float* ds_tile = v_tile + TILE * (D + PAD);
    const float scale = rsqrtf((float)D);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    long long head = blockIdx.x;
    int first_query = (gridDim.y - 1 - blockIdx.y) * TILE;  // longest first, as in the forward
    q += head * T * D; k += head * T * D; v += head * T * D; dout += head * T * D; dq += head * T * D;
    if (!RELU) { lse += head * T; rowdot += head * T; }

    load_tile<D>(q_tile, q, first_query, T);
    load_tile<D>(dout_tile, dout, first_query, T);
    float row_lse[ROWS_PER_WARP], row_rowdot[ROWS_PER_WARP];
    for (int r = 0; r < ROWS_PER_WARP; r++) {
        int query = first_query + warp + WARPS * r;
        row_lse[r] = !RELU && query < T ? lse[query] : 0.0f;
        row_rowdot[r] = !RELU && query < T ? rowdot[query] : 0.0f;
    }
    float dq_rows[ROWS_PER_WARP][D / 32] = {};
    int last_key = causal ? min(first_query + TILE - 1, T - 1) : T - 1;
    for (int first_key = 0; first_key <= last_key; first_key += TILE) {
        __syncthreads();
        load_tile<D>(k_tile, k, first_key, T);
        load_tile<D>(v_tile, v, first_key, T);
        __syncthreads();
        float s[ROWS_PER_WARP][COLUMNS_PER_LANE], dp[ROWS_PER_WARP][COLUMNS_PER_LANE];
        tile_dots<D>(s, q_tile, k_tile);
        tile_dots<D>(dp, dout_tile, v_tile);
        for (int r = 0; r < ROWS_PER_WARP; r++) {
            int query = first_query + warp + WARPS * r;
            for (int c = 0; c < COLUMNS_PER_LANE; c++) {
                int key = first_key + lane + 32 * c;
                bool visible = query < T && key < T && (!causal || key <= query);
                float p, ds;
                probability_and_gradient<RELU>(p, ds, scale * s[r][c], dp[r][c], visible, row_lse[r], row_rowdot[r]);
                ds_tile[(warp + WARPS * r) * TILE + lane + 32 * c] = ds;
            }
        }
        __syncwarp();
        tile_accumulate<D>(dq_rows, ds_tile, k_tile);
    }
    store_rows<D>(dq, dq_rows, first_query, T, scale);
}
