// Attention of a few new queries over a KV cache, split along the keys (flash-decoding). q, the cache and out
// are float32 or bf16 (floatX, storage.cuh: a model generating in bf16 keeps a bf16 cache, half the bytes to
// read); scores, the softmax and the partial results are float32 either way.
//   q, out:          (key-value heads, rows, d): the rows of one key-value head are the queries that read it,
//                    row r = g n + i for query head g of its group and new position i < n;
//   keys, values:    (key-value heads, capacity, d), the cache; positions 0 .. length - 1 are filled;
//   partial_out:     (key-value heads, splits, rows, d), partial_max, partial_sum: (key-value heads, splits, rows).
// New position i sits at position length - n + i and sees keys 0 .. length - n + i: the cached ones and the
// new ones up to itself. out = softmax(q kᵀ / √d) v over those keys.
//
// A latency problem, not a bandwidth one. Generating a token at batch 1 reads each layer's cache once: Llama 3.2
// 1B's 8 key-value heads of 64 in bf16, 600 positions, are 1.2 MB, 0.3 µs at an H200's 4.2 TB/s. What the
// kernel costs is its chain of steps that each wait for the one before: a launch, a load whose result decides
// the next load, a shuffle that feeds the next shuffle, a barrier. A load from DRAM takes some 0.5 to 0.7 µs to
// come back on an H100 or H200, one from L2 less, a shuffle some 20 cycles. So the design counts round trips: read the length;
// then every key and value a warp needs, all loads in flight at once; compute from registers; write the partial
// results; then one more round trip reads them all back for the merge.
//
// Why split the keys. One block per head would keep only as many multiprocessors busy as there are heads (8
// of an H200's 132), each with a long queue of loads. So the keys are cut into `splits` chunks of `chunk`
// keys, one block each (flash-decoding, Dao et al. 2023): block (head, s) computes, for each of its rows, over
// its chunk only, the maximum score m_s, the sum l_s = Σ e^(score - m_s) and the unnormalised output
// o_s = Σ e^(score - m_s) v; the merge of the chunks is M = max_s m_s, l = Σ_s l_s e^(m_s - M),
// out = Σ_s o_s e^(m_s - M) / l: the same rescaling as the online softmax of chapter 04 and the forward of
// chapter 08, across blocks. A chunk is as many keys as the block's warps take in one step each (the op's
// key_chunks), so that a warp waits for memory once; only a long cache, or a large batch, gives a warp several
// steps, where the other blocks on the multiprocessor hide its waits.
//
// Who merges the chunks. A second launch costs its own start and the wait for the first kernel's end. So where
// it can, the last block of a head to finish merges them in the same launch: each block writes its partial
// results, __threadfence() makes them visible to every other block, and then the block counts itself done with
// atomicAdd on the head's counter; the one that sees splits - 1 there is last, and every other block's results
// are in memory (the last-block pattern of dyt.cu). It sets the counter back to 0 for the next launch (a CUDA
// graph replays it with the same counters). But then one block does the whole merge: that pays where each of
// its threads merges one output element, with every chunk's loads in flight at once; where a thread would merge
// several elements, one round trip after another, a second kernel is faster, decode_attention_combine, whose
// many blocks take one element per thread (the op decides: counters or none). Either way the partial results
// are added in split order, whichever block does it: the same bits on every run. When one chunk covers every
// key, the block writes out itself.
//
// How a warp lays its lanes over the keys. The keys of a chunk are consecutive rows of d elements, one stretch
// of memory. A lane loads 16 bytes (4 floats or 8 bf16), so a row of D elements takes LANES_PER_KEY lanes and
// one load instruction of the warp covers KEYS_PER_LOAD = 32 / LANES_PER_KEY whole rows, 512 neighbouring
// bytes: every byte of every 32-byte sector fetched is used. (d = 64 in bf16: 8 lanes a key, 4 keys a load.)
// Each lane multiplies its 16 bytes by the same columns of every row's query, held in its registers, and a
// sum over the key's lanes (log2 LANES_PER_KEY shuffles) gives the score in each of them. The lane also loads
// the same 16 bytes of the key's value row, so it holds e^(score - m) and the values it multiplies: P V needs
// no exchange of scores between lanes. Each lane keeps a running maximum, sum and output for its keys and
// columns; at the end the warp's lanes that share columns merge theirs with shuffles, the warps merge theirs
// through shared memory, and the blocks through the last one, with the same rescaling each time.
// A step is LOADS_PER_STEP loads of keys and as many of values per lane, all issued before any is used, so that
// their latencies overlap. They wait in registers as stored (Piece: 16 bytes in four 32-bit registers, two bf16
// to a register) and become floats where they are used: in bf16 that is half the registers of floats, and
// registers decide how many blocks fit on a multiprocessor. Fewer loads a step where more rows take registers.
// The queries are multiplied by 1 / √d as they are loaded, so a score is one dot product; exponentials are
// __expf, the hardware's approximate e^x (a multiply by log2(e) and one MUFU.EX2).
//
// Grouped-query attention: the rows of a block are queries of every head of the group, so the block reads
// each key and value once for all of them (a group of 4 query heads costs the bytes of one).
// Head sizes: D = 32, 64, 128 or 256, a template parameter so that the per-lane arrays live in registers. When
// d = D and the arrays start on 16 bytes, rows are loaded 16 bytes at a time (VECTOR_LOADS); otherwise (d = 80,
// say, in a tile of 128) element by element, with zeros in columns d .. D - 1.
#include "dependent_launch.cuh"
#include "special_values.cuh"
#include "storage.cuh"
#include "warp.cuh"

