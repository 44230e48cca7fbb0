// A bias of shape (columns,) was added to every row of a (rows, columns) result: its gradient is the sum of
// the upstream gradient over the rows, added into its buffer. One thread per column; neighbouring threads
// read neighbouring columns of each row, so every row is read coalesced.
extern "C" __global__ void broadcast_gradient(float* dbias, const float* dout, int rows, int columns)
{
    int column = blockIdx.x * blockDim.x + threadIdx.x;
    if (column < columns) {
        float sum = 0.0f;
        for (int row = 0; row < rows; ++row) {
            sum += dout[row * columns + column];
        }
        dbias[column] += sum;
    }
}
