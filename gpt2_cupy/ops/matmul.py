"""Matrix products in float32: C = op(A) @ op(B), where op(X) is X or its transpose Xᵀ.

    matmul(a, b, transpose_a=False, transpose_b=False, out=None, accumulate=False)
        a: (M, K), or (K, M) with transpose_a     b: (K, N), or (N, K) with transpose_b
        returns out: (M, N)
    batched_matmul(a, b, ...)
        the same with a leading batch dimension on a, b and out: (batch, M, K) @ (batch, K, N) -> (batch, M, N)

The transposes cost nothing: the kernel reads the stored matrix in the other order (no copy is made).
With accumulate=True the product is added to `out` (out += op(a) @ op(b)), which must then be given.
A product whose 128 x 128 tiles of C would leave much of the GPU idle (a weight gradient doutᵀ x: a small
output and K = the number of tokens) is split along K into stretches computed in parallel and summed in
a fixed order afterwards (see k_splits): the result is the same from run to run.

A Linear layer y = x Wᵀ + b, with x: (N, C_in), W: (C_out, C_in), dout: (N, C_out), uses all three forms:

    y  = matmul(x, W, transpose_b=True)                          # x Wᵀ             (N, C_out)
    dx = matmul(dout, W)                                         # dout W           (N, C_in)
    matmul(dout, x, transpose_a=True, out=dW, accumulate=True)   # dW += doutᵀ x    (C_out, C_in)

accumulate=True lets gradients of a parameter used several times (or over several micro-batches) add up
in place, without a temporary and a separate addition.

Arrays are the backend's (cupy on a GPU, numpy on the CPU), float32. Inputs should be C-contiguous; a 2-D
input that is the transpose of a C-contiguous array (a.T of one) is used as it is stored, by flipping its
transpose flag, and any other layout is first copied into a contiguous array. `out` must be C-contiguous
and must not overlap a or b. The kernel is kernels/matmul.cu, from chapters/01_matmul.ipynb.

This op is chapter 01's kernel and nothing else. The package's products (the Linear layer, Tensor's @,
attention's unfused path) go through gpt2_cupy.dispatch, which sends them here or to the tensor cores by
dtype, gpt2_cupy.set_float32_matmul_precision and size.
"""

import numpy

from gpt2_cupy import backend, kernels
from gpt2_cupy.ops.arrays import (BFLOAT16, FLOAT32, LARGEST_GRID_Y, THREADS_PER_BLOCK, ceil_div, check, float4_aligned,
                                  output, storage_dtype)

TILE = 128        # a block computes a TILE x TILE tile of C (kernels/matmul.cu: TILE_M)
TILE_K = 8        # K is read in slices of 8 (kernels/matmul.cu: TILE_K)
THREADS = 256     # the kernel's block size: __launch_bounds__(256, 2)
BLOCKS_PER_MULTIPROCESSOR = 2
MIN_K_PER_SPLIT = 128
MAX_SPLITS = 16
MACHINE_BALANCE = 13  # FLOP per byte: this kernel's TFLOP/s over the memory's TB/s (bench/design_choices.json)


def _kernel_name(transpose_a, transpose_b, vector_loads):
    flags = ", ".join("true" if flag else "false" for flag in (transpose_a, transpose_b, vector_loads))
    return f"matmul<{flags}>"


# One module holds all eight versions of the template and the split-K sum: compiled once, on first use.
_NAMES = tuple(_kernel_name(ta, tb, v) for ta in (False, True) for tb in (False, True) for v in (False, True))


def _kernel(name):
    return kernels.function("matmul", name, name_expressions=_NAMES)


