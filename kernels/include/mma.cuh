// Tensor cores through inline PTX, written once: the instructions of chapter 15a as small device functions.
// CUDA's C++ interface to them (<mma.h>, WMMA) does not compile under NVRTC, and it hides the fragment
// layouts the chapter is about; these wrappers are one instruction each, with the layout in the comment.
// Fragments are per lane: g = lane / 4 (the lane's group) and t = lane % 4 (its place in the group).
// mma.sync and ldmatrix are warp-wide: all 32 lanes of a warp call them together.
#ifndef GPT2_CUPY_MMA_CUH
#define GPT2_CUPY_MMA_CUH

// The 32-bit shared-memory address of a pointer into __shared__ memory, as ldmatrix and cp.async take it.
__device__ __forceinline__ unsigned shared_address(const void* pointer)
{
    return static_cast<unsigned>(__cvta_generic_to_shared(pointer));
}

// x rounded to TF32 (8 exponent bits, 10 mantissa bits), to nearest with ties away from zero, as the 32
// bits of a float whose low 13 bits are zero. The tensor core ignores those 13 bits of a .tf32 operand, so
// an unrounded float would be cut toward zero instead: twice the error.
__device__ __forceinline__ unsigned to_tf32(float x)
{
    unsigned bits;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(bits) : "f"(x));
    return bits;
}

// 3xTF32: x = big + small with big = x in TF32 and small = the rest in TF32. big carries x's top 11
// significant bits and small the next 11, so big + small holds 22 of float32's 24.
__device__ __forceinline__ void split_tf32(float x, unsigned& big, unsigned& small)
{
    big = to_tf32(x);
    small = to_tf32(x - __uint_as_float(big));
}

// d += a b for one m16n8k8 tile in TF32: a is 16 x 8 (row-major), b is 8 x 8 (".col": each lane's values
// run down a column), d is 16 x 8 in float32. Products are exact, sums in float32.
//   a: a[0] = (g, t)     a[1] = (g + 8, t)     a[2] = (g, t + 4)     a[3] = (g + 8, t + 4)
//   b: b[0] = (t, g)     b[1] = (t + 4, g)                                          (row k, column n)
//   d: d[0] = (g, 2t)    d[1] = (g, 2t + 1)    d[2] = (g + 8, 2t)    d[3] = (g + 8, 2t + 1)
__device__ __forceinline__ void mma_m16n8k8_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2])
{
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// d += a b for one m16n8k16 tile in bf16 with float32 sums. Each register holds two bf16 values, the one of
// lower k in its low 16 bits:
//   a: a[0] = (g, 2t..2t+1)  a[1] = (g + 8, 2t..2t+1)  a[2] = (g, 2t+8..2t+9)  a[3] = (g + 8, 2t+8..2t+9)
//   b: b[0] = (2t..2t+1, g)  b[1] = (2t+8..2t+9, g)
//   d: as for mma_m16n8k8_tf32
__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2])
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// ldmatrix: the warp loads 8 x 8 matrices of 16-bit values (8 rows of 16 bytes) from shared memory; lane
// 8q + r gives the address of row r of matrix q. Register q of lane l receives elements 2t and 2t + 1 of row
// g of matrix q; with .trans, those of column g (rows 2t and 2t + 1). A row of 16 bytes is also 4 floats:
// without .trans, lane l then receives float t of row g, which is TF32's fragment order.
__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], unsigned address)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(address));
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned address)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}

__device__ __forceinline__ void ldmatrix_x2_trans(unsigned (&r)[2], unsigned address)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(address));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned address)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}

// cp.async: copy from global to shared memory without passing through registers; the thread goes on at
// once. source_bytes (0 to the copy's size) are read and the rest of the destination is filled with zeros,
// which is how a tile's edge outside the matrix becomes zeros. The 16-byte copy needs 16-byte aligned
// addresses (and skips the L1 cache, .cg); the 4-byte one needs only a float's alignment.
__device__ __forceinline__ void cp_async_16(unsigned destination, const void* source, int source_bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(destination), "l"(source), "r"(source_bytes));
}

__device__ __forceinline__ void cp_async_4(unsigned destination, const void* source, int source_bytes)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" :: "r"(destination), "l"(source), "r"(source_bytes));
}

// The copies this thread issued since the last commit become one group.
__device__ __forceinline__ void cp_async_commit()
{
    asm volatile("cp.async.commit_group;" ::);
}

// Wait until at most `PENDING` of this thread's groups are still in flight (the newest ones). Other
// threads' copies need a __syncthreads() afterwards before this thread reads them.
template <int PENDING>
__device__ __forceinline__ void cp_async_wait()
{
    asm volatile("cp.async.wait_group %0;" :: "n"(PENDING));
}

#endif  // GPT2_CUPY_MMA_CUH
