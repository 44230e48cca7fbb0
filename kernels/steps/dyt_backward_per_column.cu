// DyT backward, first version. dx elementwise; then thread c walks the rows in order and adds column c's
// terms into dweight[c] and dbias[c], and leaves its share of dalpha in alpha_terms[c]; then one thread adds
// the C shares in order into dalpha. Every addition has a fixed place: the same bits on every run. Only
// C threads do the column sums, each a chain of `rows` dependent steps.

extern "C" __global__ void dyt_backward_dx(float* dx, const float* dout, const float* x, const float* alpha,
                                           const float* weight, int n, int columns)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float t = tanhf(alpha[0] * x[i]);
        dx[i] = dout[i] * weight[i % columns] * (1.0f - t * t) * alpha[0];
    }
}

extern "C" __global__ void dyt_backward_column_sums(float* dweight, float* dbias, float* alpha_terms,
                                                    const float* dout, const float* x, const float* alpha,
                                                    const float* weight, int rows, int columns)
{
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= columns) {
        return;
    }
    float weight_sum = 0.0f, bias_sum = 0.0f, alpha_sum = 0.0f;
    for (int row = 0; row < rows; ++row) {
        long long i = (long long)row * columns + c;
        float t = tanhf(alpha[0] * x[i]);
        weight_sum += dout[i] * t;
        bias_sum += dout[i];
        alpha_sum += dout[i] * weight[c] * (1.0f - t * t) * x[i];
    }
    dweight[c] += weight_sum;
    dbias[c] += bias_sum;
    alpha_terms[c] = alpha_sum;
}

extern "C" __global__ void dyt_backward_alpha_sum(float* dalpha, const float* alpha_terms, int columns)
{
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        float sum = 0.0f;
        for (int c = 0; c < columns; ++c) {
            sum += alpha_terms[c];
        }
        dalpha[0] += sum;
    }
}
