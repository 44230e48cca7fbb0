// The CPU executor's runtime: runs a kernel's grid of blocks on a few OS threads, and each block's
// threads as fibers (cooperative user-space threads) on one OS thread, so that GPU semantics hold:
// a thread runs until it reaches a barrier (__syncthreads, or a warp operation), then the next thread
// runs; when every thread of the block (or of the warp) has arrived, they all go on. A thread that runs
// on for a while without reaching one is preempted by a watchdog, so a thread waiting for a flag that
// another warp raises gets there.
//
// Compiled once into a shared library that the Python side loads; each kernel's own library calls
// the functions declared in executor_abi.h.
#include "executor_abi.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <csetjmp>
#include <csignal>
#include <cerrno>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#if defined(__linux__) && defined(__x86_64__)
#include <ucontext.h>
#endif

// ---- context switch ---------------------------------------------------------------------------------
// gpt2cupy_switch(save, target): store the callee-saved registers and the stack pointer of the running
// code into *save, then load target's and continue there. A fresh fiber's stack is laid out so that the
// first switch to it "returns" into gpt2cupy_fiber_start, which calls fiber_main(fiber).
extern "C" void gpt2cupy_switch(void** save, void* target);
extern "C" void gpt2cupy_fiber_start();

#if defined(__APPLE__)
#define GPT2CUPY_SYMBOL(name) "_" #name
#define GPT2CUPY_FUNCTION_TYPE(name) ""
#else
#define GPT2CUPY_SYMBOL(name) #name
#define GPT2CUPY_FUNCTION_TYPE(name) ".type " #name ",@function\n"
#endif

#if defined(__x86_64__)
// Saved on the fiber's stack, lowest address first: r15, r14, r13, r12, rbx, rbp, return address.
// Not MXCSR and the x87 control word: storing and loading them took three quarters of a switch, and no
// thread changes them (a kernel sees no fenv.h; conversions with a rounding mode round in software).
// run_blocks sets them to their defaults once, for all the fibers it runs (FloatingPointDefaults).
constexpr int saved_words = 7;
constexpr int argument_word = 3;  // r12 carries fiber_main's argument into gpt2cupy_fiber_start
asm(".text\n"
    ".globl " GPT2CUPY_SYMBOL(gpt2cupy_switch) "\n" GPT2CUPY_FUNCTION_TYPE(gpt2cupy_switch)
    GPT2CUPY_SYMBOL(gpt2cupy_switch) ":\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
    "  ret\n"
    ".globl " GPT2CUPY_SYMBOL(gpt2cupy_fiber_start) "\n" GPT2CUPY_FUNCTION_TYPE(gpt2cupy_fiber_start)
    GPT2CUPY_SYMBOL(gpt2cupy_fiber_start) ":\n"
    "  movq %r12, %rdi\n"
    "  call " GPT2CUPY_SYMBOL(gpt2cupy_fiber_main) "\n"
    "  ud2\n");
#elif defined(__aarch64__)
// Saved on the fiber's stack, lowest address first: x19..x28, x29, x30 (return address), d8..d15.
constexpr int saved_words = 20;
constexpr int argument_word = 0;  // x19 carries fiber_main's argument into gpt2cupy_fiber_start
asm(".text\n"
    ".globl " GPT2CUPY_SYMBOL(gpt2cupy_switch) "\n" GPT2CUPY_FUNCTION_TYPE(gpt2cupy_switch)
    ".p2align 2\n"
    GPT2CUPY_SYMBOL(gpt2cupy_switch) ":\n"
    "  sub sp, sp, #160\n"
    "  stp x19, x20, [sp, #0]\n  stp x21, x22, [sp, #16]\n  stp x23, x24, [sp, #32]\n"
    "  stp x25, x26, [sp, #48]\n  stp x27, x28, [sp, #64]\n  stp x29, x30, [sp, #80]\n"
    "  stp d8, d9, [sp, #96]\n  stp d10, d11, [sp, #112]\n  stp d12, d13, [sp, #128]\n  stp d14, d15, [sp, #144]\n"
    "  mov x9, sp\n  str x9, [x0]\n  mov sp, x1\n"
    "  ldp x19, x20, [sp, #0]\n  ldp x21, x22, [sp, #16]\n  ldp x23, x24, [sp, #32]\n"
    "  ldp x25, x26, [sp, #48]\n  ldp x27, x28, [sp, #64]\n  ldp x29, x30, [sp, #80]\n"
    "  ldp d8, d9, [sp, #96]\n  ldp d10, d11, [sp, #112]\n  ldp d12, d13, [sp, #128]\n  ldp d14, d15, [sp, #144]\n"
    "  add sp, sp, #160\n"
    "  ret\n"
    ".globl " GPT2CUPY_SYMBOL(gpt2cupy_fiber_start) "\n" GPT2CUPY_FUNCTION_TYPE(gpt2cupy_fiber_start)
    ".p2align 2\n"
    GPT2CUPY_SYMBOL(gpt2cupy_fiber_start) ":\n"
    "  mov x0, x19\n"
    "  bl " GPT2CUPY_SYMBOL(gpt2cupy_fiber_main) "\n"
    "  brk #0\n");
#else
#error "the CPU executor has a context switch for x86-64 and arm64 only"
#endif

namespace {

using gpt2cupy::ThreadCoordinates;
using gpt2cupy::WarpExchange;

constexpr unsigned max_threads_per_block = 1024;
constexpr unsigned warps_per_block = max_threads_per_block / 32;
// A GPU gives a thread up to 512 KiB of local memory; a fiber's stack has room for that and the calls
// around it. Only the pages a thread touches take memory: the rest is reserved address space.
constexpr size_t fiber_stack_bytes = 1024 * 1024;
// Below each stack, inaccessible pages. Kernels are compiled with -fstack-clash-protection, which
// touches a large frame page by page, so an overflow faults here rather than in a neighbour's stack.
constexpr size_t stack_guard_bytes = 64 * 1024;
// What a GPU block may use at most (H100: 227 KiB); the Python side enforces the per-launch limit.
constexpr size_t dynamic_shared_bytes = 227 * 1024;
constexpr size_t page_bytes_fallback = 4096;

size_t page_bytes() {
    static const size_t bytes = [] {
        long p = sysconf(_SC_PAGESIZE);
        return p > 0 ? (size_t)p : page_bytes_fallback;
    }();
    return bytes;
}

// ---- what a launch reports back ----------------------------------------------------------------------
enum Failure : int {
    ok = 0,
    assertion_failed = 1,
    memory_fault = 2,
    deadlock = 3,
    stack_overflow = 4,
    cpp_exception = 5,
    interrupted = 6,
    arithmetic_fault = 7,
    misaligned_access = 8,
    undefined_shuffle = 9,  // (race check) a shuffle read a lane that did not take part
};

}  // namespace

extern "C" {
// One race the race check found: the place both threads touched, the thread that touched it second and
// the one before it.
struct gpt2cupy_race {
    int kind;
    unsigned long long address;
    unsigned block[3], thread[3];
    unsigned other_block[3], other_thread[3];
};
constexpr int gpt2cupy_races_kept = 10;

struct gpt2cupy_launch_result {
    int failure;
    unsigned block[3];
    unsigned thread[3];
    unsigned long long fault_address;
    int fault_is_write;  // 1 write, 0 read, -1 unknown
    char message[1024];
    // The race check's findings, one per place, in the order found: how many, and the first few.
    unsigned long long race_count;
    gpt2cupy_race races[gpt2cupy_races_kept];
};

struct gpt2cupy_launch_request {
    const gpt2cupy::KernelEntry* entry;
    const unsigned char* packed_arguments;
    unsigned grid[3];
    unsigned block[3];
    int reverse_order;  // the race check runs the threads (and blocks) in the opposite order
    int worker_count;   // OS threads to use; 0: all cores
    int track_races;    // a kernel built with -fsanitize=thread reports its accesses: look for races
    // For the race check: [start, end) pairs of the array arguments' memory. Other memory a kernel
    // touches is its block's shared memory (or a variable of its own), which the next block reuses.
    const unsigned long long* global_ranges;
    int global_range_count;
    // The launch's dynamic shared memory in bytes (of the dynamic_shared_bytes a block may have at most).
    unsigned long long dynamic_shared_bytes;
    // Bytes left between the end of the block's shared memory and the guard after it (see place_shared_window);
    // or, with shared_against_lower_guard, the bounds check's window against the guard below: its dynamic
    // memory starts shared_dynamic_offset bytes above the guard's end.
    unsigned long long shared_slack_bytes;
    int shared_against_lower_guard;
    unsigned long long shared_dynamic_offset;
    // The launched kernel's own placement of the module's __shared__ declarations (kernel.py): an offset for each,
    // by its index, and their bytes. A GPU gives a kernel only the variables it can reach, so an access past them
    // faults there; null: the module's placement of them all (cuda_builtins.h).
    const unsigned long long* shared_offsets;
    unsigned long long shared_static_bytes;
};
}

namespace {

// The race check's record of fences, atomics and barriers (defined with the race check, below).
void race_block_started(unsigned long long block_linear);
void race_barrier_opened();
void judge_pending_writes();

enum class FiberState { not_started, ready, at_block_barrier, at_warp_barrier, at_tile_barrier, done };

struct Stack {
    void* mapping = nullptr;  // guard page, then the stack
    size_t mapped_bytes = 0;
    // Where the thread's stack starts: a little below the mapping's end, by a different amount for each
    // stack, so that the busiest bytes of many stacks do not all fall in the same cache sets.
    size_t colour = 0;
    char* top() const { return static_cast<char*>(mapping) + mapped_bytes - colour; }
    char* guard_begin() const { return static_cast<char*>(mapping); }
    char* guard_end() const { return static_cast<char*>(mapping) + stack_guard_bytes; }
};

struct Fiber {
    ThreadCoordinates coordinates;
    void* saved_stack_pointer = nullptr;
    Stack* stack = nullptr;
    FiberState state = FiberState::not_started;
    unsigned warp_syncs = 0;                    // warp operations it has been released from
    unsigned warp_wait_mask = 0;                // the mask of the warp operation it waits in
    unsigned long long exchange_value = 0;      // what it puts on the table there
    const WarpExchange* exchange = nullptr;     // the table of the lanes it was released with
    // Asking which lanes of its warp run this code with it (__activemask, coalesced_threads()): where in
    // the kernel's code it asks. Lanes asking at the same place are released together.
    bool finding_converged_lanes = false;
    const void* converge_site = nullptr;
    unsigned tile_first = 0, tile_count = 0;    // the threads of the tile whose sync() it waits in
    bool spinning = false;                      // it yields in a wait on an mbarrier whose phase is incomplete
};

class Launch;

// ---- Hopper's mbarriers and bulk copies: what one block has of them ------------------------------------
// An mbarrier's 8 bytes of shared memory hold its state, as the executor encodes it (MbarrierState below).
// Which barriers the block has initialized, the copies on their way and, for the race check, the clocks that
// order threads through barriers are kept here: shared memory still holds an earlier block's bytes.
struct MbarrierState {
    // bits 0-19: arrivals each phase expects; 20-39: arrivals still to come in this phase; 40-60: transaction
    // bytes still to come (signed: 21 bits); 61: the parity of the phase in progress. PTX bounds both counts
    // by 2^20 - 1.
    static constexpr unsigned long long count_limit = (1ull << 20) - 1;
    unsigned long long expected = 0, pending = 0;
    long long bytes = 0;
    unsigned parity = 0;

    static MbarrierState decode(unsigned long long bits) {
        MbarrierState state;
        state.expected = bits & count_limit;
        state.pending = (bits >> 20) & count_limit;
        state.bytes = (long long)((bits >> 40) & ((1ull << 21) - 1)) << 43 >> 43;  // sign-extended from 21 bits
        state.parity = (bits >> 61) & 1;
        return state;
    }
    unsigned long long encode() const {
        return expected | pending << 20 | ((unsigned long long)bytes & ((1ull << 21) - 1)) << 40 |
               (unsigned long long)parity << 61;
    }
};

// A copy issued and not yet landed: it lands when a thread next tests its barrier (the latest moment a GPU
// allows, so a kernel that reads the destination without waiting reads the old bytes, as it may on a GPU).
// Copies still on their way when the block ends are dropped with its shared memory.
struct PendingBulkCopy {
    gpt2cupy::BulkCopy copy;
    unsigned long long* barrier;
    unsigned issuer;  // the issuing thread's linear index
};

struct MbarrierRecord {
    unsigned long long* barrier;
    // For the race check (clock_dimension entries each): the accesses released to the barrier by the
    // arrivals of the phase in progress, and by those of the last phase completed (what a wait acquires).
    std::vector<unsigned long long> arrived_clock, completed_clock;
};

struct BlockMbarriers {
    std::vector<MbarrierRecord> records;
    std::vector<PendingBulkCopy> copies;
    // Waits that found their phase incomplete since the block's barriers last changed: when every thread
    // still running only spins on barriers, nothing will change them, and past a bound the launch fails.
    unsigned long long fruitless_waits = 0;
    // The race check's vector clocks: row i, column j is the latest release of thread j (or of the copy
    // engine acting for thread j, column thread_count + j) that thread i has acquired through a barrier.
    // Kept only under the race check, once the block initializes a barrier.
    unsigned thread_count = 0;
    unsigned clock_dimension = 0;
    std::vector<unsigned long long> clocks;

    void start_block(unsigned threads) {
        records.clear();
        copies.clear();
        fruitless_waits = 0;
        thread_count = threads;
        clock_dimension = 0;
        clocks.clear();
    }
    MbarrierRecord* find(const unsigned long long* barrier) {
        for (MbarrierRecord& record : records)
            if (record.barrier == barrier) return &record;
        return nullptr;
    }
};

// The race check's thread number of the copy engine acting for thread `issuer`: past every real thread.
constexpr unsigned copy_engine_thread(unsigned issuer) { return max_threads_per_block + issuer; }

// One per OS thread that runs blocks: the fibers of the block in hand, their stacks, and the warps' tables.
class BlockRunner {
public:
    ~BlockRunner() {
        for (Stack* stack : all_stacks_) {
            munmap(stack->mapping, stack->mapped_bytes);
            delete stack;
        }
    }

    // Runs one block to the end; false when the launch failed inside it.
    bool run_block(Launch& launch, unsigned block_linear);

