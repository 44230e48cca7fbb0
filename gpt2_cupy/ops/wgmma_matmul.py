"""The Linear layer's products on Hopper's tensor cores through wgmma, from bf16 inputs, or float32 read as TF32.

    wgmma_matmul(a, b, out=None, out_dtype=numpy.float32, bias=None, accumulate=False,
                 transpose_a=False, transpose_b=True)
        returns out: (M, N) = op(a) @ op(b), op(x) being x or its transpose; the defaults give a @ bᵀ
        a: (M, K), or (K, M) if transpose_a; b: (K, N), or (N, K) if transpose_b; both bf16, or both float32
        bias: (N,) float32 added to every row; accumulate=True: out += op(a) @ op(b) (+ bias)

float32 a and b go through wgmma's .tf32 instruction, which reads each value's upper 19 bits (sign, exponent,
10 mantissa bits: the value rounded toward zero to TF32) and takes its operands K-major only: a (M, K) and
b (N, K), the defaults; their rows a multiple of 4 floats. launch_tf32_wgmma_product takes any layout (copying
an operand K-major first) and 3xTF32 (float32 accuracy from three TF32 products); gpt2_cupy.dispatch sends
large 2-D products there.

The Linear layer's three products, x: (B*T, C_in), W: (C_out, C_in), each read as it lies in memory:

    y  = wgmma_matmul(x, W)                                                  # x Wᵀ
    dx = wgmma_matmul(dy, W, transpose_b=False)                              # dy W
    wgmma_matmul(dy, x, transpose_a=True, transpose_b=False, out=dW, accumulate=True)   # dW += dyᵀ x

Sums are float32; the output is float32, or bf16 (out_dtype="bfloat16", rounded to nearest once at the end).
bf16 arrays are ml_dtypes' bfloat16 (numpy's, which CuPy shares); uint16 arrays holding bf16 bits (as
gpt2_cupy.ops.tensor_core_matmul.to_bf16 makes them) pass too. Each operand's rows (its last dimension) must
be whole 16-byte pieces, which the kernel moves: a multiple of 8 bf16, or 4 float32. Other sizes are free.

The kernel is kernels/wgmma_matmul.cu, from chapters/15b_hopper_gemm.ipynb (its last level): 128 x 256 tiles of C
(128 x 128, taken by the two warpgroups in turn, where that fills the GPU better) per block of
two consumer warpgroups and a copy warp, K in slices of 64 copied by the copy engine (TMA, through tensor maps
made here) into a ring of 128-byte swizzled stages guarded by mbarriers (a slice of 64 bf16 or 32 float32 per
row), wgmma.mma_async reading them by descriptor, K-major or MN-major (imm-trans, bf16 only). A float32 product
with few tiles and a long K (the weight gradients' sum over B*T rows, the output layer's input gradient's over
the vocabulary) is split along K, each stretch into its own slab, the slabs then added in order: the same result
every run.
wgmma exists only on compute capability 9.0 (H100, H200), and compiles only for sm_90a; on another GPU this op
raises RuntimeError. The CPU executor emulates wgmma, so the op runs there too.
"""

import functools

import numpy

from gpt2_cupy import backend, kernels
from gpt2_cupy.elementwise import OPERAND_NAMES, elementwise
from gpt2_cupy.ops.arrays import LARGEST_INT, ceil_div, check, float4_aligned, output
from gpt2_cupy.tensor_map import TENSOR_MAP, tensor_map

BLOCK_M = 128                      # rows of C per block (kernels/wgmma_matmul.cu: BLOCK_M)
BLOCK_K = 64                       # bf16 of K per slice (SLICE_K<__nv_bfloat16>; 32 float32); splits of K are
                                   # multiples of it, so of a float32 slice too
