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

The kernels are kernels/tensor_core_matmul.cu, from chapters/15_tensor_cores.ipynb: 128 x 128 tiles of C
per block of 256 threads, K in slices of 32 through a 3-stage cp.async pipeline (mma.sync, any GPU since
Ampere). On a GPU that runs wgmma (H100, H200; and the CPU executor, which stands for an H100), a large 2-D
product (SMALL_PRODUCT multiply-adds or more; M and N at least MIN_COPIED_EXTENT where its operands are copied
first) runs on kernels/wgmma_matmul.cu instead: "high" on its TF32 instruction (which reads each float32's
upper 19 bits: rounded toward zero to TF32, not to nearest as mma.sync's kernel rounds), "highest" as 3xTF32
on it (one pass splits each operand into TF32 parts, then one TF32 product over three times K, whose big
times big part is summed in float32 on the CUDA cores every few slices), "medium" on its bf16 one.

The package's products come here through gpt2_cupy.ops.matmul.launch_matmul at the "high" and "medium"
settings, and at "highest" where highest_on_tensor_cores says so (large 2-D products on a Hopper GPU); other
products at "highest" stay on chapter 01's float32 kernel.

bf16 arrays (a model trained in bf16, gpt2_cupy.amp) are multiplied as they are, whatever the precision
setting: launch_bf16_product takes bf16 a and b, a float32 or bf16 out (a bf16 out is rounded once, after
the float32 sum and the optional float32 bias, bias_add's "+ b" fused into the product's store).
"""

import numpy

from gpt2_cupy import backend, kernels
from gpt2_cupy.elementwise import converted, elementwise
from gpt2_cupy.ops.arrays import BFLOAT16, THREADS_PER_BLOCK, ceil_div, float4_aligned, storage_c_type
from gpt2_cupy.ops.matmul import _checked, add_bias, launch_matmul
from gpt2_cupy.ops.wgmma_matmul import launch_tf32_wgmma_product, launch_wgmma_matmul, wgmma_fits, wgmma_runs
from gpt2_cupy.precision import PRECISIONS, get_float32_matmul_precision

TILE = 128       # rows and columns of C per block (kernels/tensor_core_matmul.cu: TILE)
DEPTH = 32       # elements of K per slice (DEPTH)
STAGES = 3       # slices in flight (STAGES)
THREADS = 256
TF32_PRODUCTS = {"highest": 3, "high": 1}   # mma products per tile: 3xTF32 or TF32
# Multiply-adds below which a bf16 product runs on the float32 kernel instead: 2^27 take about 5 µs on an
# H100's float32 units, close to a launch, so tensor cores gain little there; the CPU executor, which
# emulates the tensor cores lane by lane, runs such a product 40 times faster on the float32 kernel.
SMALL_PRODUCT = 1 << 27
# M and N at least this for a float32 product on wgmma: an operand not K-major is copied first (8 bytes per
# element, read and written), which costs less than the wgmma saves over mma.sync (2 N flops per element of A,
# about 3 times faster) once N is a few hundred: at 4 TB/s and 106 against 350 TFLOP/s, N above about 150.
MIN_COPIED_EXTENT = 256
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


def launch_bf16_product(a, b, out, transpose_a=False, transpose_b=False, accumulate=False, bias=None):
    """out = op(a) @ op(b) (+ bias), or out += ..., for bf16 a and b: 2-D, or batched 3-D (a, b and out with
    one leading batch axis). Unchecked: a, b, out C-contiguous of matching shapes, out float32 or bf16, apart
    from both; bias None or out's N columns of float32."""
    K = a.shape[-2] if transpose_a else a.shape[-1]
    if out.size == 0:
        return out
    if K == 0:  # an empty sum: 0 (+ bias) into out, or out kept (+ bias)
        if not accumulate:
            backend.fill_zero(out)   # a kernel, so that a CUDA graph records it (on the CPU too)
        if bias is not None:
            elementwise("bias_add", "a + b", [out, bias], compute_dtype=out.dtype, out=out)
        return out
    batch = out.shape[0] if out.ndim == 3 else 1
    if batch * out.shape[-2] * out.shape[-1] * K < SMALL_PRODUCT:
        return _small_bf16_product(a, b, out, transpose_a, transpose_b, accumulate, bias)
    if out.ndim == 2 and wgmma_runs() and wgmma_fits(a, b):
        # Hopper's wgmma reads each operand as it lies in memory, k-contiguous or not (its transpose operands):
        # the Linear forward x Wᵀ, its input gradient dy W and its weight gradient dyᵀ x, none copied.
        return launch_wgmma_matmul(a, b, out, bias, accumulate, transpose_a, transpose_b)
    return launch_bf16_matmul(bf16_rows(a), bf16_rows(b), out, K, transpose_a, transpose_b, accumulate, bias)


def _small_bf16_product(a, b, out, transpose_a, transpose_b, accumulate, bias):
    """A small bf16 product on chapter 01's float32 kernel: the bf16 values widened (exactly), their products
    exact in float32 as on a tensor core, sums in float32, the bias added, then out rounded once."""
    if out.dtype == numpy.float32:
        result = out
    else:
        result = converted(out, numpy.float32) if accumulate else backend.xp.empty(out.shape, dtype=numpy.float32)
    launch_matmul(converted(a, numpy.float32), converted(b, numpy.float32), result, transpose_a, transpose_b,
                  accumulate)
    if result is out:
        add_bias(result, bias)
    elif bias is not None:   # the float32 sum, rounded once to bf16 as it is stored: one pass for both
        elementwise("bias_add_to_bf16", "a + b", [result, bias], compute_dtype=numpy.float32, out_dtype=out.dtype,
                    out=out)
    else:
        elementwise("float_to_bf16", "a", [result], compute_dtype=numpy.float32, out_dtype=out.dtype, out=out)
    return out


def _large_on_wgmma(out, K):
    """Whether a product into out over K runs on the wgmma: a 2-D one of at least SMALL_PRODUCT multiply-adds, on
    a backend that runs wgmma."""
    M, N = out.shape[-2:]
    return out.ndim == 2 and wgmma_runs() and M * N * K >= SMALL_PRODUCT


def _copy_pays(out):
    """Whether copying an operand K-major first (TF32's other layouts, 3xTF32's parts) costs less than the wgmma
    saves: M and N at least MIN_COPIED_EXTENT."""
    return min(out.shape[-2:]) >= MIN_COPIED_EXTENT


def highest_on_tensor_cores(out, K):
    """Whether a float32 product into out (M, N) over K runs at "highest" as 3xTF32 on the wgmma instead of on
    chapter 01's float32 kernel: on a GPU that runs wgmma (H100, H200), for a 2-D product of at least
    SMALL_PRODUCT multiply-adds with M and N at least MIN_COPIED_EXTENT (3xTF32 copies both operands into their
    parts first). Both are as accurate as float32 (gpt2_cupy.precision); 3xTF32 is the faster there. The CPU
    executor keeps the float32 kernel: it emulates the tensor cores lane by lane, three products at 40 times
    the float32 kernel's time."""
    return backend.name == "cuda" and _large_on_wgmma(out, K) and _copy_pays(out)


def launch_tensor_core_matmul(a, b, out, transpose_a=False, transpose_b=False, accumulate=False,
                              precision="highest", bias=None):
    """out = op(a) @ op(b) (+ bias), or out += ..., 2-D or batched 3-D. Unchecked: for callers that have checked
    their arguments (a, b, out C-contiguous float32 of matching shapes, out apart from both, a known precision;
    bias None or a 2-D out's N columns of float32, added in the product's store on the wgmma and bf16 kernels,
    after it on mma.sync's TF32 one). bf16 a and b are multiplied as they are, whatever the precision."""
    if a.dtype == BFLOAT16:
        return launch_bf16_product(a, b, out, transpose_a, transpose_b, accumulate, bias)
    K = a.shape[-2] if transpose_a else a.shape[-1]
    if out.size == 0 or K == 0:  # nothing to multiply: the float32 op fills or keeps out as it should
        return launch_matmul(a, b, out, transpose_a, transpose_b, accumulate, bias)
    if _large_on_wgmma(out, K):
        if precision == "medium":   # bf16 copies (as for mma.sync), then the bf16 wgmma (launch_bf16_product picks it)
            return launch_bf16_product(converted(a, BFLOAT16), converted(b, BFLOAT16), out, transpose_a, transpose_b,
                                       accumulate, bias)
        # TF32 reads x Wᵀ as it lies; other layouts, and 3xTF32's parts, take a K-major copy first.
        copied = transpose_a or not transpose_b or precision == "highest"
        if not copied or _copy_pays(out):
            return launch_tf32_wgmma_product(a, b, out, transpose_a, transpose_b, accumulate, TF32_PRODUCTS[precision],
                                             bias)
    if precision == "medium":
        return launch_bf16_matmul(to_bf16(a)[0], to_bf16(b)[0], out, K, transpose_a, transpose_b, accumulate, bias)
    return add_bias(launch_tf32_mma_sync(a, b, out, transpose_a, transpose_b, accumulate, TF32_PRODUCTS[precision]),
                    bias)


def launch_tf32_mma_sync(a, b, out, transpose_a=False, transpose_b=False, accumulate=False, products=1):
    """out = op(a) @ op(b), or out += ..., on mma.sync's TF32 kernel (any GPU since Ampere): products=1 for TF32
    (inputs rounded to nearest), 3 for 3xTF32. Unchecked, as launch_tensor_core_matmul, with K at least 1."""
    K = a.shape[-2] if transpose_a else a.shape[-1]
    lda, ldb = a.shape[-1], b.shape[-1]
    # 16-byte copies need every stored row to start on 16 bytes: rows of a multiple of 4 floats, aligned arrays
    wide = lda % 4 == 0 and ldb % 4 == 0 and float4_aligned(a, b)
    name = f"tf32_matmul<{products}, {_flag(transpose_a)}, {_flag(transpose_b)}, {_flag(wide)}>"
    kernel, shared = _kernel(name, 4, transpose_a, transpose_b)
    return _launch(kernel, shared, out, a, b, K, lda, ldb, a.shape[-2], b.shape[-2], accumulate)


def _checked_and_launched(operation, batched, a, b, transpose_a, transpose_b, out, accumulate, precision):
    precision = get_float32_matmul_precision() if precision is None else precision
    if precision not in PRECISIONS:
        raise ValueError(f"{operation}: precision must be one of {PRECISIONS} or None, got {precision!r}")
    a, b, transpose_a, transpose_b, out = _checked(operation, a, b, transpose_a, transpose_b, out, accumulate, batched)
    return launch_tensor_core_matmul(a, b, out, transpose_a, transpose_b, accumulate, precision)


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
