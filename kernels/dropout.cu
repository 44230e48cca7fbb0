// Inverted dropout with the Philox4x32-10 counter-based random number generator (Salmon, Moraes, Dror,
// Shaw, "Parallel random numbers: as easy as 1, 2, 3", SC'11), written out here: no cuRAND, no state.
//
// Element i of a launch gets the random number
//     philox4x32_10(counter = (i / 4, 0, offset_low, offset_high), key = (seed_low, seed_high))[i % 4],
// a pure function of (seed, offset, i): the same on the CPU executor and on every GPU, whatever the grid.
// The backward recomputes the mask from the same (seed, offset) instead of storing it.
// rng_state is a device array of two uint64, (seed, offset), read by the kernels from memory, so that a new
// offset every step costs no kernel argument and no host-to-device copy.

#include "storage.cuh"

#define PHILOX_M0 0xD2511F53u  // the two round multipliers
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u  // the key increments (the golden ratio, and sqrt(3) - 1, as 32-bit fractions)
#define PHILOX_W1 0xBB67AE85u

// Ten rounds on the 128-bit counter c[0..3] in place. A round multiplies two words by constants and keeps
// both halves of each 64-bit product; the high halves are mixed with the other words and the key.
__device__ __forceinline__ void philox4x32_10(unsigned int c[4], unsigned int key0, unsigned int key1)
{
    for (int round = 0; round < 10; ++round) {
        unsigned long long product0 = (unsigned long long)PHILOX_M0 * c[0];
        unsigned long long product1 = (unsigned long long)PHILOX_M1 * c[2];
        unsigned int high0 = (unsigned int)(product0 >> 32), low0 = (unsigned int)product0;
        unsigned int high1 = (unsigned int)(product1 >> 32), low1 = (unsigned int)product1;
        c[0] = high1 ^ c[1] ^ key0;
        c[1] = low1;
        c[2] = high0 ^ c[3] ^ key1;
        c[3] = low0;
        key0 += PHILOX_W0;  // the key schedule: the next round uses key + W
        key1 += PHILOX_W1;
    }
}

// Raw Philox blocks for checking against published vectors: out[4k..4k+3] = philox(counters[4k..], keys[2k..]).
extern "C" __global__ void philox4x32_10_blocks(unsigned int* out, const unsigned int* counters,
                                                const unsigned int* keys, int count)
{
    int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= count) {
        return;
    }
    unsigned int c[4] = {counters[4 * k], counters[4 * k + 1], counters[4 * k + 2], counters[4 * k + 3]};
    philox4x32_10(c, keys[2 * k], keys[2 * k + 1]);
    for (int word = 0; word < 4; ++word) {
        out[4 * k + word] = c[word];
    }
}

// The four random numbers of elements 4 * group .. 4 * group + 3, as floats uniform on [0, 1): the top
// 24 bits of each word times 2^-24, every value exact in float32.
__device__ __forceinline__ void dropout_uniforms(float u[4], const unsigned long long* rng_state, int group)
{
    unsigned long long seed = rng_state[0], offset = rng_state[1];
    unsigned int c[4] = {(unsigned int)group, 0u, (unsigned int)offset, (unsigned int)(offset >> 32)};
    philox4x32_10(c, (unsigned int)seed, (unsigned int)(seed >> 32));
    for (int word = 0; word < 4; ++word) {
        u[word] = (float)(c[word] >> 8) * (1.0f / 16777216.0f);
    }
}

// The uniforms themselves, for the chapter's statistical checks: u[i] for i < n.
extern "C" __global__ void dropout_uniform(float* u, const unsigned long long* rng_state, int n)
{
    int group = blockIdx.x * blockDim.x + threadIdx.x;
    if (4 * group >= n) {
        return;
    }
    float four[4];
    dropout_uniforms(four, rng_state, group);
    for (int word = 0; word < 4 && 4 * group + word < n; ++word) {
        u[4 * group + word] = four[word];
    }
}

// out = x * mask / (1 - p), mask_i = (u_i >= p): element i is dropped with probability p. The backward is
// the same kernel on dout with the same rng_state: dx = dout * mask / (1 - p). One thread per 4 elements,
// one Philox call for all four, loads and stores of 4 elements at once where both arrays are aligned to
// them (float4s: 16 bytes). out may be x. floatX is how x and out are stored (storage.cuh): float, or bf16
// (computed in float, rounded once): dropout_forward<float> or dropout_forward<__nv_bfloat16>.
template <typename floatX>
__global__ void dropout_forward(floatX* out, const floatX* x, const unsigned long long* rng_state, float p, int n)
{
    int group = blockIdx.x * blockDim.x + threadIdx.x;
    int first = 4 * group;
    if (first >= n) {
        return;
    }
    float u[4];
    dropout_uniforms(u, rng_state, group);
    float scale = 1.0f / (1.0f - p);  // infinite for p = 1, but then no element is kept and it is never used
    const unsigned long long group_bytes = 4 * sizeof(floatX);
    bool aligned = ((unsigned long long)out % group_bytes == 0) && ((unsigned long long)x % group_bytes == 0);
    if (aligned && first + 4 <= n) {
        float value[4];
        load_as_float<4>(value, x + first, true);
        for (int word = 0; word < 4; ++word) {
            value[word] = u[word] >= p ? value[word] * scale : 0.0f;
        }
        store_from_float<4>(out + first, value);
    } else {
        for (int word = 0; word < 4 && first + word < n; ++word) {
            out[first + word] = from_float<floatX>(u[word] >= p ? to_float(x[first + word]) * scale : 0.0f);
        }
    }
}

// rng_state[1] += count, on the device: the next dropout gets fresh random numbers without a host copy.
extern "C" __global__ void advance_rng_state(unsigned long long* rng_state, unsigned long long count)
{
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        rng_state[1] += count;
    }
}
