"""One generated CUDA kernel per elementwise expression: the way PyTorch's TensorIterator and CuPy's
ElementwiseKernel work.

    out = elementwise("mul", "a * b", [x, y])                 x (4, 1, 3), y (5, 1): out (4, 5, 3)
    out = elementwise("gt", "a > b", [x, 0.5], out_dtype=numpy.bool_)

The expression is C code over the operands a, b, c, ... (each already converted to the compute type);
a Python number among the operands becomes a kernel argument, so "a * b" with b = 2.0 and b = 3.0 is one
kernel. The operands' shapes broadcast as numpy's and PyTorch's do: each axis of the output takes its
size from the operands whose size there is not 1.

Broadcasting by strides. An operand of shape (5, 1) read as (4, 5, 3) is never copied: its stride on the
axes it is broadcast along is 0, so every step along them reads the same element. The output is walked as
rows of its last axis: blockIdx.y picks a row, which is split into coordinates once (a few divisions per
row, none per element), and each thread then computes 4 columns of it, blockDim.x apart so that a warp
reads neighbours, all 4 loads issued before the first is used. Each operand's element is its row start plus
column x its last stride. Transposed and sliced views are read the same way, through their own strides.

The common broadcast, x * weight + bias (every operand either runs along the rows, last stride 1, or is
broadcast along them, stride 0), has a kernel of its own when a row's length is a multiple of 4: it walks
the output as the contiguous path does, in groups of 4 neighbouring elements (one division per group finds
its row), and reads each operand that runs along the row 4 columns at a time, in one 16-byte load, closer
to the copy bandwidth than one column at a time, as the general kernel reads (bench/design_choices.json).

An output may be a view too (an in-place write into a transpose or a slice, x.T.add_(1)): it is written
through its own offset and strides, so that every other view of the same memory sees the change. Its
elements must not share memory (an expanded tensor's do), and an operand must either be the output itself,
element for element, or not overlap it: PyTorch's errors otherwise.

Few kernels. Shapes and strides are kernel arguments, not part of the source, so one compiled kernel
serves every shape of the same rank. Before launching, axes that every operand walks through as one run
of memory are merged ("coalesced", TensorIterator's word): a contiguous (8, 1024, 768) tensor plus a
(768,) bias is a 2-axis problem, (8·1024, 768), and a same-shape contiguous one is 1 axis. When every
operand is contiguous and of the output's shape, the fast path uses the flat index itself, with no
coordinate arithmetic at all, and moves 4 floats per load and store (16 bytes, when every array starts at
a multiple of 16 bytes; the last n % 4 elements one by one). Both paths launch about as many blocks as
the GPU holds at once (8 per multiprocessor) and let each block step through the work.

bf16 (bfloat16) operands are stored as bf16 and computed in float: each element is widened to a float
(exactly) before the expression, and a bf16 result is rounded once when it is stored (storage.cuh's
to_float and from_float). A compute dtype of bfloat16 therefore means "float arithmetic, bf16 result".

Indices are int (32 bits): an operand whose memory spans 2³¹ elements or more is refused.
"""

import functools
import math
import os

import numpy

from gpt2_cupy import backend
from gpt2_cupy.dtypes import BFLOAT16, C_TYPES, LARGEST_INT
from gpt2_cupy.ops.arrays import THREADS_PER_BLOCK, WARP_SIZE, ceil_div

OPERAND_NAMES = "abcdefgh"

BF16 = C_TYPES[BFLOAT16]


def c_type(dtype):
    dtype = numpy.dtype(dtype)
    if dtype not in C_TYPES:
        raise TypeError(f"dtype {dtype} is not supported by the generated kernels; use float32, bfloat16, int32, "
                        "int64 or bool")
    return C_TYPES[dtype]


def compute_c_type(dtype):
    """The C type an expression computes in: a bf16 result is computed in float and rounded when stored."""
    return "float" if numpy.dtype(dtype) == BFLOAT16 else c_type(dtype)


def read(kind, compute_type, element):
    """C for one stored element of C type `kind` as the compute type (a bf16 through a float, exactly)."""
    return f"({compute_type})to_float({element})" if kind == BF16 else f"({compute_type}){element}"


