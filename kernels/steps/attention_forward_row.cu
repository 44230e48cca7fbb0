// Fused causal attention, the first step: one thread per query row, the online softmax over the keys one
// at a time, nothing written but the output and the row's log-sum-exp. q, k, v, out: (heads, T, D) in
// order; lse: (heads, T). Grid (ceil(T / blockDim.x), heads). D, the head size, is a template parameter:
// the loops over it unroll, and the thread's query and running output, arrays of D floats, stay in registers.
#include "special_values.cuh"

template <int D>
__global__ void attention_forward_row(float* out, float* lse, const float* q, const float* k, const float* v,
                                      int T, int causal)
{
    int head = blockIdx.y;
    int t = blockIdx.x * blockDim.x + threadIdx.x;  // this thread's query
    if (t >= T) {
        return;
    }
    const float* keys = k + (long long)head * T * D;
    const float* values = v + (long long)head * T * D;
    float query[D], o[D];
#pragma unroll
    for (int c = 0; c < D; ++c) {
        query[c] = q[((long long)head * T + t) * D + c] * rsqrtf((float)D);  // the scale 1/sqrt(d), once
        o[c] = 0.0f;
    }
    float m = NEGATIVE_INFINITY, l = 0.0f;  // the running maximum and sum of exp(s - m)
    int last = causal ? t : T - 1;           // query t sees keys 0..t
    for (int j = 0; j <= last; ++j) {
        float s = 0.0f;
#pragma unroll
        for (int c = 0; c < D; ++c) {
            s += query[c] * keys[(long long)j * D + c];
        }
        float m_new = fmaxf(m, s);
        float correction = expf(m - m_new);  // rescales what was summed under the old maximum (0 at j = 0)
        float p = expf(s - m_new);
        l = l * correction + p;
#pragma unroll
        for (int c = 0; c < D; ++c) {
            o[c] = o[c] * correction + p * values[(long long)j * D + c];
        }
        m = m_new;
    }
#pragma unroll
    for (int c = 0; c < D; ++c) {
        out[((long long)head * T + t) * D + c] = o[c] / l;
    }
    lse[(long long)head * T + t] = m + logf(l);
}
