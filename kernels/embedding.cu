// Token and position embeddings of GPT-2, forward and backward, on float32 tables of C columns.
// Ids are int32. An id outside [0, V) never makes a kernel read or write outside its table: the forward
// writes a row of NaN for it, the backward skips it (the op refuses such ids before launching anyway).
// A model trained in bf16 keeps its tables in float32 and its activations in bf16 (storage.cuh's floatX):
// embedding_forward<__nv_bfloat16> rounds the rows it looks up once, and embedding_backward_chunks reads a
// bf16 dout into float32 sums.

#include "special_values.cuh"
#include "storage.cuh"
#include "warp.cuh"

// ---- Forward: a lookup, one thread per output element. ----

// out[n, c] = weight[ids[n], c] for n < N rows of out, stored as floatX (float, or bf16).
template <typename floatX>
__global__ void embedding_forward(floatX* out, const int* ids, const float* weight, int N, int V, int C)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;  // the element n * C + c of out
    if (i >= N * C) {
        return;
    }
    int n = i / C;
    int c = i - n * C;
    int id = ids[n];
    out[i] = from_float<floatX>((0 <= id && id < V) ? weight[id * C + c] : QUIET_NAN);
}

// The same with four neighbouring columns per thread, one 16-byte load and store: C % 4 == 0 and out,
// weight 16-byte aligned (the op checks).
extern "C" __global__ void embedding_forward_float4(float4* out, const int* ids, const float4* weight,
                                                    int N, int V, int C)
{
    int quarter = C / 4;                             // float4s per row
    int i = blockIdx.x * blockDim.x + threadIdx.x;   // the float4 n * quarter + q of out
    if (i >= N * quarter) {
        return;
    }
    int n = i / quarter;
    int q = i - n * quarter;
    int id = ids[n];
    if (0 <= id && id < V) {
        out[i] = weight[id * quarter + q];
    } else {
        out[i] = make_float4(QUIET_NAN, QUIET_NAN, QUIET_NAN, QUIET_NAN);
    }
}

// GPT-2's input: out[b, t, c] = wte[ids[b, t], c] + wpe[t, c], fused: one pass over out instead of a
// lookup, a second lookup and an add (which would write out and read it back). ids has N = B * T entries.
extern "C" __global__ void token_position_embedding_forward(float* out, const int* ids, const float* wte,
                                                            const float* wpe, int N, int T, int V, int C)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= N * C) {
        return;
    }
    int n = i / C;
    int c = i - n * C;
    int t = n % T;  // the position of row n = b * T + t
    int id = ids[n];
    out[i] = (0 <= id && id < V) ? wte[id * C + c] + wpe[t * C + c] : QUIET_NAN;
}

extern "C" __global__ void token_position_embedding_forward_float4(float4* out, const int* ids, const float4* wte,
                                                                   const float4* wpe, int N, int T, int V, int C)
{
    int quarter = C / 4;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= N * quarter) {
        return;
    }
    int n = i / quarter;
    int q = i - n * quarter;
    int t = n % T;
    int id = ids[n];
    if (0 <= id && id < V) {
        float4 token = wte[id * quarter + q];
        float4 position = wpe[t * quarter + q];
        out[i] = make_float4(token.x + position.x, token.y + position.y, token.z + position.z, token.w + position.w);
    } else {
        out[i] = make_float4(QUIET_NAN, QUIET_NAN, QUIET_NAN, QUIET_NAN);
    }
}

// ---- Backward: dweight[ids[n], :] += dout[n, :], summed over every n with the same id. ----

// Deterministic, in two stages. Grouping (a counting sort): the positions are arranged by id, and within
// an id by position, in `grouped`; the positions of id v fill grouped[starts[v] : starts[v + 1]]. Summing:
// the sorted positions are cut into chunks of POSITIONS_PER_CHUNK, one warp per chunk, so that a group of
// hundreds of positions is summed by many warps at once. Every sum runs in the order of `grouped`, and
// every element of dweight has one writer: no float atomics, the same bits every run. Positions whose id
// is outside [0, V), or equal to padding_idx (-1: no padding id), are left out of the groups.

// Grouping, step 1: how many positions each id has. Integer atomics: the counts are exact whatever the
// order of the additions. counts (V entries) must be zero before the launch.
extern "C" __global__ void embedding_count_ids(int* counts, const int* ids, int N, int V, int padding_idx)
{
    int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N) {
        return;
    }
    int id = ids[n];
    if (0 <= id && id < V && id != padding_idx) {
        atomicAdd(&counts[id], 1);
    }
}