    void syncthreads();
    const WarpExchange* warp_exchange(unsigned mask, unsigned long long value);
    unsigned converged_lanes(const void* site);
    void tile_sync(unsigned first, unsigned count);
    void fiber_main(Fiber* fiber);
    void fail_current(int failure, const std::string& message);
    bool address_in_stack_guard(const void* address) const {
        for (Stack* stack : all_stacks_)
            if (address >= stack->guard_begin() && address < stack->guard_end()) return true;
        return false;
    }
    Fiber* current_fiber() const { return current_; }
    // How many times a thread was resumed: the watchdog sees a thread that runs on and on without
    // reaching a barrier when this stands still.
    unsigned long long resumes() const { return resumes_; }
    void preempt_current();
    // Set while a fiber runs the kernel's own code (not the runtime's): only then may it be preempted.
    // A member rather than a thread_local: the runtime is a shared library, where each thread_local
    // access is a call (__tls_get_addr), and every barrier and warp operation reads and writes this.
    volatile sig_atomic_t in_kernel_code = 0;
    // After a jump out of kernel code (a fault, an interrupt): the block's threads are abandoned.
    void abandon_block() {
        for (Fiber& fiber : fibers_) {
            if (fiber.stack != nullptr) free_stacks_.push_back(fiber.stack);
            fiber.stack = nullptr;
        }
        current_ = nullptr;
        launch_ = nullptr;
        output_.clear();
    }
    std::string& output() { return output_; }

private:
    Stack* take_stack();
    void start(Fiber& fiber);
    void resume(Fiber& fiber);
    void wait_at_barrier();
    void switch_to_scheduler();
    Fiber* first_in_round();
    void take_from_round(const Fiber& fiber);
    Fiber* next_in_round();
    Fiber* next_unstarted_in_round();
    void note_where_stopped(Fiber& fiber);
    void run_ready_threads(bool reverse_order);
    bool release_warps();
    void release_group(unsigned warp, unsigned leader, unsigned group, bool orders_memory = true);
    bool release_converged_lanes(unsigned warp, unsigned asking);
    bool release_tiles();
    void open_block_barrier();
    bool any_lane(const unsigned (&lanes)[warps_per_block]) const {
        unsigned any = 0;
        for (unsigned w = 0; w < warp_count_; ++w) any |= lanes[w];
        return any != 0;
    }
    unsigned highest_thread(const unsigned (&lanes)[warps_per_block]) const {
        for (unsigned w = warp_count_; w-- > 0;)
            if (lanes[w] != 0) return w * 32 + 31 - __builtin_clz(lanes[w]);
        return 0;
    }

    Launch* launch_ = nullptr;
    Fiber fibers_[max_threads_per_block];
    Fiber* current_ = nullptr;
    void* scheduler_stack_pointer_ = nullptr;
    ThreadCoordinates** current_thread_slot_ = nullptr;  // this OS thread's gpt2cupy_current_thread
    // Which lanes of each warp are where, one bit per lane: the scheduler looks at these words rather
    // than at every thread's state, so a barrier or warp operation costs the same whatever the block's size.
    unsigned warp_count_ = 0;
    unsigned finished_count_ = 0;
    unsigned ready_[warps_per_block];     // to run in the next round (not started, released or preempted)
    unsigned at_block_[warps_per_block];  // waiting at __syncthreads()
    unsigned waiting_[warps_per_block];   // waiting in a warp operation
    unsigned at_tile_[warps_per_block];   // waiting in the sync() of a tile larger than a warp
    unsigned finished_[warps_per_block];  // returned from the kernel
    // Of the ready threads, those spinning on an mbarrier: they do not hold barriers shut, since what they
    // wait for may come from threads at a barrier (a warpgroup's wgmma, a __syncthreads() of others).
    unsigned spinning_[warps_per_block];
    // The round in progress: the lanes of each warp still to run in it, the warp it has reached, its order.
    unsigned round_lanes_[warps_per_block];
    unsigned round_warp_ = 0;
    bool round_reversed_ = false;
    std::vector<Stack*> free_stacks_;
    std::vector<Stack*> all_stacks_;
    // One table per (warp, lowest lane of a group released together): lanes of one warp waiting at
    // different masks are released as separate groups, each with its own table.
    WarpExchange exchanges_[warps_per_block][32];
    std::string output_;  // printf output of the block in hand
    bool block_failed_ = false;
    volatile unsigned long long resumes_ = 0;

public:
    // For the race check: which barrier interval of which block the running threads are in.
    unsigned long long epoch_ = 0;
    unsigned long long block_linear_ = 0;
    bool tracking_races_ = false;  // set for each block from its launch
    // For each thread and each lane of its warp: that lane's warp_syncs just after the last warp operation
    // both were released from together. Accesses of that lane before then are ordered before the thread's
    // from then on; a warp operation of other lanes only (a partial mask) orders nothing between them.
    // Apart from the fibers, which the scheduler walks through and should stay small.
    unsigned synced_with_[max_threads_per_block][32];
    unsigned linear_index(const Fiber* fiber) const { return static_cast<unsigned>(fiber - fibers_); }
    bool in_own_stack(const void* address) const {
        const Fiber* fiber = current_;
        return fiber != nullptr && fiber->stack != nullptr && address >= fiber->stack->guard_begin() &&
               address < fiber->stack->top();
    }
    Launch* launch() const { return launch_; }
    BlockMbarriers mbarriers;
};

thread_local BlockRunner* this_thread_runner = nullptr;
thread_local sigjmp_buf* this_thread_fault_recovery = nullptr;
// Set while a thread is inside the runtime's own code (printf's formatting and allocation), where an
// interrupt must not jump out; it is then acted on when the thread leaves.
thread_local volatile sig_atomic_t this_thread_in_runtime = 0;
thread_local volatile sig_atomic_t this_thread_interrupt_pending = 0;
thread_local unsigned long long this_thread_block_serial = 0;

void register_runner(BlockRunner* runner);
void release_runner_of_this_thread();

// Frees the thread's runner (its fibers' stacks: thousands of mappings) when the thread ends: threads that come
// and go (a simulated rank's, say) would otherwise use up the process's mappings.
struct RunnerReleaser {
    ~RunnerReleaser() { release_runner_of_this_thread(); }
};
thread_local RunnerReleaser this_thread_runner_releaser;

BlockRunner& runner_of_this_thread() {
    if (this_thread_runner == nullptr) {
        (void)&this_thread_runner_releaser;      // constructed now, so destroyed when the thread ends
        this_thread_runner = new BlockRunner();  // lives as long as the thread
        register_runner(this_thread_runner);
    }
    return *this_thread_runner;
}

// ---- a launch: the grid, its progress, its first failure and its output -----------------------------
class Launch {
public:
    explicit Launch(const gpt2cupy_launch_request& request) : request_(request) {
        block_count_ = (unsigned long long)request.grid[0] * request.grid[1] * request.grid[2];
        thread_count_ = request.block[0] * request.block[1] * request.block[2];
    }

    const gpt2cupy_launch_request& request() const { return request_; }
    unsigned thread_count() const { return thread_count_; }
    unsigned long long block_count() const { return block_count_; }

    // Blocks are handed out in order; the race check hands them out last to first.
    bool next_block(unsigned long long& block_linear) {
        if (failed()) return false;
        unsigned long long k = next_.fetch_add(1, std::memory_order_relaxed);
        if (k >= block_count_) return false;
        block_linear = request_.reverse_order ? block_count_ - 1 - k : k;
        return true;
    }

    void fail(int failure, const ThreadCoordinates* where, const std::string& message,
              unsigned long long fault_address = 0, int fault_is_write = -1) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (failed_.load()) return;  // the first failure is the one reported
        result_.failure = failure;
        if (where != nullptr) {
            result_.block[0] = where->block_idx.x;
            result_.block[1] = where->block_idx.y;
            result_.block[2] = where->block_idx.z;
            result_.thread[0] = where->thread_idx.x;
            result_.thread[1] = where->thread_idx.y;
            result_.thread[2] = where->thread_idx.z;
        }
        result_.fault_address = fault_address;
        result_.fault_is_write = fault_is_write;
        std::snprintf(result_.message, sizeof(result_.message), "%s", message.c_str());
        failed_.store(true);
    }
    bool failed() const {
        return failed_.load(std::memory_order_relaxed) || interrupted_.load(std::memory_order_relaxed);
    }
    // Called from a signal handler: only an atomic store, no lock.
    void interrupt() { interrupted_.store(true); }
    bool was_interrupted() const { return interrupted_.load(); }

    void keep_output(unsigned long long block_linear, std::string&& text) {
        if (text.empty()) return;
        std::lock_guard<std::mutex> lock(mutex_);
        outputs_.emplace_back(block_linear, std::move(text));
    }
    // printf output of all blocks, in block order (as deterministic as a program can ask for).
    std::string output() {
        std::sort(outputs_.begin(), outputs_.end(),
                  [](const auto& a, const auto& b) { return a.first < b.first; });
        std::string all;
        for (auto& block_output : outputs_) all += block_output.second;
        return all;
    }
    gpt2cupy_launch_result result() const { return result_; }
    // The race check keeps one finding per place (the first few whole, the rest counted); the launch runs
    // on, so its outputs can be compared too.
    void report_race(int kind, unsigned long long address, const ThreadCoordinates& second,
                     const ThreadCoordinates& first) {
        if (!race_places_.insert(address).second) {
            // A place already reported keeps its first finding, unless a lost update (a read, then a write
            // back) comes later: the read that began it was reported as a read of another thread's write.
            for (unsigned long long k = 0; k < std::min<unsigned long long>(result_.race_count, gpt2cupy_races_kept); ++k)
                if (result_.races[k].address == address && kind == 3 && result_.races[k].kind != 3)
                    keep_race(result_.races[k], kind, address, second, first);
            return;
        }
        if (result_.race_count < gpt2cupy_races_kept) keep_race(result_.races[result_.race_count], kind, address, second, first);
        result_.race_count += 1;
    }

private:
    gpt2cupy_launch_request request_;
    unsigned long long block_count_ = 0;
    unsigned thread_count_ = 0;
    std::atomic<unsigned long long> next_{0};
    std::atomic<bool> failed_{false};
    std::atomic<bool> interrupted_{false};
    std::mutex mutex_;
    gpt2cupy_launch_result result_{};
    std::unordered_set<unsigned long long> race_places_;  // the addresses of the races reported
    std::vector<std::pair<unsigned long long, std::string>> outputs_;

    static void keep_race(gpt2cupy_race& race, int kind, unsigned long long address, const ThreadCoordinates& second,
                          const ThreadCoordinates& first) {
        race = gpt2cupy_race{kind, address,
                             {second.block_idx.x, second.block_idx.y, second.block_idx.z},
                             {second.thread_idx.x, second.thread_idx.y, second.thread_idx.z},
                             {first.block_idx.x, first.block_idx.y, first.block_idx.z},
                             {first.thread_idx.x, first.thread_idx.y, first.thread_idx.z}};
    }
};

