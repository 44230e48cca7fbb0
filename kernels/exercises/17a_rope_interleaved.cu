// RoPE with the interleaved pairing of Meta's llama/model.py: channels 2i and 2i + 1 of a head form pair i,
// turned by the angle t * inv_freq[i] (t the token's position, 0 .. T - 1). x, y (B, T, H, D) float32.
extern "C" __global__ void rope_interleaved(float* y, const float* x, const float* inv_freq, int pairs, int T, int H,
                                           int D)
{
    int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p < pairs) {
        int i = p % (D / 2);             // the pair's frequency
        long long row = p / (D / 2);     // (b, t, h) flattened
        int t = (row / H) % T;
        float angle = (float)t * inv_freq[i];
        float sine = sinf(angle), cosine = cosf(angle);
        long long first = row * D + 2 * i;
        float a = x[first], b = x[first + 1];
        y[first] = a * cosine - b * sine;
        y[first + 1] = a * sine + b * cosine;
    }
}
