extern "C" __global__ void matrix_add(float* out, const float* a, const float* b, int rows, int columns)
{
    int column = blockIdx.x * blockDim.x + threadIdx.x;
    int row = blockIdx.y * blockDim.y + threadIdx.y;
    // Both dimensions have threads past the edge.
    if (row < rows && column < columns) {
        int i = row * columns + column;  // row-major: a row's elements are neighbours in memory
        out[i] = a[i] + b[i];
    }
}
