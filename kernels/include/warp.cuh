// Sums and maxima across a warp and across a block, from shuffles. A warp's 32 lanes exchange registers
// with __shfl_xor_sync(mask, value, offset): lane l receives lane l ^ offset's value. Five such steps,
// offsets 16, 8, 4, 2, 1, form a butterfly: afterwards every lane holds the result of all 32, with no
// shared memory and no barrier. Call these from all 32 lanes of a warp.
#ifndef GPT2_CUPY_WARP_CUH
#define GPT2_CUPY_WARP_CUH

#define WARP_SIZE 32
#define FULL_MASK 0xffffffffu

// The maximum over the warp, in every lane.
__device__ __forceinline__ float warp_max(float value)
{
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) {
        value = fmaxf(value, __shfl_xor_sync(FULL_MASK, value, offset));
    }
    return value;
}

// The sum over the warp, in every lane.
__device__ __forceinline__ float warp_sum(float value)
{
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) {
        value += __shfl_xor_sync(FULL_MASK, value, offset);
    }
    return value;
}

// The sum over the block, in every thread (blockDim.x a multiple of 32, at most 1024): each warp sums its
// lanes, then warp 0 sums the warps' results. The order of the additions is fixed, so the bits are the same
// on every run.
__device__ float block_sum(float value)
{
    __shared__ float partials[WARP_SIZE];
    __shared__ float result;
    int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE, warps = blockDim.x / WARP_SIZE;
    value = warp_sum(value);
    if (lane == 0) {
        partials[warp] = value;
    }
    __syncthreads();
    if (warp == 0) {
        float partial = lane < warps ? partials[lane] : 0.0f;
        partial = warp_sum(partial);
        if (lane == 0) {
            result = partial;
        }
    }
    __syncthreads();
    return result;
}

#endif
