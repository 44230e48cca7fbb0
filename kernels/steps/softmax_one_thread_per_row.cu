// Softmax, first version: one thread per row, three passes over its row (the maximum, the sum of
// exponentials, the output). Correct for any row length, slow for two reasons: neighbouring threads read
// addresses a whole row apart (each load of a warp touches 32 cache lines), and a (8192, 50257) input has
// only 8192 rows, so only 8192 threads to keep the GPU's memory busy.
extern "C" __global__ void softmax_forward_one_thread_per_row(float* y, const float* x, int rows, int columns)
{
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows) {
        return;
    }
    const float* x_row = x + (long long)row * columns;
    float* y_row = y + (long long)row * columns;
    float maximum = x_row[0];
    for (int column = 1; column < columns; ++column) {
        maximum = fmaxf(maximum, x_row[column]);
    }
    float sum = 0.0f;
    for (int column = 0; column < columns; ++column) {
        sum += expf(x_row[column] - maximum);
    }
    for (int column = 0; column < columns; ++column) {
        y_row[column] = expf(x_row[column] - maximum) / sum;
    }
}
