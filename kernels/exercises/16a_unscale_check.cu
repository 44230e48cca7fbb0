// The gradients of a loss scaled by S, divided by S again (times inverse_scale = 1 / S); when any result is
// not finite, found_infinite[0] becomes 1 and the optimizer skips this step (PyTorch's GradScaler).
extern "C" __global__ void unscale_and_check(float* unscaled, int* found_infinite, const float* gradients,
                                             const float* inverse_scale, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float value = gradients[i] * inverse_scale[0];
        unscaled[i] = value;
        if (!isfinite(value)) {
            atomicExch(found_infinite, 1);   // several threads may find one: each sets the same flag
        }
    }
}
