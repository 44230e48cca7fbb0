// The PTX instructions a kernel may write in inline `asm`, for the CPU executor: tensor-core products
// (mma.sync), warp-wide matrix loads (ldmatrix), asynchronous copies to shared memory (cp.async) and the
// conversion to TF32 (cvt.rna.tf32.f32). inline_asm.py turns each asm statement into calls of these.
//
// Shared-memory addresses. On a GPU, `__cvta_generic_to_shared(p)` and `cvta.to.shared` give a 32-bit offset
// into the block's shared memory, which code then adds to and XOR-swizzles. Here shared memory is ordinary
// host memory anywhere in 64 bits, so a 32-bit "shared address" is a window number and an offset:
//     bits 31..24  a slot of this OS thread's window table, bits 23..0  the low 24 bits of the pointer.
// A window is two consecutive 16 MiB regions of the address space (slots 2w and 2w+1), so an array that
// straddles a 16 MiB boundary still decodes right. Because the low 24 bits are the pointer's own, adding an
// offset and XOR-ing address bits (swizzles) act on the encoded value exactly as on the pointer.
// Limits: an address may move at most 16 MiB past the region its encoding came from, never below it, and
// 128 windows per OS thread (every block of a launch finds its shared memory in a handful).
#pragma once
#include "../../executor_abi.h"

