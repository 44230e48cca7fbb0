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

Every product of the package comes through launch_matmul (the Linear layer, the batched products of
attention's unfused path, these two ops), and that is where gpt2_cupy.set_float32_matmul_precision is
read: at "highest" (the default) the float32 kernel above runs, except for large 2-D products on a Hopper
GPU, which go to gpt2_cupy.ops.tensor_core_matmul's 3xTF32, as accurate and faster there
(tensor_core_matmul.highest_on_tensor_cores); at "high" and "medium" the product goes to
gpt2_cupy.ops.tensor_core_matmul, in TF32 or with bf16 inputs, with float32 sums in both.

bf16 arrays (gpt2_cupy.amp's products) are multiplied on tensor cores whatever the setting: a and b both
bf16, out bf16 (the default: the sums rounded once) or float32 (the sums as they are, for a float32
gradient such as dW += doutᵀ x, or a float32 input's dx).
"""

import numpy

from gpt2_cupy import backend, kernels
from gpt2_cupy.ops.arrays import (BFLOAT16, FLOAT32, LARGEST_GRID_Y, THREADS_PER_BLOCK, ceil_div, check, float4_aligned,
                                  output, storage_dtype)
from gpt2_cupy.precision import get_float32_matmul_precision

TILE = 128        # a block computes a TILE x TILE tile of C (kernels/matmul.cu: TILE_M)
TILE_K = 8        # K is read in slices of 8 (kernels/matmul.cu: TILE_K)
THREADS = 256     # the kernel's block size: __launch_bounds__(256, 2)
BLOCKS_PER_MULTIPROCESSOR = 2
MIN_K_PER_SPLIT = 128
MAX_SPLITS = 16
MACHINE_BALANCE = 13  # FLOP per byte: this kernel's 39 TFLOP/s over 3 TB/s of memory bandwidth on an H100


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


def _checked(operation, a, b, transpose_a, transpose_b, out, accumulate, batched):
    """The public ops' checks: (a, b, transpose_a, transpose_b, out), a and b now C-contiguous."""
    a, transpose_a = _as_stored(a, transpose_a)
    b, transpose_b = _as_stored(b, transpose_b)
    batch = ("batch",) if batched else ()
    dtype = storage_dtype(operation, "a", a)  # float32, or bf16 for both (out bf16 unless a float32 one is given)
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


def launch_matmul(a, b, out, transpose_a=False, transpose_b=False, accumulate=False, bias=None):
    """out = op(a) @ op(b) (+ bias), or out += ... with accumulate; 2-D or batched 3-D. Unchecked: for ops that
    have checked their arguments already (a, b, out C-contiguous float32 of matching shapes, out apart from both;
    bias None, or out's N columns of float32 for a 2-D out). On tensor cores when set_float32_matmul_precision
    has chosen "high" or "medium" (see the module's doc), and for bf16 a and b (out bf16 or float32). The bias
    is added in the product's store where the kernel takes one (the wgmma's and the bf16 kernels: one pass over
    out instead of two), else by chapter 02's bias_add kernel after it."""
    if a.dtype == BFLOAT16:
        from gpt2_cupy.ops.tensor_core_matmul import launch_bf16_product
        return launch_bf16_product(a, b, out, transpose_a, transpose_b, accumulate, bias)
    K = a.shape[-2] if transpose_a else a.shape[-1]
    if out.size == 0:
        return out
    if K == 0:  # an empty sum
        if not accumulate:
            backend.fill_zero(out)
        return add_bias(out, bias)
    # Imported here: tensor_core_matmul imports this module for its checks.
    from gpt2_cupy.ops.tensor_core_matmul import highest_on_tensor_cores, launch_tensor_core_matmul
    precision = get_float32_matmul_precision()
    if precision != "highest" or highest_on_tensor_cores(out, K):
        return launch_tensor_core_matmul(a, b, out, transpose_a, transpose_b, accumulate, precision, bias)
    return add_bias(launch_float32_matmul(a, b, out, transpose_a, transpose_b, accumulate), bias)


def add_bias(out, bias):
    """out += bias along every row (out 2-D float32, bias its N columns of float32, or None for nothing), on
    chapter 02's bias_add kernel: for the products whose kernel takes no bias. Returns out."""
    if bias is not None:
        from gpt2_cupy.ops.linear import launch_bias_add   # linear builds on this module
        launch_bias_add(out, bias)
    return out


def launch_float32_matmul(a, b, out, transpose_a=False, transpose_b=False, accumulate=False):
    """launch_matmul on chapter 01's float32 kernel whatever the precision setting (unchecked as it, K at least 1)."""
    M, N = out.shape[-2:]
    K = a.shape[-2] if transpose_a else a.shape[-1]
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
    """op(a) @ op(b) for 2-D float32 (or bf16) arrays, into `out` (a new array if None), or added to it if
    accumulate.

    a: (M, K), or (K, M) if transpose_a.  b: (K, N), or (N, K) if transpose_b.  Returns out: (M, N).
    """
    arguments = _checked("matmul", a, b, transpose_a, transpose_b, out, accumulate, batched=False)
    a, b, transpose_a, transpose_b, out = arguments
    return launch_matmul(a, b, out, transpose_a, transpose_b, accumulate)


def batched_matmul(a, b, transpose_a=False, transpose_b=False, out=None, accumulate=False):
    """matmul over a leading batch dimension, in one launch: out[i] = op(a[i]) @ op(b[i]).

    a: (batch, M, K), or (batch, K, M) if transpose_a.  b: (batch, K, N), or (batch, N, K) if transpose_b.
    Returns out: (batch, M, N).
    """
    arguments = _checked("batched_matmul", a, b, transpose_a, transpose_b, out, accumulate, batched=True)
    a, b, transpose_a, transpose_b, out = arguments
    return launch_matmul(a, b, out, transpose_a, transpose_b, accumulate)
