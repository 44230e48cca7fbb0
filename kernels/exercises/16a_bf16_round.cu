// x rounded to the nearest bf16, ties to even: out[i] holds the 16 bits. Add 0x7FFF plus the lowest bit
// that is kept, then keep the top 16 bits; a NaN keeps its top bits with the quiet bit set.
extern "C" __global__ void float_to_bf16(int* out, const float* x, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        unsigned bits = __float_as_uint(x[i]);
        bool nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
        unsigned rounded = nan ? (bits | 0x400000u) >> 16 : (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
        out[i] = (int)rounded;
    }
}
