// Products of a few rows with a large matrix: y (R, N) = x (R, K) Wᵀ (+ bias) (+ residual), R <= 8 (generation
// at batch 1 has R = 1). W (N, K) is a Linear layer's weight, k-contiguous, in bf16 or float32; x, y and
// residual are float32 or bf16 (y in x's storage type); bias float32 or absent; every sum float32.
// residual (R, N), or null: the layer's input added to its output, as a transformer block's x + f(x). The
// product is rounded to y's type first and the sum rounded again, the bits of a product and then an add, in
// one launch instead of two.
//
// Why not the tiled GEMM. A GEMM tile reuses each weight for 64 or 128 rows of x; with one row there is no
// reuse to win, and the tile's rows past R are wasted loads and multiplies. The whole cost is reading W once:
// 2 N K bytes in bf16, 13.5 GB per token for a 7B model. So the kernel is built around the weight's bytes:
// - each weight row is read once, by WARPS_PER_OUTPUT warps, in 16-byte loads (8 bf16 or 4 floats per lane);
// - a lane loads LOADS_IN_FLIGHT such groups before it multiplies any, so that many bytes are on their way at once
//   (a kernel that only streams memory needs about 40 KB in flight per multiprocessor to keep up with HBM). Two
//   are enough: with 64 warps per multiprocessor that is 64 KB. More cost registers, which leave room for
//   fewer warps, so the best number depends on the card and the shape;
// - the R rows of x are read at the same columns as the weight group: small, they stay in L1 and L2, and
//   every weight element read is multiplied by all R rows (R products for 2 or 4 bytes of weight);
// - the lanes' partial sums meet by warp_sum, the warps of one output by shared memory.
// grid = ⌈N / outputs per block⌉ blocks of 8 warps; WARPS_PER_OUTPUT (1, 2, 4 or 8) warps share an output
// when N is small (a 512-row k_proj would otherwise give too few blocks to fill the GPU).
// WIDTH elements per load: 8 (bf16) or 4 (float) when K and both arrays allow 16-byte loads, else 1.
// Launched dependent (dependent_launch.cuh): a lane's first weight loads go out before the wait for the kernel
// before, whose output x is, so that the memory is busy from the moment the blocks start.
// The weight's 16-byte groups are loaded evict-first (ld.global.cs): read once per token, they should not push
// out of L2 what the kernels between the products read again, the KV cache, the activations and the norms'
// weights. That makes the decode step faster; asking the weights into L2 ahead instead, before the wait
// (cp.async.bulk.prefetch.L2, while a norm or the attention leaves the memory idle), does not
// (bench/design_choices.json).
//
// More that the same launch can do, because at batch 1 every small kernel between the products costs more time
// (its launch, its ramp up and down) than its bytes:
// - GATED: W holds two matrices, rows 0 .. N/2 - 1 (gate) and N/2 .. N - 1 (up), and y (R, N/2) =
//   silu(x W_gateᵀ) * (x W_upᵀ), SwiGLU (swiglu.cuh). A block computes gate rows and the up rows of the same
//   outputs; each product is rounded to y's type as it would be stored, then SwiGLU is taken and rounded once:
//   the bits of the two products followed by kernels/swiglu.cu's forward.
// - NORM_WARPS > 0: the RMSNorm that follows the product in a transformer, normed (R, N) = RMSNorm(y) * norm_weight
//   (a layer's o_proj, then post_attention_layernorm; its down_proj, then the next layer's input_layernorm), by
//   the launch's last block, once every block's outputs are in memory: each block writes its outputs,
//   __threadfence() makes them visible to every other block, and it counts itself done with atomicAdd on
//   counters[0]; the block that sees gridDim.x - 1 there is last (the last-block pattern of dyt.cu and
//   decode_attention.cu), sets the counter back to 0 for the next launch (a CUDA graph replays it) and norms the
//   rows, NORM_WARPS warps a row with rmsnorm_row (rmsnorm_row.cuh): the bits of kernels/rmsnorm.cu's forward.
//   That norm costs one block a round trip to L2 and a sum; as a kernel of its own it costs a launch, the wait
//   for the product's end and a second wait before the next product. But the epilogue's registers (48 a thread
//   against the plain product's 32) leave room for 5 blocks a multiprocessor instead of 8, fewer loads in
//   flight: Llama 3.2 1B's decode step gained, Llama 2 7B's lost (gpt2_cupy.generation.FOLD_NORMS_MOST_CHANNELS).
//   Capping the registers instead (__launch_bounds__(256, 8): 32 a thread, the norm in a noinline function so
//   that only that epilogue spills) is slower, here and on the GATED product: the spills' local-memory traffic
//   costs more than the extra blocks give (bench/design_choices.json).
// - gemv_rope_store: the q, k, v product's blocks take pairs of channels that RoPE turns together, as GATED
//   blocks take gate and up rows, and store them turned into q and the KV cache themselves: the bits of the
//   product followed by kernels/rope.cu's rope_store_new_positions, with no launch between.
// RMSNorm before the product, inside its loop, does not pay. Folded into the loop (x_k g_k and x_k² summed
// beside every product), it adds instructions to a loop that has few to spare while it streams 16 bytes of
// weight per lane per load; made once per block in shared memory instead, every block waits for it before its
// first product. Either costs the product more than the norm's own launch.
#include "dependent_launch.cuh"
#include "rmsnorm_row.cuh"
#include "rope_pair.cuh"
#include "storage.cuh"
#include "swiglu.cuh"
#include "warp.cuh"

