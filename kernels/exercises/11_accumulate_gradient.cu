// A leaf's gradient arrives: add it into the leaf's buffer in place, never replacing the buffer.
extern "C" __global__ void accumulate_gradient(float* grad, const float* gradient, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        grad[i] += gradient[i];
    }
}
