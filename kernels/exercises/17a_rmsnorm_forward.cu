// RMSNorm's forward, a warp per row: out = x * rstd * weight, rstd = 1 / sqrt(mean(x²) + eps), float32.
extern "C" __global__ void rmsnorm_forward(float* out, float* rstd, const float* x, const float* weight, int rows,
                                          int columns, float eps)
{
    int lane = threadIdx.x % 32;
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= rows) {
        return;  // the whole warp leaves together: the shuffles below see all 32 lanes
    }
    const float* x_row = x + (long long)row * columns;
    float sum = 0.0f;
    for (int c = lane; c < columns; c += 32) {
        sum += x_row[c] * x_row[c];
    }
    for (int offset = 16; offset > 0; offset /= 2) {
        sum += __shfl_xor_sync(0xffffffff, sum, offset);
    }
    float r = rsqrtf(sum / columns + eps);
    for (int c = lane; c < columns; c += 32) {
        out[(long long)row * columns + c] = x_row[c] * r * weight[c];
    }
    if (lane == 0) {
        rstd[row] = r;
    }
}