namespace gpt2cupy {
namespace ptx {

// Bits of one type read as another of the same size, as a register holds them; other sizes convert.
template <class To, class From>
inline To bits(const From& value) {
    if constexpr (sizeof(To) == sizeof(From)) {
        To result;
        __builtin_memcpy(&result, &value, sizeof(To));
        return result;
    } else {
        return (To)value;
    }
}
template <class To, class From>
inline To bits(From* pointer) { return (To)(unsigned long long)pointer; }

// An asm output operand: the register's bits written into the C++ variable.
template <class Target, class Register>
inline void assign(Target& target, const Register& value) { target = bits<Target>(value); }

// Stops the calling thread with a message naming the instruction and the kernel's line.
[[noreturn]] inline void fail(const char* message, int line) { gpt2cupy_assert_failed(message, "kernel.cu", line); }

inline unsigned lane() { return gpt2cupy_current_thread->lane; }

// ---- shared-memory windows ---------------------------------------------------------------------------
constexpr unsigned offset_bits = 24;
constexpr unsigned long long offset_mask = (1ull << offset_bits) - 1;
constexpr unsigned window_count = 128;

// Window w covers regions table[w] - 1 and table[w]; 0 is a free window. The block's threads share the
// table (one per OS thread, like shared memory) and may be switched anywhere, so a window is claimed with
// one compare-and-swap; relaxed atomics also keep this bookkeeping out of the race check's report.
inline unsigned long long* window_table() {
    static thread_local unsigned long long table[window_count];
    return table;
}

inline unsigned long long to_shared(const void* pointer) {
    unsigned long long address = (unsigned long long)pointer;
    unsigned long long region = address >> offset_bits;
    unsigned long long* table = window_table();
    for (unsigned window = 0; window < window_count; ++window) {
        unsigned long long held = __atomic_load_n(&table[window], __ATOMIC_RELAXED);
        if (held == 0 && __atomic_compare_exchange_n(&table[window], &held, region + 1, false, __ATOMIC_RELAXED,
                                                     __ATOMIC_RELAXED))
            held = region + 1;
        if (held == region + 1) return (unsigned long long)(2 * window) << offset_bits | (address & offset_mask);
    }
    fail("__cvta_generic_to_shared: more than 128 separate 16 MiB regions of shared memory in one block", 0);
}

// The pointer behind a 32-bit shared address; a value no window produced stops the thread.
inline unsigned char* from_shared(unsigned long long address, const char* instruction, int line) {
    unsigned long long slot = address >> offset_bits;
    unsigned long long held = slot < 2 * window_count ? __atomic_load_n(&window_table()[slot / 2], __ATOMIC_RELAXED) : 0;
    if (held == 0) fail(instruction, line);
    return (unsigned char*)((held - 1 + slot % 2) << offset_bits | (address & offset_mask));
}

// ---- warp-wide exchange --------------------------------------------------------------------------------
// Every lane's `count` 32-bit registers, gathered through the executor's warp exchange (two registers a
// round). An mma or ldmatrix is .sync.aligned: all 32 lanes take part, so a lane that exited (or a warp of
// fewer than 32 threads) stops the thread with the instruction's name; a lane waiting at another warp
// operation leaves the warp deadlocked, as the executor reports it.
template <int count>
inline void gather(const unsigned (&mine)[count], unsigned (&all)[32][count], const char* missing_lane, int line) {
    for (int first = 0; first < count; first += 2) {
        unsigned long long pair = mine[first] | (first + 1 < count ? (unsigned long long)mine[first + 1] << 32 : 0);
        const WarpExchange* table = gpt2cupy_warp_exchange(0xffffffffu, pair);
        if (table->arrived != 0xffffffffu) fail(missing_lane, line);
        for (int source = 0; source < 32; ++source) {
            all[source][first] = (unsigned)table->value[source];
            if (first + 1 < count) all[source][first + 1] = (unsigned)(table->value[source] >> 32);
        }
    }
}

// ---- numbers -------------------------------------------------------------------------------------------
inline double from_bf16(unsigned short value) { return bits<float>((unsigned)value << 16); }

inline double from_f16(unsigned short value) {
    int exponent = (value >> 10) & 0x1f, mantissa = value & 0x3ff;
    double magnitude = exponent == 0    ? mantissa * 0x1p-24
                       : exponent == 31 ? (mantissa ? __builtin_nan("") : __builtin_inf())
                                        : (1024 + mantissa) * __builtin_ldexp(1.0, exponent - 25);
    return value & 0x8000 ? -magnitude : magnitude;
}

// A tensor core reads a .tf32 operand's sign, exponent and top 10 mantissa bits: the low 13 bits of the
// 32-bit register are ignored (truncation), so an fp32 value passed unconverted is rounded toward zero.
inline double from_tf32(unsigned value) { return bits<float>(value & 0xffffe000u); }

// cvt.rna.tf32.f32: to 10 mantissa bits, to nearest, ties away from zero. Adding half a unit of the 13
// dropped bits to the magnitude does that, carrying into the exponent (and past the largest value, to
// infinity) as rounding does. A NaN is not rounded: its low 13 bits are cleared, as an H200 does, so a NaN
// whose payload lies only in those bits comes out as infinity. With .satfinite, a NaN becomes the canonical
// NaN, and infinity and overflow the largest finite value of the sign.
inline unsigned cvt_rna_tf32(float value, bool satfinite = false) {
    unsigned x = bits<unsigned>(value);
    unsigned sign = x & 0x80000000u, magnitude = x & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return satfinite ? 0x7fffffffu : x & 0xffffe000u;
    unsigned rounded = magnitude == 0x7f800000u ? magnitude : (magnitude + 0x1000u) & 0xffffe000u;
    if (satfinite && rounded >= 0x7f800000u) rounded = 0x7f7fe000u;
    return sign | rounded;
}

// ---- mma.sync ------------------------------------------------------------------------------------------
enum class Input { tf32, bf16, f16 };

// Which element of its matrix a lane's i-th value is (PTX ISA, "Matrix Fragments for mma.m16n8k8" and
// "... mma.m16n8k16 with floating point type"). group = lane / 4, member = lane % 4.
struct Place { int row, column; };

template <Input input>
inline Place a_place(unsigned lane, int i) {
    int group = lane >> 2, member = lane & 3;
    if (input == Input::tf32) return {group + 8 * (i & 1), member + 4 * (i >> 1)};
    return {group + 8 * ((i >> 1) & 1), 2 * member + (i & 1) + 8 * (i >> 2)};
}
template <Input input>
inline Place b_place(unsigned lane, int i) {  // row = k, column = n
    int group = lane >> 2, member = lane & 3;
    if (input == Input::tf32) return {member + 4 * i, group};
    return {2 * member + (i & 1) + 8 * (i >> 1), group};
}
inline Place c_place(unsigned lane, int i) { return {int(lane >> 2) + 8 * (i >> 1), 2 * int(lane & 3) + (i & 1)}; }

// Element i of a lane's registers: one tf32 a register, or two 16-bit values (the lower-numbered in the
// low half).
template <Input input>
inline double element(const unsigned* registers, int i) {
    if (input == Input::tf32) return from_tf32(registers[i]);
    unsigned short half = (unsigned short)(registers[i / 2] >> (16 * (i % 2)));
    return input == Input::bf16 ? from_bf16(half) : from_f16(half);
}

// D = A·B + C for one m16n8k<depth> tile, 32 lanes together. Each product of two tf32/bf16/f16 values is exact
// in double; the sum of the depth products and C is formed in double and rounded to fp32 once. The tensor
// core's own order and precision of accumulation are unspecified: results agree with a GPU's within a few
// fp32 units of the sum of magnitudes, not bit for bit.
template <int depth, Input input>
struct Tile {
    static constexpr int per_register = input == Input::tf32 ? 1 : 2;
    static constexpr int a_registers = 16 * depth / 32 / per_register;
    static constexpr int b_registers = depth * 8 / 32 / per_register;

