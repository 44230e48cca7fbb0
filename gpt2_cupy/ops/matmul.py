"""Matrix products in float32: C = op(A) @ op(B), where op(X) is X or its transpose Xᵀ.

    matmul(a, b, transpose_a=False, transpose_b=False, out=None, accumulate=False)
        a: (M, K), or (K, M) with transpose_a     b: (K, N), or (N, K) with transpose_b
        returns out: (M, N)
    batched_matmul(a, b, ...)
        the same with a leading batch dimension on a, b and out: (batch, M, K) @ (batch, K, N) -> (batch, M, N)

The transposes cost nothing: the kernel reads the stored matrix in the other order (no copy is made).
With accumulate=True the product is added to `out` (out += op(a) @ op(b)), which must then be given.
A product whose 128 x 128 tiles of C would leave much of the GPU idle (a weight gradient dyᵀ x: a small
output and K = the number of tokens) is split along K into stretches computed in parallel and summed in
a fixed order afterwards (see k_splits): the result is the same from run to run.

A Linear layer y = x Wᵀ + b, with x: (N, C_in), W: (C_out, C_in), dy: (N, C_out), uses all three forms:

    y  = matmul(x, W, transpose_b=True)                        # x Wᵀ           (N, C_out)
    dx = matmul(dy, W)                                         # dy W           (N, C_in)
    matmul(dy, x, transpose_a=True, out=dW, accumulate=True)   # dW += dyᵀ x    (C_out, C_in)

accumulate=True lets gradients of a parameter used several times (or over several micro-batches) add up
in place, without a temporary and a separate addition.

Arrays are the backend's (cupy on a GPU, numpy on the CPU), float32. Inputs should be C-contiguous; a 2-D
input that is the transpose of a C-contiguous array (a.T of one) is used as it is stored, by flipping its
transpose flag, and any other layout is first copied into a contiguous array. `out` must be C-contiguous
and must not overlap a or b. The kernel is kernels/matmul.cu, from chapters/01_matmul.ipynb.
"""

from functools import lru_cache

import numpy

from gpt2_cupy import backend, kernels
from gpt2_cupy.ops.arrays import address, check_float32

TILE = 128        # a block computes a TILE x TILE tile of C (kernels/matmul.cu: TILE_M)
TILE_K = 8        # K is read in slices of 8 (kernels/matmul.cu: TILE_K)
THREADS = 256
BLOCKS_PER_MULTIPROCESSOR = 2  # __launch_bounds__(256, 2)
MIN_K_PER_SPLIT = 128
MAX_SPLITS = 16
MACHINE_BALANCE = 13  # FLOP per byte: this kernel's 39 TFLOP/s over 3 TB/s of memory bandwidth on an H100
CPU_MULTIPROCESSORS = 132  # on the CPU executor, split as on an H100, so both backends take the same path
_MAX_ELEMENTS = 2**31 - 1  # the kernel indexes inside one matrix with 32-bit ints
_MAX_GRID_Y_Z = 65535


def _kernel_name(transpose_a, transpose_b, vector_loads):
    flags = ", ".join("true" if flag else "false" for flag in (transpose_a, transpose_b, vector_loads))
    return f"matmul<{flags}>"


_NAMES = tuple(_kernel_name(ta, tb, v) for ta in (False, True) for tb in (False, True) for v in (False, True))


@lru_cache(maxsize=None)
def _kernel(transpose_a, transpose_b, vector_loads):
    # One module holds all eight versions: compiled once, on first use.
    return kernels.module("matmul", name_expressions=_NAMES).get_function(
        _kernel_name(transpose_a, transpose_b, vector_loads))


@lru_cache(maxsize=None)
def _multiprocessors():
    if backend.name == "cuda":
        return backend.xp.cuda.Device().attributes["MultiProcessorCount"]
    return CPU_MULTIPROCESSORS


