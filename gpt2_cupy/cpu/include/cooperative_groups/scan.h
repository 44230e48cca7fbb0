// CUDA's <cooperative_groups/scan.h> for the CPU executor: prefix sums (or any associative operator) over
// a tile. inclusive_scan gives thread k the combination of ranks 0..k; exclusive_scan that of ranks 0..k-1.
#pragma once
#include <cooperative_groups/reduce.h>

namespace cooperative_groups {

// Hillis and Steele's scan: log2(Size) steps, each combining with the value `offset` ranks below.
template <unsigned int Size, class Parent, class T, class Operator>
__forceinline__ T inclusive_scan(const thread_block_tile<Size, Parent>& tile, T value, Operator op) {
    unsigned int rank = tile.thread_rank();
    for (unsigned int offset = 1; offset < Size; offset *= 2) {
        T below = tile.shfl_up(value, offset);
        if (rank >= offset) value = op(below, value);
    }
    return value;
}
template <unsigned int Size, class Parent, class T>
__forceinline__ T inclusive_scan(const thread_block_tile<Size, Parent>& tile, T value) {
    return inclusive_scan(tile, value, plus<T>());
}
// Rank 0 combines nothing: it gets T() (0 for numbers).
template <unsigned int Size, class Parent, class T, class Operator>
__forceinline__ T exclusive_scan(const thread_block_tile<Size, Parent>& tile, T value, Operator op) {
    T inclusive = inclusive_scan(tile, value, op);
    T below = tile.shfl_up(inclusive, 1);
    return tile.thread_rank() == 0 ? T() : below;
}
template <unsigned int Size, class Parent, class T>
__forceinline__ T exclusive_scan(const thread_block_tile<Size, Parent>& tile, T value) {
    return exclusive_scan(tile, value, plus<T>());
}

}  // namespace cooperative_groups
