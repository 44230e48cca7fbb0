// The CPU executor's runtime: runs a kernel's grid of blocks on a few OS threads, and each block's
// threads as fibers (cooperative user-space threads) on one OS thread, so that GPU semantics hold:
// a thread runs until it reaches a barrier (__syncthreads, or a warp operation), then the next thread
// runs; when every thread of the block (or of the warp) has arrived, they all go on.
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
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
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
// Saved on the fiber's stack, lowest address first: MXCSR and x87 control word, r15, r14, r13, r12,
// rbx, rbp, return address.
constexpr int saved_words = 8;
constexpr int argument_word = 4;  // r12 carries fiber_main's argument into gpt2cupy_fiber_start
asm(".text\n"
    ".globl " GPT2CUPY_SYMBOL(gpt2cupy_switch) "\n" GPT2CUPY_FUNCTION_TYPE(gpt2cupy_switch)
    GPT2CUPY_SYMBOL(gpt2cupy_switch) ":\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  subq $8, %rsp\n  stmxcsr (%rsp)\n  fnstcw 4(%rsp)\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  ldmxcsr (%rsp)\n  fldcw 4(%rsp)\n  addq $8, %rsp\n"
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
constexpr size_t fiber_stack_bytes = 256 * 1024;
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
};

}  // namespace

extern "C" {
struct gpt2cupy_launch_result {
    int failure;
    unsigned block[3];
    unsigned thread[3];
    unsigned long long fault_address;
    int fault_is_write;  // 1 write, 0 read, -1 unknown
    char message[1024];
};

struct gpt2cupy_launch_request {
    const gpt2cupy::KernelEntry* entry;
    const unsigned char* packed_arguments;
    unsigned grid[3];
    unsigned block[3];
    int reverse_order;  // the race check runs the threads (and blocks) in the opposite order
    int worker_count;   // OS threads to use; 0: all cores
};
}

namespace {

enum class FiberState { not_started, ready, at_block_barrier, at_warp_barrier, done };

struct Stack {
    void* mapping = nullptr;  // guard page, then the stack
    size_t mapped_bytes = 0;
    char* top() const { return static_cast<char*>(mapping) + mapped_bytes; }
    char* guard_begin() const { return static_cast<char*>(mapping); }
    char* guard_end() const { return static_cast<char*>(mapping) + page_bytes(); }
};

struct Fiber {
    ThreadCoordinates coordinates;
    void* saved_stack_pointer = nullptr;
    Stack* stack = nullptr;
    FiberState state = FiberState::not_started;
    unsigned warp_wait_mask = 0;
    unsigned exchange_parity = 0;
};

class Launch;

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
    void fiber_main(Fiber* fiber);
    void fail_current(int failure, const std::string& message);
    bool address_in_stack_guard(const void* address) const {
        for (Stack* stack : all_stacks_)
            if (address >= stack->guard_begin() && address < stack->guard_end()) return true;
        return false;
    }
    Fiber* current_fiber() const { return current_; }
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
    void yield_to_scheduler();
    bool release_warps(unsigned thread_count);

    Launch* launch_ = nullptr;
    Fiber fibers_[max_threads_per_block];
    Fiber* current_ = nullptr;
    void* scheduler_stack_pointer_ = nullptr;
    std::vector<Stack*> free_stacks_;
    std::vector<Stack*> all_stacks_;
    WarpExchange exchanges_[2][warps_per_block];
    std::string output_;  // printf output of the block in hand
    bool block_failed_ = false;
};

thread_local BlockRunner* this_thread_runner = nullptr;
thread_local sigjmp_buf* this_thread_fault_recovery = nullptr;
// Set while a thread is inside the runtime's own code (printf's formatting and allocation), where an
// interrupt must not jump out; it is then acted on when the thread leaves.
thread_local volatile sig_atomic_t this_thread_in_runtime = 0;
thread_local volatile sig_atomic_t this_thread_interrupt_pending = 0;

BlockRunner& runner_of_this_thread() {
    if (this_thread_runner == nullptr) this_thread_runner = new BlockRunner();  // lives as long as the thread
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

private:
    gpt2cupy_launch_request request_;
    unsigned long long block_count_ = 0;
    unsigned thread_count_ = 0;
    std::atomic<unsigned long long> next_{0};
    std::atomic<bool> failed_{false};
    std::atomic<bool> interrupted_{false};
    std::mutex mutex_;
    gpt2cupy_launch_result result_{};
    std::vector<std::pair<unsigned long long, std::string>> outputs_;
};

