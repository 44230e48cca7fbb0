"""Which machine runs the kernels: an NVIDIA GPU through CuPy, or the CPU executor.

Everything else imports the names below and never asks which backend is active:

    name          "cuda" or "cpu" (for people to read; code asks the capabilities below)
    ON_GPU        True when a GPU runs the kernels (CuPy), False on the CPU executor
    DEVICE_TYPE   the device type tensors report (torch.device's): "cuda" on a GPU, "cpu" on the executor
    device_id()   the current GPU's number, -1 on the CPU
    device_count()           GPUs this process sees: 0 on the CPU
    xp            the array module: cupy or numpy
    asnumpy(a)    a numpy copy of an array from either module
    synchronize() wait for launched kernels to finish (a no-op on the CPU, whose launches are synchronous)
                  Both are synchronisation points: a range check launched before them (gpt2_cupy.device_checks,
                  a target or an id out of range) raises its error there.
    address(a)    where an array's data starts (device memory on a GPU, host memory on the CPU)
    multiprocessor_count()   the GPU's streaming multiprocessors; on the CPU an H100's 132, so that ops
                  that size their grid by it take the same path (and give the same results) on both
    runs_wgmma()  whether Hopper's wgmma runs: compute capability 9.0 (H100, H200), or the CPU executor,
                  which emulates it and stands for an H100
    TENSOR_CORES_EMULATED    True on the CPU, whose executor runs the tensor cores' instructions lane by
                  lane (gpt2_cupy.dispatch keeps products off them where a float32 kernel is as accurate)
    RawKernel(code, name, options=())
    RawModule(code=..., options=(), name_expressions=None) with .get_function(name)
                  CuPy's own (or the executor's), with kernels/include/ on the include path, so that any
                  kernel, a chapter's cell as well as a file of kernels/, may `#include "warp.cuh"`
    launch_dependent(kernel, grid, block, args, shared_mem=0)
                  inside a CUDA graph's capture, a launch that may start before the kernel ahead of it has
                  ended (CUDA's programmatic dependent launch, compute capability 9.0 on;
                  kernels/include/dependent_launch.cuh); an ordinary launch outside a capture, on older GPUs,
                  on the CPU, or with DEPENDENT_LAUNCHES = False
    fill_zero(a)  a[...] = 0, on the device
    copy_into(dst, src)      dst[...] = src, on the device (src may be a numpy array: one host-to-device copy)

A kernel is called exactly like CuPy's: kernel(grid, block, args, shared_mem=0).

Inside a CUDA graph's capture (gpt2_cupy.graphs) nothing runs: on a GPU, CuPy's launches, fills and
copies go to the capturing stream, which records them; on the CPU the executor's kernels, fill_zero and
copy_into are recorded here instead of run. A host copy (asnumpy, and so .item(), float(), print of a
tensor) or synchronize() inside capture raises RuntimeError: there is nothing to read before a replay.

The choice: GPT2_CUPY_BACKEND=cuda|cpu; unset means cuda when CuPy imports and sees a device, else cpu.
On cuda the arrays and kernels are CuPy's own objects, so there is no wrapper in the hot path.
"""

import contextlib
import os
import sys
from functools import lru_cache

import numpy

from gpt2_cupy import cpu   # the CPU executor: only the CPU backend launches through it
from gpt2_cupy.cpu.kernel import MAX_DYNAMIC_SHARED_BYTES
from gpt2_cupy.driver_launch import launch_with_programmatic_serialization   # ctypes; the driver loads when first used
from gpt2_cupy.kernel_files import include_options

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

# launch_dependent's overlap on or off: False makes every such launch an ordinary one (to measure what it brings).
DEPENDENT_LAUNCHES = True

# ---- CUDA graph capture: set by gpt2_cupy.graphs while a `with graph(g):` block runs ---------------------

_capturing = False   # a graph is being captured: host copies and synchronisation are refused
_recording = None    # on the CPU, the graphs.Recording that takes the launches, fills and copies meanwhile


def set_capture(recording):
    """Start (a Recording on the CPU, True on a GPU) or end (None) a capture. For gpt2_cupy.graphs only."""
    global _capturing, _recording
    _capturing = recording is not None
    _recording = recording if name == "cpu" else None


def set_array_module(module):
    """CPU only: the numpy stand-in that gpt2_cupy.graphs puts in xp's place during a warm-up or a capture
    (it records the calls a capture makes), or numpy itself again. For gpt2_cupy.graphs only."""
    global xp
    if name != "cpu":
        raise RuntimeError("set_array_module: on a GPU, xp stays CuPy (its stream records what a capture needs)")
    xp = module