def k_splits(M, N, K, batch=1):
    """(splits, k_per_split): how a single product is split along K; (1, 0) means not at all.

    The GPU runs blocks in rounds of BLOCKS_PER_MULTIPROCESSOR x multiprocessors (264 on an H100), and a round
    that is only partly full takes about as long as a full one. Splitting K into s stretches makes s times
    as many blocks, each 1/s as long, so the arithmetic takes rounds(tiles * s) / s rounds of full-K blocks;
    the s partial products cost (2s + 1) M N floats of memory traffic on top (written, read back, summed
    into C). 36 tiles (a 768 x 768 weight gradient) fill 14 % of one round and 7 stretches 95 % of it;
    384 tiles (an 8192 x 768 output) take 2 rounds with the second one half empty, and 2 stretches make 3
    full rounds. A split is taken when the estimate saves at least a fifth of the time. Each stretch is at
    least MIN_K_PER_SPLIT long and a multiple of TILE_K.
    """
    tiles = -(-M // TILE) * -(-N // TILE)
    if batch != 1 or tiles == 0:
        return 1, 0
    slots = BLOCKS_PER_MULTIPROCESSOR * _multiprocessors()
    # Times in bytes of memory traffic: a round of full-K blocks does 2 TILE² K slots FLOP, which take as
    # long as moving that many / MACHINE_BALANCE bytes; a partial product's float is 4 bytes.
    round_time = 2 * TILE * TILE * K * slots / MACHINE_BALANCE
    float_time = 4.0

    def time(splits):
        partials = (2 * splits + 1) * M * N * float_time if splits > 1 else 0.0
        return -(-tiles * splits // slots) / splits * round_time + partials

    candidates = range(1, max(1, min(MAX_SPLITS, K // MIN_K_PER_SPLIT)) + 1)
    best = min(candidates, key=lambda splits: (time(splits), splits))
    if best == 1 or time(best) > 0.8 * time(1):
        return 1, 0
    k_per_split = -(-K // (best * TILE_K)) * TILE_K
    return -(-K // k_per_split), k_per_split


@lru_cache(maxsize=None)
def _sum_splits():
    return kernels.module("matmul", name_expressions=_NAMES).get_function("matmul_sum_splits")


def _check_array(name, array, function):
    check_float32(function, name, array, contiguous=False)  # other layouts are read in place or copied


def _as_stored(array, transposed):
    """(C-contiguous array, transpose flag) that describe the same op(array) without a copy if possible."""
    if array.flags.c_contiguous:
        return array, transposed
    if array.ndim == 2 and array.flags.f_contiguous:
        return array.T, not transposed  # a.T of a C-contiguous matrix: read that matrix the other way
    return backend.xp.ascontiguousarray(array), transposed


def _product(function, a, b, transpose_a, transpose_b, out, accumulate, ndim):
    _check_array("a", a, function)
    _check_array("b", b, function)
    if a.ndim != ndim or b.ndim != ndim:
        what = "2-D matrices" if ndim == 2 else "3-D stacks of matrices (batch, rows, columns)"
        raise ValueError(f"{function}: a and b must be {what}, got shapes {a.shape} and {b.shape}")
    batch = a.shape[0] if ndim == 3 else 1
    if ndim == 3 and b.shape[0] != batch:
        raise ValueError(f"{function}: batch sizes differ: a {a.shape}, b {b.shape}")
    M, K = a.shape[-1:-3:-1] if transpose_a else a.shape[-2:]
    K_b, N = b.shape[-1:-3:-1] if transpose_b else b.shape[-2:]
    if K != K_b:
        raise ValueError(
            f"{function}: op(a) is {M} x {K} and op(b) is {K_b} x {N}, so their inner dimensions {K} and {K_b} "
            f"differ (a {a.shape} with transpose_a={transpose_a}, b {b.shape} with transpose_b={transpose_b})")
    out_shape = (batch, M, N) if ndim == 3 else (M, N)
    for name, size in (("a", a.size), ("b", b.size), ("out", batch * M * N)):
        if size // max(batch, 1) > _MAX_ELEMENTS:
            raise ValueError(f"{function}: each matrix of {name} has more than 2**31 - 1 elements")
    if -(-M // TILE) > _MAX_GRID_Y_Z or batch > _MAX_GRID_Y_Z:
        raise ValueError(f"{function}: M={M} or batch={batch} is too large for one launch "
                         f"(at most {_MAX_GRID_Y_Z * TILE} rows and {_MAX_GRID_Y_Z} matrices)")

    if out is None:
        if accumulate:
            raise ValueError(f"{function}: accumulate=True adds the product to `out`, so out must be given")
        out = backend.xp.empty(out_shape, dtype=numpy.float32)
    else:
        _check_array("out", out, function)
        if out.shape != out_shape:
            raise ValueError(f"{function}: out has shape {out.shape}, but op(a) @ op(b) has shape {out_shape} "
                             f"(a {a.shape}, transpose_a={transpose_a}; b {b.shape}, transpose_b={transpose_b})")
        if not out.flags.c_contiguous:
            raise ValueError(f"{function}: out must be C-contiguous (the kernel writes rows of {N} floats)")
        if backend.xp.may_share_memory(out, a) or backend.xp.may_share_memory(out, b):
            raise ValueError(f"{function}: out overlaps a or b; the kernel would read values it has already "
                             "overwritten")
    if out.size == 0:
        return out
    if K == 0:  # an empty sum
        if not accumulate:
            out.fill(0)
        return out

    if ndim == 2:
        a, transpose_a = _as_stored(a, transpose_a)
        b, transpose_b = _as_stored(b, transpose_b)
    else:
        a, b = backend.xp.ascontiguousarray(a), backend.xp.ascontiguousarray(b)
    # float4 loads and stores need rows of a multiple of 4 floats and 16-byte aligned starting addresses.
    vector_loads = (a.shape[-1] % 4 == 0 and b.shape[-1] % 4 == 0 and N % 4 == 0
                    and all(address(x) % 16 == 0 for x in (a, b, out)))
    kernel = _kernel(bool(transpose_a), bool(transpose_b), vector_loads)
    splits, k_per_split = k_splits(M, N, K, batch)
    if splits > 1:
        # Each stretch of K writes its partial product to its own slab; matmul_sum_splits adds them up.
        target = backend.xp.empty((splits, M, N), dtype=numpy.float32)
        strides, depth = (0, 0, M * N), splits
    else:
        target = out
        strides, depth = ((M * K, K * N, M * N) if ndim == 3 else (0, 0, 0)), batch
    grid = (-(-N // TILE), -(-M // TILE), depth)
    kernel(grid, (THREADS,), (a, b, target, numpy.int32(M), numpy.int32(N), numpy.int32(K),
                              *(numpy.int64(s) for s in strides), numpy.int32(k_per_split),
                              numpy.int32(bool(accumulate) and splits == 1)))
    if splits > 1:
        _sum_splits()((-(-(M * N) // THREADS),), (THREADS,),
                      (target, out, numpy.int32(M * N), numpy.int32(splits), numpy.int32(bool(accumulate))))
    return out


def matmul(a, b, transpose_a=False, transpose_b=False, out=None, accumulate=False):
    """op(a) @ op(b) for 2-D float32 arrays, into `out` (a new array if None), or added to it if accumulate.

    a: (M, K), or (K, M) if transpose_a.  b: (K, N), or (N, K) if transpose_b.  Returns out: (M, N).
    """
    return _product("matmul", a, b, transpose_a, transpose_b, out, accumulate, ndim=2)


def batched_matmul(a, b, transpose_a=False, transpose_b=False, out=None, accumulate=False):
    """matmul over a leading batch dimension, in one launch: out[i] = op(a[i]) @ op(b[i]).

    a: (batch, M, K), or (batch, K, M) if transpose_a.  b: (batch, K, N), or (batch, N, K) if transpose_b.
    Returns out: (batch, M, N).
    """
    return _product("batched_matmul", a, b, transpose_a, transpose_b, out, accumulate, ndim=3)
