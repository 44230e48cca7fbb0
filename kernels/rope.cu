// Rotary position embedding (RoPE) of queries or keys x (B, T, H, D), in place or into y:
// the pair (a, b) of channels that share frequency i, 0 <= i < D/2, is turned by the angle
// (start + t) * inv_freq[i], t the position in the sequence:
//   a' = a cos - b sin,   b' = a sin + b cos.
// Two pairings of the channels:
//   rotate_half (Hugging Face, Meta's release): a = x[i], b = x[i + D/2];
//   interleaved (llama2.c, the RoFormer paper):  a = x[2i], b = x[2i + 1].
// inv_freq[i] = theta^(-2i/D), computed once on the host in float32; the angle is a float32 product, as
// Hugging Face's is (in float16 the angle of position 1000 would be wrong by about 0.5 radians).
// A rotation is orthogonal: its backward is the rotation by minus the angle, the same kernel with sign -1.
// One thread per pair; start shifts the positions for a KV cache (new tokens at start, start + 1, ...).

__device__ __forceinline__ void rotate_pair(float* y, const float* x, const float* inv_freq, int pairs, int T,
                                            int H, int D, int start, int interleaved, float sign)
{
    int pair = blockIdx.x * blockDim.x + threadIdx.x;
    if (pair >= pairs) {
        return;
    }
    int half = D / 2;
    int i = pair % half;                         // the frequency
    long long row = pair / half;                 // (b, t, h) flattened
    int t = (int)((row / H) % T);
    float angle = (float)(start + t) * inv_freq[i];
    float sine = sign * sinf(angle), cosine = cosf(angle);
    long long first = row * D + (interleaved ? 2 * i : i);
    long long second = first + (interleaved ? 1 : half);
    float a = x[first], b = x[second];
    y[first] = a * cosine - b * sine;
    y[second] = a * sine + b * cosine;
}

extern "C" __global__ void rope_forward(float* y, const float* x, const float* inv_freq, int pairs, int T, int H,
                                        int D, int start, int interleaved)
{
    rotate_pair(y, x, inv_freq, pairs, T, H, D, start, interleaved, 1.0f);
}

extern "C" __global__ void rope_backward(float* dx, const float* dout, const float* inv_freq, int pairs, int T,
                                         int H, int D, int start, int interleaved)
{
    rotate_pair(dx, dout, inv_freq, pairs, T, H, D, start, interleaved, -1.0f);
}
