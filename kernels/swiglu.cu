// SwiGLU, the gated activation of Llama's MLP, elementwise on the two projections gate and up:
//   forward:  y = silu(gate) * up,  silu(g) = g * sigmoid(g);
//   backward: with s = sigmoid(gate),
//             dgate = dout * up * s * (1 + gate * (1 - s)),   dup = dout * gate * s.
// Fused: one read of gate and up, one write of y, where silu then a multiply would write and read silu(gate)
// once more. The _float4 versions move four elements per load (arrays 16-byte aligned); n counts floats.
// swiglu_forward_stored<floatX> takes bf16 too (generation in bf16): computed in float32, rounded once; its
// gate and up may be rows of `columns` elements, row_stride apart, starting gate_offset and up_offset
// elements into the arrays passed (the two halves of one product's output).
#include "storage.cuh"
#include "swiglu.cuh"

extern "C" __global__ void swiglu_forward(float* y, const float* gate, const float* up, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        y[i] = swiglu(gate[i], up[i]);
    }
}

extern "C" __global__ void swiglu_forward_float4(float* y, const float* gate, const float* up, int n)
{
    int i = 4 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (i + 3 < n) {
        float4 g = *(const float4*)(gate + i), u = *(const float4*)(up + i);
        *(float4*)(y + i) = make_float4(swiglu(g.x, u.x), swiglu(g.y, u.y), swiglu(g.z, u.z), swiglu(g.w, u.w));
    } else {
        for (; i < n; ++i) {  // the last, incomplete group of four
            y[i] = swiglu(gate[i], up[i]);
        }
    }
}

template <typename floatX>
__global__ void swiglu_forward_stored(floatX* y, const floatX* gate, const floatX* up, int n, int columns,
                                      long long row_stride, long long gate_offset, long long up_offset)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        long long at = i / columns * row_stride + i % columns;
        y[i] = from_float<floatX>(swiglu(to_float(gate[gate_offset + at]), to_float(up[up_offset + at])));
    }
}

extern "C" __global__ void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate,
                                           const float* up, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        swiglu_gradients(dgate + i, dup + i, dout[i], gate[i], up[i]);
    }
}

extern "C" __global__ void swiglu_backward_float4(float* dgate, float* dup, const float* dout, const float* gate,
                                                  const float* up, int n)
{
    int i = 4 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (i + 3 < n) {
        float4 d = *(const float4*)(dout + i), g = *(const float4*)(gate + i), u = *(const float4*)(up + i);
        float4 dg, du;
        swiglu_gradients(&dg.x, &du.x, d.x, g.x, u.x);
        swiglu_gradients(&dg.y, &du.y, d.y, g.y, u.y);
        swiglu_gradients(&dg.z, &du.z, d.z, g.z, u.z);
        swiglu_gradients(&dg.w, &du.w, d.w, g.w, u.w);
        *(float4*)(dgate + i) = dg;
        *(float4*)(dup + i) = du;
    } else {
        for (; i < n; ++i) {
            swiglu_gradients(dgate + i, dup + i, dout[i], gate[i], up[i]);
        }
    }
}
