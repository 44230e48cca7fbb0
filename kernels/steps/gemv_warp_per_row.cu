// y = W x for one row x (K) and W (N, K) float32: a warp per output n, lane l summing columns l, l + 32, ...
extern "C" __global__ void gemv_warp_per_row(float* y, const float* x, const float* weight, int N, int K)
{
    int lane = threadIdx.x % 32;
    int n = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (n >= N) {
        return;  // the whole warp leaves together: the shuffles below see all 32 lanes
    }
    const float* row = weight + (long long)n * K;
    float sum = 0.0f;
    for (int k = lane; k < K; k += 32) {
        sum += row[k] * x[k];   // 32 neighbouring floats per warp load: 128 bytes
    }
    for (int offset = 16; offset > 0; offset /= 2) {
        sum += __shfl_xor_sync(0xffffffff, sum, offset);
    }
    if (lane == 0) {
        y[n] = sum;
    }
}
