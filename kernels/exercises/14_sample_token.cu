// Draw the next token of each row from softmax(logits / temperature): the first token at which the running
// sum of the probabilities passes the row's uniform number u in [0, 1). One thread per row.
extern "C" __global__ void sample_token(int* tokens, const float* logits, const float* uniforms, float temperature,
                                        int rows, int vocab)
{
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row < rows) {
        const float* z = logits + (long)row * vocab;
        float largest = z[0];
        for (int t = 1; t < vocab; ++t) {
            largest = fmaxf(largest, z[t]);
        }
        float total = 0.0f;
        for (int t = 0; t < vocab; ++t) {
            total += expf((z[t] - largest) / temperature);
        }
        float threshold = uniforms[row] * total;   // compare unnormalised sums: no division per token
        float running = 0.0f;
        int token = vocab - 1;                     // where rounding leaves the sum just short of the threshold
        for (int t = 0; t < vocab; ++t) {
            running += expf((z[t] - largest) / temperature);
            if (running > threshold) {
                token = t;
                break;
            }
        }
        tokens[row] = token;
    }
}
