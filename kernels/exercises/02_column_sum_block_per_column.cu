extern "C" __global__ void column_sum_block_per_column(float* sums, const float* matrix, int rows, int columns)
{
    int column = blockIdx.x;
    float sum = 0.0f;
    for (int row = threadIdx.x; row < rows; row += blockDim.x) {
        sum += matrix[(long long)row * columns + column];  // the 32 lanes of a warp hit 32 different rows
    }
    for (int offset = 16; offset > 0; offset /= 2) {
        sum += __shfl_down_sync(0xffffffff, sum, offset);  // lane 0 ends with the warp's sum
    }
    __shared__ float warp_sums[32];
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) {
        warp_sums[warp] = sum;
    }
    __syncthreads();  // every warp's sum is in shared memory before thread 0 adds them
    if (threadIdx.x == 0) {
        float total = 0.0f;
        for (int w = 0; w < blockDim.x / 32; ++w) {
            total += warp_sums[w];
        }
        sums[column] += total;  // add: a parameter's gradient accumulates
    }
}
