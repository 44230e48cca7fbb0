// attention_forward_online_softmax without shared memory: the accumulator of S for 16 rows x 16 keys holds,
// lane by lane, the same elements as the A fragment of a 16 x 16 operand (rows g, g + 8; columns 2t, 2t + 1
// of each 8-key half). So P, rounded to bf16 in pairs, goes from S's registers straight into P V.
// Grouped-query attention is an index: query head h reads key and value head h / (heads / kv_heads).
// q: (heads, T, D), k, v: (kv_heads, T, D) bf16; out: (heads, T, D) float32; lse: (heads, T) float32.
#include <math_constants.h>   // CUDART_INF_F, CUDART_L2E_F = log2(e)
#include "bf16_fragments.cuh"   // row_pair, column_pair, strip_fragments, bf16_pair
#include "mma.cuh"

constexpr int D = 64;

// grid (ceil(T / 16), heads), block 32
extern "C" __global__ void attention_forward_mma(float* out, float* lse, const unsigned short* q,
                                             const unsigned short* k, const unsigned short* v,
                                             int T, int heads, int kv_heads, float scale, int causal)
{
    int lane = threadIdx.x, g = lane / 4, t = lane % 4;
    long long head = blockIdx.y, kv_head = head / (heads / kv_heads);
    q += head * T * D; k += kv_head * T * D; v += kv_head * T * D; out += head * T * D; lse += head * T;
    int row0 = blockIdx.x * 16;

    unsigned a[D / 16][4];
    for (int s = 0; s < D / 16; ++s) {
        a[s][0] = row_pair<D>(q, row0 + g, 16 * s + 2 * t, T);
        a[s][1] = row_pair<D>(q, row0 + g + 8, 16 * s + 2 * t, T);
        a[s][2] = row_pair<D>(q, row0 + g, 16 * s + 2 * t + 8, T);
        a[s][3] = row_pair<D>(q, row0 + g + 8, 16 * s + 2 * t + 8, T);
    }
    float o[D / 8][4] = {};                     // O's accumulator: D / 8 tiles of 16 x 8
    float row_max[2] = {-CUDART_INF_F, -CUDART_INF_F};  // rows g and g + 8, in log2 units
    float row_sum[2] = {0.0f, 0.0f};            // this lane's share of each row's sum
    int keys = causal ? min(T, row0 + 16) : T;
    for (int key0 = 0; key0 < keys; key0 += 16) {
        float s[2][4] = {};                     // S: two 8-key tiles
        for (int n = 0; n < 2; ++n) {
            for (int d = 0; d < D / 16; ++d) {
                unsigned b[2] = {row_pair<D>(k, key0 + 8 * n + g, 16 * d + 2 * t, T),
                                 row_pair<D>(k, key0 + 8 * n + g, 16 * d + 2 * t + 8, T)};
                mma_m16n8k16_bf16(s[n], a[d], b);
            }
        }
        for (int r = 0; r < 2; ++r) {           // r = 0: row g (elements 0, 1); r = 1: row g + 8 (elements 2, 3)
            int row = row0 + g + 8 * r;
            float tile_max = -CUDART_INF_F;
            for (int n = 0; n < 2; ++n) {
                for (int i = 2 * r; i < 2 * r + 2; ++i) {
                    int key = key0 + 8 * n + 2 * t + i % 2;
                    bool visible = key < T && (!causal || key <= row);
                    s[n][i] = visible ? s[n][i] * scale * CUDART_L2E_F : -CUDART_INF_F;
                    tile_max = fmaxf(tile_max, s[n][i]);
                }
            }
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));  // the group's four lanes
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
            float new_max = fmaxf(row_max[r], tile_max);
            float base = new_max == -CUDART_INF_F ? 0.0f : new_max;     // a row with nothing visible yet
            float correction = exp2f(row_max[r] - base);            // what the old sums were measured against
            row_sum[r] *= correction;
            for (int j = 0; j < D / 8; ++j) {
                o[j][2 * r] *= correction;
                o[j][2 * r + 1] *= correction;
            }
            for (int n = 0; n < 2; ++n) {
                for (int i = 2 * r; i < 2 * r + 2; ++i) {
                    s[n][i] = exp2f(s[n][i] - base);                // now P, unnormalised
                    row_sum[r] += s[n][i];
                }
            }
            row_max[r] = new_max;
        }
        // S's accumulator as P V's A fragment: a[0] row g and a[1] row g + 8 from the first 8 keys, a[2], a[3] the next 8
        unsigned p[4] = {bf16_pair(s[0][0], s[0][1]), bf16_pair(s[0][2], s[0][3]),
                         bf16_pair(s[1][0], s[1][1]), bf16_pair(s[1][2], s[1][3])};
        for (int j = 0; j < D / 8; ++j) {
            unsigned b[2] = {column_pair<D>(v, key0 + 2 * t, 8 * j + g, T), column_pair<D>(v, key0 + 2 * t + 8, 8 * j + g, T)};
            mma_m16n8k16_bf16(o[j], p, b);
        }
    }
    for (int r = 0; r < 2; ++r) {
        float total = row_sum[r];
        total += __shfl_xor_sync(0xffffffffu, total, 1);
        total += __shfl_xor_sync(0xffffffffu, total, 2);
        int row = row0 + g + 8 * r;
        if (row < T) {
            for (int j = 0; j < D / 8; ++j) {
                out[(long long)row * D + 8 * j + 2 * t] = o[j][2 * r] / total;
                out[(long long)row * D + 8 * j + 2 * t + 1] = o[j][2 * r + 1] / total;
            }
            if (t == 0) {
                lse[row] = (row_max[r] + log2f(total)) / CUDART_L2E_F;
            }
        }
    }
}
