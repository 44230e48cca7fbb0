// The PTX instructions a kernel may write in inline `asm`, for the CPU executor: tensor-core products
// (mma.sync, and Hopper's warpgroup-wide wgmma.mma_async from shared-memory descriptors), warp-wide matrix
// loads (ldmatrix), asynchronous copies to shared memory (cp.async), the conversion to TF32
// (cvt.rna.tf32.f32), and Hopper's shared-memory barriers (mbarrier) with the bulk copies that complete them
// (cp.async.bulk, and cp.async.bulk.tensor: the Tensor Memory Accelerator), whose state the runtime keeps.
// inline_asm.py turns each asm statement into calls of these.
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

inline void note_dynamic_shared(const void* pointer);  // for wgmma's descriptors, below

inline unsigned long long to_shared(const void* pointer) {
    note_dynamic_shared(pointer);
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

// A value rounded to the nearest f16 (ties to even), as its bits: past the largest finite value (65504) by half
// a unit or more it is infinity, below 2^-14 a subnormal (a multiple of 2^-24); a NaN is the canonical 0x7fff.
inline unsigned short to_f16(double value) {
    if (value != value) return 0x7fff;
    const unsigned short sign = value < 0 || (value == 0 && __builtin_signbit(value)) ? 0x8000 : 0;
    const double magnitude = value < 0 ? -value : value;
    if (magnitude >= 65520.0) return sign | 0x7c00;
    if (magnitude == 0) return sign;
    int exponent = 0;
    __builtin_frexp(magnitude, &exponent);            // magnitude = f * 2^exponent, 0.5 <= f < 1
    const int unit = exponent - 11 < -24 ? -24 : exponent - 11;  // f16 keeps 11 significant bits
    const double units = __builtin_rint(__builtin_ldexp(magnitude, -unit));  // exact, then ties to even
    if (unit == -24) return sign | (unsigned short)units;  // subnormal (1024: the smallest normal)
    const double rounded = __builtin_ldexp(units, unit);
    __builtin_frexp(rounded, &exponent);
    const unsigned mantissa = (unsigned)__builtin_ldexp(rounded, 11 - exponent) - 1024;
    return sign | (unsigned short)((exponent + 14) << 10 | mantissa);
}

// mma.sync with f16 C and D: two halves to a register (the lower-numbered element in the low half). D = A·B + C is
// formed as for f32 accumulators, then rounded to f16. (The tensor core's own accumulation is unspecified; sums
// that f16 holds exactly, as the tests use, come out the same.)
template <int depth>
inline void multiply_half_accumulators(unsigned (&d)[2], const unsigned (&a)[Tile<depth, Input::f16>::a_registers],
                                       const unsigned (&b)[Tile<depth, Input::f16>::b_registers],
                                       const unsigned (&c)[2], int line) {
    float c_wide[4], d_wide[4];
    for (int i = 0; i < 4; ++i) c_wide[i] = (float)from_f16((unsigned short)(c[i / 2] >> (16 * (i % 2))));
    Tile<depth, Input::f16>::multiply(d_wide, a, b, c_wide, line);
    for (int r = 0; r < 2; ++r) d[r] = (unsigned)to_f16(d_wide[2 * r]) | (unsigned)to_f16(d_wide[2 * r + 1]) << 16;
}

// ---- ldmatrix ------------------------------------------------------------------------------------------
// Up to four 8x8 matrices of 16-bit elements. Lane 8m + r gives the address of row r of matrix m; lane l
// receives, in register m, elements 2(l % 4) and 2(l % 4) + 1 of row l / 4 (with .trans: rows 2(l % 4) and
// 2(l % 4) + 1 of column l / 4) of matrix m. Each lane reads its own elements at the rows' addresses.
// The row addresses of every lane of the warp (ldmatrix's and stmatrix's operand), each checked, as pointers.
// MESSAGES names the instruction in each of the three ways it can fail.
#define GPT2CUPY_MATRIX_MESSAGES(instruction)                                                                      \
    instruction ": a row address is not a shared-memory address (from __cvta_generic_to_shared or cvta.to.shared)", \
    instruction ": a row address is not a multiple of 16 bytes",                                                  \
    instruction ": all 32 lanes of the warp must execute it together (a lane exited, or the block's last warp "    \
                "has fewer than 32 threads)"
inline void matrix_rows(unsigned long long address, bool shared, unsigned short* (&rows)[32], int line,
                        const char* not_shared, const char* not_aligned, const char* missing_lane) {
    unsigned char* row = shared ? from_shared(address, not_shared, line) : (unsigned char*)address;
    if ((unsigned long long)row % 16 != 0) fail(not_aligned, line);
    unsigned long long row_bits = (unsigned long long)row;
    unsigned mine[2] = {(unsigned)row_bits, (unsigned)(row_bits >> 32)}, all[32][2];
    gather(mine, all, missing_lane, line);
    for (int lane_row = 0; lane_row < 32; ++lane_row)
        rows[lane_row] = (unsigned short*)((unsigned long long)all[lane_row][1] << 32 | all[lane_row][0]);
}

// Where this lane's element i (0 or 1) of a matrix is: (row, column) of the 8x8 matrix.
inline void matrix_element(bool transpose, int i, int& row, int& column) {
    const unsigned me = lane();
    row = transpose ? 2 * (me & 3) + i : me >> 2;
    column = transpose ? me >> 2 : 2 * (me & 3) + i;
}

inline void ldmatrix(unsigned* destination, int matrices, bool transpose, unsigned long long address, bool shared,
                     int line) {
    unsigned short* rows[32];
    matrix_rows(address, shared, rows, line, GPT2CUPY_MATRIX_MESSAGES("ldmatrix"));
    for (int m = 0; m < matrices; ++m) {
        unsigned short pair[2];
        for (int i = 0, r, column; i < 2; ++i) {
            matrix_element(transpose, i, r, column);
            pair[i] = rows[8 * m + r][column];
        }
        destination[m] = pair[0] | (unsigned)pair[1] << 16;
    }
}

// ---- stmatrix (sm_90) ----------------------------------------------------------------------------------
// ldmatrix's store: the same lanes give the rows' addresses, and each lane writes its register m's two
// elements where ldmatrix would have read them (an mma accumulator fragment, converted to 16 bits, goes to
// shared memory as whole rows).
inline void stmatrix(const unsigned* source, int matrices, bool transpose, unsigned long long address, bool shared,
                     int line) {
    unsigned short* rows[32];
    matrix_rows(address, shared, rows, line, GPT2CUPY_MATRIX_MESSAGES("stmatrix"));
    for (int m = 0; m < matrices; ++m) {
        for (int i = 0, r, column; i < 2; ++i) {
            matrix_element(transpose, i, r, column);
            rows[8 * m + r][column] = (unsigned short)(source[m] >> (16 * i));
        }
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

// ---- wgmma: warpgroups ---------------------------------------------------------------------------------
// A warpgroup is four consecutive warps, threads 128w .. 128w + 127 of the block. Its wgmma instructions are
// .sync.aligned: all 128 threads execute the same one together. Each thread posts which instruction it
// reached (and, for wgmma.mma_async, its descriptors), the warpgroup waits in one tile sync, and the lowest
// thread checks that all 128 posted the same. Posts alternate between two slots: a thread already at the
// next instruction writes the other slot, never the one still being compared. The posts are shared by the
// block's threads, so they are read and written with relaxed atomics, which keeps this bookkeeping out of
// the race check's report; each entry carries its block's tag, so a new block needs no reset.
enum WarpgroupStep : unsigned { step_fence = 1, step_mma = 2, step_commit = 3, step_wait = 4 };

struct WarpgroupPost {
    unsigned long long reached;  // (block tag << 32) | how many warpgroup instructions the thread has reached
    unsigned long long what;     // the WarpgroupStep, and for wgmma.mma_async its shape's N << 8
    unsigned long long a_descriptor, b_descriptor;
};

struct ThreadOfWarpgroup {  // one thread's own record, touched by that thread only
    unsigned long long reached;  // as its posts' `reached`
    unsigned long long fenced;   // the block tag once it has executed wgmma.fence
};

inline unsigned long long block_tag() { return (gpt2cupy_block_serial() + 1) & 0xffffffffull; }

inline unsigned thread_in_block() {
    const ThreadCoordinates& t = *gpt2cupy_current_thread;
    return (t.thread_idx.z * t.block_dim.y + t.thread_idx.y) * t.block_dim.x + t.thread_idx.x;
}

inline WarpgroupPost (&warpgroup_posts())[1024][2] {
    static thread_local WarpgroupPost posts[1024][2];  // one block at a time per OS thread, like shared memory
    return posts;
}

inline ThreadOfWarpgroup& my_warpgroup_record() {
    static thread_local ThreadOfWarpgroup records[1024];
    ThreadOfWarpgroup& record = records[thread_in_block()];
    if (record.reached >> 32 != block_tag()) record.reached = block_tag() << 32;
    return record;
}

inline unsigned long long relaxed_load(const unsigned long long& place) { return __atomic_load_n(&place, __ATOMIC_RELAXED); }
inline void relaxed_store(unsigned long long& place, unsigned long long value) { __atomic_store_n(&place, value, __ATOMIC_RELAXED); }

// The warpgroup's 128 threads meet at one wgmma instruction; a thread missing, one at another instruction,
// or one with other descriptors stops the launch with a message that says which.
inline void warpgroup_meet(unsigned long long what, unsigned long long a_descriptor, unsigned long long b_descriptor,
                           int line) {
    const unsigned thread = thread_in_block(), first = thread & ~127u;
    ThreadOfWarpgroup& record = my_warpgroup_record();
    record.reached += 1;
    const unsigned long long reached = record.reached;
    WarpgroupPost& mine = warpgroup_posts()[thread][reached & 1];
    relaxed_store(mine.what, what);
    relaxed_store(mine.a_descriptor, a_descriptor);
    relaxed_store(mine.b_descriptor, b_descriptor);
    relaxed_store(mine.reached, reached);
    gpt2cupy_tile_sync(first, 128);
    static const char* const missing =
        "wgmma: all 128 threads of a warpgroup (4 consecutive warps, threads 128w .. 128w + 127 of the block) must "
        "execute each wgmma instruction together: a thread of this warpgroup exited or waits elsewhere, or the "
        "block's size is not a multiple of 128";
    const ThreadCoordinates& t = *gpt2cupy_current_thread;
    if (first + 128 > t.block_dim.x * t.block_dim.y * t.block_dim.z) fail(missing, line);
    const unsigned last = thread == first ? first + 127 : first;  // the lowest thread checks them all
    for (unsigned other = first; other <= last; ++other) {
        const WarpgroupPost& theirs = warpgroup_posts()[other][reached & 1];
        if (relaxed_load(theirs.reached) != reached) fail(missing, line);
        if (relaxed_load(theirs.what) != what)
            fail("wgmma: the threads of a warpgroup reached different wgmma instructions (each one is executed by "
                 "all 128 threads together)", line);
        if (relaxed_load(theirs.a_descriptor) != a_descriptor || relaxed_load(theirs.b_descriptor) != b_descriptor)
            fail("wgmma.mma_async: the threads of a warpgroup gave different matrix descriptors (PTX requires the "
                 "same descriptors in every thread of the warpgroup)", line);
    }
}

inline void wgmma_fence(int line) {
    warpgroup_meet(step_fence, 0, 0, line);
    my_warpgroup_record().fenced = block_tag();
}

// The product is computed when issued (see wgmma below), so committing and waiting only meet.
inline void wgmma_commit_group(int line) { warpgroup_meet(step_commit, 0, 0, line); }
inline void wgmma_wait_group(unsigned long long pending, int line) {
    warpgroup_meet(step_wait | pending << 8, 0, 0, line);
}

// ---- wgmma: shared-memory matrix descriptors -----------------------------------------------------------
// A descriptor (PTX ISA, "Matrix Descriptor Format") is 64 bits:
//     bits  0-13  start address / 16        (the shared address's bits 4-17)
//     bits 16-29  leading dimension byte offset / 16
//     bits 32-45  stride dimension byte offset / 16
//     bits 49-51  matrix base offset
//     bits 62-63  swizzle: 0 none, 1 128-byte, 2 64-byte, 3 32-byte
// The matrix is 64 rows of A, or N rows of B (row: m of A, n of B), by 16 elements of k (bf16, f16) or 8
// (tf32: 4 bytes each, a float32 bit pattern). K-major ("no transpose", imm-trans 0): a row's elements of k
// are contiguous, in core matrices of 8 rows of 16 bytes. Element (row, k) of E bytes, with byte = k E its
// offset along the row and chunk = byte / 16 its 16-byte column:
//     no swizzle  start + (row / 8) SBO + chunk LBO + (row % 8) 16 + byte % 16
//     swizzle W   start + (row / 8) SBO + (row % 8) W + chunk 16 + byte % 16
// MN-major (imm-trans 1, 16-bit types only): a k's elements of m (or n) are contiguous, 16 bytes holding 8:
//     no swizzle  start + (row / 8) SBO + (k / 8) LBO + (k % 8) 16 + (row % 8) 2
//     swizzle W   start + (row / (W / 2)) LBO + (k / 8) SBO + (k % 8) W + (row % (W / 2)) / 8 16 + (row % 8) 2
// (W / 2 elements of 2 bytes fill one swizzled row of W bytes: LBO steps along the rows by whole swizzle
// atoms, SBO along k by groups of 8). Every swizzled address has its bits 4.. XOR-ed with its bits 7..
// (W = 32: one bit, 64: two, 128: three), as TMA's swizzled copies write.
// The descriptor keeps only 18 bits of the address, which on a GPU is all of shared memory. Here shared
// memory is host memory anywhere in 64 bits: a descriptor is read as pointing into the block's dynamic
// shared memory (extern __shared__, where Hopper kernels keep their tiles: they need more than the 48 KB a
// static array may have), at the one place there whose low 18 bits it holds. So that a static __shared__
// tile is an error rather than a read of the wrong bytes, to_shared notes when the block takes the shared
// address of a pointer into dynamic shared memory, and a descriptor is refused before that.
constexpr unsigned long long dynamic_shared_bytes = 227 * 1024;  // the most a block has (an H100's limit)

inline unsigned long long& dynamic_shared_noted() {
    static thread_local unsigned long long block;  // the block tag once a pointer into it was converted
    return block;
}

inline void note_dynamic_shared(const void* pointer) {
    const unsigned char* dynamic = (const unsigned char*)gpt2cupy_dynamic_shared_memory();
    const unsigned char* p = (const unsigned char*)pointer;
    if (p >= dynamic && p < dynamic + dynamic_shared_bytes && relaxed_load(dynamic_shared_noted()) != block_tag())
        relaxed_store(dynamic_shared_noted(), block_tag());
}

struct SharedMatrix {
    const unsigned char* dynamic;  // the block's dynamic shared memory, where the matrix must lie
    const unsigned char* start;
    unsigned long long leading, stride, swizzle;  // swizzle: its width in bytes, 0 for none
    bool mn_major;                                 // imm-trans 1
    const char* name;
    int line;

    const unsigned char* address(int row, int k, int element_bytes) const {
        if (mn_major) {
            const unsigned long long within = 2 * (row % 8);
            if (swizzle == 0) return start + (row / 8) * stride + (k / 8) * leading + (k % 8) * 16 + within;
            const unsigned long long atom = swizzle / 2;  // elements of one swizzled row
            return swizzled((unsigned long long)start + (row / atom) * leading + (k / 8) * stride + (k % 8) * swizzle +
                            (row % atom) / 8 * 16 + within);
        }
        const unsigned long long byte = (unsigned long long)k * element_bytes, chunk = byte / 16, within = byte % 16;
        if (swizzle == 0) return start + (row / 8) * stride + chunk * leading + (row % 8) * 16 + within;
        return swizzled((unsigned long long)start + (row / 8) * stride + (row % 8) * swizzle + chunk * 16 + within);
    }

    const unsigned char* swizzled(unsigned long long at) const {
        return (const unsigned char*)(at ^ ((at >> 7) & (swizzle / 16 - 1)) << 4);
    }

    template <Input input>
    double element(int row, int k) const {
        constexpr int bytes = input == Input::tf32 ? 4 : 2;
        const unsigned char* at = address(row, k, bytes);
        if (at < dynamic || at + bytes > dynamic + dynamic_shared_bytes) fail(name, line);
        if (input == Input::tf32) {  // the upper 19 bits of the float32 in shared memory, as mma.sync reads them
            unsigned value;
            __builtin_memcpy(&value, at, 4);
            return from_tf32(value);
        }
        unsigned short value;
        __builtin_memcpy(&value, at, 2);
        return input == Input::bf16 ? from_bf16(value) : from_f16(value);
    }
};

inline SharedMatrix decode_descriptor(unsigned long long descriptor, bool is_a, bool mn_major, int line) {
    const unsigned long long start = (descriptor & 0x3fff) << 4, mode = descriptor >> 62;
    const unsigned long long swizzle = mode == 0 ? 0 : 256 >> mode;  // 1: 128, 2: 64, 3: 32 bytes
    if (relaxed_load(dynamic_shared_noted()) != block_tag())
        fail("wgmma.mma_async: the CPU executor reads a descriptor's matrix from the block's dynamic shared memory "
             "(extern __shared__), and no thread of this block has taken the shared address of a pointer into it "
             "(tiles in static __shared__ arrays are not supported here)", line);
    if (swizzle != 0 && ((descriptor >> 49 & 7) != 0 || start % (8 * swizzle) >= swizzle))
        fail("wgmma.mma_async: the CPU executor runs swizzled matrices that start in the first row of their swizzle "
             "pattern (start address modulo 8 x the swizzle width below the width: a tile 1024-byte aligned for "
             "128-byte swizzle, plus 32 bytes per step of k) with matrix base offset 0", line);
    const unsigned char* dynamic = (const unsigned char*)gpt2cupy_dynamic_shared_memory();
    const unsigned long long offset = (start - ((unsigned long long)dynamic & 0x3ffff)) & 0x3ffff;
    return SharedMatrix{dynamic, dynamic + offset, (descriptor >> 16 & 0x3fff) << 4, (descriptor >> 32 & 0x3fff) << 4, swizzle,
                        mn_major, is_a ? "wgmma.mma_async: matrix A's descriptor reaches outside the block's dynamic shared memory"
                             : "wgmma.mma_async: matrix B's descriptor reaches outside the block's dynamic shared memory",
                        line};
}

// ---- wgmma.mma_async -----------------------------------------------------------------------------------
// D = A B + D (or A B when scale_d is false) for a 64 x n x 16 tile (64 x n x 8 for tf32), A and B both read
// from shared memory by descriptor, K-major or (imm-trans 1, which bf16 and f16 allow; tf32 is K-major only)
// MN-major, each element negated when its scale is -1. Accumulator fragment (PTX ISA, "Matrix
// Fragments for wgmma.mma_async.m64nNk16"): warp w of the warpgroup holds rows 16w .. 16w + 15, and its
// lane l = 4g + t holds, in register i,
//     row 16w + g + 8 ((i / 2) % 2), column 8 (i / 4) + 2t + i % 2
// (mma.sync's m16n8 accumulator, repeated every 8 columns). As for mma.sync, each product of two 16-bit
// values (or two TF32 values: 11-bit significands) is exact in double, the k products and D are summed in
// double and rounded to fp32 once: results
// agree with a GPU's within a few fp32 units, not bit for bit. The product is computed when the instruction
// is issued, from shared memory as it is then: a correct kernel cannot tell, as it neither writes those
// bytes nor reads D before the wgmma.wait_group that covers the instruction.
template <int n, Input input>
inline void wgmma(float (&d)[n / 2], unsigned long long a_descriptor, unsigned long long b_descriptor, bool scale_d,
                  long long scale_a, long long scale_b, long long transpose_a, long long transpose_b, int line) {
    if ((scale_a != 1 && scale_a != -1) || (scale_b != 1 && scale_b != -1) || (transpose_a != 0 && transpose_a != 1) ||
        (transpose_b != 0 && transpose_b != 1))
        fail("wgmma.mma_async: imm-scale-a and imm-scale-b must be 1 or -1, imm-trans-a and imm-trans-b 0 or 1", line);
    warpgroup_meet(step_mma | (unsigned long long)n << 8, a_descriptor, b_descriptor, line);
    if (my_warpgroup_record().fenced != block_tag())
        fail("wgmma.mma_async: no wgmma.fence before it (PTX requires one before the first wgmma.mma_async, and "
             "between other instructions' accesses to its registers and the wgmma.mma_async that uses them)", line);
    const SharedMatrix a = decode_descriptor(a_descriptor, true, transpose_a, line),
                       b = decode_descriptor(b_descriptor, false, transpose_b, line);
    if (input == Input::tf32 && (transpose_a || transpose_b))
        fail("wgmma.mma_async: .tf32 operands are K-major only (PTX has no imm-trans for .tf32)", line);
    constexpr int depth = input == Input::tf32 ? 8 : 16;
    const int warp = (thread_in_block() / 32) % 4, g = lane() / 4, t = lane() % 4;
    double a_rows[2][depth], b_columns[n / 4][depth];  // the thread's two rows of A, its n / 4 columns of B
    for (int half = 0; half < 2; ++half)
        for (int k = 0; k < depth; ++k) a_rows[half][k] = scale_a * a.element<input>(16 * warp + g + 8 * half, k);
    for (int j = 0; j < n / 4; ++j)
        for (int k = 0; k < depth; ++k) b_columns[j][k] = scale_b * b.element<input>(8 * (j / 2) + 2 * t + j % 2, k);
    for (int i = 0; i < n / 2; ++i) {
        const double* row = a_rows[(i / 2) % 2];
        const double* column = b_columns[2 * (i / 4) + i % 2];
        double sum = scale_d ? (double)d[i] : 0.0;
        for (int k = 0; k < depth; ++k) sum += row[k] * column[k];
        d[i] = (float)sum;
    }
}

// ---- mbarrier -------------------------------------------------------------------------------------------
// The barrier's 8 bytes, by their 32-bit shared address; the runtime keeps each barrier's phases (and stops the
// launch on a misuse: use before mbarrier.init, more arrivals or transaction bytes than the phase expects, a
// wait nothing will complete).
inline unsigned long long* mbarrier_at(unsigned long long address, int line) {
    unsigned char* barrier = from_shared(address, "mbarrier: the barrier's address is not a shared-memory address "
                                                  "(from __cvta_generic_to_shared or cvta.to.shared)", line);
    if ((unsigned long long)barrier % 8 != 0)
        fail("mbarrier: the barrier's address is not a multiple of 8 bytes", line);
    return (unsigned long long*)barrier;
}

inline void mbarrier_init(unsigned long long address, unsigned long long arrivals, int line) {
    gpt2cupy_mbarrier_init(mbarrier_at(address, line), (unsigned)arrivals, line);
}

inline void mbarrier_inval(unsigned long long address, int line) {
    gpt2cupy_mbarrier_inval(mbarrier_at(address, line), line);
}

// `arrivals` arrivals (mbarrier.arrive{.expect_tx}) after `bytes` more transaction bytes (expect_tx); the
// state token says which phase they belong to.
inline unsigned long long mbarrier_arrive(unsigned long long address, unsigned long long arrivals,
                                          unsigned long long bytes, int line) {
    if (arrivals == 0 && bytes == 0) return 0;
    return gpt2cupy_mbarrier_arrive(mbarrier_at(address, line), (unsigned)arrivals, bytes, line);
}

// test_wait and try_wait (whose wait the hardware may bound by a time limit: here it returns at once):
// whether the phase of the parity has completed. When not, the block's other threads run first, so that a
// spin loop lets the threads that complete the phase get there.
inline bool mbarrier_test_wait(unsigned long long address, unsigned long long parity, int line) {
    return gpt2cupy_mbarrier_test_wait(mbarrier_at(address, line), (unsigned)(parity & 1), line) != 0;
}

// The state-token forms: the token of an arrival names the phase it belonged to (bit 63 marks a token).
inline bool mbarrier_test_wait_state(unsigned long long address, unsigned long long state, int line) {
    if (!(state >> 63))
        fail("mbarrier.test_wait / try_wait: the state operand is not a token from mbarrier.arrive", line);
    return mbarrier_test_wait(address, state & 1, line);
}

// ---- bulk copies (the Tensor Memory Accelerator) -----------------------------------------------------------
// A tensor map as gpt2_cupy.tensor_map writes it for the CPU executor (CPU_TENSOR_MAP there), in the 128 bytes
// where the driver would write a CUtensorMap.
struct CpuTensorMap {
    unsigned magic, rank;
    unsigned long long address;
    unsigned element_bytes, swizzle_bytes;
    unsigned long long columns, rows, row_stride;
    unsigned box_columns, box_rows;
};
constexpr unsigned cpu_tensor_map_magic = 0x70616D74;  // "tmap"

// cp.async.bulk.tensor.<dimensions>d: the box at `coordinates` (innermost first: column, then row) of the array
// the map at generic address `map_address` describes, into shared memory at `destination`; its bytes complete
// the transactions of the barrier at shared address `barrier` when it lands.
inline void bulk_tensor_copy(int dimensions, unsigned long long destination, unsigned long long map_address,
                             const int (&coordinates)[5], unsigned long long barrier, int line) {
    const CpuTensorMap* map = (const CpuTensorMap*)map_address;
    if (map_address % 64 != 0)
        fail("cp.async.bulk.tensor: the tensor map's address is not a multiple of 64 bytes (pass the map as a "
             "`const __grid_constant__ TensorMap` parameter and give its address)", line);
    if (map->magic != cpu_tensor_map_magic)
        fail("cp.async.bulk.tensor: the tensor map is not one the CPU executor can read: make it with "
             "gpt2_cupy.tensor_map (a map the CUDA driver wrote means nothing here)", line);
    if ((int)map->rank != dimensions)
        fail("cp.async.bulk.tensor: the instruction's dimension count (.1d .. .5d) is not the tensor map's rank", line);
    if (destination % 128 != 0)
        fail("cp.async.bulk.tensor: the shared-memory destination is not a multiple of 128 bytes", line);
    // The box's first element in global memory must lie on 16 bytes (an H200 stops the kernel with an illegal
    // instruction otherwise), negative coordinates included.
    if ((long long)coordinates[0] * map->element_bytes % 16 != 0)
        fail("cp.async.bulk.tensor: the box's innermost coordinate times the element size is not a multiple of 16 "
             "bytes: a box must start on 16 bytes along the array's contiguous dimension", line);
    unsigned char* to = from_shared(destination, "cp.async.bulk.tensor: the destination is not a shared-memory "
                                                 "address (from __cvta_generic_to_shared or cvta.to.shared)", line);
    const BulkCopy copy{to, destination, (const unsigned char*)map->address, map->rows, map->columns,
                        map->row_stride, map->element_bytes, map->swizzle_bytes, map->box_rows, map->box_columns,
                        dimensions > 1 ? coordinates[1] : 0, coordinates[0]};
    gpt2cupy_bulk_copy(&copy, mbarrier_at(barrier, line), line);
}

// cp.async.bulk: `bytes` contiguous bytes (a multiple of 16, both addresses on 16 bytes) from global memory.
inline void bulk_copy(unsigned long long destination, unsigned long long source, unsigned long long bytes,
                      unsigned long long barrier, int line) {
    if (bytes % 16 != 0 || destination % 16 != 0 || source % 16 != 0)
        fail("cp.async.bulk: the size and both addresses must be multiples of 16 bytes", line);
    unsigned char* to = from_shared(destination, "cp.async.bulk: the destination is not a shared-memory address "
                                                 "(from __cvta_generic_to_shared or cvta.to.shared)", line);
    const BulkCopy copy{to, destination, (const unsigned char*)source, 1, bytes, bytes, 1, 0, 1, (unsigned)bytes, 0, 0};
    gpt2cupy_bulk_copy(&copy, mbarrier_at(barrier, line), line);
}

// cp.async.bulk.prefetch.L2: a hint that `bytes` bytes from `source` will be read; the executor has no L2 to
// fill. A GPU takes only a size and an address that are multiples of 16 bytes, as for cp.async.bulk.
inline void bulk_prefetch(unsigned long long source, unsigned long long bytes, int line) {
    if (bytes % 16 != 0 || source % 16 != 0)
        fail("cp.async.bulk.prefetch.L2: the size and the address must be multiples of 16 bytes", line);
}

// ---- elect.sync --------------------------------------------------------------------------------------------
// The lanes of `members` meet (a .sync instruction); the lowest of them that is there is elected.
inline unsigned elect_sync(unsigned long long members, bool& elected, int line) {
    if (!(((unsigned)members >> lane()) & 1)) fail("elect.sync: the executing lane is not in the member mask", line);
    const WarpExchange* table = gpt2cupy_warp_exchange((unsigned)members, 0);
    const unsigned present = table->arrived & (unsigned)members;
    const unsigned leader = __builtin_ctz(present);
    elected = leader == lane();
    return leader;
}

}  // namespace ptx
}  // namespace gpt2cupy

// CUDA's conversions between generic pointers and shared-memory addresses (size_t on a GPU too).
inline unsigned long __cvta_generic_to_shared(const void* pointer) { return gpt2cupy::ptx::to_shared(pointer); }
inline void* __cvta_shared_to_generic(unsigned long address) {
    return gpt2cupy::ptx::from_shared(address, "__cvta_shared_to_generic: not a shared-memory address", 0);
}
