"""The one check-and-launch layer every op uses: array checks with named sizes, output buffers, launch sizes.

    sizes = check("layernorm_forward", x=(x, ("...", "C")), weight=(weight, ("C",)), bias=(bias, ("C",)))
    sizes["C"], sizes["..."]          # 768, (8, 1024): every name binds one size, "..." the leading axes
    out = output("layernorm_forward", out, sizes["..."] + (sizes["C"],))
    blocks = ceil_div(n, THREADS_PER_BLOCK)

A public op checks its arguments once, then calls unchecked internal functions (which never check again).
Errors name the op and the argument, in a learner's terms: a wrong type or dtype is a TypeError, a wrong
shape or layout a ValueError.
"""

import math

import numpy

from gpt2_cupy import backend, kernels
from gpt2_cupy.dtypes import BFLOAT16, C_TYPES, FLOAT32, LARGEST_INT, STORAGE_DTYPES  # noqa: F401 (the ops' names)

LARGEST_GRID_Y = 65535    # CUDA's limit on gridDim.y and gridDim.z (gridDim.x goes to 2**31 - 1)
WARP_SIZE = 32            # kernels/include/warp.cuh's WARP_SIZE
THREADS_PER_BLOCK = 256   # the default block size of elementwise and row kernels
SHARED_BYTES_WITHOUT_OPT_IN = 48 * 1024   # the shared memory a block may have without asking for more
ELLIPSIS = "..."          # in a shape pattern: any number of leading axes, the same in every argument


_counters = {}            # per device: the counters of the last-block pattern (counters()), newest last


def counters(count):
    """`count` zeroed unsigned ints on the current device, the same ones on every call, for kernels that finish
    with the last-block pattern (a block takes an atomicAdd ticket; the last one finishes the work and sets its
    counter back to zero, so a captured graph replays with them). A launch that needs more gets new ones, and the
    old stay (a graph captured with them may replay). Two launches that use them must not run at the same time
    (on two streams of one device), or their counts would mix."""
    device = backend.device_id()
    held = _counters.setdefault(device, [])
    if not held or held[-1].size < count:
        held.append(backend.xp.zeros(max(count, 256), dtype=numpy.uint32))
    return held[-1]


