#define BYTE_VALUES 256

// How often each byte value occurs in n bytes of UTF-8 text, stored four to an int (byte k of a word is
// (word >> 8k) & 255, little-endian). Each block counts its share in shared memory, where the atomics are
// cheap, and adds its 256 counts to the global ones once.
extern "C" __global__ void byte_histogram(int* counts, const int* words, int n)
{
    __shared__ int block_counts[BYTE_VALUES];
    block_counts[threadIdx.x] = 0;
    __syncthreads();
    for (int byte = blockIdx.x * blockDim.x + threadIdx.x; byte < n; byte += gridDim.x * blockDim.x) {
        int value = ((unsigned int)words[byte / 4] >> (8 * (byte % 4))) & 255;
        atomicAdd(&block_counts[value], 1);
    }
    __syncthreads();
    atomicAdd(&counts[threadIdx.x], block_counts[threadIdx.x]);   // one thread per byte value
}