#define GEMV_WARPS 8
#define LOADS_IN_FLIGHT 2

// WIDTH elements of a row into floats; float rows in float4 groups where WIDTH allows, bf16 rows in one load.
template <int WIDTH, typename T>
__device__ __forceinline__ void load_elements(float* destination, const T* source)
{
    constexpr int GROUP = sizeof(T) == 4 ? (WIDTH % 4 == 0 ? 4 : 1) : WIDTH;
#pragma unroll
    for (int g = 0; g < WIDTH; g += GROUP) {
        load_as_float<GROUP>(destination + g, source + g, true);
    }
}

// load_elements for one 16-byte group (WIDTH * sizeof(T) == 16), with a load that tells L2 to evict its line
// first (ld.global.cs): read once, the weights should not push out lines still to be read.
template <int WIDTH, typename T>
__device__ __forceinline__ void load_streamed(float* destination, const T* source)
{
    const uint4 loaded = __ldcs(reinterpret_cast<const uint4*>(source));
    const T* elements = reinterpret_cast<const T*>(&loaded);
#pragma unroll
    for (int e = 0; e < WIDTH; e++) {
        destination[e] = to_float(elements[e]);
    }
}

// This warp's share of the product of one weight row with the R rows of x, summed over its lanes: in lane 0,
// warp_sums[r] = the warp's part of row r's product (the lanes of the output's warps side by side along the row,
// `part` this warp's place among them). Launched dependent (dependent_launch.cuh): the first weight loads go out
// before the wait for the kernel before, whose output x is. Every thread of the block calls it.
template <int ROWS, int WIDTH, typename weightT, typename floatX>
__device__ __forceinline__ void warp_products(float* warp_sums, const floatX* x, const weightT* weight_row, int rows,
                                              int K, int part, int warps_per_output)
{
    int lane = threadIdx.x % WARP_SIZE;
    int groups = K / WIDTH;                        // WIDTH-element groups of a row
    int stride = warps_per_output * WARP_SIZE;     // the output's lanes, side by side along the row

    float sums[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) sums[r] = 0.0f;

    // LOADS_IN_FLIGHT groups of the row, stride apart from `first`: only loads, 16 bytes each in flight per lane.
    float w[LOADS_IN_FLIGHT][WIDTH];
    auto load_weights = [&](int first) {
#pragma unroll
        for (int u = 0; u < LOADS_IN_FLIGHT; u++) {
            int group = first + u * stride;
            if (group < groups) {
                const weightT* source = weight_row + (long long)group * WIDTH;
                if (WIDTH * sizeof(weightT) == 16) load_streamed<WIDTH>(w[u], source);
                else load_elements<WIDTH>(w[u], source);
            }
        }
    };
    let_next_kernel_start();
    int first = part * WARP_SIZE + lane;
    load_weights(first);               // weights: written by no kernel launched dependent
    wait_for_previous_kernel();        // x, residual: written by the kernels before
    for (; first < groups; first += LOADS_IN_FLIGHT * stride) {
#pragma unroll
        for (int u = 0; u < LOADS_IN_FLIGHT; u++) {
            int group = first + u * stride;
            if (group >= groups) break;
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                if (r < rows) {
                    float xs[WIDTH];
                    load_elements<WIDTH>(xs, x + (long long)r * K + (long long)group * WIDTH);
#pragma unroll
                    for (int e = 0; e < WIDTH; e++) sums[r] += w[u][e] * xs[e];
                }
            }
        }
        load_weights(first + LOADS_IN_FLIGHT * stride);
    }