// ---- the scheduler of one block ---------------------------------------------------------------------
Stack* BlockRunner::take_stack() {
    if (!free_stacks_.empty()) {
        Stack* stack = free_stacks_.back();
        free_stacks_.pop_back();
        return stack;
    }
    Stack* stack = new Stack();
    stack->mapped_bytes = fiber_stack_bytes + stack_guard_bytes;
    stack->mapping = mmap(nullptr, stack->mapped_bytes, PROT_READ | PROT_WRITE,
                          MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (stack->mapping == MAP_FAILED) {
        delete stack;
        return nullptr;
    }
    // The lowest pages stay inaccessible, so a thread that overflows its stack faults there.
    mprotect(stack->mapping, stack_guard_bytes, PROT_NONE);
    stack->colour = (all_stacks_.size() % 61) * (page_bytes() + 64);
    all_stacks_.push_back(stack);
    return stack;
}

void BlockRunner::start(Fiber& fiber) {
    fiber.stack = take_stack();
    if (fiber.stack == nullptr) {
        launch_->fail(cpp_exception, &fiber.coordinates, "out of memory for the threads' stacks");
        block_failed_ = true;
        fiber.state = FiberState::done;
        return;
    }
    // Lay out a frame for gpt2cupy_switch to "return" from into gpt2cupy_fiber_start, with a 16-byte
    // aligned stack there as both ABIs require.
    uintptr_t top = reinterpret_cast<uintptr_t>(fiber.stack->top()) & ~uintptr_t(15);
    void** frame = reinterpret_cast<void**>(top) - saved_words - 2;
    std::memset(frame, 0, (saved_words + 2) * sizeof(void*));
#if defined(__x86_64__)
    frame[saved_words - 1] = reinterpret_cast<void*>(&gpt2cupy_fiber_start);
    frame[argument_word] = &fiber;
#else
    frame[11] = reinterpret_cast<void*>(&gpt2cupy_fiber_start);  // x30
    frame[argument_word] = &fiber;                               // x19
#endif
    fiber.saved_stack_pointer = frame;
    fiber.state = FiberState::ready;
}

// Runs `fiber`, and after it the threads it hands on to (wait_at_barrier), until one switches back here.
void BlockRunner::resume(Fiber& fiber) {
    current_ = &fiber;
    resumes_ = resumes_ + 1;
    *current_thread_slot_ = &fiber.coordinates;
    gpt2cupy_switch(&scheduler_stack_pointer_, fiber.saved_stack_pointer);
    Fiber& stopped = *current_;  // the last thread of that chain
    in_kernel_code = 0;
    current_ = nullptr;
    note_where_stopped(stopped);
    if (stopped.state == FiberState::done && stopped.stack != nullptr) {
        free_stacks_.push_back(stopped.stack);  // a finished thread's stack serves the next one
        stopped.stack = nullptr;
    }
}

// The running thread stops at a barrier (its state says which): the round goes on with the next thread,
// switched to directly, one switch where a round trip through the scheduler takes two. The order in which
// threads run is the scheduler's own (next_in_round); only when the round is over does the scheduler
// take over, to open barriers and release warps.
void BlockRunner::wait_at_barrier() {
    Fiber* fiber = current_;
    Fiber* next = next_in_round();
    if (next == nullptr) {
        switch_to_scheduler();
        return;
    }
    note_where_stopped(*fiber);
    current_ = next;
    resumes_ = resumes_ + 1;
    *current_thread_slot_ = &next->coordinates;
    gpt2cupy_switch(&fiber->saved_stack_pointer, next->saved_stack_pointer);
}

// A finished or preempted thread, or the last of a round, goes back to the scheduler (resume() sets the
// coordinates of the next one). A finished thread must: its stack is freed once nobody runs on it.
void BlockRunner::switch_to_scheduler() {
    Fiber* fiber = current_;
    gpt2cupy_switch(&fiber->saved_stack_pointer, scheduler_stack_pointer_);
}

// The round's next thread, left in the round, or nullptr when the round is over.
Fiber* BlockRunner::first_in_round() {
    for (; round_warp_ < warp_count_; ++round_warp_) {
        const unsigned warp = round_reversed_ ? warp_count_ - 1 - round_warp_ : round_warp_;
        const unsigned lanes = round_lanes_[warp];
        if (lanes != 0) return &fibers_[warp * 32 + (round_reversed_ ? 31 - __builtin_clz(lanes) : __builtin_ctz(lanes))];
    }
    return nullptr;
}

void BlockRunner::take_from_round(const Fiber& fiber) {
    const unsigned index = linear_index(&fiber);
    round_lanes_[index / 32] &= ~(1u << (index % 32));
}

// The next thread of the round that can run (started here if it has not been), taken out of the round, or
// nullptr when the round is over. Threads that cannot run (whose stack could not be mapped) are noted as
// they are passed.
Fiber* BlockRunner::next_in_round() {
    while (!block_failed_) {
        Fiber* fiber = first_in_round();
        if (fiber == nullptr) return nullptr;
        take_from_round(*fiber);
        if (fiber->state == FiberState::not_started) start(*fiber);
        if (fiber->state == FiberState::ready) return fiber;
        note_where_stopped(*fiber);
    }
    return nullptr;
}

// The round's next thread if it has not started yet (taken out of the round), else nullptr (left in it).
Fiber* BlockRunner::next_unstarted_in_round() {
    Fiber* fiber = first_in_round();
    if (fiber == nullptr || fiber->state != FiberState::not_started) return nullptr;
    take_from_round(*fiber);
    return fiber;
}

// Puts a thread that has stopped into the set of where it stopped.
void BlockRunner::note_where_stopped(Fiber& fiber) {
    const unsigned index = linear_index(&fiber), warp = index / 32, bit = 1u << (index % 32);
    switch (fiber.state) {
        case FiberState::done: finished_[warp] |= bit; ++finished_count_; break;
        case FiberState::at_block_barrier: at_block_[warp] |= bit; break;
        case FiberState::at_warp_barrier: waiting_[warp] |= bit; break;
        case FiberState::at_tile_barrier: at_tile_[warp] |= bit; break;
        default:  // preempted, or it yielded: it goes on next round
            ready_[warp] |= bit;
            if (fiber.spinning) spinning_[warp] |= bit;
            fiber.spinning = false;
            break;
    }
}

// A thread that has run for a while without reaching a barrier (spinning on a flag that another warp
// will set, say) steps aside, as a GPU's warps are scheduled independently: called from the preemption
// signal's handler, on the thread's own stack; it returns there when the thread is resumed.
void BlockRunner::preempt_current() {
    Fiber* fiber = current_;
    fiber->state = FiberState::ready;
    in_kernel_code = 0;
    switch_to_scheduler();
}

void BlockRunner::fiber_main(Fiber* fiber) {
    for (;;) {
        try {
            in_kernel_code = 1;
            launch_->request().entry->invoke(launch_->request().packed_arguments);
        } catch (int) {
            // gpt2cupy_assert_failed (or another failure) has recorded what happened; the block stops.
            block_failed_ = true;
        } catch (...) {
            launch_->fail(cpp_exception, &fiber->coordinates, "the kernel threw a C++ exception");
            block_failed_ = true;
        }
        in_kernel_code = 0;  // (after a throw too): a finished thread is not to be preempted
        fiber->state = FiberState::done;
        // When the round's next thread has not started yet, it runs here, on this stack, which the finished
        // thread needs no more: no switch and no new frame for each thread of a kernel without barriers.
        Fiber* next = block_failed_ ? nullptr : next_unstarted_in_round();
        if (next == nullptr) break;
        note_where_stopped(*fiber);
        next->stack = fiber->stack;
        fiber->stack = nullptr;
        next->state = FiberState::ready;
        fiber = next;
        current_ = next;
        resumes_ = resumes_ + 1;
        *current_thread_slot_ = &next->coordinates;
    }
    switch_to_scheduler();  // never resumed
}

void BlockRunner::fail_current(int failure, const std::string& message) {
    launch_->fail(failure, current_ != nullptr ? &current_->coordinates : nullptr, message);
    block_failed_ = true;
}

void BlockRunner::syncthreads() {
    current_->state = FiberState::at_block_barrier;
    wait_at_barrier();
    if (block_failed_) throw 0;  // another thread of this block failed: stop here
}

const WarpExchange* BlockRunner::warp_exchange(unsigned mask, unsigned long long value) {
    Fiber* fiber = current_;
    fiber->exchange_value = value;
    fiber->warp_wait_mask = mask | (1u << fiber->coordinates.lane);
    fiber->state = FiberState::at_warp_barrier;
    wait_at_barrier();
    if (block_failed_) throw 0;
    return fiber->exchange;
}

// The lanes of the caller's warp that run this code together with it, as a GPU's __activemask() gives
// them: the caller waits until every other lane of its warp has stopped somewhere (at a barrier, in a
// warp operation, at its end); those stopped at this same place in the code are the converged ones.
unsigned BlockRunner::converged_lanes(const void* site) {
    Fiber* fiber = current_;
    fiber->finding_converged_lanes = true;
    fiber->converge_site = site;
    fiber->warp_wait_mask = 1u << fiber->coordinates.lane;
    fiber->state = FiberState::at_warp_barrier;
    wait_at_barrier();
    fiber->finding_converged_lanes = false;
    if (block_failed_) throw 0;
    return fiber->exchange->arrived;
}

// The sync() of a tile of more than 32 threads: the threads first .. first + count - 1 of the block wait
// for each other (those that have returned count as arrived, as at __syncthreads()).
void BlockRunner::tile_sync(unsigned first, unsigned count) {
    Fiber* fiber = current_;
    fiber->tile_first = first;
    fiber->tile_count = count;
    fiber->state = FiberState::at_tile_barrier;
    wait_at_barrier();
    if (block_failed_) throw 0;
}

// A warp's waiting lanes go on as a GPU's shfl.sync/vote.sync/bar.warp.sync let them: a group of lanes
// that wait with the same mask goes on when every lane named in that mask waits with that mask too (or
// has finished). Lanes that wait with other masks wait on: after divergent code, lanes at different
// warp operations are never paired up.
// orders_memory: false for __activemask(), which tells which lanes run together but is no barrier.
void BlockRunner::release_group(unsigned warp, unsigned leader, unsigned group, bool orders_memory) {
    WarpExchange& table = exchanges_[warp][leader];
    table.arrived = group;
    for (unsigned lanes = group; lanes != 0; lanes &= lanes - 1) {
        Fiber& fiber = fibers_[warp * 32 + __builtin_ctz(lanes)];
        table.value[__builtin_ctz(lanes)] = fiber.exchange_value;
        fiber.exchange = &table;
        if (orders_memory) fiber.warp_syncs += 1;
        fiber.state = FiberState::ready;
    }
    if (tracking_races_ && orders_memory)
        for (unsigned lanes = group; lanes != 0; lanes &= lanes - 1)
            for (unsigned others = group; others != 0; others &= others - 1)
                synced_with_[warp * 32 + __builtin_ctz(lanes)][__builtin_ctz(others)] =
                    fibers_[warp * 32 + __builtin_ctz(others)].warp_syncs;
    waiting_[warp] &= ~group;
    ready_[warp] |= group;
}

// Lanes asking for their converged lanes go on only when no other group of their warp can: lanes that
// will reach the same place once released (after a shuffle in an `if`) are then there too.
bool BlockRunner::release_converged_lanes(unsigned warp, unsigned asking) {
    for (unsigned rest = asking; rest != 0;) {
        const void* site = fibers_[warp * 32 + __builtin_ctz(rest)].converge_site;
        unsigned together = 0;
        for (unsigned lanes = rest; lanes != 0; lanes &= lanes - 1)
            if (fibers_[warp * 32 + __builtin_ctz(lanes)].converge_site == site) together |= 1u << __builtin_ctz(lanes);
        release_group(warp, __builtin_ctz(together), together, false);
        rest &= ~together;
    }
    return asking != 0;
}

bool BlockRunner::release_warps() {
    bool released = false;
    for (unsigned warp = 0; warp < warp_count_; ++warp) {
        const unsigned first = warp * 32;
        unsigned asking = 0;
        for (unsigned lanes = waiting_[warp]; lanes != 0; lanes &= lanes - 1)
            if (fibers_[first + __builtin_ctz(lanes)].finding_converged_lanes) asking |= 1u << __builtin_ctz(lanes);
        const unsigned waiting = waiting_[warp] & ~asking;
        if (waiting == 0) {
            released = release_converged_lanes(warp, asking) || released;
            continue;
        }
        unsigned wanted = 0;
        for (unsigned lanes = waiting; lanes != 0; lanes &= lanes - 1)
            wanted |= fibers_[first + __builtin_ctz(lanes)].warp_wait_mask;
        unsigned lanes = std::min(32u, launch_->thread_count() - first);
        unsigned existing = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u);
        unsigned alive = existing & ~finished_[warp];
        bool released_in_warp = false;
        for (unsigned candidates = waiting; candidates != 0;) {
            unsigned leader = __builtin_ctz(candidates);
            unsigned mask = fibers_[first + leader].warp_wait_mask;
            unsigned group = mask & alive;
            bool all_there = (group & ~waiting) == 0;
            for (unsigned members = group; all_there && members != 0; members &= members - 1)
                all_there = fibers_[first + __builtin_ctz(members)].warp_wait_mask == mask;
            if (all_there) {
                release_group(warp, leader, group);
                candidates &= ~group;
                released_in_warp = true;
            } else {
                candidates &= ~(1u << leader);
            }
        }
        // Masks that do not agree (lane 0 names lanes 0-1, lane 1 names lanes 0-2): undefined on a GPU.
        // Rather than hang, the lanes go on together, as long as none waits for a lane at __syncthreads().
        if (!released_in_warp && (wanted & alive & ~waiting & ~asking) == 0) {
            release_group(warp, __builtin_ctz(waiting), waiting);
            released_in_warp = true;
        }
        if (!released_in_warp) released_in_warp = release_converged_lanes(warp, asking);
        released = released || released_in_warp;
    }
    return released;
}

// Threads waiting in the sync() of a tile go on when every thread of their tile that has not returned
// waits there too. The race check then counts it as a barrier of the whole block: it reports no false race
// between the tile's threads, though it may miss one between threads of different tiles.
bool BlockRunner::release_tiles() {
    bool released = false;
    for (unsigned warp = 0; warp < warp_count_; ++warp) {
        for (unsigned lanes = at_tile_[warp]; lanes != 0; lanes &= lanes - 1) {
            const Fiber& asker = fibers_[warp * 32 + __builtin_ctz(lanes)];
            const unsigned first = asker.tile_first, end = std::min(first + asker.tile_count, launch_->thread_count());
            bool all_there = true;
            for (unsigned t = first; all_there && t < end; ++t)
                all_there = fibers_[t].state == FiberState::done ||
                            (fibers_[t].state == FiberState::at_tile_barrier && fibers_[t].tile_first == first &&
                             fibers_[t].tile_count == asker.tile_count);
            if (!all_there) continue;
            for (unsigned t = first; t < end; ++t) {
                if (fibers_[t].state != FiberState::at_tile_barrier) continue;
                fibers_[t].state = FiberState::ready;
                at_tile_[t / 32] &= ~(1u << (t % 32));
                ready_[t / 32] |= 1u << (t % 32);
            }
            released = true;
        }
    }
    if (released) {
        epoch_ += 1;
        if (tracking_races_) judge_pending_writes();
    }
    return released;
}

// Every thread still running is at __syncthreads(): the barrier opens. (Threads that have returned
// count as arrived, as on current GPUs.)
void BlockRunner::open_block_barrier() {
    for (unsigned warp = 0; warp < warp_count_; ++warp) {
        for (unsigned lanes = at_block_[warp]; lanes != 0; lanes &= lanes - 1)
            fibers_[warp * 32 + __builtin_ctz(lanes)].state = FiberState::ready;
        ready_[warp] = at_block_[warp];
        at_block_[warp] = 0;
    }
    epoch_ += 1;  // accesses before the barrier are ordered before those after it
    if (tracking_races_) race_barrier_opened();
}

// One round: every thread that can run runs until it finishes or reaches a barrier, in the order of
// threadIdx (the race check: the opposite order); each lands in the set of where it stopped.
void BlockRunner::run_ready_threads(bool reverse_order) {
    for (unsigned warp = 0; warp < warp_count_; ++warp) {
        round_lanes_[warp] = ready_[warp];
        ready_[warp] = spinning_[warp] = 0;
    }
    round_warp_ = 0;
    round_reversed_ = reverse_order;
    while (!block_failed_) {
        Fiber* fiber = next_in_round();
        if (fiber == nullptr) return;
        resume(*fiber);
    }
}