STAGE_ROOM = 192 * 1024           # shared memory for the ring of slices (STAGE_ROOM)
THREADS = 256 + 32                 # two consumer warpgroups and a copy warp (THREADS)
SLICE_SUMS_BLOCK_N = 128           # tile width with slice sums: room in the registers for two sums
PING_PONG_WIDTHS = (128,)          # tile widths whose warpgroups take whole tiles in turn (bench/design_choices.json)
# Slices summed by the tensor cores before a float32 addition (3xTF32's big times big part): each addition makes
# the tensor cores wait, and each slice more in a sum lets their truncated adds cut more bits. 6: nearly the speed
# of 8, with an error below chapter 01's float32 kernel's on GPT-2's products (bench/design_choices.json).
SLICES_PER_SUM = 6
MN_BOX = 64                        # an MN-major operand's box: 64 of m (n) by 64 of k (MN_BOX)
MAX_SPLITS = 6                     # stretches of K at most: with out and bias, the 8 operands of one generated sum
MIN_K_PER_SPLIT = 1024             # elements of K per stretch at least: 16 slices, to keep the pipeline full
# Multiply-adds per second of a block, by tile width, relative to the widest: the ratio that picks the faster width
# for GPT-2's products (bench/design_choices.json, bench/tensor_cores.json)
TILE_SPEED = {256: 1.0, 128: 0.80}
WIDEST = max(TILE_SPEED)
# Slices' worth of time a tile's stores hold its tensor cores: a 256-wide tile's two warpgroups store together;
# 128-wide tiles are ping-pong, one warpgroup storing while the other multiplies (bench/design_choices.json)
STORE_SLICES = {256: 2, 128: 0}
# Bytes the GPU's memory moves in the time a 128 x 256 tile multiplies one slice: the unit of split K's partial
# sums (each stretch's slab written, then read back by add_partial_sums); about 2 MB (bench/design_choices.json).
SLICE_BYTES = 2 * 1024 * 1024
ROW_BYTES = 128                    # a slice of k in shared memory: 64 bf16 or 32 float32 a row (ROW_BYTES)
ROW_MULTIPLE = {2: 8, 4: 4}        # rows of a and b in 16-byte pieces: 8 bf16, 4 float32 (by element bytes)
TF32_ROW_MULTIPLE = ROW_MULTIPLE[4]
TF32_SLICE_K = ROW_BYTES // 4       # float32 of K per slice: a 3xTF32 part fills whole slices
PART_VALUE, PART_BIG, PART_SMALL = 0, 1, 2   # tf32_operand_rows' parts of a value (kernels/wgmma_matmul.cu)
OPERAND_TILE = 64                  # rows and k of op(x) per block of tf32_operand_rows (OPERAND_TILE)
OPERAND_THREADS = 256              # threads per block of tf32_operand_rows (OPERAND_THREADS)
MAX_GRID_Y = 65535                 # CUDA's limit on a grid's y dimension (tf32_operand_rows' tiles of rows)
# 3xTF32 as one TF32 product over three times K: A's rows [small | big], B's [big | small], whose big parts the
# kernel reads a second time for the third product, big times big (kernels/wgmma_matmul.cu's SLICE_SUMS)
THREE_PRODUCT_PARTS = ((PART_SMALL, PART_BIG), (PART_BIG, PART_SMALL))
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


def _check_element(operation, name, array):
    if isinstance(array, backend.xp.ndarray) and array.dtype not in (_bfloat16(), numpy.dtype(numpy.uint16),
                                                                     numpy.dtype(numpy.float32)):
        raise TypeError(f"{operation}: {name} has dtype {array.dtype}; it must be bfloat16 (ml_dtypes.bfloat16, "
                        "or uint16 holding bf16 bits), or float32 (read as TF32)")
    return array.dtype if isinstance(array, backend.xp.ndarray) else None


def _require_hopper(operation):
    if backend.runs_wgmma():
        return
    device = backend.xp.cuda.Device()
    raise RuntimeError(f"{operation}: wgmma runs only on compute capability 9.0 (H100, H200); this GPU "
                       f"({backend.device_name()}) is {device.compute_capability[:-1]}."
                       f"{device.compute_capability[-1]}. gpt2_cupy.ops.tensor_core_matmul with "
                       "precision='medium' multiplies bf16 on the tensor cores of any GPU since Ampere")


