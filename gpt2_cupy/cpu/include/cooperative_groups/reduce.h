// CUDA's <cooperative_groups/reduce.h> for the CPU executor: cg::reduce over a tile, with the operators
// cg::plus, cg::less (the minimum), cg::greater (the maximum), cg::bit_and, cg::bit_or, cg::bit_xor.
#pragma once
#include <cooperative_groups.h>

namespace cooperative_groups {

template <class T> struct plus { T operator()(const T& a, const T& b) const { return a + b; } };
template <class T> struct less { T operator()(const T& a, const T& b) const { return b < a ? b : a; } };
template <class T> struct greater { T operator()(const T& a, const T& b) const { return a < b ? b : a; } };
template <class T> struct bit_and { T operator()(const T& a, const T& b) const { return a & b; } };
template <class T> struct bit_or { T operator()(const T& a, const T& b) const { return a | b; } };
template <class T> struct bit_xor { T operator()(const T& a, const T& b) const { return a ^ b; } };

// Every thread of the tile gets op over the tile's values: a butterfly of shfl_xor steps.
template <unsigned int Size, class Parent, class T, class Operator>
__forceinline__ T reduce(const thread_block_tile<Size, Parent>& tile, T value, Operator op) {
    for (unsigned int offset = Size / 2; offset > 0; offset /= 2) value = op(value, tile.shfl_xor(value, offset));
    return value;
}

}  // namespace cooperative_groups