bool BlockRunner::run_block(Launch& launch, unsigned block_linear) {
    launch_ = &launch;
    block_failed_ = false;
    output_.clear();
    current_thread_slot_ = &gpt2cupy_current_thread;
    const gpt2cupy_launch_request& request = launch.request();
    const unsigned bx = request.block[0], by = request.block[1], bz = request.block[2];
    const unsigned gx = request.grid[0], gy = request.grid[1];
    const unsigned thread_count = launch.thread_count();
    tracking_races_ = request.track_races != 0;
    const uint3 block_idx{block_linear % gx, (block_linear / gx) % gy, block_linear / (gx * gy)};
    for (unsigned t = 0; t < thread_count; ++t) {
        Fiber& fiber = fibers_[t];
        fiber.coordinates.thread_idx = uint3{t % bx, (t / bx) % by, t / (bx * by)};
        fiber.coordinates.block_idx = block_idx;
        fiber.coordinates.block_dim = dim3(bx, by, bz);
        fiber.coordinates.grid_dim = dim3(request.grid[0], request.grid[1], request.grid[2]);
        fiber.coordinates.lane = t % 32;
        fiber.state = FiberState::not_started;
        fiber.exchange = nullptr;
        fiber.warp_syncs = 0;
        fiber.stack = nullptr;
        fiber.spinning = false;
    }
    warp_count_ = (thread_count + 31) / 32;
    finished_count_ = 0;
    if (tracking_races_) std::memset(synced_with_, 0, thread_count * sizeof(synced_with_[0]));
    for (unsigned warp = 0; warp < warps_per_block; ++warp) {
        unsigned lanes = warp < warp_count_ ? std::min(32u, thread_count - warp * 32) : 0;
        ready_[warp] = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u);
        at_block_[warp] = waiting_[warp] = at_tile_[warp] = finished_[warp] = spinning_[warp] = 0;
    }
    block_linear_ = block_linear;
    epoch_ += 1;
    mbarriers.start_block(thread_count);
    if (tracking_races_) race_block_started(block_linear);
    this_thread_block_serial += 1;
    for (;;) {
        run_ready_threads(request.reverse_order != 0);
        if (block_failed_ || launch.failed()) break;
        if (finished_count_ == thread_count) break;
        bool on_their_way = false, spinning = false;  // no barrier opens while a thread is still on its way to it
        for (unsigned w = 0; w < warp_count_; ++w) {
            on_their_way |= (ready_[w] & ~spinning_[w]) != 0;
            spinning |= spinning_[w] != 0;
        }
        if (on_their_way) continue;
        const bool in_warp_operations = any_lane(waiting_), in_tiles = any_lane(at_tile_);
        if (in_warp_operations && release_warps()) continue;
        if (in_tiles && release_tiles()) continue;
        if (spinning) continue;  // the spinning threads again: what they wait for may come from one of them
        if (!in_warp_operations && !in_tiles) {
            open_block_barrier();
            continue;
        }
        // Some threads wait in a warp operation or a tile's sync() for threads that wait elsewhere (at
        // __syncthreads(), or in another tile's sync()): on a GPU this hangs.
        unsigned warp_waiter = in_warp_operations ? highest_thread(waiting_) : highest_thread(at_tile_);
        unsigned block_waiter = any_lane(at_block_) ? highest_thread(at_block_) : highest_thread(at_tile_);
        char message[320];
        const uint3 w = fibers_[warp_waiter].coordinates.thread_idx, b = fibers_[block_waiter].coordinates.thread_idx;
        std::snprintf(message, sizeof(message), "deadlock: thread (%u, %u, %u) waits in %s for thread (%u, %u, %u), which waits %s",
                      w.x, w.y, w.z,
                      in_warp_operations ? "a warp operation (shuffle, vote or __syncwarp)" : "a tile's sync()",
                      b.x, b.y, b.z, any_lane(at_block_) ? "at __syncthreads()" : "in another tile's sync()");
        launch.fail(deadlock, &fibers_[warp_waiter].coordinates, message);
        block_failed_ = true;
        break;
    }
    if (tracking_races_) judge_pending_writes();
    // Stacks of threads left waiting in a failed block go back to the pool.
    for (unsigned t = 0; t < thread_count; ++t) {
        if (fibers_[t].stack != nullptr) {
            free_stacks_.push_back(fibers_[t].stack);
            fibers_[t].stack = nullptr;
        }
    }
    launch.keep_output(block_linear, std::move(output_));
    output_ = std::string();
    launch_ = nullptr;
    gpt2cupy_current_thread = nullptr;
    return !block_failed_;
}

// ---- faults: a bad address becomes a reported failure, not a dead Python process --------------------
struct sigaction previous_segv_action, previous_bus_action, previous_fpe_action, previous_ill_action,
    previous_interrupt_action;
Launch* launch_in_flight = nullptr;
constexpr int stop_signal = SIGUSR2;  // sent to the workers when the launch is interrupted

void on_fault(int signal_number, siginfo_t* info, void* context) {
    BlockRunner* runner = this_thread_runner;
    if (runner != nullptr) runner->in_kernel_code = 0;  // no preemption from here on: this handler's frame is on the signal stack
    if (this_thread_fault_recovery == nullptr || runner == nullptr || launch_in_flight == nullptr) {
        // Not a kernel's fault: give it to whoever handled it before (Python's faulthandler, say), and
        // fault again there. The next launch puts this handler back.
        sigaction(SIGSEGV, &previous_segv_action, nullptr);
        sigaction(SIGBUS, &previous_bus_action, nullptr);
        sigaction(SIGFPE, &previous_fpe_action, nullptr);
        sigaction(SIGILL, &previous_ill_action, nullptr);
        return;
    }
    const void* address = info->si_addr;
    int is_write = -1;
#if defined(__linux__) && defined(__x86_64__)
    is_write = (static_cast<ucontext_t*>(context)->uc_mcontext.gregs[REG_ERR] & 2) ? 1 : 0;
#else
    (void)context;
#endif
    Fiber* fiber = runner->current_fiber();
    const bool overflow = signal_number != SIGFPE && signal_number != SIGILL && runner->address_in_stack_guard(address);
    int failure = memory_fault;
    char message[320];
    if (signal_number == SIGFPE) {
        // A GPU does not trap on an integer division by zero (it gives a meaningless number); a CPU
        // does. Either way the kernel divides by zero: report where.
        failure = arithmetic_fault;
        // (x86-64 reports the most negative int divided by -1 as a division by zero too.)
        std::snprintf(message, sizeof(message), "%s",
                      "integer division by zero (/ or % by 0), or of the most negative integer by -1; "
                      "a GPU would go on with a meaningless number");
        address = nullptr;
    } else if (overflow) {
        failure = stack_overflow;
        std::snprintf(message, sizeof(message),
                      "stack overflow: a thread used more than %zu KiB of local memory (a large local array? "
                      "a GPU allows at most 512 KiB per thread), or recursed too deep",
                      fiber_stack_bytes / 1024);
    } else if (signal_number == SIGILL) {
        // Kernels are compiled with an alignment check before every load and store (toolchain.py's
        // ALIGNMENT_CHECK_FLAGS), whose failure executes ud2.
        failure = misaligned_access;
        std::snprintf(message, sizeof(message), "%s",
                      "misaligned access: a load or store at an address that is not a multiple of its size (a "
                      "float4 must start at a multiple of 16 bytes, a float2 at 8, a float at 4: is the index a "
                      "multiple of the vector's width, the array's start aligned?); a GPU stops the kernel there");
        address = nullptr;
    } else if (signal_number == SIGSEGV && info->si_code == SI_KERNEL && address == nullptr) {
        // x86-64 reports a misaligned vector access (and an address outside the address space) as a
        // general protection fault, which carries no address.
        failure = misaligned_access;
        std::snprintf(message, sizeof(message),
                      "misaligned access: a vector load or store (float4, float2, double2, int4, ...) at an address "
                      "that is not a multiple of its size (a float4 must start at a multiple of 16 bytes: is the "
                      "index a multiple of 4 floats, the array's start aligned?), or a pointer far outside memory");
    } else {
        std::snprintf(message, sizeof(message), "%s of address %p, which is not memory the kernel may use (%s)",
                      is_write == 1 ? "write" : (is_write == 0 ? "read" : "access"), address,
                      signal_number == SIGBUS ? "SIGBUS" : "SIGSEGV");
    }
    launch_in_flight->fail(failure, fiber != nullptr ? &fiber->coordinates : nullptr,
                           message, reinterpret_cast<unsigned long long>(address), is_write);
    siglongjmp(*this_thread_fault_recovery, 1);
}

// Ctrl-C (an interrupt in Jupyter) stops a launch, even one whose kernel loops forever: each thread
// that is running kernel code leaves it at once; the others stop at their next block or barrier.
void leave_kernel_code_if_running_it() {
    BlockRunner* runner = this_thread_runner;
    if (runner == nullptr || runner->current_fiber() == nullptr || this_thread_fault_recovery == nullptr) return;
    if (this_thread_in_runtime) {
        this_thread_interrupt_pending = 1;
        return;
    }
    siglongjmp(*this_thread_fault_recovery, 1);
}

void stop_workers();

void on_interrupt(int) {
    if (launch_in_flight == nullptr) return;
    launch_in_flight->interrupt();
    stop_workers();
    leave_kernel_code_if_running_it();
}

void on_stop_signal(int) {
    if (launch_in_flight != nullptr && launch_in_flight->was_interrupted()) leave_kernel_code_if_running_it();
}

// Each thread that runs blocks handles its faults on a stack of its own: the faulting stack may be
// the one that overflowed. Set once per thread and kept (a handler installed by others with
// SA_ONSTACK, such as Python's faulthandler, runs on it just as well).
void use_alternate_signal_stack() {
    static thread_local std::vector<char> memory;
    if (!memory.empty()) return;
    memory.resize(64 * 1024);
    stack_t ours{};
    ours.ss_sp = memory.data();
    ours.ss_size = memory.size();
    sigaltstack(&ours, nullptr);
}

// The fault handler stays installed between launches; a launch only checks that nobody replaced it.
void install_fault_handler() {
    struct sigaction current {};
    sigaction(SIGSEGV, nullptr, &current);
    if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_fault) return;
    struct sigaction ours {};
    ours.sa_sigaction = on_fault;
    // SA_NODEFER: a handler left by siglongjmp leaves no signal blocked, so no mask needs restoring.
    ours.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&ours.sa_mask);
    sigaddset(&ours.sa_mask, SIGURG);  // no preemption (see on_preempt) while on the signal stack
    sigaction(SIGSEGV, &ours, &previous_segv_action);
    sigaction(SIGBUS, &ours, &previous_bus_action);
    sigaction(SIGFPE, &ours, &previous_fpe_action);
    sigaction(SIGILL, &ours, &previous_ill_action);
}

constexpr int preempt_signal = SIGURG;  // ignored by default, so a stray one does no harm

void on_preempt(int) {
    BlockRunner* runner = this_thread_runner;
    if (runner == nullptr || !runner->in_kernel_code || runner->current_fiber() == nullptr) return;
    int saved_errno = errno;
    runner->preempt_current();
    runner->in_kernel_code = 1;
    errno = saved_errno;
}

// The watchdog: while a launch runs, every few milliseconds it looks at each OS thread that runs blocks;
// one whose thread has not changed since the last look gets the preemption signal.
std::mutex runners_mutex;
// Never destroyed: the watchdog thread looks at it until the process ends, after static destructors too.
std::vector<std::pair<pthread_t, BlockRunner*>>& runners = *new std::vector<std::pair<pthread_t, BlockRunner*>>();
std::atomic<bool> launch_running{false};

void register_runner(BlockRunner* runner) {
    std::lock_guard<std::mutex> lock(runners_mutex);
    runners.emplace_back(pthread_self(), runner);
}

void release_runner_of_this_thread() {
    BlockRunner* runner = this_thread_runner;
    if (runner == nullptr) return;
    {
        std::lock_guard<std::mutex> lock(runners_mutex);  // the watchdog reads the list under it
        for (auto entry = runners.begin(); entry != runners.end(); ++entry) {
            if (entry->second == runner) {
                runners.erase(entry);
                break;
            }
        }
    }
    this_thread_runner = nullptr;
    delete runner;
}

void watch_for_threads_that_never_yield() {
    constexpr auto look_every = std::chrono::milliseconds(10);
    std::unordered_map<const BlockRunner*, unsigned long long> last_seen;  // by runner: threads come and go
    for (;;) {
        std::this_thread::sleep_for(look_every);
        std::lock_guard<std::mutex> lock(runners_mutex);
        for (const auto& [thread, runner] : runners) {
            unsigned long long resumes = runner->resumes();
            auto seen = last_seen.find(runner);
            if (launch_running.load() && runner->current_fiber() != nullptr && seen != last_seen.end() &&
                seen->second == resumes)
                pthread_kill(thread, preempt_signal);
            last_seen[runner] = resumes;
        }
    }
}

void start_watchdog_once() {
    static bool started = [] {
        struct sigaction preempt_action {};
        preempt_action.sa_handler = on_preempt;
        // Not on the alternate stack: the handler switches away and must keep its frame on the thread's
        // own stack. SA_NODEFER: the signal stays deliverable while the thread is switched out.
        preempt_action.sa_flags = SA_NODEFER | SA_RESTART;
        sigemptyset(&preempt_action.sa_mask);
        sigaction(preempt_signal, &preempt_action, nullptr);
        std::thread(watch_for_threads_that_never_yield).detach();
        return true;
    }();
    (void)started;
}

// The floating-point control a GPU thread computes with, set for the fibers an OS thread runs and put back
// afterwards (the switch between fibers leaves it alone): round to nearest, all exceptions masked, and
// subnormals flushed to zero, in and out (MXCSR's DAZ and FTZ bits), as a CuPy kernel computes: CuPy compiles
// every kernel with -ftz=true, so a float32 add, multiply or fma on a GPU reads a subnormal as a zero of its sign
// and writes a zero of its sign for a subnormal result (measured on an H100: -2^-149 - (-0) gives +0). The
// GPU keeps subnormal doubles, which MXCSR cannot tell apart: on the executor they are flushed too.
class FloatingPointDefaults {
public:
#if defined(__x86_64__)
    FloatingPointDefaults() {
        asm volatile("stmxcsr %0\n  fnstcw %1" : "=m"(mxcsr_), "=m"(x87_));
        const unsigned int mxcsr = 0x1F80u | 1u << 15 | 1u << 6;   // exceptions masked, FTZ, DAZ
        const unsigned short x87 = 0x037Fu;
        asm volatile("ldmxcsr %0\n  fldcw %1" : : "m"(mxcsr), "m"(x87));
    }
    ~FloatingPointDefaults() { asm volatile("ldmxcsr %0\n  fldcw %1" : : "m"(mxcsr_), "m"(x87_)); }

private:
    unsigned int mxcsr_ = 0;
    unsigned short x87_ = 0;
#endif
};

