// The optimizer's kernels, over ONE flat float32 buffer of all parameters and one of all gradients
// (every parameter a view into them). Parameter groups are consecutive stretches of the buffers:
// group g covers the elements [group_ends[g - 1], group_ends[g]). Every stretch starts at a multiple of
// 16 elements (the optimizer pads), so float4 loads and stores are always aligned and never straddle two
// groups. The hyperparameters are read from device memory, never passed as arguments, so that a launch
// can be recorded once in a CUDA graph and replayed while the learning rate changes:
//   hyperparameters: (groups, HYPERPARAMETERS) float64, written from the host when a group's value changes
//   step_scalars:    (groups, 2) float32, written on the device by adamw_prepare_step every step
// Under bf16 autocast the products read each weight in bf16. adamw_update can write that working copy
// itself, bf16 of every updated master, while the master is still in registers: the step's one pass over
// the parameters then serves both, where a separate conversion would read every master again each step.

#define HYPERPARAMETERS 5   // per group: learning rate, beta1, beta2, eps, weight decay (SGD: lr, momentum, weight decay)
#define NORM_THREADS 256

#include "storage.cuh"
#include "warp.cuh"

__device__ __forceinline__ int group_of(int element, const int* group_ends, int groups)
{
    int g = 0;
    while (g < groups - 1 && element >= group_ends[g]) {  // a handful of groups: a short loop, from L1
        ++g;
    }
    return g;
}

// Once per step, one thread: t += 1, then per group the two numbers the bias corrections give, in float64:
// step_size = lr / (1 - beta1^t) and sqrt(1 - beta2^t).
extern "C" __global__ void adamw_prepare_step(float* step_scalars, int* step, const double* hyperparameters,
                                              int groups)
{
    int t = step[0] + 1;
    step[0] = t;
    for (int g = 0; g < groups; ++g) {
        const double* h = hyperparameters + g * HYPERPARAMETERS;
        double bias_correction1 = 1.0 - pow(h[1], (double)t);
        double bias_correction2 = 1.0 - pow(h[2], (double)t);
        step_scalars[2 * g] = (float)(h[0] / bias_correction1);
        step_scalars[2 * g + 1] = (float)sqrt(bias_correction2);
    }
}

__device__ __forceinline__ void adamw_one(float& theta, float& m, float& v, float g, float decay, float beta1,
                                          float beta2, float eps, float step_size, float bias_correction2_sqrt)
{
    theta -= decay * theta;                               // decoupled weight decay: lr * lambda * theta
    m = beta1 * m + (1.0f - beta1) * g;                   // first moment
    v = beta2 * v + (1.0f - beta2) * g * g;               // second moment
    float denominator = sqrtf(v) / bias_correction2_sqrt + eps;   // eps outside the square root
    theta -= step_size * m / denominator;
}

// AdamW as torch.optim.AdamW defines it, four elements per step of a grid-stride loop; n is a multiple
// of 4. params_bf16: null, or the bf16 working copy, written with bf16 of each updated master (rounded to
// nearest even, as every conversion to bf16 is).
extern "C" __global__ void adamw_update(float* params, __nv_bfloat16* params_bf16, float* m, float* v,
                                        const float* grads, const double* hyperparameters,
                                        const float* step_scalars, const int* group_ends, int groups, int n)
{
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; 4 * i < n; i += gridDim.x * blockDim.x) {
        int g = group_of(4 * i, group_ends, groups);
        const double* h = hyperparameters + g * HYPERPARAMETERS;
        float decay = (float)(h[0] * h[4]);
        float beta1 = (float)h[1], beta2 = (float)h[2], eps = (float)h[3];
        float step_size = step_scalars[2 * g], bias_correction2_sqrt = step_scalars[2 * g + 1];
        float theta[4], m4[4], v4[4], g4[4];
        load_group<4>(theta, params + 4 * i, true);   // four independent 16-byte loads in flight
        load_group<4>(g4, grads + 4 * i, true);
        load_group<4>(m4, m + 4 * i, true);
        load_group<4>(v4, v + 4 * i, true);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            adamw_one(theta[k], m4[k], v4[k], g4[k], decay, beta1, beta2, eps, step_size, bias_correction2_sqrt);
        }
        store_group<4>(params + 4 * i, theta);
        store_group<4>(m + 4 * i, m4);
        store_group<4>(v + 4 * i, v4);
        if (params_bf16 != nullptr) {
            store_from_float<4>(params_bf16 + 4 * i, theta);
        }
    }
}