#define MOST_WARPS 8  // per block of decode_attention_partial (the op launches WARPS: ops/decode_attention.py)

// Where a lane's 16-byte pieces of a row of D elements lie, and how many keys a warp takes per step.
template <int D, int ROWS, typename floatX>
struct KeyLayout {
    static constexpr int VECTOR = 16 / sizeof(floatX);  // elements in 16 bytes
    static constexpr int LANES_PER_KEY = D / VECTOR < WARP_SIZE ? D / VECTOR : WARP_SIZE;
    static constexpr int KEYS_PER_LOAD = WARP_SIZE / LANES_PER_KEY;
    static constexpr int PIECES = D / (LANES_PER_KEY * VECTOR);  // a lane's 16 bytes of a row: 2 for float D = 256
    static constexpr int COLUMNS = PIECES * VECTOR;              // a lane's columns of a row
    // At most 8 loads a step, and about 16 scores (ROWS x LOADS_PER_STEP): 8 loads for 1 or 2 rows, 4 for 4, 2 for
    // 8; half as many with two pieces a row.
    static constexpr int LOADS_PER_STEP_WANTED = (16 / ROWS < 8 ? 16 / ROWS : 8) / PIECES;
    static constexpr int LOADS_PER_STEP = LOADS_PER_STEP_WANTED > 1 ? LOADS_PER_STEP_WANTED : 1;
    static constexpr int KEYS_PER_STEP = LOADS_PER_STEP * KEYS_PER_LOAD;

    // Column of element e of piece p of this lane: the pieces of a load are neighbours across the lanes.
    static __device__ __forceinline__ int column(int lane, int p, int e)
    {
        return p * LANES_PER_KEY * VECTOR + lane % LANES_PER_KEY * VECTOR + e;
    }
};

// The sum, or the maximum, over the lanes whose indices differ from this lane's only in the bits
// FIRST_OFFSET .. END_OFFSET / 2 (powers of two): <1, 8> sums groups of 8 neighbouring lanes, <8, 32> the lanes
// 8 apart. warp.cuh's warp_sum is <1, 32>. All 32 lanes call it; every lane of a group gets the result.
template <int FIRST_OFFSET, int END_OFFSET>
__device__ __forceinline__ float sum_over_lanes(float value)
{
#pragma unroll
    for (int offset = FIRST_OFFSET; offset < END_OFFSET; offset *= 2) {
        value += __shfl_xor_sync(FULL_MASK, value, offset);
    }
    return value;
}

template <int FIRST_OFFSET, int END_OFFSET>
__device__ __forceinline__ float max_over_lanes(float value)
{
#pragma unroll
    for (int offset = FIRST_OFFSET; offset < END_OFFSET; offset *= 2) {
        value = fmaxf(value, __shfl_xor_sync(FULL_MASK, value, offset));
    }
    return value;
}

// The bits of a stored element, and back.
__device__ __forceinline__ unsigned bits_of(float x) { return __float_as_uint(x); }
__device__ __forceinline__ unsigned bits_of(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }

template <typename floatX>
__device__ __forceinline__ floatX from_bits(unsigned bits);

