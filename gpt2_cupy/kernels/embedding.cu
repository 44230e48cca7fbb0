// Token and position embeddings of GPT-2, forward and backward, on float32 tables of C columns.
// Ids are int32. An id outside [0, V) never makes a kernel read or write outside its table: the forward
// writes a row of NaN for it, the backward skips it (the op refuses such ids before launching anyway).

#define QUIET_NAN __int_as_float(0x7fc00000)  // the bits of a float NaN

// ---- Forward: a lookup, one thread per output element. ----

// out[n, c] = weight[ids[n], c] for n < N rows of out.
extern "C" __global__ void embedding_forward(float* out, const int* ids, const float* weight, int N, int V, int C)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;  // the element n * C + c of out
    if (i >= N * C) {
        return;
    }
    int n = i / C;
    int c = i - n * C;
    int id = ids[n];
    out[i] = (0 <= id && id < V) ? weight[id * C + c] : QUIET_NAN;
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

// Deterministic: the positions come sorted by (id, position), as keys id * N + position, so that the rows
// for one id are neighbours. The warp at the first key of each id walks its group in that fixed order and
// adds the sum into dweight once: no two warps write the same element, no atomics, the same bits every run.
// A warp covers 128 columns (4 per lane, 32 apart, so that each load of the warp is 128 contiguous bytes);
// blockIdx.y picks the 128-column chunk. Ids equal to padding_idx receive nothing (-1: no padding id).
// The group's keys are read 32 at a time, one per lane, and handed to the whole warp by __shfl_sync: the
// address of the next row is then known before the current one arrives, so several rows are in flight.
#define COLUMNS_PER_LANE 4
#define COLUMNS_PER_WARP (32 * COLUMNS_PER_LANE)
#define FULL_WARP 0xffffffffu

extern "C" __global__ void embedding_backward_sorted(float* dweight, const float* __restrict__ dout,
                                                     const long long* sorted_keys, int N, int V, int C,
                                                     int padding_idx)
{
    int k = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;  // the sorted key this warp looks at
    int lane = threadIdx.x % 32;
    if (k >= N) {
        return;  // the whole warp: k is the same for its 32 lanes, so the shuffles below see full warps
    }
    long long key = sorted_keys[k];
    long long id = key / N;
    if (key < 0 || id >= V || id == padding_idx) {
        return;  // an id outside [0, V), or the padding id
    }
    if (k > 0 && sorted_keys[k - 1] >= 0 && sorted_keys[k - 1] / N == id) {
        return;  // not the first key of its id: the warp at the first one sums this row
    }
    int first_column = blockIdx.y * COLUMNS_PER_WARP + lane;
    float sum[COLUMNS_PER_LANE] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int batch = k; batch < N; batch += 32) {
        int j = batch + lane;
        long long lane_key = j < N ? sorted_keys[j] : -1;
        int position = (lane_key >= 0 && lane_key / N == id) ? (int)(lane_key - id * N) : -1;
        // The group's keys are a prefix of the batch (the keys are sorted): count them.
        int count = __popc(__ballot_sync(FULL_WARP, position >= 0));
#pragma unroll 4
        for (int r = 0; r < count; ++r) {
            const float* row = dout + (long long)__shfl_sync(FULL_WARP, position, r) * C;
            for (int u = 0; u < COLUMNS_PER_LANE; ++u) {
                int c = first_column + 32 * u;
                if (c < C) {
                    sum[u] += row[c];
                }
            }
        }
        if (count < 32) {
            break;  // the group ended inside this batch
        }
    }
    for (int u = 0; u < COLUMNS_PER_LANE; ++u) {
        int c = first_column + 32 * u;
        if (c < C) {
            dweight[id * C + c] += sum[u];
        }
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
