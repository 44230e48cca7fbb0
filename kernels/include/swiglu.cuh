// SwiGLU, Llama's gated activation, on one element: silu(gate) * up, silu(g) = g * sigmoid(g), and its two
// gradients. Shared by kernels/swiglu.cu (the elementwise kernels) and kernels/gemv.cu (SwiGLU joined to the
// gate and up products in generation), so that both compute the same bits.
#ifndef GPT2_CUPY_SWIGLU_CUH
#define GPT2_CUPY_SWIGLU_CUH

__device__ __forceinline__ float sigmoid(float g)
{
    return 1.0f / (1.0f + expf(-g));  // expf(-g) = inf for g < -88: sigmoid 0, as it should be
}

__device__ __forceinline__ float swiglu(float g, float u)
{
    return g * sigmoid(g) * u;
}

__device__ __forceinline__ void swiglu_gradients(float* dgate, float* dup, float d, float g, float u)
{
    float s = sigmoid(g);
    *dgate = d * u * s * (1.0f + g * (1.0f - s));
    *dup = d * g * s;
}

#endif
