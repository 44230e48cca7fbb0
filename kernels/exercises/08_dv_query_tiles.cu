// dV of causal attention, one thread per key j, the queries brought into shared memory a tile at a time:
//     dv_j = sum over queries t >= j of P_tj dO_t,  P_tj = exp(q_t . k_j / sqrt(D) - lse_t).
// A block of TILE_ROWS threads owns TILE_ROWS keys; the queries that see them start at the block's first key.
#define D 64
#define TILE_ROWS 64

extern "C" __global__ void attention_backward_dv(float* dv, const float* q, const float* k, const float* dout,
                                                 const float* lse, int T)
{
    __shared__ float query_tile[TILE_ROWS][D];
    __shared__ float dout_tile[TILE_ROWS][D];
    __shared__ float lse_tile[TILE_ROWS];
    int first = blockIdx.x * TILE_ROWS, j = first + threadIdx.x;
    float key[D], gradient[D];
    for (int c = 0; c < D; ++c) {
        key[c] = j < T ? k[j * D + c] * rsqrtf((float)D) : 0.0f;
        gradient[c] = 0.0f;
    }
    for (int t0 = first; t0 < T; t0 += TILE_ROWS) {
        __syncthreads();  // nobody still reads the previous tile
        for (int i = threadIdx.x; i < TILE_ROWS * D; i += TILE_ROWS) {
            int t = t0 + i / D;
            query_tile[i / D][i % D] = t < T ? q[t * D + i % D] : 0.0f;
            dout_tile[i / D][i % D] = t < T ? dout[t * D + i % D] : 0.0f;
        }
        lse_tile[threadIdx.x] = t0 + threadIdx.x < T ? lse[t0 + threadIdx.x] : 0.0f;
        __syncthreads();  // the tiles are complete
        for (int tt = 0; tt < TILE_ROWS; ++tt) {
            int t = t0 + tt;
            if (t < j || t >= T) {
                continue;  // query t does not see key j, or there is no query t
            }
            float s = 0.0f;
            for (int c = 0; c < D; ++c) {
                s += query_tile[tt][c] * key[c];
            }
            float p = expf(s - lse_tile[tt]);
            for (int c = 0; c < D; ++c) {
                gradient[c] += p * dout_tile[tt][c];
            }
        }
    }
    if (j < T) {
        for (int c = 0; c < D; ++c) {
            dv[j * D + c] = gradient[c];
        }
    }
}
