// CUDA's <cooperative_groups.h> for the CPU executor: the thread block and its tiles of 32, 16, 8, 4, 2 or
// 1 threads, with the tiles' warp operations. (Grid-wide sync and coalesced groups are not here.)
#pragma once

namespace cooperative_groups {
namespace details {
__forceinline__ unsigned int block_thread_rank() {
    return (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
}
__forceinline__ unsigned int block_thread_count() { return blockDim.x * blockDim.y * blockDim.z; }
}  // namespace details

class thread_block {
public:
    static void sync() { __syncthreads(); }
    static unsigned int thread_rank() { return details::block_thread_rank(); }
    static unsigned long long size() { return details::block_thread_count(); }
    static unsigned long long num_threads() { return details::block_thread_count(); }
    static dim3 group_index() { return dim3(blockIdx.x, blockIdx.y, blockIdx.z); }
    static dim3 thread_index() { return dim3(threadIdx.x, threadIdx.y, threadIdx.z); }
    static dim3 group_dim() { return dim3(blockDim.x, blockDim.y, blockDim.z); }
    static dim3 dim_threads() { return group_dim(); }
    static bool is_valid() { return true; }
};
__forceinline__ thread_block this_thread_block() { return thread_block(); }

class grid_group {
public:
    static unsigned long long thread_rank() {
        return (unsigned long long)block_rank() * details::block_thread_count() + details::block_thread_rank();
    }
    static unsigned long long block_rank() {
        return ((unsigned long long)blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    }
    static unsigned long long num_blocks() { return (unsigned long long)gridDim.x * gridDim.y * gridDim.z; }
    static unsigned long long num_threads() { return num_blocks() * details::block_thread_count(); }
    static unsigned long long size() { return num_threads(); }
    static dim3 block_index() { return dim3(blockIdx.x, blockIdx.y, blockIdx.z); }
    static dim3 dim_blocks() { return dim3(gridDim.x, gridDim.y, gridDim.z); }
    // Every block of the grid waits here for all the others: on a GPU only in a cooperative launch (CuPy's
    // RawKernel(..., enable_cooperative_groups=True)), whose blocks all run at once. The executor runs a few
    // blocks at a time, so it cannot.
    static void sync() {
        gpt2cupy_unsupported("grid_group::sync() (this_grid().sync()) needs every block of the grid running at "
                             "once, which the CPU executor does not do; split the kernel in two launches at the "
                             "grid-wide barrier");
    }
};
__forceinline__ grid_group this_grid() { return grid_group(); }

// A tile of Size consecutive threads of the block (by thread_rank), inside one warp: its warp operations
// name only the tile's lanes, and read lanes by their rank in the tile.
template <unsigned int Size, class Parent = void>
class thread_block_tile {
    static_assert(Size == 1 || Size == 2 || Size == 4 || Size == 8 || Size == 16 || Size == 32,
                  "a tile has 1, 2, 4, 8, 16 or 32 threads");

public:
    thread_block_tile(unsigned int meta_rank, unsigned int meta_size) : meta_rank_(meta_rank), meta_size_(meta_size) {}
    unsigned int thread_rank() const { return details::block_thread_rank() & (Size - 1); }
    static constexpr unsigned long long size() { return Size; }
    static constexpr unsigned long long num_threads() { return Size; }
    unsigned int meta_group_rank() const { return meta_rank_; }
    unsigned int meta_group_size() const { return meta_size_; }
    // The tile's lanes in its warp.
    unsigned int build_mask() const {
        unsigned int first = details::block_thread_rank() & 31u & ~(Size - 1);
        return Size == 32 ? 0xffffffffu : ((1u << Size) - 1u) << first;
    }
    void sync() const { __syncwarp(build_mask()); }
    template <class T> T shfl(T var, int source_rank) const { return __shfl_sync(build_mask(), var, source_rank, Size); }
    template <class T> T shfl_down(T var, unsigned int delta) const { return __shfl_down_sync(build_mask(), var, delta, Size); }
    template <class T> T shfl_up(T var, unsigned int delta) const { return __shfl_up_sync(build_mask(), var, delta, Size); }
    template <class T> T shfl_xor(T var, unsigned int lane_mask) const { return __shfl_xor_sync(build_mask(), var, lane_mask, Size); }
    // Votes: bit i of a ballot is the tile's thread of rank i.
    unsigned int ballot(int predicate) const {
        unsigned int first = details::block_thread_rank() & 31u & ~(Size - 1);
        return (__ballot_sync(build_mask(), predicate) & build_mask()) >> first;
    }
    int any(int predicate) const { return ballot(predicate) != 0; }
    int all(int predicate) const { return __all_sync(build_mask(), predicate); }
    template <class T> unsigned int match_any(T value) const {
        unsigned int first = details::block_thread_rank() & 31u & ~(Size - 1);
        return __match_any_sync(build_mask(), value) >> first;
    }
    template <class T> unsigned int match_all(T value, int& predicate) const {
        unsigned int first = details::block_thread_rank() & 31u & ~(Size - 1);
        return __match_all_sync(build_mask(), value, &predicate) >> first;
    }
    bool is_valid() const { return true; }

private:
    unsigned int meta_rank_;
    unsigned int meta_size_;
};
template <unsigned int Size>
__forceinline__ thread_block_tile<Size, void> tiled_partition(const thread_block&) {
    unsigned int threads = details::block_thread_count();
    return thread_block_tile<Size, void>(details::block_thread_rank() / Size, (threads + Size - 1) / Size);
}
// A tile of a tile: its rank and count among the parent tile's sub-tiles.
template <unsigned int Size, unsigned int ParentSize, class Grandparent>
__forceinline__ thread_block_tile<Size, void> tiled_partition(const thread_block_tile<ParentSize, Grandparent>&) {
    static_assert(Size <= ParentSize, "a tile of a tile is no larger than its parent");
    return thread_block_tile<Size, void>((details::block_thread_rank() & (ParentSize - 1)) / Size, ParentSize / Size);
}

template <class Group> __forceinline__ void sync(const Group& group) { group.sync(); }

}  // namespace cooperative_groups
