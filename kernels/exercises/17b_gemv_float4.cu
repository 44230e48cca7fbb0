// y = W x for one row x (K) and W (N, K) float32: a warp per output, each lane reading 16 bytes (a float4) at a
// time, so that a warp's load is 512 contiguous bytes. K is a multiple of 4 (rows stay 16-byte aligned).
extern "C" __global__ void gemv_float4(float* y, const float* x, const float* weight, int N, int K)
{
    int lane = threadIdx.x % 32;
    int n = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (n >= N) {
        return;  // the whole warp leaves together: the shuffles below see all 32 lanes
    }
    const float4* w4 = reinterpret_cast<const float4*>(weight + (long long)n * K);
    const float4* x4 = reinterpret_cast<const float4*>(x);
    float sum = 0.0f;
    for (int k = lane; k < K / 4; k += 32) {
        float4 w = w4[k], v = x4[k];
        sum += w.x * v.x + w.y * v.y + w.z * v.z + w.w * v.w;
    }
    for (int offset = 16; offset > 0; offset /= 2) {
        sum += __shfl_xor_sync(0xffffffff, sum, offset);
    }
    if (lane == 0) {
        y[n] = sum;
    }
}
