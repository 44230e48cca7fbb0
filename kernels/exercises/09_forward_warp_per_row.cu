// Cross-entropy's forward, one warp per row: each lane runs the online softmax over elements lane,
// lane + 32, ...; the 32 pairs (maximum, sum) merge by shuffles; lane 0 writes lse and the row's loss.
#include "special_values.cuh"

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
        float x = z[j];
        if (x > maximum) {  // the maximum grows: rescale the sum so far
            sum = sum * expf(maximum - x) + 1.0f;
            maximum = x;
        } else {
            sum += expf(x - maximum);
        }
    }
    for (int offset = 16; offset > 0; offset /= 2) {  // merge the lanes' pairs, as chapter 04 merges them
        float other_maximum = __shfl_xor_sync(0xffffffff, maximum, offset);
        float other_sum = __shfl_xor_sync(0xffffffff, sum, offset);
        float largest = fmaxf(maximum, other_maximum);
        if (largest != NEGATIVE_INFINITY) {  // both empty (a lane past V holds (-inf, 0)): nothing to rescale
            sum = sum * expf(maximum - largest) + other_sum * expf(other_maximum - largest);
            maximum = largest;
        }
    }
    if (lane == 0) {
        float log_sum_exp = maximum + logf(sum);
        int target = targets[row];
        lse[row] = log_sum_exp;
        bool valid = 0 <= target && target < V;  // else NaN: a wrong target shows in the loss
        row_losses[row] = target == ignore_index ? 0.0f : valid ? log_sum_exp - z[target] : QUIET_NAN;
    }
}
