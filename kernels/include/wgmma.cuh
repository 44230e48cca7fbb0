// Hopper's warpgroup tensor-core instructions through inline PTX, written once, one instruction per wrapper
// as in mma.cuh (whose shared_address and cp.async wrappers the wgmma kernel uses too). They compile only
// for the architecture sm_90a: RawModule(code, options=("-arch=sm_90a",)).
//
// A warpgroup is four consecutive warps: threads 128w .. 128w + 127 of a block. Its 128 threads execute each
// wgmma instruction together (.sync.aligned), with the same operands. wgmma.mma_async reads A and B from
// shared memory itself, through 64-bit matrix descriptors, and returns before the product is done; the
// accumulator D stays spread over the 128 threads' registers.
#ifndef GPT2_CUPY_WGMMA_CUH
#define GPT2_CUPY_WGMMA_CUH

#include "mma.cuh"

// The descriptor of a K-major tile in shared memory, written by rows of 128 bytes (64 bf16, or 32 float32
// read as TF32) with the 128-byte swizzle: 16-byte chunk c of row r sits at chunk c ^ (r % 8) of that row.
// `address` is the shared address of the tile's first element of k, for a tile that starts on 1024 bytes
// (8 rows: one repeat of the swizzle pattern), plus 32 bytes per step along k (16 bf16, or 8 TF32). The
// fields (PTX ISA, "Matrix Descriptor Format"), each byte count divided by 16:
//   bits  0-13  start address                  address bits 4-17
//   bits 16-29  leading dimension byte offset  unused by K-major swizzled tiles (16 by convention)
//   bits 32-45  stride dimension byte offset   1024: from one group of 8 rows to the next
//   bits 49-51  matrix base offset             0: the tile starts at a repeat of the swizzle pattern
//   bits 62-63  swizzle mode                   1: 128-byte (2: 64-byte, 3: 32-byte, 0: none)
__device__ __forceinline__ unsigned long long matrix_descriptor_128b(unsigned address)
{
    return (unsigned long long)((address & 0x3FFFF) >> 4)
         | (unsigned long long)(16 >> 4) << 16
         | (unsigned long long)(1024 >> 4) << 32
         | 1ull << 62;
}

// The descriptor of an MN-major tile (imm-trans 1: m of A, or n of B, contiguous) in the 128-byte swizzle:
// for each k a row of 128 bytes holds 64 consecutive values of m (or n), chunk c (values 8c .. 8c + 7) of the
// row for k at chunk c ^ (k % 8). Eight such rows (k .. k + 7) make one 1024-byte swizzle atom of 64 x 8.
//   bits 16-29  leading dimension byte offset  leading_bytes: from one atom to the next 64 values of m (n)
//   bits 32-45  stride dimension byte offset   stride_bytes: from one atom to the next 8 values of k
// `address` is the first atom's, on 1024 bytes.
__device__ __forceinline__ unsigned long long matrix_descriptor_128b_mn(unsigned address, unsigned leading_bytes,
                                                                        unsigned stride_bytes)
{
    return (unsigned long long)((address & 0x3FFFF) >> 4)
         | (unsigned long long)(leading_bytes >> 4) << 16
         | (unsigned long long)(stride_bytes >> 4) << 32
         | 1ull << 62;
}

// Orders this thread's earlier writes to its registers and to shared memory before the wgmma.mma_async
// that follow; needed before the first one and whenever other instructions touched its accumulators.
__device__ __forceinline__ void wgmma_fence()
{
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}

// Shared memory written the ordinary way (st.shared, cp.async) becomes visible to the tensor cores' own
// reads (the "async proxy") after this fence by the writing thread, and a barrier.
__device__ __forceinline__ void fence_proxy_async_shared()
{
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// The accumulator of the wrappers below, written once per width: D's COUNT registers (COUNT = N / 2 for
// m64nN) as the instruction's first operand, "{%0, %1, ..., %COUNT-1}", and as the asm statement's outputs,
// each read and written ("+f"). The descriptors and immediates follow as %COUNT, %COUNT+1, ...
#define WGMMA_D64_REGISTERS \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WGMMA_D64_TEXT "{" WGMMA_D64_REGISTERS "}"
#define WGMMA_D128_TEXT \
    "{" WGMMA_D64_REGISTERS ", " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127" \
    "}"

#define WGMMA_D64_OPERANDS(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define WGMMA_D128_OPERANDS(d) \
    WGMMA_D64_OPERANDS(d), \
    "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
    "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
    "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
    "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
    "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
    "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
    "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
    "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

