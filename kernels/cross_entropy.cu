// Cross-entropy of softmax(logits) against integer targets, fused with its gradient.
// logits (N, V) float32, targets (N,) int32; rows whose target equals ignore_index count for nothing.
//   loss    = (1 / count) * sum over counted rows i of (lse_i - logits[i, t_i]),  lse_i = log sum_j exp(logits[i, j])
//   dlogits = (softmax(logits[i]) - onehot(t_i)) * dout / count on counted rows, 0 on ignored rows
// One block of ROW_THREADS threads per row. A target outside [0, V) (and not ignore_index) makes its
// row's loss and gradient NaN: the error shows in the loss without a check that would stop the GPU.

#include "float_groups.cuh"
#include "special_values.cuh"
#include "storage.cuh"

#ifndef ROW_THREADS  // the op builds a copy with fewer threads for a small vocabulary (-DROW_THREADS=256)
#define ROW_THREADS 1024
#endif
#define WARPS_PER_ROW (ROW_THREADS / 32)
#ifndef LOADS_IN_FLIGHT  // the row read twice, float by float: loads a thread issues before it uses the first
#define LOADS_IN_FLIGHT 8
#endif
#ifndef VECTORS_PER_STEP  // the row kept in shared memory: float4 loads a thread issues before it uses the first,
#define VECTORS_PER_STEP 4  // 1024 x 4 x 16 B = 64 KiB in flight per SM (bench/cross_entropy.py compares 2, 4 and 8)
#endif

// The running (maximum, sum of exp(x - maximum)) of the online softmax, merged with another such pair.
__device__ __forceinline__ void merge_softmax_state(float& maximum, float& sum, float other_maximum, float other_sum)
{
    float largest = fmaxf(maximum, other_maximum);
    if (largest == NEGATIVE_INFINITY) {
        return;  // both empty (or all -inf): nothing to rescale
    }
    sum = sum * expf(maximum - largest) + other_sum * expf(other_maximum - largest);
    maximum = largest;
}

// One element into the running pair: one exp, and a rescale only when the maximum grows.
__device__ __forceinline__ void add_to_softmax_state(float& maximum, float& sum, float x)
{
    if (x > maximum) {
        sum = sum * expf(maximum - x) + 1.0f;
        maximum = x;
    } else if (x != NEGATIVE_INFINITY) {
        sum += expf(x - maximum);
    }
}

// n values into the running pair at once: their maximum first, then one exp each relative to it (and one
// rescale of the running sum per n values, not per value).
__device__ __forceinline__ void add_values_to_softmax_state(float& maximum, float& sum, const float* x, int n)
{
    float values_maximum = NEGATIVE_INFINITY;
    for (int k = 0; k < n; ++k) {
        values_maximum = fmaxf(values_maximum, x[k]);
    }
    float values_sum = 0.0f;
    if (values_maximum != NEGATIVE_INFINITY) {
        for (int k = 0; k < n; ++k) {
            values_sum += expf(x[k] - values_maximum);
        }
    }
    merge_softmax_state(maximum, sum, values_maximum, values_sum);
}

// The (maximum, sum) of the whole block, returned to every thread: shuffles within each warp, then warp 0.
__device__ void block_softmax_state(float& maximum, float& sum)
{
    __shared__ float warp_maximum[WARPS_PER_ROW];
    __shared__ float warp_sum[WARPS_PER_ROW];
    for (int offset = 16; offset > 0; offset /= 2) {
        float other_maximum = __shfl_xor_sync(0xffffffff, maximum, offset);
        float other_sum = __shfl_xor_sync(0xffffffff, sum, offset);
        merge_softmax_state(maximum, sum, other_maximum, other_sum);
    }
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
        warp_maximum[warp] = maximum;
        warp_sum[warp] = sum;
    }
    __syncthreads();
    if (warp == 0) {
        maximum = lane < WARPS_PER_ROW ? warp_maximum[lane] : NEGATIVE_INFINITY;  // fewer than 32 warps: empty
        sum = lane < WARPS_PER_ROW ? warp_sum[lane] : 0.0f;
        for (int offset = 16; offset > 0; offset /= 2) {
            float other_maximum = __shfl_xor_sync(0xffffffff, maximum, offset);
            float other_sum = __shfl_xor_sync(0xffffffff, sum, offset);
            merge_softmax_state(maximum, sum, other_maximum, other_sum);
        }
        if (lane == 0) {
            warp_maximum[0] = maximum;
            warp_sum[0] = sum;
        }
    }
    __syncthreads();
    maximum = warp_maximum[0];
    sum = warp_sum[0];
}

