// Attention's backward, second pass: dQ for one strip of 16 query rows per warp, over the keys it sees:
//   S = Q K^T,  P = exp(scale S - lse),  dP = dO V^T,  dS = P (dP - row_dot),  dQ += scale dS K.
// The same loop as the forward's, with dO's strip beside Q's in registers; each warp writes only its own
// rows of dQ, so the two passes together need no atomics.
// q, dout: (heads, T, D) bf16; k, v: (kv_heads, T, D) bf16; lse, row_dot: (heads, T); dq: (heads, T, D).
#include <math_constants.h>   // CUDART_L2E_F = log2(e)
#include "bf16_fragments.cuh"   // row_pair, column_pair, strip_fragments, bf16_pair
#include "mma.cuh"

constexpr int D = 64;

// grid (ceil(T / 16), heads), block 32
extern "C" __global__ void attention_backward_dq(float* dq, const unsigned short* q, const unsigned short* k,
                                                 const unsigned short* v, const unsigned short* dout,
                                                 const float* lse, const float* row_dot, int T, int heads,
                                                 int kv_heads, float scale, int causal)
{
    int lane = threadIdx.x, g = lane / 4, t = lane % 4;
    long long head = blockIdx.y, kv_head = head / (heads / kv_heads);
    int row0 = blockIdx.x * 16;
    k += kv_head * T * D;
    v += kv_head * T * D;
    unsigned q_strip[D / 16][4], dout_strip[D / 16][4];
    strip_fragments<D>(q_strip, q + head * T * D, row0, T);
    strip_fragments<D>(dout_strip, dout + head * T * D, row0, T);
    float row_lse[2], row_delta[2];           // rows g and g + 8
    for (int r = 0; r < 2; ++r) {
        int row = row0 + g + 8 * r;
        row_lse[r] = row < T ? lse[head * T + row] : 0.0f;
        row_delta[r] = row < T ? row_dot[head * T + row] : 0.0f;
    }
    float dq_sum[D / 8][4] = {};
    int keys = causal ? min(T, row0 + 16) : T;
    for (int key0 = 0; key0 < keys; key0 += 16) {
        float p[2][4] = {}, ds[2][4] = {};
        for (int n = 0; n < 2; ++n) {
            for (int d = 0; d < D / 16; ++d) {
                unsigned k_b[2] = {row_pair<D>(k, key0 + 8 * n + g, 16 * d + 2 * t, T),
                                   row_pair<D>(k, key0 + 8 * n + g, 16 * d + 2 * t + 8, T)};
                unsigned v_b[2] = {row_pair<D>(v, key0 + 8 * n + g, 16 * d + 2 * t, T),
                                   row_pair<D>(v, key0 + 8 * n + g, 16 * d + 2 * t + 8, T)};
                mma_m16n8k16_bf16(p[n], q_strip[d], k_b);
                mma_m16n8k16_bf16(ds[n], dout_strip[d], v_b);
            }
            for (int i = 0; i < 4; ++i) {
                int row = row0 + g + 8 * (i / 2), key = key0 + 8 * n + 2 * t + i % 2;
                bool visible = row < T && key < T && (!causal || key <= row);
                p[n][i] = visible ? exp2f((p[n][i] * scale - row_lse[i / 2]) * CUDART_L2E_F) : 0.0f;
                ds[n][i] = p[n][i] * (ds[n][i] - row_delta[i / 2]);
            }
        }
        unsigned ds_a[4] = {bf16_pair(ds[0][0], ds[0][1]), bf16_pair(ds[0][2], ds[0][3]),
                            bf16_pair(ds[1][0], ds[1][1]), bf16_pair(ds[1][2], ds[1][3])};
        for (int j = 0; j < D / 8; ++j) {
            unsigned k_b[2] = {column_pair<D>(k, key0 + 2 * t, 8 * j + g, T), column_pair<D>(k, key0 + 2 * t + 8, 8 * j + g, T)};
            mma_m16n8k16_bf16(dq_sum[j], ds_a, k_b);
        }
    }
    for (int i = 0; i < 4; ++i) {
        int row = row0 + g + 8 * (i / 2);
        if (row < T) {
            for (int j = 0; j < D / 8; ++j) {
                dq[(head * T + row) * D + 8 * j + 2 * t + i % 2] = scale * dq_sum[j][i];
            }
        }
    }
}
