// Block (i, j) sums rows [j rows_per_block, (j + 1) rows_per_block) of the columns 32 i .. 32 i + 31.
// Thread (x, y) adds every 8th of those rows from the y-th, in order, for its column; the block then adds
// its 8 slots in order y = 0, 1, ..., 7 and writes row j of the partials: every addition in a fixed place.
#define ROW_SLOTS 8
#define COLUMNS_PER_BLOCK 32

extern "C" __global__ void dyt_partial_sums(float* weight_partials, float* bias_partials, const float* dout,
                                            const float* x, const float* alpha, int rows, int columns,
                                            int rows_per_block)
{
    __shared__ float weight_slots[ROW_SLOTS][COLUMNS_PER_BLOCK];
    __shared__ float bias_slots[ROW_SLOTS][COLUMNS_PER_BLOCK];
    int column = blockIdx.x * COLUMNS_PER_BLOCK + threadIdx.x;
    int first = blockIdx.y * rows_per_block;
    int end = min(first + rows_per_block, rows);
    float weight_sum = 0.0f, bias_sum = 0.0f;
    if (column < columns) {
        for (int row = first + threadIdx.y; row < end; row += ROW_SLOTS) {
            long long i = (long long)row * columns + column;
            weight_sum += dout[i] * tanhf(alpha[0] * x[i]);
            bias_sum += dout[i];
        }
    }
    weight_slots[threadIdx.y][threadIdx.x] = weight_sum;  // every thread, so that the block's sums are complete
    bias_slots[threadIdx.y][threadIdx.x] = bias_sum;
    __syncthreads();  // all eight slots written
    if (threadIdx.y == 0 && column < columns) {
        float weight_total = 0.0f, bias_total = 0.0f;
        for (int slot = 0; slot < ROW_SLOTS; ++slot) {
            weight_total += weight_slots[slot][threadIdx.x];
            bias_total += bias_slots[slot][threadIdx.x];
        }
        weight_partials[(long long)blockIdx.y * columns + column] = weight_total;
        bias_partials[(long long)blockIdx.y * columns + column] = bias_total;
    }
}
