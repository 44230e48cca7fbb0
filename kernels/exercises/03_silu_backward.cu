extern "C" __global__ void silu_backward(float* dx, const float* x, const float* dy, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float s = 1.0f / (1.0f + expf(-x[i]));  // sigma(x)
        dx[i] = dy[i] * (s + x[i] * s * (1.0f - s));  // sigma' = sigma (1 - sigma)
    }
}
