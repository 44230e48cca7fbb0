// Three ways to scatter-add the rows of dout into dweight, dweight[ids[n], :] += dout[n, :], that the
// package does not use. ids are assumed to be in [0, V) here.

// Version 0, wrong: one thread per element of dout, a plain +=. Two threads whose rows have the same id
// both read the old value, both add, both write: one of the two additions is lost.
extern "C" __global__ void embedding_backward_racy(float* dweight, const float* dout, const int* ids, int N, int C)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= N * C) {
        return;
    }
    int n = i / C;
    int c = i - n * C;
    dweight[ids[n] * C + c] += dout[i];
}

// Version 1: the same with atomicAdd, which reads, adds and writes as one indivisible step. Every
// addition counts, but in whatever order the threads arrive: float addition is not associative, so the
// last bits of the result can differ from run to run.
extern "C" __global__ void embedding_backward_atomic(float* dweight, const float* dout, const int* ids, int N, int C)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= N * C) {
        return;
    }
    int n = i / C;
    int c = i - n * C;
    atomicAdd(&dweight[ids[n] * C + c], dout[i]);
}

// Version 2: one thread per column c, walking all N rows in order. Thread c is the only one that ever
// writes column c, so there is no race and the order is fixed; but only C threads run (768 for GPT-2,
// under 1 % of the 2048 x 132 threads an H100 holds at once) and each walks all N rows one after another.
extern "C" __global__ void embedding_backward_per_column(float* dweight, const float* dout, const int* ids,
                                                         int N, int C)
{
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) {
        return;
    }
    for (int n = 0; n < N; ++n) {
        dweight[ids[n] * C + c] += dout[n * C + c];
    }
}
