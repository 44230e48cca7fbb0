// The index of the largest element of each row: greedy generation's next token, index (rows) int64 from
// logits (rows, V) in float32 or bf16. The first of equal largest elements wins, and NaN counts as larger than
// any number (the first NaN wins), as numpy's and PyTorch's argmax.
//
// Why a kernel of its own. A general reduction library reduces one row with one block, which then reads 128256
// logits (Llama 3's vocabulary) in turn while the rest of the GPU idles. Here a row is cut into stretches of
// ELEMENTS_PER_BLOCK, one block each (argmax_partial), and one warp per row reduces the blocks' winners
// (argmax_rows): two launches of a few microseconds. Every comparison keeps the same winner whatever the
// order, so the result does not depend on how the work is split. Both are launched dependent
// (dependent_launch.cuh): each starts while the kernel before it ends, and waits before it reads.
// Folding the first pass into the output head's GEMV (each block's winner as a 64-bit key, value bits ordered
// above the index's complement, by atomicMax; the last block writes the index and advances the positions) saves
// three launches but is slower: its epilogue takes the GEMV from 32 to 39 registers, and the output head's
// weights already stream at nearly the copy rate (bench/design_choices.json).
#include "dependent_launch.cuh"
#include "storage.cuh"
#include "warp.cuh"

#define ARGMAX_THREADS 256
#define ELEMENTS_PER_BLOCK 4096

// Whether (value, index) beats the current (best, best_index): NaN first, then larger, then earlier.
__device__ __forceinline__ bool beats(float value, long long index, float best, long long best_index)
{
    bool value_nan = value != value, best_nan = best != best;
    if (value_nan || best_nan) return value_nan && (!best_nan || index < best_index);
    return value > best || (value == best && index < best_index);
}

// The warp's winner, in every lane (the butterfly of warp.cuh's sums, with beats() for +).
__device__ __forceinline__ void warp_argmax(float& best, long long& best_index)
{
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) {
        float value = __shfl_xor_sync(FULL_MASK, best, offset);
        long long index = __shfl_xor_sync(FULL_MASK, best_index, offset);
        if (beats(value, index, best, best_index)) {
            best = value;
            best_index = index;
        }
    }
}

// grid (⌈V / ELEMENTS_PER_BLOCK⌉, rows): block (b, row) writes the winner of its stretch of the row to
// partial_values[row, b], partial_indices[row, b]. An empty stretch cannot happen (the grid covers V).
template <typename floatX>
__global__ void __launch_bounds__(ARGMAX_THREADS) argmax_partial(float* partial_values, long long* partial_indices,
                                                                 const floatX* logits, int V)
{
    __shared__ float warp_values[ARGMAX_THREADS / WARP_SIZE];
    __shared__ long long warp_indices[ARGMAX_THREADS / WARP_SIZE];
    let_next_kernel_start();
    wait_for_previous_kernel();
    const floatX* row = logits + (long long)blockIdx.y * V;
    int first = blockIdx.x * ELEMENTS_PER_BLOCK, end = min(first + ELEMENTS_PER_BLOCK, V);
    float best = to_float(row[first]);
    long long best_index = first;
    for (int i = first + threadIdx.x; i < end; i += ARGMAX_THREADS) {
        float value = to_float(row[i]);
        if (beats(value, i, best, best_index)) {
            best = value;
            best_index = i;
        }
    }
    warp_argmax(best, best_index);
    int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    if (lane == 0) {
        warp_values[warp] = best;
        warp_indices[warp] = best_index;
    }
    __syncthreads();
    if (warp == 0) {
        best = warp_values[lane % (ARGMAX_THREADS / WARP_SIZE)];
        best_index = warp_indices[lane % (ARGMAX_THREADS / WARP_SIZE)];
        warp_argmax(best, best_index);
        if (lane == 0) {
            long long at = (long long)blockIdx.y * gridDim.x + blockIdx.x;
            partial_values[at] = best;
            partial_indices[at] = best_index;
        }
    }
}

// One warp per row (grid = rows): the winner of the row's `blocks` stretches, into index[row].
extern "C" __global__ void argmax_rows(long long* index, const float* partial_values,
                                       const long long* partial_indices, int blocks)
{
    wait_for_previous_kernel();
    const float* values = partial_values + (long long)blockIdx.x * blocks;
    const long long* indices = partial_indices + (long long)blockIdx.x * blocks;
    float best = values[0];
    long long best_index = indices[0];
    for (int b = threadIdx.x; b < blocks; b += WARP_SIZE) {
        if (beats(values[b], indices[b], best, best_index)) {
            best = values[b];
            best_index = indices[b];
        }
    }
    warp_argmax(best, best_index);
    if (threadIdx.x == 0) {
        index[blockIdx.x] = best_index;
    }
}