    static void multiply(float (&d)[4], const unsigned (&a)[a_registers], const unsigned (&b)[b_registers],
                         const float (&c)[4], int line) {
        unsigned mine[a_registers + b_registers], all[32][a_registers + b_registers];
        for (int r = 0; r < a_registers; ++r) mine[r] = a[r];
        for (int r = 0; r < b_registers; ++r) mine[a_registers + r] = b[r];
        gather(mine, all, "mma.sync: all 32 lanes of the warp must execute it together (a lane exited, "
                          "or the block's last warp has fewer than 32 threads)", line);
        double a_matrix[16][depth], b_matrix[depth][8];
        for (unsigned source = 0; source < 32; ++source) {
            for (int i = 0; i < a_registers * per_register; ++i) {
                Place p = a_place<input>(source, i);
                a_matrix[p.row][p.column] = element<input>(all[source], i);
            }
            for (int i = 0; i < b_registers * per_register; ++i) {
                Place p = b_place<input>(source, i);
                b_matrix[p.row][p.column] = element<input>(all[source] + a_registers, i);
            }
        }
        for (int i = 0; i < 4; ++i) {
            Place p = c_place(lane(), i);
            double sum = c[i];
            for (int k = 0; k < depth; ++k) sum += a_matrix[p.row][k] * b_matrix[k][p.column];
            d[i] = (float)sum;
        }
    }
};

// ---- ldmatrix ------------------------------------------------------------------------------------------
// Up to four 8x8 matrices of 16-bit elements. Lane 8m + r gives the address of row r of matrix m; lane l
// receives, in register m, elements 2(l % 4) and 2(l % 4) + 1 of row l / 4 (with .trans: rows 2(l % 4) and
// 2(l % 4) + 1 of column l / 4) of matrix m. Each lane reads its own elements at the rows' addresses.
inline void ldmatrix(unsigned* destination, int matrices, bool transpose, unsigned long long address, bool shared,
                     int line) {
    const char* not_shared = "ldmatrix: a row address is not a shared-memory address (from __cvta_generic_to_shared "
                             "or cvta.to.shared)";
    unsigned char* row = shared ? from_shared(address, not_shared, line) : (unsigned char*)address;
    if ((unsigned long long)row % 16 != 0) fail("ldmatrix: a row address is not a multiple of 16 bytes", line);
    unsigned long long row_bits = (unsigned long long)row;
    unsigned mine[2] = {(unsigned)row_bits, (unsigned)(row_bits >> 32)}, rows[32][2];
    gather(mine, rows, "ldmatrix: all 32 lanes of the warp must execute it together (a lane exited, or the "
                       "block's last warp has fewer than 32 threads)", line);
    unsigned me = lane();
    for (int m = 0; m < matrices; ++m) {
        unsigned short pair[2];
        for (int i = 0; i < 2; ++i) {
            int r = transpose ? 2 * (me & 3) + i : me >> 2;
            int column = transpose ? me >> 2 : 2 * (me & 3) + i;
            const unsigned short* start = (const unsigned short*)((unsigned long long)rows[8 * m + r][1] << 32 | rows[8 * m + r][0]);
            pair[i] = start[column];
        }
        destination[m] = pair[0] | (unsigned)pair[1] << 16;
    }
}

// ---- cp.async ------------------------------------------------------------------------------------------
// A copy may land any time between its issue and the wait that covers it; here it lands at that wait, the
// latest moment a GPU allows, so a kernel that reads its destination too early reads the old bytes, as a
// GPU may. Each thread keeps its own queue (groups are per thread); a full queue completes its oldest copy
// early, which a GPU may also do. Copies still pending when a block ends are dropped with its shared memory.
struct PendingCopy {
    unsigned char* destination;
    const unsigned char* source;
    unsigned char bytes, source_bytes;
    unsigned group;
};
struct CopyQueue {
    static constexpr unsigned capacity = 32;
    unsigned long long block;  // gpt2cupy_block_serial() + 1 of the block the queue is for
    unsigned first, count, committed;
    PendingCopy copies[capacity];
};

inline CopyQueue& my_copies() {
    static thread_local CopyQueue queues[1024];  // one per thread of the block, touched by that thread only
    const ThreadCoordinates& t = *gpt2cupy_current_thread;
    unsigned thread = (t.thread_idx.z * t.block_dim.y + t.thread_idx.y) * t.block_dim.x + t.thread_idx.x;
    CopyQueue& queue = queues[thread];
    if (queue.block != gpt2cupy_block_serial() + 1) {
        queue.block = gpt2cupy_block_serial() + 1;
        queue.first = queue.count = queue.committed = 0;
    }
    return queue;
}

inline void complete_oldest(CopyQueue& queue) {
    PendingCopy& copy = queue.copies[queue.first];
    for (unsigned i = 0; i < copy.bytes; ++i) copy.destination[i] = i < copy.source_bytes ? copy.source[i] : 0;
    queue.first = (queue.first + 1) % CopyQueue::capacity;
    queue.count -= 1;
}

// cp-size bytes to shared memory: the first source_bytes from global memory, the rest zeros.
inline void cp_async(unsigned long long shared_address, unsigned long long global_address, unsigned bytes,
                     unsigned long long source_bytes, bool cache_global, int line) {
    if (bytes != 4 && bytes != 8 && bytes != 16) fail("cp.async: the copy size must be 4, 8 or 16 bytes", line);
    if (cache_global && bytes != 16) fail("cp.async.cg: the copy size must be 16 bytes", line);
    if (source_bytes > bytes) fail("cp.async: the source size is larger than the copy size", line);
    unsigned char* destination = from_shared(shared_address, "cp.async: the destination is not a shared-memory "
                                             "address (from __cvta_generic_to_shared or cvta.to.shared)", line);
    if ((unsigned long long)destination % bytes != 0 || global_address % bytes != 0)
        fail("cp.async: an address is not a multiple of the copy size", line);
    CopyQueue& queue = my_copies();
    if (queue.count == CopyQueue::capacity) complete_oldest(queue);
    queue.copies[(queue.first + queue.count) % CopyQueue::capacity] =
        PendingCopy{destination, (const unsigned char*)global_address, (unsigned char)bytes,
                    (unsigned char)source_bytes, queue.committed};
    queue.count += 1;
}

inline void cp_async_commit_group() { my_copies().committed += 1; }

// Until at most `pending` of the most recent committed groups remain: copies not yet committed stay.
inline void cp_async_wait_group(unsigned pending) {
    CopyQueue& queue = my_copies();
    while (queue.count != 0 && queue.copies[queue.first].group + pending < queue.committed) complete_oldest(queue);
}

inline void cp_async_wait_all() {
    cp_async_commit_group();
    cp_async_wait_group(0);
}

}  // namespace ptx
}  // namespace gpt2cupy

// CUDA's conversions between generic pointers and shared-memory addresses (size_t on a GPU too).
inline unsigned long __cvta_generic_to_shared(const void* pointer) { return gpt2cupy::ptx::to_shared(pointer); }
inline void* __cvta_shared_to_generic(unsigned long address) {
    return gpt2cupy::ptx::from_shared(address, "__cvta_shared_to_generic: not a shared-memory address", 0);
}
