// c_fc's bias and the GELU in one pass: out = gelu(x + bias[column]), tanh form, over a (rows, columns) x.
extern "C" __global__ void bias_gelu(float* out, const float* x, const float* bias, int rows, int columns)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows * columns) {
        float h = x[i] + bias[i % columns];
        float inner = 0.7978845608f * (h + 0.044715f * h * h * h);   // sqrt(2 / pi) (h + 0.044715 h^3)
        out[i] = 0.5f * h * (1.0f + tanhf(inner));
    }
}
