// Four standard normal numbers per thread from one Philox call, by the Box-Muller transform: two uniforms
// u0 in (0, 1] and u1 in [0, 1) give z0 = sqrt(-2 ln u0) cos(2 pi u1) and z1 = sqrt(-2 ln u0) sin(2 pi u1).
#include "philox.cuh"

extern "C" __global__ void philox_normal(float* z, unsigned long long seed, int n)
{
    int group = blockIdx.x * blockDim.x + threadIdx.x;
    unsigned int c[4] = {(unsigned int)group, 0u, 0u, 0u};  // counter (group, 0, 0, 0)
    philox4x32_10(c, (unsigned int)seed, (unsigned int)(seed >> 32));
    float result[4];
    for (int pair = 0; pair < 2; ++pair) {
        // (top 24 bits + 1) / 2^24: in (0, 1], so the logarithm is finite.
        float u0 = ((c[2 * pair] >> 8) + 1.0f) * (1.0f / 16777216.0f);
        float u1 = (c[2 * pair + 1] >> 8) * (1.0f / 16777216.0f);
        float radius = sqrtf(-2.0f * logf(u0));
        result[2 * pair] = radius * cosf(6.2831853f * u1);
        result[2 * pair + 1] = radius * sinf(6.2831853f * u1);
    }
    for (int k = 0; k < 4; ++k) {
        int i = 4 * group + k;
        if (i < n) {
            z[i] = result[k];
        }
    }
}
