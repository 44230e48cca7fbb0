"""Conformance of PTX's plain loads and stores in inline asm: `ld` and `st`, as public kernels write them
(ld.global.nc.v4.f32, st.global.cs.v2.f32, ld.shared.b32 through a cvta.to.shared address, ld.acquire.gpu ...).

Each kernel moves known bits and the test compares them with numpy, on whichever backend is active: on a GPU
this checks our reading of the PTX ISA, on the CPU that the executor does what the GPU does. The qualifiers
that only steer a GPU's caches (.nc, .cs, .L1::no_allocate, .L2::256B, .L2::cache_hint ...) must leave the
values alone; narrow types are sign- or zero-extended into wider registers and cut from them; every state
space (.global, .shared, .local, .const and generic addresses) reads and writes what C++ sees there.

A load or store of global or shared memory at an address that is not a multiple of its size (vector width
times element size) stops a GPU's kernel with "misaligned address", and the executor's with "misaligned
access". Such a launch ends a GPU's CUDA context for good, so on the GPU each one runs in a process of its own.
(An H100 went on past the misaligned local store and constant load below, whose results PTX leaves undefined;
the executor stops those too.)
"""

import numpy as np
import pytest

from gpt2_cupy import backend
from gpt2_cupy.testing import launch_in_a_process_of_its_own

# ---------------------------------------------------------------------------------------------------------
# Every type and vector width, through global memory: each thread loads its group of elements and stores it
# ---------------------------------------------------------------------------------------------------------

# (load, store, the registers' constraint and C++ type, the array's dtype, elements per thread)
COPIES = [
    ("ld.global.v4.f32", "st.global.v4.f32", "f", "float", np.float32, 4),
    ("ld.global.nc.v4.f32", "st.global.cs.v4.f32", "f", "float", np.float32, 4),
    ("ld.global.cs.v4.u32", "st.global.v4.b32", "r", "unsigned", np.uint32, 4),
    ("ld.global.L1::no_allocate.v4.s32", "st.global.wt.v4.s32", "r", "unsigned", np.int32, 4),
    ("ld.global.nc.L1::no_allocate.L2::256B.v4.u32", "st.global.cg.v4.u32", "r", "unsigned", np.uint32, 4),
    ("ld.global.cg.v2.f32", "st.global.cs.v2.f32", "f", "float", np.float32, 2),
    ("ld.global.ca.v2.f64", "st.global.wb.v2.f64", "d", "double", np.float64, 2),
    ("ld.global.lu.v2.u64", "st.global.L1::evict_last.v2.u64", "l", "unsigned long long", np.uint64, 2),
    ("ld.global.cv.s64", "st.global.s64", "l", "unsigned long long", np.int64, 1),
    ("ld.global.L1::evict_first.b32", "st.global.L1::no_allocate.b32", "r", "unsigned", np.uint32, 1),
    ("ld.global.v4.b16", "st.global.v4.b16", "h", "unsigned short", np.uint16, 4),
    ("ld.global.L2::64B.v2.u16", "st.global.v2.s16", "h", "unsigned short", np.int16, 2),
    ("ld.global.v4.u8", "st.global.v4.b8", "h", "unsigned short", np.uint8, 4),
    ("ld.global.v2.s8", "st.global.v2.s8", "r", "unsigned", np.int8, 2),
    ("ld.L2::128B.f32", "st.f32", "f", "float", np.float32, 1),  # generic addresses
    ("ld.v2.b64", "st.v2.b64", "d", "double", np.float64, 2),
]


def vector(first, count):
    """The asm template's registers %first .. %(first + count - 1): a vector operand {...} when more than one."""
    registers = ", ".join(f"%{first + k}" for k in range(count))
    return f"{{{registers}}}" if count > 1 else registers


def copy_kernel(load, store, constraint, register_type, itemsize, count):
    values = [f"v{k}" for k in range(count)]
    group = itemsize * count
    return rf"""
extern "C" __global__ void copy(void* out, const void* x, int n)
{{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    {register_type} {", ".join(values)};
    asm volatile("{load} {vector(0, count)}, [%{count}];"
                 : {", ".join(f'"={constraint}"({v})' for v in values)} : "l"((const char*)x + {group} * i));
    asm volatile("{store} [%0], {vector(1, count)};"
                 :: "l"((char*)out + {group} * i), {", ".join(f'"{constraint}"({v})' for v in values)} : "memory");
}}
"""


