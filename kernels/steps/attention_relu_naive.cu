// ReLU attention's middle step for the naive path, elementwise over scores of shape (..., T, T):
//   forward:   P = max(scale * S, 0) where key <= query (causal), else 0; S = q kᵀ, not yet scaled;
//   backward:  dS = scale * dP where P > 0, else 0. P > 0 exactly where the key is visible and the score
//              positive, so the saved P is all the backward needs. No row sum is subtracted: unlike
//              softmax, each P_ij depends on S_ij alone, so the Jacobian is diagonal.
extern "C" __global__ void relu_scores_forward(float* p, const float* s, int n, int T, float scale, int causal)
{
    int index = blockIdx.x * blockDim.x + threadIdx.x;
    if (index >= n) return;
    int key = index % T, query = (index / T) % T;
    float score = scale * s[index];
    p[index] = (!causal || key <= query) && score > 0.0f ? score : 0.0f;
}

extern "C" __global__ void relu_scores_backward(float* ds, const float* dp, const float* p, int n, float scale)
{
    int index = blockIdx.x * blockDim.x + threadIdx.x;
    if (index >= n) return;
    ds[index] = p[index] > 0.0f ? scale * dp[index] : 0.0f;
}
