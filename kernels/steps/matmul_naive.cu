// One thread per element of C (M x N) = A (M x K) @ B (K x N), all row-major float32.
// threadIdx.x runs along a row of C: the 32 threads of a warp read 32 neighbouring floats of B
// and write 32 neighbouring floats of C, one 128-byte transaction each (coalesced).
extern "C" __global__ void matmul_naive(float* C, const float* A, const float* B, int M, int N, int K)
{
    int col = blockIdx.x * blockDim.x + threadIdx.x;
    int row = blockIdx.y * blockDim.y + threadIdx.y;
    if (row < M && col < N) {
        float sum = 0.0f;
        for (int k = 0; k < K; ++k) {
            sum += A[row * K + k] * B[k * N + col];
        }
        C[row * N + col] = sum;
    }
}

// The same arithmetic with the roles of x and y swapped: threadIdx.x now runs down a column of C,
// so the 32 threads of a warp read 32 floats of A that lie K floats apart (32 transactions instead
// of one) and write C with a stride of N floats.
extern "C" __global__ void matmul_naive_uncoalesced(float* C, const float* A, const float* B, int M, int N, int K)
{
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    int col = blockIdx.y * blockDim.y + threadIdx.y;
    if (row < M && col < N) {
        float sum = 0.0f;
        for (int k = 0; k < K; ++k) {
            sum += A[row * K + k] * B[k * N + col];
        }
        C[row * N + col] = sum;
    }
}
