// Programmatic dependent launch (compute capability 9.0 on): a kernel launched by
// gpt2_cupy.backend.launch_dependent may start while the kernel before it in the stream is still running, so
// that its launch, its blocks' start and its first loads overlap the tail of that kernel instead of following
// it. Two instructions make it safe:
//   let_next_kernel_start()     griddepcontrol.launch_dependents: the next kernel may be started once every
//                               block of this one has said so (or ended). It only allows an earlier start.
//   wait_for_previous_kernel()  griddepcontrol.wait: returns once the kernel before this one has ended and its
//                               writes are visible. A kernel launched dependent calls it before it reads
//                               anything an earlier kernel wrote, and before it writes anything.
// Before the wait a kernel may only read what no kernel launched dependent writes: a layer's weights, say.
// Where these instructions do not exist (before compute capability 9.0) the launch is an ordinary one and
// both are left out; on the CPU executor, which runs one launch to its end before the next, they do nothing.
#ifndef GPT2_CUPY_DEPENDENT_LAUNCH_CUH
#define GPT2_CUPY_DEPENDENT_LAUNCH_CUH

__device__ __forceinline__ void let_next_kernel_start()
{
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_previous_kernel()
{
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

#endif
