// Where a (B, heads, T, d) tensor of attention heads lies in the array that holds it: head h of batch element b
// starts at element offset + b batch + h head, its T rows are `row` elements apart, and each row's d elements
// are contiguous. A kernel given this (and the holding array) reads heads where they lie: q, k and v cut by
// split and transpose from one (B, T, 3 H d) product's output (batch = 3 T H d, head = d, row = 3 H d), out
// written with its heads side by side as (B, T, H d) for the next product, or a plain (B, heads, T, d) array
// (batch = heads T d, head = T d, row = d). PyTorch's flash attention takes its tensors the same way.
#ifndef GPT2_CUPY_HEAD_LAYOUT_CUH
#define GPT2_CUPY_HEAD_LAYOUT_CUH

struct HeadLayout {
    long long offset, batch, head, row;

    // The first element of head number `index` (b heads + h).
    __device__ __forceinline__ long long start(long long index, int heads) const
    {
        return offset + index / heads * batch + index % heads * head;
    }
};

#endif
