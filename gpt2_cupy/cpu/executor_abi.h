// What a compiled kernel and the executor's runtime agree on. Included by cuda_builtins.h (into every
// kernel) and by runtime.cpp. It includes no system header on purpose: a kernel must not see host functions.
#pragma once

struct uint3 { unsigned int x, y, z; };

struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
};

namespace gpt2cupy {

// The coordinates a running thread reads through threadIdx, blockIdx, blockDim and gridDim.
struct ThreadCoordinates {
    uint3 thread_idx;
    uint3 block_idx;
    dim3 block_dim;
    dim3 grid_dim;
    unsigned int lane;  // threadIdx's linear index modulo 32: the thread's place in its warp
};

// The 32 values a warp's lanes put on the table at one shuffle, vote or __syncwarp,
// and which lanes took part.
struct WarpExchange {
    unsigned long long value[32];
    unsigned int arrived;
};

// How the Python side reads a kernel's parameter list: one ParameterType each.
// kind: 'p' pointer, 'i' signed integer (or an enum of one), 'u' unsigned integer, 'f' floating point,
//       'b' bool, 's' any other type passed by value (a struct, a vector type such as float4)
// element_kind / element_size: for a pointer, what it points at ('v' for void); for a vector type
//       such as float4, its component ('f', 4); for a scalar, the scalar itself.
// alignment: where the argument sits in the packed buffer, which is laid out like a C struct of the
//       parameters: each at the next multiple of its alignment.
// type_name: the parameter's type as the compiler spells it, for messages (inside a longer text).
struct ParameterType {
    char kind;
    char element_kind;
    unsigned short size;
    unsigned short element_size;
    unsigned short alignment;
    const char* type_name;
};

constexpr int max_parameters = 64;
// Kept for the built-ins header's own entry helpers; arguments now travel as laid out above.
constexpr int argument_slot_bytes = 8;

struct KernelEntry {
    int parameter_count;
    ParameterType parameters[max_parameters];
    void (*invoke)(const unsigned char* packed_arguments);
};

// A bulk copy from global into shared memory (PTX's cp.async.bulk and cp.async.bulk.tensor), as the runtime
// keeps it from its issue until it lands: the box of box_rows x box_columns elements whose first element is
// (row, column) of a rows x columns array, written row after row at `destination`, each element outside the
// array as zeros, each 16-byte chunk of a row moved by the swizzle (swizzle_bytes 128: chunk c at chunk
// c ^ ((shared address >> 7) & 7), from the address it would have had unswizzled). A plain bulk copy is one
// row of `size` one-byte elements.
struct BulkCopy {
    unsigned char* destination;
    unsigned long long destination_address;  // its shared address, whose bits the swizzle reads
    const unsigned char* array;
    unsigned long long rows, columns, row_stride;  // row_stride in bytes
    unsigned element_bytes, swizzle_bytes;
    unsigned box_rows, box_columns;
    long long row, column;
};

}  // namespace gpt2cupy

extern "C" {
// The running fiber's coordinates; set by the scheduler before it resumes a thread.
extern __thread gpt2cupy::ThreadCoordinates* gpt2cupy_current_thread;

void gpt2cupy_syncthreads(void);
// Put this lane's value on the warp's table, wait for the lanes in mask, and return the table.
const gpt2cupy::WarpExchange* gpt2cupy_warp_exchange(unsigned int mask, unsigned long long value);
// The lanes of the running thread's warp that reach this call together with it (its __activemask()).
unsigned int gpt2cupy_converged_lanes(void);
// The sync() of a tile larger than a warp: wait for the block's threads first_thread .. + thread_count - 1.
void gpt2cupy_tile_sync(unsigned int first_thread, unsigned int thread_count);
// A shuffle of the running thread read lane `source`, which did not take part: under the race check the
// launch fails with where it happened; otherwise it returns and the shuffle goes on.
void gpt2cupy_shuffle_from_absent_lane(unsigned int mask, unsigned int source);
void* gpt2cupy_dynamic_shared_memory(void);
// The launched kernel's offsets of the module's __shared__ declarations (by index) and their total bytes, or
// null where the launch gives none (the module's own placement then holds).
const unsigned long long* gpt2cupy_shared_offsets(unsigned long long* static_bytes);
int gpt2cupy_printf(const char* format, ...);
[[noreturn]] void gpt2cupy_assert_failed(const char* condition, const char* file, int line);
// Something the executor cannot do as a GPU does: the launch fails with `why`.
[[noreturn]] void gpt2cupy_unsupported(const char* why);
// Let the block's other threads run before this one goes on (a thread waiting for something they do).
void gpt2cupy_yield(void);
// Grows by one each time a block starts on this OS thread: block-shared state kept by the built-ins
// (in thread_local storage) can tell a new block from the one before, even one abandoned after a fault.
unsigned long long gpt2cupy_block_serial(void);

// Hopper's shared-memory barriers (mbarrier) and the bulk copies that complete them, for ptx.h: `barrier`
// is the barrier's 8 bytes in shared memory, `line` the kernel's line for messages. A misuse stops the
// launch with a message, as a GPU would fault or hang.
void gpt2cupy_mbarrier_init(unsigned long long* barrier, unsigned arrivals, int line);
void gpt2cupy_mbarrier_inval(unsigned long long* barrier, int line);
// `arrivals` arrivals (0 for none) after adding `bytes` to the transaction count; returns the state token.
unsigned long long gpt2cupy_mbarrier_arrive(unsigned long long* barrier, unsigned arrivals, unsigned long long bytes,
                                            int line);
// Whether the phase of parity `parity` has completed; when not, the block's other threads run first.
int gpt2cupy_mbarrier_test_wait(unsigned long long* barrier, unsigned parity, int line);
// Starts a copy whose bytes count against `barrier` when it lands.
void gpt2cupy_bulk_copy(const gpt2cupy::BulkCopy* copy, unsigned long long* barrier, int line);
}
