"""Kernels that several test files launch, kept in one place."""

TILED_MATMUL = r"""
#define TILE 16

extern "C" __global__ void tiled_matmul(const float* A, const float* B, float* C, int M, int N, int K)
{
    __shared__ float As[TILE][TILE];
    __shared__ float Bs[TILE][TILE];
    int row = blockIdx.y * TILE + threadIdx.y;
    int col = blockIdx.x * TILE + threadIdx.x;
    float acc = 0.0f;
    for (int k0 = 0; k0 < K; k0 += TILE) {
        int a_col = k0 + threadIdx.x;
        int b_row = k0 + threadIdx.y;
        As[threadIdx.y][threadIdx.x] = (row < M && a_col < K) ? A[row * K + a_col] : 0.0f;
        Bs[threadIdx.y][threadIdx.x] = (b_row < K && col < N) ? B[b_row * N + col] : 0.0f;
        __syncthreads();
        for (int k = 0; k < TILE; k++) {
            acc += As[threadIdx.y][k] * Bs[k][threadIdx.x];
        }
        __syncthreads();
    }
    if (row < M && col < N) {
        C[row * N + col] = acc;
    }
}
"""


# A block's sum by a tree reduction in shared memory (blocks of up to 256 threads, a power of two).
# The barrier inside the loop is on a line of its own, so a test can take it out and get a race.
LOOP_BARRIER = "        __syncthreads();  // each step reads the sums of the step before\n"
BLOCK_SUM = r"""
extern "C" __global__ void block_sum(const float* x, float* sums, int n)
{
    __shared__ float cache[256];
    int t = threadIdx.x;
    int i = blockIdx.x * blockDim.x + t;
    cache[t] = (i < n) ? x[i] : 0.0f;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
        if (t < stride) {
            cache[t] += cache[t + stride];
        }
""" + LOOP_BARRIER + r"""    }
    if (t == 0) {
        sums[blockIdx.x] = cache[0];
    }
}
"""


# The "last block" reduction: each block writes its partial, makes it visible (FENCE: __threadfence() in the
# correct kernel) and takes a ticket with an atomic; the block that draws the last ticket adds every block's
# partial, reading through the L2 cache (__ldcg), and resets the counter. Replace FENCE before compiling.
SUM_LAST_BLOCK = r"""
extern "C" __global__ void sum_last_block(float* total, float* partials, unsigned int* counter, const float* x)
{
    __shared__ bool last;
    if (threadIdx.x == 0) {
        partials[blockIdx.x] = x[blockIdx.x];
        FENCE
        last = atomicAdd(counter, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (last && threadIdx.x == 0) {
        float sum = 0.0f;
        for (unsigned int b = 0; b < gridDim.x; ++b) sum += __ldcg(partials + b);
        total[0] = sum;
        counter[0] = 0;
    }
}
"""
