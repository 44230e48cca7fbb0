"""Matrix products of float32 arrays on tensor cores: C = op(A) @ op(B), op(X) being X or its transpose.

    tensor_core_matmul(a, b, transpose_a=False, transpose_b=False, out=None, accumulate=False, precision=None)
    batched_tensor_core_matmul(a, b, ...)     the same over a leading batch dimension, in one launch

The interface is gpt2_cupy.ops.matmul's (same shapes, transposes, accumulate=True for out += ..., the same
checks and errors), with one more argument: how the tensor cores see the float32 inputs.

    precision="highest"  3xTF32: each input split into two TF32 parts, three products; float32 accuracy
    precision="high"     TF32: inputs rounded to 10 mantissa bits (relative error about 1e-3)
    precision="medium"   bf16: inputs rounded to 8 mantissa bits (about 1e-2), converted into a bf16 copy first
    precision=None       gpt2_cupy.get_float32_matmul_precision() (set_float32_matmul_precision chooses it)

Sums are float32 in every case. The Linear layer's three products, x: (N, C_in), W: (C_out, C_in):

    y  = tensor_core_matmul(x, W, transpose_b=True)                          # x Wᵀ
    dx = tensor_core_matmul(dout, W)                                         # dout W
    tensor_core_matmul(dout, x, transpose_a=True, out=dW, accumulate=True)   # dW += doutᵀ x

The kernels are kernels/tensor_core_matmul.cu, from chapters/15a_tensor_cores_mma_sync.ipynb: 128 x 128 tiles of C
per block of 256 threads, K in slices of 32 through a 3-stage cp.async pipeline (mma.sync, any GPU since
Ampere). bf16 a and b (a model trained in bf16, gpt2_cupy.amp) are multiplied as they are, whatever the
precision: launch_bf16_matmul takes their rows and a float32 or bf16 out (rounded once, after the float32 sum
and the optional float32 bias, bias_add's "+ b" fused into the product's store).

The package's products reach these kernels through gpt2_cupy.dispatch, which sends large 2-D products on a
Hopper GPU to Hopper's wgmma (gpt2_cupy.ops.wgmma_matmul) instead.
"""

import numpy

from gpt2_cupy import backend, kernels
from gpt2_cupy.elementwise import converted
from gpt2_cupy.ops.arrays import BFLOAT16, THREADS_PER_BLOCK, ceil_div, float4_aligned, storage_c_type
from gpt2_cupy.ops.matmul import check_product, launch_float32_matmul
from gpt2_cupy.precision import PRECISIONS, get_float32_matmul_precision

TILE = 128       # rows and columns of C per block (kernels/tensor_core_matmul.cu: TILE)
DEPTH = 32       # elements of K per slice (DEPTH)
STAGES = 3       # slices in flight (STAGES)
THREADS = 256
TF32_PRODUCTS = {"highest": 3, "high": 1}   # mma products per tile: 3xTF32 or TF32
BF16_ROW_MULTIPLE = 8                       # bf16 copies' rows are padded to 16 bytes, for 16-byte copies


def _flag(value):
    return "true" if value else "false"


def shared_bytes(element_bytes, transpose_a, transpose_b):
    """Dynamic shared memory of one block: STAGES slices of A and of B, each padded as the kernel's Slice."""
    def slice_bytes(k_contiguous):
        if k_contiguous:   # TILE rows of DEPTH elements, 16 bytes of padding
            return TILE * (DEPTH * element_bytes + 16)
        padding = 32 if element_bytes == 4 else 16   # DEPTH rows of TILE elements
        return DEPTH * (TILE * element_bytes + padding)
    return STAGES * (slice_bytes(not transpose_a) + slice_bytes(transpose_b))


def _kernel(name, element_bytes, transpose_a, transpose_b):
    """(kernel, shared bytes): one module per instantiation, so a run compiles only the versions it uses."""
    kernel = kernels.function("tensor_core_matmul", name, name_expressions=(name,))
    shared = shared_bytes(element_bytes, transpose_a, transpose_b)
    if kernel.max_dynamic_shared_size_bytes < shared:
        # Beyond 48 KB a kernel must ask for its dynamic shared memory before its first launch.
        kernel.max_dynamic_shared_size_bytes = shared
    return kernel, shared


