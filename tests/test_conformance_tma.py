"""Conformance: Hopper's shared-memory barriers (mbarrier) and bulk tensor copies (TMA), through inline PTX.

mbarrier.init, arrive (with a count, with expect_tx, and the state-token forms), expect_tx, try_wait and
test_wait on a parity or a token, in CUTLASS's spin loop of labels and branches; cp.async.bulk.tensor.2d of
boxes described by gpt2_cupy.tensor_map (bf16 and float32, with and without the 128-byte swizzle, reaching
past the array's edges, from an array whose rows lie apart); the producer/consumer ring of stages that a
warp-specialized GEMM runs, summing what it reads and feeding wgmma (K-major and MN-major tiles); elect.sync.
On a GPU (an H100 or H200: these need compute capability 9.0, and the kernels compile for sm_90a) they check
our reading of the PTX ISA; on the CPU, that the executor runs the copies and barriers as the GPU does. The
misuses a GPU hangs or faults on are checked on the CPU, where the executor reports them.
"""

import numpy as np
import pytest

from gpt2_cupy import backend
from gpt2_cupy.tensor_map import TENSOR_MAP, tensor_map

ml_dtypes = pytest.importorskip("ml_dtypes")


def _is_hopper():
    return backend.xp.cuda.Device().compute_capability == "90"


pytestmark = pytest.mark.skipif(backend.name == "cuda" and not _is_hopper(),
                                reason="mbarrier waits on parity and TMA need compute capability 9.0 (H100, H200)")
cpu_only = pytest.mark.skipif(backend.name != "cpu",
                              reason="the executor's report of a misuse a GPU hangs or faults on")

OPTIONS = ("-arch=sm_90a",)

# Waits written as CUTLASS writes them (cutlass/arch/barrier.h, ClusterBarrier::wait): a spin loop of labels
# and branches inside one asm statement; and the state-token forms of arrive and test_wait.
WAITS = r"""
#include "tma.cuh"

__device__ __forceinline__ void spin_wait(unsigned barrier, unsigned parity)
{
    asm volatile("{\n\t"
                 ".reg .pred P1;\n\t"
                 "LAB_WAIT:\n\t"
                 "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n\t"
                 "@P1 bra DONE;\n\t"
                 "bra.uni LAB_WAIT;\n\t"
                 "DONE:\n\t"
                 "}" :: "r"(barrier), "r"(parity) : "memory");
}

// The block's ordinary writes to shared memory ordered before a copy's (the async proxy's), and the barrier,
// expecting one arrival, initialized by thread 0 for all.
__device__ __forceinline__ void start_one_arrival_barrier(unsigned barrier)
{
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    if (threadIdx.x == 0) {
        mbarrier_init(barrier, 1);
        fence_mbarrier_init();
    }
    __syncthreads();
}

__device__ __forceinline__ unsigned long long arrive_for_token(unsigned barrier, unsigned count)
{
    unsigned long long state;
    asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 %0, [%1], %2;" : "=l"(state) : "r"(barrier), "r"(count)
                 : "memory");
    return state;
}

__device__ __forceinline__ bool test_token(unsigned barrier, unsigned long long state)
{
    unsigned done;
    asm volatile("{\n\t.reg .pred p;\n\t"
                 "mbarrier.test_wait.shared::cta.b64 p, [%1], %2;\n\t"
                 "selp.b32 %0, 1, 0, p;\n\t}" : "=r"(done) : "r"(barrier), "l"(state) : "memory");
    return done != 0;
}

__device__ __forceinline__ void wait_token(unsigned barrier, unsigned long long state)
{
    asm volatile("{\n\t"
                 ".reg .pred done;\n\t"
                 "WAIT:\n\t"
                 "mbarrier.try_wait.shared::cta.b64 done, [%0], %1;\n\t"
                 "@!done bra WAIT;\n\t"
                 "}" :: "r"(barrier), "l"(state) : "memory");
}
"""


def run(code, name, grid, block, args, shared_mem=0):
    kernel = backend.RawKernel(code, name, options=OPTIONS)
    if shared_mem > kernel.max_dynamic_shared_size_bytes:
        kernel.max_dynamic_shared_size_bytes = shared_mem
    kernel(grid, block, args, shared_mem=shared_mem)


# ---------------------------------------------------------------------------------------------------------
# mbarrier phases
# ---------------------------------------------------------------------------------------------------------