template <>
__device__ __forceinline__ float from_bits<float>(unsigned bits) { return __uint_as_float(bits); }

template <>
__device__ __forceinline__ __nv_bfloat16 from_bits<__nv_bfloat16>(unsigned bits)
{
    return __ushort_as_bfloat16((unsigned short)bits);
}

// 16 bytes of a row, as stored: 4 floats or 8 bf16 in four 32-bit words. A step holds its keys and values so,
// half the registers of floats in bf16 (two bf16 to a register, not one each), and widens each element to a
// float where it is used.
template <typename floatX>
struct alignas(16) Piece {
    static constexpr int PER_WORD = 4 / sizeof(floatX), BITS = 32 / PER_WORD;
    unsigned word[4];

    __device__ __forceinline__ floatX item(int e) const
    {
        return from_bits<floatX>(word[e / PER_WORD] >> (e % PER_WORD * BITS));
    }
};

// This lane's PIECES pieces of a row of d elements; zeros past d, and zeros without reading when not inside.
template <typename Layout, bool VECTOR_LOADS, typename floatX>
__device__ __forceinline__ void load_lane_pieces(Piece<floatX> pieces[Layout::PIECES], const floatX* row, int d,
                                                 bool inside)
{
    constexpr int PER_WORD = Piece<floatX>::PER_WORD, BITS = Piece<floatX>::BITS;
    int lane = threadIdx.x % WARP_SIZE;
#pragma unroll
    for (int p = 0; p < Layout::PIECES; p++) {
        int first = Layout::column(lane, p, 0);
        if (VECTOR_LOADS && inside) {
            pieces[p] = *reinterpret_cast<const Piece<floatX>*>(row + first);
        } else {
#pragma unroll
            for (int w = 0; w < 4; w++) pieces[p].word[w] = 0u;  // zero bits: 0.0 in both types
#pragma unroll
            for (int e = 0; e < Layout::VECTOR; e++) {
                if (inside && first + e < d) {
                    pieces[p].word[e / PER_WORD] |= bits_of(row[first + e]) << (e % PER_WORD * BITS);
                }
            }
        }
    }
}

// The lane's COLUMNS columns of a row as floats, from its pieces.
template <typename Layout, typename floatX>
__device__ __forceinline__ void widen(float columns[Layout::COLUMNS], const Piece<floatX> pieces[Layout::PIECES])
{
#pragma unroll
    for (int c = 0; c < Layout::COLUMNS; c++) {
        columns[c] = to_float(pieces[c / Layout::VECTOR].item(c % Layout::VECTOR));
    }
}

// The chunks' merge for element (r, column) of a head's output: its `splits` partial results, in split order.
// The maxima, sums and columns of SPLITS_AT_ONCE splits are loaded before any is used, so that one round trip
// to memory serves them all (a loop that waits for each load in turn spends its time in memory latency); the
// running result is rescaled once per batch. __ldcg reads through the L2 cache, where every multiprocessor's
// writes meet, never from this multiprocessor's L1 (not kept coherent with the others). Split 0 holds key 0,
// which every row sees, so the maximum is finite from the first batch on.
#define SPLITS_AT_ONCE 16

__device__ __forceinline__ float merged_element(const float* partial_out, const float* partial_max,
                                                const float* partial_sum, long long head, int r, int column,
                                                int rows, int splits, int d)
{
    const float* maxima = partial_max + head * splits * rows + r;  // split s at maxima[s * rows]
    const float* sums = partial_sum + head * splits * rows + r;
    const float* partial = partial_out + (head * splits * rows + r) * d + column;  // split s at [s * rows * d]
    float largest = NEGATIVE_INFINITY, sum = 0.0f, result = 0.0f;
    for (int first = 0; first < splits; first += SPLITS_AT_ONCE) {
        float split_max[SPLITS_AT_ONCE], split_sum[SPLITS_AT_ONCE], split_out[SPLITS_AT_ONCE];
#pragma unroll
        for (int u = 0; u < SPLITS_AT_ONCE; u++) {
            bool inside = first + u < splits;
            long long s = first + u;
            split_max[u] = inside ? __ldcg(maxima + s * rows) : NEGATIVE_INFINITY;
            split_sum[u] = inside ? __ldcg(sums + s * rows) : 0.0f;
            split_out[u] = inside ? __ldcg(partial + s * rows * d) : 0.0f;
        }
        float batch_max = largest;
#pragma unroll
        for (int u = 0; u < SPLITS_AT_ONCE; u++) batch_max = fmaxf(batch_max, split_max[u]);
        float correction = __expf(largest - batch_max);  // e^-inf = 0 the first time
        sum *= correction;
        result *= correction;
#pragma unroll
        for (int u = 0; u < SPLITS_AT_ONCE; u++) {
            float weight = __expf(split_max[u] - batch_max);  // 0 for a chunk past the end
            sum += split_sum[u] * weight;
            result += split_out[u] * weight;
        }
        largest = batch_max;
    }
    return result / sum;
}