// Grouping, step 2: starts[v] = counts[0] + ... + counts[v - 1] (an exclusive scan), starts[V] = the number
// of grouped positions. One block: each thread sums a run of neighbouring counts, the block scans those
// sums (Hillis and Steele: log2(threads) steps), then each thread writes its run's starts. counts is set
// back to zero on the way, for step 3 to count with. The block must have SCAN_THREADS threads.
#define SCAN_THREADS 1024

extern "C" __global__ void embedding_group_starts(int* starts, int* counts, int V)
{
    __shared__ int totals[SCAN_THREADS];
    int per_thread = (V + SCAN_THREADS - 1) / SCAN_THREADS;
    int first = threadIdx.x * per_thread;
    int end = min(first + per_thread, V);
    int total = 0;
    for (int v = first; v < end; ++v) {
        total += counts[v];
    }
    totals[threadIdx.x] = total;
    __syncthreads();
    for (int offset = 1; offset < SCAN_THREADS; offset *= 2) {
        int earlier = threadIdx.x >= offset ? totals[threadIdx.x - offset] : 0;
        __syncthreads();  // every thread has read before any thread writes
        totals[threadIdx.x] += earlier;
        __syncthreads();
    }
    int start = totals[threadIdx.x] - total;  // the runs of the threads before this one
    for (int v = first; v < end; ++v) {
        starts[v] = start;
        start += counts[v];
        counts[v] = 0;
    }
    if (threadIdx.x == SCAN_THREADS - 1) {
        starts[V] = totals[SCAN_THREADS - 1];
    }
}

// Grouping, step 3: each position takes the next free place in its id's group. The places come from
// integer atomics on filled (zero before the launch), so the order WITHIN a group changes from run to run;
// step 4 puts it right.
extern "C" __global__ void embedding_place_positions(int* unordered, int* filled, const int* starts, const int* ids,
                                                     int N, int V, int padding_idx)
{
    int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N) {
        return;
    }
    int id = ids[n];
    if (0 <= id && id < V && id != padding_idx) {
        unordered[starts[id] + atomicAdd(&filled[id], 1)] = n;
    }
}

// Grouping, step 4: the place of a position in its group is the number of positions of the group smaller
// than it. One thread per position, reading its whole group: m * m reads for a group of m positions, a
// few microseconds for the longest groups of text, and the result does not depend on step 3's order.
extern "C" __global__ void embedding_order_groups(int* grouped, const int* unordered, const int* starts,
                                                  const int* ids, int V)
{
    int slot = blockIdx.x * blockDim.x + threadIdx.x;
    if (slot >= starts[V]) {
        return;
    }
    int position = unordered[slot];
    int id = ids[position];
    int first = starts[id];
    int end = starts[id + 1];
    int rank = 0;
    for (int other = first; other < end; ++other) {
        rank += unordered[other] < position;
    }
    grouped[first + rank] = position;
}

// Summing: warp `chunk` takes the grouped positions [chunk * POSITIONS_PER_CHUNK, ... + POSITIONS_PER_CHUNK)
// and walks them in order, adding the rows of dout; a chunk may hold the ends of several groups. A group
// that lies wholly inside the chunk is added into dweight at once. A piece of a longer group is stored as
// a partial row instead: partials[2 * chunk] for the piece that continues a group begun in an earlier
// chunk, partials[2 * chunk + 1] for a group that begins in this chunk and goes on in the next (a chunk
// holds at most one of each). A warp covers 128 columns (4 per lane, 32 apart: each load of the warp is
// 128 contiguous bytes); blockIdx.y picks which 128 columns. The chunk's positions are read at once,
// one per lane, and handed to the whole warp by __shfl_sync; the warp loads ROWS_IN_FLIGHT rows of dout
// before it adds any of them, so that their loads wait for memory together rather than one after another.
#define POSITIONS_PER_CHUNK 16
#define ROWS_IN_FLIGHT 4
#define COLUMNS_PER_LANE 4
#define COLUMNS_PER_WARP (32 * COLUMNS_PER_LANE)

