// The backward of the fused forward, one thread per row, P recomputed from the saved lse instead of stored:
// P_tj = exp(q_t . k_j / sqrt(d) - lse_t). Two kernels, each summing along the axis its thread owns:
//   attention_backward_dq_row     one thread per query t: rowdot_t = dO_t . O_t (section 3), then over the
//                                 keys j it sees, dS_tj = P_tj (dO_t . v_j - rowdot_t), dq_t = sum_j dS_tj k_j / sqrt(d)
//   attention_backward_dk_dv_row  one thread per key j, over the queries t that see it (launched second:
//                                 it reads rowdot): dv_j = sum_t P_tj dO_t, dk_j = sum_t dS_tj q_t / sqrt(d)
// Every sum has one owner and one order: the same bits on every run. Arrays (heads, T, D) in order.
template <int D>
__global__ void attention_backward_dq_row(float* dq, float* rowdot, const float* dout, const float* out,
                                          const float* q, const float* k, const float* v, const float* lse,
                                          int T, int causal)
{
    int head = blockIdx.y, t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) {
        return;
    }
    long long row = ((long long)head * T + t) * D;
    const float* keys = k + (long long)head * T * D;
    const float* values = v + (long long)head * T * D;
    float scale = rsqrtf((float)D), query[D], gradient[D], dout_row[D], dot = 0.0f;
#pragma unroll
    for (int c = 0; c < D; ++c) {
        query[c] = q[row + c] * scale;
        dout_row[c] = dout[row + c];
        dot += dout_row[c] * out[row + c];
        gradient[c] = 0.0f;
    }
    rowdot[(long long)head * T + t] = dot;
    float row_lse = lse[(long long)head * T + t];
    for (int j = 0; j <= (causal ? t : T - 1); ++j) {
        float s = 0.0f, dp = 0.0f;
#pragma unroll
        for (int c = 0; c < D; ++c) {
            s += query[c] * keys[(long long)j * D + c];
            dp += dout_row[c] * values[(long long)j * D + c];
        }
        float ds = expf(s - row_lse) * (dp - dot);
#pragma unroll
        for (int c = 0; c < D; ++c) {
            gradient[c] += ds * keys[(long long)j * D + c];
        }
    }
#pragma unroll
    for (int c = 0; c < D; ++c) {
        dq[row + c] = gradient[c] * scale;
    }
}

template <int D>
__global__ void attention_backward_dk_dv_row(float* dk, float* dv, const float* dout, const float* q,
                                             const float* k, const float* v, const float* lse,
                                             const float* rowdot, int T, int causal)
{
    int head = blockIdx.y, j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= T) {
        return;
    }
    long long row = ((long long)head * T + j) * D, first = (long long)head * T;
    float scale = rsqrtf((float)D), key[D], value[D], key_gradient[D], value_gradient[D];
#pragma unroll
    for (int c = 0; c < D; ++c) {
        key[c] = k[row + c] * scale;
        value[c] = v[row + c];
        key_gradient[c] = value_gradient[c] = 0.0f;
    }
    for (int t = causal ? j : 0; t < T; ++t) {  // the queries that see key j
        const float* query = q + (first + t) * D;
        const float* dout_row = dout + (first + t) * D;
        float s = 0.0f, dp = 0.0f;
#pragma unroll
        for (int c = 0; c < D; ++c) {
            s += query[c] * key[c];
            dp += dout_row[c] * value[c];
        }
        float p = expf(s - lse[first + t]);
        float ds = p * (dp - rowdot[first + t]);
#pragma unroll
        for (int c = 0; c < D; ++c) {
            value_gradient[c] += p * dout_row[c];
            key_gradient[c] += ds * query[c];
        }
    }
#pragma unroll
    for (int c = 0; c < D; ++c) {
        dk[row + c] = key_gradient[c] * scale;
        dv[row + c] = value_gradient[c];
    }
}
