// Philox4x32-10, the counter-based random number generator (Salmon, Moraes, Dror, Shaw, "Parallel random
// numbers: as easy as 1, 2, 3", SC'11), and the uniform numbers dropout draws from it: one home for every
// kernel that drops elements (dropout.cu, and the attention weights in attention.cu).
//
// Element i of a stream (seed, offset) gets the random number
//     philox4x32_10(counter = (i / 4 low, i / 4 high, offset_low, offset_high), key = (seed_low, seed_high))[i % 4],
// a pure function of (seed, offset, i): the same on the CPU executor and on every GPU, whatever the grid, so
// a backward recomputes a forward's mask from the same (seed, offset) instead of storing it.
#ifndef GPT2_CUPY_PHILOX_CUH
#define GPT2_CUPY_PHILOX_CUH

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

// The four random numbers of elements 4 * group .. 4 * group + 3 of the stream (seed, offset), as floats
// uniform on [0, 1): the top 24 bits of each word times 2^-24, every value exact in float32.
__device__ __forceinline__ void philox_uniforms(float u[4], unsigned long long seed, unsigned long long offset,
                                                unsigned long long group)
{
    unsigned int c[4] = {(unsigned int)group, (unsigned int)(group >> 32), (unsigned int)offset,
                         (unsigned int)(offset >> 32)};
    philox4x32_10(c, (unsigned int)seed, (unsigned int)(seed >> 32));
    for (int word = 0; word < 4; ++word) {
        u[word] = (float)(c[word] >> 8) * (1.0f / 16777216.0f);
    }
}

// The random number of element `index` alone: word index % 4 of its group's four (a kernel whose threads
// own scattered elements, as attention's do, computes a whole Philox call per element).
__device__ __forceinline__ float philox_uniform(unsigned long long seed, unsigned long long offset,
                                                unsigned long long index)
{
    float u[4];
    philox_uniforms(u, seed, offset, index / 4);
    int word = (int)(index % 4);
    return word == 0 ? u[0] : word == 1 ? u[1] : word == 2 ? u[2] : u[3];
}

#endif