def refuse_under_capture(call):
    """RuntimeError naming `call` when a graph is being captured: capture forbids host copies and syncs."""
    if _capturing:
        raise RuntimeError(
            f"{call} inside CUDA graph capture: capture forbids host copies and synchronisation. Inside "
            "`with graph(g):` nothing has run yet (the kernels are recorded, not executed), so there is no "
            "value to read; read results after g.replay(), outside the block.")


def _report_device_checks():
    """Raise the error of a range check that failed on the device (gpt2_cupy.device_checks), if any ran."""
    checks = sys.modules.get("gpt2_cupy.device_checks")  # not imported: no check has run
    if checks is not None:
        checks.report()


if _cupy is not None:
    name = "cuda"
    ON_GPU = True
    DEVICE_TYPE = "cuda"
    xp = _cupy
    _RawKernel = _cupy.RawKernel
    _RawModule = _cupy.RawModule

    def _device_array(a):
        """a, or the CuPy array over the memory an object (a Tensor) exposes through __cuda_array_interface__, with
        the object's own dtype: the interface spells bf16 as two raw bytes, which CuPy cannot copy as such."""
        if isinstance(a, _cupy.ndarray) or not hasattr(a, "__cuda_array_interface__"):
            return a
        interface = a.__cuda_array_interface__
        dtype = numpy.dtype(getattr(a, "dtype", interface["typestr"]))
        shape = tuple(interface["shape"])
        strides = interface.get("strides") or tuple(
            int(numpy.prod(shape[axis + 1:], dtype=numpy.int64)) * dtype.itemsize for axis in range(len(shape)))
        extent = (sum((n - 1) * abs(s) for n, s in zip(shape, strides)) + dtype.itemsize) if all(shape) else 0
        memory = _cupy.cuda.UnownedMemory(interface["data"][0], extent, a)
        return _cupy.ndarray(shape, dtype, _cupy.cuda.MemoryPointer(memory, 0), strides)

    def unchecked_asnumpy(a):
        """A numpy copy, without reporting the range checks (device_checks reads its own flags with it)."""
        return _cupy.asnumpy(_device_array(a))

    def asnumpy(a):
        refuse_under_capture("backend.asnumpy (a host copy, as .item(), .tolist(), float() and print make)")
        result = _cupy.asnumpy(_device_array(a))
        _report_device_checks()
        return result

    def synchronize():
        refuse_under_capture("backend.synchronize()")
        _cupy.cuda.get_current_stream().synchronize()
        _report_device_checks()

    def fill_zero(array):
        """array[...] = 0: a memset on the current stream (inside capture, the capturing stream records it)."""
        array.fill(0)

    def copy_into(dst, src):
        """dst[...] = src on the current stream; src a device array, or a numpy array (one host-to-device copy)."""
        _check_copy(dst, src)
        if isinstance(src, numpy.ndarray):
            # A capture would keep the host address of src and read it again at every replay.
            refuse_under_capture("backend.copy_into from a numpy array (a host-to-device copy)")
            dst.set(src)
        else:
            _cupy.copyto(dst, src)

    def device_name():
        properties = _cupy.cuda.runtime.getDeviceProperties(_cupy.cuda.Device().id)
        return properties["name"].decode()

    def address(array):
        return array.data.ptr

    def device_id():
        return _cupy.cuda.Device().id

    def device_count():
        return _cupy.cuda.runtime.getDeviceCount()

    def multiprocessor_count():
        return _cupy.cuda.Device().attributes["MultiProcessorCount"]

    @lru_cache(maxsize=None)  # the products ask at every call
    def runs_wgmma():
        """Whether this GPU runs wgmma: compute capability 9.0 (H100, H200); sm_90a code runs nowhere else."""
        return _cupy.cuda.Device().compute_capability == "90"

    TENSOR_CORES_EMULATED = False

    @lru_cache(maxsize=None)  # the attribute table is slow to read, and the ops ask at every call
    def shared_memory_per_block():
        """Bytes of shared memory one block may have once its kernel opts in: 227 KiB on an H100."""
        return _cupy.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"]

    @lru_cache(maxsize=None)
    def _has_dependent_launch(device):
        return int(_cupy.cuda.Device(device).compute_capability) >= 90

    def launch_dependent(kernel, grid, block, args, shared_mem=0):
        """kernel(grid, block, args, shared_mem), free to start before the kernel ahead of it in the stream
        has ended, where a CUDA graph is being captured. CuPy's launch takes no launch attributes, so this one
        goes to the driver's cuLaunchKernelEx (through ctypes, as gpt2_cupy.tensor_map reaches the driver).
        Launched one at a time from Python, a kernel waits for the host, not for the kernel before it, and
        there the driver's launch is the slower (bench/design_choices.json): outside a capture this is CuPy's
        ordinary launch."""
        if not (DEPENDENT_LAUNCHES and _capturing and _has_dependent_launch(_cupy.cuda.Device().id)):
            return kernel(grid, block, args, shared_mem=shared_mem)
        launch_with_programmatic_serialization(kernel.kernel.ptr, grid, block, args, shared_mem,
                                               _cupy.cuda.get_current_stream().ptr)