def shared_bytes(block_n):
    """Dynamic shared memory of one block: as many slices of A's and B's tiles (128 bytes a row) as fit in
    STAGE_ROOM, and 1024 bytes to align them."""
    stage = (BLOCK_M + block_n) * ROW_BYTES
    return STAGE_ROOM // stage * stage + 1024


def operand_map(x, rows, mn_major):
    """x's tensor map for the kernel: boxes of `rows` rows (of m or n) by one 128-byte slice of k for a K-major
    operand, of 64 rows of k by 64 values of m (n) for an MN-major one."""
    if mn_major:
        return tensor_map(x, MN_BOX, MN_BOX)
    return tensor_map(x, rows, ROW_BYTES // x.dtype.itemsize)


def _flag(value):
    return "true" if value else "false"


def _c_type(dtype):
    return "float" if dtype == numpy.dtype(numpy.float32) else "__nv_bfloat16"


def _kernel(block_n, transpose_a, transpose_b, output_dtype, element_dtype, slice_sums=False, ping_pong=False):
    """The kernel for one tile width, layout, output type and element type (bf16, or float32 read as TF32). A is
    MN-major when transposed (stored K x M); B is MN-major when not (stored K x N, as W in dy W). slice_sums:
    each slice of K summed apart, the slices added on the CUDA cores (3xTF32). ping_pong: the consumer warpgroups
    take whole tiles in turn."""
    name = (f"wgmma_matmul<{block_n}, {_flag(transpose_a)}, {_flag(not transpose_b)}, {_flag(slice_sums)}, "
            f"{_flag(ping_pong)}, {_c_type(output_dtype)}, {_c_type(element_dtype)}>")
    kernel = kernels.function("wgmma_matmul", name, options=OPTIONS, name_expressions=(name,))
    if kernel.max_dynamic_shared_size_bytes < shared_bytes(block_n):
        # Beyond 48 KB a kernel must ask for its dynamic shared memory before its first launch.
        kernel.max_dynamic_shared_size_bytes = shared_bytes(block_n)
    return kernel


def tiles(M, N, block_n):
    return ceil_div(M, BLOCK_M) * ceil_div(N, block_n)


def launch_shape(M, N, K, float32_out, widths=tuple(TILE_SPEED)):
    """(block_n, splits, k_per_split) for an M x N x K product, block_n one of widths; see _launch_shape."""
    return _launch_shape(M, N, K, float32_out, backend.multiprocessor_count(), widths)


@functools.lru_cache(maxsize=None)   # asked at every launch, with the few shapes of a model
def _launch_shape(M, N, K, float32_out, processors, widths=tuple(TILE_SPEED)):
    """(block_n, splits, k_per_split) for an M x N x K product: how wide a block's tile of C is (one of widths),
    and into how many stretches of K (of k_per_split each) the sum is split.

    A GPU of P multiprocessors runs one block per multiprocessor, in rounds of P blocks; a round only partly
    full takes about as long as a full one. A block's time is about its multiply-adds (block_n, and its
    stretch's slices of K, plus STORE_SLICES for its stores) over its speed: a 128-wide tile reads more shared
    memory per multiply-add, so it runs at TILE_SPEED[128] of the 256-wide one's rate. Split K (a float32 out
    only, each stretch at least MIN_K_PER_SPLIT long and a multiple of BLOCK_K) adds its slabs' traffic, in
    SLICE_BYTES a slice. The launch takes the shape of least rounds x block time + slab traffic, the fewest
    stretches and then the wider tile on a tie. Of every width and number of stretches, timed on an H100 for
    GPT-2 small's 15 Linear products (8192 rows) in bf16 and TF32, this picks the fastest, or one within 4 %
    of it (128-wide tiles without ping-pong on the products of N = 768 and K of 768 to 3072, and the attention's
    qkv weight gradient on 128-wide tiles unsplit, are that much faster). 3xTF32 runs on 128-wide tiles only
    (widths=(128,)): its stretches come from the same times, not from a timing of its own. The CPU executor
    reports an H100's 132 multiprocessors, so both backends take the same path."""

    def stretch(splits):
        k_per_split = K if splits == 1 else ceil_div(K, splits * BLOCK_K) * BLOCK_K
        return (ceil_div(K, k_per_split) if splits > 1 else 1), k_per_split

    def time(block_n, stretches, k_per_split):
        rounds = ceil_div(tiles(M, N, block_n) * stretches, processors)
        slices = ceil_div(k_per_split, BLOCK_K) + STORE_SLICES[block_n]
        blocks = rounds * block_n / WIDEST * slices / TILE_SPEED[block_n]
        slabs = 2 * stretches * M * N * numpy.dtype(numpy.float32).itemsize   # written, then read back
        return blocks + (slabs / SLICE_BYTES if stretches > 1 else 0)

    most_splits = max(1, min(MAX_SPLITS, K // MIN_K_PER_SPLIT)) if float32_out else 1
    shapes = {(block_n, *stretch(splits)) for splits in range(1, most_splits + 1) for block_n in widths}
    return min(shapes, key=lambda shape: (time(*shape), shape[1], -shape[0]))


def grid_blocks(items):
    """Blocks for `items` items of work (tiles of C times stretches of K): one per multiprocessor at most, each
    taking items gridDim.x apart, so that a block's copy warp fills its stages with the next tile's slices
    while its consumers store the last one."""
    return max(1, min(items, backend.multiprocessor_count()))


def launch_wgmma_matmul(a, b, out, bias=None, accumulate=False, transpose_a=False, transpose_b=True, shape=None,
                        k_apart=None, ping_pong=None):
    """out = op(a) @ op(b) (+ bias), or out += ... Unchecked: a, b C-contiguous, both bf16 (or uint16 bf16 bits)
    or both float32 (read as TF32, K-major only: transpose_a False, transpose_b True), their rows whole 16-byte
    pieces starting on 16 bytes, out (M, N) float32 or bf16 apart from both, bias None or N float32s.
    shape: (block_n, splits, k_per_split) instead of launch_shape's choice (for benchmarks). k_apart (3xTF32):
    a's rows are [small | big] and b's [big | small], k_apart / 2 each, and the product runs over K = 3 k_apart / 2,
    its third part (big times big) reading the big parts again; from k_apart on, each SLICES_PER_SUM slices of K
    are summed apart by the tensor cores and added in float32 on the CUDA cores, on 128-wide tiles (a tensor core
    adding into a large sum cuts off the low bits of what it adds, which would lose the small corrections' share)."""
    M, N = out.shape
    K = (a.shape[0] if transpose_a else a.shape[1]) if k_apart is None else 3 * k_apart // 2
    if out.size == 0:
        return out
    slice_sums = k_apart is not None
    widths = (SLICE_SUMS_BLOCK_N,) if slice_sums else tuple(TILE_SPEED)
    block_n, splits, k_per_split = shape or launch_shape(M, N, K, out.dtype == numpy.dtype(numpy.float32), widths)
    if slice_sums:
        block_n = SLICE_SUMS_BLOCK_N
    if ping_pong is None:
        ping_pong = block_n in PING_PONG_WIDTHS and not slice_sums
    kernel = _kernel(block_n, transpose_a, transpose_b, out.dtype, a.dtype, slice_sums, ping_pong)
    # Split K: each stretch writes its partial sums to its own slab, added below in stretch order.
    target = out if splits == 1 else backend.xp.empty((splits, M, N), dtype=numpy.float32)
    if K > 0:
        a_map, b_map = operand_map(a, BLOCK_M, transpose_a), operand_map(b, block_n, not transpose_b)
    else:   # an empty sum: no slice to copy (the driver maps no array of zero width)
        a_map = b_map = numpy.zeros((), dtype=TENSOR_MAP)[()]
    kernel((grid_blocks(tiles(M, N, block_n) * splits),), (THREADS,),
           (target, a_map, b_map, numpy.int32(M), numpy.int32(N), numpy.int32(K), numpy.int32(k_per_split),
            0 if bias is None or splits > 1 else bias, numpy.bool_(accumulate and splits == 1),
            numpy.int32(k_apart if slice_sums else K), numpy.int32(SLICES_PER_SUM)),
           shared_mem=shared_bytes(block_n))
    if splits > 1:
        add_partial_sums(target, out, bias, accumulate)
    return out


def add_partial_sums(partials, out, bias, accumulate):
    """out (+)= partials[0] + partials[1] + ... (+ bias), added in that order by one generated kernel: the same
    result every run, as a sum of float32 atomics in the order blocks finish would not be."""
    terms = ([out] if accumulate else []) + list(partials) + ([] if bias is None else [bias])
    expression = " + ".join(OPERAND_NAMES[:len(terms)])
    elementwise("split_k_sum", expression, terms, out=out)


def wgmma_fits(a, b):
    """Whether the kernel reads a and b as they are: rows of whole 16-byte pieces, starting on 16 bytes."""
    multiple = ROW_MULTIPLE[a.dtype.itemsize]
    return a.shape[-1] % multiple == 0 and b.shape[-1] % multiple == 0 and float4_aligned(a, b)


def _tf32_rows_fit(x):
    """Whether the TF32 kernel reads K-major x as it lies: rows of a multiple of 4 floats, starting on 16 bytes."""
    return x.shape[-1] % TF32_ROW_MULTIPLE == 0 and float4_aligned(x)


def tf32_operand_rows(x, k_contiguous, parts, segment_multiple=TF32_ROW_MULTIPLE):
    """(rows, len(parts) * segment_k) float32: op(x)'s rows (x itself if k_contiguous, else x's transpose, read
    as it lies), K-major, once per part, each padded with zeros to segment_k = K rounded up to a multiple of
    segment_multiple (4 at least: rows of whole 16-byte pieces).
    parts: PART_VALUE (the value), PART_BIG (rounded to TF32), PART_SMALL (the TF32 of what that leaves)."""
    rows, K = x.shape if k_contiguous else x.shape[::-1]
    if ceil_div(rows, OPERAND_TILE) > MAX_GRID_Y:
        raise ValueError(f"tf32_operand_rows: {rows} rows need more than {MAX_GRID_Y} blocks along the grid's y")
    segment_k = ceil_div(K, segment_multiple) * segment_multiple
    out = backend.xp.empty((rows, len(parts) * segment_k), dtype=numpy.float32)
    if out.size == 0:
        return out
    code = sum(part << 2 * segment for segment, part in enumerate(parts))
    kernel = kernels.function("wgmma_matmul", "tf32_operand_rows", options=OPTIONS)
    kernel((ceil_div(segment_k, OPERAND_TILE), ceil_div(rows, OPERAND_TILE)), (OPERAND_THREADS,),
           (out, x, numpy.int32(rows), numpy.int32(K), numpy.int32(segment_k), numpy.bool_(k_contiguous),
            numpy.int32(len(parts)), numpy.int32(code)))
    return out


def launch_tf32_wgmma_product(a, b, out, transpose_a=False, transpose_b=False, accumulate=False, products=1,
                              bias=None):
    """out = op(a) @ op(b) (+ bias), or out += ..., for 2-D float32 a and b on the TF32 wgmma: products=1 for TF32 (the
    values' upper 19 bits), 3 for 3xTF32 (each value split into big + small, three products, each slice of K
    summed apart and the slices added in float32 on the CUDA cores: float32's accuracy).
    Unchecked: a, b, out C-contiguous float32 of matching shapes, out apart from both; bias None or N float32s,
    added in the product's store.

    TF32 reads an operand as it lies when it is K-major (a not transposed, b transposed: x Wᵀ) with rows of a
    multiple of 4 floats on 16 bytes, else a K-major copy of it, both padded alike when K is not a multiple of 4
    (one pass: 8 bytes per element, against 2 N (or 2 M) flops per element of the product, which the wgmma runs
    about 3 times faster than mma.sync). 3xTF32 makes the operands' rows [small | big] and [big | small] in one
    pass each, each part padded to whole slices of K, then one TF32 product over three times K (small·big,
    big·small, big·big), the last part's slices summed apart."""
    if products == 3:
        a_parts, b_parts = THREE_PRODUCT_PARTS
        a_rows = tf32_operand_rows(a, not transpose_a, a_parts, TF32_SLICE_K)
        b_rows = tf32_operand_rows(b, transpose_b, b_parts, TF32_SLICE_K)
    else:
        a_rows, b_rows = (x if k_contiguous and _tf32_rows_fit(x) else tf32_operand_rows(x, k_contiguous, (PART_VALUE,))
                          for x, k_contiguous in ((a, not transpose_a), (b, transpose_b)))
    # 3xTF32's third part, big times big, from k = 2 segment_k on: its sums are summed apart
    k_apart = a_rows.shape[1] if products == 3 else None
    return launch_wgmma_matmul(a_rows, b_rows, out, bias, accumulate, False, True, k_apart=k_apart)


def wgmma_matmul(a, b, out=None, out_dtype=numpy.float32, bias=None, accumulate=False, transpose_a=False,
                 transpose_b=True):
    """op(a) @ op(b) (+ bias) for bf16 a and b, or float32 a and b read as TF32, on Hopper's tensor cores, float32
    sums, into `out` (a new array if None) of out_dtype: float32, or bfloat16 ("bfloat16" or ml_dtypes.bfloat16);
    accumulate=True adds into out instead. a: (M, K), or (K, M) if transpose_a; b: (N, K) if transpose_b (the
    default: a @ b.T, the Linear forward), or (K, N); float32 operands the defaults only (TF32 is K-major).
    bias: None or (N,) float32. Rows of a and b: a multiple of 8 bf16, or 4 float32. Returns (M, N)."""
    operation = "wgmma_matmul"
    a_dtype, b_dtype = _check_element(operation, "a", a), _check_element(operation, "b", b)
    float32 = numpy.dtype(numpy.float32)
    if a_dtype is not None and b_dtype is not None and (a_dtype == float32) != (b_dtype == float32):
        raise TypeError(f"{operation}: a is {a_dtype} and b is {b_dtype}; both must be bf16, or both float32")
    if a_dtype == float32 and (transpose_a or not transpose_b):
        raise ValueError(f"{operation}: float32 operands are read as TF32, which wgmma takes K-major only: a (M, K) "
                         "and b (N, K), transpose_a=False and transpose_b=True (got transpose_a="
                         f"{transpose_a}, transpose_b={transpose_b}); gpt2_cupy.ops.tensor_core_matmul copies other "
                         "layouts")
    sizes = check(operation, a=(a, ("K", "M") if transpose_a else ("M", "K"), a_dtype),
                  b=(b, ("N", "K") if transpose_b else ("K", "N"), b_dtype), bias=(bias, ("N",)))
    M, N = sizes["M"], sizes["N"]
    multiple = ROW_MULTIPLE[a.dtype.itemsize]
    for name, array in (("a", a), ("b", b)):
        if array.shape[-1] % multiple:
            raise ValueError(f"{operation}: the rows of {name} {array.shape} must be a multiple of {multiple} "
                             f"elements (the kernel moves them in 16-byte pieces of {multiple} {a.dtype.name}); "
                             f"pad {name} with zero columns")
    if not float4_aligned(a, b):
        raise ValueError(f"{operation}: a and b must start on 16 bytes (the kernel copies 16-byte pieces); a view "
                         "into the middle of an array may not: pass a copy")
    if tiles(M, N, 128) > LARGEST_INT:
        raise ValueError(f"{operation}: {M} x {N} needs more than {LARGEST_INT} blocks of {BLOCK_M} x 128")
    if accumulate and out is None:
        raise ValueError(f"{operation}: accumulate=True adds into out; pass the array to add into")
    out = output(operation, out, (M, N), out.dtype if out is not None and accumulate else
                 _output_dtype(operation, out_dtype))
    if backend.xp.may_share_memory(out, a) or backend.xp.may_share_memory(out, b):
        raise ValueError(f"{operation}: out overlaps a or b; the kernel would read values it has already overwritten")
    _require_hopper(operation)
    return launch_wgmma_matmul(a, b, out, bias, accumulate, transpose_a, transpose_b)