def written(out_type, expression):
    """C for the value of `expression` as the output's C type: a bf16 rounded once, to nearest even."""
    if out_type == BF16:
        return f"from_float<__nv_bfloat16>((float)({expression}))"
    return f"({out_type})({expression})"


def storage_include(types):
    """The #include that bf16 operands need (storage.cuh brings <cuda_bf16.h>); nothing for other types."""
    return ['#include "storage.cuh"', ""] if BF16 in types else []


def broadcast_shapes(operation, shapes, names=None):
    """The shape that `shapes` broadcast to, or a ValueError naming the operation, the arguments and shapes."""
    names = names or [f"argument {i}" for i in range(len(shapes))]
    ndim = max((len(shape) for shape in shapes), default=0)
    result = []
    for axis in range(-ndim, 0):
        sizes = {shape[axis] for shape in shapes if len(shape) >= -axis} - {1}
        if len(sizes) > 1:
            described = ", ".join(f"{name} {tuple(shape)}" for name, shape in zip(names, shapes))
            raise ValueError(f"{operation}: the shapes do not broadcast: {described} differ at dimension "
                             f"{ndim + axis} (sizes {sorted(sizes)}); sizes must be equal or 1")
        result.append(sizes.pop() if sizes else 1)
    return tuple(result)


def element_strides(array):
    return tuple(stride // array.itemsize for stride in array.strides)


def broadcast_strides(array, shape):
    """array's strides in elements when read as `shape`: 0 on every axis it is broadcast along."""
    strides = element_strides(array)
    missing = len(shape) - array.ndim
    return (0,) * missing + tuple(0 if size == 1 and out_size != 1 else stride
                                  for size, stride, out_size in zip(array.shape, strides, shape[missing:]))


def coalesce(shape, operand_strides):
    """Merge neighbouring axes that every operand walks as one run of memory; drop axes of size 1.

    Returns (shape, strides per operand), at least one axis. Axes i and i+1 merge when, for every
    operand, a step along i is as long as a whole run along i+1: stride[i] == stride[i+1] * shape[i+1].
    """
    merged_shape, merged_strides = [], [[] for _ in operand_strides]
    for axis, size in enumerate(shape):
        if size == 1:
            continue
        strides = [s[axis] for s in operand_strides]
        if merged_shape and all(m[-1] == stride * size for m, stride in zip(merged_strides, strides)):
            merged_shape[-1] *= size
            for m, stride in zip(merged_strides, strides):
                m[-1] = stride
            continue
        merged_shape.append(size)
        for m, stride in zip(merged_strides, strides):
            m.append(stride)
    if not merged_shape:
        return (1,), [(0,) for _ in operand_strides]
    return tuple(merged_shape), [tuple(m) for m in merged_strides]


def root_of(array):
    """The array that owns array's memory: a view (a slice, a transpose, a reshape) leads back to its base."""
    while isinstance(array.base, backend.xp.ndarray):
        array = array.base
    return array


def _readable(operand):
    """operand itself when a kernel can read it through its strides (its memory is one C-contiguous array of
    its dtype: a C-contiguous array or a view into one), else a C-contiguous copy. A Fortran-ordered array
    (numpy's array(a.T)) or a view into one must be copied before its strides are read, not after."""
    if not isinstance(operand, backend.xp.ndarray):
        return operand
    root = root_of(operand)
    if root.flags.c_contiguous and root.dtype == operand.dtype:
        return operand
    return backend.xp.ascontiguousarray(operand)


def storage_and_offset(operation, name, array, writable=False):
    """(a C-contiguous array that holds array's memory, where array's first element is in it).

    A kernel receives a pointer; a view (a transpose, a slice) is passed as the array it views into plus
    an offset, and read through its strides. The memory the view reaches must fit int indexing. An operand
    whose memory is laid out otherwise is copied first; an output (writable) cannot be.
    """
    root = root_of(array)
    if not root.flags.c_contiguous or root.dtype != array.dtype:
        if writable:
            raise NotImplementedError(f"{operation}: {name} is a view into memory that is not one C-contiguous "
                                      f"array of {array.dtype}; the generated kernels cannot write through it")
        root = array = backend.xp.ascontiguousarray(array)
    if root.size > LARGEST_INT:
        raise ValueError(f"{operation}: {name} spans {root.size} elements of memory; the generated kernels "
                         f"index with int, at most {LARGEST_INT}")
    offset = (backend.address(array) - backend.address(root)) // array.itemsize if array.size else 0
    return root.reshape(-1), offset


# ---- the source ------------------------------------------------------------------------------------------

ELEMENTS_PER_THREAD = 4   # the strided kernel: each thread computes 4 elements of a row, loads first
BLOCKS_PER_MULTIPROCESSOR = 8  # 8 blocks of 256 threads: 2048 threads, as many as a multiprocessor holds
# The rows kernel launches 4 times as many blocks as fit at once: a little closer to the copy bandwidth than one
# or two rounds (bench/design_choices.json).
ROWS_ROUNDS_OF_BLOCKS = 4
# The CPU executor runs every GPU thread as a fiber, which costs about 50 ns on top of the thread's work, and
# its blocks on the machine's cores: there 2 blocks per core, each thread stepping through many elements,
# pay that cost once per many elements (a grid that fills an H100 is 1056 blocks: 270,000 fibers).
CPU_EXECUTOR_BLOCKS_PER_CORE = 2

# W neighbouring elements moved by one load or store. alignas tells the compiler that the address is a
# multiple of the vector's size, so 4 floats travel as one 16-byte instruction (ld.global.v4.f32) instead
# of four 4-byte ones: a quarter of the instructions for the same bytes.
VECTOR_TYPE = """// COUNT neighbouring elements as one load or store (16 bytes for 4 floats: one instruction, not four)
template <typename T, int COUNT>
struct alignas(sizeof(T) * COUNT) Vector {
    T item[COUNT];
};
"""


def vector_width(arrays):
    """How many elements of each array one 16-byte vector may hold: 4 floats, 2 doubles; at most 4."""
    return max(1, min(4, 16 // max(array.itemsize for array in arrays)))


def is_aligned(array, width):
    return backend.address(array) % (array.itemsize * width) == 0


def _contiguous_source(name, expression, operand_types, compute_type, out_type, width):
    parameters, loads, reads, tail_reads = [f"{out_type}* out"], [], [], []
    for index, kind in enumerate(operand_types):
        letter = OPERAND_NAMES[index]
        if isinstance(kind, tuple):
            parameters.append(f"{compute_type} {letter}")
            continue
        parameters.append(f"const {kind}* {letter}_data")
        loads.append(f"        Vector<{kind}, W> {letter}_vector = "
                     f"reinterpret_cast<const Vector<{kind}, W>*>({letter}_data)[group];")
        reads.append(f"            {compute_type} {letter} = {read(kind, compute_type, f'{letter}_vector.item[k]')};")
        tail_reads.append(f"        {compute_type} {letter} = {read(kind, compute_type, f'{letter}_data[i]')};")
    parameters.append("int n")
    lines = storage_include(list(operand_types) + [out_type]) + [f"#define W {width}", "", VECTOR_TYPE,
             f'extern "C" __global__ void {name}({", ".join(parameters)})', "{",
             "    // A grid that fills the GPU steps through the n / W groups of W elements (grid-stride);",
             "    // unsigned: group + step may pass 2^31 on the last step.",
             "    int groups = n / W;",
             "    unsigned int step = gridDim.x * blockDim.x;",
             "    for (unsigned int group = blockIdx.x * blockDim.x + threadIdx.x; group < (unsigned int)groups;"
             " group += step) {",
             "        // every operand's load is issued before the first use: they are in flight together"]
    lines.extend(loads)
    lines.extend([f"        Vector<{out_type}, W> result;", "#pragma unroll",
                  "        for (int k = 0; k < W; k++) {"])
    lines.extend(reads)
    lines.extend([f"            result.item[k] = {written(out_type, expression)};", "        }",
                  f"        reinterpret_cast<Vector<{out_type}, W>*>(out)[group] = result;", "    }",
                  "    // the n % W elements after the last whole group, one per thread of block 0",
                  "    int i = groups * W + threadIdx.x;",
                  "    if (blockIdx.x == 0 && i < n) {"])
    lines.extend(tail_reads)
    lines.extend([f"        out[i] = {written(out_type, expression)};", "    }", "}"])
    return "\n".join(lines) + "\n"


def _operand_parameters(operand_types, compute_type):
    """The kernel's parameters for the operands, (a pointer and an offset per array, a value per number), and
    the letters of the arrays."""
    parameters, arrays = [], []
    for index, kind in enumerate(operand_types):
        letter = OPERAND_NAMES[index]
        if isinstance(kind, tuple):
            parameters.append(f"{compute_type} {letter}")
        else:
            parameters.append(f"const {kind}* {letter}_data, int {letter}_offset")
            arrays.append(letter)
    return parameters, arrays


def _row_start_lines(letters, ndim):
    """C that splits `row` into coordinates of the axes before the last and sets each array's LETTER_row,
    its offset plus coordinate x stride on each of those axes."""
    last = ndim - 1
    lines = ["        int rest = row;"] if ndim > 1 else []
    for letter in letters:
        lines.append(f"        int {letter}_row = {letter}_offset;")
    for axis in reversed(range(last)):
        lines.append(f"        int coordinate{axis} = rest % size{axis};" if axis else
                     f"        int coordinate{axis} = rest;")
        if axis:
            lines.append(f"        rest /= size{axis};")
        for letter in letters:
            lines.append(f"        {letter}_row += coordinate{axis} * {letter}_stride{axis};")
    return lines


def _strided_source(name, expression, operand_types, compute_type, out_type, ndim, strided_out=False):
    # strided_out: out is a view (a transpose, a slice), written at its own offset and strides like an operand
    operand_parameters, operands = _operand_parameters(operand_types, compute_type)
    parameters = [f"{out_type}* out, int out_offset" if strided_out else f"{out_type}* out"] + operand_parameters
    arrays = ["out"] + operands if strided_out else operands
    # Shapes and strides follow n: size0..size{ndim-1}, then per array operand its strides.
    parameters.append("int n")
    parameters.extend(f"int size{axis}" for axis in range(ndim))
    for letter in arrays:
        parameters.extend(f"int {letter}_stride{axis}" for axis in range(ndim))
    last = ndim - 1
    lines = storage_include(list(operand_types) + [out_type]) + [f"#define ELEMENTS {ELEMENTS_PER_THREAD}", "",
             f'extern "C" __global__ void {name}({", ".join(parameters)})', "{",
             "    // The output as rows of its last axis: blockIdx.x and threadIdx.x pick columns, blockIdx.y and",
             "    // threadIdx.y rows (grid-stride; a block spans several short rows, so that none of its threads",
             "    // idles). A column index then needs no division: only the row is split into coordinates, once",
             "    // per row, and each operand's row start is its offset plus coordinate x stride on every other",
             "    // axis (stride 0: broadcast).",
             f"    int columns = size{last};",
             "    int rows = n / columns;",
             "    int first = blockIdx.x * blockDim.x * ELEMENTS + threadIdx.x;",
             "    for (int row = blockIdx.y * blockDim.y + threadIdx.y; row < rows; row += gridDim.y * blockDim.y) {"]
    lines.extend(_row_start_lines(arrays, ndim))
    lines.append("        // ELEMENTS columns per thread, blockDim.x apart (a warp reads neighbours): all loaded")
    lines.append("        // before the first is used, so that they are in flight together")
    for letter in operands:
        lines.append(f"        {compute_type} {letter}_values[ELEMENTS];")
    lines.extend(["#pragma unroll", "        for (int k = 0; k < ELEMENTS; k++) {",
                  "            int column = first + k * blockDim.x;",
                  "            if (first < columns - k * (int)blockDim.x) {  // column < columns, without overflow"])
    for index, kind in enumerate(operand_types):
        letter = OPERAND_NAMES[index]
        if not isinstance(kind, tuple):
            element = f"{letter}_data[{letter}_row + column * {letter}_stride{last}]"
            lines.append(f"                {letter}_values[k] = {read(kind, compute_type, element)};")
    lines.extend(["            }", "        }", "#pragma unroll", "        for (int k = 0; k < ELEMENTS; k++) {",
                  "            int column = first + k * blockDim.x;",
                  "            if (first < columns - k * (int)blockDim.x) {"])
    for letter in operands:
        lines.append(f"                {compute_type} {letter} = {letter}_values[k];")
    target = f"out_row + column * out_stride{last}" if strided_out else "row * columns + column"
    lines.extend([f"                out[{target}] = {written(out_type, expression)};",
                  "            }", "        }", "    }", "}"])
    return "\n".join(lines) + "\n"


def _rows_source(name, expression, operand_types, compute_type, out_type, ndim, width, along_rows):
    """The broadcast kernel when every operand either runs along the output's rows (last stride 1) or is
    broadcast along them (last stride 0), as x * weight + bias is: W neighbouring columns per load.

    along_rows: per array operand, True for last stride 1 (read W at a time), False for 0 (one element per row).
    """
    operand_parameters, letters = _operand_parameters(operand_types, compute_type)
    parameters = [f"{out_type}* out"] + operand_parameters + ["int n"]
    parameters.extend(f"int size{axis}" for axis in range(ndim))
    for letter in letters:
        parameters.extend(f"int {letter}_stride{axis}" for axis in range(ndim - 1))
    kinds = [kind for kind in operand_types if not isinstance(kind, tuple)]
    arrays = list(zip(letters, kinds, along_rows))
    last = ndim - 1
    lines = storage_include(list(operand_types) + [out_type]) + [f"#define W {width}", "", VECTOR_TYPE,
             f'extern "C" __global__ void {name}({", ".join(parameters)})', "{",
             "    // The output as groups of W neighbouring elements, as the contiguous kernel walks it (grid-stride);",
             "    // a row's length is a multiple of W, so a group never crosses a row. Its row is split into",
             "    // coordinates, and each operand's row start is its offset plus coordinate x stride on every other",
             "    // axis. An operand that runs along the row is then read W columns at once (one 16-byte load for",
             "    // floats); one broadcast along it (a (rows, 1) operand) reads the one element of its row.",
             f"    int columns = size{last};",
             "    int groups = n / W;",
             "    unsigned int step = gridDim.x * blockDim.x;",
             "    for (unsigned int group = blockIdx.x * blockDim.x + threadIdx.x; group < (unsigned int)groups;"
             " group += step) {",
             "        int row = (int)group * W / columns;",
             "        int column = (int)group * W - row * columns;"]
    lines.extend(_row_start_lines(letters, ndim))
    lines.append("        // every operand's load is issued before the first use: they are in flight together")
    reads = []
    for letter, kind, along in arrays:
        if along:
            lines.append(f"        Vector<{kind}, W> {letter}_vector = "
                         f"*reinterpret_cast<const Vector<{kind}, W>*>({letter}_data + {letter}_row + column);")
            reads.append(f"            {compute_type} {letter} = {read(kind, compute_type, f'{letter}_vector.item[k]')};")
        else:
            lines.append(f"        {compute_type} {letter} = {read(kind, compute_type, f'{letter}_data[{letter}_row]')};")
    lines.extend([f"        Vector<{out_type}, W> result;", "#pragma unroll",
                  "        for (int k = 0; k < W; k++) {"])
    lines.extend(reads)
    lines.extend([f"            result.item[k] = {written(out_type, expression)};", "        }",
                  f"        reinterpret_cast<Vector<{out_type}, W>*>(out)[group] = result;", "    }", "}"])
    return "\n".join(lines) + "\n"


def kernel_source(name, expression, operand_types, compute_type, out_type, ndim, width=4, along_rows=None,
                  strided_out=False):
    """CUDA C for out[i] = expression over operands read at their broadcast strides.

    operand_types: per operand its C type, or ("scalar", C type) for a number passed by value.
    ndim: the number of (coalesced) axes; 0 means the contiguous fast path (every operand indexed by i),
    which moves `width` neighbouring elements of each operand per load.
    """
    if ndim == 0:
        return _contiguous_source(name, expression, operand_types, compute_type, out_type, width)
    if along_rows is not None:
        return _rows_source(name, expression, operand_types, compute_type, out_type, ndim, width, along_rows)
    return _strided_source(name, expression, operand_types, compute_type, out_type, ndim, strided_out)


_kernels = {}  # (expression, types, ndim, the rows kernel's operands, strided out, vector width) -> kernel


def _kernel(name, expression, operand_types, compute_type, out_type, ndim, width=1, along_rows=None,
            strided_out=False):
    key = (expression, tuple(operand_types), compute_type, out_type, ndim,
           None if along_rows is None else tuple(along_rows), strided_out, width)
    if key not in _kernels:
        kernel_name = f"{name}_{f'contiguous{width}' if ndim == 0 else f'{ndim}d'}"
        if along_rows is not None:
            kernel_name += f"_rows{width}"
        elif strided_out:
            kernel_name += "_strided_out"
        source = kernel_source(kernel_name, expression, operand_types, compute_type, out_type, ndim, width,
                               along_rows, strided_out)
        _kernels[key] = backend.RawKernel(source, kernel_name)
    return _kernels[key]


@functools.lru_cache(maxsize=None)
def resident_blocks():
    """Blocks of 256 threads that fill the GPU: 8 per multiprocessor (the attribute is slow to read)."""
    return backend.multiprocessor_count() * BLOCKS_PER_MULTIPROCESSOR


def grid_stride_blocks(needed, gpu_limit=None):
    """Blocks for a grid-stride launch that would need `needed` blocks to give each thread one step: at most
    gpu_limit on a GPU (None: no limit), at most CPU_EXECUTOR_BLOCKS_PER_CORE per core on the CPU executor.
    Each element is computed by one thread from its own operands whatever the grid: the same bits."""
    if not backend.ON_GPU:
        gpu_limit = CPU_EXECUTOR_BLOCKS_PER_CORE * (os.cpu_count() or 1)
    return needed if gpu_limit is None else min(needed, gpu_limit)


def _scalar(value, dtype):
    """A Python number as the kernel's compute type (float for bf16: the number is not rounded to bf16)."""
    return numpy.float32(value) if numpy.dtype(dtype) == BFLOAT16 else numpy.dtype(dtype).type(value)


def elementwise(operation, expression, operands, compute_dtype=numpy.float32, out_dtype=None, out=None,
                names=None):
    """out = expression(operands...) elementwise, with broadcasting; out a new C-contiguous array unless given
    (any strides: a view is written through them).

    operands: backend arrays of any strides, or Python numbers (passed to the kernel as compute_dtype).
    compute_dtype: the type every operand is converted to before the expression (bfloat16: float, see the
    module's doc); out_dtype: the result's (compute_dtype unless given). names: the operands' names for
    error messages.
    """
    out_dtype = numpy.dtype(compute_dtype if out_dtype is None else out_dtype)
    compute = compute_c_type(compute_dtype)
    names = names or [f"argument {OPERAND_NAMES[i]}" for i in range(len(operands))]
    operands = [_readable(operand) for operand in operands]
    arrays = [(index, operand) for index, operand in enumerate(operands) if isinstance(operand, backend.xp.ndarray)]
    shape = broadcast_shapes(operation, [a.shape for _, a in arrays], [names[i] for i, _ in arrays])
    if out is None:
        out = backend.xp.empty(shape, dtype=out_dtype)
    elif tuple(out.shape) != shape or out.dtype != out_dtype:
        raise ValueError(f"{operation}: out has shape {tuple(out.shape)} and dtype {out.dtype}; the result needs a "
                         f"{shape} array of {out_dtype}")
    else:
        check_writable(operation, out, [a for _, a in arrays])
    n = math.prod(shape)
    if n > LARGEST_INT:
        raise ValueError(f"{operation}: the result has {n} elements; the generated kernels index with int, "
                         f"at most {LARGEST_INT}")
    if n == 0:
        return out
    operand_types = [c_type(operand.dtype) if isinstance(operand, backend.xp.ndarray) else ("scalar", compute)
                     for operand in operands]
    contiguous = out.flags.c_contiguous and all(a.flags.c_contiguous and a.shape == shape for _, a in arrays)
    if contiguous:
        # 16-byte vectors when every array (out too) starts at a multiple of the vector's size
        width = vector_width([out] + [a for _, a in arrays])
        if not all(is_aligned(array, width) for array in [out] + [a for _, a in arrays]):
            width = 1
        arguments = [operand if isinstance(operand, backend.xp.ndarray) else _scalar(operand, compute_dtype)
                     for operand in operands]
        kernel = _kernel(operation, expression, operand_types, compute, c_type(out_dtype), 0, width)
        blocks = grid_stride_blocks(ceil_div(ceil_div(n, width), THREADS_PER_BLOCK), resident_blocks())
        kernel((blocks,), (THREADS_PER_BLOCK,), (out, *arguments, numpy.int32(n)))
        return out
    # A view as out (an in-place write into a transpose or a slice) is walked through its strides as well.
    strided_out = not out.flags.c_contiguous
    strides = [broadcast_strides(a, shape) for _, a in arrays]
    if strided_out:
        strides = [element_strides(out)] + strides
    merged_shape, merged_strides = coalesce(shape, strides)
    arguments, placed = [], []  # placed: each array operand's (storage, offset)
    if strided_out:
        storage, offset = storage_and_offset(operation, "out", out, writable=True)
        arguments.extend([storage, numpy.int32(offset)])
    else:
        arguments.append(out)
    for name, operand in zip(names, operands):
        if isinstance(operand, backend.xp.ndarray):
            storage, offset = storage_and_offset(operation, name, operand)
            arguments.extend([storage, numpy.int32(offset)])
            placed.append((storage, offset))
        else:
            arguments.append(_scalar(operand, compute_dtype))
    shape_arguments = [numpy.int32(size) for size in merged_shape]
    ndim = len(merged_shape)
    width = vector_width([out] + [a for _, a in arrays])
    operand_strides = merged_strides[1:] if strided_out else merged_strides
    if not strided_out and rows_vectorize(merged_shape, operand_strides, placed, out, width):
        # every operand runs along the rows or is broadcast along them: W columns per load
        along_rows = [s[-1] == 1 for s in operand_strides]
        shape_arguments += [numpy.int32(stride) for s in operand_strides for stride in s[:-1]]
        kernel = _kernel(operation, expression, operand_types, compute, c_type(out_dtype), ndim, width, along_rows)
        blocks = grid_stride_blocks(ceil_div(ceil_div(n, width), THREADS_PER_BLOCK),
                                    ROWS_ROUNDS_OF_BLOCKS * resident_blocks())
        kernel((blocks,), (THREADS_PER_BLOCK,), (*arguments, numpy.int32(n), *shape_arguments))
        return out
    shape_arguments += [numpy.int32(stride) for s in merged_strides for stride in s]
    kernel = _kernel(operation, expression, operand_types, compute, c_type(out_dtype), ndim,
                     strided_out=strided_out)
    columns = merged_shape[-1]
    rows = n // columns
    block = strided_block(columns)
    column_blocks = ceil_div(columns, block[0] * ELEMENTS_PER_THREAD)
    row_blocks = grid_stride_blocks(ceil_div(rows, block[1]), min(ceil_div(resident_blocks(), column_blocks), 65535))
    kernel((column_blocks, row_blocks), block, (*arguments, numpy.int32(n), *shape_arguments))
    return out


def strided_block(columns):
    """(threads along a row, rows) of the strided kernel's blocks of THREADS_PER_BLOCK threads: as few threads
    along a row as cover it (a warp at least, so that a warp reads neighbours), the rest on further rows.
    A head of 64 floats is then 8 rows of 32 threads, where one row of 256 threads would leave 192 idle."""
    along = WARP_SIZE
    while along < THREADS_PER_BLOCK and along * ELEMENTS_PER_THREAD < columns:
        along *= 2
    return along, THREADS_PER_BLOCK // along


def rows_vectorize(shape, operand_strides, placed, out, width):
    """Whether the rows kernel can take this problem, W (width) columns per load: a row's length is a
    multiple of W, out starts at a multiple of W elements' bytes, and each operand runs along the rows (last
    stride 1) from a W-aligned start (its memory, its offset, its other strides all multiples of W), or is
    broadcast along them (last stride 0). placed: each array operand's (storage, offset)."""
    if width == 1 or shape[-1] % width or not is_aligned(out, width):
        return False
    for strides, (storage, offset) in zip(operand_strides, placed):
        if strides[-1] == 0:
            continue
        if strides[-1] != 1 or offset % width or any(stride % width for stride in strides[:-1]) or \
                not is_aligned(storage, width):
            return False
    return True


OVERLAPPING_OUTPUT = ("unsupported operation: more than one element of the written-to tensor refers to a single "
                      "memory location. Please clone() the tensor before performing the operation.")
OVERLAPPING_INPUT = ("unsupported operation: some elements of the input tensor and the written-to tensor refer to a "
                     "single memory location. Please clone() the tensor before performing the operation.")


def _memory_span(array):
    """(first, last) byte address that array's elements reach."""
    start = backend.address(array)
    low = sum(stride * (size - 1) for stride, size in zip(array.strides, array.shape) if stride < 0)
    high = sum(stride * (size - 1) for stride, size in zip(array.strides, array.shape) if stride > 0)
    return start + low, start + high + array.itemsize - 1


def check_writable(operation, out, operands):
    """PyTorch's errors for an output that the kernel's threads could not write independently: one whose
    elements share memory (an expanded tensor: stride 0), or one that an operand overlaps at other places
    (x += x.T): each thread reads its operands' elements and writes its own, so an operand must either be
    out itself, element for element, or not touch out's memory."""
    if out.size == 0:
        return
    if any(stride == 0 and size > 1 for stride, size in zip(out.strides, out.shape)):
        raise RuntimeError(f"{operation}: {OVERLAPPING_OUTPUT}")
    root, (first, last) = root_of(out), _memory_span(out)
    for operand in operands:
        if operand.size == 0 or root_of(operand) is not root:
            continue
        walked = [(a, b) for a, b, size in zip(broadcast_strides(operand, out.shape), element_strides(out), out.shape)
                  if size > 1]  # (a stride along an axis of size 1 is never used)
        same_elements = backend.address(operand) == backend.address(out) and all(a == b for a, b in walked)
        operand_first, operand_last = _memory_span(operand)
        if not same_elements and operand_first <= last and first <= operand_last:
            raise RuntimeError(f"{operation}: {OVERLAPPING_INPUT}")


def converted(array, dtype, out=None):
    """array in dtype: itself if it has that dtype, else a C-contiguous converted copy (rounded once);
    with out (an array of dtype and array's shape), the converted values written into out."""
    if out is None and array.dtype == dtype:
        return array
    if not backend.ON_GPU and array.dtype == BFLOAT16 and numpy.dtype(dtype) == numpy.float32 and (
            out is None or (out.dtype == numpy.float32 and out.shape == array.shape)):
        return bf16_widened_on_the_host(array, out)
    return elementwise("to", "a", [array], compute_dtype=dtype, out=out)


def bf16_widened_on_the_host(array, out=None):
    """bf16 to float32 on the CPU executor by numpy, without a launch (a launch of "to" costs a few hundred
    microseconds there, numpy's pass a few tens). A float32 is the bf16's 16 bits followed by 16 zero bits,
    as __bfloat162float makes it on a GPU, so the shift gives the kernel's values bit for bit. Called through
    backend.xp with out=, so that a CPU graph's capture records it, as a GPU's records the kernel."""
    if out is None:
        out = backend.xp.empty(array.shape, dtype=numpy.float32)
    backend.xp.left_shift(array.view(numpy.uint16), 16, out=out.view(numpy.uint32), dtype=numpy.uint32)
    return out


def copy(operation, array, out=None):
    """A C-contiguous copy of any view (a transpose, a slice, a broadcast): the expression "a"."""
    return elementwise(operation, "a", [array], compute_dtype=array.dtype, out=out)


def contiguous(array):
    """array itself if it is C-contiguous (or not an array at all), else a C-contiguous copy of it."""
    if not isinstance(array, backend.xp.ndarray) or array.flags.c_contiguous:
        return array
    return copy("contiguous", array)