def to_bf16(x):
    """(bf16 bits as uint16 (rows, ld), ld): a float32 (..., columns) array rounded to bf16, its rows padded
    with zeros to ld, a multiple of BF16_ROW_MULTIPLE elements."""
    rows = x.size // x.shape[-1] if x.shape[-1] else 0
    columns = x.shape[-1]
    ld = ceil_div(columns, BF16_ROW_MULTIPLE) * BF16_ROW_MULTIPLE
    out = backend.xp.empty((rows, ld), dtype=numpy.uint16)
    if out.size:
        kernel = kernels.function("tensor_core_matmul", "float_to_bf16")
        kernel((ceil_div(out.size, THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,),
               (out, x, numpy.int32(rows), numpy.int32(columns), numpy.int32(ld)))
    return out, ld


def _launch(kernel, shared, out, a, b, K, lda, ldb, a_rows, b_rows, accumulate, bias=()):
    """One launch over out's tiles (and its batch): a_rows, b_rows are one stored matrix's rows. bias: () for
    the TF32 kernels, which take none; the bf16 kernel's bias array, or 0 (a null pointer) for none."""
    M, N = out.shape[-2:]
    batch = out.shape[0] if out.ndim == 3 else 1
    strides = (a_rows * lda, b_rows * ldb, M * N) if batch > 1 else (0, 0, 0)
    grid = (ceil_div(N, TILE), ceil_div(M, TILE), batch)
    kernel(grid, (THREADS,), (out, a, b, *bias, numpy.int32(M), numpy.int32(N), numpy.int32(K), numpy.int32(lda),
                              numpy.int32(ldb), *(numpy.int64(s) for s in strides), numpy.int32(bool(accumulate))),
           shared_mem=shared)
    return out


def launch_bf16_matmul(a_bits, b_bits, out, K, transpose_a=False, transpose_b=False, accumulate=False, bias=None):
    """out = op(A) @ op(B) (+ bias), or out += ..., from bf16 rows as to_bf16 makes them: a_bits (rows, lda)
    holds A's stored rows (all batches' rows one after the other), b_bits likewise, lda and ldb multiples of
    8 elements, 16-byte aligned; K is op(A)'s number of columns. out: float32, or bf16 (rounded once);
    bias: None or N float32s added to every row."""
    M, N = out.shape[-2:]
    batch = out.shape[0] if out.ndim == 3 else 1
    name = f"bf16_matmul<{_flag(transpose_a)}, {_flag(transpose_b)}, {storage_c_type(out.dtype)}>"
    kernel, shared = _kernel(name, 2, transpose_a, transpose_b)
    return _launch(kernel, shared, out, a_bits, b_bits, K, a_bits.shape[-1], b_bits.shape[-1],
                   a_bits.shape[0] // batch, b_bits.shape[0] // batch, accumulate, (0 if bias is None else bias,))


def bf16_rows(x):
    """x (bf16, C-contiguous, 2-D or batched 3-D) as stored rows the bf16 kernel reads with 16-byte copies:
    (rows, ld) itself when its rows are a multiple of 8 elements and it starts on 16 bytes, else a copy with
    its rows padded by zeros (through float32, exactly: every bf16 is a float32)."""
    columns = x.shape[-1]
    if columns % BF16_ROW_MULTIPLE == 0 and float4_aligned(x):
        return x.reshape(-1, columns)
    padded, _ = to_bf16(converted(x, numpy.float32))
    return padded


def launch_tf32_mma_sync(a, b, out, transpose_a=False, transpose_b=False, accumulate=False, products=1):
    """out = op(a) @ op(b), or out += ..., on mma.sync's TF32 kernel (any GPU since Ampere): products=1 for TF32
    (inputs rounded to nearest), 3 for 3xTF32. Unchecked: a, b, out C-contiguous float32 of matching shapes, out
    apart from both (check_product), K at least 1."""
    K = a.shape[-2] if transpose_a else a.shape[-1]
    lda, ldb = a.shape[-1], b.shape[-1]
    # 16-byte copies need every stored row to start on 16 bytes: rows of a multiple of 4 floats, aligned arrays
    wide = lda % 4 == 0 and ldb % 4 == 0 and float4_aligned(a, b)
    name = f"tf32_matmul<{products}, {_flag(transpose_a)}, {_flag(transpose_b)}, {_flag(wide)}>"
    kernel, shared = _kernel(name, 4, transpose_a, transpose_b)
    return _launch(kernel, shared, out, a, b, K, lda, ldb, a.shape[-2], b.shape[-2], accumulate)


def check_tensor_core_product(operation, a, b, transpose_a, transpose_b, out, accumulate, precision, batched):
    """tensor_core_matmul's checks: (a, b, transpose_a, transpose_b, out) as ops.matmul.check_product gives them,
    float32 or bf16, and a known precision."""
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"{operation}: precision must be one of {PRECISIONS} or None, got {precision!r}")
    return check_product(operation, a, b, transpose_a, transpose_b, out, accumulate, batched, bf16=True)


def _checked_and_launched(operation, batched, a, b, transpose_a, transpose_b, out, accumulate, precision):
    a, b, transpose_a, transpose_b, out = check_tensor_core_product(operation, a, b, transpose_a, transpose_b, out,
                                                                    accumulate, precision, batched)
    precision = get_float32_matmul_precision() if precision is None else precision
    K = a.shape[-2] if transpose_a else a.shape[-1]
    if out.size == 0 or K == 0:  # nothing to multiply: the float32 op fills or keeps out as it should
        return launch_float32_matmul(a, b, out, transpose_a, transpose_b, accumulate)
    if a.dtype == BFLOAT16:
        return launch_bf16_matmul(bf16_rows(a), bf16_rows(b), out, K, transpose_a, transpose_b, accumulate)
    if precision == "medium":
        return launch_bf16_matmul(to_bf16(a)[0], to_bf16(b)[0], out, K, transpose_a, transpose_b, accumulate)
    return launch_tf32_mma_sync(a, b, out, transpose_a, transpose_b, accumulate, TF32_PRODUCTS[precision])


def tensor_core_matmul(a, b, transpose_a=False, transpose_b=False, out=None, accumulate=False, precision=None):
    """op(a) @ op(b) for 2-D float32 arrays on tensor cores, into `out` (a new array if None), or added to it
    if accumulate. a: (M, K), or (K, M) if transpose_a. b: (K, N), or (N, K) if transpose_b. Returns (M, N).
    precision: "highest", "high", "medium", or None for gpt2_cupy.get_float32_matmul_precision()."""
    return _checked_and_launched("tensor_core_matmul", False, a, b, transpose_a, transpose_b, out, accumulate,
                                 precision)


def batched_tensor_core_matmul(a, b, transpose_a=False, transpose_b=False, out=None, accumulate=False,
                               precision=None):
    """tensor_core_matmul over a leading batch dimension, in one launch: out[i] = op(a[i]) @ op(b[i]).
    a: (batch, M, K) or (batch, K, M); b: (batch, K, N) or (batch, N, K). Returns (batch, M, N)."""
    return _checked_and_launched("batched_tensor_core_matmul", True, a, b, transpose_a, transpose_b, out,
                                 accumulate, precision)