// The online softmax over one row, read from `row` (global memory) element by element: float, or bf16
// logits of a model trained in bf16 (floatX, storage.cuh), each read into a float.
template <typename floatX>
__device__ void row_softmax_state(float& maximum, float& sum, const floatX* row, int V)
{
    maximum = NEGATIVE_INFINITY;
    sum = 0.0f;
    for (int first = threadIdx.x; first < V; first += LOADS_IN_FLIGHT * ROW_THREADS) {
        float x[LOADS_IN_FLIGHT];
#pragma unroll
        for (int u = 0; u < LOADS_IN_FLIGHT; ++u) {  // all loads first: they overlap in the memory system
            int j = first + u * ROW_THREADS;
            x[u] = j < V ? to_float(row[j]) : NEGATIVE_INFINITY;
        }
#pragma unroll
        for (int u = 0; u < LOADS_IN_FLIGHT; ++u) {
            int j = first + u * ROW_THREADS;
            if (j < V) {
                add_to_softmax_state(maximum, sum, x[u]);
            }
        }
    }
    block_softmax_state(maximum, sum);
}

// The row kept in shared memory, moved as float4s (16 bytes per load, a quarter of the instructions).
// A float4 must sit on a 16-byte boundary, and rows of 50257 floats start 4 bytes further along each time:
// a row is read as a `head` of 0 to 3 floats up to its first boundary, whole float4s, and a tail of 0 to 3
// floats, the loose floats one each for the first threads. Column j is cached at cache[j + shift] with
// shift = (4 - head) % 4, so that the row's float4s land on float4s of shared memory too.
struct RowLayout {
    int head, shift, vectors;
};

__device__ __forceinline__ RowLayout row_layout(const float* row, int V)
{
    int boundary = floats_to_boundary(row);
    int head = min(boundary, V);
    return {head, (4 - boundary) % 4, (V - head) / 4};
}

// The head or tail column this thread takes (V or more: none).
__device__ __forceinline__ int loose_column(RowLayout layout, int V)
{
    int tail = layout.head + 4 * layout.vectors;
    int column = (int)threadIdx.x < layout.head ? (int)threadIdx.x : tail + (int)threadIdx.x - layout.head;
    return (int)threadIdx.x < layout.head + 3 ? column : V;
}

// The online softmax over one row read from global memory once, each value also stored in shared memory.
__device__ void cached_row_softmax_state(float& maximum, float& sum, const float* row, float* cache, int V,
                                         RowLayout layout)
{
    int threads = blockDim.x;
    const float4* row_vectors = reinterpret_cast<const float4*>(row + layout.head);
    float4* cache_vectors = reinterpret_cast<float4*>(cache + layout.head + layout.shift);
    maximum = NEGATIVE_INFINITY;
    sum = 0.0f;
    int v = threadIdx.x;
    for (; v + (VECTORS_PER_STEP - 1) * threads < layout.vectors; v += VECTORS_PER_STEP * threads) {
        float4 loaded[VECTORS_PER_STEP];
#pragma unroll
        for (int u = 0; u < VECTORS_PER_STEP; ++u) {  // all loads first: they overlap in the memory system
            loaded[u] = __ldcs(row_vectors + v + u * threads);  // streaming: DRAM will not see this row again
        }
        float x[4 * VECTORS_PER_STEP];
#pragma unroll
        for (int u = 0; u < VECTORS_PER_STEP; ++u) {
            cache_vectors[v + u * threads] = loaded[u];
            x[4 * u] = loaded[u].x;
            x[4 * u + 1] = loaded[u].y;
            x[4 * u + 2] = loaded[u].z;
            x[4 * u + 3] = loaded[u].w;
        }
        add_values_to_softmax_state(maximum, sum, x, 4 * VECTORS_PER_STEP);
    }
    for (; v < layout.vectors; v += threads) {
        float4 loaded = __ldcs(row_vectors + v);
        cache_vectors[v] = loaded;
        float x[4] = {loaded.x, loaded.y, loaded.z, loaded.w};
        add_values_to_softmax_state(maximum, sum, x, 4);
    }
    int loose = loose_column(layout, V);
    if (loose < V) {
        cache[loose + layout.shift] = row[loose];
        add_to_softmax_state(maximum, sum, row[loose]);
    }
    block_softmax_state(maximum, sum);  // its __syncthreads also make the whole cache visible
}

__device__ __forceinline__ bool target_in_range(int target, int V)
{
    return 0 <= target && target < V;
}

