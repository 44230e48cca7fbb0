extern "C" __global__ void gelu_forward_sigmoid(float* y, const float* x, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const float sqrt_2_over_pi = 0.7978845608f;
        const float cubic = 0.044715f;
        float v = x[i];
        float u = sqrt_2_over_pi * (v + cubic * v * v * v);
        // For u << 0, expf(-2u) is huge (infinite below u = -44) and y a tiny, correctly signed number (or -0).
        y[i] = v / (1.0f + expf(-2.0f * u));
    }
}
