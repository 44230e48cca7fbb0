"""Which machine runs the kernels: an NVIDIA GPU through CuPy, or the CPU executor.

Everything else imports the names below and never asks which backend is active:

    name          "cuda" or "cpu"
    xp            the array module: cupy or numpy
    asnumpy(a)    a numpy copy of an array from either module
    synchronize() wait for launched kernels to finish (a no-op on the CPU, whose launches are synchronous)
    address(a)    where an array's data starts (device memory on a GPU, host memory on the CPU)
    multiprocessor_count()   the GPU's streaming multiprocessors; on the CPU an H100's 132, so that ops
                  that size their grid by it take the same path (and give the same results) on both
    RawKernel(code, name, options=())
    RawModule(code=..., options=(), name_expressions=None) with .get_function(name)
                  CuPy's own (or the executor's), with kernels/include/ on the include path, so that any
                  kernel, a chapter's cell as well as a file of kernels/, may `#include "warp.cuh"`

A kernel is called exactly like CuPy's: kernel(grid, block, args, shared_mem=0).

The choice: GPT2_CUPY_BACKEND=cuda|cpu; unset means cuda when CuPy imports and sees a device, else cpu.
On cuda the arrays and kernels are CuPy's own objects, so there is no wrapper in the hot path.
"""

import contextlib
import os
from functools import lru_cache

import numpy

from gpt2_cupy import kernels

_ENV = "GPT2_CUPY_BACKEND"


def _cupy_with_a_device():
    """CuPy if it imports and sees at least one GPU, else None (and why not)."""
    try:
        import cupy
    except Exception as error:  # ImportError, or a CUDA library that fails to load
        return None, f"CuPy does not import ({error})"
    try:
        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy, ""
        return None, "CuPy sees no GPU"
    except Exception as error:
        return None, f"CuPy finds no usable GPU ({error})"


def _choose():
    wanted = os.environ.get(_ENV, "").strip().lower()
    if wanted not in ("", "cuda", "cpu"):
        raise ValueError(f"{_ENV}={wanted!r}: use 'cuda', 'cpu', or leave it unset to pick cuda when a GPU is there")
    if wanted == "cpu":
        return None
    cupy, why_not = _cupy_with_a_device()
    if wanted == "cuda" and cupy is None:
        raise RuntimeError(f"{_ENV}=cuda, but {why_not}")
    return cupy


_cupy = _choose()

if _cupy is not None:
    name = "cuda"
    xp = _cupy
    _RawKernel = _cupy.RawKernel
    _RawModule = _cupy.RawModule
    asnumpy = _cupy.asnumpy

    def synchronize():
        _cupy.cuda.get_current_stream().synchronize()

    def device_name():
        properties = _cupy.cuda.runtime.getDeviceProperties(_cupy.cuda.Device().id)
        return properties["name"].decode()

    def address(array):
        return array.data.ptr

    def multiprocessor_count():
        return _cupy.cuda.Device().attributes["MultiProcessorCount"]

    @lru_cache(maxsize=None)  # the attribute table is slow to read, and the ops ask at every call
    def shared_memory_per_block():
        """Bytes of shared memory one block may have once its kernel opts in: 227 KiB on an H100."""
        return _cupy.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"]

else:
    name = "cpu"
    xp = numpy
    from .cpu import RawKernel as _RawKernel, RawModule as _RawModule  # (only the CPU backend needs the executor)

    def asnumpy(a):
        return numpy.asarray(a)

    def synchronize():
        """Launches on the CPU executor return when the kernel has finished."""

    def device_name():
        from .cpu import describe_host

        return describe_host()

    def address(array):
        return array.ctypes.data

    def multiprocessor_count():
        return 132  # an H100's: kernels sized by it split their work as they would on one

    def shared_memory_per_block():
        """The executor's limit for one block after the opt-in, an H100's."""
        from .cpu.kernel import MAX_DYNAMIC_SHARED_BYTES

        return MAX_DYNAMIC_SHARED_BYTES


def RawKernel(code, name, options=(), **keywords):
    """The backend's RawKernel, able to #include the device helpers of kernels/include/."""
    return _RawKernel(code, name, options=tuple(options) + kernels.include_options(), **keywords)


def RawModule(code=None, options=(), **keywords):
    """The backend's RawModule, able to #include the device helpers of kernels/include/."""
    return _RawModule(code=code, options=tuple(options) + kernels.include_options(), **keywords)


@contextlib.contextmanager
def checks(bounds=False, races=False):
    """Switch on the CPU executor's teaching checks for the launches inside the block.

    bounds: an out-of-bounds read or write of an array argument is reported with kernel, block and thread.
    races:  every load and store of each launch is checked: two threads touching one place, one of them
            writing, with nothing ordering them (a __syncthreads() within a block; between blocks a
            __threadfence() by the writer and an atomic ticket taken after it) are reported, a missing
            __syncthreads() or a lost `x += 1` for instance.
    On a GPU these checks do not exist (NVIDIA's compute-sanitizer does that work there); the block runs unchecked.
    """
    if name != "cpu":
        yield
        return
    from .cpu import launch_checks

    with launch_checks(bounds=bounds, races=races):
        yield
