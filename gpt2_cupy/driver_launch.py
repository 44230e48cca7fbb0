"""A kernel launch with CUDA's programmatic stream serialization, through the driver's cuLaunchKernelEx.

For gpt2_cupy.backend.launch_dependent only (on a GPU of compute capability 9.0 on). CuPy launches through
cuLaunchKernel, which takes no launch attributes; this module builds the CUlaunchConfig by hand, with the one
attribute that lets the kernel start while the one before it in the stream finishes, and passes the
arguments as CuPy would: arrays as their device pointers, numpy scalars by value in their own type, Python
ints as 64-bit integers (a null pointer is passed as 0). A captured stream records the launch, attribute and
all, so a CUDA graph replays the overlap too.
"""

import ctypes
from functools import lru_cache

import numpy

PROGRAMMATIC_STREAM_SERIALIZATION = 6    # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION in cuda.h

_SCALARS = {numpy.dtype(numpy.int32): ctypes.c_int32, numpy.dtype(numpy.uint32): ctypes.c_uint32,
            numpy.dtype(numpy.int64): ctypes.c_int64, numpy.dtype(numpy.uint64): ctypes.c_uint64,
            numpy.dtype(numpy.float32): ctypes.c_float, numpy.dtype(numpy.float64): ctypes.c_double,
            numpy.dtype(numpy.bool_): ctypes.c_bool}


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: the attribute's id, 4 bytes of padding, then a 64-byte union whose first int is the
    value programmatic stream serialization reads."""
    _fields_ = [("id", ctypes.c_int), ("padding", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("rest_of_value", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attributes", ctypes.POINTER(_LaunchAttribute)),
                ("attribute_count", ctypes.c_uint)]


@lru_cache(maxsize=None)
def _driver():
    driver = ctypes.CDLL("libcuda.so.1")
    driver.cuLaunchKernelEx.restype = ctypes.c_int
    driver.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                                        ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    driver.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return driver


def _three(dimensions):
    dimensions = tuple(dimensions) if isinstance(dimensions, (tuple, list)) else (dimensions,)
    return (ctypes.c_uint * 3)(*(tuple(int(d) for d in dimensions) + (1, 1, 1))[:3])


def _argument(value):
    """A kernel argument as the ctypes value the driver copies: what CuPy's own launch would pass."""
    if hasattr(value, "data") and hasattr(value.data, "ptr"):       # a CuPy array: its device pointer
        return ctypes.c_void_p(value.data.ptr)
    if isinstance(value, numpy.generic) and value.dtype in _SCALARS:
        return _SCALARS[value.dtype](value.item())
    if isinstance(value, bool):
        return ctypes.c_bool(value)
    if isinstance(value, int):
        return ctypes.c_int64(value)
    if isinstance(value, float):
        return ctypes.c_double(value)
    raise TypeError(f"launch_dependent: cannot pass a {type(value).__name__} to a kernel (arrays, numpy scalars "
                    "and Python numbers only)")


def launch_with_programmatic_serialization(function, grid, block, args, shared_mem, stream):
    """cuLaunchKernelEx(function, grid, block, args) on `stream`, the kernel free to start early."""
    values = [_argument(value) for value in args]
    pointers = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
    attribute = _LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    config = _LaunchConfig(grid=_three(grid), block=_three(block), shared_bytes=int(shared_mem), stream=stream,
                           attributes=ctypes.pointer(attribute), attribute_count=1)
    status = _driver().cuLaunchKernelEx(ctypes.byref(config), ctypes.c_void_p(function), pointers, None)
    if status != 0:
        text = ctypes.c_char_p()
        _driver().cuGetErrorString(status, ctypes.byref(text))
        raise RuntimeError(f"launch_dependent: cuLaunchKernelEx failed with CUDA error {status} "
                           f"({(text.value or b'unknown').decode()})")
