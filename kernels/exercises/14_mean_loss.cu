#define LOSS_THREADS 256

// The mean of n per-token losses, in one block: each thread sums a strided share, then a tree adds the
// partial sums in a fixed order, so the loss has the same bits on every run.
extern "C" __global__ void mean_loss(float* loss, const float* losses, int n)
{
    __shared__ float partial[LOSS_THREADS];
    float sum = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        sum += losses[i];
    }
    partial[threadIdx.x] = sum;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) {
            partial[threadIdx.x] += partial[threadIdx.x + half];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        loss[0] = partial[0] / n;
    }
}
