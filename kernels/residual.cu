// The residual add of a GPT-2 block, out = a + b, elementwise on float32 arrays. One kernel serves both
// directions: forward, out = x + branch; backward, at the fork where x was used twice, dx = dout + dx_branch.
// The pointers are not __restrict__: out may be a or b itself (an in-place sum), which is safe because
// each thread reads its own elements before it writes them.

// One thread per element.
extern "C" __global__ void residual_add(float* out, const float* a, const float* b, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = a[i] + b[i];
    }
}

// Four elements per thread through 16-byte loads and stores (16-byte aligned arrays); the thread just
// past the last full group adds the n % 4 elements left over. Launch ceil(n / 4) threads.
extern "C" __global__ void residual_add_float4(float* out, const float* a, const float* b, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int groups = n / 4;
    if (i < groups) {
        float4 p = reinterpret_cast<const float4*>(a)[i];
        float4 q = reinterpret_cast<const float4*>(b)[i];
        reinterpret_cast<float4*>(out)[i] = make_float4(p.x + q.x, p.y + q.y, p.z + q.z, p.w + q.w);
    } else if (i == groups) {
        for (int j = 4 * groups; j < n; ++j) {
            out[j] = a[j] + b[j];
        }
    }
}