PHASES = WAITS + r"""
// out[0], out[1]: a fresh barrier's try_wait on parity 1, then 0. Then `rounds` phases: every thread arrives
// (thread 0 with a count of 2: the barrier expects blockDim.x + 1) and waits, even threads on the parity in
// CUTLASS's loop, odd ones on their arrival's token. out[2 + t] counts the rounds in which thread t saw the
// phase complete after its wait, and the next phase incomplete (it needs this thread's next arrival). A test
// before the thread's own arrival is made but not counted: an H200 answered "complete" to it in rounds 0 and 4
// of 5, which the PTX ISA's description of try_wait does not explain; no kernel here waits before arriving.
extern "C" __global__ void phases(int* out, int rounds)
{
    __shared__ __align__(8) unsigned long long storage;
    const unsigned barrier = shared_address(&storage);
    if (threadIdx.x == 0) {
        mbarrier_init(barrier, blockDim.x + 1);
        fence_mbarrier_init();
        out[0] = mbarrier_try_wait(barrier, 1);
        out[1] = mbarrier_try_wait(barrier, 0);
    }
    __syncthreads();
    int right = 0;
    for (int round = 0; round < rounds; ++round) {
        const unsigned parity = round & 1;
        mbarrier_try_wait(barrier, parity);
        const unsigned long long token = arrive_for_token(barrier, threadIdx.x == 0 ? 2 : 1);
        if (threadIdx.x % 2 == 0) spin_wait(barrier, parity);
        else wait_token(barrier, token);
        const bool after = test_token(barrier, token) && mbarrier_try_wait(barrier, parity);
        const bool next = mbarrier_try_wait(barrier, parity ^ 1);
        right += after && !next;
    }
    out[2 + threadIdx.x] = right;
}
"""


def test_mbarrier_phases_parities_and_tokens():
    """A fresh barrier is in phase 0: parity 1 counts as completed, parity 0 not. Each phase completes when all
    expected arrivals have come; the next phase then waits for the next arrivals."""
    threads, rounds = 96, 5
    out = backend.xp.full(2 + threads, -1, dtype=np.int32)
    run(PHASES, "phases", (1,), (threads,), (out, np.int32(rounds)))
    got = backend.asnumpy(out)
    assert list(got[:2]) == [1, 0]
    np.testing.assert_array_equal(got[2:], rounds)


# ---------------------------------------------------------------------------------------------------------
# TMA: one box into shared memory
# ---------------------------------------------------------------------------------------------------------

BOX = WAITS + r"""

// One box of `map` at (column, row) into dynamic shared memory `offset` bytes past a 1024-byte boundary (filled
// with 0xAB first, so bytes the copy leaves alone show), then copied out byte for byte.
extern "C" __global__ void box(unsigned char* out, const __grid_constant__ TensorMap map, int column, int row,
                               int box_bytes, int offset, int expected_bytes)
{
    extern __shared__ __align__(1024) unsigned char shared[];
    __shared__ __align__(8) unsigned long long storage;
    const unsigned base = ((shared_address(shared) + 1023) & ~1023u) + offset;
    unsigned char* tile = shared + (base - shared_address(shared));
    const unsigned barrier = shared_address(&storage);
    for (int i = threadIdx.x; i < box_bytes; i += blockDim.x) tile[i] = 0xAB;
    start_one_arrival_barrier(barrier);
    if (threadIdx.x == 0) {
        asm volatile("prefetch.tensormap [%0];" :: "l"(reinterpret_cast<unsigned long long>(&map)) : "memory");
        mbarrier_arrive_expect_tx(barrier, expected_bytes);
        tma_load_2d(base, map, column, row, barrier);
    }
    mbarrier_wait(barrier, 0);
    for (int i = threadIdx.x; i < box_bytes; i += blockDim.x) out[i] = tile[i];
}
"""


