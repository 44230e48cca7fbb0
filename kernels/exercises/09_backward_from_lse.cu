// Cross-entropy's backward from the forward's lse, one warp per row:
//     dlogits[i, j] = (exp(logits[i, j] - lse[i]) - (j == target_i)) * scale,  0 on an ignored row,
// scale = dout / (rows counted). Lane l writes elements l, l + 32, ...: each store of the warp is 32
// neighbouring floats.
extern "C" __global__ void cross_entropy_backward_warp(float* dlogits, const float* logits, const int* targets,
                                                       const float* lse, float scale, int N, int V,
                                                       int ignore_index)
{
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= N) {
        return;
    }
    int target = targets[row];
    float row_lse = lse[row];
    for (int j = lane; j < V; j += 32) {
        long long i = (long long)row * V + j;
        dlogits[i] = target == ignore_index ? 0.0f : (expf(logits[i] - row_lse) - (j == target ? 1.0f : 0.0f)) * scale;
    }
}
