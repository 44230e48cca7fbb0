// Cross-entropy's forward, one warp per row: each lane runs the online softmax over elements lane,
// lane + 32, ...; the 32 pairs (maximum, sum) merge by shuffles; lane 0 writes lse and the row's loss.
#include "special_values.cuh"

__device__ void merge(float& maximum, float& sum, float other_maximum, float other_sum)
{
    float largest = fmaxf(maximum, other_maximum);
    if (largest != NEGATIVE_INFINITY) {
        sum = sum * expf(maximum - largest) + other_sum * expf(other_maximum - largest);
        maximum = largest;
    }
}

extern "C" __global__ void cross_entropy_forward_warp(float* lse, float* row_losses, const float* logits,
                                                      const int* targets, int N, int V, int ignore_index)
{
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= N) {
        return;
    }
    const float* z = logits + (long long)row * V;
    float maximum = NEGATIVE_INFINITY, sum = 0.0f;
    for (int j = lane; j < V; j += 32) {
        merge(maximum, sum, z[j], 1.0f);  // one element is the pair (z_j, 1)
    }
    for (int offset = 16; offset > 0; offset /= 2) {
        merge(maximum, sum, __shfl_xor_sync(0xffffffff, maximum, offset), __shfl_xor_sync(0xffffffff, sum, offset));
    }
    if (lane == 0) {
        float log_sum_exp = maximum + logf(sum);
        int target = targets[row];
        lse[row] = log_sum_exp;
        row_losses[row] = target == ignore_index ? 0.0f : log_sum_exp - z[target];
    }
}
