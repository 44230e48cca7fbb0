// Attention of a few new queries over a KV cache, split along the keys (flash-decoding). q, the cache and out
// are float32 or bf16 (floatX, storage.cuh: a model generating in bf16 keeps a bf16 cache, half the bytes to
// read); scores, the softmax and the partial results are float32 either way.
//   q, out:          (key-value heads, rows, d): the rows of one key-value head are the queries that read it,
//                    row r = g n + i for query head g of its group and new position i < n;
//   keys, values:    (key-value heads, capacity, d), the cache; positions 0 .. length - 1 are filled;
//   partial_out:     (key-value heads, splits, rows, d), partial_max, partial_sum: (key-value heads, splits, rows).
// New position i sits at position length - n + i and sees keys 0 .. length - n + i: the cached ones and the
// new ones up to itself. out = softmax(q kᵀ / √d) v over those keys.
//
// Why split the keys. Generating a token runs one query per head: the whole work is reading the cache,
// 2 x length x d floats per key-value head, and a kernel with one block per head would keep only as many
// multiprocessors busy as there are heads (8 of an H100's 132 for Llama 3 8B's key-value heads at batch 1).
// So the keys are cut into `splits` chunks of `chunk` keys, one block each (flash-decoding, Dao et al. 2023):
// block (head, s) computes, for each of its rows, over its chunk only, the maximum score m_s, the sum
// l_s = Σ e^(score - m_s) and the unnormalised output o_s = Σ e^(score - m_s) v; a second, small kernel
// merges the chunks: M = max_s m_s, l = Σ_s l_s e^(m_s - M), out = Σ_s o_s e^(m_s - M) / l. The
// same rescaling as the online softmax of chapter 04 and the forward of chapter 08, across blocks.
// The queries are multiplied by 1 / √d as they are loaded, so a score is one dot product; exponentials are
// __expf, the hardware's approximate e^x (a multiply by log2(e) and one MUFU.EX2).
//
// Grouped-query attention: the rows of a block are queries of every head of the group, so the block reads
// each key and value once for all of them (a group of 4 query heads costs the bytes of one).
// Head sizes: rows of d floats in a tile of D = 32, 64, 128 or 256 (a template parameter, so that the
// per-lane arrays live in registers); columns d .. D - 1 are zeros, as in kernels/attention.cu.
//
// Work layout inside a block: WARPS warps, each a whole number of keys at a time. A warp reads one key as
// 32 lanes x D / 32 neighbouring floats (lane l holds columns l D / 32 ..): one 128-byte line per 32 floats,
// float4 loads from D = 128. Each lane multiplies its part by the same part of every row's query and a
// warp_sum gives the score in every lane; then every lane updates its D / 32 columns of the row's output.
// A warp takes KEYS_AT_ONCE keys and their values per step, all loaded before any is used, so that their
// loads are in flight together: a kernel that reads memory once needs many bytes on their way to keep up
// with it. At the end, the block's warps merge their (m, l, o) through shared memory, as the chunks do.
#include "warp.cuh"
#include "special_values.cuh"
#include "storage.cuh"

#define WARPS 4
#define KEYS_AT_ONCE 4

// The lane's D / 32 neighbouring elements of a row of d, as floats (zeros past d). Rows of d = D elements
// start on 16 bytes (float) or 8 bytes (bf16) from D = 128, where a lane's 4 or 8 are whole groups of 4.
template <int D, typename floatX>
__device__ __forceinline__ void load_lane_part(float part[D / WARP_SIZE], const floatX* row, int d)
{
    constexpr int PER_LANE = D / WARP_SIZE, WIDTH = PER_LANE >= 4 ? 4 : 1;
    int first = (threadIdx.x % WARP_SIZE) * PER_LANE;
    if (d == D) {
#pragma unroll
        for (int e = 0; e < PER_LANE; e += WIDTH) load_as_float<WIDTH>(part + e, row + first + e, true);
    } else {
#pragma unroll
        for (int e = 0; e < PER_LANE; e++) load_as_float<1>(part + e, row + first + e, first + e < d);
    }
}

