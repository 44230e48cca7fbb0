// How often each token id occurs: one thread per token of the text, each adding 1 to its id's counter.
// Many threads add to the same counter, so the addition must be atomic.
extern "C" __global__ void token_counts(int* counts, const int* ids, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        atomicAdd(&counts[ids[i]], 1);
    }
}