#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        float total = warp_sum(sums[r]);
        if (lane == 0) warp_sums[r] = total;
    }
}

// The first warp of each output adds its warps' sums in a fixed order and the bias: row r's product, before any
// rounding.
template <int ROWS>
__device__ __forceinline__ float output_sum(const float (*warp_sums)[ROWS], int warp, int r, int warps_per_output,
                                            const float* bias, int output)
{
    float total = 0.0f;
    for (int p = 0; p < warps_per_output; p++) total += warp_sums[warp + p][r];
    if (bias != nullptr) total += bias[output];
    return total;
}

// NORM_WARPS, NORM_WIDTH, NORM_K: the norm's row layout (kernels/rmsnorm.cu's <WIDTH, K, WARPS_PER_ROW>), 0
// warps for none; then normed, norm_weight (normWeightT), eps and counters (one zero) are used, else null.
template <int ROWS, int WIDTH, typename weightT, typename floatX, bool GATED = false, int NORM_WARPS = 0,
          int NORM_WIDTH = 1, int NORM_K = 1, typename normWeightT = float>
__global__ void __launch_bounds__(GEMV_WARPS * WARP_SIZE) gemv(floatX* y, floatX* normed, const floatX* x,
    const weightT* weight, const float* bias, const floatX* residual, const normWeightT* norm_weight,
    unsigned int* counters, int rows, int N, int K, int warps_per_output, float eps)
{
    __shared__ float warp_sums[GEMV_WARPS][ROWS];
    __shared__ float products[GEMV_WARPS][ROWS];   // GATED: each output's product, as stored, for SwiGLU
    int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    int outputs_per_block = GEMV_WARPS / warps_per_output;
    int slot = warp / warps_per_output;            // which of the block's outputs this warp works on
    int part = warp % warps_per_output;            // which of the output's warps this is
    // GATED: the block's first half of slots take gate rows, the second half the up rows N/2 further on.
    int pairs = outputs_per_block / 2;
    int output = GATED ? blockIdx.x * pairs + slot % pairs + slot / pairs * (N / 2)
                       : blockIdx.x * outputs_per_block + slot;
    bool inside = GATED ? blockIdx.x * pairs + slot % pairs < N / 2 : output < N;
    warp_products<ROWS, WIDTH>(warp_sums[warp], x, weight + (long long)min(output, N - 1) * K, rows, K, part,
                               warps_per_output);
    __syncthreads();
    // Each output's sum rounded once (then the residual added and rounded again, or left for SwiGLU).
    if (part == 0 && inside) {
        for (int r = lane; r < rows && r < ROWS; r += WARP_SIZE) {
            float total = output_sum<ROWS>(warp_sums, warp, r, warps_per_output, bias, output);
            if (GATED) {
                products[slot][r] = to_float(from_float<floatX>(total));
                continue;
            }
            long long at = (long long)r * N + output;
            y[at] = residual == nullptr ? from_float<floatX>(total)
                                        : from_float<floatX>(to_float(from_float<floatX>(total)) + to_float(residual[at]));
        }
    }
    if (GATED) {
        __syncthreads();
        // Thread (pair, r) joins the gate and up products of one output of row r.
        for (int entry = threadIdx.x; entry < pairs * rows; entry += blockDim.x) {
            int pair = entry % pairs, r = entry / pairs, column = blockIdx.x * pairs + pair;
            if (r < ROWS && column < N / 2) {
                y[(long long)r * (N / 2) + column] = from_float<floatX>(swiglu(products[pair][r], products[pair + pairs][r]));
            }
        }
    }
    if (NORM_WARPS > 0) {
        __shared__ bool last;
        __threadfence();  // this block's outputs reach memory before its count says they are there
        __syncthreads();
        if (threadIdx.x == 0) last = atomicAdd(counters, 1u) == gridDim.x - 1;
        __syncthreads();
        if (!last) return;
        if (threadIdx.x == 0) counters[0] = 0;  // ready for the next launch
        // The block's warps, NORM_WARPS to a row, take GEMV_WARPS / NORM_WARPS rows at a time; every thread goes
        // round the loop as often (rmsnorm_row's barriers), a row past the last reading nothing.
        constexpr int ROW_WARPS = NORM_WARPS > 0 ? NORM_WARPS : 1;
        int columns = GATED ? N / 2 : N;
        for (int first = 0; first < rows; first += GEMV_WARPS / ROW_WARPS) {
            int r = first + warp / ROW_WARPS;
            long long start = (long long)min(r, rows - 1) * columns;
            rmsnorm_row<NORM_WIDTH, NORM_K, ROW_WARPS, true>(normed + start, y + start, norm_weight, columns, eps,
                                                             r < rows);
        }
    }
}

