// Rotary position embedding (RoPE) of queries or keys x (B, T, H, D), in place or into y:
// the pair (a, b) of channels that share frequency i, 0 <= i < D/2, is turned by the angle
// (start + t) * inv_freq[i], t the position in the sequence:
//   a' = a cos - b sin,   b' = a sin + b cos.
// Two pairings of the channels:
//   rotate_half (Hugging Face's modeling_llama.py and its checkpoints): a = x[i], b = x[i + D/2];
//   interleaved (Meta's llama/model.py, llama2.c, the RoFormer paper):  a = x[2i], b = x[2i + 1].
// inv_freq[i] = theta^(-2i/D), computed once on the host in float32; the angle is a float32 product, as
// Hugging Face's is (in float16 the angle of position 1000 would be wrong by about 0.5 radians).
// A rotation is orthogonal: its backward is the rotation by minus the angle, the same kernel with sign -1.
// One thread per pair; start shifts the positions for a KV cache (new tokens at start, start + 1, ...).
// x and y float32, or bf16 (floatX, storage.cuh) for generation in bf16: the pair is rotated in float32 and
// rounded once; the angle is float32 either way. y is contiguous; x's rows (b, t) are x_row elements apart,
// H D when it is contiguous too, more when x is a slice of a wider array (q or k among q, k, v side by side),
// and x starts x_offset elements into the array passed.
#include "dependent_launch.cuh"
#include "rope_pair.cuh"   // pair_channels, rotated, store_new_position_pair
#include "storage.cuh"

template <typename floatX>
__device__ __forceinline__ void rotate_pair(floatX* y, const floatX* x, long long x_offset, long long x_row,
                                            const float* inv_freq, int pairs, int T, int H, int D, int start,
                                            int interleaved, float sign)
{
    int pair = blockIdx.x * blockDim.x + threadIdx.x;
    if (pair >= pairs) {
        return;
    }
    int half = D / 2;
    int i = pair % half;                         // the frequency
    long long row = pair / half;                 // (b, t, h) flattened
    int t = (int)((row / H) % T);
    int2 channels = pair_channels(i, D, interleaved);
    long long first = row * D + channels.x, second = row * D + channels.y;
    long long x_start = x_offset + row / H * x_row + row % H * D;
    float2 turned = rotated(to_float(x[x_start + channels.x]), to_float(x[x_start + channels.y]), start + t,
                            inv_freq[i], sign);
    y[first] = from_float<floatX>(turned.x);
    y[second] = from_float<floatX>(turned.y);
}

extern "C" __global__ void rope_forward(float* y, const float* x, const float* inv_freq, int pairs, int T, int H,
                                        int D, int start, int interleaved)
{
    rotate_pair<float>(y, x, 0, (long long)H * D, inv_freq, pairs, T, H, D, start, interleaved, 1.0f);
}

extern "C" __global__ void rope_backward(float* dx, const float* dout, const float* inv_freq, int pairs, int T,
                                         int H, int D, int start, int interleaved)
{
    rotate_pair<float>(dx, dout, 0, (long long)H * D, inv_freq, pairs, T, H, D, start, interleaved, -1.0f);
}

// The forward in either storage type, the first position read from device memory when device_start is not
// null: a CUDA graph captures the launch once and replays it at every new position of generation. x starts
// x_offset elements into the array passed, its rows x_row elements apart.
template <typename floatX>
__global__ void rope_forward_stored(floatX* y, const floatX* x, long long x_offset, long long x_row,
                                    const float* inv_freq, const int* device_start, int host_start, int pairs, int T,
                                    int H, int D, int interleaved)
{
    int start = device_start != nullptr ? device_start[0] : host_start;
    rotate_pair<floatX>(y, x, x_offset, x_row, inv_freq, pairs, T, H, D, start, interleaved, 1.0f);
}

// Generation's step after the product of q, k and v, in one launch: q and k rotated, q written head-major for
// the decode kernel, k and v written into the cache. The new positions t < n of each sequence b sit at
// positions p0 + t, p0 = device_start[0] (a CUDA graph replays the launch as the cache grows).
//   qkv (B, n, (H + 2 H_kv) D): q's H heads, k's H_kv heads and v's H_kv heads side by side, as one product of
//       the three weights' rows gives them;
//   q_out (B, H, n, D); keys, values (B, H_kv, capacity, D).
// One thread per pair of channels of q's, k's and v's heads (v's pairs are copied, not turned): the same
// rotation and rounding as rope_forward_stored, then the copy that decode_attention_store makes
// (store_new_position_pair, rope_pair.cuh, which the q, k, v GEMV also runs: kernels/gemv.cu's gemv_rope_store).
// Launched dependent (dependent_launch.cuh): it starts while the product before it ends, and waits before it reads.
template <typename floatX>
__global__ void rope_store_new_positions(floatX* q_out, floatX* keys, floatX* values, const floatX* qkv,
    const float* inv_freq, const int* device_start, int B, int n, int H, int H_kv, int D, int capacity,
    int interleaved)
{
    let_next_kernel_start();
    wait_for_previous_kernel();
    int half = D / 2, heads = H + 2 * H_kv;
    long long pair = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (pair >= (long long)B * n * heads * half) {
        return;
    }
    int i = (int)(pair % half), head = (int)(pair / half % heads);
    int t = (int)(pair / half / heads % n), b = (int)(pair / half / heads / n);
    int position = device_start[0] + t;
    const floatX* source = qkv + (((long long)b * n + t) * heads + head) * D;
    int2 channels = pair_channels(i, D, interleaved);
    store_new_position_pair(q_out, keys, values, source[channels.x], source[channels.y], b, t, head, i, position,
                            inv_freq[i], n, H, H_kv, D, capacity, interleaved);
}