def random_bits(rng, dtype, size):
    """Values of every bit pattern the type has (floats: finite ones, so that numpy compares them plainly)."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return (rng.standard_normal(size) * 1e3).astype(dtype)
    return rng.integers(0, 256, size * dtype.itemsize, dtype=np.uint8).view(dtype)


@pytest.mark.parametrize("load, store, constraint, register_type, dtype, count", COPIES,
                         ids=[f"{load}|{store}" for load, store, *_ in COPIES])
def test_loads_and_stores_of_every_type_and_width_move_the_bits(rng, to_device, to_host, load, store, constraint,
                                                                 register_type, dtype, count):
    threads = 37  # two blocks of 32, the second partly idle
    x = random_bits(rng, dtype, threads * count)
    out = to_device(np.zeros_like(x))
    code = copy_kernel(load, store, constraint, register_type, np.dtype(dtype).itemsize, count)
    backend.RawKernel(code, "copy")((2,), (32,), (out, to_device(x), np.int32(threads)))
    np.testing.assert_array_equal(to_host(out), x)


# ---------------------------------------------------------------------------------------------------------
# Registers wider than the type: signed types are sign-extended into them, the others zero-extended; a store
# keeps the register's low bits
# ---------------------------------------------------------------------------------------------------------

WIDTHS = r"""
extern "C" __global__ void widths(unsigned* out32, unsigned long long* out64, unsigned char* bytes_out,
                                  unsigned short* halves_out, const unsigned char* bytes)
{
    int i = threadIdx.x;
    unsigned s8, u8, s16, b16;
    unsigned long long s32, u16;
    asm("ld.global.s8 %0, [%1];" : "=r"(s8) : "l"(bytes + i));
    asm("ld.global.u8 %0, [%1];" : "=r"(u8) : "l"(bytes + i));
    asm("ld.global.s16 %0, [%1];" : "=r"(s16) : "l"(bytes + 2 * i));
    asm("ld.global.b16 %0, [%1];" : "=r"(b16) : "l"(bytes + 2 * i));
    asm("ld.global.s32 %0, [%1];" : "=l"(s32) : "l"(bytes + 4 * i));
    asm("ld.global.u16 %0, [%1];" : "=l"(u16) : "l"(bytes + 2 * i));
    out32[4 * i] = s8;  out32[4 * i + 1] = u8;  out32[4 * i + 2] = s16;  out32[4 * i + 3] = b16;
    out64[2 * i] = s32;  out64[2 * i + 1] = u16;
    asm volatile("st.global.s8 [%0], %1;" :: "l"(bytes_out + i), "r"(s8) : "memory");
    asm volatile("st.global.u16 [%0], %1;" :: "l"(halves_out + i), "l"(s32) : "memory");
}
"""


def test_narrow_types_extend_into_wide_registers_and_stores_keep_the_low_bits(rng, to_device, to_host):
    threads = 32
    data = rng.integers(0, 256, 4 * threads, dtype=np.uint8)
    out32, out64 = to_device(np.zeros(4 * threads, np.uint32)), to_device(np.zeros(2 * threads, np.uint64))
    bytes_out, halves_out = to_device(np.zeros(threads, np.uint8)), to_device(np.zeros(threads, np.uint16))
    backend.RawKernel(WIDTHS, "widths")((1,), (threads,), (out32, out64, bytes_out, halves_out, to_device(data)))
    got32, got64 = to_host(out32).reshape(threads, 4), to_host(out64).reshape(threads, 2)
    as_int8, as_int16, as_int32 = (data[:size * threads].view(kind)
                                   for size, kind in ((1, np.int8), (2, np.int16), (4, np.int32)))
    np.testing.assert_array_equal(got32[:, 0], as_int8.astype(np.int32).view(np.uint32))
    np.testing.assert_array_equal(got32[:, 1], data[:threads])
    np.testing.assert_array_equal(got32[:, 2], as_int16.astype(np.int32).view(np.uint32))
    np.testing.assert_array_equal(got32[:, 3], as_int16.view(np.uint16))
    np.testing.assert_array_equal(got64[:, 0], as_int32.astype(np.int64).view(np.uint64))
    np.testing.assert_array_equal(got64[:, 1], as_int16.view(np.uint16))
    np.testing.assert_array_equal(to_host(bytes_out), data[:threads])
    np.testing.assert_array_equal(to_host(halves_out), as_int32.view(np.uint32).astype(np.uint16))
    assert np.any(as_int8 < 0) and np.any(as_int32 < 0), "the data must have negative values to tell sign extension"


# ---------------------------------------------------------------------------------------------------------
# Shared memory: 32-bit shared addresses (from __cvta_generic_to_shared, or cvta.to.shared in the statement
# into a .reg), offsets, and generic addresses of shared memory
# ---------------------------------------------------------------------------------------------------------

SHARED = r"""
extern "C" __global__ void shared_forms(float* out, const float* x)
{
    __shared__ __align__(16) float tile[32 * 4];
    int t = threadIdx.x, other = 31 - t;
    unsigned mine = (unsigned)__cvta_generic_to_shared(&tile[4 * t]);
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};"
                 :: "r"(mine), "f"(x[4 * t]), "f"(x[4 * t + 1]), "f"(x[4 * t + 2]), "f"(x[4 * t + 3]) : "memory");
    __syncthreads();
    float first, second, third, fourth;
    asm volatile("{\n"
                 "  .reg .u64 shared64;\n"
                 "  .reg .u32 shared32;\n"
                 "  cvta.to.shared.u64 shared64, %1;\n"
                 "  cvt.u32.u64 shared32, shared64;\n"
                 "  ld.shared.b32 %0, [shared32];\n"
                 "}\n" : "=f"(first) : "l"(&tile[4 * other]) : "memory");
    asm volatile("ld.f32 %0, [%1];" : "=f"(second) : "l"(&tile[4 * other + 1]) : "memory");
    unsigned theirs = (unsigned)__cvta_generic_to_shared(&tile[4 * other]);
    asm volatile("ld.shared::cta.v2.f32 {%0, %1}, [%2+8];" : "=f"(third), "=f"(fourth) : "r"(theirs) : "memory");
    out[4 * t] = first;  out[4 * t + 1] = second;  out[4 * t + 2] = third;  out[4 * t + 3] = fourth;
}
"""


def test_shared_memory_through_shared_and_generic_addresses(rng, to_device, to_host):
    x = rng.standard_normal(128).astype(np.float32)
    out = to_device(np.zeros(128, np.float32))
    backend.RawKernel(SHARED, "shared_forms")((1,), (32,), (out, to_device(x)))
    np.testing.assert_array_equal(to_host(out).reshape(32, 4), x.reshape(32, 4)[::-1])


# ---------------------------------------------------------------------------------------------------------
# Local and constant memory, through the addresses cvta.to.local and cvta.to.const make
# ---------------------------------------------------------------------------------------------------------

LOCAL_AND_CONSTANT = r"""
__constant__ __align__(16) unsigned table[8] = {3u, 1u, 4u, 1u, 5u, 9u, 2u, 6u};

