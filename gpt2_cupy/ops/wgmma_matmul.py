"""The Linear layer's product x Wᵀ on Hopper's tensor cores through wgmma, from bf16 inputs.

    wgmma_matmul(a, b, out=None, out_dtype=numpy.float32, bias=None, accumulate=False)
        a: (M, K) bf16, b: (N, K) bf16 (the "TN" layout: both k-contiguous)   returns out: (M, N) = a bᵀ
        bias: (N,) float32 added to every row; accumulate=True: out += a bᵀ (+ bias)

Sums are float32; the output is float32, or bf16 (out_dtype="bfloat16", rounded to nearest once at the end).
bf16 arrays are ml_dtypes' bfloat16 (numpy's, which CuPy shares); uint16 arrays holding bf16 bits (as
gpt2_cupy.ops.tensor_core_matmul.to_bf16 makes them) pass too. K must be a multiple of 8: the kernel moves
rows in 16-byte pieces; M and N are any size. The other two products of a Linear layer (dy W, dyᵀ x) are
this one on a transposed copy.

The kernel is kernels/wgmma_matmul.cu, from chapters/15_tensor_cores.ipynb, section 4.8: 128 x 256 tiles of C
per block of two warpgroups, K in slices of 64 through a 4-stage cp.async pipeline into 128-byte swizzled
shared memory, wgmma.mma_async m64n256k16 reading it by descriptor. wgmma exists only on compute
capability 9.0 (H100, H200), and compiles only for sm_90a; on another GPU this op raises RuntimeError. The
CPU executor emulates wgmma, so the op runs there too.
"""

import functools

import numpy

from gpt2_cupy import backend, kernels
from gpt2_cupy.ops.arrays import LARGEST_INT, ceil_div, check, output

BLOCK_M, BLOCK_N = 128, 256        # a block's tile of C (kernels/wgmma_matmul.cu: BLOCK_M, BLOCK_N)
SHARED_BYTES = 4 * (BLOCK_M + BLOCK_N) * 64 * 2 + 1024   # STAGES slices of A and B, and room to align (SHARED_BYTES)
THREADS = 256
K_MULTIPLE = 8                     # rows of A and B in 16-byte pieces: 8 bf16
OPTIONS = ("-arch=sm_90a",)        # wgmma compiles for sm_90a only (NVRTC refuses it for plain sm_90)


def _bfloat16():
    import ml_dtypes  # a dependency of the package; imported here, where bf16 arrays are first needed
    return numpy.dtype(ml_dtypes.bfloat16)


def _output_dtype(operation, out_dtype):
    if isinstance(out_dtype, str) and out_dtype == "bfloat16":
        return _bfloat16()
    dtype = numpy.dtype(out_dtype)
    if dtype not in (numpy.dtype(numpy.float32), _bfloat16()):
        raise TypeError(f"{operation}: out_dtype must be float32 or bfloat16, got {dtype.name}")
    return dtype


def _check_bf16(operation, name, array):
    if isinstance(array, backend.xp.ndarray) and array.dtype not in (_bfloat16(), numpy.dtype(numpy.uint16)):
        raise TypeError(f"{operation}: {name} has dtype {array.dtype}; it must be bfloat16 (ml_dtypes.bfloat16, "
                        "or uint16 holding bf16 bits). Convert a float32 array with .astype(ml_dtypes.bfloat16)")
    return array.dtype if isinstance(array, backend.xp.ndarray) else None


def _require_hopper(operation):
    if wgmma_runs():
        return
    device = backend.xp.cuda.Device()
    raise RuntimeError(f"{operation}: wgmma runs only on compute capability 9.0 (H100, H200); this GPU "
                       f"({backend.device_name()}) is {device.compute_capability[:-1]}."
                       f"{device.compute_capability[-1]}. gpt2_cupy.ops.tensor_core_matmul with "
                       "precision='medium' multiplies bf16 on the tensor cores of any GPU since Ampere")


def _kernel(output_dtype):
    name = "wgmma_matmul_float32" if output_dtype == numpy.dtype(numpy.float32) else "wgmma_matmul_bfloat16"
    kernel = kernels.function("wgmma_matmul", name, options=OPTIONS)
    if kernel.max_dynamic_shared_size_bytes < SHARED_BYTES:
        # Beyond 48 KB a kernel must ask for its dynamic shared memory before its first launch.
        kernel.max_dynamic_shared_size_bytes = SHARED_BYTES
    return kernel


def launch_wgmma_matmul(a, b, out, bias=None, accumulate=False):
    """out = a bᵀ (+ bias), or out += ... Unchecked: a (M, K), b (N, K) C-contiguous bf16, out (M, N) float32 or
    bf16, apart from both, bias None or N float32s, K a multiple of 8."""
    (M, K), N = a.shape, b.shape[0]
    if out.size == 0:
        return out
    blocks = ceil_div(M, BLOCK_M) * ceil_div(N, BLOCK_N)
    _kernel(out.dtype)((blocks,), (THREADS,), (out, a, b, numpy.int32(M), numpy.int32(N), numpy.int32(K),
                                               0 if bias is None else bias, numpy.bool_(accumulate)),
                       shared_mem=SHARED_BYTES)
    return out


@functools.lru_cache(maxsize=None)  # the Linear layer asks at every bf16 product
def wgmma_runs():
    """Whether this backend runs wgmma: a GPU of compute capability 9.0, or the CPU executor (which emulates it,
    and stands for an H100 everywhere)."""
    return backend.name != "cuda" or backend.xp.cuda.Device().compute_capability == "90"


def wgmma_matmul(a, b, out=None, out_dtype=numpy.float32, bias=None, accumulate=False):
    """a @ b.T (+ bias) for bf16 a: (M, K) and b: (N, K) on Hopper's tensor cores, float32 sums, into `out` (a
    new array if None) of out_dtype: float32, or bfloat16 ("bfloat16" or ml_dtypes.bfloat16); accumulate=True
    adds into out instead. bias: None or (N,) float32. K must be a multiple of 8. Returns (M, N)."""
    operation = "wgmma_matmul"
    a_dtype, b_dtype = _check_bf16(operation, "a", a), _check_bf16(operation, "b", b)
    sizes = check(operation, a=(a, ("M", "K"), a_dtype), b=(b, ("N", "K"), b_dtype), bias=(bias, ("N",)))
    M, N, K = sizes["M"], sizes["N"], sizes["K"]
    if K % K_MULTIPLE:
        raise ValueError(f"{operation}: K must be a multiple of {K_MULTIPLE} (the kernel moves rows of a and b in "
                         f"16-byte pieces of 8 bf16), got K={K}; pad a and b with zero columns")
    if ceil_div(M, BLOCK_M) * ceil_div(N, BLOCK_N) > LARGEST_INT:
        raise ValueError(f"{operation}: {M} x {N} needs more than {LARGEST_INT} blocks of {BLOCK_M} x {BLOCK_N}")
    if accumulate and out is None:
        raise ValueError(f"{operation}: accumulate=True adds into out; pass the array to add into")
    out = output(operation, out, (M, N), out.dtype if out is not None and accumulate else
                 _output_dtype(operation, out_dtype))
    if backend.xp.may_share_memory(out, a) or backend.xp.may_share_memory(out, b):
        raise ValueError(f"{operation}: out overlaps a or b; the kernel would read values it has already overwritten")
    _require_hopper(operation)
    return launch_wgmma_matmul(a, b, out, bias, accumulate)
