// Cross-entropy fused with its gradient, the second step: one block of THREADS threads per row, the row read
// once. Thread j reads elements j, j + THREADS, ...: a warp reads 32 neighbouring floats, one 128-byte segment.
// Each thread keeps a running (maximum, sum of exp(x - maximum)) over its elements, the online softmax, and
// stores each value in shared memory as it reads it; the block merges the threads' pairs (shuffles within a
// warp, then the warps' pairs through shared memory); the gradient pass reads the row from shared memory.
// Launch: grid N, block THREADS, shared_mem 4 V bytes. scale = 1 / (rows counted).
#include "special_values.cuh"

#define THREADS 1024

// Merge the pair (other_maximum, other_sum) into (maximum, sum).
__device__ void merge(float& maximum, float& sum, float other_maximum, float other_sum)
{
    float largest = fmaxf(maximum, other_maximum);
    if (largest != NEGATIVE_INFINITY) {  // both empty: nothing to rescale
        sum = sum * expf(maximum - largest) + other_sum * expf(other_maximum - largest);
        maximum = largest;
    }
}

// The pair of the whole block, in every thread.
__device__ void block_merge(float& maximum, float& sum)
{
    __shared__ float warp_maximum[THREADS / 32], warp_sum[THREADS / 32];
    for (int offset = 16; offset > 0; offset /= 2) {
        merge(maximum, sum, __shfl_xor_sync(0xffffffff, maximum, offset), __shfl_xor_sync(0xffffffff, sum, offset));
    }
    if (threadIdx.x % 32 == 0) {
        warp_maximum[threadIdx.x / 32] = maximum;
        warp_sum[threadIdx.x / 32] = sum;
    }
    __syncthreads();  // every warp's pair is written (and so is the cached row) before anyone reads them
    maximum = NEGATIVE_INFINITY;
    sum = 0.0f;
    for (int w = 0; w < THREADS / 32; ++w) {  // every thread merges the 32 pairs, in the same order
        merge(maximum, sum, warp_maximum[w], warp_sum[w]);
    }
}

extern "C" __global__ void __launch_bounds__(THREADS)
cross_entropy_block_per_row(float* dlogits, float* row_losses, const float* logits, const int* targets, int V,
                            int ignore_index, float scale)
{
    extern __shared__ float cached_row[];  // V floats
    const float* row = logits + (long long)blockIdx.x * V;
    float* dlogits_row = dlogits + (long long)blockIdx.x * V;
    int target = targets[blockIdx.x];
    if (target == ignore_index) {  // the whole block takes this branch: no barrier is skipped by a part of it
        for (int j = threadIdx.x; j < V; j += THREADS) {
            dlogits_row[j] = 0.0f;
        }
        if (threadIdx.x == 0) {
            row_losses[blockIdx.x] = 0.0f;
        }
        return;
    }
    float maximum = NEGATIVE_INFINITY, sum = 0.0f;
    for (int j = threadIdx.x; j < V; j += THREADS) {
        float x = row[j];
        cached_row[j] = x;
        if (x > maximum) {  // the maximum grows: rescale the sum so far
            sum = sum * expf(maximum - x) + 1.0f;
            maximum = x;
        } else {
            sum += expf(x - maximum);
        }
    }
    block_merge(maximum, sum);
    float log_sum_exp = maximum + logf(sum);
    if (threadIdx.x == 0) {
        row_losses[blockIdx.x] = log_sum_exp - cached_row[target];
    }
    for (int j = threadIdx.x; j < V; j += THREADS) {
        dlogits_row[j] = (expf(cached_row[j] - log_sum_exp) - (j == target ? 1.0f : 0.0f)) * scale;
    }
}