// Generation's q, k, v product followed by rope_store_new_positions (kernels/rope.cu), in one launch: W holds
// q's H heads, k's H_kv and v's H_kv heads of D rows (N = (H + 2 H_kv) D), x the B n new positions (R = B n rows,
// row b n + t). A block's outputs are pairs of channels that RoPE turns together (rope_pair.cuh): its first half
// of slots take the first channels of `pairs` consecutive pairs, the second half their partners, as a GATED
// block takes gate and up rows. Each product is rounded to the storage type as the q, k, v array would hold it;
// then thread (pair, r) turns q's and k's pairs, copies v's, and writes them where the separate kernel does
// (store_new_position_pair): its bits, with no q, k, v array and no launch between.
template <int ROWS, int WIDTH, typename weightT, typename floatX>
__global__ void __launch_bounds__(GEMV_WARPS * WARP_SIZE) gemv_rope_store(floatX* q_out, floatX* keys,
    floatX* values, const floatX* x, const weightT* weight, const float* inv_freq,
    const int* device_start, int rows, int N, int K, int warps_per_output, int n, int H, int H_kv, int D,
    int capacity, int interleaved)
{
    __shared__ float warp_sums[GEMV_WARPS][ROWS];
    __shared__ float products[GEMV_WARPS][ROWS];   // each output's product, as stored
    int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    int outputs_per_block = GEMV_WARPS / warps_per_output;
    int slot = warp / warps_per_output, part = warp % warps_per_output;
    int pairs = outputs_per_block / 2, half = D / 2, all_pairs = N / 2;
    int pair = blockIdx.x * pairs + slot % pairs;  // (head, i) flattened, i < D / 2 the frequency
    bool inside = pair < all_pairs;
    int head = min(pair, all_pairs - 1) / half;
    int2 channels = pair_channels(min(pair, all_pairs - 1) % half, D, interleaved);
    int output = head * D + (slot < pairs ? channels.x : channels.y);
    warp_products<ROWS, WIDTH>(warp_sums[warp], x, weight + (long long)output * K, rows, K, part, warps_per_output);
    __syncthreads();
    if (part == 0 && inside) {
        for (int r = lane; r < rows && r < ROWS; r += WARP_SIZE) {
            products[slot][r] = to_float(from_float<floatX>(output_sum<ROWS>(warp_sums, warp, r, warps_per_output,
                                                                             nullptr, output)));  // no bias
        }
    }
    __syncthreads();
    int start = device_start[0];   // after warp_products' wait: the kernels before advance it
    for (int entry = threadIdx.x; entry < pairs * rows; entry += blockDim.x) {
        int p = entry % pairs, r = entry / pairs, flat = blockIdx.x * pairs + p;
        if (r < ROWS && flat < all_pairs) {
            int t = r % n, i = flat % half;
            store_new_position_pair(q_out, keys, values, from_float<floatX>(products[p][r]),
                                    from_float<floatX>(products[p + pairs][r]), r / n, t, flat / half, i, start + t,
                                    inv_freq[i], n, H, H_kv, D, capacity, interleaved);
        }
    }
}
