"""What every op does with its arrays before a launch: check them, find their address, launch elementwise.

Errors name the op and the argument: a wrong type or dtype is a TypeError, a wrong layout a ValueError.
"""

import numpy

from gpt2_cupy import backend, kernels

LARGEST_INT = 2**31 - 1  # kernels index with int
THREADS_PER_BLOCK = 256


def address(array):
    """Where an array's data starts, on the device (cupy) or in host memory (numpy)."""
    return array.data.ptr if backend.name == "cuda" else array.ctypes.data


def check_float32(operation, name, array, contiguous=True):
    """A float32 array of the active backend; C-contiguous unless contiguous=False; indexable with int."""
    if not isinstance(array, backend.xp.ndarray):
        raise TypeError(f"{operation}: {name} must be a {backend.xp.__name__}.ndarray (the active backend is "
                        f"{backend.name}), got {type(array).__module__}.{type(array).__name__}")
    if array.dtype != numpy.float32:
        raise TypeError(f"{operation}: {name} has dtype {array.dtype}; only float32 is supported")
    if contiguous and not array.flags.c_contiguous:
        raise ValueError(f"{operation}: {name} (shape {array.shape}, strides {array.strides}) is not C-contiguous; "
                         "the kernels index memory as one flat array, so pass xp.ascontiguousarray(...)")
    if array.size > LARGEST_INT:
        raise ValueError(f"{operation}: {name} has {array.size} elements; the kernels index with int, "
                         f"at most {LARGEST_INT}")


def output_like(operation, out, like, like_name="x"):
    """`out` checked against `like`'s shape, or a new array of that shape when out is None."""
    if out is None:
        return backend.xp.empty_like(like)
    check_float32(operation, "out", out)
    if out.shape != like.shape:
        raise ValueError(f"{operation}: out has shape {out.shape} but {like_name} has shape {like.shape}; "
                         "they must be equal")
    return out


def launch_elementwise(kernel_file, kernel_name, arrays, n, *scalars):
    """Launch an elementwise kernel over n elements of `arrays` (the output first), then `scalars`.

    Arrays that all start at a 16-byte aligned address (every fresh allocation does) go to the float4
    version, <kernel_name>_float4, four elements per thread; others to the one-element-per-thread version.
    """
    if n == 0:
        return
    if all(address(array) % 16 == 0 for array in arrays):
        kernel, threads = kernels.function(kernel_file, kernel_name + "_float4"), (n + 3) // 4
    else:
        kernel, threads = kernels.function(kernel_file, kernel_name), n
    blocks = (threads + THREADS_PER_BLOCK - 1) // THREADS_PER_BLOCK
    kernel((blocks,), (THREADS_PER_BLOCK,), (*arrays, numpy.int32(n), *scalars))