def ceil_div(numerator, denominator):
    """⌈numerator / denominator⌉ for non-negative ints: how many blocks of `denominator` cover `numerator`."""
    return -(-numerator // denominator)


def rows(array):
    """The (N, C) view of a C-contiguous (..., C) array, N the product of the leading axes: no copy."""
    return array.reshape(math.prod(array.shape[:-1]), array.shape[-1])  # -1 would fail when a size is 0


def _check_one(operation, name, array, dtype, contiguous):
    if not isinstance(array, backend.xp.ndarray):
        raise TypeError(f"{operation}: {name} must be a {backend.xp.__name__}.ndarray (the active backend's "
                        f"arrays), got {type(array).__module__}.{type(array).__name__}")
    if array.dtype != dtype:
        raise TypeError(f"{operation}: {name} has dtype {array.dtype}; it must be {numpy.dtype(dtype).name}")
    if contiguous and not array.flags.c_contiguous:
        raise ValueError(f"{operation}: {name} (shape {array.shape}, strides {array.strides}) is not C-contiguous; "
                         "the kernels index memory as one flat array, so pass xp.ascontiguousarray(...)")
    if array.size > LARGEST_INT:
        raise ValueError(f"{operation}: {name} has {array.size} elements; the kernels index with int, "
                         f"at most {LARGEST_INT}")


def storage_dtype(operation, name, array):
    """The dtype of an activation an op takes in either storage type: float32 or bfloat16; a TypeError
    naming the argument otherwise. The op then checks its other activations against the same dtype."""
    if not isinstance(array, backend.xp.ndarray):
        _check_one(operation, name, array, FLOAT32, contiguous=False)  # raises: not an array at all
    if array.dtype not in STORAGE_DTYPES:
        raise TypeError(f"{operation}: {name} has dtype {array.dtype}; it must be float32 or bfloat16")
    return array.dtype


def storage_c_type(dtype):
    """The C type a kernel templated on its storage type is instantiated with: float or __nv_bfloat16."""
    return C_TYPES[BFLOAT16 if dtype == BFLOAT16 else FLOAT32]


def _pattern_text(pattern):
    return "(" + ", ".join(str(p) for p in pattern) + ("," if len(pattern) == 1 else "") + ")"


def check(operation, **arguments):
    """Check arrays against shape patterns that share named sizes; return the sizes they bind.

    Each keyword is an argument's name, its value (array, pattern) or (array, pattern, dtype); dtype is
    float32 unless given. An array of None is skipped (an optional argument left out). A pattern is a
    tuple of ints (that exact size), names ("C": the same size wherever the name appears) and at most one
    "..." first (any number of leading axes, the same in every argument). Arrays must be C-contiguous.
    """
    return _check_sizes(operation, arguments, contiguous=True)


def check_views(operation, **arguments):
    """check() for an op whose kernels read and write by strides: the arrays may be views of any layout."""
    return _check_sizes(operation, arguments, contiguous=False)


def _check_sizes(operation, arguments, contiguous):
    sizes, first_seen = {}, {}
    for name, specification in arguments.items():
        array, pattern, dtype = (*specification, numpy.float32) if len(specification) == 2 else specification
        if array is None:
            continue
        _check_one(operation, name, array, dtype, contiguous)
        shape = tuple(array.shape)
        leading = len(pattern) > 0 and pattern[0] == ELLIPSIS
        fixed = pattern[1:] if leading else pattern
        if len(shape) < len(fixed) or (not leading and len(shape) != len(fixed)):
            raise ValueError(f"{operation}: {name} must have shape {_pattern_text(pattern)}, got {shape}")
        bound = {ELLIPSIS: shape[:len(shape) - len(fixed)]} if leading else {}
        bound.update(zip(fixed, shape[len(shape) - len(fixed):]))
        for size_name, size in bound.items():
            if isinstance(size_name, int):
                if size != size_name:
                    raise ValueError(f"{operation}: {name} must have shape {_pattern_text(pattern)}, got {shape}")
                continue
            if size_name in sizes and sizes[size_name] != size:
                other = first_seen[size_name]
                what = "leading axes" if size_name == ELLIPSIS else size_name
                raise ValueError(f"{operation}: {name} has shape {shape}, which gives {what} = {size}, but "
                                 f"{other[0]} has shape {other[1]}, which gives {what} = {sizes[size_name]}")
            sizes.setdefault(size_name, size)
            first_seen.setdefault(size_name, (name, shape))
    return sizes


def output(operation, out, shape, dtype=numpy.float32, name="out"):
    """`out` checked to have `shape` and `dtype`, or a new uninitialised array of that shape when out is None."""
    shape = tuple(shape)
    if out is None:
        return backend.xp.empty(shape, dtype=dtype)
    _check_one(operation, name, out, dtype, contiguous=True)
    if tuple(out.shape) != shape:
        raise ValueError(f"{operation}: {name} has shape {tuple(out.shape)}, but the inputs give {shape}")
    return out


def float4_aligned(*arrays):
    """Whether every array (None skipped) starts on a 16-byte boundary, as float4 loads and stores need.
    Every fresh allocation does (CuPy's start on 256 bytes); a view into the middle of one may not."""
    return all(backend.address(array) % 16 == 0 for array in arrays if array is not None)


def row_width(columns, *arrays):
    """Floats per load for rows of `columns` float32s: 4 when every row of every array (None skipped) starts
    on 16 bytes, which needs a row length that is a multiple of 4 and arrays that start on 16 bytes; else 1."""
    return 4 if columns % 4 == 0 and float4_aligned(*arrays) else 1


def launch_elementwise(kernel_file, kernel_name, arrays, n, *scalars):
    """Launch an elementwise kernel over n elements of `arrays` (the output first), then `scalars`.

    Arrays that all start at a 16-byte aligned address (every fresh allocation does) go to the float4
    version, <kernel_name>_float4, four elements per thread; others to the one-element-per-thread version.
    """
    if n == 0:
        return
    if float4_aligned(*arrays):
        kernel, threads = kernels.function(kernel_file, kernel_name + "_float4"), ceil_div(n, 4)
    else:
        kernel, threads = kernels.function(kernel_file, kernel_name), n
    kernel((ceil_div(threads, THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,), (*arrays, numpy.int32(n), *scalars))


# ---- views: arrays that lie inside another ----------------------------------------------------------------

def storage_of(array):
    """The array that owns array's memory: a view (a slice, a reshape, a transpose) leads back to its base."""
    while isinstance(getattr(array, "base", None), backend.xp.ndarray):
        array = array.base
    return array


def element_strides(array):
    """array's strides in elements rather than bytes."""
    return tuple(stride // array.itemsize for stride in array.strides)


def rows_apart(array, row_axes=1):
    """How many elements apart the rows of `array` lie, a row being its last row_axes axes, when each row is
    laid out as in a C-contiguous array, the rows are evenly spaced and the array that holds them is
    C-contiguous (a kernel is given that array and element_offset): a C-contiguous array, or the rows of a
    slice of a wider one (q among q, k and v side by side). None for any other layout."""
    if not storage_of(array).flags.c_contiguous:
        return None
    shape, strides = array.shape, element_strides(array)
    expected = 1
    for axis in range(array.ndim - 1, array.ndim - 1 - row_axes, -1):
        if shape[axis] != 1 and strides[axis] != expected:
            return None
        expected *= shape[axis]
    leading = [(size, stride) for size, stride in zip(shape[:array.ndim - row_axes], strides) if size != 1]
    if not leading:
        return expected
    apart = leading[-1][1]
    for (size, stride), (next_size, next_stride) in zip(leading, leading[1:]):
        if stride != next_stride * next_size:
            return None
    return apart if apart >= expected else None


def element_offset(array):
    """Where array's first element lies in its storage, in elements."""
    return (backend.address(array) - backend.address(storage_of(array))) // array.itemsize


def empty_like_views(*arrays):
    """New uninitialised arrays of the shapes and dtypes of `arrays`, laid out as they are where that is free.

    Arrays that together tile a C-contiguous storage exactly, as q, k and v split from one product's output
    do, get views into one new array of the storage's shape, at the same places: gradients made here lie
    side by side as their inputs did, and need no copy to become the gradient of the storage (Split's
    backward hands it on as it is). Any other array gets a C-contiguous one of its own."""
    groups = {}
    for array in arrays:
        groups.setdefault(id(storage_of(array)), []).append(array)
    made = {}
    for group in groups.values():
        made.update(_views_of_a_new_storage(group))
    return tuple(made[id(array)] if id(array) in made else backend.xp.empty(array.shape, dtype=array.dtype)
                 for array in arrays)


def same_place(a, b):
    """Whether a and b are views of the same elements: the same start, shape and strides (those of axes of
    size 1 aside, which never move)."""
    def moving(array):
        return [stride for stride, size in zip(array.strides, array.shape) if size != 1]
    return (a.shape == b.shape and backend.address(a) == backend.address(b) and moving(a) == moving(b))


def _views_of_a_new_storage(group):
    """{id(array): its like in a new array of the storage's shape} when the arrays of group, of one dtype and
    strides, are consecutive blocks along one of their axes (their shapes differ in that axis at most) that
    together cover every element of their C-contiguous storage once (one array: a permutation of the
    storage's own layout); else {}."""
    whole = storage_of(group[0])
    strides = _shared_strides(group)
    group = sorted(group, key=element_offset)
    if not whole.flags.c_contiguous or strides is None or any(a.dtype != whole.dtype or 0 in a.shape
                                                              for a in group) or element_offset(group[0]) != 0:
        return {}
    shape = list(group[0].shape)
    if len(group) > 1:
        axis = _joining_axis(group, strides)
        if axis is None:
            return {}
        shape[axis] = sum(a.shape[axis] for a in group)
    # The blocks joined: contiguous once its axes are sorted by stride (size-1 axes go anywhere).
    order = sorted(range(len(shape)), key=lambda i: (shape[i] != 1, -strides[i]))
    covered = 1
    for i in reversed(order):
        if shape[i] != 1 and strides[i] != covered:
            return {}
        covered *= shape[i]
    if covered != whole.size:
        return {}
    new = backend.xp.empty(whole.shape, dtype=whole.dtype)
    joined = new.reshape([shape[i] for i in order]).transpose([order.index(i) for i in range(len(shape))])
    if len(group) == 1:
        return {id(group[0]): joined}
    views, start = {}, 0
    for array in group:
        views[id(array)] = joined[(slice(None),) * axis + (slice(start, start + array.shape[axis]),)]
        start += array.shape[axis]
    return views


def _shared_strides(group):
    """The strides, in elements, that the arrays of group share, axis by axis, or None where they differ. An axis
    of size 1 says nothing (its stride is never used, and numpy and CuPy give it different ones): it takes the
    stride of the arrays where that axis is longer."""
    if len({a.ndim for a in group}) > 1:
        return None
    strides = []
    for axis in range(group[0].ndim):
        seen = {element_strides(a)[axis] for a in group if a.shape[axis] != 1}
        if len(seen) > 1:
            return None
        strides.append(seen.pop() if seen else element_strides(group[0])[axis])
    return strides


def _joining_axis(group, strides):
    """The axis along which the arrays of group (sorted by offset, of equal strides) follow each other with no
    gap and no overlap, their shapes equal in every other axis; None if there is none."""
    for axis, stride in enumerate(strides):
        same_elsewhere = all(a.shape[:axis] + a.shape[axis + 1:] == group[0].shape[:axis] + group[0].shape[axis + 1:]
                             for a in group)
        follow = all(element_offset(b) - element_offset(a) == a.shape[axis] * stride for a, b in zip(group, group[1:]))
        if same_elsewhere and follow:
            return axis
    return None


# The kernels' struct HeadLayout (kernels/include/head_layout.cuh): where a (B, heads, T, d) tensor lies in
# the array that holds it, in elements.
HEAD_LAYOUT = numpy.dtype([("offset", numpy.int64), ("batch", numpy.int64), ("head", numpy.int64),
                           ("row", numpy.int64)])


def head_layout(array):
    """(the array holding the (B, heads, T, d) `array`, the HeadLayout that says where in it `array` lies), as
    the attention kernels take them."""
    layout = numpy.zeros((), dtype=HEAD_LAYOUT)
    layout["offset"] = element_offset(array)
    layout["batch"], layout["head"], layout["row"] = element_strides(array)[:3]
    return storage_of(array), layout[()]


def heads_readable(array, alignment_bytes):
    """Whether a kernel taking a HeadLayout reads the (B, heads, T, d) `array` where it lies: each row's d
    elements contiguous, its start and its strides multiples of alignment_bytes, in an array that is
    C-contiguous itself (the kernel is handed that array and the layout)."""
    strides = element_strides(array)
    rows_fit = strides[-1] == 1 or array.shape[-1] == 1
    offsets = [element_offset(array)] + [stride for stride, size in zip(strides[:-1], array.shape) if size > 1]
    aligned = all(offset * array.itemsize % alignment_bytes == 0 for offset in offsets)
    return rows_fit and aligned and storage_of(array).flags.c_contiguous


def empty_heads_side_by_side(shape, dtype):
    """A new uninitialised array of `shape` (..., H, T, d) laid out as (..., T, H, d): attention's output with
    its heads side by side, which y.transpose(-3, -2) then reads as (..., T, H d) without a copy, as the next
    product wants it. (T, d): a C-contiguous one."""
    if len(shape) < 3:
        return backend.xp.empty(shape, dtype=dtype)
    *leading, H, T, d = shape
    return backend.xp.empty((*leading, T, H, d), dtype=dtype).swapaxes(-3, -2)
