// One step of the online softmax for a row (one thread per row): a tile of `keys` scores arrives; the row's
// maximum may grow, so what was summed against the old maximum is rescaled by exp(old - new) first.
extern "C" __global__ void online_softmax_step(float* o, float* row_max, float* row_sum, const float* scores,
                                               const float* v, int rows, int keys, int d)
{
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row < rows) {
        const float* s = scores + (long long)row * keys;
        float new_max = row_max[row];
        for (int j = 0; j < keys; ++j) {
            new_max = fmaxf(new_max, s[j]);
        }
        float correction = expf(row_max[row] - new_max);   // 0 when the row had seen nothing (-inf)
        float sum = row_sum[row] * correction;
        for (int j = 0; j < keys; ++j) {
            sum += expf(s[j] - new_max);
        }
        for (int c = 0; c < d; ++c) {
            float total = o[(long long)row * d + c] * correction;
            for (int j = 0; j < keys; ++j) {
                total += expf(s[j] - new_max) * v[(long long)j * d + c];
            }
            o[(long long)row * d + c] = total;
        }
        row_max[row] = new_max;
        row_sum[row] = sum;
    }
}