// The kernel. grid = (key-value heads, splits, ⌈rows / ROWS⌉), warps x 32 threads (warps <= MOST_WARPS),
// dynamic shared memory warps x ROWS x (D + 2) floats: block (head, s, z) takes rows z ROWS .. z ROWS + ROWS - 1
// of the head against keys s chunk .. s chunk + chunk - 1 (those below length). length: device_length[0] when
// device_length is not null (a CUDA graph replays the launch as the cache grows), else host_length. A chunk past
// the end, or keys no row sees, leave m = -inf, l = 0, o = 0. With one split (gridDim.y = 1) the block writes
// out = o / l itself, and the partial arrays are not used. counters: (key-value heads, ⌈rows / ROWS⌉) zeros, for
// the last block's merge, left at zero; null to leave the merge to decode_attention_combine.
// Launch bounds: with 1 or 2 rows, two blocks of MOST_WARPS warps on a multiprocessor, so at most 128 registers
// a thread and 4 blocks of 4 warps side by side; more rows need more registers (up to 255).
template <int D, int ROWS, bool VECTOR_LOADS, typename floatX = float>
__global__ void __launch_bounds__(MOST_WARPS * WARP_SIZE, ROWS <= 2 ? 2 : 1) decode_attention_partial(floatX* out,
    float* partial_out, float* partial_max, float* partial_sum, unsigned int* counters, const floatX* q,
    const floatX* keys, const floatX* values, const int* device_length, int host_length, int rows, int new_positions,
    int capacity, int chunk, int d)
{
    using Layout = KeyLayout<D, ROWS, floatX>;
    constexpr int COLUMNS = Layout::COLUMNS, LOADS = Layout::LOADS_PER_STEP, LANES_PER_KEY = Layout::LANES_PER_KEY;
    extern __shared__ __align__(16) float merge_space[];  // the warps' outputs, then their maxima, then their sums
    int warps = blockDim.x / WARP_SIZE, warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    float* warp_out = merge_space;                   // [warps][ROWS][D]
    float* warp_max = merge_space + warps * ROWS * D;  // [warps][ROWS]
    float* warp_sums = warp_max + warps * ROWS;        // [warps][ROWS]
    long long head = blockIdx.x;
    int split = blockIdx.y, splits = gridDim.y, first_row = blockIdx.z * ROWS;
    let_next_kernel_start();
    wait_for_previous_kernel();   // launched dependent: q, the cache and its length come from the kernels before
    int length = device_length != nullptr ? device_length[0] : host_length;
    int first_key = split * chunk, end_key = min(first_key + chunk, length);
    keys += head * capacity * d;
    values += head * capacity * d;
    const float scale = rsqrtf((float)d);

    // The query's columns this lane multiplies, for every row (loaded while the length is on its way).
    float query[ROWS][COLUMNS], out_part[ROWS][COLUMNS], running_max[ROWS], running_sum[ROWS];
    int last_visible[ROWS];  // the last key each row sees: its own position
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        int row = min(first_row + r, rows - 1);  // rows past the end repeat the last one and are not written
        Piece<floatX> pieces[Layout::PIECES];
        load_lane_pieces<Layout, VECTOR_LOADS>(pieces, q + (head * rows + row) * d, d, true);
        widen<Layout>(query[r], pieces);
#pragma unroll
        for (int c = 0; c < COLUMNS; c++) { query[r][c] *= scale; out_part[r][c] = 0.0f; }
        running_max[r] = NEGATIVE_INFINITY;
        running_sum[r] = 0.0f;
        last_visible[r] = length - new_positions + row % new_positions;
    }

    // Load k of lane l in a step: key step_key + k KEYS_PER_LOAD + l / LANES_PER_KEY. With VECTOR_LOADS the row
    // stride is the constant D, so that the loads of a step are one address plus constant offsets.
    const int stride = VECTOR_LOADS ? D : d;
    int lane_key = lane / LANES_PER_KEY;
    for (int step_key = first_key + warp * Layout::KEYS_PER_STEP; step_key < end_key;
         step_key += warps * Layout::KEYS_PER_STEP) {
        Piece<floatX> key[LOADS][Layout::PIECES], value[LOADS][Layout::PIECES];
        const floatX* lane_keys = keys + (long long)(step_key + lane_key) * stride;
        const floatX* lane_values = values + (long long)(step_key + lane_key) * stride;
#pragma unroll
        for (int k = 0; k < LOADS; k++) {  // every load of the step in flight before any is used
            // Positions past the length are never read: they may hold anything, or lie past the capacity.
            bool inside = step_key + k * Layout::KEYS_PER_LOAD + lane_key < end_key;
            int offset = k * Layout::KEYS_PER_LOAD * stride;
            load_lane_pieces<Layout, VECTOR_LOADS>(key[k], lane_keys + offset, d, inside);
            load_lane_pieces<Layout, VECTOR_LOADS>(value[k], lane_values + offset, d, inside);
        }
        // Scores: each key widened once for every row.
        float score[ROWS][LOADS];
#pragma unroll
        for (int k = 0; k < LOADS; k++) {
            float key_columns[COLUMNS];
            widen<Layout>(key_columns, key[k]);
            int position = step_key + k * Layout::KEYS_PER_LOAD + lane_key;
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                float dot = 0.0f;
#pragma unroll
                for (int c = 0; c < COLUMNS; c++) dot += query[r][c] * key_columns[c];
                dot = sum_over_lanes<1, LANES_PER_KEY>(dot);  // the whole score, in each of the key's lanes
                score[r][k] = position < end_key && position <= last_visible[r] ? dot : NEGATIVE_INFINITY;
            }
        }
        // The online softmax of each row over the step's keys: score[r][k] becomes p = e^(score - max).
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            float step_max = NEGATIVE_INFINITY;
#pragma unroll
            for (int k = 0; k < LOADS; k++) step_max = fmaxf(step_max, score[r][k]);
            // While the lane has seen no visible key, its maximum is -inf: e^(x - 0) then gives 0 for the
            // correction and for every p, where e^(-inf - -inf) would give NaN.
            float new_max = fmaxf(running_max[r], step_max);
            float reference = new_max == NEGATIVE_INFINITY ? 0.0f : new_max;
            float correction = __expf(running_max[r] - reference);
            running_sum[r] *= correction;
