"""Range checks that run on the device and are reported at the next synchronisation, as PyTorch's
device-side asserts are; unlike those, the error is recoverable: it is raised once, and work goes on.

    check_range("cross_entropy", targets, 0, C, skip=ignore_index, error=lambda position, value: IndexError(...))
    ...                                   # more launches: nothing waits, nothing is read back
    loss.item()                           # the first host read after the check raises its error

Why on the device: a check that reads the ids back to the host makes the host wait for the GPU at every
call, and inside a CUDA graph's capture nothing can be read at all, so a bad target in a captured step would
give a NaN loss and no error. Here the check is one more kernel: it runs wherever the op runs, at a replay too.

The kernel, first_out_of_range, looks at every value: one outside [low, high) (and not `skip`) proposes its
position and value to the check's flag, a 64-bit word in device memory, by atomicMax of
(LAST_POSITION - position) << 32 | value. The smallest position makes the largest word, so the flag ends
holding the first bad position and its value, in whatever order the threads ran; 0 means none was bad.

The flags of all checks live in one small device array, made once (at the first check, which is in a
graph's warm-up when a graph is used) and cleared only when read: a flag gathers every launch since. The
backend calls report() after each of its host reads (backend.asnumpy, so .item(), .tolist(), .numpy(),
float(), print) and after backend.synchronize(): when a check has run since the last read (or a graph
captured one, whose replays may set it at any time), the flags are read, and a set flag is cleared and
its check's error raised.
"""

import numpy

from gpt2_cupy import backend
from gpt2_cupy.ops.arrays import THREADS_PER_BLOCK, ceil_div

LAST_POSITION = 2**31 - 1  # positions are int: LAST_POSITION - position >= 1 keeps a bad value's word nonzero
SLOTS = 8                  # flags: one per kind of check (cross_entropy's targets, embedding's ids, ...)

FIRST_OUT_OF_RANGE = r"""
// flag: the first position whose value is outside [low, high) (and is not skip, when skips), with the value.
extern "C" __global__ void first_out_of_range(unsigned long long* flag, const int* values, int n, int low, int high,
                                              int skip, int skips)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int value = values[i];
    if ((skips && value == skip) || (low <= value && value < high)) return;
    // The smallest position gives the largest word: whichever thread runs last, the flag keeps the first.
    unsigned long long word = ((unsigned long long)(2147483647 - i) << 32) | (unsigned int)value;
    atomicMax(flag, word);
}
"""

_state = {"flags": None, "kernel": None, "armed": False, "captured": False}
_slots = {}    # check name -> its flag's index in the flags array
_errors = {}   # check name -> error(position, value), from its latest launch


def _flags():
    if _state["flags"] is None:
        if backend._capturing:
            raise RuntimeError("device_checks: the first range check ran inside CUDA graph capture; run the step "
                               "once before capturing it (the warm-up), so that the checks' flags exist")
        if backend.ON_GPU:  # from the default pool, never a graph's: the flags outlive every graph
            cupy = backend.xp
            with cupy.cuda.using_allocator(cupy.get_default_memory_pool().malloc):
                _state["flags"] = cupy.zeros(SLOTS, dtype=numpy.uint64)
        else:
            _state["flags"] = numpy.zeros(SLOTS, dtype=numpy.uint64)
        _state["kernel"] = backend.RawKernel(FIRST_OUT_OF_RANGE, "first_out_of_range")
    return _state["flags"]


def check_range(name, values, low, high, error, skip=None):
    """Launch the check that every element of values (int32, C-contiguous) is in [low, high) or equals skip.

    error(position, value) builds the exception to raise for the first bad one (its flat position in
    values); it is called at the next synchronisation, not now. Nothing is read back here.
    """
    if values.dtype != numpy.int32 or not values.flags.c_contiguous:
        raise TypeError(f"device_checks.check_range: {name}'s values must be C-contiguous int32, got "
                        f"{values.dtype}{'' if values.flags.c_contiguous else ' (strided)'}")
    flags = _flags()
    if name not in _slots:
        if len(_slots) == SLOTS:
            raise RuntimeError(f"device_checks: more than {SLOTS} kinds of check")
        _slots[name] = len(_slots)
    _errors[name] = error
    _state["armed"] = True
    _state["captured"] |= backend._capturing
    n = values.size
    if n == 0:
        return
    flag = flags[_slots[name]:_slots[name] + 1]
    _state["kernel"]((ceil_div(n, THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,),
                     (flag, values, numpy.int32(n), numpy.int32(low), numpy.int32(high),
                      numpy.int32(0 if skip is None else skip), numpy.int32(skip is not None)))


def report():
    """Raise the error of the first check whose flag is set (clearing every set flag); called by the backend
    after each host read and synchronisation. Nothing to read unless a check ran since the last time."""
    if not (_state["armed"] or _state["captured"]):
        return
    _state["armed"] = False
    words = [int(word) for word in backend.unchecked_asnumpy(_state["flags"])]  # (on the CPU, the flags themselves)
    if not any(words):
        return
    backend.fill_zero(_state["flags"])
    for name, slot in _slots.items():
        word = words[slot]
        if word:
            position = LAST_POSITION - (word >> 32)
            value = int(numpy.uint32(word & 0xFFFFFFFF).view(numpy.int32))
            raise _errors[name](position, value)


def clear():
    """Forget every pending result (for tests that leave a bad value unread on purpose)."""
    if _state["flags"] is not None:
        backend.fill_zero(_state["flags"])
    _state["armed"] = False