extern "C" __global__ void local_and_constant(unsigned* out)
{
    __align__(16) unsigned scratch[8];
    unsigned long long local, constant;
    asm("cvta.to.local.u64 %0, %1;" : "=l"(local) : "l"(scratch));
    asm("cvta.to.const.u64 %0, %1;" : "=l"(constant) : "l"(table));
    unsigned t = threadIdx.x, a, b, c, d, first;
    asm volatile("ld.const.v4.u32 {%0, %1, %2, %3}, [%4+16];" : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "l"(constant));
    asm volatile("ld.const.u32 %0, [%1];" : "=r"(first) : "l"(constant));
    asm volatile("st.local.v4.u32 [%0], {%1, %2, %3, %4};" :: "l"(local), "r"(a + t), "r"(b + t), "r"(c), "r"(d)
                 : "memory");
    asm volatile("st.local.v2.b32 [%0+16], {%1, %2};" :: "l"(local), "r"(t), "r"(t * t) : "memory");
    unsigned e, f, g, h, i, j;
    asm volatile("ld.local.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(e), "=r"(f), "=r"(g), "=r"(h) : "l"(local)
                 : "memory");
    asm volatile("ld.local.v2.u32 {%0, %1}, [%2+16];" : "=r"(i), "=r"(j) : "l"(local) : "memory");
    unsigned* row = out + 8 * t;
    row[0] = e;  row[1] = f;  row[2] = g;  row[3] = h;  row[4] = i;  row[5] = j;  row[6] = first;  row[7] = 0;
}
"""


def test_local_and_constant_memory(to_device, to_host):
    out = to_device(np.zeros((32, 8), np.uint32))
    backend.RawKernel(LOCAL_AND_CONSTANT, "local_and_constant")((1,), (32,), (out,))
    t = np.arange(32, dtype=np.uint32)
    expected = np.stack([5 + t, 9 + t, np.full(32, 2), np.full(32, 6), t, t * t, np.full(32, 3), np.zeros(32)], axis=1)
    np.testing.assert_array_equal(to_host(out), expected)


# ---------------------------------------------------------------------------------------------------------
# Memory orders: .volatile, .relaxed, .acquire and .release with their scopes move the same bits
# ---------------------------------------------------------------------------------------------------------

ORDERS = r"""
extern "C" __global__ void global_orders(unsigned* out, const unsigned* x)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned* from = x + 4 * i;
    unsigned* to = out + 4 * i;
    unsigned a, b, c, d;
    asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(a) : "l"(from) : "memory");
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1+4];" : "=r"(b) : "l"(from) : "memory");
    asm volatile("ld.acquire.sys.global.v2.u32 {%0, %1}, [%2+8];" : "=r"(c), "=r"(d) : "l"(from) : "memory");
    asm volatile("st.volatile.global.u32 [%0], %1;" :: "l"(to), "r"(d) : "memory");
    asm volatile("st.relaxed.gpu.u32 [%0+4], %1;" :: "l"(to), "r"(c) : "memory");
    asm volatile("st.release.sys.global.v2.u32 [%0+8], {%1, %2};" :: "l"(to), "r"(b), "r"(a) : "memory");
}

