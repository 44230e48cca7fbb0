// sums[c] += (sum over the rows of column c) for an array of (rows, columns) floats in row-major order.
// One thread per column, walking down it. Used twice: as the first, simple bias gradient (on dy), and to
// finish the fast one (on the partial sums of its blocks, an array of few rows).
extern "C" __global__ void bias_column_sum(float* sums, const float* matrix, int rows, int columns)
{
    int column = blockIdx.x * blockDim.x + threadIdx.x;
    if (column < columns) {
        float sum = 0.0f;
        for (int row = 0; row < rows; ++row) {
            sum += matrix[(long long)row * columns + column];
        }
        sums[column] += sum;  // add, not set: a parameter's gradient accumulates
    }
}