// dout is stored as floatX (float, or bf16); the sums and dweight are float32.
template <typename floatX>
__global__ void embedding_backward_chunks(float* dweight, float* partials, const floatX* __restrict__ dout,
                                         const int* grouped, const int* starts, const int* ids, int V, int C)
{
    int chunk = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    int first_slot = chunk * POSITIONS_PER_CHUNK;
    int grouped_count = starts[V];
    if (first_slot >= grouped_count) {
        return;  // the whole warp: chunk is the same for its 32 lanes, so the shuffles below see full warps
    }
    int count = min(POSITIONS_PER_CHUNK, grouped_count - first_slot);
    int lane_position = lane < count ? grouped[first_slot + lane] : 0;
    int lane_id = lane < count ? ids[lane_position] : -1;
    int first_column = blockIdx.y * COLUMNS_PER_WARP + lane;
    float sum[COLUMNS_PER_LANE] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int batch = 0; batch < count; batch += ROWS_IN_FLIGHT) {
        float rows[ROWS_IN_FLIGHT][COLUMNS_PER_LANE];
#pragma unroll
        for (int i = 0; i < ROWS_IN_FLIGHT; ++i) {
            long long position = __shfl_sync(FULL_MASK, lane_position, (batch + i) % 32);
#pragma unroll
            for (int u = 0; u < COLUMNS_PER_LANE; ++u) {
                int c = first_column + 32 * u;
                rows[i][u] = (batch + i < count && c < C) ? to_float(dout[position * C + c]) : 0.0f;
            }
        }
#pragma unroll
        for (int i = 0; i < ROWS_IN_FLIGHT; ++i) {
            int r = batch + i;
            if (r >= count) {
                break;  // the same r for every lane: the warp leaves the loop together
            }
            int id = __shfl_sync(FULL_MASK, lane_id, r % 32);
            int next_id = __shfl_sync(FULL_MASK, lane_id, (r + 1) % 32);
#pragma unroll
            for (int u = 0; u < COLUMNS_PER_LANE; ++u) {
                sum[u] += rows[i][u];
            }
            if (r + 1 < count && next_id == id) {
                continue;  // the next row belongs to the same id: keep adding
            }
            // The run of this id ends here. Where does its group begin and end?
            bool begun_before = starts[id] < first_slot;
            bool goes_on = starts[id + 1] > first_slot + count;
#pragma unroll
            for (int u = 0; u < COLUMNS_PER_LANE; ++u) {
                int c = first_column + 32 * u;
                if (c < C) {
                    if (begun_before || goes_on) {
                        partials[(2 * chunk + (begun_before ? 0 : 1)) * C + c] = sum[u];
                    } else {
                        dweight[id * C + c] += sum[u];
                    }
                }
                sum[u] = 0.0f;
            }
        }
    }
}

// The groups longer than a chunk: the warp of the chunk where a group begins adds the group's partial rows,
// chunk after chunk (a fixed order), into dweight. Launched after embedding_backward_chunks, with as many
// warps. The loads of the partial rows do not depend on each other: unrolled, several are in flight.
extern "C" __global__ void embedding_backward_long_groups(float* dweight, const float* partials, const int* grouped,
                                                          const int* starts, const int* ids, int V, int C)
{
    int chunk = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    int last_slot = chunk * POSITIONS_PER_CHUNK + POSITIONS_PER_CHUNK - 1;
    if (last_slot + 1 >= starts[V]) {
        return;  // no chunk after this one
    }
    int id = ids[grouped[last_slot]];
    int first = starts[id];
    int end = starts[id + 1];
    if (end <= last_slot + 1 || first < chunk * POSITIONS_PER_CHUNK) {
        return;  // the group of the last position ends in this chunk, or began in an earlier one
    }
    int first_column = blockIdx.y * COLUMNS_PER_WARP + lane;
    for (int u = 0; u < COLUMNS_PER_LANE; ++u) {
        int c = first_column + 32 * u;
        if (c >= C) {
            break;
        }
        float sum = partials[(2 * chunk + 1) * C + c];
#pragma unroll 8
        for (int next = chunk + 1; next * POSITIONS_PER_CHUNK < end; ++next) {
            sum += partials[2 * next * C + c];
        }
        dweight[id * C + c] += sum;
    }
}

// dwpe[t, c] += sum over b of dout[b, t, c]: one thread per (t, c), summing over the batch in order.
extern "C" __global__ void position_embedding_backward(float* dwpe, const float* dout, int B, int T, int C)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;  // the element t * C + c of dwpe
    if (i >= T * C) {
        return;
    }
    float sum = 0.0f;
    for (int b = 0; b < B; ++b) {
        sum += dout[b * T * C + i];
    }
    dwpe[i] += sum;
}