extern "C" __global__ void shared_orders(unsigned* out, const unsigned* x)
{
    __shared__ __align__(16) unsigned cells[4];
    unsigned base = (unsigned)__cvta_generic_to_shared(cells);
    if (threadIdx.x == 0) {
        asm volatile("st.relaxed.cta.shared.u32 [%0], %1;" :: "r"(base), "r"(x[0]) : "memory");
        asm volatile("st.release.cta.shared::cta.u32 [%0+4], %1;" :: "r"(base), "r"(x[1]) : "memory");
        asm volatile("st.volatile.shared.v2.u32 [%0+8], {%1, %2};" :: "r"(base), "r"(x[2]), "r"(x[3]) : "memory");
    }
    __syncthreads();
    unsigned a, b, c, d;
    asm volatile("ld.relaxed.cta.shared.u32 %0, [%1];" : "=r"(a) : "r"(base) : "memory");
    asm volatile("ld.acquire.cta.shared::cta.u32 %0, [%1+4];" : "=r"(b) : "r"(base) : "memory");
    asm volatile("ld.volatile.shared.v2.u32 {%0, %1}, [%2+8];" : "=r"(c), "=r"(d) : "r"(base) : "memory");
    unsigned* row = out + 4 * threadIdx.x;
    row[0] = a;  row[1] = b;  row[2] = c;  row[3] = d;
}
"""


def test_volatile_relaxed_acquire_and_release_in_global_memory(rng, to_device, to_host):
    x = rng.integers(0, 2**32, (64, 4), dtype=np.uint32)
    out = to_device(np.zeros_like(x))
    backend.RawModule(code=ORDERS).get_function("global_orders")((2,), (32,), (out, to_device(x)))
    np.testing.assert_array_equal(to_host(out), x[:, ::-1])


def test_volatile_relaxed_acquire_and_release_in_shared_memory(rng, to_device, to_host):
    x = rng.integers(0, 2**32, 4, dtype=np.uint32)
    out = to_device(np.zeros((32, 4), np.uint32))
    backend.RawModule(code=ORDERS).get_function("shared_orders")((1,), (32,), (out, to_device(x)))
    np.testing.assert_array_equal(to_host(out), np.tile(x, (32, 1)))


# A release in one block, an acquire in another: each block publishes its partial sum with st.release.gpu,
# and the block that takes the last ticket waits for each flag with ld.acquire.gpu before reading the sums.
LAST_BLOCK = r"""
extern "C" __global__ void last_block_sum(float* total, float* partials, unsigned* published, unsigned* tickets,
                                          const float* x)
{
    if (threadIdx.x != 0) return;
    float sum = 0.0f;
    for (int k = 0; k < 32; ++k) sum += x[32 * blockIdx.x + k];
    asm volatile("st.global.f32 [%0], %1;" :: "l"(partials + blockIdx.x), "f"(sum) : "memory");
    asm volatile("PUBLISH.gpu.global.u32 [%0], %1;" :: "l"(published + blockIdx.x), "r"(1u) : "memory");
    if (atomicAdd(tickets, 1u) != gridDim.x - 1) return;
    float all = 0.0f;
    for (unsigned b = 0; b < gridDim.x; ++b) {
        unsigned ready = 0;
        while (!ready)
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(ready) : "l"(published + b) : "memory");
        float partial;
        asm volatile("ld.global.f32 %0, [%1];" : "=f"(partial) : "l"(partials + b) : "memory");
        all += partial;
    }
    *total = all;
}
"""


def last_block_arguments(rng, to_device, blocks):
    x = rng.integers(0, 10, 32 * blocks).astype(np.float32)  # small integers: every sum is exact
    zeros = [to_device(np.zeros(n, dtype)) for n, dtype in ((1, np.float32), (blocks, np.float32),
                                                            (blocks, np.uint32), (1, np.uint32))]
    return x, (*zeros, to_device(x))


def test_release_and_acquire_between_blocks(rng, to_device, to_host):
    x, arguments = last_block_arguments(rng, to_device, blocks=24)
    backend.RawKernel(LAST_BLOCK.replace("PUBLISH", "st.release"), "last_block_sum")((24,), (32,), arguments)
    assert to_host(arguments[0])[0] == x.sum()


# ---------------------------------------------------------------------------------------------------------
# Guarded loads (CUTLASS's idiom): a predicate in the statement decides whether the load happens at all
# ---------------------------------------------------------------------------------------------------------

GUARDED = r"""
extern "C" __global__ void guarded_loads(unsigned* out, const unsigned* x, int n)
{
    int t = threadIdx.x;
    unsigned a = 0xdeadbeefu, b = 0xdeadbeefu;
    asm volatile("{\n"
                 "  .reg .pred p;\n"
                 "  setp.lt.s32 p, %2, %3;\n"
                 "  @p ld.global.L2::cache_hint.v2.u32 {%0, %1}, [%4], %5;\n"
                 "}\n" : "+r"(a), "+r"(b) : "r"(t), "r"(n), "l"(x + 2 * t), "l"(0x10F0000000000000ull));
    out[2 * t] = a;  out[2 * t + 1] = b;
}
"""


def test_a_predicate_guards_a_load_with_a_cache_policy(rng, to_device, to_host):
    n = 20
    x = rng.integers(0, 2**32, 2 * n, dtype=np.uint32)
    out = to_device(np.zeros(64, np.uint32))
    backend.RawKernel(GUARDED, "guarded_loads")((1,), (32,), (out, to_device(x), np.int32(n)))
    expected = np.concatenate([x, np.full(64 - 2 * n, 0xDEADBEEF, np.uint32)])
    np.testing.assert_array_equal(to_host(out), expected)


# ---------------------------------------------------------------------------------------------------------
# Misaligned addresses stop the kernel, in every state space and memory order
# ---------------------------------------------------------------------------------------------------------

# Each kernel reads at x + shift bytes (or writes at out + 16 + shift bytes) and leaves out[0] = what it read,
# summed; shift 0 is aligned for all of them. x holds 1, 2, 3, ...
MISALIGNED = r"""
extern "C" __global__ void load_v4(unsigned* out, const unsigned* x, int shift)
{
    unsigned a, b, c, d;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "l"((const char*)x + shift));
    out[0] = a + b + c + d;
}

