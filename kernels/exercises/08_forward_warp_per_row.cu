// Fused causal attention, one warp per query row: lane l owns elements l and l + 32 of the row (d <= 64).
// A score is the warp's sum of its lanes' partial dot products (five shuffles, every lane gets it); then
// every lane runs the same online-softmax step and rescales its own two elements of the output.
#include "special_values.cuh"
#include "warp.cuh"

extern "C" __global__ void attention_forward_warp(float* out, float* lse, const float* q, const float* k,
                                                  const float* v, int T, int d)
{
    int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;  // this warp's query
    int lane = threadIdx.x % 32;
    if (t >= T) {
        return;  // the whole warp: every lane of it has the same t
    }
    float scale = rsqrtf((float)d), query[2], o[2] = {0.0f, 0.0f};
    for (int i = 0; i < 2; ++i) {
        int c = lane + 32 * i;
        query[i] = c < d ? q[t * d + c] * scale : 0.0f;
    }
    float m = NEGATIVE_INFINITY, l = 0.0f;
    for (int j = 0; j <= t; ++j) {
        float partial = 0.0f;
        for (int i = 0; i < 2; ++i) {
            int c = lane + 32 * i;
            partial += c < d ? query[i] * k[j * d + c] : 0.0f;
        }
        float s = warp_sum(partial);
        float m_new = fmaxf(m, s);
        float correction = expf(m - m_new), p = expf(s - m_new);
        l = l * correction + p;
        for (int i = 0; i < 2; ++i) {
            int c = lane + 32 * i;
            o[i] = o[i] * correction + (c < d ? p * v[j * d + c] : 0.0f);
        }
        m = m_new;
    }
    for (int i = 0; i < 2; ++i) {
        int c = lane + 32 * i;
        if (c < d) {
            out[t * d + c] = o[i] / l;
        }
    }
    if (lane == 0) {
        lse[t] = m + logf(l);
    }
}