// ---- the scheduler of one block ---------------------------------------------------------------------
Stack* BlockRunner::take_stack() {
    if (!free_stacks_.empty()) {
        Stack* stack = free_stacks_.back();
        free_stacks_.pop_back();
        return stack;
    }
    Stack* stack = new Stack();
    stack->mapped_bytes = fiber_stack_bytes + page_bytes();
    stack->mapping = mmap(nullptr, stack->mapped_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (stack->mapping == MAP_FAILED) {
        delete stack;
        return nullptr;
    }
    // The lowest page stays unmapped-in-effect, so a thread that overflows its stack faults there.
    mprotect(stack->mapping, page_bytes(), PROT_NONE);
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
    // Default MXCSR (all exceptions masked, round to nearest) and x87 control word.
    unsigned int mxcsr_and_x87[2] = {0x1F80u, 0x037Fu};
    std::memcpy(&frame[0], mxcsr_and_x87, sizeof(mxcsr_and_x87));
    frame[saved_words - 1] = reinterpret_cast<void*>(&gpt2cupy_fiber_start);
    frame[argument_word] = &fiber;
#else
    frame[11] = reinterpret_cast<void*>(&gpt2cupy_fiber_start);  // x30
    frame[argument_word] = &fiber;                               // x19
#endif
    fiber.saved_stack_pointer = frame;
    fiber.state = FiberState::ready;
}

void BlockRunner::resume(Fiber& fiber) {
    current_ = &fiber;
    gpt2cupy_current_thread = &fiber.coordinates;
    gpt2cupy_switch(&scheduler_stack_pointer_, fiber.saved_stack_pointer);
    current_ = nullptr;
    if (fiber.state == FiberState::done && fiber.stack != nullptr) {
        free_stacks_.push_back(fiber.stack);  // a finished thread's stack serves the next one
        fiber.stack = nullptr;
    }
}

void BlockRunner::yield_to_scheduler() {
    Fiber* fiber = current_;
    gpt2cupy_switch(&fiber->saved_stack_pointer, scheduler_stack_pointer_);
    gpt2cupy_current_thread = &fiber->coordinates;
}

void BlockRunner::fiber_main(Fiber* fiber) {
    try {
        launch_->request().entry->invoke(launch_->request().packed_arguments);
    } catch (int) {
        // gpt2cupy_assert_failed (or another failure) has recorded what happened; the block stops.
        block_failed_ = true;
    } catch (...) {
        launch_->fail(cpp_exception, &fiber->coordinates, "the kernel threw a C++ exception");
        block_failed_ = true;
    }
    fiber->state = FiberState::done;
    yield_to_scheduler();  // never resumed
}

void BlockRunner::fail_current(int failure, const std::string& message) {
    launch_->fail(failure, current_ != nullptr ? &current_->coordinates : nullptr, message);
    block_failed_ = true;
}

void BlockRunner::syncthreads() {
    current_->state = FiberState::at_block_barrier;
    yield_to_scheduler();
    if (block_failed_) throw 0;  // another thread of this block failed: stop here
}

const WarpExchange* BlockRunner::warp_exchange(unsigned mask, unsigned long long value) {
    Fiber* fiber = current_;
    unsigned lane = fiber->coordinates.lane;
    unsigned linear = static_cast<unsigned>(fiber - fibers_);
    WarpExchange& table = exchanges_[fiber->exchange_parity][linear / 32];
    fiber->exchange_parity ^= 1u;
    table.value[lane] = value;
    fiber->warp_wait_mask = mask | (1u << lane);
    fiber->state = FiberState::at_warp_barrier;
    yield_to_scheduler();
    if (block_failed_) throw 0;
    return &table;
}

// A warp's waiting lanes go on when every lane they wait for has arrived or has finished.
bool BlockRunner::release_warps(unsigned thread_count) {
    bool released = false;
    for (unsigned first = 0; first < thread_count; first += 32) {
        unsigned lanes = std::min(32u, thread_count - first);
        unsigned waiting = 0, finished = 0, wanted = 0;
        for (unsigned lane = 0; lane < lanes; ++lane) {
            const Fiber& fiber = fibers_[first + lane];
            if (fiber.state == FiberState::at_warp_barrier) {
                waiting |= 1u << lane;
                wanted |= fiber.warp_wait_mask;
            } else if (fiber.state == FiberState::done) {
                finished |= 1u << lane;
            }
        }
        if (waiting == 0) continue;
        unsigned existing = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u);
        if ((wanted & existing & ~finished & ~waiting) != 0) continue;  // someone it waits for is elsewhere
        for (unsigned lane = 0; lane < lanes; ++lane) {
            Fiber& fiber = fibers_[first + lane];
            if (fiber.state != FiberState::at_warp_barrier) continue;
            // The table this lane wrote to is the one of the parity before its flip.
            exchanges_[fiber.exchange_parity ^ 1u][first / 32].arrived = waiting;
            fiber.state = FiberState::ready;
        }
        released = true;
    }
    return released;
}

