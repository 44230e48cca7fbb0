// One pair of RoPE channels: which channels share a frequency, their rotation, and generation's store of a new
// position's pair of q, k or v (kernels/rope.cu's rope_store_new_positions, and the q, k, v product that does
// the same in its own launch, kernels/gemv.cu's gemv_rope_store), so that both give the same bits.
#ifndef GPT2_CUPY_ROPE_PAIR_CUH
#define GPT2_CUPY_ROPE_PAIR_CUH

#include "storage.cuh"

// The channels of frequency i in a head of D: (i, i + D/2) for rotate_half, (2i, 2i + 1) interleaved.
__device__ __forceinline__ int2 pair_channels(int i, int D, int interleaved)
{
    int first = interleaved ? 2 * i : i;
    return make_int2(first, first + (interleaved ? 1 : D / 2));
}

// The pair (a, b) turned by position * inv_freq (sign -1: backwards), in float32.
__device__ __forceinline__ float2 rotated(float a, float b, int position, float inv_freq, float sign)
{
    float angle = (float)position * inv_freq;
    float sine = sign * sinf(angle), cosine = cosf(angle);
    return make_float2(a * cosine - b * sine, a * sine + b * cosine);
}

// The pair (a, b), channels pair_channels(i, D, interleaved) of head `head` of q's H, k's H_kv and v's H_kv heads
// side by side, of sequence b's new position t, which sits at `position`: q's and k's turned and rounded once,
// v's copied; q's written head-major into q_out (B, H, n, D), k's and v's into the cache keys, values (B, H_kv,
// capacity, D) at `position` (nothing when the cache cannot hold it).
template <typename floatX>
__device__ __forceinline__ void store_new_position_pair(floatX* q_out, floatX* keys, floatX* values, floatX a,
    floatX b_value, int b, int t, int head, int i, int position, float inv_freq, int n, int H, int H_kv, int D,
    int capacity, int interleaved)
{
    floatX* destination;
    if (head < H) {
        destination = q_out + (((long long)b * H + head) * n + t) * D;
    } else {
        if (position < 0 || position >= capacity) {
            return;
        }
        int kv_head = (head - H) % H_kv;
        destination = (head < H + H_kv ? keys : values) + (((long long)b * H_kv + kv_head) * capacity + position) * D;
    }
    int2 channels = pair_channels(i, D, interleaved);
    if (head < H + H_kv) {
        float2 turned = rotated(to_float(a), to_float(b_value), position, inv_freq, 1.0f);
        destination[channels.x] = from_float<floatX>(turned.x);
        destination[channels.y] = from_float<floatX>(turned.y);
    } else {
        destination[channels.x] = a;
        destination[channels.y] = b_value;
    }
}

#endif
