// The tied lm_head's share of the embedding's gradient: dwte[token, c] += sum over rows of
// dlogits[row, token] * x[row, c]. The embedding's own backward adds its share into the same buffer.
// A two-dimensional grid: x walks the channels, y the tokens.
extern "C" __global__ void tied_head_gradient(float* dwte, const float* dlogits, const float* x, int rows,
                                              int vocab, int channels)
{
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    int token = blockIdx.y * blockDim.y + threadIdx.y;
    if (token < vocab && c < channels) {
        float sum = 0.0f;
        for (int row = 0; row < rows; ++row) {
            sum += dlogits[row * vocab + token] * x[row * channels + c];
        }
        dwte[token * channels + c] += sum;
    }
}
