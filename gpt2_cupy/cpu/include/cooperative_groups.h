// CUDA's <cooperative_groups.h> for the CPU executor:
//   thread_group       the base class: a function taking a `const thread_group&` takes any group below;
//   thread_block       this_thread_block(), also with a block_tile_memory (which sm_80 and later do not need);
//   thread_block_tile  tiled_partition<N>(block or tile): N = 1 .. 32 with the warp operations, or a tile of
//                      64 .. 1024 threads (several warps) with sync(), shfl(), any() and all();
//   coalesced_group    coalesced_threads(): the lanes of the warp that run this code together; and what
//                      binary_partition, labeled_partition and tiled_partition(group, n) make of a warp's lanes;
//   grid_group         this_grid(): ranks and sizes (sync() needs a cooperative launch the executor does not do).
#pragma once

namespace cooperative_groups {
namespace details {
__forceinline__ unsigned int block_thread_rank() {
    return (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
}
__forceinline__ unsigned int block_thread_count() { return blockDim.x * blockDim.y * blockDim.z; }
__forceinline__ unsigned int lane() { return block_thread_rank() & 31u; }
// The lanes of `lanes` below the caller's: its rank among them.
__forceinline__ unsigned int rank_among(unsigned int lanes) { return __popc(lanes & ((1u << lane()) - 1u)); }
// The lane of rank `rank` among `lanes` (32 when there is none).
__forceinline__ unsigned int lane_of_rank(unsigned int lanes, unsigned int rank) {
    for (unsigned int k = 0; k < rank && lanes != 0; ++k) lanes &= lanes - 1;
    return lanes == 0 ? 32u : (unsigned int)__builtin_ctz(lanes);
}
// A mask of lanes written with bit k for the group's thread of rank k, as a group's ballot gives it.
__forceinline__ unsigned int by_rank(unsigned int lane_bits, unsigned int lanes) {
    unsigned int packed = 0, rank = 0;
    for (; lanes != 0; lanes &= lanes - 1, ++rank)
        if (lane_bits >> __builtin_ctz(lanes) & 1u) packed |= 1u << rank;
    return packed;
}
template <bool Condition, class IfTrue, class IfFalse> struct pick { using type = IfTrue; };
template <class IfTrue, class IfFalse> struct pick<false, IfTrue, IfFalse> { using type = IfFalse; };
}  // namespace details

class thread_block;
class grid_group;
class coalesced_group;
namespace details {
unsigned int lanes_of(const coalesced_group& group);
}

// Any group. It keeps what its operations need, so that one taken by reference to the base still knows
// what it is: a block, a grid, some lanes of one warp (a tile of up to 32 threads or a coalesced group),
// or a tile of several warps.
class thread_group {
protected:
    enum class kind { block, grid, lanes, multi_warp_tile };
    thread_group(kind what, unsigned int lanes, unsigned int tile_size, unsigned int meta_rank, unsigned int meta_size)
        : kind_(what), lanes_(lanes), tile_size_(tile_size), meta_rank_(meta_rank), meta_size_(meta_size) {}
    kind kind_;
    unsigned int lanes_;      // kind::lanes: the group's lanes of the caller's warp
    unsigned int tile_size_;  // kind::multi_warp_tile: its threads
    unsigned int meta_rank_;  // its rank among the groups its parent was split into
    unsigned int meta_size_;  // how many there are
    friend thread_group tiled_partition(const thread_group& parent, unsigned int tile_size);

public:
    unsigned long long size() const {
        switch (kind_) {
            case kind::block: return details::block_thread_count();
            case kind::grid: return (unsigned long long)gridDim.x * gridDim.y * gridDim.z * details::block_thread_count();
            case kind::lanes: return __popc(lanes_);
            default: return tile_size_;
        }
    }
    // CUDA 13's header declares num_threads() on the base class without defining it, so NVRTC refuses a call
    // through a thread_group ("referenced but not defined"); size() is the one to call there.
    unsigned long long num_threads() const = delete;
    unsigned long long thread_rank() const {
        switch (kind_) {
            case kind::block: return details::block_thread_rank();
            case kind::grid:
                return (((unsigned long long)blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x) *
                           details::block_thread_count() + details::block_thread_rank();
            case kind::lanes: return details::rank_among(lanes_);
            default: return details::block_thread_rank() & (tile_size_ - 1);
        }
    }
    inline void sync() const;
    bool is_valid() const { return true; }
};

class thread_block : public thread_group {
    friend thread_block this_thread_block();

protected:
    thread_block() : thread_group(kind::block, 0, 0, 0, 1) {}

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

// Scratch memory through which a GPU before compute capability 8.0 lets the warps of a tile larger than
// a warp talk; the H100 the executor imitates needs none, so this holds nothing.
template <unsigned int MaxBlockSize = 1024>
struct block_tile_memory {
    char unused;
};
template <unsigned int MaxBlockSize>
__forceinline__ thread_block this_thread_block(block_tile_memory<MaxBlockSize>&) { return this_thread_block(); }

class grid_group : public thread_group {
    friend grid_group this_grid();

protected:
    grid_group() : thread_group(kind::grid, 0, 0, 0, 1) {}

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

// Some lanes of one warp, ranked from the lowest lane up. coalesced_threads() gives the lanes that reach
// it together: inside an `if`, those that took the branch.
class coalesced_group : public thread_group {
    friend unsigned int details::lanes_of(const coalesced_group& group);

public:
    explicit coalesced_group(unsigned int lanes, unsigned int meta_rank = 0, unsigned int meta_size = 1)
        : thread_group(kind::lanes, lanes, 0, meta_rank, meta_size) {}
    unsigned long long size() const { return __popc(lanes_); }
    unsigned long long num_threads() const { return size(); }
    unsigned int thread_rank() const { return details::rank_among(lanes_); }
    unsigned int meta_group_rank() const { return meta_rank_; }
    unsigned int meta_group_size() const { return meta_size_; }
    void sync() const { __syncwarp(lanes_); }
    template <class T> T shfl(T var, unsigned int source_rank) const {
        return __shfl_sync(lanes_, var, details::lane_of_rank(lanes_, source_rank));
    }
    // A rank with none `delta` above (below) it gets its own value, as in a tile.
    template <class T> T shfl_down(T var, unsigned int delta) const {
        unsigned int source = details::lane_of_rank(lanes_, thread_rank() + delta);
        return __shfl_sync(lanes_, var, source < 32 ? source : details::lane());
    }
    template <class T> T shfl_up(T var, unsigned int delta) const {
        unsigned int rank = thread_rank();
        return __shfl_sync(lanes_, var, rank >= delta ? details::lane_of_rank(lanes_, rank - delta) : details::lane());
    }
    // Votes: bit k of a ballot (or a match) is the group's thread of rank k.
    unsigned int ballot(int predicate) const { return details::by_rank(__ballot_sync(lanes_, predicate), lanes_); }
    int any(int predicate) const { return __ballot_sync(lanes_, predicate) != 0; }
    int all(int predicate) const { return __ballot_sync(lanes_, predicate) == lanes_; }
    template <class T> unsigned int match_any(T value) const {
        return details::by_rank(__match_any_sync(lanes_, value), lanes_);
    }
    template <class T> unsigned int match_all(T value, int& predicate) const {
        return details::by_rank(__match_all_sync(lanes_, value, &predicate), lanes_);
    }
    bool is_valid() const { return true; }
};
__forceinline__ coalesced_group coalesced_threads() { return coalesced_group(__activemask()); }
__forceinline__ unsigned int details::lanes_of(const coalesced_group& group) { return group.lanes_; }

namespace details {
// A tile of Size consecutive threads of the block (by thread_rank), inside one warp: its warp operations
// name only the tile's lanes, and read lanes by their rank in the tile.
template <unsigned int Size>
class warp_tile : public thread_group {
    static_assert(Size == 1 || Size == 2 || Size == 4 || Size == 8 || Size == 16 || Size == 32,
                  "a tile has 1, 2, 4, 8, 16 or 32 threads, or 64, 128, 256, 512 or 1024");
    static unsigned int first_lane() { return details::lane() & ~(Size - 1); }

public:
    warp_tile(unsigned int meta_rank, unsigned int meta_size)
        : thread_group(kind::lanes, build_mask(), 0, meta_rank, meta_size) {}
    static unsigned int thread_rank() { return details::block_thread_rank() & (Size - 1); }
    static constexpr unsigned long long size() { return Size; }
    static constexpr unsigned long long num_threads() { return Size; }
    unsigned int meta_group_rank() const { return meta_rank_; }
    unsigned int meta_group_size() const { return meta_size_; }
    // The tile's lanes in its warp.
    static unsigned int build_mask() { return Size == 32 ? 0xffffffffu : ((1u << Size) - 1u) << first_lane(); }
    static void sync() { __syncwarp(build_mask()); }
    template <class T> T shfl(T var, int source_rank) const { return __shfl_sync(build_mask(), var, source_rank, Size); }
    template <class T> T shfl_down(T var, unsigned int delta) const { return __shfl_down_sync(build_mask(), var, delta, Size); }
    template <class T> T shfl_up(T var, unsigned int delta) const { return __shfl_up_sync(build_mask(), var, delta, Size); }
    template <class T> T shfl_xor(T var, unsigned int lane_mask) const { return __shfl_xor_sync(build_mask(), var, lane_mask, Size); }
    // Votes: bit i of a ballot is the tile's thread of rank i.
    unsigned int ballot(int predicate) const { return (__ballot_sync(build_mask(), predicate) & build_mask()) >> first_lane(); }
    int any(int predicate) const { return ballot(predicate) != 0; }
    int all(int predicate) const { return __all_sync(build_mask(), predicate); }
    template <class T> unsigned int match_any(T value) const { return __match_any_sync(build_mask(), value) >> first_lane(); }
    template <class T> unsigned int match_all(T value, int& predicate) const {
        return __match_all_sync(build_mask(), value, &predicate) >> first_lane();
    }
    bool is_valid() const { return true; }
};

// What the warps of a tile larger than a warp exchange through, one per tile of the block in hand (a
// GPU keeps this in shared memory). Threads of one block are fibers of one OS thread: thread_local is the
// block's. Relaxed atomics, which the race check does not record, keep it out of the report on the kernel's memory.
struct multi_warp_exchange {
    unsigned long long value;            // shfl: the source thread's value
    int count;                           // any, all: how many threads' predicates hold
    unsigned long long warp_results[32];  // reduce: each warp's result
};
__forceinline__ multi_warp_exchange& exchange_of_tile(unsigned int tile) {
    static thread_local multi_warp_exchange tiles[32];
    return tiles[tile];
}

// A tile of Size threads of the block, 64 to 1024, whole warps: sync() waits for its threads only.
template <unsigned int Size>
class multi_warp_tile : public thread_group {
    static_assert(Size == 64 || Size == 128 || Size == 256 || Size == 512 || Size == 1024,
                  "a tile has 1, 2, 4, 8, 16 or 32 threads, or 64, 128, 256, 512 or 1024");

public:
    multi_warp_tile(unsigned int meta_rank, unsigned int meta_size)
        : thread_group(kind::multi_warp_tile, 0, Size, meta_rank, meta_size) {}
    static unsigned int thread_rank() { return details::block_thread_rank() & (Size - 1); }
    static constexpr unsigned long long size() { return Size; }
    static constexpr unsigned long long num_threads() { return Size; }
    unsigned int meta_group_rank() const { return meta_rank_; }
    unsigned int meta_group_size() const { return meta_size_; }
    static void sync() { gpt2cupy_tile_sync(details::block_thread_rank() & ~(Size - 1), Size); }
    static multi_warp_exchange& exchange() { return exchange_of_tile(details::block_thread_rank() / Size); }
    // Every thread gets the value of the tile's thread of rank source_rank. The first sync() lets every
    // thread finish reading the previous exchange before the source writes this one.
    template <class T> T shfl(T var, unsigned int source_rank) const {
        sync();
        if (thread_rank() == source_rank) __atomic_store_n(&exchange().value, gpt2cupy_to_slot(var), __ATOMIC_RELAXED);
        sync();
        unsigned long long slot = __atomic_load_n(&exchange().value, __ATOMIC_RELAXED);
        T value;
        __builtin_memcpy(&value, &slot, sizeof(T));
        return value;
    }
    int any(int predicate) const { return count(predicate) != 0; }
    int all(int predicate) const { return count(predicate) == (int)Size; }
    bool is_valid() const { return true; }

private:
    // How many of the tile's threads have a non-zero predicate.
    static int count(int predicate) {
        if (thread_rank() == 0) __atomic_store_n(&exchange().count, 0, __ATOMIC_RELAXED);
        sync();
        if (predicate) __atomic_fetch_add(&exchange().count, 1, __ATOMIC_RELAXED);
        sync();
        int threads = __atomic_load_n(&exchange().count, __ATOMIC_RELAXED);
        sync();  // every thread has read the count before the next vote clears it
        return threads;
    }
};
}  // namespace details

// thread_block_tile<Size>: a warp_tile for 1 to 32 threads, a multi_warp_tile for more.
template <unsigned int Size, class Parent = void>
class thread_block_tile
    : public details::pick<(Size > 32), details::multi_warp_tile<Size>, details::warp_tile<Size>>::type {
    using tile = typename details::pick<(Size > 32), details::multi_warp_tile<Size>, details::warp_tile<Size>>::type;

public:
    thread_block_tile(unsigned int meta_rank, unsigned int meta_size) : tile(meta_rank, meta_size) {}
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
__forceinline__ thread_block_tile<1, void> this_thread() { return thread_block_tile<1, void>(0, 1); }

// Tiles of a size known only at run time: 1, 2, 4, 8, 16 or 32 threads (larger ones only through
// tiled_partition<N>). The threads of ranks k * tile_size .. k * tile_size + tile_size - 1 of the parent.
namespace details {
__forceinline__ void check_run_time_tile_size(unsigned int tile_size) {
    if (tile_size == 0 || tile_size > 32 || (tile_size & (tile_size - 1)) != 0)
        gpt2cupy_unsupported("tiled_partition(group, tile_size) takes a tile_size of 1, 2, 4, 8, 16 or 32 (on a GPU "
                             "another size aborts the kernel); for 64 to 1024 threads, use tiled_partition<N>(block)");
}
// The lanes of ranks first .. first + count - 1 among `lanes`.
__forceinline__ unsigned int lanes_of_ranks(unsigned int lanes, unsigned int first, unsigned int count) {
    unsigned int chosen = 0, rank = 0;
    for (; lanes != 0; lanes &= lanes - 1, ++rank)
        if (rank >= first && rank < first + count) chosen |= 1u << __builtin_ctz(lanes);
    return chosen;
}
}  // namespace details
__forceinline__ coalesced_group tiled_partition(const coalesced_group& parent, unsigned int tile_size) {
    details::check_run_time_tile_size(tile_size);
    unsigned int rank = parent.thread_rank(), size = (unsigned int)parent.size();
    return coalesced_group(details::lanes_of_ranks(details::lanes_of(parent), rank / tile_size * tile_size, tile_size),
                           rank / tile_size, (size + tile_size - 1) / tile_size);
}
__forceinline__ thread_group tiled_partition(const thread_block&, unsigned int tile_size) {
    details::check_run_time_tile_size(tile_size);
    unsigned int rank = details::block_thread_rank(), threads = details::block_thread_count();
    unsigned int first = rank & ~(tile_size - 1);
    unsigned int in_tile = threads - first < tile_size ? threads - first : tile_size;  // a short last tile
    unsigned int lanes = (in_tile == 32 ? 0xffffffffu : (1u << in_tile) - 1u) << (first & 31u);
    return coalesced_group(lanes, rank / tile_size, (threads + tile_size - 1) / tile_size);
}
__forceinline__ thread_group tiled_partition(const thread_group& parent, unsigned int tile_size);

namespace details {
// The parent's lanes in the caller's warp, for a group that lies within one warp.
template <unsigned int Size, class Parent>
__forceinline__ unsigned int lanes_of(const thread_block_tile<Size, Parent>& tile) {
    static_assert(Size <= 32, "binary_partition and labeled_partition split a group of at most 32 threads");
    return tile.build_mask();
}

// The lanes of `parent` whose label equals the caller's; the group's rank among the parent's groups
// (ordered by their lowest lane) and their count.
template <class Label>
__forceinline__ coalesced_group split_by_label(unsigned int parent, Label label) {
    unsigned int same = __match_any_sync(parent, label);
    unsigned int leader = __builtin_ctz(same);
    unsigned int leaders = __ballot_sync(parent, details::lane() == leader);
    return coalesced_group(same, __popc(leaders & ((1u << leader) - 1u)), __popc(leaders));
}
// binary_partition: the threads whose predicate holds are group 1 of 2, the others group 0 (when all
// agree, one group of rank 0).
__forceinline__ coalesced_group split_by_predicate(unsigned int parent, bool predicate) {
    unsigned int holding = __ballot_sync(parent, predicate) & parent;
    if (holding == 0 || holding == parent) return coalesced_group(parent, 0, 1);
    return coalesced_group(predicate ? holding : parent & ~holding, predicate ? 1 : 0, 2);
}
}  // namespace details

template <class Label>
__forceinline__ coalesced_group labeled_partition(const coalesced_group& parent, Label label) {
    return details::split_by_label(details::lanes_of(parent), label);
}
template <class Label, unsigned int Size, class Parent>
__forceinline__ coalesced_group labeled_partition(const thread_block_tile<Size, Parent>& parent, Label label) {
    return details::split_by_label(details::lanes_of(parent), label);
}
__forceinline__ coalesced_group binary_partition(const coalesced_group& parent, bool predicate) {
    return details::split_by_predicate(details::lanes_of(parent), predicate);
}
template <unsigned int Size, class Parent>
__forceinline__ coalesced_group binary_partition(const thread_block_tile<Size, Parent>& parent, bool predicate) {
    return details::split_by_predicate(details::lanes_of(parent), predicate);
}

// A thread_group's sync(), whatever group it is.
void thread_group::sync() const {
    switch (kind_) {
        case kind::block: __syncthreads(); break;
        case kind::grid: grid_group::sync(); break;
        case kind::lanes: __syncwarp(lanes_); break;
        default: gpt2cupy_tile_sync(details::block_thread_rank() & ~(tile_size_ - 1), tile_size_); break;
    }
}

// A group within one warp splits by rank among its lanes; a block or a multi-warp tile by thread rank
// (each tile then lies within one warp).
__forceinline__ thread_group tiled_partition(const thread_group& parent, unsigned int tile_size) {
    if (parent.kind_ == thread_group::kind::lanes) return tiled_partition(coalesced_group(parent.lanes_), tile_size);
    details::check_run_time_tile_size(tile_size);
    unsigned int rank = (unsigned int)parent.thread_rank(), size = (unsigned int)parent.size();
    unsigned int lanes = (tile_size == 32 ? 0xffffffffu : (1u << tile_size) - 1u) << (details::lane() & ~(tile_size - 1));
    return coalesced_group(lanes, rank / tile_size, (size + tile_size - 1) / tile_size);
}

template <class Group> __forceinline__ void sync(const Group& group) { group.sync(); }
template <class Group> __forceinline__ unsigned long long thread_rank(const Group& group) { return group.thread_rank(); }
template <class Group> __forceinline__ unsigned long long group_size(const Group& group) { return group.num_threads(); }

}  // namespace cooperative_groups