__device__ __forceinline__ void sgd_one(float& theta, float& buffer, float g, float lr, float momentum,
                                        float weight_decay)
{
    g += weight_decay * theta;           // SGD's weight decay is L2: added to the gradient
    buffer = momentum * buffer + g;      // the first step gives buffer = g, as torch's clone does
    theta -= lr * buffer;
}

// SGD with momentum as torch.optim.SGD (no dampening, no Nesterov), four elements per thread.
extern "C" __global__ void sgd_update(float* params, float* momentum_buffer, const float* grads,
                                      const double* hyperparameters, const int* group_ends, int groups, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (4 * i >= n) {
        return;
    }
    const double* h = hyperparameters + group_of(4 * i, group_ends, groups) * HYPERPARAMETERS;
    float lr = (float)h[0], momentum = (float)h[1], weight_decay = (float)h[2];
    float4 theta4 = reinterpret_cast<float4*>(params)[i];
    float4 g4 = reinterpret_cast<const float4*>(grads)[i];
    float4 b4 = reinterpret_cast<float4*>(momentum_buffer)[i];
    sgd_one(theta4.x, b4.x, g4.x, lr, momentum, weight_decay);
    sgd_one(theta4.y, b4.y, g4.y, lr, momentum, weight_decay);
    sgd_one(theta4.z, b4.z, g4.z, lr, momentum, weight_decay);
    sgd_one(theta4.w, b4.w, g4.w, lr, momentum, weight_decay);
    reinterpret_cast<float4*>(params)[i] = theta4;
    reinterpret_cast<float4*>(momentum_buffer)[i] = b4;
}

// The global gradient norm, first half: each block sums the squares of its grid-stride share of the
// gradients (n a multiple of 4) into partial_sums[block]. Same grid, same order, same bits every run.
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
gradient_norm_partial_sums(float* partial_sums, const float* grads, int n)
{
    float sum = 0.0f;
    for (int i = blockIdx.x * NORM_THREADS + threadIdx.x; 4 * i < n; i += gridDim.x * NORM_THREADS) {
        float4 g = reinterpret_cast<const float4*>(grads)[i];
        sum += g.x * g.x + g.y * g.y + g.z * g.z + g.w * g.w;
    }
    float total = block_sum(sum);
    if (threadIdx.x == 0) {
        partial_sums[blockIdx.x] = total;
    }
}

// Second half, one block: norm = sqrt(sum of the partial sums), in a fixed order.
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
gradient_norm_finish(float* norm, const float* partial_sums, int blocks)
{
    float sum = 0.0f;
    for (int b = threadIdx.x; b < blocks; b += NORM_THREADS) {
        sum += partial_sums[b];
    }
    float total = block_sum(sum);
    if (threadIdx.x == 0) {
        norm[0] = sqrtf(total);
    }
}

// Clipping as torch.nn.utils.clip_grad_norm_: grads *= min(1, max_norm / (norm + 1e-6)), the norm read
// from device memory. When the factor is 1 the gradients are left as they are, without a pass over them.
extern "C" __global__ void clip_gradients(float* grads, const float* norm, float max_norm, int n)
{
    float scale = fminf(1.0f, max_norm / (norm[0] + 1e-6f));
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (scale == 1.0f || 4 * i >= n) {
        return;
    }
    float4 g = reinterpret_cast<float4*>(grads)[i];
    reinterpret_cast<float4*>(grads)[i] = make_float4(g.x * scale, g.y * scale, g.z * scale, g.w * scale);
}
