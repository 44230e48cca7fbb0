// GELU, the activation in GPT-2's MLP, elementwise on float32 arrays: forward y = GELU(x),
// backward dx = dy * GELU'(x). exact = 0 selects GPT-2's tanh approximation, exact = 1 the erf form.
// Every thread of a launch takes the same side of `exact`, so the choice costs no divergence.

#include "storage.cuh"

__device__ __forceinline__ float gelu_tanh(float x)
{
    const float sqrt_2_over_pi = 0.7978845608f;
    const float cubic = 0.044715f;
    float u = sqrt_2_over_pi * (x + cubic * x * x * x);
    return 0.5f * x * (1.0f + tanhf(u));
}

__device__ __forceinline__ float gelu_tanh_derivative(float x)
{
    const float sqrt_2_over_pi = 0.7978845608f;
    const float cubic = 0.044715f;
    float u = sqrt_2_over_pi * (x + cubic * x * x * x);
    float cosh_u = coshf(u);
    // 1 - tanh(u)^2 as 1 / cosh(u)^2: the subtraction would lose every digit where tanh(u) is close to -1 or 1.
    float sech_squared = 1.0f / (cosh_u * cosh_u);
    return 0.5f * (1.0f + tanhf(u)) + 0.5f * x * sech_squared * sqrt_2_over_pi * (1.0f + 3.0f * cubic * x * x);
}

__device__ __forceinline__ float gelu_erf(float x)
{
    // Phi(x) = erfc(-x / sqrt(2)) / 2 keeps its digits for negative x, where 1 + erf(x / sqrt(2)) cancels.
    const float one_over_sqrt_2 = 0.7071067812f;
    return 0.5f * x * erfcf(-one_over_sqrt_2 * x);
}

__device__ __forceinline__ float gelu_erf_derivative(float x)
{
    const float one_over_sqrt_2 = 0.7071067812f;
    const float one_over_sqrt_2_pi = 0.3989422804f;
    return 0.5f * erfcf(-one_over_sqrt_2 * x) + x * one_over_sqrt_2_pi * expf(-0.5f * x * x);
}

__device__ __forceinline__ float gelu(float x, int exact)
{
    return exact ? gelu_erf(x) : gelu_tanh(x);
}

__device__ __forceinline__ float gelu_derivative(float x, int exact)
{
    return exact ? gelu_erf_derivative(x) : gelu_tanh_derivative(x);
}

// One thread per element. floatX is how the arrays are stored (storage.cuh): float, or bf16 for a model
// trained in bf16, whose elements are computed in float and rounded once: gelu_forward<float> or
// gelu_forward<__nv_bfloat16>.
template <typename floatX>
__global__ void gelu_forward(floatX* y, const floatX* x, int n, int exact)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        y[i] = from_float<floatX>(gelu(to_float(x[i]), exact));
    }
}

template <typename floatX>
__global__ void gelu_backward(floatX* dx, const floatX* x, const floatX* dy, int n, int exact)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        dx[i] = from_float<floatX>(to_float(dy[i]) * gelu_derivative(to_float(x[i]), exact));
    }
}

// Four elements per thread, moved by 16-byte loads and stores, so every array must start at an address
// that is a multiple of 16. Thread i owns elements 4i .. 4i+3; the thread just past the last full group
// does the n % 4 elements left over, one at a time. Launch ceil(n / 4) threads.
extern "C" __global__ void gelu_forward_float4(float* y, const float* x, int n, int exact)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int groups = n / 4;
    if (i < groups) {
        float4 in = reinterpret_cast<const float4*>(x)[i];
        float4 out = make_float4(gelu(in.x, exact), gelu(in.y, exact), gelu(in.z, exact), gelu(in.w, exact));
        reinterpret_cast<float4*>(y)[i] = out;
    } else if (i == groups) {
        for (int j = 4 * groups; j < n; ++j) {
            y[j] = gelu(x[j], exact);
        }
    }
}

extern "C" __global__ void gelu_backward_float4(float* dx, const float* x, const float* dy, int n, int exact)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int groups = n / 4;
    if (i < groups) {
        float4 in = reinterpret_cast<const float4*>(x)[i];
        float4 gradient = reinterpret_cast<const float4*>(dy)[i];
        float4 out = make_float4(gradient.x * gelu_derivative(in.x, exact), gradient.y * gelu_derivative(in.y, exact),
                                 gradient.z * gelu_derivative(in.z, exact), gradient.w * gelu_derivative(in.w, exact));
        reinterpret_cast<float4*>(dx)[i] = out;
    } else if (i == groups) {
        for (int j = 4 * groups; j < n; ++j) {
            dx[j] = dy[j] * gelu_derivative(x[j], exact);
        }
    }
}

// Eight bf16 per thread, moved by one 16-byte load and store (storage.cuh's groups), so every array must
// start at an address that is a multiple of 16: a bf16 model's activations, where one element per thread
// would move 2 bytes per instruction. Thread i owns elements 8i .. 8i+7; the thread just past the last
// full group does the n % 8 elements left over. Launch ceil(n / 8) threads. The same bits as
// gelu_forward<__nv_bfloat16>: each element computed in float and rounded once.
constexpr int BF16_GROUP = 8;

extern "C" __global__ void gelu_forward_bf16x8(__nv_bfloat16* y, const __nv_bfloat16* x, int n, int exact)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int groups = n / BF16_GROUP;
    if (i < groups) {
        float values[BF16_GROUP];
        load_as_float<BF16_GROUP>(values, x + BF16_GROUP * i, true);
        for (int w = 0; w < BF16_GROUP; ++w) {
            values[w] = gelu(values[w], exact);
        }
        store_from_float<BF16_GROUP>(y + BF16_GROUP * i, values);
    } else if (i == groups) {
        for (int j = BF16_GROUP * groups; j < n; ++j) {
            y[j] = __float2bfloat16_rn(gelu(__bfloat162float(x[j]), exact));
        }
    }
}

extern "C" __global__ void gelu_backward_bf16x8(__nv_bfloat16* dx, const __nv_bfloat16* x, const __nv_bfloat16* dy,
                                                int n, int exact)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int groups = n / BF16_GROUP;
    if (i < groups) {
        float values[BF16_GROUP], gradients[BF16_GROUP];
        load_as_float<BF16_GROUP>(values, x + BF16_GROUP * i, true);
        load_as_float<BF16_GROUP>(gradients, dy + BF16_GROUP * i, true);
        for (int w = 0; w < BF16_GROUP; ++w) {
            values[w] = gradients[w] * gelu_derivative(values[w], exact);
        }
        store_from_float<BF16_GROUP>(dx + BF16_GROUP * i, values);
    } else if (i == groups) {
        for (int j = BF16_GROUP * groups; j < n; ++j) {
            dx[j] = __float2bfloat16_rn(__bfloat162float(dy[j]) * gelu_derivative(__bfloat162float(x[j]), exact));
        }
    }
}