bool BlockRunner::run_block(Launch& launch, unsigned block_linear) {
    launch_ = &launch;
    block_failed_ = false;
    output_.clear();
    const gpt2cupy_launch_request& request = launch.request();
    const unsigned bx = request.block[0], by = request.block[1], bz = request.block[2];
    const unsigned gx = request.grid[0], gy = request.grid[1];
    const unsigned thread_count = launch.thread_count();
    const uint3 block_idx{block_linear % gx, (block_linear / gx) % gy, block_linear / (gx * gy)};
    for (unsigned t = 0; t < thread_count; ++t) {
        Fiber& fiber = fibers_[t];
        fiber.coordinates.thread_idx = uint3{t % bx, (t / bx) % by, t / (bx * by)};
        fiber.coordinates.block_idx = block_idx;
        fiber.coordinates.block_dim = dim3(bx, by, bz);
        fiber.coordinates.grid_dim = dim3(request.grid[0], request.grid[1], request.grid[2]);
        fiber.coordinates.lane = t % 32;
        fiber.state = FiberState::not_started;
        fiber.exchange_parity = 0;
        fiber.stack = nullptr;
    }
    for (;;) {
        // Run every thread that can run until it finishes or reaches a barrier.
        for (unsigned k = 0; k < thread_count && !block_failed_; ++k) {
            Fiber& fiber = fibers_[request.reverse_order ? thread_count - 1 - k : k];
            if (fiber.state == FiberState::not_started) start(fiber);
            if (fiber.state == FiberState::ready) resume(fiber);
        }
        if (block_failed_ || launch.failed()) break;
        unsigned done = 0, at_block = 0, at_warp = 0;
        for (unsigned t = 0; t < thread_count; ++t) {
            switch (fibers_[t].state) {
                case FiberState::done: ++done; break;
                case FiberState::at_block_barrier: ++at_block; break;
                case FiberState::at_warp_barrier: ++at_warp; break;
                default: break;
            }
        }
        if (done == thread_count) break;
        if (at_warp > 0 && release_warps(thread_count)) continue;
        if (at_warp == 0) {
            // Every thread still running is at __syncthreads(): the barrier opens. (Threads that have
            // returned count as arrived, as on current GPUs.)
            for (unsigned t = 0; t < thread_count; ++t)
                if (fibers_[t].state == FiberState::at_block_barrier) fibers_[t].state = FiberState::ready;
            continue;
        }
        // Some threads wait in a warp operation for lanes that wait at __syncthreads(): on a GPU this hangs.
        unsigned warp_waiter = 0, block_waiter = 0;
        for (unsigned t = 0; t < thread_count; ++t) {
            if (fibers_[t].state == FiberState::at_warp_barrier) warp_waiter = t;
            if (fibers_[t].state == FiberState::at_block_barrier) block_waiter = t;
        }
        char message[256];
        const uint3 w = fibers_[warp_waiter].coordinates.thread_idx, b = fibers_[block_waiter].coordinates.thread_idx;
        std::snprintf(message, sizeof(message),
                      "deadlock: thread (%u, %u, %u) waits in a warp operation (shuffle, vote or __syncwarp) for "
                      "thread (%u, %u, %u), which waits at __syncthreads()",
                      w.x, w.y, w.z, b.x, b.y, b.z);
        launch.fail(deadlock, &fibers_[warp_waiter].coordinates, message);
        block_failed_ = true;
        break;
    }
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
struct sigaction previous_segv_action, previous_bus_action, previous_interrupt_action;
Launch* launch_in_flight = nullptr;
constexpr int stop_signal = SIGUSR2;  // sent to the workers when the launch is interrupted

void on_fault(int signal_number, siginfo_t* info, void* context) {
    BlockRunner* runner = this_thread_runner;
    if (this_thread_fault_recovery == nullptr || runner == nullptr || launch_in_flight == nullptr) {
        // Not a kernel's fault: give it to whoever handled it before (Python's faulthandler, say), and
        // fault again there. The next launch puts this handler back.
        sigaction(SIGSEGV, &previous_segv_action, nullptr);
        sigaction(SIGBUS, &previous_bus_action, nullptr);
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
    const bool overflow = runner->address_in_stack_guard(address);
    char message[256];
    if (overflow)
        std::snprintf(message, sizeof(message),
                      "stack overflow: a thread used more than %zu KiB of local memory (a large local array?)",
                      fiber_stack_bytes / 1024);
    else
        std::snprintf(message, sizeof(message), "%s of address %p, which is not memory the kernel may use (%s)",
                      is_write == 1 ? "write" : (is_write == 0 ? "read" : "access"), address,
                      signal_number == SIGBUS ? "SIGBUS" : "SIGSEGV");
    launch_in_flight->fail(overflow ? stack_overflow : memory_fault, fiber != nullptr ? &fiber->coordinates : nullptr,
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
    sigaction(SIGSEGV, &ours, &previous_segv_action);
    sigaction(SIGBUS, &ours, &previous_bus_action);
}

// Runs blocks of the launch until none are left; returns when done or failed.
void run_blocks(Launch& launch) {
    BlockRunner& runner = runner_of_this_thread();
    use_alternate_signal_stack();
    sigjmp_buf recovery;
    if (sigsetjmp(recovery, 0) != 0) {
        // A fault or an interrupt inside a kernel: the launch has recorded it.
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

void stop_workers() {
    WorkerPool& pool = WorkerPool::instance();
    for (unsigned w = 0; w < pool.worker_count_; ++w) pthread_kill(pool.worker_handles_[w], stop_signal);
}

}  // namespace

// ---- the ABI the kernels call ---------------------------------------------------------------------------
extern "C" {

__thread gpt2cupy::ThreadCoordinates* gpt2cupy_current_thread = nullptr;
const int gpt2cupy_warp_size = 32;

void gpt2cupy_fiber_main(Fiber* fiber) { this_thread_runner->fiber_main(fiber); }

void gpt2cupy_syncthreads(void) { this_thread_runner->syncthreads(); }

const gpt2cupy::WarpExchange* gpt2cupy_warp_exchange(unsigned int mask, unsigned long long value) {
    return this_thread_runner->warp_exchange(mask, value);
}

void* gpt2cupy_dynamic_shared_memory(void) {
    // One block runs on an OS thread at a time, so one buffer per OS thread is the block's.
    alignas(256) static thread_local unsigned char memory[dynamic_shared_bytes];
    return memory;
}

int gpt2cupy_printf(const char* format, ...) {
    this_thread_in_runtime = 1;
    char buffer[1024];
    va_list arguments;
    va_start(arguments, format);
    int length = std::vsnprintf(buffer, sizeof(buffer), format, arguments);
    va_end(arguments);
    if (length > 0) this_thread_runner->output().append(buffer, std::min<size_t>(length, sizeof(buffer) - 1));
    this_thread_in_runtime = 0;
    if (this_thread_interrupt_pending) {
        this_thread_interrupt_pending = 0;
        throw 0;  // the launch was interrupted while this thread was printing
    }
    return length;
}

void gpt2cupy_assert_failed(const char* condition, const char* file, int line) {
    this_thread_runner->fail_current(assertion_failed, std::string(file) + ":" + std::to_string(line) +
                                                           ": Assertion `" + condition + "` failed.");
    throw 0;  // unwinds the thread's own stack to fiber_main
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
    sigaction(SIGINT, &interrupt_action, &previous_interrupt_action);
    static bool stop_signal_installed = [] {
        struct sigaction stop_action {};
        stop_action.sa_handler = on_stop_signal;
        stop_action.sa_flags = SA_ONSTACK | SA_NODEFER;
        sigemptyset(&stop_action.sa_mask);
        return sigaction(stop_signal, &stop_action, nullptr) == 0;
    }();
    (void)stop_signal_installed;
    launch_in_flight = &launch;

    // Asking the system for its core count reads files: once is enough.
    static const unsigned all_cores = std::max(1u, std::thread::hardware_concurrency());
    unsigned cores = request->worker_count > 0 ? (unsigned)request->worker_count : all_cores;
    unsigned long long blocks = launch.block_count();
    unsigned helpers = (unsigned)std::min<unsigned long long>(cores - 1, blocks > 0 ? blocks - 1 : 0);
    if (request->reverse_order) helpers = 0;  // the race check wants one fixed order
    if (helpers == 0) run_blocks(launch);
    else WorkerPool::instance().run(launch, helpers);

    launch_in_flight = nullptr;
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
// regions of 64 KiB, so that an index a little or a lot past either end faults. Returns the start of
// the accessible stretch; the caller places the array's bytes in it, against one end.
void* gpt2cupy_guarded_alloc(unsigned long long bytes, void** mapping, unsigned long long* mapped_bytes,
                             unsigned long long* accessible_bytes) {
    size_t page = page_bytes();
    size_t guard = ((64 * 1024 + page - 1) / page) * page;
    size_t data = ((bytes + page - 1) / page) * page;
    if (data == 0) data = page;
    size_t total = guard + data + guard;
    void* base = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) return nullptr;
    char* first = static_cast<char*>(base);
    mprotect(first, guard, PROT_NONE);
    mprotect(first + guard + data, guard, PROT_NONE);
    *mapping = base;
    *mapped_bytes = total;
    *accessible_bytes = data;
    return first + guard;
}

void gpt2cupy_guarded_free(void* mapping, unsigned long long mapped_bytes) { munmap(mapping, mapped_bytes); }

}  // extern "C"
