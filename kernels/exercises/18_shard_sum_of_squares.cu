#define SQUARES_THREADS 256

// total += the sum of gradients[i]^2 over the n elements of this rank's shard. Each block adds its 256 squares
// in shared memory (a tree, as chapter 02's column sums), and one thread adds the block's sum to total.
extern "C" __global__ void sum_of_squares(float* total, const float* gradients, int n)
{
    __shared__ float partial[SQUARES_THREADS];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    float value = 0.0f;
    if (i < n) {
        value = gradients[i] * gradients[i];
    }
    partial[threadIdx.x] = value;
    __syncthreads();
    for (int half = SQUARES_THREADS / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) {
            partial[threadIdx.x] += partial[threadIdx.x + half];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        atomicAdd(total, partial[0]);
    }
}
