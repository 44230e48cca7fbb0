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
// x and y float32, or bf16 (floatX, storage.cuh) for generation in bf16: the pair is rotated in float32 and
// rounded once; the angle is float32 either way.
#include "storage.cuh"

template <typename floatX>
__device__ __forceinline__ void rotate_pair(floatX* y, const floatX* x, const float* inv_freq, int pairs, int T,
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
    float a = to_float(x[first]), b = to_float(x[second]);
    y[first] = from_float<floatX>(a * cosine - b * sine);
    y[second] = from_float<floatX>(a * sine + b * cosine);
}

extern "C" __global__ void rope_forward(float* y, const float* x, const float* inv_freq, int pairs, int T, int H,
                                        int D, int start, int interleaved)
{
    rotate_pair<float>(y, x, inv_freq, pairs, T, H, D, start, interleaved, 1.0f);
}

extern "C" __global__ void rope_backward(float* dx, const float* dout, const float* inv_freq, int pairs, int T,
                                         int H, int D, int start, int interleaved)
{
    rotate_pair<float>(dx, dout, inv_freq, pairs, T, H, D, start, interleaved, -1.0f);
}

// The forward in either storage type, the first position read from device memory when device_start is not
// null: a CUDA graph captures the launch once and replays it at every new position of generation.
template <typename floatX>
__global__ void rope_forward_stored(floatX* y, const floatX* x, const float* inv_freq, const int* device_start,
                                    int host_start, int pairs, int T, int H, int D, int interleaved)
{
    int start = device_start != nullptr ? device_start[0] : host_start;
    rotate_pair<floatX>(y, x, inv_freq, pairs, T, H, D, start, interleaved, 1.0f);
}