// ---- shared memory: one window per OS thread, against an inaccessible guard --------------------------------
// A GPU gives each block one window of shared memory: the kernel's __shared__ variables, then the launch's
// dynamic shared memory (extern __shared__), and an access past the window's end stops the kernel with an illegal
// address. Here the window of the blocks an OS thread runs lies in an arena of that thread's, ending where an
// inaccessible guard begins: the dynamic memory as close below the guard as its alignment (128 bytes) allows,
// the library's __shared__ variables just below it (cuda_builtins.h places them, counting down from the dynamic
// memory's start). So an access past the end of the last array faults in the guard, and the fault's address says
// it was shared memory. (Past dynamic memory whose size is not a multiple of 128 bytes, the bytes up to the next
// multiple go unreported; below the window's start, nothing is reported: the arena's bytes are there.) Below the arena, another guard: a kernel never reaches it, but a library
// whose __shared__ variables outgrew the arena would, rather than other memory.
constexpr size_t shared_arena_bytes = 4 * 1024 * 1024;
constexpr size_t shared_guard_bytes = size_t(1) << 32;  // a 32-bit shared address can go no further
constexpr size_t shared_low_guard_bytes = 64 * 1024;
constexpr size_t dynamic_shared_alignment = 128;

struct SharedArena {
    char* low = nullptr;   // the arena's first accessible byte
    char* guard = nullptr; // its first inaccessible byte past the end
    char* dynamic = nullptr;  // the current launch's dynamic shared memory, `dynamic_bytes` long
    unsigned long long dynamic_bytes = 0;
    size_t guard_bytes = 0;
};

std::mutex shared_arenas_mutex;
std::vector<SharedArena*> shared_arenas;  // every OS thread's, for the fault's message
thread_local SharedArena* this_thread_shared_arena = nullptr;

SharedArena& shared_arena() {
    if (this_thread_shared_arena != nullptr) return *this_thread_shared_arena;
    size_t guard_bytes = shared_guard_bytes;  // where the system refuses that much address space, less
    void* mapping = MAP_FAILED;
    while (guard_bytes >= 64 * 1024) {
        mapping = mmap(nullptr, shared_low_guard_bytes + shared_arena_bytes + guard_bytes, PROT_NONE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (mapping != MAP_FAILED) break;
        guard_bytes >>= 2;
    }
    if (mapping == MAP_FAILED) {
        std::perror("gpt2_cupy CPU executor: no memory for shared memory");
        std::abort();
    }
    SharedArena* arena = new SharedArena();  // lives as long as the thread, and is kept for the fault's message
    arena->low = static_cast<char*>(mapping) + shared_low_guard_bytes;
    arena->guard = arena->low + shared_arena_bytes;
    arena->guard_bytes = guard_bytes;
    mprotect(arena->low, shared_arena_bytes, PROT_READ | PROT_WRITE);
    {
        std::lock_guard<std::mutex> lock(shared_arenas_mutex);
        shared_arenas.push_back(arena);
    }
    this_thread_shared_arena = arena;
    return *arena;
}

// The window of the launch's blocks on this OS thread: `dynamic_bytes` of dynamic shared memory end `slack_bytes`
// below the guard, to within their alignment. The slack is what the __shared__ variables below the last one
// take (kernel.py): a GPU's compiler lays them out in an order of its own, in which a read past one of them may
// still lie inside the window, and so the guard is where no order of them reaches. Against the lower guard (the
// bounds check's pass with arrays against the guards below them), the window lies against the guard below the
// arena instead: its dynamic memory `dynamic_offset` bytes above the arena's start, which kernel.py chooses so
// that the first __shared__ variable lies as far above the guard as the others take.
void place_shared_window(unsigned long long dynamic_bytes, unsigned long long slack_bytes, bool against_lower_guard,
                         unsigned long long dynamic_offset) {
    SharedArena& arena = shared_arena();
    arena.dynamic_bytes = std::min<unsigned long long>(dynamic_bytes, dynamic_shared_bytes);
    slack_bytes = std::min<unsigned long long>(slack_bytes, shared_arena_bytes / 2);
    if (against_lower_guard) {
        arena.dynamic = arena.low + std::min<unsigned long long>(dynamic_offset, shared_arena_bytes / 2);
        return;
    }
    // A launch's dynamic memory is aligned to 128 bytes. Without any, the __shared__ variables below end where the
    // slack says (16 bytes apart; cuda_builtins.h aligns each variable down as it needs), not a whole unit lower.
    const uintptr_t alignment = arena.dynamic_bytes != 0 ? dynamic_shared_alignment : 16;
    arena.dynamic = reinterpret_cast<char*>(reinterpret_cast<uintptr_t>(arena.guard - slack_bytes - arena.dynamic_bytes) &
                                            ~(alignment - 1));
}

// The running launch's placement of the __shared__ declarations, for the blocks this OS thread runs
// (gpt2cupy_shared_offsets); set with the window, as each launch starts on the thread.
thread_local const unsigned long long* launch_shared_offsets = nullptr;
thread_local unsigned long long launch_shared_static_bytes = 0;

// Runs blocks of the launch until none are left; returns when done or failed.
void run_blocks(Launch& launch) {
    BlockRunner& runner = runner_of_this_thread();
    place_shared_window(launch.request().dynamic_shared_bytes, launch.request().shared_slack_bytes,
                        launch.request().shared_against_lower_guard != 0, launch.request().shared_dynamic_offset);
    launch_shared_offsets = launch.request().shared_offsets;
    launch_shared_static_bytes = launch.request().shared_static_bytes;
    FloatingPointDefaults floating_point_defaults;
    use_alternate_signal_stack();
    sigjmp_buf recovery;
    if (sigsetjmp(recovery, 0) != 0) {
        // A fault or an interrupt inside a kernel: the launch has recorded it. Its handler blocked the
        // preemption signal, and the jump here did not restore the mask.
        runner.in_kernel_code = 0;
        sigset_t preemption;
        sigemptyset(&preemption);
        sigaddset(&preemption, SIGURG);
        pthread_sigmask(SIG_UNBLOCK, &preemption, nullptr);
        runner.abandon_block();
        this_thread_fault_recovery = nullptr;
        gpt2cupy_current_thread = nullptr;
        return;
    }
    this_thread_fault_recovery = &recovery;
    unsigned long long block_linear;
    while (launch.next_block(block_linear)) {
        if (!runner.run_block(launch, (unsigned)block_linear)) break;
    }
    this_thread_fault_recovery = nullptr;
}

// ---- the workers: OS threads that take blocks while the calling thread takes them too ---------------
class WorkerPool {
public:
    static WorkerPool& instance() {
        static WorkerPool* pool = new WorkerPool();  // never destroyed: its threads outlive static teardown
        return *pool;
    }

    void run(Launch& launch, unsigned helpers_wanted) {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            while (threads_.size() < helpers_wanted && threads_.size() < max_workers) {
                threads_.emplace_back([this] { work(); });
                worker_handles_[threads_.size() - 1] = threads_.back().native_handle();
                worker_count_ = (unsigned)threads_.size();
            }
            helpers_wanted = std::min<unsigned>(helpers_wanted, (unsigned)threads_.size());
            job_ = &launch;
            helpers_active_ = helpers_wanted;
            helpers_running_ = helpers_wanted;
            ++generation_;
        }
        wake_.notify_all();
        run_blocks(launch);
        std::unique_lock<std::mutex> lock(mutex_);
        finished_.wait(lock, [this] { return helpers_running_ == 0; });
        job_ = nullptr;
    }

private:
    void work() {
        // Kernel faults are handled by the launch; keep Ctrl-C and the like for Python's thread.
        sigset_t blocked;
        sigfillset(&blocked);
        sigdelset(&blocked, SIGSEGV);
        sigdelset(&blocked, SIGBUS);
        sigdelset(&blocked, SIGFPE);
        sigdelset(&blocked, SIGILL);
        sigdelset(&blocked, stop_signal);
        sigdelset(&blocked, preempt_signal);
        pthread_sigmask(SIG_BLOCK, &blocked, nullptr);
        unsigned long long seen = 0;
        unsigned my_index;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            my_index = started_++;
        }
        for (;;) {
            Launch* job;
            {
                std::unique_lock<std::mutex> lock(mutex_);
                wake_.wait(lock, [&] { return generation_ != seen; });
                seen = generation_;
                job = my_index < helpers_active_ ? job_ : nullptr;
            }
            if (job == nullptr) continue;
            run_blocks(*job);
            {
                std::lock_guard<std::mutex> lock(mutex_);
                --helpers_running_;
            }
            finished_.notify_all();
        }
    }

    std::mutex mutex_;
    std::condition_variable wake_, finished_;
    std::vector<std::thread> threads_;

public:
    static constexpr unsigned max_workers = 256;
    // Read by a signal handler, so plain storage rather than the vector of threads.
    pthread_t worker_handles_[max_workers];
    volatile unsigned worker_count_ = 0;

private:
    Launch* job_ = nullptr;
    unsigned long long generation_ = 0;
    unsigned helpers_active_ = 0, helpers_running_ = 0, started_ = 0;
};

std::mutex launch_mutex;  // one launch at a time, like one CUDA stream

pthread_t launching_thread;  // the thread that called gpt2cupy_launch: it runs blocks too

void stop_workers() {
    WorkerPool& pool = WorkerPool::instance();
    for (unsigned w = 0; w < pool.worker_count_; ++w) pthread_kill(pool.worker_handles_[w], stop_signal);
    // Python may launch from a thread other than the one Ctrl-C lands on.
    if (!pthread_equal(launching_thread, pthread_self())) pthread_kill(launching_thread, stop_signal);
}

// ---- the race check: every access of a kernel built with -fsanitize=thread comes here -----------------
// The race pass runs on one OS thread. For each 4-byte word of memory (each byte, once a word has been
// accessed in pieces smaller than itself) it keeps the last write and the last read: which thread, in which barrier interval (epoch) of which block, after how many warp
// operations. Two accesses by different threads, at least one a write and neither atomic, race unless a
// barrier lies between them: a __syncthreads() (another epoch) or, within a warp, a warp operation the
// earlier thread has been through since. Atomics are not recorded: their order is free by design.
// Between blocks, global memory is ordered only the way a GPU orders it (the "last block" pattern, below).
enum RaceKind : int {
    no_race = 0, write_then_read = 1, write_then_write = 2, read_modify_write = 3, read_then_write = 4,
    write_then_read_without_fence = 5,  // another block's write, read after an atomic, but no __threadfence() released it
    atomic_and_plain = 6  // an atomic operation and another thread's plain access of the block, nothing between
};

struct Access {
    unsigned long long block = ~0ull, epoch = 0;
    unsigned long long sequence = 0;  // race_sequence when it happened
    unsigned thread = 0, warp_syncs = 0;
    bool valid = false;
};
struct Granule {
    Access write, read;
    Access atomic;  // the last atomic operation (compared with plain accesses of its own block only)
    bool split = false;  // a word whose bytes are tracked one by one, in race_bytes
};
std::unordered_map<unsigned long long, Granule> race_shadow;  // by word (address / 4)
std::unordered_map<unsigned long long, Granule> race_bytes;   // by byte address, for the words split

// Two threads writing one place with nothing between them race only if they write different values. CUDA's
// programming guide: where several threads of a warp write one location, one of the writes is performed, which
// one undefined; with one value the result is the same in any order (the idiom of every lane storing the
// warp's sum, reduced with shuffles that gave each lane the same number). A write that finds another thread's
// unordered write is kept here with the bytes it is about to replace, and judged once its own store has
// certainly happened: when a later access is ordered after it (its own thread's, or any after a barrier or
// warp operation between), or when the block reaches a barrier or its end. The bytes then differ from what the
// first thread left only if the two values differed: that is the race.
struct PendingWrite {
    Access second;                   // the write that found the other
    unsigned char replaced[4];       // the place's bytes before it, the other thread's value
    unsigned size;                   // 4 for a word, 1 for a byte
    ThreadCoordinates now, then;     // the second thread and the first, for the report
};
std::unordered_map<unsigned long long, PendingWrite> race_pending_writes;  // by the place's address
bool tracking_races = false;

const gpt2cupy_launch_request* race_request = nullptr;

bool in_global_memory(unsigned long long address) {
    for (int k = 0; k < race_request->global_range_count; ++k)
        if (address >= race_request->global_ranges[2 * k] && address < race_request->global_ranges[2 * k + 1])
            return true;
    return false;
}

// -- ordering between blocks: fences, atomics and barriers --
// A block may read what another block wrote when the writer released it and the reader acquired it:
//   released: the writing thread called __threadfence() after the access, then an atomic operation was taken
//     after that fence, by the same thread or, after a __syncthreads(), by any thread of its block; or the
//     access lay before a __syncthreads() after which some thread of the block fenced, then took an atomic
//     (a GPU's fences are cumulative: they also publish what the barrier showed the fencing thread);
//   acquired: the reading thread took an atomic operation after that release, or a thread of its block did
//     before a __syncthreads() the reader has passed (the ticket, shared through shared memory).
// Fences, atomics and barriers are numbered in the one order the race pass runs them (race_sequence); an
// access carries the number current when it ran. Only blocks that fence keep a record, so kernels that
// never fence pay a few stores per atomic. (An atomic counts whatever it read: one that ran after the
// release but did not see it, on another counter, passes too.)
unsigned long long race_sequence = 0;

struct Release {
    unsigned long long covers;  // accesses numbered below this are released...
    unsigned long long atomic;  // ...to whoever acquires after this atomic (0: no atomic yet)
};
struct ThreadFences {
    std::vector<unsigned long long> fences;  // the numbers of its __threadfence() calls
    std::vector<Release> releases;           // its fence, then its own atomic: covers its accesses before the fence
};
struct BlockFences {
    std::unordered_map<unsigned, ThreadFences> threads;
    std::vector<Release> barriers;     // each __syncthreads() after the first fence, with the block's first atomic after it
    std::vector<Release> whole_block;  // a barrier, then a fence and an atomic by one thread: covers the whole block before it
};
std::unordered_map<unsigned long long, BlockFences> race_fences;  // by block; only blocks that fenced

// The block in hand. Numbers below `start` belong to earlier blocks and count as none.
struct BlockOrder {
    unsigned long long block = 0, start = 0;
    unsigned long long last_barrier = 0;
    unsigned long long last_atomic = 0;    // by any of its threads
    unsigned long long shared_atomic = 0;  // the last atomic before the last barrier: every thread has seen it
    BlockFences* fences = nullptr;         // none until one of its threads fences
    unsigned long long thread_atomic[max_threads_per_block];
    unsigned long long thread_fence[max_threads_per_block];
    unsigned long long thread_fence_released[max_threads_per_block];  // the fence its last release paired with
    unsigned long long barrier_before_fence[max_threads_per_block];
} block_order;