extern "C" __global__ void load_v2(unsigned* out, const unsigned* x, int shift)
{
    float a, b;
    asm volatile("ld.global.cs.v2.f32 {%0, %1}, [%2];" : "=f"(a), "=f"(b) : "l"((const char*)x + shift));
    out[0] = __float_as_uint(a) + __float_as_uint(b);
}

extern "C" __global__ void load_volatile_u16(unsigned* out, const unsigned* x, int shift)
{
    unsigned short a;
    asm volatile("ld.volatile.global.u16 %0, [%1];" : "=h"(a) : "l"((const char*)x + shift));
    out[0] = a;
}

extern "C" __global__ void load_acquire(unsigned* out, const unsigned* x, int shift)
{
    unsigned a;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(a) : "l"((const char*)x + shift) : "memory");
    out[0] = a;
}

extern "C" __global__ void store_v4(unsigned* out, const unsigned* x, int shift)
{
    asm volatile("st.global.v4.b32 [%0], {%1, %1, %1, %1};" :: "l"((char*)out + 16 + shift), "r"(x[0]) : "memory");
}

extern "C" __global__ void store_release(unsigned* out, const unsigned* x, int shift)
{
    asm volatile("st.release.gpu.global.u32 [%0], %1;" :: "l"((char*)out + 16 + shift), "r"(x[0]) : "memory");
}

