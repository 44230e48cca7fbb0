// attention_forward_mma with a block of WARPS warps that share each tile of K and V in shared memory,
// fetched by cp.async two stages deep: while the warps multiply tile i, tile i + 1 is on its way. K's
// B fragments are 32-bit reads of a tile row; V's come through ldmatrix.trans, since P V reads V down its
// columns. Compiled with -DSTRIPS=2, each warp owns two strips of 16 query rows, and every fragment of K or
// V it reads from shared memory serves both: half the shared-memory traffic per multiply-add, for twice
// the registers. q: (heads, T, D), k, v: (kv_heads, T, D) bf16; out: (heads, T, D), lse: (heads, T) float32.
#include <math_constants.h>   // CUDART_INF_F, CUDART_L2E_F = log2(e)
#include "bf16_fragments.cuh"   // row_pair, column_pair, strip_fragments, bf16_pair
#include "mma.cuh"

#ifndef STRIPS
#define STRIPS 1
#endif
constexpr int D = 64, WARPS = 4, KEYS = 32;   // a tile: KEYS keys
constexpr int STRIDE = D + 8;  // a tile row of 144 bytes: ldmatrix's rows stay 16-byte aligned, on other banks
constexpr int ROWS = 16 * STRIPS * WARPS;     // query rows per block

// The block's threads start the copy of rows key0.. of `matrix` into `tile`, 16 bytes each; rows past T
// become zeros (0 source bytes, read from row 0 so that the address stays inside the array).
__device__ __forceinline__ void copy_tile_async(unsigned short (*tile)[STRIDE], const unsigned short* matrix, int key0, int T)
{
    for (int chunk = threadIdx.x; chunk < KEYS * D / 8; chunk += blockDim.x) {
        int r = chunk / (D / 8), col = 8 * (chunk % (D / 8));
        bool inside = key0 + r < T;
        cp_async_16(shared_address(&tile[r][col]), matrix + (long long)(inside ? key0 + r : 0) * D + col, inside ? 16 : 0);
    }
}

