// The fast column sum behind the bias gradient db = sum over rows of dy, in two launches:
//   bias_partial_sums<WIDTH>     grid (ceil(columns / 32), ceil(rows / rows_per_block)), any multiple of 32
//                                threads up to 1024: block (s, r) writes the sums of strip s (32 columns)
//                                over its range r of rows to partial_sums[r, strip columns]
//   bias_column_sum              (bias_column_sum.cu) then adds up the columns of partial_sums.
// The matrix is stored as floatX (storage.cuh): float, or bf16 for a model trained in bf16; the sums are
// float32 either way.

#include "storage.cuh"

// WIDTH is 4 (needs columns % 4 == 0 and matrix 16-byte aligned) or 1 (any shape). load_as_float moves
// a lane's WIDTH neighbouring elements with one instruction (16 bytes for 4 floats, 8 for 4 bf16).
template <int WIDTH, typename floatX = float>
__global__ void bias_partial_sums(float* partial_sums, const floatX* matrix, int rows, int columns,
                                  int rows_per_block)
{
    constexpr int LANES_PER_ROW = 32 / WIDTH;  // lanes that cover the 32 columns of one row
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int warps = blockDim.x / 32;
    const int column = blockIdx.x * 32 + (lane % LANES_PER_ROW) * WIDTH;  // first of this lane's WIDTH columns
    const int first_row = blockIdx.y * rows_per_block;
    const int end_row = min(first_row + rows_per_block, rows);

    // A warp reads WIDTH rows per step, each a run of 128 bytes: coalesced.
    float sum[WIDTH] = {};
    if (column < columns) {  // WIDTH divides columns, so the lane's other columns are in range too
        for (int row = first_row + warp * WIDTH + lane / LANES_PER_ROW; row < end_row; row += warps * WIDTH) {
            float loaded[WIDTH];
            load_as_float<WIDTH>(loaded, matrix + (long long)row * columns + column, true);
            for (int k = 0; k < WIDTH; ++k) {
                sum[k] += loaded[k];
            }
        }
    }

    // Lanes lane, lane + LANES_PER_ROW, ... hold the same columns of different rows: a butterfly of shuffles
    // adds them up in registers. All 32 lanes take part, so this sits outside the `if` above.
    for (int k = 0; k < WIDTH; ++k) {
        for (int offset = LANES_PER_ROW; offset < 32; offset *= 2) {
            sum[k] += __shfl_xor_sync(0xffffffff, sum[k], offset);
        }
    }

    // The warps of the block read different rows: add up their sums through shared memory.
    __shared__ float warp_sums[32][32];  // [warp][column within the strip]
    if (lane < LANES_PER_ROW) {
        for (int k = 0; k < WIDTH; ++k) {
            warp_sums[warp][lane * WIDTH + k] = sum[k];
        }
    }
    __syncthreads();
    if (warp == 0) {
        float total = 0.0f;
        for (int w = 0; w < warps; ++w) {
            total += warp_sums[w][lane];
        }
        int strip_column = blockIdx.x * 32 + lane;
        if (strip_column < columns) {
            partial_sums[(long long)blockIdx.y * columns + strip_column] = total;
        }
    }
}
