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
//   are enough: with 64 warps per multiprocessor that is 64 KB. Measured on an H200 with the weights cold in L2,
//   four or eight took 10 to 60 % longer: their registers leave room for fewer warps (an H100 prefers four on
//   most of these shapes: the best number depends on the card);
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
// weights. Measured on an H200 (the captured decode step, 2026-11-27): Llama 3.2 1B 987 -> 1027 tokens/s (58 ->
// 60 % of the bound), Llama 2 7B 230 -> 237 (74 -> 76 %). Asking the weights into L2 ahead instead, before the
// wait (cp.async.bulk.prefetch.L2, while a norm or the attention leaves the memory idle), measured slower on
// the same H200 beyond 4 MiB a launch (1B: 16 MiB 957, every block's rows 924), and 4 MiB won 1 %.
//
// One more thing the same launch can do, because at batch 1 every small kernel between the products costs more
// time (its launch, its ramp up and down) than its bytes:
// - GATED: W holds two matrices, rows 0 .. N/2 - 1 (gate) and N/2 .. N - 1 (up), and y (R, N/2) =
//   silu(x W_gateᵀ) * (x W_upᵀ), SwiGLU (swiglu.cuh). A block computes gate rows and the up rows of the same
//   outputs; each product is rounded to y's type as it would be stored, then SwiGLU is taken and rounded once:
//   the bits of the two products followed by kernels/swiglu.cu's forward.
// RMSNorm, before the product, stays a kernel of its own. Folded into the loop (x_k g_k and x_k² summed beside
// every product) it made Llama 3.2 1B's gate and up product take 27 µs on an H200, where the norm and the plain
// product take 3 + 19: at 16 bytes of weight per clock a multiprocessor has few instructions to spare. Made
// once per block in shared memory instead, 32 µs: each of 2048 blocks waited for it.
#include "dependent_launch.cuh"
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

template <int ROWS, int WIDTH, typename weightT, typename floatX, bool GATED = false>
__global__ void __launch_bounds__(GEMV_WARPS * WARP_SIZE) gemv(floatX* y, const floatX* x, const weightT* weight,
    const float* bias, const floatX* residual, int rows, int N, int K, int warps_per_output)
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
    const weightT* weight_row = weight + (long long)min(output, N - 1) * K;
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
        if (lane == 0) warp_sums[warp][r] = total;
    }
    __syncthreads();
    // The first warp of each output adds its warps' sums in a fixed order, adds the bias, and rounds once (then
    // adds the residual and rounds again, or leaves the product for SwiGLU).
    if (part == 0 && inside) {
        for (int r = lane; r < rows && r < ROWS; r += WARP_SIZE) {
            float total = 0.0f;
            for (int p = 0; p < warps_per_output; p++) total += warp_sums[warp + p][r];
            if (bias != nullptr) total += bias[output];
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
}