extern "C" __global__ void load_shared_v2(unsigned* out, const unsigned* x, int shift)
{
    __shared__ __align__(16) unsigned tile[8];
    for (int k = 0; k < 8; ++k) tile[k] = x[k];
    unsigned a, b;
    unsigned address = (unsigned)__cvta_generic_to_shared(tile) + shift;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(a), "=r"(b) : "r"(address) : "memory");
    out[0] = a + b;
}

extern "C" __global__ void store_local_v2(unsigned* out, const unsigned* x, int shift)
{
    __align__(16) unsigned scratch[4] = {0u, 0u, 0u, 0u};
    unsigned long long local;
    asm("cvta.to.local.u64 %0, %1;" : "=l"(local) : "l"(scratch));
    asm volatile("st.local.v2.u32 [%0], {%1, %2};" :: "l"(local + shift), "r"(x[0]), "r"(x[1]) : "memory");
    out[0] = scratch[0] + scratch[1] + scratch[2] + scratch[3];
}

__constant__ __align__(16) unsigned constants[8] = {1u, 2u, 3u, 4u, 5u, 6u, 7u, 8u};

extern "C" __global__ void load_const_v4(unsigned* out, const unsigned* x, int shift)
{
    unsigned long long constant;
    asm("cvta.to.const.u64 %0, %1;" : "=l"(constant) : "l"(constants));
    unsigned a, b, c, d;
    asm volatile("ld.const.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "l"(constant + shift));
    out[0] = a + b + c + d;
}
"""
# Each kernel's out[:8] after an aligned launch (x = 1, 2, ..., 8), and shifts that misalign it.
ALIGNED_RESULTS = {"load_v4": [10], "load_v2": [3], "load_volatile_u16": [1], "load_acquire": [1],
                   "store_v4": [0, 0, 0, 0, 1, 1, 1, 1], "store_release": [0, 0, 0, 0, 1],
                   "load_shared_v2": [3], "store_local_v2": [3], "load_const_v4": [10]}
MISALIGNED_SHIFTS = [("load_v4", 4), ("load_v4", 8), ("load_v2", 4), ("load_volatile_u16", 1),
                     ("load_acquire", 2), ("store_v4", 8), ("store_release", 2), ("load_shared_v2", 4)]
# An H100 went on past these two, without an error (PTX leaves what a misaligned access reads or writes
# undefined). The executor stops them as it stops the others.
MISALIGNED_UNCHECKED_ON_A_GPU = [("store_local_v2", 4), ("load_const_v4", 8)]

def launch_elsewhere(name, shift):
    return launch_in_a_process_of_its_own(MISALIGNED, name, np.uint32, shift)


@pytest.mark.parametrize("name", ALIGNED_RESULTS)
def test_aligned_accesses_read_and_write_what_they_address(to_device, to_host, name):
    out, x = to_device(np.zeros(8, np.uint32)), to_device(np.arange(1, 9, dtype=np.uint32))
    backend.RawModule(code=MISALIGNED).get_function(name)((1,), (1,), (out, x, np.int32(0)))
    expected = ALIGNED_RESULTS[name]
    assert to_host(out)[:len(expected)].tolist() == expected


@pytest.mark.parametrize("name, shift", MISALIGNED_SHIFTS)
def test_a_misaligned_load_or_store_stops_the_kernel(name, shift):
    if backend.name == "cuda":
        assert "misaligned address" in launch_elsewhere(name, shift)
        return
    assert_stopped_as_misaligned(name, shift)


@pytest.mark.cpu_only
@pytest.mark.parametrize("name, shift", MISALIGNED_UNCHECKED_ON_A_GPU)
def test_a_misaligned_local_or_constant_access_stops_the_kernel_on_the_cpu(name, shift):
    assert_stopped_as_misaligned(name, shift)


def assert_stopped_as_misaligned(name, shift):
    from gpt2_cupy.cpu import KernelError
    out, x = np.zeros(8, np.uint32), np.arange(1, 9, dtype=np.uint32)
    with pytest.raises(KernelError, match=f"kernel '{name}'.*misaligned access"):
        backend.RawModule(code=MISALIGNED).get_function(name)((1,), (1,), (out, x, np.int32(shift)))


# ---------------------------------------------------------------------------------------------------------
# The CPU executor: 256-bit accesses (sm_100 and later), what it refuses, and the race check
# ---------------------------------------------------------------------------------------------------------

WIDE = r"""
extern "C" __global__ void wide(unsigned* out, const unsigned* x)
{
    int t = threadIdx.x;
    unsigned r[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
    asm volatile("ld.global.L2::evict_last.v8.u32 {%0, _, %1, %2, %3, %4, %5, %6}, [%7];"
                 : "=r"(r[0]), "=r"(r[2]), "=r"(r[3]), "=r"(r[4]), "=r"(r[5]), "=r"(r[6]), "=r"(r[7])
                 : "l"(x + 8 * t));
    asm volatile("st.global.v8.b32 [%0], {%1, %2, _, %3, %4, %5, %6, %7};"
                 :: "l"(out + 8 * t), "r"(r[0]), "r"(r[1]), "r"(r[3]), "r"(r[4]), "r"(r[5]), "r"(r[6]), "r"(r[7])
                 : "memory");
    unsigned long long q[4];
    asm volatile("ld.global.v4.u64 {%0, %1, %2, %3}, [%4];" : "=l"(q[0]), "=l"(q[1]), "=l"(q[2]), "=l"(q[3])
                 : "l"(x + 8 * t));
    asm volatile("st.global.v4.b64 [%0], {%1, %2, %3, %4};" :: "l"(out + 256 + 8 * t), "l"(q[3]), "l"(q[2]),
                 "l"(q[1]), "l"(q[0]) : "memory");
}
"""


def aligned_to_32_bytes(array):
    """A copy of the array at an address that is a multiple of 32 bytes, as a 256-bit access needs (numpy
    promises 16; a GPU's allocations are 256-byte aligned)."""
    room = np.empty(array.nbytes + 32, np.uint8)
    start = -room.ctypes.data % 32
    copy = room[start:start + array.nbytes].view(array.dtype)
    copy[:] = array
    return copy


@pytest.mark.cpu_only
def test_256_bit_loads_and_stores_with_sinks_on_sm_100(rng):
    """A sink _ leaves its register alone in a load, and its memory alone in a store."""
    x = aligned_to_32_bytes(rng.integers(0, 2**32, 256, dtype=np.uint32))
    out = aligned_to_32_bytes(np.full(512, 7, np.uint32))
    backend.RawKernel(WIDE, "wide", options=("-arch=sm_100",))((1,), (32,), (out, x))
    groups, expected = x.reshape(32, 8), x.reshape(32, 8).copy()
    expected[:, 1], expected[:, 2] = 0, 7  # not loaded (r[1] stays 0); not stored (out keeps its 7)
    np.testing.assert_array_equal(out[:256].reshape(32, 8), expected)
    np.testing.assert_array_equal(out[256:].reshape(32, 4, 2), groups.reshape(32, 4, 2)[:, ::-1])


def refused(instruction, outputs, inputs):
    """The CompileError the executor raises for one asm statement, as text."""
    from gpt2_cupy.cpu import CompileError
    code = (f'extern "C" __global__ void refused(unsigned* out, unsigned long long* wide)\n{{\n'
            f'    unsigned r0 = 0, r1 = 0; unsigned short h0 = 0; double d0 = 0;\n'
            f'    asm volatile("{instruction}" : {outputs} : {inputs});\n'
            f'    out[0] = r0 + r1 + h0 + (unsigned)d0;\n}}\n')
    with pytest.raises(CompileError) as caught:
        backend.RawKernel(code, "refused")((1,), (1,), (np.zeros(1, np.uint32), np.zeros(4, np.uint64)))
    message = str(caught.value)
    assert "kernel.cu:4:" in message and "   4 | " in message, message
    return message


@pytest.mark.cpu_only
@pytest.mark.parametrize("instruction, outputs, words", [
    ("ld.global.foo.u32 %0, [%1];", '"=r"(r0)', "does not run 'ld.global.foo.u32': .foo is not a qualifier of ld"),
    ("ld.global.f16 %0, [%1];", '"=h"(h0)', "'ld.global.f16': .f16 is not a type it loads or stores: PTX has no"),
    ("ld.global.b128 %0, [%1];", '"=r"(r0)', "no 128-bit registers"),
    ("ld.param.u32 %0, [%1];", '"=r"(r0)', ".param is not a qualifier of ld"),
    ("ld.relaxed.global.u32 %0, [%1];", '"=r"(r0)', "ld.relaxed.global.u32: .relaxed needs a scope"),
    ("ld.global.gpu.u32 %0, [%1];", '"=r"(r0)', "a scope (.gpu) goes with .relaxed, .acquire or .release only"),
    ("ld.volatile.global.cg.u32 %0, [%1];", '"=r"(r0)', "without a cache operator"),
    ("ld.acquire.gpu.local.u32 %0, [%1];", '"=r"(r0)', ".acquire is for .global and .shared"),
    ("ld.shared.nc.u32 %0, [%1];", '"=r"(r0)', ".nc is for ld.global only"),
    ("ld.global.cs.cg.u32 %0, [%1];", '"=r"(r0)', "two cache operator qualifiers (.cs and .cg)"),
    ("ld.global.L2::evict_last.b32 %0, [%1];", '"=r"(r0)', ".L2::evict_last is for 256-bit loads and stores only"),
    ("ld.global.v8.u32 {%0, %0, %0, %0, %0, %0, %0, %0}, [%1];", '"=r"(r0)', "256-bit loads and stores are for"),
    ("ld.global.v8.u16 {%0, %0, %0, %0, %0, %0, %0, %0}, [%1];", '"=h"(h0)', ".v8 is for 32-bit types only"),
    ("ld.global.v2.u32 {%0, _}, [%1];", '"=r"(r0)', "the sink _ stands for an element only in 256-bit"),
    ("ld.global.u64 %0, [%1];", '"=r"(r0)', "the register '%0' (unsigned int) cannot hold .u64"),
    ("ld.global.f32 %0, [%1];", '"=d"(d0)', "the register '%0' (double) cannot hold .f32"),
    ("ld.global.L2::cache_hint.u32 %0, [%1];", '"=r"(r0)', "expected 3 operands, got 2"),
])
def test_a_load_the_executor_does_not_run_is_a_compile_error_naming_it(instruction, outputs, words):
    assert words in refused(instruction, outputs, '"l"(wide)')


@pytest.mark.cpu_only
def test_a_store_to_constant_memory_is_a_compile_error():
    assert ".const is not a qualifier of st" in refused("st.const.u32 [%0], %1;", "", '"l"(wide), "r"(r0)')


ASM_NEIGHBOURS = r"""
extern "C" __global__ void neighbours(unsigned* out, unsigned* cells)
{
    unsigned t = threadIdx.x, theirs;
    asm volatile("st.global.u32 [%0], %1;" :: "l"(cells + t), "r"(t) : "memory");
    BARRIER
    asm volatile("ld.global.u32 %0, [%1];" : "=r"(theirs) : "l"(cells + (t + 1) % 64) : "memory");
    out[t] = theirs;
}
"""


@pytest.mark.cpu_only
def test_the_race_check_sees_asm_loads_and_stores():
    from gpt2_cupy.cpu import RaceError
    arguments = (np.zeros(64, np.uint32), np.zeros(64, np.uint32))
    with pytest.raises(RaceError, match="race on 'cells'"):
        backend.RawKernel(ASM_NEIGHBOURS.replace("BARRIER", ""), "neighbours")((1,), (64,), arguments, check_races=True)
    backend.RawKernel(ASM_NEIGHBOURS.replace("BARRIER", "__syncthreads();"), "neighbours")(
        (1,), (64,), arguments, check_races=True)
    np.testing.assert_array_equal(arguments[0], (np.arange(64) + 1) % 64)


@pytest.mark.cpu_only
def test_the_race_check_takes_st_release_gpu_for_a_fence_and_st_relaxed_for_none(rng, to_device, to_host):
    """st.release.gpu publishes the block's earlier writes as __threadfence() then a store does; st.relaxed.gpu
    is an atomic store without that fence, so another block's read of the partial sum is not ordered."""
    from gpt2_cupy.cpu import RaceError
    x, arguments = last_block_arguments(rng, to_device, blocks=8)
    backend.RawKernel(LAST_BLOCK.replace("PUBLISH", "st.release"), "last_block_sum")(
        (8,), (32,), arguments, check_races=True)
    assert to_host(arguments[0])[0] == x.sum()
    x, arguments = last_block_arguments(rng, to_device, blocks=8)
    with pytest.raises(RaceError, match="without a __threadfence"):
        backend.RawKernel(LAST_BLOCK.replace("PUBLISH", "st.relaxed"), "last_block_sum")(
            (8,), (32,), arguments, check_races=True)
