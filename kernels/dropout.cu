// Inverted dropout with the Philox4x32-10 counter-based random number generator (philox.cuh): no cuRAND,
// no state. Element i of a launch gets the random number of element i of the stream (seed, offset), a pure
// function of (seed, offset, i): the backward recomputes the mask from the same (seed, offset) instead of
// storing it.
// rng_state is a device array of two uint64, (seed, offset), read by the kernels from memory, so that a new
// offset every step costs no kernel argument and no host-to-device copy.

#include "philox.cuh"
#include "storage.cuh"

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

// The uniforms themselves, for the chapter's statistical checks: u[i] for i < n.
extern "C" __global__ void dropout_uniform(float* u, const unsigned long long* rng_state, int n)
{
    int group = blockIdx.x * blockDim.x + threadIdx.x;
    if (4 * group >= n) {
        return;
    }
    float four[4];
    philox_uniforms(four, rng_state[0], rng_state[1], group);
    for (int word = 0; word < 4 && 4 * group + word < n; ++word) {
        u[4 * group + word] = four[word];
    }
}

// out = x * mask / (1 - p), mask_i = (u_i >= p): element i is dropped with probability p. The backward is
// the same kernel on dout with the same rng_state: dx = dout * mask / (1 - p). One thread per 4 elements,
// one Philox call for all four, loads and stores of 4 elements at once where both arrays are aligned to
// them (float4s: 16 bytes). out may be x. floatX is how x and out are stored (storage.cuh): float, or bf16
// (computed in float, rounded once): dropout_forward<float> or dropout_forward<__nv_bfloat16>.
// start is the stream index of x's element 0: 0 for a whole batch; under data parallelism, rank r's rows
// start where they lie in the global batch, so that N ranks draw the numbers one process draws for them all.
template <typename floatX>
__global__ void dropout_forward(floatX* out, const floatX* x, const unsigned long long* rng_state, float p, int n,
                                unsigned long long start)
{
    int group = blockIdx.x * blockDim.x + threadIdx.x;
    int first = 4 * group;
    if (first >= n) {
        return;
    }
    float u[4];
    if (start % 4 == 0) {   // the four elements are one group of the stream: one Philox call
        philox_uniforms(u, rng_state[0], rng_state[1], start / 4 + group);
    } else {                // they straddle two groups: a call for each element
        for (int word = 0; word < 4; ++word) {
            u[word] = philox_uniform(rng_state[0], rng_state[1], start + first + word);
        }
    }
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