unsigned long long in_this_block(unsigned long long number) { return number > block_order.start ? number : 0; }

void race_block_started(unsigned long long block_linear) {
    block_order.block = block_linear;
    block_order.start = ++race_sequence;
    block_order.last_barrier = block_order.last_atomic = block_order.shared_atomic = 0;
    block_order.fences = nullptr;
}

void race_barrier_opened() {
    judge_pending_writes();
    block_order.last_barrier = ++race_sequence;
    block_order.shared_atomic = block_order.last_atomic;
    if (block_order.fences != nullptr) block_order.fences->barriers.push_back({block_order.last_barrier, 0});
}

void record_fence(unsigned thread) {
    const unsigned long long fence = ++race_sequence;
    if (block_order.fences == nullptr) block_order.fences = &race_fences[block_order.block];
    block_order.fences->threads[thread].fences.push_back(fence);
    block_order.thread_fence[thread] = fence;
    block_order.barrier_before_fence[thread] = block_order.last_barrier;
}

void record_atomic(unsigned thread) {
    const unsigned long long atomic = ++race_sequence;
    block_order.thread_atomic[thread] = atomic;
    block_order.last_atomic = atomic;
    BlockFences* fences = block_order.fences;
    if (fences == nullptr) return;
    if (!fences->barriers.empty() && fences->barriers.back().atomic == 0) fences->barriers.back().atomic = atomic;
    const unsigned long long fence = in_this_block(block_order.thread_fence[thread]);
    if (fence <= in_this_block(block_order.thread_fence_released[thread])) return;  // no fence since its last release
    block_order.thread_fence_released[thread] = fence;
    fences->threads[thread].releases.push_back({fence, atomic});
    // Kept increasing in both numbers: a later release that covers no more than an earlier one adds nothing.
    const unsigned long long barrier = in_this_block(block_order.barrier_before_fence[thread]);
    if (barrier != 0 && (fences->whole_block.empty() || barrier > fences->whole_block.back().covers))
        fences->whole_block.push_back({barrier, atomic});
}

// The last atomic a thread of the block in hand has taken, or seen through a barrier (0: none).
unsigned long long acquired(unsigned thread) {
    return std::max(in_this_block(block_order.thread_atomic[thread]), block_order.shared_atomic);
}

// The first atomic after which an access of an earlier block is released to other blocks (~0: never).
unsigned long long released_at(const Access& earlier) {
    auto block = race_fences.find(earlier.block);
    if (block == race_fences.end()) return ~0ull;
    const auto covering = [&](const std::vector<Release>& releases) {  // the first release covering the access
        return std::upper_bound(releases.begin(), releases.end(), earlier.sequence,
                                [](unsigned long long number, const Release& r) { return number < r.covers; });
    };
    unsigned long long at = ~0ull;
    auto whole_block = covering(block->second.whole_block);
    if (whole_block != block->second.whole_block.end()) at = whole_block->atomic;
    auto thread = block->second.threads.find(earlier.thread);
    if (thread == block->second.threads.end()) return at;
    auto own = covering(thread->second.releases);
    if (own != thread->second.releases.end()) at = std::min(at, own->atomic);
    // Its fence after the access, then a barrier, then any thread's atomic.
    const auto& fences = thread->second.fences;
    auto fence = std::upper_bound(fences.begin(), fences.end(), earlier.sequence);
    if (fence == fences.end()) return at;
    const auto& barriers = block->second.barriers;
    auto barrier = std::upper_bound(barriers.begin(), barriers.end(), *fence,
                                    [](unsigned long long number, const Release& r) { return number < r.covers; });
    while (barrier != barriers.end() && barrier->atomic == 0) ++barrier;  // no atomic before the next barrier
    if (barrier != barriers.end()) at = std::min(at, barrier->atomic);
    return at;
}

// -- ordering within a block through mbarriers (vector clocks) --
// A thread's arrival releases its accesses so far (and what it had acquired) to the barrier's phase; a wait
// that sees the phase completed acquires all of them. A bulk copy's writes are the copy engine's, acting for
// the issuing thread: it acquires what the issuer had when it issued the copy, and its landing releases
// the writes to the barrier it completes. Releases are numbered from race_sequence, so an access is
// ordered before a thread when that thread has acquired a later release of the access's thread.
unsigned clock_column(const BlockMbarriers& book, unsigned thread) {
    return thread < max_threads_per_block ? thread : book.thread_count + (thread - max_threads_per_block);
}

unsigned long long* clock_row(BlockMbarriers& book, unsigned thread) {
    return &book.clocks[(size_t)clock_column(book, thread) * book.clock_dimension];
}

bool acquired_through_mbarrier(const BlockMbarriers& book, unsigned now_thread, const Access& earlier) {
    if (book.clock_dimension == 0) return false;
    const size_t at =
        (size_t)clock_column(book, now_thread) * book.clock_dimension + clock_column(book, earlier.thread);
    return book.clocks[at] > earlier.sequence;
}

void merge_clock(unsigned long long* into, const unsigned long long* from, unsigned dimension) {
    for (unsigned k = 0; k < dimension; ++k) into[k] = std::max(into[k], from[k]);
}

bool ordered(const BlockRunner& runner, const Access& earlier, unsigned now_thread, unsigned long long address) {
    // Shared memory is a new block's own; global memory is ordered between blocks by fences and atomics only.
    if (earlier.block != runner.block_linear_) {
        if (!in_global_memory(address)) return true;
        if (race_fences.empty()) return false;
        const unsigned long long seen = acquired(now_thread);
        return seen != 0 && released_at(earlier) < seen;
    }
    if (earlier.epoch != runner.epoch_) return true;          // a __syncthreads() lies between
    if (acquired_through_mbarrier(runner.mbarriers, now_thread, earlier)) return true;
    if (earlier.thread < max_threads_per_block && now_thread < max_threads_per_block &&
        earlier.thread / 32 == now_thread / 32)               // the same warp: a warp operation of both between?
        return runner.synced_with_[now_thread][earlier.thread % 32] > earlier.warp_syncs;
    return false;
}

void record_access_unpreempted(const volatile void* address, unsigned long long size, bool is_write, bool is_atomic);
void record_access_by(const Access& now, const volatile void* address, unsigned long long size, bool is_write,
                      bool is_atomic);

// Called from kernel code, but runtime code itself: the watchdog must not switch threads in the middle.
void record_access(const volatile void* address, unsigned long long size, bool is_write, bool is_atomic = false) {
    BlockRunner* runner = this_thread_runner;
    if (!tracking_races || runner == nullptr) return;
    sig_atomic_t was_in_kernel_code = runner->in_kernel_code;
    runner->in_kernel_code = 0;
    record_access_unpreempted(address, size, is_write, is_atomic);
    runner->in_kernel_code = was_in_kernel_code;
}

// A __threadfence() (is_fence) or an atomic operation of the running thread, for the ordering between blocks.
void record_order_event(bool is_fence);

// An atomic operation of the running thread on `size` bytes at `address`: an event that orders blocks, and an
// access that races with another thread's plain one when nothing orders the two.
void record_atomic_operation(const volatile void* address, unsigned long long size, bool is_write) {
    record_order_event(false);
    record_access(address, size, is_write, true);
}

void record_order_event(bool is_fence) {
    BlockRunner* runner = this_thread_runner;
    if (!tracking_races || runner == nullptr || runner->current_fiber() == nullptr) return;
    sig_atomic_t was_in_kernel_code = runner->in_kernel_code;
    runner->in_kernel_code = 0;  // the watchdog must not switch threads in the middle of the record
    const unsigned thread = runner->linear_index(runner->current_fiber());
    if (is_fence) record_fence(thread);
    else record_atomic(thread);
    runner->in_kernel_code = was_in_kernel_code;
}

// A kept write judged: reported if the place's bytes no longer hold what the first thread wrote.
void judge_pending_write(unsigned long long at, const PendingWrite& pending) {
    BlockRunner* runner = this_thread_runner;
    if (std::memcmp(reinterpret_cast<const void*>(at), pending.replaced, pending.size) != 0 && runner != nullptr &&
        runner->launch() != nullptr)
        runner->launch()->report_race(write_then_write, at, pending.now, pending.then);
}

// The kept write at `kept` judged, and forgotten.
void judge_and_forget(std::unordered_map<unsigned long long, PendingWrite>::iterator kept) {
    judge_pending_write(kept->first, kept->second);
    race_pending_writes.erase(kept);
}

// Every kept write judged (at a barrier and at a block's end, when every store before them has happened).
void judge_pending_writes() {
    for (const auto& [at, pending] : race_pending_writes) judge_pending_write(at, pending);
    race_pending_writes.clear();
}

// An access of the running thread to one place (a word, or a byte of a word that holds smaller data),
// checked against the place's last write and read, then recorded there. A race is reported once per
// access (`reported`), at the first place of it that races. An atomic operation is checked against the
// plain accesses, and recorded apart from them: atomic operations never race with each other.
void check_place(Granule& place, const Access& now, bool is_write, bool is_atomic, unsigned long long at,
                 unsigned place_bytes, bool& reported) {
    BlockRunner* runner = this_thread_runner;
    const unsigned thread = now.thread;
    if (!race_pending_writes.empty()) {
        // A kept write is judged by the first access ordered after it (its store has happened by then).
        const auto kept = race_pending_writes.find(at);
        if (kept != race_pending_writes.end() &&
            ((kept->second.second.thread == thread && kept->second.second.block == now.block) ||
             ordered(*runner, kept->second.second, thread, at)))
            judge_and_forget(kept);
    }
    int kind = no_race;
    const Access* other = nullptr;
    const bool read_it_first = place.read.valid && place.read.thread == thread &&
                               place.read.block == now.block && place.read.epoch == now.epoch;
    if (place.write.valid && (place.write.thread != thread || place.write.block != now.block) &&
        !ordered(*runner, place.write, thread, at)) {
        kind = !is_write ? write_then_read : (read_it_first ? read_modify_write : write_then_write);
        other = &place.write;
        // Another block's write, read after an atomic operation: the last-block pattern without its fence.
        if (kind == write_then_read && other->block != now.block && acquired(thread) > other->sequence &&
            in_global_memory(at))
            kind = write_then_read_without_fence;
    } else if (is_write && place.read.valid && (place.read.thread != thread || place.read.block != now.block) &&
               !ordered(*runner, place.read, thread, at)) {
        kind = read_then_write;
        other = &place.read;
    }
    if (is_atomic && kind != no_race) kind = atomic_and_plain;
    // A plain access after another thread's atomic operation in the block (a sum read, or started at zero,
    // while others still add). Between blocks the ticket pattern orders them; they are not compared.
    if (!is_atomic && kind == no_race && place.atomic.valid && place.atomic.block == now.block &&
        place.atomic.thread != thread && !ordered(*runner, place.atomic, thread, at)) {
        kind = atomic_and_plain;
        other = &place.atomic;
    }
    if (kind != no_race && (kind == write_then_write || !reported) && runner->launch() != nullptr) {
        // The other thread's coordinates, rebuilt from its block and linear index.
        const gpt2cupy_launch_request& request = runner->launch()->request();
        // (A bulk copy's writes are named by the thread that issued the copy.)
        ThreadCoordinates coordinates = runner->current_fiber()->coordinates;
        unsigned bx = request.block[0], by = request.block[1], gx = request.grid[0], gy = request.grid[1];
        const auto thread_idx = [&](unsigned thread) {
            thread %= max_threads_per_block;
            return uint3{thread % bx, (thread / bx) % by, thread / (bx * by)};
        };
        if (thread >= max_threads_per_block) coordinates.thread_idx = thread_idx(thread);
        ThreadCoordinates then = coordinates;
        unsigned long long b = other->block;
        then.block_idx = uint3{(unsigned)(b % gx), (unsigned)((b / gx) % gy), (unsigned)(b / ((unsigned long long)gx * gy))};
        then.thread_idx = thread_idx(other->thread);
        if (kind == write_then_write) {
            // Judged later, once this write's value is in place (race_pending_writes); a write kept before at
            // this place, by a third thread, is judged now.
            const auto kept = race_pending_writes.find(at);
            if (kept != race_pending_writes.end()) judge_and_forget(kept);
            PendingWrite pending{now, {}, place_bytes, coordinates, then};
            std::memcpy(pending.replaced, reinterpret_cast<const void*>(at), place_bytes);
            race_pending_writes.emplace(at, pending);
        } else {
            runner->launch()->report_race(kind, at, coordinates, then);
            reported = true;
        }
    }
    if (is_atomic) {
        place.atomic = now;
        return;
    }
    if (is_write) {
        place.write = now;
    } else {
        place.read = now;
    }
}

// From now on the word's bytes are tracked one by one, each starting from the word's record.
void split_word(Granule& word, unsigned long long word_address) {
    for (unsigned long long byte = 0; byte < 4; ++byte) race_bytes[word_address + byte] = Granule{word.write, word.read, word.atomic};
    word.split = true;
}

void record_access_unpreempted(const volatile void* address, unsigned long long size, bool is_write, bool is_atomic) {
    BlockRunner* runner = this_thread_runner;
    if (runner == nullptr || runner->current_fiber() == nullptr) return;
    const Fiber* fiber = runner->current_fiber();
    Access now{runner->block_linear_, runner->epoch_, race_sequence, runner->linear_index(fiber), fiber->warp_syncs, true};
    if (runner->in_own_stack(const_cast<const void*>(address))) return;
    record_access_by(now, address, size, is_write, is_atomic);
}

// An access by `now`'s thread (a kernel's thread, or the copy engine acting for one), checked and recorded.
void record_access_by(const Access& now, const volatile void* address, unsigned long long size, bool is_write,
                      bool is_atomic) {
    const unsigned long long begin = reinterpret_cast<unsigned long long>(address), end = begin + (size ? size : 1);
    bool reported = false;
    for (unsigned long long key = begin / 4; key <= (end - 1) / 4; ++key) {
        Granule& word = race_shadow[key];
        const unsigned long long word_address = key * 4;
        const unsigned long long from = std::max(begin, word_address), to = std::min(end, word_address + 4);
        if (to - from == 4 && !word.split) {
            check_place(word, now, is_write, is_atomic, word_address, 4, reported);
            continue;
        }
        // A byte or two (a half, a bfloat16, a uint8, a bool): neighbouring threads may store to the other
        // bytes of the word without racing.
        if (!word.split) split_word(word, word_address);
        for (unsigned long long byte = from; byte < to; ++byte) check_place(race_bytes[byte], now, is_write, is_atomic, byte, 1, reported);
    }
}