else:
    name = "cpu"
    ON_GPU = False
    DEVICE_TYPE = "cpu"
    xp = numpy
    _RawKernel, _RawModule = cpu.RawKernel, cpu.RawModule

    def unchecked_asnumpy(a):
        """The array itself, without reporting the range checks (device_checks reads its own flags with it)."""
        return numpy.asarray(a)

    def asnumpy(a):
        refuse_under_capture("backend.asnumpy (a host copy, as .item(), .tolist(), float() and print make)")
        _report_device_checks()
        return numpy.asarray(a)

    def synchronize():
        """Launches on the CPU executor return when the kernel has finished."""
        refuse_under_capture("backend.synchronize()")
        _report_device_checks()

    def fill_zero(array):
        """array[...] = 0 (recorded, not run, inside a graph's capture)."""
        if _recording is not None:
            _recording.fill_zero(array)
        else:
            array.fill(0)

    def copy_into(dst, src):
        """dst[...] = src (recorded, not run, inside a graph's capture)."""
        _check_copy(dst, src)
        if _recording is not None:
            _recording.copy_into(dst, src)
        else:
            numpy.copyto(dst, src)

    def device_name():
        return cpu.describe_host()

    def address(array):
        return array.ctypes.data

    def device_id():
        return -1

    def device_count():
        return 0

    def multiprocessor_count():
        return 132  # an H100's: kernels sized by it split their work as they would on one

    def runs_wgmma():
        """The executor emulates wgmma, and stands for an H100 everywhere."""
        return True

    TENSOR_CORES_EMULATED = True  # lane by lane: a tensor-core product costs about 40 float32 kernels' time

    def launch_dependent(kernel, grid, block, args, shared_mem=0):
        """An ordinary launch: the executor runs each launch to its end before the next starts, so there is no
        tail to overlap (kernels/include/dependent_launch.cuh's instructions do nothing here)."""
        kernel(grid, block, args, shared_mem)

    def shared_memory_per_block():
        """The executor's limit for one block after the opt-in, an H100's."""
        return MAX_DYNAMIC_SHARED_BYTES


def _check_copy(dst, src):
    if tuple(dst.shape) != tuple(src.shape) or dst.dtype != src.dtype:
        raise ValueError(f"copy_into: dst is {dst.dtype} {tuple(dst.shape)}, src {src.dtype} {tuple(src.shape)}; "
                         "they must have the same shape and dtype")


class _RecordableKernel:
    """An executor kernel that a CPU graph's capture records instead of running (CUDA has no need of it:
    the capturing stream records CuPy's own launches)."""

    def __init__(self, kernel):
        self._kernel = kernel

    def __call__(self, grid, block, args, shared_mem=0, **checks_wanted):
        if _recording is not None:
            _recording.launch(self._kernel, grid, block, args, shared_mem, checks_wanted)
        else:
            self._kernel(grid, block, args, shared_mem, **checks_wanted)

    @property
    def max_dynamic_shared_size_bytes(self):
        return self._kernel.max_dynamic_shared_size_bytes

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value):
        self._kernel.max_dynamic_shared_size_bytes = value

    def __getattr__(self, attribute):  # compile(), max_threads_per_block, ...: the executor's own
        return getattr(self._kernel, attribute)


class _RecordableModule:
    """An executor RawModule whose functions are _RecordableKernels."""

    def __init__(self, module):
        self._module = module

    def get_function(self, name):
        return _RecordableKernel(self._module.get_function(name))

    def __getattr__(self, attribute):  # compile(), get_global(), ...
        return getattr(self._module, attribute)


def RawKernel(code, name, options=(), **keywords):
    """The backend's RawKernel, able to #include the device helpers of kernels/include/."""
    kernel = _RawKernel(code, name, options=tuple(options) + include_options(), **keywords)
    return kernel if _cupy is not None else _RecordableKernel(kernel)


def RawModule(code=None, options=(), **keywords):
    """The backend's RawModule, able to #include the device helpers of kernels/include/."""
    module = _RawModule(code=code, options=tuple(options) + include_options(), **keywords)
    return module if _cupy is not None else _RecordableModule(module)


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
    with cpu.launch_checks(bounds=bounds, races=races):
        yield