// Forward only: lse[i] and the row's loss (0 for an ignored row). Reads each logit once. The logits are
// floatX (float, or bf16); lse and the losses are float32 either way.
template <typename floatX>
__global__ void __launch_bounds__(ROW_THREADS)
cross_entropy_forward_rows(float* lse, float* row_losses, const floatX* logits, const int* targets, int V,
                           int ignore_index)
{
    int i = blockIdx.x;
    const floatX* row = logits + (long long)i * V;
    float maximum, sum;
    row_softmax_state(maximum, sum, row, V);
    if (threadIdx.x == 0) {
        float log_sum_exp = maximum + logf(sum);
        int target = targets[i];
        lse[i] = log_sum_exp;
        if (target == ignore_index) {
            row_losses[i] = 0.0f;
        } else {
            row_losses[i] = target_in_range(target, V) ? log_sum_exp - to_float(row[target]) : QUIET_NAN;
        }
    }
}

// How many targets are not ignore_index, in one block (fixed order: the same count, and no atomics).
extern "C" __global__ void __launch_bounds__(ROW_THREADS)
cross_entropy_count(int* count, const int* targets, int N, int ignore_index)
{
    __shared__ int warp_count[WARPS_PER_ROW];
    int counted = 0;
    for (int i = threadIdx.x; i < N; i += ROW_THREADS) {
        counted += targets[i] != ignore_index;
    }
    for (int offset = 16; offset > 0; offset /= 2) {
        counted += __shfl_xor_sync(0xffffffff, counted, offset);
    }
    if (threadIdx.x % 32 == 0) {
        warp_count[threadIdx.x / 32] = counted;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int total = 0;
        for (int w = 0; w < WARPS_PER_ROW; ++w) {
            total += warp_count[w];
        }
        count[0] = total;
    }
}

// loss = sum(row_losses) / count, summed in a fixed order (deterministic); NaN when count is 0, as in torch.
extern "C" __global__ void __launch_bounds__(ROW_THREADS)
cross_entropy_mean(float* loss, const float* row_losses, const int* count, int N)
{
    __shared__ float warp_total[WARPS_PER_ROW];
    float total = 0.0f;
    for (int i = threadIdx.x; i < N; i += ROW_THREADS) {
        total += row_losses[i];
    }
    for (int offset = 16; offset > 0; offset /= 2) {
        total += __shfl_xor_sync(0xffffffff, total, offset);
    }
    if (threadIdx.x % 32 == 0) {
        warp_total[threadIdx.x / 32] = total;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float sum = 0.0f;
        for (int w = 0; w < WARPS_PER_ROW; ++w) {
            sum += warp_total[w];
        }
        loss[0] = count[0] > 0 ? sum / (float)count[0] : QUIET_NAN;
    }
}

// The gradient of logit j of a counted row: (exp(x - lse) - onehot) * scale.
__device__ __forceinline__ float logit_gradient(float x, int j, float log_sum_exp, int target, float scale)
{
    return (expf(x - log_sum_exp) - (j == target ? 1.0f : 0.0f)) * scale;
}

// A counted row's gradient, its logits read from `source`. dlogits may be the logits themselves: every thread
// reads its elements before it writes them. floatX: how both are stored (a bf16 gradient is rounded once).
// Rows that start on 16 bytes and hold whole 16-byte groups (V a multiple of 4 floats or 8 bf16, as GPT-2's
// padded vocabulary of 50304) move a group per load and store (storage.cuh), with each element's value the
// same as one at a time.
template <typename floatX>
__device__ void write_row_gradient(floatX* dlogits_row, const floatX* source, int V, float log_sum_exp, int target,
                                   float scale)
{
    constexpr int WIDTH = 16 / sizeof(floatX);
    if (V % WIDTH == 0 && (unsigned long long)source % 16 == 0 && (unsigned long long)dlogits_row % 16 == 0) {
        for (int group = threadIdx.x; group < V / WIDTH; group += ROW_THREADS) {
            float x[WIDTH];
            load_as_float<WIDTH>(x, source + WIDTH * group, true);
            for (int w = 0; w < WIDTH; ++w) {
                x[w] = logit_gradient(x[w], WIDTH * group + w, log_sum_exp, target, scale);
            }
            store_from_float<WIDTH>(dlogits_row + WIDTH * group, x);
        }
        return;
    }
    for (int j = threadIdx.x; j < V; j += ROW_THREADS) {
        dlogits_row[j] = from_float<floatX>(logit_gradient(to_float(source[j]), j, log_sum_exp, target, scale));
    }
}