#pragma unroll
            for (int c = 0; c < COLUMNS; c++) out_part[r][c] *= correction;
#pragma unroll
            for (int k = 0; k < LOADS; k++) {
                score[r][k] = __expf(score[r][k] - reference);  // 0 for a key the row does not see
                running_sum[r] += score[r][k];
            }
            running_max[r] = new_max;
        }
        // P V: each value widened once for every row.
#pragma unroll
        for (int k = 0; k < LOADS; k++) {
            float value_columns[COLUMNS];
            widen<Layout>(value_columns, value[k]);
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
#pragma unroll
                for (int c = 0; c < COLUMNS; c++) out_part[r][c] += score[r][k] * value_columns[c];
            }
        }
    }

    // The warp's key groups merged: lanes LANES_PER_KEY apart hold the same columns for different keys.
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        float largest = max_over_lanes<LANES_PER_KEY, WARP_SIZE>(running_max[r]);
        float weight = __expf(running_max[r] - (largest == NEGATIVE_INFINITY ? 0.0f : largest));
        float sum = sum_over_lanes<LANES_PER_KEY, WARP_SIZE>(running_sum[r] * weight);
        if (lane == 0) { warp_max[warp * ROWS + r] = largest; warp_sums[warp * ROWS + r] = sum; }
#pragma unroll
        for (int c = 0; c < COLUMNS; c++) {
            float merged = sum_over_lanes<LANES_PER_KEY, WARP_SIZE>(out_part[r][c] * weight);
            int column = Layout::column(lane, c / Layout::VECTOR, c % Layout::VECTOR);
            if (lane < LANES_PER_KEY) warp_out[(warp * ROWS + r) * D + column] = merged;
        }
    }
    __syncthreads();

    // The warps merged: every thread takes some (row, column) entries of the block's.
    for (int entry = threadIdx.x; entry < ROWS * d; entry += warps * WARP_SIZE) {
        int r = entry / d, column = entry % d;
        if (first_row + r >= rows) break;  // entries run row by row: the rest are past the last row too
        float block_max = NEGATIVE_INFINITY;
        for (int w = 0; w < warps; w++) block_max = fmaxf(block_max, warp_max[w * ROWS + r]);
        float sum = 0.0f, result = 0.0f;
        if (block_max != NEGATIVE_INFINITY) {
            for (int w = 0; w < warps; w++) {
                float weight = __expf(warp_max[w * ROWS + r] - block_max);
                sum += warp_sums[w * ROWS + r] * weight;
                result += warp_out[(w * ROWS + r) * D + column] * weight;
            }
        }
        long long row = head * rows + first_row + r;
        if (splits == 1) {  // the only chunk holds key 0, which every row sees: sum > 0
            out[row * d + column] = from_float<floatX>(result / sum);
            continue;
        }
        long long partial_row = (head * splits + split) * rows + first_row + r;
        partial_out[partial_row * d + column] = result;
        if (column == 0) { partial_max[partial_row] = block_max; partial_sum[partial_row] = sum; }
    }
    if (splits == 1 || counters == nullptr) {
        return;  // one chunk wrote out; or decode_attention_combine merges the chunks
    }

    // The last block of the head's rows to finish merges the chunks, in this launch. "Last" is known from
    // atomicAdd's return value on the rows' counter; __threadfence() before it makes the block's partial
    // results visible to every other block before its count is. The merge is the same, in the same order,
    // whichever block does it. (The op passes counters where ROWS x d <= the block's threads: one element each.)
    __shared__ bool last;
    unsigned int* counter = counters + head * gridDim.z + blockIdx.z;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == (unsigned int)splits - 1;
    __syncthreads();
    if (!last) return;
    if (threadIdx.x == 0) *counter = 0;  // ready for the next launch
    for (int entry = threadIdx.x; entry < ROWS * d; entry += warps * WARP_SIZE) {
        int r = entry / d, column = entry % d;
        if (first_row + r >= rows) break;
        float merged = merged_element(partial_out, partial_max, partial_sum, head, first_row + r, column, rows,
                                      splits, d);
        out[(head * rows + first_row + r) * d + column] = from_float<floatX>(merged);
    }
}

