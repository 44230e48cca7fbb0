"""Cross-entropy forward+backward over GPT-2's vocabulary on a GPU (chapter 09's benchmark).

    python -m bench.cross_entropy        prints a table and writes bench/cross_entropy.json

At N = 8192 rows (B·T = 8 x 1024) and V = 50257, each variant's time and its bandwidth counted as the bytes
that cannot be avoided: reading the logits once and writing dlogits once (2·N·V·4 bytes, 3.3 GB), next to the
device's copy bandwidth (a reference line) and PyTorch's cross_entropy forward+backward. Variants: the
chapter's first version (one thread per row), its second step (one block per row, the row kept in shared
memory, float by float: kernels/steps/cross_entropy_block_per_row.cu), the fused kernel keeping each row in
shared memory (the package's path, float4s; also compiled with 2 and 8 float4 loads in flight instead of 4),
the same writing dlogits in place of the logits, the same allocating dlogits on each call (as PyTorch's call
does, the one compared with it), the fused kernel reading each row twice (second time from L2, if it is still
there), and the forward kernel followed by the backward kernel (each reads the logits once).
"""

import numpy as np

from gpt2_cupy import backend, benchmark, kernels, testing
from gpt2_cupy.ops import cross_entropy as ce
from gpt2_cupy.ops.arrays import ceil_div

N, V = 8192, 50257
IGNORE_INDEX = -1
BLOCK_STEP_STATIC_SHARED_BYTES = 2 * 32 * 4  # the block step's two arrays of one float per warp


def candidates(logits, targets, dlogits):
    ignore = np.int32(IGNORE_INDEX)
    scratch_losses = backend.xp.empty((N,), dtype=np.float32)
    count = backend.xp.empty((1,), dtype=np.int32)
    dout = backend.xp.ones((), dtype=np.float32)

    def fused_reading_twice():
        ce._count(count, targets, N, ignore)
        kernel = ce._fused_kernel(False, ce.ROW_THREADS)
        kernel((N,), (ce.ROW_THREADS,), (dlogits, scratch_losses, logits, targets, count, np.int32(V), ignore))

    def forward_then_backward():
        _, lse = ce.cross_entropy_forward(logits, targets, ignore_index=IGNORE_INDEX)
        ce.cross_entropy_backward(dout, logits, targets, lse, ignore_index=IGNORE_INDEX, out=dlogits)

    one_thread_per_row = kernels.function("steps/cross_entropy_one_thread_per_row")
    scale = np.float32(1.0 / int((targets != IGNORE_INDEX).sum()))  # read once, outside the timed calls

    def first_version():
        one_thread_per_row((ceil_div(N, 256),), (256,), (dlogits, scratch_losses, logits, targets, np.int32(N),
                                                     np.int32(V), ignore, scale))

    block_per_row = kernels.function("steps/cross_entropy_block_per_row")
    block_per_row.max_dynamic_shared_size_bytes = backend.shared_memory_per_block() - BLOCK_STEP_STATIC_SHARED_BYTES

    def block_step():
        block_per_row((N,), (ce.ROW_THREADS,), (dlogits, scratch_losses, logits, targets, np.int32(V), ignore, scale),
                      shared_mem=4 * V)

    def fused_with_vectors_in_flight(vectors):
        # The package's kernel compiled with another VECTORS_PER_STEP: how many float4 loads per thread the
        # memory needs.
        module = kernels.module("cross_entropy", options=(f"-DVECTORS_PER_STEP={vectors}",),
                                name_expressions=ce._FUSED_NAMES)
        kernel = module.get_function(ce._FUSED_NAMES[0])
        kernel.max_dynamic_shared_size_bytes = backend.shared_memory_per_block() - ce.STATIC_SHARED_BYTES

        def run():
            ce._count(count, targets, N, ignore)
            kernel((N,), (ce.ROW_THREADS,), (dlogits, scratch_losses, logits, targets, count, np.int32(V), ignore),
                   shared_mem=ce.cached_row_bytes(V))
        return run

    runs = {
        "one thread per row (the first version)": first_version,
        "one block per row, row in shared memory, float by float (the second step)": block_step,
        "fused, row kept in shared memory": lambda: ce.cross_entropy_fused(logits, targets, ignore_index=IGNORE_INDEX,
                                                                           dlogits=dlogits),
        "fused, allocating dlogits (as torch's does)": lambda: ce.cross_entropy_fused(logits, targets,
                                                                                     ignore_index=IGNORE_INDEX),
        "fused, in place (dlogits = logits)": lambda: ce.cross_entropy_fused(logits, targets,
                                                                             ignore_index=IGNORE_INDEX, dlogits=logits),
        "fused, row read twice": fused_reading_twice,
        "fused, row in shared memory, 2 float4 loads in flight": fused_with_vectors_in_flight(2),
        "fused, row in shared memory, 8 float4 loads in flight": fused_with_vectors_in_flight(8),
        "forward kernel, then backward kernel": forward_then_backward,
    }
    torch = testing.torch_or_none()
    if torch is not None:
        logits_torch = torch.from_dlpack(logits)
        targets_torch = torch.from_dlpack(targets).long()

        def benchmark_torch():
            leaf = logits_torch.detach().requires_grad_()
            torch.nn.functional.cross_entropy(leaf, targets_torch, ignore_index=IGNORE_INDEX).backward()

        runs["torch: F.cross_entropy forward+backward"] = benchmark_torch
    return runs


def measure():
    benchmark.require_gpu()
    cupy = backend.xp
    random = cupy.random.default_rng(0)
    logits = random.standard_normal((N, V), dtype=cupy.float32)
    targets = random.integers(0, V, N).astype(cupy.int32)
    targets[::97] = IGNORE_INDEX  # a few ignored rows, as padding gives
    dlogits = cupy.empty_like(logits)
    bytes_moved = 2 * N * V * 4
    seconds = {name: benchmark.seconds_per_call(run) for name, run in candidates(logits, targets, dlogits).items()}
    return {
        **benchmark.measured_on(),
        "N": N, "V": V,
        "bytes_read_once_written_once": bytes_moved,
        "copy_bandwidth_gb_per_s": benchmark.copy_bandwidth() / 1e9,
        "milliseconds": {name: s * 1e3 for name, s in seconds.items()},
        "gb_per_s": {name: benchmark.gigabytes_per_second(bytes_moved, s) for name, s in seconds.items()},
    }


def table(measured):
    ceiling = measured["copy_bandwidth_gb_per_s"]
    milliseconds = measured["milliseconds"]
    lines = [f"{measured['device']}, {measured['date']}: N = {measured['N']}, V = {measured['V']}, "
             f"copy bandwidth {ceiling:.0f} GB/s; GB/s count one read of the logits and one write of dlogits"]
    lines += benchmark.bandwidth_rows(measured["gb_per_s"], ceiling,
                                      {name: ms / 1e3 for name, ms in milliseconds.items()})
    torch_ms = milliseconds.get("torch: F.cross_entropy forward+backward")
    if torch_ms:
        # the same work on both sides: torch allocates its gradient, so the package's call allocates too
        package_ms = milliseconds.get("fused, allocating dlogits (as torch's does)",
                                      milliseconds["fused, row kept in shared memory"])
        lines.append(f"  the package's fused kernel is {torch_ms / package_ms:.2f}x as fast as torch")
    return lines


def report(measured):
    """The table as one text, for a notebook to print."""
    return "\n".join(table(measured))


if __name__ == "__main__":
    measured = measure()
    benchmark.report("cross_entropy", measured, table(measured))
