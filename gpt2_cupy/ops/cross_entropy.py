"""Cross-entropy loss of GPT-2's logits against the next tokens, fused with the softmax it contains.

    loss, lse = cross_entropy_forward(logits, targets, ignore_index=-100)
    dlogits   = cross_entropy_backward(dout, logits, targets, lse, ignore_index=-100, out=None)
    loss, dlogits = cross_entropy_fused(logits, targets, ignore_index=-100, dlogits=None)

logits: (N, V) float32 (N = B·T tokens, V the vocabulary); targets: (N,) int32. The loss is a float32
array of shape () on the device: the mean over the rows whose target is not ignore_index of
lse_i - logits[i, target_i], with lse_i = log Σ_j exp(logits[i, j]); NaN when every target is ignored,
as torch.nn.functional.cross_entropy gives. dout is a float32 array of shape () (the loss's gradient).
cross_entropy_fused does the forward and the backward in one pass, as if dout = 1; dlogits (or out) may
be the logits array itself, which then holds the gradient afterwards: the (N, V) gradient needs no memory
of its own. A target outside [0, V) that is not ignore_index makes the loss NaN (the kernels cannot stop
the GPU to raise an error without waiting for it).

Nothing here copies to the host: the count of counted targets and the mean are computed on the device.
cross_entropy_forward and cross_entropy_backward also take bf16 logits (a model trained in bf16,
gpt2_cupy.amp): each logit is read into a float, the log-sum-exp, the losses and the loss are float32, and
the gradient is bf16, like the logits, rounded once. cross_entropy_fused takes float32 logits.
The kernels are kernels/cross_entropy.cu, taught in chapters/09_cross_entropy.ipynb.
"""

from functools import lru_cache

import numpy as np

from gpt2_cupy import backend, kernels
from gpt2_cupy.ops.arrays import FLOAT32, LARGEST_INT, check, float4_aligned, output, storage_c_type, storage_dtype

ROW_THREADS = 1024                # kernels/cross_entropy.cu: one block of 1024 threads per row (V ≥ 8192)
STATIC_SHARED_BYTES = 2 * 32 * 4  # the block reduction's own shared arrays
_FUSED_NAMES = ("cross_entropy_fused_rows<true>", "cross_entropy_fused_rows<false>")
# the row kernels' float32 and bf16 versions, compiled in the same module
_NAMES = _FUSED_NAMES + tuple(f"cross_entropy_{direction}_rows<{c_type}>" for direction in ("forward", "backward")
                              for c_type in ("float", "__nv_bfloat16"))


