// Attention's backward, first pass: dK and dV for one strip of 16 keys per warp, over every query that sees
// them. P is recomputed from the saved log-sum-exp, as chapter 08's backward does; the strip works on the
// transposes, with keys as rows, so that dK and dV stay in one warp's accumulators and no two warps add
// into the same element (no atomics, the same bits at every run):
//   S^T = K Q^T,  P^T = exp(scale S^T - lse),  dV += P^T dO,  dP^T = V dO^T,
//   dS^T = P^T (dP^T - row_dot),  dK += scale dS^T Q,  with row_dot = rowsum(dO * O) per query.
// Grouped-query attention: a key head's strip loops over the query heads that read it.
// q, dout: (heads, T, D) bf16; k, v: (kv_heads, T, D) bf16; lse, row_dot: (heads, T); dk, dv: (kv_heads, T, D).
#include <math_constants.h>   // CUDART_L2E_F = log2(e)
#include "bf16_fragments.cuh"   // row_pair, column_pair, strip_fragments, bf16_pair
#include "mma.cuh"

constexpr int D = 64;

// grid (ceil(T / 16), kv_heads), block 32
extern "C" __global__ void attention_backward_dk_dv(float* dk, float* dv, const unsigned short* q,
                                                    const unsigned short* k, const unsigned short* v,
                                                    const unsigned short* dout, const float* lse,
                                                    const float* row_dot, int T, int heads, int kv_heads,
                                                    float scale, int causal)
{
    int lane = threadIdx.x, g = lane / 4, t = lane % 4;
    long long kv_head = blockIdx.y, group = heads / kv_heads;
    int key0 = blockIdx.x * 16;
    unsigned k_strip[D / 16][4], v_strip[D / 16][4];
    strip_fragments<D>(k_strip, k + kv_head * T * D, key0, T);
    strip_fragments<D>(v_strip, v + kv_head * T * D, key0, T);
    float dk_sum[D / 8][4] = {}, dv_sum[D / 8][4] = {};
    for (long long head = kv_head * group; head < (kv_head + 1) * group; ++head) {
        const unsigned short* qh = q + head * T * D;
        const unsigned short* dout_h = dout + head * T * D;
        for (int query0 = causal ? key0 : 0; query0 < T; query0 += 16) {   // causal: earlier queries see none of these keys
            float p[2][4] = {}, dp[2][4] = {};  // P^T and dP^T: 16 keys x two tiles of 8 queries
            for (int n = 0; n < 2; ++n) {
                for (int d = 0; d < D / 16; ++d) {
                    unsigned q_b[2] = {row_pair<D>(qh, query0 + 8 * n + g, 16 * d + 2 * t, T),
                                       row_pair<D>(qh, query0 + 8 * n + g, 16 * d + 2 * t + 8, T)};
                    unsigned dout_b[2] = {row_pair<D>(dout_h, query0 + 8 * n + g, 16 * d + 2 * t, T),
                                          row_pair<D>(dout_h, query0 + 8 * n + g, 16 * d + 2 * t + 8, T)};
                    mma_m16n8k16_bf16(p[n], k_strip[d], q_b);
                    mma_m16n8k16_bf16(dp[n], v_strip[d], dout_b);
                }
                for (int i = 0; i < 4; ++i) {   // element i: key key0 + g + 8 (i / 2), query query0 + 8n + 2t + i % 2
                    int key = key0 + g + 8 * (i / 2), query = query0 + 8 * n + 2 * t + i % 2;
                    bool visible = query < T && (!causal || key <= query);
                    p[n][i] = visible ? exp2f((p[n][i] * scale - lse[head * T + query]) * CUDART_L2E_F) : 0.0f;
                    dp[n][i] = visible ? p[n][i] * (dp[n][i] - row_dot[head * T + query]) : 0.0f;  // now dS^T
                }
            }
            unsigned p_a[4] = {bf16_pair(p[0][0], p[0][1]), bf16_pair(p[0][2], p[0][3]),
                               bf16_pair(p[1][0], p[1][1]), bf16_pair(p[1][2], p[1][3])};
            unsigned ds_a[4] = {bf16_pair(dp[0][0], dp[0][1]), bf16_pair(dp[0][2], dp[0][3]),
                                bf16_pair(dp[1][0], dp[1][1]), bf16_pair(dp[1][2], dp[1][3])};
            for (int j = 0; j < D / 8; ++j) {   // B operands: dO and Q read down their columns
                unsigned dout_b[2] = {column_pair<D>(dout_h, query0 + 2 * t, 8 * j + g, T),
                                      column_pair<D>(dout_h, query0 + 2 * t + 8, 8 * j + g, T)};
                unsigned q_b[2] = {column_pair<D>(qh, query0 + 2 * t, 8 * j + g, T),
                                   column_pair<D>(qh, query0 + 2 * t + 8, 8 * j + g, T)};
                mma_m16n8k16_bf16(dv_sum[j], p_a, dout_b);
                mma_m16n8k16_bf16(dk_sum[j], ds_a, q_b);
            }
        }
    }
    for (int i = 0; i < 4; ++i) {
        int key = key0 + g + 8 * (i / 2);
        if (key < T) {
            for (int j = 0; j < D / 8; ++j) {
                long long at = (kv_head * T + key) * D + 8 * j + 2 * t + i % 2;
                dk[at] = scale * dk_sum[j][i];
                dv[at] = dv_sum[j][i];
            }
        }
    }
}