// First kernel. grid = (key-value heads, splits, ⌈rows / ROWS⌉), WARPS x 32 threads: block (head, s, z) takes
// rows z ROWS .. z ROWS + ROWS - 1 of the head against keys s chunk .. s chunk + chunk - 1 (those below length).
// length: device_length[0] when device_length is not null (a CUDA graph replays the launch as the cache
// grows), else host_length. A chunk past the end, or keys no row sees, leave m = -inf, l = 0, o = 0.
template <int D, int ROWS, typename floatX = float>
__global__ void __launch_bounds__(WARPS * WARP_SIZE) decode_attention_partial(float* partial_out,
    float* partial_max, float* partial_sum, const floatX* q, const floatX* keys, const floatX* values,
    const int* device_length, int host_length, int rows, int new_positions, int capacity, int chunk, int d)
{
    constexpr int PER_LANE = D / WARP_SIZE;
    __shared__ float warp_max[WARPS][ROWS], warp_sums[WARPS][ROWS];
    __shared__ __align__(16) float warp_out[WARPS][ROWS][D];
    int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    long long head = blockIdx.x;
    int split = blockIdx.y, splits = gridDim.y, first_row = blockIdx.z * ROWS;
    int length = device_length != nullptr ? device_length[0] : host_length;
    int first_key = split * chunk, end_key = min(first_key + chunk, length);
    keys += head * capacity * d;
    values += head * capacity * d;
    const float scale = rsqrtf((float)d);

    float query[ROWS][PER_LANE], out[ROWS][PER_LANE], running_max[ROWS], running_sum[ROWS];
    int last_visible[ROWS];  // the last key each row sees: its own position
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        int row = min(first_row + r, rows - 1);  // rows past the end repeat the last one and are not written
        load_lane_part<D>(query[r], q + (head * rows + row) * d, d);
        for (int e = 0; e < PER_LANE; e++) { query[r][e] *= scale; out[r][e] = 0.0f; }
        running_max[r] = NEGATIVE_INFINITY;
        running_sum[r] = 0.0f;
        last_visible[r] = length - new_positions + row % new_positions;
    }

    for (int step_key = first_key + warp * KEYS_AT_ONCE; step_key < end_key; step_key += WARPS * KEYS_AT_ONCE) {
        float key[KEYS_AT_ONCE][PER_LANE], value[KEYS_AT_ONCE][PER_LANE];
#pragma unroll
        for (int u = 0; u < KEYS_AT_ONCE; u++) {
            bool inside = step_key + u < end_key;
            int position = inside ? step_key + u : first_key;  // a valid address; its zeros are never used
            load_lane_part<D>(key[u], keys + (long long)position * d, inside ? d : 0);
            load_lane_part<D>(value[u], values + (long long)position * d, inside ? d : 0);
        }
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            float score[KEYS_AT_ONCE], step_max = NEGATIVE_INFINITY;
#pragma unroll
            for (int u = 0; u < KEYS_AT_ONCE; u++) {
                float dot = 0.0f;
                for (int e = 0; e < PER_LANE; e++) dot += query[r][e] * key[u][e];
                dot = warp_sum(dot);  // the whole score, in every lane
                bool visible = step_key + u < end_key && step_key + u <= last_visible[r];
                score[u] = visible ? dot : NEGATIVE_INFINITY;
                step_max = fmaxf(step_max, score[u]);
            }
            if (step_max == NEGATIVE_INFINITY) continue;  // no key of this step is visible to the row
            float new_max = fmaxf(running_max[r], step_max);
            float correction = __expf(running_max[r] - new_max);  // e^-inf = 0 the first time
            running_sum[r] *= correction;
            for (int e = 0; e < PER_LANE; e++) out[r][e] *= correction;
#pragma unroll
            for (int u = 0; u < KEYS_AT_ONCE; u++) {
                float p = __expf(score[u] - new_max);  // 0 for a key the row does not see
                running_sum[r] += p;
                for (int e = 0; e < PER_LANE; e++) out[r][e] += p * value[u][e];
            }
            running_max[r] = new_max;
        }
    }

    // The warps' partial results, merged: every thread takes some (row, column) entries of the block's.
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        for (int e = 0; e < PER_LANE; e++) warp_out[warp][r][lane * PER_LANE + e] = out[r][e];
        if (lane == 0) { warp_max[warp][r] = running_max[r]; warp_sums[warp][r] = running_sum[r]; }
    }
    __syncthreads();
    for (int entry = threadIdx.x; entry < ROWS * d; entry += WARPS * WARP_SIZE) {
        int r = entry / d, column = entry % d;
        if (first_row + r >= rows) break;  // entries run row by row: the rest are past the last row too
        float block_max = NEGATIVE_INFINITY;
        for (int w = 0; w < WARPS; w++) block_max = fmaxf(block_max, warp_max[w][r]);
        float sum = 0.0f, result = 0.0f;
        if (block_max != NEGATIVE_INFINITY) {
            for (int w = 0; w < WARPS; w++) {
                float weight = __expf(warp_max[w][r] - block_max);
                sum += warp_sums[w][r] * weight;
                result += warp_out[w][r][column] * weight;
            }
        }
        long long partial_row = (head * splits + split) * rows + first_row + r;
        partial_out[partial_row * d + column] = result;
        if (column == 0) { partial_max[partial_row] = block_max; partial_sum[partial_row] = sum; }
    }
}

