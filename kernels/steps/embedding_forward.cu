// The lookup, one thread per element of the output: out[n, c] = weight[ids[n], c]. Neighbouring threads
// copy neighbouring columns of one row, so a warp's 32 loads and 32 stores are each one 128-byte line.
// An id outside [0, V) is never used as an address: its row of out becomes NaN.
#include "special_values.cuh"

extern "C" __global__ void embedding_forward_one_thread_per_element(float* out, const int* ids,
                                                                    const float* weight, int N, int V, int C)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;  // the element n * C + c of out
    if (i >= N * C) {
        return;
    }
    int n = i / C;
    int c = i - n * C;
    int id = ids[n];
    out[i] = (0 <= id && id < V) ? weight[id * C + c] : QUIET_NAN;
}