// d += a b for a 64 x N x 16 tile (N = 256 or 128), a 64 x 16 and b 16 x N, both bf16 from shared memory by
// descriptor; d is float32, N / 2 registers per thread. TRANSPOSE_A, TRANSPOSE_B (the PTX operands
// imm-trans-a, imm-trans-b; bf16 allows both): 0 for a K-major tile (a's rows, and b's columns stored as
// rows "TN", hold their k contiguous), 1 for an MN-major one (for each k, a's m, or b's n, contiguous).
// Warp w of the warpgroup holds rows 16w .. 16w + 15 of d; with g = lane / 4 and t = lane % 4, its d[i] is
//   row 16w + g + 8 ((i / 2) % 2), column 8 (i / 4) + 2t + i % 2
// (mma.sync's m16n8 accumulator, d[0..3], repeated for each 8 columns). The operands after the descriptors:
// scale-d 1 (add to d), imm-scale-a and imm-scale-b 1 (no negation), then the two transposes.
template <int TRANSPOSE_A = 0, int TRANSPOSE_B = 0>
__device__ __forceinline__ void wgmma_m64n256k16_bf16(float (&d)[128], unsigned long long a_descriptor,
                                                      unsigned long long b_descriptor)
{
    asm volatile("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
                 WGMMA_D128_TEXT ", %128, %129, 1, 1, 1, %130, %131;"
                 : WGMMA_D128_OPERANDS(d)
                 : "l"(a_descriptor), "l"(b_descriptor), "n"(TRANSPOSE_A), "n"(TRANSPOSE_B));
}

template <int TRANSPOSE_A = 0, int TRANSPOSE_B = 0>
__device__ __forceinline__ void wgmma_m64n128k16_bf16(float (&d)[64], unsigned long long a_descriptor,
                                                      unsigned long long b_descriptor)
{
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                 WGMMA_D64_TEXT ", %64, %65, 1, 1, 1, %66, %67;"
                 : WGMMA_D64_OPERANDS(d)
                 : "l"(a_descriptor), "l"(b_descriptor), "n"(TRANSPOSE_A), "n"(TRANSPOSE_B));
}

// d += a b for a 64 x N x 8 tile (N = 256 or 128) from float32 a (64 x 8) and b (8 x N) in shared memory,
// read as TF32: the tensor core takes each value's sign, exponent and top 10 mantissa bits (its upper 19
// bits) and ignores the low 13, so a value not already rounded to TF32 is rounded toward zero. Eight values
// of k are 32 bytes, as the sixteen bf16 of a k16 step: the same descriptors step through a swizzled row.
// TF32 operands are K-major only (PTX has no imm-trans operands for .tf32): a's rows and b's columns hold
// their k contiguous. The accumulator fragment is the bf16 instruction's; scale-d 1, imm-scale-a and -b 1.
__device__ __forceinline__ void wgmma_m64n256k8_tf32(float (&d)[128], unsigned long long a_descriptor,
                                                     unsigned long long b_descriptor)
{
    asm volatile("wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 "
                 WGMMA_D128_TEXT ", %128, %129, 1, 1, 1;"
                 : WGMMA_D128_OPERANDS(d)
                 : "l"(a_descriptor), "l"(b_descriptor));
}

__device__ __forceinline__ void wgmma_m64n128k8_tf32(float (&d)[64], unsigned long long a_descriptor,
                                                     unsigned long long b_descriptor)
{
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 "
                 WGMMA_D64_TEXT ", %64, %65, 1, 1, 1;"
                 : WGMMA_D64_OPERANDS(d)
                 : "l"(a_descriptor), "l"(b_descriptor));
}

// The wgmma.mma_async this thread issued since the last commit become one group.
__device__ __forceinline__ void wgmma_commit_group()
{
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

// Wait until at most PENDING of this warpgroup's groups are still running (the newest ones): the others'
// results are in d, and the shared memory they read may be written again.
template <int PENDING>
__device__ __forceinline__ void wgmma_wait_group()
{
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(PENDING) : "memory");
}

// No instruction: tells the compiler that d is read and written here. The tensor cores write d until the
// wgmma.wait_group that covers their products, which the compiler cannot see; called after that wait (and
// after d is set before the first product), it keeps the compiler from moving any use of d across it.
template <int COUNT>
__device__ __forceinline__ void fence_accumulators(float (&d)[COUNT])
{
#pragma unroll
    for (int i = 0; i < COUNT; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}

#endif  // GPT2_CUPY_WGMMA_CUH
