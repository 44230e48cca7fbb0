extern "C" __global__ void column_sum_strip(float* sums, const float* matrix, int rows, int columns)
{
    __shared__ float partial[8][32];  // [row of threads][column within the strip]
    int column = blockIdx.x * 32 + threadIdx.x;
    float sum = 0.0f;
    if (column < columns) {
        // A warp reads 32 neighbouring floats of one row: coalesced.
        for (int row = threadIdx.y; row < rows; row += blockDim.y) {
            sum += matrix[(long long)row * columns + column];
        }
    }
    partial[threadIdx.y][threadIdx.x] = sum;
    __syncthreads();  // all 8 partial sums are in shared memory before row 0 adds them
    if (threadIdx.y == 0 && column < columns) {
        float total = 0.0f;
        for (int r = 0; r < blockDim.y; ++r) {
            total += partial[r][threadIdx.x];
        }
        sums[column] += total;  // add: a parameter's gradient accumulates
    }
}
