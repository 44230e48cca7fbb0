// out[b, t, c] = wte[ids[b, t], c] + wpe[t, c], one thread per element of out; an id outside [0, V) is
// never used as an address: its row of out is NaN.
#include "special_values.cuh"  // QUIET_NAN

extern "C" __global__ void token_position_forward(float* out, const int* ids, const float* wte, const float* wpe,
                                                  int B, int T, int V, int C)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;  // the element (b T + t) C + c of out
    if (i < B * T * C) {
        int n = i / C;
        int c = i - n * C;
        int t = n % T;
        int id = ids[n];
        out[i] = (0 <= id && id < V) ? wte[id * C + c] + wpe[t * C + c] : QUIET_NAN;
    }
}
