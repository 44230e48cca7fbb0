// Fused causal attention, the second step: the first step's thread per query row, with the keys and values
// brought into shared memory a tile at a time. A block of TILE threads owns TILE consecutive queries. For
// each tile of TILE keys it loads the keys and values once, consecutive threads reading consecutive floats;
// then every thread reads them from shared memory as float4s, 4 floats per load instruction, and since all
// threads of a warp read the same key at once, each load is one broadcast. Causal: the key tiles stop at the
// block's last query. Grid (ceil(T / TILE), heads). The two tiles take 2 TILE D floats: D <= 64 fits the
// 48 KiB a block may declare statically.
#include "special_values.cuh"

#define TILE 64

template <int D>
__global__ void __launch_bounds__(TILE) attention_forward_key_tiles(float* out, float* lse, const float* q,
                                                                   const float* k, const float* v, int T,
                                                                   int causal)
{
    __shared__ __align__(16) float key_tile[TILE][D];  // 16-byte aligned: each row is read as float4s
    __shared__ __align__(16) float value_tile[TILE][D];
    int head = blockIdx.y, first = blockIdx.x * TILE;
    int t = first + threadIdx.x;
    bool active = t < T;  // a thread past the end still loads tiles: every thread must reach every barrier
    const float* keys = k + (long long)head * T * D;
    const float* values = v + (long long)head * T * D;
    float query[D], o[D];
#pragma unroll
    for (int c = 0; c < D; ++c) {
        query[c] = active ? q[((long long)head * T + t) * D + c] * rsqrtf((float)D) : 0.0f;
        o[c] = 0.0f;
    }
    float m = NEGATIVE_INFINITY, l = 0.0f;
    int last_key = causal ? min(first + TILE, T) - 1 : T - 1;  // the last key any query of the block sees
    for (int j0 = 0; j0 <= last_key; j0 += TILE) {
        __syncthreads();  // every thread is done with the previous tile before it is overwritten
        for (int i = threadIdx.x; i < TILE * D; i += TILE) {
            int j = j0 + i / D;
            key_tile[i / D][i % D] = j < T ? keys[(long long)j * D + i % D] : 0.0f;
            value_tile[i / D][i % D] = j < T ? values[(long long)j * D + i % D] : 0.0f;
        }
        __syncthreads();  // the whole tile is loaded before anyone reads it
        int visible = min(TILE, (causal ? t : T - 1) - j0 + 1);  // keys of this tile that query t sees
        for (int jj = 0; jj < visible; ++jj) {
            const float4* key = reinterpret_cast<const float4*>(key_tile[jj]);
            const float4* value = reinterpret_cast<const float4*>(value_tile[jj]);
            float s = 0.0f;
#pragma unroll
            for (int c = 0; c < D / 4; ++c) {
                float4 kc = key[c];
                s += query[4 * c] * kc.x;  // one multiply-add each (chapter 01)
                s += query[4 * c + 1] * kc.y;
                s += query[4 * c + 2] * kc.z;
                s += query[4 * c + 3] * kc.w;
            }
            float m_new = fmaxf(m, s);
            float correction = expf(m - m_new);
            float p = expf(s - m_new);
            l = l * correction + p;
#pragma unroll
            for (int c = 0; c < D / 4; ++c) {
                float4 vc = value[c];
                o[4 * c] = o[4 * c] * correction + p * vc.x;
                o[4 * c + 1] = o[4 * c + 1] * correction + p * vc.y;
                o[4 * c + 2] = o[4 * c + 2] * correction + p * vc.z;
                o[4 * c + 3] = o[4 * c + 3] * correction + p * vc.w;
            }
            m = m_new;
        }
    }
    if (active) {
#pragma unroll
        for (int c = 0; c < D; ++c) {
            out[((long long)head * T + t) * D + c] = o[c] / l;
        }
        lse[(long long)head * T + t] = m + logf(l);
    }
}
