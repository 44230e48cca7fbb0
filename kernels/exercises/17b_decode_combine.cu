// Flash-decoding's merge: chunk s of the keys left, for each row, its maximum score m_s, its sum
// l_s = Σ e^(score - m_s) and its unnormalised output o_s (d numbers). With M = max_s m_s,
//   out = Σ_s o_s e^(m_s - M) / Σ_s l_s e^(m_s - M).
// partial_out (splits, rows, d), partial_max and partial_sum (splits, rows), out (rows, d); a thread per element.
extern "C" __global__ void decode_combine(float* out, const float* partial_out, const float* partial_max,
                                         const float* partial_sum, int splits, int rows, int d)
{
    int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e < rows * d) {
        int row = e / d;
        float M = partial_max[row];
        for (int s = 1; s < splits; s++) {
            M = fmaxf(M, partial_max[s * rows + row]);
        }
        float numerator = 0.0f, denominator = 0.0f;
        for (int s = 0; s < splits; s++) {
            float scale = expf(partial_max[s * rows + row] - M);
            numerator += partial_out[(long long)s * rows * d + e] * scale;
            denominator += partial_sum[s * rows + row] * scale;
        }
        out[e] = numerator / denominator;
    }
}
