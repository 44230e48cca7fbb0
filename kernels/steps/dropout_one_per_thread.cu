// Dropout, the first step: one thread per element. Each thread computes a whole Philox call for its own
// random number (philox_uniform, philox.cuh) and uses one of its four words: the mask is the package's,
// bit for bit, since the number of element i depends on i alone; but it computes four numbers to use one.
#include "philox.cuh"

extern "C" __global__ void dropout_one_per_thread(float* out, const float* x, const unsigned long long* rng_state,
                                                  float p, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    float scale = 1.0f / (1.0f - p);  // infinite for p = 1, but then no element is kept and it is never used
    out[i] = philox_uniform(rng_state[0], rng_state[1], i) >= p ? x[i] * scale : 0.0f;
}
