// dV += P^T dO for causal attention, one thread per element (key j, column c) of dV: the sum over the
// queries i >= j that see key j of P[i][j] dO[i][c], with P recomputed as exp(S[i][j] - lse[i]).
extern "C" __global__ void dv_accumulate(float* dv, const float* scores, const float* lse, const float* dout,
                                         int T, int d)
{
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    int j = blockIdx.y * blockDim.y + threadIdx.y;
    if (j < T && c < d) {
        float sum = 0.0f;
        for (int i = j; i < T; ++i) {
            sum += expf(scores[(long long)i * T + j] - lse[i]) * dout[(long long)i * d + c];
        }
        dv[(long long)j * d + c] += sum;
    }
}