def row_threads(V):
    """Threads per row: 1024 for GPT-2's vocabulary, fewer for a small one (at least 8 logits a thread).

    With V = 2048 and 1024 threads, each thread would hold two logits and spend its time in the block's
    reduction; on the CPU executor, where every thread is a fiber, the reduction is most of the cost.
    """
    if V >= 8 * ROW_THREADS:
        return ROW_THREADS
    return max(32, 1 << max(5, (V // 8 - 1).bit_length()))


def cached_row_bytes(V):
    """Shared memory for a row of V logits: the kernel shifts it by up to 3 floats to align its float4s."""
    return 4 * (V + 3)


def row_fits_in_shared_memory(V):
    """Whether the fused kernel can keep a whole row of V logits on the chip (V ≤ 58 000 or so)."""
    return cached_row_bytes(V) + STATIC_SHARED_BYTES <= backend.shared_memory_per_block()


def can_cache_row(V, logits, dlogits):
    """Whether the fused kernel keeps the row in shared memory: it fits, and both arrays start on 16 bytes
    (the kernel moves float4s, and a row of dlogits must start where the row of logits does, modulo 16)."""
    return row_fits_in_shared_memory(V) and float4_aligned(logits, dlogits)


def cross_entropy_forward(logits, targets, *, ignore_index=-100):
    """(loss, lse): the mean cross-entropy (float32, shape ()) and each row's log-sum-exp (N,), from float32 or
    bf16 logits."""
    N, V = _check("cross_entropy_forward", logits, targets, ignore_index, logits_dtype=None)
    lse = backend.xp.empty((N,), dtype=np.float32)
    row_losses = backend.xp.empty((N,), dtype=np.float32)
    count = backend.xp.empty((1,), dtype=np.int32)
    loss = backend.xp.empty((), dtype=np.float32)
    ignore = np.int32(ignore_index)
    if N > 0:
        threads = row_threads(V)
        _kernel(f"cross_entropy_forward_rows<{storage_c_type(logits.dtype)}>", threads)(
            (N,), (threads,), (lse, row_losses, logits, targets, np.int32(V), ignore))
    _count(count, targets, N, ignore)
    _mean(loss, row_losses, count, N)
    return loss, lse


def cross_entropy_backward(dout, logits, targets, lse, *, ignore_index=-100, out=None):
    """dlogits = (softmax(logits) - onehot(targets)) * dout / count, 0 on ignored rows. out may be logits.
    dlogits has the logits' dtype (float32 or bf16); lse and dout are float32."""
    N, V = _check("cross_entropy_backward", logits, targets, ignore_index, logits_dtype=None)
    check("cross_entropy_backward", lse=(lse, (N,)))
    if check("cross_entropy_backward", dout=(dout, ("...",)))["..."] != ():
        raise ValueError(f"cross_entropy_backward: dout must have shape () (the loss's gradient), got {dout.shape}")
    out = output("cross_entropy_backward", out, (N, V), dtype=logits.dtype)
    count = backend.xp.empty((1,), dtype=np.int32)
    _count(count, targets, N, np.int32(ignore_index))
    if N > 0 and V > 0:
        threads = row_threads(V)
        _kernel(f"cross_entropy_backward_rows<{storage_c_type(logits.dtype)}>", threads)(
            (N,), (threads,), (out, logits, targets, lse, dout, count, np.int32(V), np.int32(ignore_index)))
    return out


def cross_entropy_fused(logits, targets, *, ignore_index=-100, dlogits=None):
    """(loss, dlogits) in one pass over the logits, as if dout = 1. dlogits may be logits itself (in place)."""
    N, V = _check("cross_entropy_fused", logits, targets, ignore_index)
    dlogits = output("cross_entropy_fused", dlogits, (N, V), name="dlogits")
    row_losses = backend.xp.empty((N,), dtype=np.float32)
    count = backend.xp.empty((1,), dtype=np.int32)
    loss = backend.xp.empty((), dtype=np.float32)
    ignore = np.int32(ignore_index)
    _count(count, targets, N, ignore)
    if N > 0:
        cache_row = can_cache_row(V, logits, dlogits)
        threads = row_threads(V)
        kernel = _fused_kernel(cache_row, threads)
        kernel((N,), (threads,), (dlogits, row_losses, logits, targets, count, np.int32(V), ignore),
               shared_mem=cached_row_bytes(V) if cache_row else 0)
    _mean(loss, row_losses, count, N)
    return loss, dlogits


def _check(operation, logits, targets, ignore_index, logits_dtype=FLOAT32):
    """(N, V) after the checks; logits_dtype None: float32 or bf16 logits."""
    if logits_dtype is None:
        logits_dtype = storage_dtype(operation, "logits", logits)
    sizes = check(operation, logits=(logits, ("N", "V"), logits_dtype), targets=(targets, ("N",), np.int32))
    if not isinstance(ignore_index, (int, np.integer)) or not -LARGEST_INT - 1 <= ignore_index <= LARGEST_INT:
        raise TypeError(f"{operation}: ignore_index must be an int (a 32-bit one), got {ignore_index!r}")
    if sizes["V"] == 0:
        raise ValueError(f"{operation}: logits has shape {tuple(logits.shape)}; a vocabulary of 0 has no softmax")
    return sizes["N"], sizes["V"]


def _count(count, targets, N, ignore):
    _kernel("cross_entropy_count")((1,), (ROW_THREADS,), (count, targets, np.int32(N), ignore))


def _mean(loss, row_losses, count, N):
    _kernel("cross_entropy_mean")((1,), (ROW_THREADS,), (loss, row_losses, count, np.int32(N)))


def _kernel(name, threads=ROW_THREADS):
    """A kernel of kernels/cross_entropy.cu built for blocks of `threads` (the count and mean use 1024)."""
    options = () if threads == ROW_THREADS else (f"-DROW_THREADS={threads}",)
    return kernels.function("cross_entropy", name, options=options, name_expressions=_NAMES)


@lru_cache(maxsize=None)
def _fused_kernel(cache_row, threads):
    kernel = _kernel(_FUSED_NAMES[0] if cache_row else _FUSED_NAMES[1], threads)
    if cache_row:  # past 48 KiB a block must opt in to more dynamic shared memory
        kernel.max_dynamic_shared_size_bytes = backend.shared_memory_per_block() - STATIC_SHARED_BYTES
    return kernel
