// CUDA's <cooperative_groups/reduce.h> for the CPU executor: cg::reduce over a tile (of up to 32 threads or
// of several warps) or a coalesced group, with the operators cg::plus, cg::less (the minimum), cg::greater
// (the maximum), cg::bit_and, cg::bit_or, cg::bit_xor. Every thread of the group gets the result.
#pragma once
#include <cooperative_groups.h>

namespace cooperative_groups {

template <class T> struct plus { T operator()(const T& a, const T& b) const { return a + b; } };
template <class T> struct less { T operator()(const T& a, const T& b) const { return b < a ? b : a; } };
template <class T> struct greater { T operator()(const T& a, const T& b) const { return a < b ? b : a; } };
template <class T> struct bit_and { T operator()(const T& a, const T& b) const { return a & b; } };
template <class T> struct bit_or { T operator()(const T& a, const T& b) const { return a | b; } };
template <class T> struct bit_xor { T operator()(const T& a, const T& b) const { return a ^ b; } };

// A butterfly of shfl_xor steps.
template <unsigned int Size, class T, class Operator>
__forceinline__ T reduce(const details::warp_tile<Size>& tile, T value, Operator op) {
    for (unsigned int offset = Size / 2; offset > 0; offset /= 2) value = op(value, tile.shfl_xor(value, offset));
    return value;
}

// Each warp reduces its own values, then every thread combines the warps' results, in warp order.
template <unsigned int Size, class T, class Operator>
__forceinline__ T reduce(const details::multi_warp_tile<Size>& tile, T value, Operator op) {
    static_assert(sizeof(T) <= 8, "the executor reduces values of up to 8 bytes over a tile of several warps");
    for (unsigned int offset = 16; offset > 0; offset /= 2) value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
    details::multi_warp_exchange& exchange = tile.exchange();
    tile.sync();  // every thread has read the previous reduce's results
    if (details::lane() == 0)
        __atomic_store_n(&exchange.warp_results[tile.thread_rank() / 32], gpt2cupy_to_slot(value), __ATOMIC_RELAXED);
    tile.sync();
    T result;
    for (unsigned int warp = 0; warp < Size / 32; ++warp) {
        unsigned long long slot = __atomic_load_n(&exchange.warp_results[warp], __ATOMIC_RELAXED);
        T warp_result;
        __builtin_memcpy(&warp_result, &slot, sizeof(T));
        result = warp == 0 ? warp_result : op(result, warp_result);
    }
    return result;
}

// The group's values, combined from its lowest lane up.
template <class T, class Operator>
__forceinline__ T reduce(const coalesced_group& group, T value, Operator op) {
    T result = value;
    for (unsigned int rank = 0; rank < group.size(); ++rank) {
        T other = group.shfl(value, rank);
        result = rank == 0 ? other : op(result, other);
    }
    return result;
}

}  // namespace cooperative_groups
