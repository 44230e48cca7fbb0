// dweight[v, c] = the sum of dout[n, c] over the positions n of id v, in the order grouped lists them:
// group v is grouped[starts[v] .. starts[v + 1]). Block (i, v) takes id v and columns 128 i .. 128 i + 127,
// a thread per column; each element of dweight has one writer and a fixed order of additions.
extern "C" __global__ void embedding_backward_grouped(float* dweight, const float* dout, const int* grouped,
                                                      const int* starts, int V, int C)
{
    int v = blockIdx.y;
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c < C) {
        float sum = 0.0f;
        for (int k = starts[v]; k < starts[v + 1]; ++k) {
            sum += dout[grouped[k] * C + c];
        }
        dweight[v * C + c] = sum;
    }
}