def expected_box(array, row, column, box_rows, box_columns, swizzle, offset=0):
    """The bytes of the box as the copy writes them: elements outside the array as zeros, rows of box_columns
    elements one after another and, with the 128-byte swizzle, the 16-byte chunk c of the row at shared
    address A moved to chunk c ^ ((A >> 7) % 8): for a box `offset` bytes past 1024, row r's chunks by
    (offset / 128 + r) % 8."""
    box = np.zeros((box_rows, box_columns), dtype=array.dtype)
    rows = np.arange(row, row + box_rows)
    columns = np.arange(column, column + box_columns)
    inside_rows = (rows >= 0) & (rows < array.shape[0])
    inside_columns = (columns >= 0) & (columns < array.shape[1])
    box[np.ix_(inside_rows, inside_columns)] = array[np.ix_(rows[inside_rows], columns[inside_columns])]
    data = box.view(np.uint8).reshape(box_rows, -1)
    if swizzle == 0:
        return data.reshape(-1)
    chunks = data.reshape(box_rows, -1, 16)
    swizzled = np.empty_like(chunks)
    for r in range(box_rows):
        for c in range(chunks.shape[1]):
            swizzled[r, c ^ ((offset // 128 + r) % 8)] = chunks[r, c]
    return swizzled.reshape(-1)


def copy_box(array, row, column, box_rows, box_columns, swizzle, offset=0, expected_bytes=None, map_bytes=None,
             shared_mem=None):
    """The bytes the kernel finds in shared memory after copying the box of the device array (launched with room
    for the box, or with `shared_mem` bytes)."""
    box_bytes = box_rows * box_columns * array.dtype.itemsize
    out = backend.xp.zeros(box_bytes, dtype=np.uint8)
    map_ = tensor_map(array, box_rows, box_columns, swizzle) if map_bytes is None else map_bytes
    run(BOX, "box", (1,), (128,), (out, map_, np.int32(column), np.int32(row), np.int32(box_bytes),
                                   np.int32(offset), np.int32(box_bytes if expected_bytes is None else expected_bytes)),
        shared_mem=2048 + offset + box_bytes if shared_mem is None else shared_mem)
    return backend.asnumpy(out)


def bf16_bits(rng, shape):
    return rng.standard_normal(shape).astype(ml_dtypes.bfloat16).view(np.uint16)


@pytest.mark.parametrize("swizzle", [128, 0])
@pytest.mark.parametrize("box_rows", [64, 128, 256])
def test_bf16_boxes_of_64_columns(box_rows, swizzle, rng):
    """uint16 (bf16 bits) boxes of 64 columns (128-byte rows) inside a larger array, as wgmma's K-major tiles."""
    array = bf16_bits(rng, (300, 200))
    device = backend.xp.asarray(array)
    got = copy_box(device, 17, 72, box_rows, 64, swizzle)
    np.testing.assert_array_equal(got, expected_box(array, 17, 72, box_rows, 64, swizzle))


@pytest.mark.parametrize("swizzle", [128, 0])
def test_float32_boxes_of_32_columns(swizzle, rng):
    array = rng.standard_normal((100, 96)).astype(np.float32)
    got = copy_box(backend.xp.asarray(array), 30, 40, 64, 32, swizzle)
    np.testing.assert_array_equal(got, expected_box(array, 30, 40, 64, 32, swizzle))


@pytest.mark.parametrize("row, column", [(70, 144), (-5, -24), (-64, 0), (90, -8)],
                         ids=["past the bottom right", "negative", "wholly above", "bottom left"])
@pytest.mark.parametrize("swizzle", [128, 0])
def test_boxes_past_the_edges_read_zeros(row, column, swizzle, rng):
    """A box reaching past the array's right or bottom edge, or starting at negative coordinates: the elements
    outside the array are written as zeros, and the whole box still counts its bytes (the wait completes)."""
    array = bf16_bits(rng, (100, 176))
    got = copy_box(backend.xp.asarray(array), row, column, 64, 64, swizzle)
    np.testing.assert_array_equal(got, expected_box(array, row, column, 64, 64, swizzle))


@pytest.mark.skipif(backend.name == "cuda", reason="an H200 stops with an illegal instruction, which poisons the process's CUDA context")
def test_a_box_off_16_bytes_along_its_rows_fails_the_launch(rng):
    """A box whose innermost coordinate puts its first element off 16 bytes (column 3 of bf16: byte 6) fails the
    launch with a message saying so, where a GPU stops with an illegal instruction."""
    from gpt2_cupy.cpu import KernelError
    array = backend.xp.asarray(bf16_bits(rng, (64, 64)))
    with pytest.raises(KernelError, match="innermost coordinate"):
        copy_box(array, 0, 3, 8, 64, 128)


def test_a_column_slice_copies_with_its_row_stride(rng):
    """An array whose rows lie apart (64 columns of a 200-column array): the map's row stride, not its width,
    steps from row to row, and the columns past the slice's last are outside it (zeros), not its neighbours."""
    wide = bf16_bits(rng, (128, 200))
    device = backend.xp.asarray(wide)[:, 8:72]
    got = copy_box(device, 32, 16, 64, 64, 128)
    np.testing.assert_array_equal(got, expected_box(wide[:, 8:72], 32, 16, 64, 64, 128))


def test_the_swizzle_follows_the_shared_address(rng):
    """A destination 3 x 128 bytes past a 1024-byte boundary: the swizzle XORs each chunk with the shared
    address's bits 7-9, so row r's chunks move by (3 + r) % 8, not by r % 8."""
    array = bf16_bits(rng, (64, 64))
    got = copy_box(backend.xp.asarray(array), 0, 0, 64, 64, 128, offset=384)
    np.testing.assert_array_equal(got, expected_box(array, 0, 0, 64, 64, 128, offset=384))


BULK = WAITS + r"""

// cp.async.bulk: `bytes` contiguous bytes of `source` into shared memory (filled with 0xAB first), completing
// the barrier's transactions by mbarrier.expect_tx and a plain arrival; then copied out byte for byte.
extern "C" __global__ void bulk(unsigned char* out, const unsigned char* source, int bytes, int room)
{
    extern __shared__ __align__(128) unsigned char tile[];
    __shared__ __align__(8) unsigned long long storage;
    const unsigned barrier = shared_address(&storage);
    for (int i = threadIdx.x; i < room; i += blockDim.x) tile[i] = 0xAB;
    start_one_arrival_barrier(barrier);
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" :: "r"(barrier), "r"(bytes) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     :: "r"(shared_address(tile)), "l"(source), "r"(bytes), "r"(barrier) : "memory");
        mbarrier_arrive(barrier);
    }
    mbarrier_wait(barrier, 0);
    for (int i = threadIdx.x; i < room; i += blockDim.x) out[i] = tile[i];
}
"""


def test_a_plain_bulk_copy_moves_contiguous_bytes(rng):
    """1008 bytes (a multiple of 16) land as they are; the bytes after them keep what was there."""
    source = rng.integers(0, 256, 1024).astype(np.uint8)
    out = backend.xp.zeros(1024, dtype=np.uint8)
    run(BULK, "bulk", (1,), (64,), (out, backend.xp.asarray(source), np.int32(1008), np.int32(1024)), shared_mem=1024)
    np.testing.assert_array_equal(backend.asnumpy(out), np.concatenate([source[:1008], np.full(16, 0xAB, np.uint8)]))


# ---------------------------------------------------------------------------------------------------------
# The producer/consumer ring of a warp-specialized GEMM
# ---------------------------------------------------------------------------------------------------------

RING_COMMON = r"""
#include "tma.cuh"
#include "wgmma.cuh"

constexpr int STAGES = 3;

// Warpgroup 0 produces (its thread 0 issues the copies), warpgroups 1 and 2 consume. full[s]: stage s holds
// this round's tiles (one arrival, the producer's, and the copies' bytes); empty[s]: both consumer warpgroups
// are done with it (256 arrivals). Round k uses stage k % STAGES on its (k / STAGES)-th pass: the consumers
// wait on full's parity pass % 2, the producer on empty's parity (pass % 2) ^ 1, which a fresh barrier
// passes at once on the first pass.
struct Ring {
    unsigned full[STAGES], empty[STAGES];

    __device__ void start(unsigned long long (&storage)[2 * STAGES])
    {
        for (int s = 0; s < STAGES; ++s) {
            full[s] = shared_address(&storage[s]);
            empty[s] = shared_address(&storage[STAGES + s]);
        }
        if (threadIdx.x == 0) {
            for (int s = 0; s < STAGES; ++s) {
                mbarrier_init(full[s], 1);
                mbarrier_init(empty[s], 256);
            }
            fence_mbarrier_init();
        }
        __syncthreads();
    }
};
"""

RING_SUM = RING_COMMON + r"""
// Each round the producer copies rows 64 k .. 64 k + 63 of a 32-column float32 array into its stage; thread
// t of each consumer warpgroup adds element i (weighted by i % 7 + 1) of the stage for each i = t mod 128.
// With skip_wait, warpgroup 2 reads each stage without waiting for it.
extern "C" __global__ void ring_sum(float* sums, const __grid_constant__ TensorMap map, int rounds, int skip_wait)
{
    constexpr int STAGE_FLOATS = 64 * 32, STAGE_BYTES = STAGE_FLOATS * 4;
    extern __shared__ __align__(1024) unsigned char shared[];
    __shared__ __align__(8) unsigned long long storage[2 * STAGES];
    const unsigned base = (shared_address(shared) + 1023) & ~1023u;
    const float* stages = reinterpret_cast<const float*>(shared + (base - shared_address(shared)));
    Ring ring;
    ring.start(storage);
    const int warpgroup = threadIdx.x / 128, t = threadIdx.x % 128;
    if (warpgroup == 0) {
        if (threadIdx.x == 0) {
            for (int round = 0; round < rounds; ++round) {
                const int s = round % STAGES, pass = round / STAGES;
                mbarrier_wait(ring.empty[s], (pass % 2) ^ 1);
                mbarrier_arrive_expect_tx(ring.full[s], STAGE_BYTES);
                tma_load_2d(base + s * STAGE_BYTES, map, 0, 64 * round, ring.full[s]);
            }
        }
        return;
    }
    float sum = 0.0f;
    for (int round = 0; round < rounds; ++round) {
        const int s = round % STAGES, pass = round / STAGES;
        if (!(skip_wait && warpgroup == 2)) mbarrier_wait(ring.full[s], pass % 2);
        for (int i = t; i < STAGE_FLOATS; i += 128) sum += stages[s * STAGE_FLOATS + i] * (float)(i % 7 + 1);
        mbarrier_arrive(ring.empty[s]);
    }
    sums[(warpgroup - 1) * 128 + t] = sum;
}
"""


def ring_sum_expected(array, rounds):
    """float64 sums (exact in float32 for small integers) of what each consumer thread reads."""
    stages = array[:64 * rounds].reshape(rounds, 64 * 32).astype(np.float64)
    weights = np.arange(64 * 32) % 7 + 1
    per_thread = (stages * weights).reshape(rounds, 16, 128).sum(axis=(0, 1))
    return np.concatenate([per_thread, per_thread])


def launch_ring_sum(array, rounds, skip_wait=0):
    sums = backend.xp.zeros(256, dtype=np.float32)
    device = backend.xp.asarray(array)
    run(RING_SUM, "ring_sum", (1,), (384,), (sums, tensor_map(device, 64, 32, swizzle=0), np.int32(rounds),
                                              np.int32(skip_wait)), shared_mem=1024 + 3 * 64 * 32 * 4)
    return backend.asnumpy(sums)


def test_a_ring_of_three_stages_feeds_two_consumer_warpgroups(rng):
    """One producer thread, 3 stages, 10 rounds (each stage reused 3 or 4 times): each consumer sees each
    round's rows exactly once, whichever order the threads run in."""
    rounds = 10
    array = rng.integers(-8, 9, (64 * rounds, 32)).astype(np.float32)
    np.testing.assert_array_equal(launch_ring_sum(array, rounds), ring_sum_expected(array, rounds))


RING_WGMMA = RING_COMMON + r"""
// D (128 x 128) = A B^T through the ring: each consumer warpgroup multiplies its 64 rows of A by all of B with
// wgmma m64n128k16, four steps of k per 64-wide tile. K-major (MN_MAJOR 0): A (128 x K) and B (128 x K), one
// box of 64 columns (k) x 128 rows each a round, read through matrix_descriptor_128b. MN-major (MN_MAJOR 1):
// A^T (K x 128) and B^T (K x 128), two boxes of 64 columns (m, or n) x 64 rows (k) each a round, read with
// imm-trans 1 through matrix_descriptor_128b_mn (8192 bytes from one box of 64 columns to the next, 1024 from
// one group of 8 rows of k to the next).
extern "C" __global__ void ring_wgmma(float* D, const __grid_constant__ TensorMap a_map,
                                      const __grid_constant__ TensorMap b_map, int rounds)
{
    constexpr int TILE_BYTES = 128 * 64 * 2, STAGE_BYTES = 2 * TILE_BYTES;
    extern __shared__ __align__(1024) unsigned char shared[];
    __shared__ __align__(8) unsigned long long storage[2 * STAGES];
    const unsigned base = (shared_address(shared) + 1023) & ~1023u;
    Ring ring;
    ring.start(storage);
    const int warpgroup = threadIdx.x / 128;
    if (warpgroup == 0) {
        if (threadIdx.x == 0) {
            for (int round = 0; round < rounds; ++round) {
                const int s = round % STAGES, pass = round / STAGES;
                const unsigned a_tile = base + s * STAGE_BYTES, b_tile = a_tile + TILE_BYTES;
                mbarrier_wait(ring.empty[s], (pass % 2) ^ 1);
                mbarrier_arrive_expect_tx(ring.full[s], STAGE_BYTES);
#if MN_MAJOR
                for (int half = 0; half < 2; ++half) {
                    tma_load_2d(a_tile + half * 8192, a_map, 64 * half, 64 * round, ring.full[s]);
                    tma_load_2d(b_tile + half * 8192, b_map, 64 * half, 64 * round, ring.full[s]);
                }
#else
                tma_load_2d(a_tile, a_map, 64 * round, 0, ring.full[s]);
                tma_load_2d(b_tile, b_map, 64 * round, 0, ring.full[s]);
#endif
            }
        }
        return;
    }
    const int m_half = warpgroup - 1;
    float d[64];
    for (int i = 0; i < 64; ++i) d[i] = 0.0f;
    fence_accumulators(d);
    for (int round = 0; round < rounds; ++round) {
        const int s = round % STAGES, pass = round / STAGES;
        const unsigned a_tile = base + s * STAGE_BYTES, b_tile = a_tile + TILE_BYTES;
        mbarrier_wait(ring.full[s], pass % 2);
        wgmma_fence();
        for (int step = 0; step < 4; ++step) {
#if MN_MAJOR
            const unsigned long long a = matrix_descriptor_128b_mn(a_tile + m_half * 8192 + step * 2048, 8192, 1024);
            const unsigned long long b = matrix_descriptor_128b_mn(b_tile + step * 2048, 8192, 1024);
            wgmma_m64n128k16_bf16<1, 1>(d, a, b);
#else
            const unsigned long long a = matrix_descriptor_128b(a_tile + m_half * 64 * 128 + step * 32);
            const unsigned long long b = matrix_descriptor_128b(b_tile + step * 32);
            wgmma_m64n128k16_bf16(d, a, b);
#endif
        }
        wgmma_commit_group();
        wgmma_wait_group<0>();
        fence_accumulators(d);
        mbarrier_arrive(ring.empty[s]);
    }
    const int warp = threadIdx.x % 128 / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    for (int i = 0; i < 64; ++i)
        D[(64 * m_half + 16 * warp + g + 8 * (i / 2 % 2)) * 128 + 8 * (i / 4) + 2 * t + i % 2] = d[i];
}
"""


@pytest.mark.parametrize("mn_major", [False, True], ids=["K-major", "MN-major"])
def test_the_ring_feeds_wgmma_from_tma_tiles(mn_major, rng):
    """D = A B^T for A, B of small integers (every sum exact in float32, so compared bit for bit with float64),
    K = 320: five rounds through the three stages. A wrong box, swizzle or descriptor reads the wrong element."""
    rounds, k = 5, 320
    a = rng.integers(-4, 5, (128, k)).astype(np.float32)
    b = rng.integers(-4, 5, (128, k)).astype(np.float32)
    xp = backend.xp
    if mn_major:   # m (n) contiguous: the transposes, copied by boxes of 64 columns x 64 rows of k
        a_device, b_device = (xp.asarray(np.ascontiguousarray(x.T).astype(ml_dtypes.bfloat16).view(np.uint16))
                              for x in (a, b))
        maps = (tensor_map(a_device, 64, 64), tensor_map(b_device, 64, 64))
    else:          # k contiguous: boxes of 64 columns of k x 128 rows
        a_device, b_device = (xp.asarray(x.astype(ml_dtypes.bfloat16).view(np.uint16)) for x in (a, b))
        maps = (tensor_map(a_device, 128, 64), tensor_map(b_device, 128, 64))
    out = xp.full((128, 128), np.nan, dtype=np.float32)
    code = f"#define MN_MAJOR {int(mn_major)}\n" + RING_WGMMA
    run(code, "ring_wgmma", (1,), (384,), (out, *maps, np.int32(rounds)), shared_mem=1024 + 3 * 2 * 128 * 64 * 2)
    np.testing.assert_array_equal(backend.asnumpy(out), a.astype(np.float64) @ b.T.astype(np.float64))


# ---------------------------------------------------------------------------------------------------------
# elect.sync
# ---------------------------------------------------------------------------------------------------------

ELECT = r"""
// Each lane of the warp's odd lanes (mask 0xAAAAAAAA) and then all 32 (mask 0xFFFFFFFF) elect one: the lowest
// lane of the mask, which alone gets the predicate.
extern "C" __global__ void elect(int* leaders, int* elected)
{
    const unsigned lane = threadIdx.x % 32;
    if (lane % 2 == 1) {
        unsigned leader, chosen;
        asm volatile("{\n\t.reg .pred p;\n\t"
                     "elect.sync %0|p, 0xAAAAAAAA;\n\t"
                     "selp.u32 %1, 1, 0, p;\n\t}" : "=r"(leader), "=r"(chosen));
        leaders[lane] = leader;
        elected[lane] = chosen;
    }
    __syncwarp();
    unsigned chosen;
    asm volatile("{\n\t.reg .pred p;\n\t"
                 "elect.sync _|p, 0xFFFFFFFF;\n\t"
                 "selp.u32 %0, 1, 0, p;\n\t}" : "=r"(chosen));
    elected[32 + lane] = chosen;
}
"""


def test_elect_sync_elects_the_lowest_lane_of_the_mask():
    leaders = backend.xp.full(32, -1, dtype=np.int32)
    elected = backend.xp.full(64, -1, dtype=np.int32)
    run(ELECT, "elect", (1,), (32,), (leaders, elected))
    odd = np.arange(1, 32, 2)
    np.testing.assert_array_equal(backend.asnumpy(leaders)[odd], 1)
    np.testing.assert_array_equal(backend.asnumpy(elected)[odd], (odd == 1).astype(np.int32))
    np.testing.assert_array_equal(backend.asnumpy(elected)[32:], (np.arange(32) == 0).astype(np.int32))


# ---------------------------------------------------------------------------------------------------------
# Misuses: the executor stops the launch (a GPU hangs or faults), or refuses to compile
# ---------------------------------------------------------------------------------------------------------

NEVER_COMPLETES = r"""
#include "tma.cuh"

// The barrier expects blockDim.x + 1 arrivals; only blockDim.x come.
extern "C" __global__ void never(int* out)
{
    extern __shared__ __align__(1024) unsigned char shared[];
    const unsigned barrier = shared_address(shared) + 64;
    if (threadIdx.x == 0) mbarrier_init(barrier, blockDim.x + 1);
    __syncthreads();
    mbarrier_arrive(barrier);
    mbarrier_wait(barrier, 0);
    out[threadIdx.x] = 1;
}
"""


@cpu_only
def test_a_wait_that_never_completes_fails_the_launch_naming_barrier_and_parity():
    from gpt2_cupy.cpu import KernelError
    with pytest.raises(KernelError, match=r"(?s)deadlock.*parity 0.*shared offset 64"):
        run(NEVER_COMPLETES, "never", (1,), (64,), (backend.xp.zeros(64, dtype=np.int32),), shared_mem=1024)


@cpu_only
def test_an_expect_tx_larger_than_the_box_never_completes(rng):
    """16 bytes expected beyond the box's: the copy lands, the phase waits for bytes that never come."""
    from gpt2_cupy.cpu import KernelError
    array = backend.xp.asarray(bf16_bits(rng, (64, 64)))
    with pytest.raises(KernelError, match=r"(?s)deadlock.*16 transaction bytes still to come"):
        copy_box(array, 0, 0, 64, 64, 128, expected_bytes=64 * 64 * 2 + 16)


@cpu_only
def test_an_expect_tx_smaller_than_the_box_is_reported(rng):
    from gpt2_cupy.cpu import KernelError
    array = backend.xp.asarray(bf16_bits(rng, (64, 64)))
    with pytest.raises(KernelError, match="more transaction bytes than its phase expects"):
        copy_box(array, 0, 0, 64, 64, 128, expected_bytes=64 * 64 * 2 - 128)


@cpu_only
def test_a_map_not_made_by_tensor_map_is_refused(rng):
    from gpt2_cupy.cpu import KernelError
    array = backend.xp.asarray(bf16_bits(rng, (64, 64)))
    with pytest.raises(KernelError, match="make it with gpt2_cupy.tensor_map"):
        copy_box(array, 0, 0, 64, 64, 128, map_bytes=np.zeros((), dtype=TENSOR_MAP)[()])


@cpu_only
def test_a_destination_off_128_bytes_is_refused(rng):
    from gpt2_cupy.cpu import KernelError
    array = backend.xp.asarray(bf16_bits(rng, (64, 64)))
    with pytest.raises(KernelError, match="destination is not a multiple of 128 bytes"):
        copy_box(array, 0, 0, 64, 64, 0, offset=64)


@cpu_only
def test_a_box_past_the_end_of_shared_memory_is_refused(rng):
    from gpt2_cupy.cpu import KernelError
    array = backend.xp.asarray(bf16_bits(rng, (256, 64)))
    # (the kernel's own fill of the box's bytes runs past the 16 KiB before the copy: either stops the launch)
    with pytest.raises(KernelError, match="(past|right at) the end of the( block's)? dynamic shared memory"):
        copy_box(array, 0, 0, 256, 64, 128, shared_mem=16 * 1024)


MISUSED_BARRIER = r"""
#include "tma.cuh"

extern "C" __global__ void misuse(int how)
{
    __shared__ __align__(8) unsigned long long storage;
    const unsigned barrier = shared_address(&storage);
    if (how == 0) {                      // used before mbarrier.init
        mbarrier_arrive(barrier);
        return;
    }
    if (threadIdx.x == 0) mbarrier_init(barrier, 2);
    __syncthreads();
    if (how == 1) {                      // three arrivals on a phase of two
        if (threadIdx.x < 3) mbarrier_arrive_expect_tx(barrier, 16);
        return;
    }
    if (how == 2 && threadIdx.x == 0) mbarrier_init(barrier + 4, 1);   // not on 8 bytes
    if (how == 3 && threadIdx.x == 0) mbarrier_init(0x12345678u, 1);   // not shared memory
    if (how == 4) {                      // used after mbarrier.inval
        if (threadIdx.x == 0) asm volatile("mbarrier.inval.shared::cta.b64 [%0];" :: "r"(barrier) : "memory");
        __syncthreads();
        mbarrier_arrive(barrier);
    }
}
"""


@cpu_only
@pytest.mark.parametrize("how, words", [(0, "before mbarrier.init"), (1, "more arrivals"),
                                        (2, "not a multiple of 8 bytes"), (3, "not a shared-memory address"),
                                        (4, "after mbarrier.inval")])
def test_barrier_misuses_are_reported(how, words):
    from gpt2_cupy.cpu import KernelError
    with pytest.raises(KernelError, match=words):
        run(MISUSED_BARRIER, "misuse", (1,), (32,), (np.int32(how),))


@cpu_only
@pytest.mark.parametrize("instruction", ["cp.async.bulk.prefetch.tensor.2d.L2.global [%1, {%0, %0}];",
                                         "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%1, {%0, %0}], [%0];",
                                         "mbarrier.arrive.noComplete.shared::cta.b64 _, [%0], 1;"])
def test_other_bulk_copies_and_barrier_forms_are_compile_errors_naming_them(instruction):
    from gpt2_cupy.cpu import CompileError
    code = ('extern "C" __global__ void other(unsigned a, unsigned long long m) '
            f'{{ asm volatile("{instruction}" :: "r"(a), "l"(m) : "memory"); }}')
    with pytest.raises(CompileError, match=instruction.split()[0].replace(".", r"\.")):
        backend.RawKernel(code, "other", options=OPTIONS).compile()


SETMAXNREG = r"""
extern "C" __global__ void registers(int* out)
{
    asm volatile("setmaxnreg.dec.sync.aligned.u32 COUNT;" ::: "memory");
    out[threadIdx.x] = 1;
}
"""


@cpu_only
def test_setmaxnreg_compiles_for_counts_nvrtc_takes_and_refuses_others():
    """A multiple of 8 in 24 .. 256, for sm_90a only, as NVRTC takes it; no effect on the CPU."""
    from gpt2_cupy.cpu import CompileError
    out = backend.xp.zeros(128, dtype=np.int32)
    run(SETMAXNREG.replace("COUNT", "40"), "registers", (1,), (128,), (out,))
    np.testing.assert_array_equal(backend.asnumpy(out), 1)
    for count in (100, 16, 264):
        with pytest.raises(CompileError, match=f"multiple of 8 in 24 .. 256, got {count}"):
            backend.RawKernel(SETMAXNREG.replace("COUNT", str(count)), "registers", options=OPTIONS).compile()
    with pytest.raises(CompileError, match="needs the architecture sm_90a"):
        backend.RawKernel(SETMAXNREG.replace("COUNT", "40"), "registers").compile()


# ---------------------------------------------------------------------------------------------------------
# The race check: barrier waits order a copy's writes before the reads, arrivals order reads before the
# next copy into the stage
# ---------------------------------------------------------------------------------------------------------

@cpu_only
def test_the_ring_passes_the_race_check(rng):
    """Every stage is written by a copy after both consumers arrived on its empty barrier, and read after the
    full barrier's wait: nothing races, in either order of the threads."""
    rounds = 7
    array = rng.integers(-8, 9, (64 * rounds, 32)).astype(np.float32)
    with backend.checks(races=True):
        got = launch_ring_sum(array, rounds)
    np.testing.assert_array_equal(got, ring_sum_expected(array, rounds))


@cpu_only
@pytest.mark.parametrize("mn_major", [False, True], ids=["K-major", "MN-major"])
def test_the_ring_feeding_wgmma_passes_the_race_check(mn_major, rng):
    with backend.checks(races=True):
        test_the_ring_feeds_wgmma_from_tma_tiles(mn_major, rng)


@cpu_only
def test_a_consumer_that_reads_a_stage_without_waiting_is_a_race(rng):
    from gpt2_cupy.cpu import RaceError
    array = rng.integers(-8, 9, (64 * 3, 32)).astype(np.float32)   # one round per stage: no stage is reused
    with pytest.raises(RaceError, match="race on shared memory"), backend.checks(races=True):
        launch_ring_sum(array, 3, skip_wait=1)


EARLY_READ = WAITS + r"""

// The box is copied into a tile of -1s; every thread reads its elements before any thread waits on the barrier,
// then after its wait.
extern "C" __global__ void early_read(float* before, float* after, const __grid_constant__ TensorMap map)
{
    extern __shared__ __align__(1024) unsigned char shared[];
    __shared__ __align__(8) unsigned long long storage;
    const unsigned base = (shared_address(shared) + 1023) & ~1023u;
    float* tile = reinterpret_cast<float*>(shared + (base - shared_address(shared)));
    const unsigned barrier = shared_address(&storage);
    for (int i = threadIdx.x; i < 64 * 32; i += blockDim.x) tile[i] = -1.0f;
    start_one_arrival_barrier(barrier);
    if (threadIdx.x == 0) {
        mbarrier_arrive_expect_tx(barrier, 64 * 32 * 4);
        tma_load_2d(base, map, 0, 0, barrier);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 64 * 32; i += blockDim.x) before[i] = tile[i];
    __syncthreads();
    mbarrier_wait(barrier, 0);
    for (int i = threadIdx.x; i < 64 * 32; i += blockDim.x) after[i] = tile[i];
}
"""


@cpu_only
def test_a_copy_lands_only_when_its_barrier_is_tested(rng):
    """A GPU may land the copy any time before the wait sees its phase complete; the executor lands it at the
    latest moment, the wait, so a kernel that reads the tile without waiting reads what was there before."""
    array = rng.integers(0, 9, (64, 32)).astype(np.float32)
    before, after = (backend.xp.zeros(64 * 32, dtype=np.float32) for _ in range(2))
    run(EARLY_READ, "early_read", (1,), (128,), (before, after, tensor_map(backend.xp.asarray(array), 64, 32, 0)),
        shared_mem=2048 + 64 * 32 * 4)
    np.testing.assert_array_equal(backend.asnumpy(before), -1.0)
    np.testing.assert_array_equal(backend.asnumpy(after), array.reshape(-1))