// The same from the row cached in shared memory, as float4s (dlogits_row starts where the row does, modulo 16
// bytes: the op launches this only when both arrays start on 16 bytes).
__device__ void write_cached_row_gradient(float* dlogits_row, const float* cache, int V, RowLayout layout,
                                          float log_sum_exp, int target, float scale)
{
    const float4* cache_vectors = reinterpret_cast<const float4*>(cache + layout.head + layout.shift);
    float4* dlogits_vectors = reinterpret_cast<float4*>(dlogits_row + layout.head);
    for (int v = threadIdx.x; v < layout.vectors; v += blockDim.x) {  // shared memory answers fast: no unrolling
        float4 x = cache_vectors[v];
        int j = layout.head + 4 * v;
        __stcs(dlogits_vectors + v, make_float4(logit_gradient(x.x, j, log_sum_exp, target, scale),
                                                logit_gradient(x.y, j + 1, log_sum_exp, target, scale),
                                                logit_gradient(x.z, j + 2, log_sum_exp, target, scale),
                                                logit_gradient(x.w, j + 3, log_sum_exp, target, scale)));
    }
    int loose = loose_column(layout, V);
    if (loose < V) {
        dlogits_row[loose] = logit_gradient(cache[loose + layout.shift], loose, log_sum_exp, target, scale);
    }
}

template <typename floatX>
__device__ void write_zero_row(floatX* dlogits_row, int V)
{
    for (int j = threadIdx.x; j < V; j += ROW_THREADS) {
        dlogits_row[j] = from_float<floatX>(0.0f);
    }
}

// Backward from a saved lse: dlogits = (softmax - onehot) * dout / count. Reads and writes each element once.
// The logits and their gradient are floatX (float, or bf16); lse and dout are float32.
template <typename floatX>
__global__ void __launch_bounds__(ROW_THREADS)
cross_entropy_backward_rows(floatX* dlogits, const floatX* logits, const int* targets, const float* lse,
                            const float* dout, const int* count, int V, int ignore_index)
{
    int i = blockIdx.x;
    int target = targets[i];
    floatX* dlogits_row = dlogits + (long long)i * V;
    if (target == ignore_index) {
        write_zero_row(dlogits_row, V);
        return;
    }
    float scale = target_in_range(target, V) ? dout[0] / (float)count[0] : QUIET_NAN;
    write_row_gradient(dlogits_row, logits + (long long)i * V, V, lse[i], target, scale);
}

// Forward and backward in one pass over the logits, as if dout = 1. CACHE_ROW keeps the row in dynamic
// shared memory (V + 3 floats: 196 KiB at V = 50257) so that DRAM sees each logit read once and each gradient
// written once, moved as float4s (logits and dlogits must start on 16 bytes); without it the gradient pass
// reads the row a second time (from L2 if it is still there), float by float.
template <bool CACHE_ROW>
__global__ void __launch_bounds__(ROW_THREADS)
cross_entropy_fused_rows(float* dlogits, float* row_losses, const float* logits, const int* targets,
                         const int* count, int V, int ignore_index)
{
    extern __shared__ float cached_row[];
    int i = blockIdx.x;
    int target = targets[i];
    const float* row = logits + (long long)i * V;
    float* dlogits_row = dlogits + (long long)i * V;
    if (target == ignore_index) {  // nothing to read: the gradient is 0 and the loss does not count the row
        write_zero_row(dlogits_row, V);
        if (threadIdx.x == 0) {
            row_losses[i] = 0.0f;
        }
        return;
    }
    float maximum, sum;
    RowLayout layout = row_layout(row, V);
    if (CACHE_ROW) {
        cached_row_softmax_state(maximum, sum, row, cached_row, V, layout);
    } else {
        row_softmax_state(maximum, sum, row, V);
    }
    float log_sum_exp = maximum + logf(sum);
    bool valid = target_in_range(target, V);
    if (threadIdx.x == 0) {
        float target_logit = valid ? (CACHE_ROW ? cached_row[target + layout.shift] : row[target]) : 0.0f;
        row_losses[i] = valid ? log_sum_exp - target_logit : QUIET_NAN;
    }
    __syncthreads();  // thread 0 has read row[target] before any thread overwrites it (in place)
    float scale = valid ? 1.0f / (float)count[0] : QUIET_NAN;
    if (CACHE_ROW) {
        write_cached_row_gradient(dlogits_row, cached_row, V, layout, log_sum_exp, target, scale);
    } else {
        write_row_gradient(dlogits_row, row, V, log_sum_exp, target, scale);
    }
}