// grid (ceil(T / ROWS), heads), block 32 WARPS
extern "C" __global__ void attention_forward_pipelined(float* out, float* lse, const unsigned short* q,
                                                       const unsigned short* k, const unsigned short* v,
                                                       int T, int heads, int kv_heads, float scale, int causal)
{
    __shared__ __align__(16) unsigned short k_tiles[2][KEYS][STRIDE];
    __shared__ __align__(16) unsigned short v_tiles[2][KEYS][STRIDE];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    long long head = blockIdx.y, kv_head = head / (heads / kv_heads);
    q += head * T * D; k += kv_head * T * D; v += kv_head * T * D; out += head * T * D; lse += head * T;
    int block_row0 = blockIdx.x * ROWS, row0 = block_row0 + 16 * STRIPS * warp;   // strip s starts at row0 + 16 s

    unsigned a[STRIPS][D / 16][4];
    for (int s = 0; s < STRIPS; ++s)
        for (int d = 0; d < D / 16; ++d)
            for (int i = 0; i < 4; ++i)
                a[s][d][i] = row_pair<D>(q, row0 + 16 * s + g + 8 * (i % 2), 16 * d + 2 * t + 8 * (i / 2), T);
    float o[STRIPS][D / 8][4] = {};
    float row_max[STRIPS][2], row_sum[STRIPS][2] = {};
    for (int s = 0; s < STRIPS; ++s) row_max[s][0] = row_max[s][1] = -CUDART_INF_F;

    int keys = causal ? min(T, block_row0 + ROWS) : T, tiles = (keys + KEYS - 1) / KEYS;
    copy_tile_async(k_tiles[0], k, 0, T);
    copy_tile_async(v_tiles[0], v, 0, T);
    cp_async_commit();
    for (int tile = 0; tile < tiles; ++tile) {
        int stage = tile % 2;
        if (tile + 1 < tiles) {                 // the next tile into the other stage, while this one is used
            copy_tile_async(k_tiles[1 - stage], k, (tile + 1) * KEYS, T);
            copy_tile_async(v_tiles[1 - stage], v, (tile + 1) * KEYS, T);
        }
        cp_async_commit();                      // a group each time, empty at the end: wait<1> then means "this tile"
        cp_async_wait<1>();
        __syncthreads();                        // every thread's copies of this tile have landed
        for (int sub = 0; sub < KEYS; sub += 16) {
            int key0 = tile * KEYS + sub;
            if (causal && key0 > row0 + 16 * STRIPS - 1) break;   // the warp's rows see none of these keys
            float p[STRIPS][2][4] = {};
            for (int n = 0; n < 2; ++n) {
                for (int d = 0; d < D / 16; ++d) {
                    const unsigned short* key_row = &k_tiles[stage][sub + 8 * n + g][16 * d + 2 * t];
                    unsigned b[2] = {*reinterpret_cast<const unsigned*>(key_row), *reinterpret_cast<const unsigned*>(key_row + 8)};
                    for (int s = 0; s < STRIPS; ++s) mma_m16n8k16_bf16(p[s][n], a[s][d], b);   // one B, every strip
                }
            }
            for (int s = 0; s < STRIPS; ++s) {
                for (int r = 0; r < 2; ++r) {
                    int row = row0 + 16 * s + g + 8 * r;
                    float tile_max = -CUDART_INF_F;
                    for (int n = 0; n < 2; ++n) {
                        for (int i = 2 * r; i < 2 * r + 2; ++i) {
                            int key = key0 + 8 * n + 2 * t + i % 2;
                            p[s][n][i] = key < T && (!causal || key <= row) ? p[s][n][i] * scale * CUDART_L2E_F : -CUDART_INF_F;
                            tile_max = fmaxf(tile_max, p[s][n][i]);
                        }
                    }
                    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
                    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
                    float new_max = fmaxf(row_max[s][r], tile_max);
                    float base = new_max == -CUDART_INF_F ? 0.0f : new_max;
                    float correction = exp2f(row_max[s][r] - base);
                    row_sum[s][r] *= correction;
                    for (int j = 0; j < D / 8; ++j) {
                        o[s][j][2 * r] *= correction;
                        o[s][j][2 * r + 1] *= correction;
                    }
                    for (int n = 0; n < 2; ++n) {
                        for (int i = 2 * r; i < 2 * r + 2; ++i) {
                            p[s][n][i] = exp2f(p[s][n][i] - base);
                            row_sum[s][r] += p[s][n][i];
                        }
                    }
                    row_max[s][r] = new_max;
                }
            }
            unsigned pa[STRIPS][4];             // P as the A fragment of P V, as in attention_forward_mma
            for (int s = 0; s < STRIPS; ++s) {
                pa[s][0] = bf16_pair(p[s][0][0], p[s][0][1]); pa[s][1] = bf16_pair(p[s][0][2], p[s][0][3]);
                pa[s][2] = bf16_pair(p[s][1][0], p[s][1][1]); pa[s][3] = bf16_pair(p[s][1][2], p[s][1][3]);
            }
            for (int j = 0; j < D / 8; ++j) {
                unsigned b[2];                  // V down its columns: keys sub + 2t, 2t + 1 (and + 8) of column 8j + g
                ldmatrix_x2_trans(b, shared_address(&v_tiles[stage][sub + lane % 16][8 * j]));
                for (int s = 0; s < STRIPS; ++s) mma_m16n8k16_bf16(o[s][j], pa[s], b);
            }
        }
        __syncthreads();                        // nobody still reads this stage when the next copy into it starts
    }
    for (int s = 0; s < STRIPS; ++s) {
        for (int r = 0; r < 2; ++r) {
            float total = row_sum[s][r];
            total += __shfl_xor_sync(0xffffffffu, total, 1);
            total += __shfl_xor_sync(0xffffffffu, total, 2);
            int row = row0 + 16 * s + g + 8 * r;
            if (row < T) {
                for (int j = 0; j < D / 8; ++j) {
                    out[(long long)row * D + 8 * j + 2 * t] = o[s][j][2 * r] / total;
                    out[(long long)row * D + 8 * j + 2 * t + 1] = o[s][j][2 * r + 1] / total;
                }
                if (t == 0) lse[row] = (row_max[s][r] + log2f(total)) / CUDART_L2E_F;
            }
        }
    }
}