// ---- Hopper's mbarriers and bulk copies --------------------------------------------------------------
// PTX ISA, "Parallel Synchronization and Communication Instructions: mbarrier": a phase completes when its
// expected arrivals have come and its transaction count (bytes that copies still have to write) is 0; the
// barrier then expects as many arrivals again, in the next phase, of the other parity. These run as the
// runtime's own code, out of reach of preemption, so each update is whole.

// Where a barrier is, for messages: its byte in the block's dynamic shared memory, or its address.
std::string barrier_place(const unsigned long long* barrier) {
    const unsigned char* dynamic = static_cast<const unsigned char*>(gpt2cupy_dynamic_shared_memory());
    const unsigned char* at = reinterpret_cast<const unsigned char*>(barrier);
    char text[96];
    if (at >= dynamic && at < dynamic + dynamic_shared_bytes)
        std::snprintf(text, sizeof(text), "shared offset %llu (of the dynamic shared memory)",
                      (unsigned long long)(at - dynamic));
    else
        std::snprintf(text, sizeof(text), "shared address %p (a static __shared__ variable)", (const void*)barrier);
    return text;
}

[[noreturn]] void mbarrier_fail(const std::string& message, int line) {
    gpt2cupy_assert_failed(message.c_str(), "kernel.cu", line);
}

MbarrierRecord& initialized(BlockMbarriers& book, unsigned long long* barrier, const char* instruction, int line) {
    MbarrierRecord* record = book.find(barrier);
    if (record == nullptr)
        mbarrier_fail(std::string(instruction) + ": the barrier at " + barrier_place(barrier) + " is used before " +
                      "mbarrier.init in this block (or after mbarrier.inval): one thread initializes it, then a " +
                      "__syncthreads() lets the others use it", line);
    return *record;
}

// The running thread's arrival (or a landing copy's completion) releases what it did to the phase.
void release_to(BlockMbarriers& book, MbarrierRecord& record, unsigned thread) {
    if (book.clock_dimension == 0) return;
    const unsigned long long release = ++race_sequence;
    merge_clock(record.arrived_clock.data(), clock_row(book, thread), book.clock_dimension);
    unsigned long long& own = record.arrived_clock[clock_column(book, thread)];
    own = std::max(own, release);
}

// `arrivals` arrivals and `bytes` more (or, negative, fewer) transaction bytes, by `thread`; returns the
// parity of the phase they belong to (the state token's).
unsigned mbarrier_update(BlockMbarriers& book, MbarrierRecord& record, unsigned long long arrivals, long long bytes,
                         unsigned thread, const char* instruction, int line) {
    MbarrierState state = MbarrierState::decode(*record.barrier);
    const unsigned parity = state.parity;
    state.bytes += bytes;
    if (state.bytes < 0)
        mbarrier_fail(std::string(instruction) + ": the barrier at " + barrier_place(record.barrier) + " got " +
                      "more transaction bytes than its phase expects (its count went below 0): the bytes given " +
                      "to mbarrier.expect_tx / arrive.expect_tx must be those its copies write", line);
    if (state.bytes > (long long)MbarrierState::count_limit)
        mbarrier_fail(std::string(instruction) + ": the barrier at " + barrier_place(record.barrier) + " expects " +
                      "more than 2^20 - 1 transaction bytes in one phase", line);
    if (arrivals > state.pending)
        mbarrier_fail(std::string(instruction) + ": more arrivals on the barrier at " + barrier_place(record.barrier) +
                      " than its phase expects (it was initialized for " + std::to_string(state.expected) +
                      " per phase)", line);
    state.pending -= arrivals;
    if (arrivals != 0 || bytes < 0) release_to(book, record, thread);
    if (state.pending == 0 && state.bytes == 0) {  // the phase completes; the next begins
        state.pending = state.expected;
        state.parity ^= 1;
        if (book.clock_dimension != 0) {
            record.completed_clock = record.arrived_clock;
            std::fill(record.arrived_clock.begin(), record.arrived_clock.end(), 0ull);
        }
    }
    *record.barrier = state.encode();
    book.fruitless_waits = 0;
    return parity;
}

void mbarrier_init(BlockMbarriers& book, unsigned long long* barrier, unsigned arrivals, int line) {
    if (arrivals == 0 || arrivals > MbarrierState::count_limit)
        mbarrier_fail("mbarrier.init: the expected arrival count must be 1 .. 2^20 - 1, got " +
                      std::to_string(arrivals), line);
    if (tracking_races && book.clock_dimension == 0) {
        book.clock_dimension = 2 * book.thread_count;  // the threads, then the copy engine acting for each
        book.clocks.assign((size_t)book.clock_dimension * book.clock_dimension, 0);
    }
    MbarrierRecord* record = book.find(barrier);
    if (record == nullptr) {
        book.records.push_back(MbarrierRecord{barrier, {}, {}});
        record = &book.records.back();
    }
    record->arrived_clock.assign(book.clock_dimension, 0);
    record->completed_clock.assign(book.clock_dimension, 0);
    MbarrierState state;
    state.expected = state.pending = arrivals;
    *barrier = state.encode();
    book.fruitless_waits = 0;
}

// The copy lands: the box's bytes into shared memory, then its bytes complete the barrier's transactions.
void land(BlockRunner& runner, const PendingBulkCopy& pending, int line) {
    const gpt2cupy::BulkCopy& copy = pending.copy;
    const unsigned long long element = copy.element_bytes, row_bytes = copy.box_columns * element;
    const unsigned long long chunk_mask = copy.swizzle_bytes != 0 ? copy.swizzle_bytes / 16 - 1 : 0;
    for (unsigned r = 0; r < copy.box_rows; ++r) {
        const long long row = copy.row + r;
        for (unsigned c = 0; c < copy.box_columns; ++c) {
            const long long column = copy.column + c;
            // The swizzle moves 16-byte chunks by the shared address's bits 7.. (as the copy engine does).
            const unsigned long long at = copy.destination_address + r * row_bytes + c * element;
            const unsigned long long swizzled = at ^ ((at >> 7) & chunk_mask) << 4;
            unsigned char* to = copy.destination + (swizzled - copy.destination_address);
            const bool inside = row >= 0 && (unsigned long long)row < copy.rows && column >= 0 &&
                                (unsigned long long)column < copy.columns;
            if (inside)
                std::memcpy(to, copy.array + row * copy.row_stride + column * element, element);
            else
                std::memset(to, 0, element);
        }
    }
    BlockMbarriers& book = runner.mbarriers;
    const unsigned engine = copy_engine_thread(pending.issuer);
    const unsigned long long bytes = row_bytes * copy.box_rows;
    if (book.clock_dimension != 0) {
        // (A swizzle only moves chunks within 128-byte rows: the copy writes the same bytes unswizzled.)
        Access now{runner.block_linear_, runner.epoch_, race_sequence, engine, 0, true};
        record_access_by(now, copy.destination, bytes, true, false);
    }
    MbarrierRecord& record = initialized(book, pending.barrier, "a bulk copy's complete_tx", line);
    mbarrier_update(book, record, 0, -(long long)bytes, engine, "a bulk copy's complete_tx", line);
}

void bulk_copy(BlockRunner& runner, const gpt2cupy::BulkCopy& copy, unsigned long long* barrier, int line) {
    BlockMbarriers& book = runner.mbarriers;
    initialized(book, barrier, "cp.async.bulk", line);
    const unsigned char* dynamic = static_cast<const unsigned char*>(gpt2cupy_dynamic_shared_memory());
    const unsigned long long bytes = (unsigned long long)copy.box_rows * copy.box_columns * copy.element_bytes;
    const unsigned long long launched = std::min<unsigned long long>(runner.launch()->request().dynamic_shared_bytes,
                                                                     dynamic_shared_bytes);
    if (copy.destination >= dynamic && copy.destination < dynamic + dynamic_shared_bytes &&
        copy.destination + bytes > dynamic + launched)
        mbarrier_fail("cp.async.bulk: the copy of " + std::to_string(bytes) + " bytes at shared offset " +
                      std::to_string(copy.destination - dynamic) + " would write past the end of the block's " +
                      "dynamic shared memory (" + std::to_string(launched) + " bytes, the launch's shared_mem)", line);
    const unsigned issuer = runner.linear_index(runner.current_fiber());
    book.copies.push_back(PendingBulkCopy{copy, barrier, issuer});
    if (book.clock_dimension != 0) {  // the copy comes after what its issuer did and acquired
        unsigned long long* engine = clock_row(book, copy_engine_thread(issuer));
        merge_clock(engine, clock_row(book, issuer), book.clock_dimension);
        unsigned long long& issued = engine[clock_column(book, issuer)];
        issued = std::max(issued, ++race_sequence);
    }
    book.fruitless_waits = 0;
}

// Whether the barrier's phase of parity `parity` has completed (the last phase completed has that parity),
// after the copies that complete it have landed.
bool mbarrier_test_wait(BlockRunner& runner, unsigned long long* barrier, unsigned parity, int line) {
    BlockMbarriers& book = runner.mbarriers;
    MbarrierRecord& record = initialized(book, barrier, "mbarrier.test_wait / try_wait", line);
    for (size_t k = 0; k < book.copies.size();) {
        if (book.copies[k].barrier != barrier) {
            ++k;
            continue;
        }
        const PendingBulkCopy pending = book.copies[k];
        book.copies.erase(book.copies.begin() + k);
        land(runner, pending, line);
    }
    const MbarrierState state = MbarrierState::decode(*barrier);
    if (state.parity != (parity & 1)) {
        if (book.clock_dimension != 0)
            merge_clock(clock_row(book, runner.linear_index(runner.current_fiber())), record.completed_clock.data(),
                        book.clock_dimension);
        book.fruitless_waits = 0;
        return true;
    }
    // Every thread still running may be spinning on barriers that nothing will complete: a GPU hangs. Past
    // this many fruitless waits in a row (thousands of rounds of every thread's spin), the launch fails.
    const unsigned long long limit = std::max<unsigned long long>(1ull << 20, 4096ull * book.thread_count);
    if (++book.fruitless_waits > limit) {
        char message[640];
        std::snprintf(message, sizeof(message),
                      "deadlock: the threads of the block wait on mbarriers that nothing will complete (%llu waits "
                      "in a row found their phase incomplete, and no thread arrived or copied meanwhile); this "
                      "thread waits for the phase of parity %u of the barrier at %s, which has %llu of its %llu "
                      "arrivals and %lld transaction bytes still to come (a missing arrival, a wrong expect_tx "
                      "byte count, or a wait on the wrong parity?)",
                      book.fruitless_waits - 1, parity & 1, barrier_place(barrier).c_str(),
                      (unsigned long long)state.pending, (unsigned long long)state.expected, (long long)state.bytes);
        runner.fail_current(deadlock, message);
        throw 0;
    }
    return false;
}

}  // namespace

// ---- the ABI of -fsanitize=thread: what an instrumented kernel calls at each access and atomic ----------
extern "C" {
#define GPT2CUPY_TSAN_ACCESS(N)                                                                   \
    void __tsan_read##N(void* a) { record_access(a, N, false); }                                  \
    void __tsan_write##N(void* a) { record_access(a, N, true); }                                  \
    void __tsan_unaligned_read##N(void* a) { record_access(a, N, false); }                        \
    void __tsan_unaligned_write##N(void* a) { record_access(a, N, true); }                        \
    void __tsan_volatile_read##N(void* a) { record_access(a, N, false); }                         \
    void __tsan_volatile_write##N(void* a) { record_access(a, N, true); }
GPT2CUPY_TSAN_ACCESS(1) GPT2CUPY_TSAN_ACCESS(2) GPT2CUPY_TSAN_ACCESS(4) GPT2CUPY_TSAN_ACCESS(8)
GPT2CUPY_TSAN_ACCESS(16)
#undef GPT2CUPY_TSAN_ACCESS
void __tsan_read_range(void* a, unsigned long size) { record_access(a, size, false); }
void __tsan_write_range(void* a, unsigned long size) { record_access(a, size, true); }
void* __tsan_memcpy(void* to, const void* from, unsigned long size) {
    record_access(from, size, false);
    record_access(to, size, true);
    return std::memcpy(to, from, size);
}
void* __tsan_memmove(void* to, const void* from, unsigned long size) {
    record_access(from, size, false);
    record_access(to, size, true);
    return std::memmove(to, from, size);
}
void* __tsan_memset(void* to, int value, unsigned long size) {
    record_access(to, size, true);
    return std::memset(to, value, size);
}
void __tsan_init() {}
void __tsan_func_entry(void*) {}
void __tsan_func_exit() {}
void __tsan_vptr_update(void**, void*) {}
void __tsan_vptr_read(void**) {}
void __tsan_atomic_thread_fence(int) {
    record_order_event(true);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}
void __tsan_atomic_signal_fence(int) { __atomic_signal_fence(__ATOMIC_SEQ_CST); }
// The atomics themselves, done for real (relaxed ordering as CUDA's atomics, sequentially consistent
// where asked: the memory-order argument follows C++'s numbering, which __atomic builtins share).
#define GPT2CUPY_TSAN_ATOMIC(N, T)                                                                           \
    T __tsan_atomic##N##_load(const volatile T* a, int) {                                                    \
        record_atomic_operation(a, sizeof(T), false);                                                        \
        return __atomic_load_n(a, __ATOMIC_SEQ_CST);                                                         \
    }                                                                                                        \
    void __tsan_atomic##N##_store(volatile T* a, T v, int) {                                                 \
        record_atomic_operation(a, sizeof(T), true);                                                         \
        __atomic_store_n(a, v, __ATOMIC_SEQ_CST);                                                            \
    }                                                                                                        \
    T __tsan_atomic##N##_exchange(volatile T* a, T v, int) {                                                 \
        record_atomic_operation(a, sizeof(T), true);                                                         \
        return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST);                                                  \
    }                                                                                                        \
    GPT2CUPY_TSAN_FETCH(N, T, add) GPT2CUPY_TSAN_FETCH(N, T, sub) GPT2CUPY_TSAN_FETCH(N, T, and)             \
    GPT2CUPY_TSAN_FETCH(N, T, or) GPT2CUPY_TSAN_FETCH(N, T, xor) GPT2CUPY_TSAN_FETCH(N, T, nand)             \
    int __tsan_atomic##N##_compare_exchange_strong(volatile T* a, T* c, T v, int, int) {                    \
        record_atomic_operation(a, sizeof(T), true);                                                         \
        return __atomic_compare_exchange_n(a, c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);             \
    }                                                                                                        \
    int __tsan_atomic##N##_compare_exchange_weak(volatile T* a, T* c, T v, int, int) {                      \
        record_atomic_operation(a, sizeof(T), true);                                                         \
        return __atomic_compare_exchange_n(a, c, v, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);              \
    }                                                                                                        \
    T __tsan_atomic##N##_compare_exchange_val(volatile T* a, T c, T v, int, int) {                          \
        record_atomic_operation(a, sizeof(T), true);                                                         \
        __atomic_compare_exchange_n(a, &c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                   \
        return c;                                                                                            \
    }
