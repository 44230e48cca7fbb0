// Hopper's bulk tensor copies (the Tensor Memory Accelerator, TMA) and the shared-memory barriers they
// complete, through inline PTX, one instruction per wrapper. They compile only for sm_90a:
// RawModule(code, options=("-arch=sm_90a",)).
//
// A tensor map describes a 2-D array in global memory (its address, sizes, row stride) and the box one copy
// moves (rows x columns, columns contiguous, with the 128-byte swizzle that wgmma's descriptors read). The host
// makes it (gpt2_cupy.tensor_map) and passes it by value as a `const __grid_constant__ TensorMap` parameter:
// the copy engine reads it from the kernel's parameter space, by its generic address. One thread starts a
// copy of a whole box; the engine writes the box into shared memory, zeros where the box reaches past the
// array's edges, and counts the bytes it wrote against a barrier.
//
// An mbarrier is 8 bytes of shared memory that counts two things in each phase: arrivals (threads that said
// they are done) and transaction bytes (bytes that copies still have to write). The phase completes when the
// expected arrivals have come and the outstanding bytes are 0; the barrier then starts its next phase. Phases
// alternate parity 0, 1, 0, ...; a thread waits for "the phase of parity p has completed".
#ifndef GPT2_CUPY_TMA_CUH
#define GPT2_CUPY_TMA_CUH

#include "mma.cuh"

// The 128 bytes of a CUtensorMap, as the driver writes them (64-byte aligned, as the copy engine requires).
struct alignas(64) TensorMap {
    unsigned long long opaque[16];
};

// Sets up the barrier at shared address `barrier` to expect `arrivals` arrivals per phase, in phase 0.
__device__ __forceinline__ void mbarrier_init(unsigned barrier, unsigned arrivals)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(barrier), "r"(arrivals) : "memory");
}

// Makes this thread's mbarrier.init visible to the copy engine (and the rest of the cluster); a __syncthreads
// after it makes it visible to the block.
__device__ __forceinline__ void fence_mbarrier_init()
{
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// One arrival on the barrier.
__device__ __forceinline__ void mbarrier_arrive(unsigned barrier)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(barrier) : "memory");
}

// One arrival, and `bytes` more transaction bytes the current phase waits for: the copies this thread is about
// to start into memory the barrier guards.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(unsigned barrier, unsigned bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(barrier), "r"(bytes) : "memory");
}

// Whether the barrier's phase of parity `parity` has completed; the hardware may wait a while before it says
// no. A barrier just initialized is in phase 0, so waiting on parity 1 returns at once (the phase "before" it).
__device__ __forceinline__ bool mbarrier_try_wait(unsigned barrier, unsigned parity)
{
    unsigned done;
    asm volatile("{\n\t"
                 ".reg .pred complete;\n\t"
                 "mbarrier.try_wait.parity.shared::cta.b64 complete, [%1], %2;\n\t"
                 "selp.u32 %0, 1, 0, complete;\n\t"
                 "}"
                 : "=r"(done) : "r"(barrier), "r"(parity) : "memory");
    return done != 0;
}

// Waits until the barrier's phase of parity `parity` has completed. What a copy wrote before it completed a
// phase is then visible to the waiting thread, and to wgmma's reads after a wgmma_fence.
__device__ __forceinline__ void mbarrier_wait(unsigned barrier, unsigned parity)
{
    while (!mbarrier_try_wait(barrier, parity)) {
    }
}

// Starts the copy of one box of the 2-D array `map` describes: the box whose first element is column `column`
// (the contiguous dimension) of row `row`, into shared memory at `destination` (1024-byte aligned for the
// 128-byte swizzle), as the map's box and swizzle lay it out. Elements past the array's edges are written as
// zeros. The copy counts its bytes (the whole box, zeros included) against `barrier`'s transaction count.
__device__ __forceinline__ void tma_load_2d(unsigned destination, const TensorMap& map, int column, int row,
                                            unsigned barrier)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes "
                 "[%0], [%1, {%2, %3}], [%4];"
                 :: "r"(destination), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(column), "r"(row),
                    "r"(barrier)
                 : "memory");
}

#endif  // GPT2_CUPY_TMA_CUH
