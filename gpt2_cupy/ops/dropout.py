"""Inverted dropout with a counter-based random number generator (Philox4x32-10), forward and backward.

    rng_state = new_rng_state(seed)            a backend uint64 array (seed, offset) = (seed, 0)
    y = dropout_forward(x, p, rng_state)       x * mask / (1 - p), each element dropped with probability p
    dx = dropout_backward(dout, p, rng_state)  dout * mask / (1 - p), the same mask, regenerated
    advance_rng_state(rng_state, x.size)       offset += count on the device: the next call gets new numbers

In training the kept elements are scaled by 1/(1 - p), so that the expected value of every element is
unchanged; in evaluation dropout is the identity (the caller simply does not call it).

Element i's random number is Philox4x32-10 of (seed, offset, i): a pure function, the same on the CPU
executor and on any GPU. The backward therefore stores no mask: it regenerates it from the rng_state the
forward used, which the caller keeps (a copy, or the same array before advance_rng_state). The kernels
read (seed, offset) from device memory, so a new offset every step needs no kernel argument and no host
copy. Any shape works; out may be the input itself. x (dout) and out are float32, or bf16 (a model
trained in bf16, gpt2_cupy.amp: computed in float32, rounded once): the same mask for either.

The kernels are kernels/dropout.cu, taught in chapters/07_dropout.ipynb.
"""

import numpy as np

from gpt2_cupy import backend, kernels
from gpt2_cupy.ops.arrays import THREADS_PER_BLOCK, ceil_div, check, output, storage_c_type, storage_dtype

ELEMENTS_PER_THREAD = 4  # one Philox call gives four 32-bit random numbers
_NAMES = ("dropout_forward<float>", "dropout_forward<__nv_bfloat16>")  # the template's two storage types


def _kernel(name):
    """A kernel of kernels/dropout.cu, all of them from one module."""
    return kernels.function("dropout", name, name_expressions=_NAMES)


def new_rng_state(seed):
    """A fresh (seed, offset = 0) as a backend uint64 array of shape (2,)."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**64:
        raise ValueError(f"new_rng_state: seed must be an int in [0, 2**64), got {seed!r}")
    return backend.xp.array([seed, 0], dtype=np.uint64)


def dropout_forward(x, p, rng_state, *, out=None, start=0):
    """x * mask / (1 - p): x float32 of any shape, p in [0, 1], rng_state (2,) uint64 (seed, offset).

    start: the stream index of x's element 0 (element i draws number start + i): 0 for a whole batch, the place
    of a rank's rows in the global batch under data parallelism."""
    return _dropout("dropout_forward", "x", x, p, rng_state, out, start)


def dropout_backward(dout, p, rng_state, *, out=None, start=0):
    """dout * mask / (1 - p), with the mask the forward drew from the same rng_state and start."""
    return _dropout("dropout_backward", "dout", dout, p, rng_state, out, start)


def advance_rng_state(rng_state, count):
    """rng_state[1] += count on the device, without a host sync: the offset past count random numbers."""
    check("advance_rng_state", rng_state=(rng_state, (2,), np.uint64))
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
        raise ValueError(f"advance_rng_state: count must be a non-negative int, got {count!r}")
    _kernel("advance_rng_state")((1,), (1,), (rng_state, np.uint64(count)))


def dropout_uniform(n, rng_state):
    """The n uniform numbers in [0, 1) that dropout with this rng_state compares with p (for checks)."""
    check("dropout_uniform", rng_state=(rng_state, (2,), np.uint64))
    u = backend.xp.empty(n, dtype=np.float32)
    if n:
        _kernel("dropout_uniform")(
            (ceil_div(ceil_div(n, ELEMENTS_PER_THREAD), THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,),
            (u, rng_state, np.int32(n)))
    return u


def _dropout(operation, name, x, p, rng_state, out, start):
    dtype = storage_dtype(operation, name, x)
    check(operation, **{name: (x, ("...",), dtype)}, rng_state=(rng_state, (2,), np.uint64))
    if isinstance(p, bool) or not isinstance(p, (int, float, np.floating, np.integer)) or not 0.0 <= p <= 1.0:
        raise ValueError(f"{operation}: p must be a probability in [0, 1], got {p!r}")
    if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or not 0 <= start < 2**64:
        raise ValueError(f"{operation}: start must be an int in [0, 2**64), got {start!r}")
    out = output(operation, out, x.shape, dtype=dtype)
    if x.size:
        _kernel(f"dropout_forward<{storage_c_type(dtype)}>")(
            (ceil_div(ceil_div(x.size, ELEMENTS_PER_THREAD), THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,),
            (out, x, rng_state, np.float32(p), np.int32(x.size), np.uint64(start)))
    return out