def k_splits(M, N, K, batch=1):
    """(splits, k_per_split): how a single product is split along K; (1, 0) means not at all.

    The GPU runs blocks in rounds of BLOCKS_PER_MULTIPROCESSOR x multiprocessors (264 on an H100), and a round
    that is only partly full takes about as long as a full one. Splitting K into s stretches makes s times
    as many blocks, each 1/s as long, so the arithmetic takes rounds(tiles * s) / s rounds of full-K blocks;
    the s partial products cost (2s + 1) M N floats of memory traffic on top (written, read back, summed
    into C). 36 tiles (a 768 x 768 weight gradient) fill 14 % of one round and 7 stretches 95 % of it;
    384 tiles (an 8192 x 768 output) take 2 rounds with the second one half empty, and 2 stretches make 3
    full rounds. A split is taken when the estimate saves at least a fifth of the time. Each stretch is at
    least MIN_K_PER_SPLIT long and a multiple of TILE_K. The CPU executor reports an H100's 132
    multiprocessors, so both backends take the same path.
    """
    tiles = ceil_div(M, TILE) * ceil_div(N, TILE)
    if batch != 1 or tiles == 0:
        return 1, 0
    slots = BLOCKS_PER_MULTIPROCESSOR * backend.multiprocessor_count()
    # Times in bytes of memory traffic: a round of full-K blocks does 2 TILE² K slots FLOP, which take as
    # long as moving that many / MACHINE_BALANCE bytes; a partial product's float is 4 bytes.
    round_time = 2 * TILE * TILE * K * slots / MACHINE_BALANCE
    float_time = 4.0

    def time(splits):
        partials = (2 * splits + 1) * M * N * float_time if splits > 1 else 0.0
        return ceil_div(tiles * splits, slots) / splits * round_time + partials

    candidates = range(1, max(1, min(MAX_SPLITS, K // MIN_K_PER_SPLIT)) + 1)
    best = min(candidates, key=lambda splits: (time(splits), splits))
    if best == 1 or time(best) > 0.8 * time(1):
        return 1, 0
    k_per_split = ceil_div(K, best * TILE_K) * TILE_K
    return ceil_div(K, k_per_split), k_per_split


def _as_stored(array, transposed):
    """(C-contiguous array, transpose flag) that describe the same op(array), without a copy if possible."""
    if not isinstance(array, backend.xp.ndarray) or array.flags.c_contiguous:
        return array, transposed  # check() explains anything that is not an array
    if array.ndim == 2 and array.flags.f_contiguous:
        return array.T, not transposed  # a.T of a C-contiguous matrix: read that matrix the other way
    return backend.xp.ascontiguousarray(array), transposed


def check_product(operation, a, b, transpose_a, transpose_b, out, accumulate, batched, bf16=False):
    """The products' checks: (a, b, transpose_a, transpose_b, out), a and b now C-contiguous. bf16: whether bf16
    a and b pass too (gpt2_cupy.dispatch's products, which run them on tensor cores; out bf16 unless a float32
    one is given)."""
    a, transpose_a = _as_stored(a, transpose_a)
    b, transpose_b = _as_stored(b, transpose_b)
    batch = ("batch",) if batched else ()
    dtype = storage_dtype(operation, "a", a) if bf16 else FLOAT32
    sizes = check(operation,
                  a=(a, batch + (("K", "M") if transpose_a else ("M", "K")), dtype),
                  b=(b, batch + (("N", "K_of_b") if transpose_b else ("K_of_b", "N")), dtype))
    M, N, K = sizes["M"], sizes["N"], sizes["K"]
    if K != sizes["K_of_b"]:
        raise ValueError(
            f"{operation}: op(a) is {M} x {K} and op(b) is {sizes['K_of_b']} x {N}, so their inner dimensions "
            f"{K} and {sizes['K_of_b']} differ (a {a.shape} with transpose_a={transpose_a}, b {b.shape} with "
            f"transpose_b={transpose_b})")
    if ceil_div(M, TILE) > LARGEST_GRID_Y or sizes.get("batch", 1) > LARGEST_GRID_Y:
        raise ValueError(f"{operation}: M={M} or batch={sizes.get('batch', 1)} is too large for one launch "
                         f"(at most {LARGEST_GRID_Y * TILE} rows and {LARGEST_GRID_Y} matrices)")
    if out is None and accumulate:
        raise ValueError(f"{operation}: accumulate=True adds the product to `out`, so out must be given")
    out_dtype = FLOAT32 if dtype == BFLOAT16 and out is not None and out.dtype == FLOAT32 else dtype
    out = output(operation, out, tuple(sizes[name] for name in batch) + (M, N), dtype=out_dtype)
    if backend.xp.may_share_memory(out, a) or backend.xp.may_share_memory(out, b):
        raise ValueError(f"{operation}: out overlaps a or b; the kernel would read values it has already "
                         "overwritten")
    return a, b, transpose_a, transpose_b, out


def launch_float32_matmul(a, b, out, transpose_a=False, transpose_b=False, accumulate=False):
    """out = op(a) @ op(b), or out += ... with accumulate; 2-D or batched 3-D, on chapter 01's kernel. Unchecked:
    for callers that have checked their arguments (a, b, out C-contiguous float32 of matching shapes, out apart
    from both: check_product)."""
    M, N = out.shape[-2:]
    K = a.shape[-2] if transpose_a else a.shape[-1]
    if out.size == 0:
        return out
    if K == 0:  # an empty sum
        if not accumulate:
            backend.fill_zero(out)
        return out
    batch = a.shape[0] if a.ndim == 3 else 1
    # float4 loads and stores need rows of a multiple of 4 floats and 16-byte aligned starting addresses.
    vector_loads = (a.shape[-1] % 4 == 0 and b.shape[-1] % 4 == 0 and N % 4 == 0
                    and float4_aligned(a, b, out))
    kernel = _kernel(_kernel_name(bool(transpose_a), bool(transpose_b), vector_loads))
    splits, k_per_split = k_splits(M, N, K, batch)
    if splits > 1:
        # Each stretch of K writes its partial product to its own slab; matmul_sum_splits adds them up.
        target = backend.xp.empty((splits, M, N), dtype=numpy.float32)
        strides, depth = (0, 0, M * N), splits
    else:
        target = out
        strides, depth = ((M * K, K * N, M * N) if a.ndim == 3 else (0, 0, 0)), batch
    grid = (ceil_div(N, TILE), ceil_div(M, TILE), depth)
    kernel(grid, (THREADS,), (target, a, b, numpy.int32(M), numpy.int32(N), numpy.int32(K),
                              *(numpy.int64(s) for s in strides), numpy.int32(k_per_split),
                              numpy.int32(bool(accumulate) and splits == 1)))
    if splits > 1:
        count = M * N  # fits an int: out passed check()
        _kernel("matmul_sum_splits")((ceil_div(count, THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,),
                                     (out, target, numpy.int32(count), numpy.int32(splits),
                                      numpy.int32(bool(accumulate))))
    return out


def matmul(a, b, transpose_a=False, transpose_b=False, out=None, accumulate=False):
    """op(a) @ op(b) for 2-D float32 arrays, into `out` (a new array if None), or added to it if accumulate.

    a: (M, K), or (K, M) if transpose_a.  b: (K, N), or (N, K) if transpose_b.  Returns out: (M, N).
    """
    a, b, transpose_a, transpose_b, out = check_product("matmul", a, b, transpose_a, transpose_b, out, accumulate,
                                                        batched=False)
    return launch_float32_matmul(a, b, out, transpose_a, transpose_b, accumulate)


def batched_matmul(a, b, transpose_a=False, transpose_b=False, out=None, accumulate=False):
    """matmul over a leading batch dimension, in one launch: out[i] = op(a[i]) @ op(b[i]).

    a: (batch, M, K), or (batch, K, M) if transpose_a.  b: (batch, K, N), or (batch, N, K) if transpose_b.
    Returns out: (batch, M, N).
    """
    a, b, transpose_a, transpose_b, out = check_product("batched_matmul", a, b, transpose_a, transpose_b, out,
                                                        accumulate, batched=True)
    return launch_float32_matmul(a, b, out, transpose_a, transpose_b, accumulate)
