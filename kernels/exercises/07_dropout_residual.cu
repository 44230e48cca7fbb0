// out = residual + dropout(x): the residual add after an attention or MLP branch, fused with the branch's
// dropout, so that the dropped branch is never written to memory and read back. One thread per group of 4
// elements, one Philox call for all four (philox_uniforms, philox.cuh).
#include "philox.cuh"

extern "C" __global__ void dropout_residual(float* out, const float* residual, const float* x,
                                            unsigned long long seed, unsigned long long offset, float p, int n)
{
    int group = blockIdx.x * blockDim.x + threadIdx.x;
    float u[4];
    philox_uniforms(u, seed, offset, group);
    float scale = 1.0f / (1.0f - p);
    for (int word = 0; word < 4; ++word) {
        int i = 4 * group + word;
        if (i < n) {
            out[i] = residual[i] + (u[word] >= p ? x[i] * scale : 0.0f);
        }
    }
}