#define GPT2CUPY_TSAN_FETCH(N, T, OP)                                                                        \
    T __tsan_atomic##N##_fetch_##OP(volatile T* a, T v, int) {                                               \
        record_atomic_operation(a, sizeof(T), true);                                                         \
        return __atomic_fetch_##OP(a, v, __ATOMIC_SEQ_CST);                                                  \
    }
GPT2CUPY_TSAN_ATOMIC(8, unsigned char) GPT2CUPY_TSAN_ATOMIC(16, unsigned short)
GPT2CUPY_TSAN_ATOMIC(32, unsigned int) GPT2CUPY_TSAN_ATOMIC(64, unsigned long long)
#undef GPT2CUPY_TSAN_ATOMIC
#undef GPT2CUPY_TSAN_FETCH
}  // extern "C"

namespace {
}  // namespace

// ---- the ABI the kernels call ---------------------------------------------------------------------------
extern "C" {

__thread gpt2cupy::ThreadCoordinates* gpt2cupy_current_thread = nullptr;
// extern: a const at namespace scope would otherwise be internal, and kernels would not find it.
extern const int gpt2cupy_warp_size = 32;

void gpt2cupy_fiber_main(Fiber* fiber) { this_thread_runner->fiber_main(fiber); }

void gpt2cupy_syncthreads(void) {
    BlockRunner* runner = this_thread_runner;
    runner->in_kernel_code = 0;
    runner->syncthreads();
    runner->in_kernel_code = 1;
}

const gpt2cupy::WarpExchange* gpt2cupy_warp_exchange(unsigned int mask, unsigned long long value) {
    BlockRunner* runner = this_thread_runner;
    runner->in_kernel_code = 0;
    const gpt2cupy::WarpExchange* table = runner->warp_exchange(mask, value);
    runner->in_kernel_code = 1;
    return table;
}

// Not inlined into the kernel: its return address is the place in the kernel's code that asks.
unsigned int gpt2cupy_converged_lanes(void) {
    BlockRunner* runner = this_thread_runner;
    const void* site = __builtin_return_address(0);
    runner->in_kernel_code = 0;
    unsigned lanes = runner->converged_lanes(site);
    runner->in_kernel_code = 1;
    return lanes;
}

void gpt2cupy_tile_sync(unsigned int first_thread, unsigned int thread_count) {
    BlockRunner* runner = this_thread_runner;
    runner->in_kernel_code = 0;
    runner->tile_sync(first_thread, thread_count);
    runner->in_kernel_code = 1;
}

void gpt2cupy_shuffle_from_absent_lane(unsigned int mask, unsigned int source) {
    BlockRunner* runner = this_thread_runner;
    if (!tracking_races || runner == nullptr || runner->current_fiber() == nullptr) return;
    runner->in_kernel_code = 0;
    const bool named = (mask >> source) & 1u;
    char message[512];
    std::snprintf(message, sizeof(message),
                  "a warp shuffle (mask 0x%08x) reads lane %u, which %s: CUDA leaves the value it returns undefined "
                  "(the executor would give the reading lane its own value). Name in the mask every lane the "
                  "shuffle reads, and have them all reach it (a block whose size is not a multiple of 32 has a "
                  "shorter last warp)",
                  mask, source, named ? "has exited or does not exist" : "is not in the mask");
    runner->fail_current(undefined_shuffle, message);
    throw 0;
}

void* gpt2cupy_dynamic_shared_memory(void) {
    // One block runs on an OS thread at a time, so the OS thread's window is the block's.
    SharedArena& arena = shared_arena();
    if (arena.dynamic == nullptr) place_shared_window(dynamic_shared_bytes, 0, false, 0);  // not in a launch: all of it
    return arena.dynamic;
}

const unsigned long long* gpt2cupy_shared_offsets(unsigned long long* static_bytes) {
    *static_bytes = launch_shared_static_bytes;
    return launch_shared_offsets;
}

int gpt2cupy_shared_overrun(unsigned long long address, unsigned long long* bytes_past_end,
                            unsigned long long* dynamic_bytes) {
    std::lock_guard<std::mutex> lock(shared_arenas_mutex);
    for (const SharedArena* arena : shared_arenas) {
        const unsigned long long guard = reinterpret_cast<unsigned long long>(arena->guard);
        if (address >= guard && address - guard < arena->guard_bytes) {
            *bytes_past_end = address - reinterpret_cast<unsigned long long>(arena->dynamic + arena->dynamic_bytes);
            *dynamic_bytes = arena->dynamic_bytes;
            return 1;
        }
        const unsigned long long low = reinterpret_cast<unsigned long long>(arena->low);
        if (address < low && low - address <= shared_low_guard_bytes) {  // before the window's start
            *bytes_past_end = low - address;
            *dynamic_bytes = arena->dynamic_bytes;
            return -1;
        }
    }
    return 0;
}

int gpt2cupy_printf(const char* format, ...) {
    this_thread_runner->in_kernel_code = 0;
    this_thread_in_runtime = 1;
    char buffer[1024];
    va_list arguments, again;
    va_start(arguments, format);
    va_copy(again, arguments);
    int length = std::vsnprintf(buffer, sizeof(buffer), format, arguments);
    va_end(arguments);
    if (length >= (int)sizeof(buffer)) {  // a long line: format it again, whole
        std::string& output = this_thread_runner->output();
        size_t before = output.size();
        output.resize(before + length + 1);
        std::vsnprintf(&output[before], length + 1, format, again);
        output.resize(before + length);
    } else if (length > 0) {
        this_thread_runner->output().append(buffer, length);
    }
    va_end(again);
    this_thread_in_runtime = 0;
    if (this_thread_interrupt_pending) {
        this_thread_interrupt_pending = 0;
        throw 0;  // the launch was interrupted while this thread was printing
    }
    this_thread_runner->in_kernel_code = 1;
    return length;
}

void gpt2cupy_yield(void) {
    BlockRunner* runner = this_thread_runner;
    if (runner == nullptr || runner->current_fiber() == nullptr) return;
    runner->in_kernel_code = 0;
    runner->preempt_current();
    runner->in_kernel_code = 1;
}

unsigned long long gpt2cupy_block_serial(void) { return this_thread_block_serial; }

void gpt2cupy_mbarrier_init(unsigned long long* barrier, unsigned arrivals, int line) {
    BlockRunner* runner = this_thread_runner;
    runner->in_kernel_code = 0;
    mbarrier_init(runner->mbarriers, barrier, arrivals, line);
    runner->in_kernel_code = 1;
}

void gpt2cupy_mbarrier_inval(unsigned long long* barrier, int line) {
    BlockRunner* runner = this_thread_runner;
    runner->in_kernel_code = 0;
    BlockMbarriers& book = runner->mbarriers;
    MbarrierRecord& record = initialized(book, barrier, "mbarrier.inval", line);
    book.records.erase(book.records.begin() + (&record - book.records.data()));
    runner->in_kernel_code = 1;
}

unsigned long long gpt2cupy_mbarrier_arrive(unsigned long long* barrier, unsigned arrivals, unsigned long long bytes,
                                            int line) {
    BlockRunner* runner = this_thread_runner;
    runner->in_kernel_code = 0;
    BlockMbarriers& book = runner->mbarriers;
    const char* instruction = arrivals == 0 ? "mbarrier.expect_tx" : "mbarrier.arrive";
    MbarrierRecord& record = initialized(book, barrier, instruction, line);
    if (bytes > MbarrierState::count_limit)
        mbarrier_fail(std::string(instruction) + ": a transaction count above 2^20 - 1 bytes", line);
    const unsigned parity = mbarrier_update(book, record, arrivals, (long long)bytes,
                                            runner->linear_index(runner->current_fiber()), instruction, line);
    runner->in_kernel_code = 1;
    return 1ull << 63 | parity;  // the state token: the parity of the phase the arrival belongs to
}

int gpt2cupy_mbarrier_test_wait(unsigned long long* barrier, unsigned parity, int line) {
    BlockRunner* runner = this_thread_runner;
    runner->in_kernel_code = 0;
    const bool complete = mbarrier_test_wait(*runner, barrier, parity, line);
    if (!complete) {  // the others run: the one that completes the phase among them
        runner->current_fiber()->spinning = true;
        runner->preempt_current();
    }
    runner->in_kernel_code = 1;
    return complete;
}

void gpt2cupy_bulk_copy(const gpt2cupy::BulkCopy* copy, unsigned long long* barrier, int line) {
    BlockRunner* runner = this_thread_runner;
    runner->in_kernel_code = 0;
    bulk_copy(*runner, *copy, barrier, line);
    runner->in_kernel_code = 1;
}

void gpt2cupy_assert_failed(const char* condition, const char* file, int line) {
    this_thread_runner->in_kernel_code = 0;
    this_thread_runner->fail_current(assertion_failed, std::string(file) + ":" + std::to_string(line) +
                                                           ": Assertion `" + condition + "` failed.");
    throw 0;  // unwinds the thread's own stack to fiber_main
}

void gpt2cupy_unsupported(const char* why) {
    this_thread_runner->in_kernel_code = 0;
    this_thread_runner->fail_current(cpp_exception, why);
    throw 0;
}

// ---- the ABI Python calls -----------------------------------------------------------------------------
int gpt2cupy_launch(const gpt2cupy_launch_request* request, gpt2cupy_launch_result* result,
                    char** output, unsigned long long* output_length) {
    std::lock_guard<std::mutex> one_at_a_time(launch_mutex);
    Launch launch(*request);

    install_fault_handler();
    struct sigaction interrupt_action {};
    interrupt_action.sa_handler = on_interrupt;
    interrupt_action.sa_flags = SA_ONSTACK | SA_NODEFER;
    sigemptyset(&interrupt_action.sa_mask);
    sigaddset(&interrupt_action.sa_mask, SIGURG);
    sigaction(SIGINT, &interrupt_action, &previous_interrupt_action);
    static bool stop_signal_installed = [] {
        struct sigaction stop_action {};
        stop_action.sa_handler = on_stop_signal;
        stop_action.sa_flags = SA_ONSTACK | SA_NODEFER;
        sigemptyset(&stop_action.sa_mask);
        sigaddset(&stop_action.sa_mask, SIGURG);
        return sigaction(stop_signal, &stop_action, nullptr) == 0;
    }();
    (void)stop_signal_installed;
    launching_thread = pthread_self();
    start_watchdog_once();
    tracking_races = request->track_races != 0;
    race_request = request;
    race_shadow.clear();
    race_bytes.clear();
    race_pending_writes.clear();
    race_fences.clear();
    launch_in_flight = &launch;
    launch_running.store(true);

    // Asking the system for its core count reads files: once is enough.
    static const unsigned all_cores = std::max(1u, std::thread::hardware_concurrency());
    unsigned cores = request->worker_count > 0 ? (unsigned)request->worker_count : all_cores;
    unsigned long long blocks = launch.block_count();
    unsigned helpers = (unsigned)std::min<unsigned long long>(cores - 1, blocks > 0 ? blocks - 1 : 0);
    if (request->reverse_order || request->track_races) helpers = 0;  // the race check wants one fixed order
    if (helpers == 0) run_blocks(launch);
    else WorkerPool::instance().run(launch, helpers);

    launch_running.store(false);
    launch_in_flight = nullptr;
    if (tracking_races) {
        tracking_races = false;
        race_shadow = std::unordered_map<unsigned long long, Granule>();  // its memory back
        race_bytes = std::unordered_map<unsigned long long, Granule>();
        race_fences = std::unordered_map<unsigned long long, BlockFences>();
    }
    sigaction(SIGINT, &previous_interrupt_action, nullptr);

    *result = launch.result();
    if (launch.was_interrupted()) {
        result->failure = interrupted;
        std::snprintf(result->message, sizeof(result->message), "interrupted");
    }
    std::string text = launch.output();
    *output_length = text.size();
    *output = nullptr;
    if (!text.empty()) {
        *output = static_cast<char*>(std::malloc(text.size()));
        std::memcpy(*output, text.data(), text.size());
    }
    return result->failure;
}

void gpt2cupy_free(void* pointer) { std::free(pointer); }

// Memory for the bounds check: an accessible stretch of at least `bytes` between two inaccessible
// regions as large as any 32-bit index can reach (2^32 elements of 16 bytes: 64 GiB), so that an index
// a little or a lot past either end faults, and faults in this array's guard, not in another array.
// Inaccessible address space costs no memory. Where the system refuses that much, smaller guards.
// Returns the start of the accessible stretch; the caller places the array's bytes in it, against one end.
void* gpt2cupy_guarded_alloc(unsigned long long bytes, void** mapping, unsigned long long* mapped_bytes,
                             unsigned long long* accessible_bytes) {
    size_t page = page_bytes();
    size_t data = ((bytes + page - 1) / page) * page;
    if (data == 0) data = page;
    for (size_t guard = size_t(1) << 36; guard >= 64 * 1024; guard >>= 2) {
        size_t total = guard + data + guard;
        void* base = mmap(nullptr, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (base == MAP_FAILED) continue;
        char* first = static_cast<char*>(base);
        if (mprotect(first + guard, data, PROT_READ | PROT_WRITE) != 0) {
            munmap(base, total);
            return nullptr;
        }
        *mapping = base;
        *mapped_bytes = total;
        *accessible_bytes = data;
        return first + guard;
    }
    return nullptr;
}

void gpt2cupy_guarded_free(void* mapping, unsigned long long mapped_bytes) { munmap(mapping, mapped_bytes); }

}  // extern "C"