// Second kernel, for launches without counters: one thread per element (head, r, column) of out merges that
// column of the row's chunks (merged_element). The maxima and sums of a row are read by every thread of the
// row: the same addresses, one load for the warp.
#define COMBINE_THREADS 128

template <typename floatX = float>
__global__ void __launch_bounds__(COMBINE_THREADS) decode_attention_combine(floatX* out, const float* partial_out,
    const float* partial_max, const float* partial_sum, int heads, int rows, int splits, int d)
{
    let_next_kernel_start();
    wait_for_previous_kernel();
    long long entry = (long long)blockIdx.x * COMBINE_THREADS + threadIdx.x;  // (head, r, column) of out
    if (entry >= (long long)heads * rows * d) return;
    long long head = entry / d / rows;
    int r = (int)(entry / d % rows), column = (int)(entry % d);
    out[entry] = from_float<floatX>(merged_element(partial_out, partial_max, partial_sum, head, r, column, rows,
                                                   splits, d));
}

// The new positions' keys and values, k and v (key-value heads, n, d), written into the cache (key-value
// heads, capacity, d) at positions length - n .. length - 1, length read from device memory: a CUDA graph
// replays this launch at every step of generation. One thread per element.
template <typename floatX>
__global__ void decode_attention_store(floatX* keys, floatX* values, const floatX* k, const floatX* v,
                                       const int* device_length, int heads, int new_positions, int capacity, int d)
{
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;  // the element (head, t, e) of k and v
    if (i >= (long long)heads * new_positions * d) {
        return;
    }
    int e = (int)(i % d);
    long long head = i / d / new_positions;
    int t = (int)(i / d % new_positions);
    long long position = device_length[0] - new_positions + t;
    if (position < 0 || position >= capacity) {
        return;  // a length the cache cannot hold writes nothing (the op checks it where it can: a host length)
    }
    keys[(head * capacity + position) * d + e] = k[i];
    values[(head * capacity + position) * d + e] = v[i];
}
