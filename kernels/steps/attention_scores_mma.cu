// S = scale Q K^T for one strip of 16 query rows per warp, on tensor cores (mma.sync.m16n8k16, bf16 in,
// float32 sums). Q, K: (heads, T, D) bf16, row-major; S: (heads, T, T) float32.
// A row of Q or K is already in the layout mma wants: the A fragment of Q holds two neighbours of a row
// (columns 2t, 2t + 1), and so does the B fragment of K^T, whose columns are K's rows. One 32-bit load each.
#include "bf16_fragments.cuh"   // row_pair, column_pair, strip_fragments, bf16_pair
#include "mma.cuh"

constexpr int D = 64;  // the head size; a multiple of 16, the k of one mma

// grid (ceil(T / 16), heads), block 32: one warp, one strip
extern "C" __global__ void attention_scores_mma(float* scores, const unsigned short* q, const unsigned short* k,
                                                int T, float scale)
{
    int lane = threadIdx.x, g = lane / 4, t = lane % 4;   // the lane's group and its place in the group
    long long head = blockIdx.y;
    q += head * T * D;
    k += head * T * D;
    scores += head * T * T;
    int row0 = blockIdx.x * 16;

    unsigned a[D / 16][4];  // the strip's Q, loaded once: D / 16 A fragments of 16 x 16
    for (int s = 0; s < D / 16; ++s) {
        a[s][0] = row_pair<D>(q, row0 + g, 16 * s + 2 * t, T);
        a[s][1] = row_pair<D>(q, row0 + g + 8, 16 * s + 2 * t, T);
        a[s][2] = row_pair<D>(q, row0 + g, 16 * s + 2 * t + 8, T);
        a[s][3] = row_pair<D>(q, row0 + g + 8, 16 * s + 2 * t + 8, T);
    }
    for (int key0 = 0; key0 < T; key0 += 8) {     // 8 keys: one n8 tile of S
        float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int s = 0; s < D / 16; ++s) {
            unsigned b[2] = {row_pair<D>(k, key0 + g, 16 * s + 2 * t, T), row_pair<D>(k, key0 + g, 16 * s + 2 * t + 8, T)};
            mma_m16n8k16_bf16(c, a[s], b);
        }
        // the accumulator: c[i] is row g + 8 (i / 2), column 2t + i % 2 of the 16 x 8 tile
        for (int i = 0; i < 4; ++i) {
            int row = row0 + g + 8 * (i / 2), key = key0 + 2 * t + i % 2;
            if (row < T && key < T) {
                scores[(long long)row * T + key] = scale * c[i];
            }
        }
    }
}