// Second kernel: one block of COMBINE_THREADS threads per output row (head, r) merges the row's `splits`
// partial results. grid = heads x rows blocks; dynamic shared memory: `splits` floats. The first warp finds M
// and l and leaves each split's weight e^(m_s - M) in shared memory; then every thread sums its columns over the
// splits, with the loads of several splits in flight at once (a loop that waits for each load in turn spends
// the kernel's time in memory latency). Split 0 holds key 0, which every row sees, so M is finite.
#define COMBINE_THREADS 128
#define SPLITS_AT_ONCE 4

template <typename floatX = float>
__global__ void __launch_bounds__(COMBINE_THREADS) decode_attention_combine(floatX* out, const float* partial_out,
    const float* partial_max, const float* partial_sum, int rows, int splits, int d)
{
    extern __shared__ float split_weights[];  // splits entries
    __shared__ float normaliser;
    long long head = blockIdx.x / rows, r = blockIdx.x % rows;
    const float* maxima = partial_max + head * splits * rows + r;  // split s at maxima[s * rows]
    const float* sums = partial_sum + head * splits * rows + r;
    if (threadIdx.x < WARP_SIZE) {
        int lane = threadIdx.x;
        float largest = NEGATIVE_INFINITY;
        for (int s = lane; s < splits; s += WARP_SIZE) largest = fmaxf(largest, maxima[(long long)s * rows]);
        largest = warp_max(largest);
        float sum = 0.0f;
        for (int s = lane; s < splits; s += WARP_SIZE) {
            float weight = __expf(maxima[(long long)s * rows] - largest);
            split_weights[s] = weight;
            sum += sums[(long long)s * rows] * weight;
        }
        sum = warp_sum(sum);
        if (lane == 0) normaliser = 1.0f / sum;
    }
    __syncthreads();
    const float* partial = partial_out + (head * splits * rows + r) * d;  // split s at partial[s * rows * d]
    long long split_stride = (long long)rows * d;
    for (int column = threadIdx.x; column < d; column += COMBINE_THREADS) {
        float result = 0.0f;
        int s = 0;
        for (; s + SPLITS_AT_ONCE <= splits; s += SPLITS_AT_ONCE) {
            float parts[SPLITS_AT_ONCE];
#pragma unroll
            for (int u = 0; u < SPLITS_AT_ONCE; u++) parts[u] = partial[(s + u) * split_stride + column];
#pragma unroll
            for (int u = 0; u < SPLITS_AT_ONCE; u++) result += parts[u] * split_weights[s + u];  // in split order
        }
        for (; s < splits; s++) result += partial[s * split_stride + column] * split_weights[s];
        out[(head * rows + r) * d + column] = from_float<floatX>(result * normaliser);
    }
}

// The new positions' keys and values, k and v (key-value heads, n, d), written into the cache (key-value
// heads, capacity, d) at positions length - n .. length - 1, length read from device memory: a CUDA graph
// replays this launch at every step of generation. One thread per element.
template <typename floatX>
__global__ void decode_attention_store(floatX* keys, floatX* values, const floatX* k, const floatX* v,
                                       const int* device_length, int heads, int new_positions, int capacity, int d)
{
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;  // the element (head, t, e) of k and v
    if (i >= (long long)heads * new_positions * d) {
        return;
    }
    int e = (int)(i % d);
    long long head = i / d / new_positions;
    int t = (int)(i / d % new_positions);
    long long position = device_length[0] - new_positions + t;
    if (position < 0 || position >= capacity) {
        return;  // a length the cache cannot hold writes nothing (the op checks it where it can: a host length)
    }
    keys[(head * capacity + position) * d + e] = k[i];
    values[(head * capacity + position) * d + e] = v[i];
}
