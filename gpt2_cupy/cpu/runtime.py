"""The ctypes face of runtime.cpp: one launch call, and memory with guard pages for the bounds check."""

import collections
import ctypes
import os
from functools import lru_cache

import numpy

from . import toolchain


class ParameterType(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_char), ("element_kind", ctypes.c_char),
                ("size", ctypes.c_ushort), ("element_size", ctypes.c_ushort),
                ("alignment", ctypes.c_ushort), ("type_name", ctypes.c_char_p)]


MAX_PARAMETERS = 64


class KernelEntry(ctypes.Structure):
    _fields_ = [("parameter_count", ctypes.c_int),
                ("parameters", ParameterType * MAX_PARAMETERS),
                ("invoke", ctypes.c_void_p)]


class LaunchRequest(ctypes.Structure):
    _fields_ = [("entry", ctypes.c_void_p), ("packed_arguments", ctypes.c_char_p),
                ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("reverse_order", ctypes.c_int), ("worker_count", ctypes.c_int), ("track_races", ctypes.c_int),
                ("global_ranges", ctypes.POINTER(ctypes.c_ulonglong)), ("global_range_count", ctypes.c_int),
                ("dynamic_shared_bytes", ctypes.c_ulonglong), ("shared_slack_bytes", ctypes.c_ulonglong),
                ("shared_against_lower_guard", ctypes.c_int), ("shared_dynamic_offset", ctypes.c_ulonglong),
                ("shared_offsets", ctypes.POINTER(ctypes.c_ulonglong)), ("shared_static_bytes", ctypes.c_ulonglong)]


class Race(ctypes.Structure):
    """One race: its kind, the place, the thread that touched it second (block, thread) and the one before."""
    _fields_ = [("kind", ctypes.c_int), ("address", ctypes.c_ulonglong),
                ("block", ctypes.c_uint * 3), ("thread", ctypes.c_uint * 3),
                ("other_block", ctypes.c_uint * 3), ("other_thread", ctypes.c_uint * 3)]


RACES_KEPT = 10  # the races a launch reports in full; the rest are counted


class LaunchResult(ctypes.Structure):
    _fields_ = [("failure", ctypes.c_int), ("block", ctypes.c_uint * 3), ("thread", ctypes.c_uint * 3),
                ("fault_address", ctypes.c_ulonglong), ("fault_is_write", ctypes.c_int),
                ("message", ctypes.c_char * 1024),
                ("race_count", ctypes.c_ulonglong), ("races", Race * RACES_KEPT)]

    def kept_races(self):
        return list(self.races[:min(self.race_count, RACES_KEPT)])


# Race.kind: what the race check found
NO_RACE, WRITE_THEN_READ, WRITE_THEN_WRITE, READ_MODIFY_WRITE, READ_THEN_WRITE, WRITE_THEN_READ_WITHOUT_FENCE, \
    ATOMIC_AND_PLAIN = range(7)


# LaunchResult.failure
OK, ASSERTION_FAILED, MEMORY_FAULT, DEADLOCK, STACK_OVERFLOW, CPP_EXCEPTION, INTERRUPTED, ARITHMETIC_FAULT, \
    MISALIGNED_ACCESS, UNDEFINED_SHUFFLE = range(10)


@lru_cache(maxsize=None)
def library():
    """The runtime, loaded so that kernel libraries loaded later find its functions."""
    lib = ctypes.CDLL(str(toolchain.build_runtime()), mode=ctypes.RTLD_GLOBAL)
    lib.gpt2cupy_launch.argtypes = [ctypes.POINTER(LaunchRequest), ctypes.POINTER(LaunchResult),
                                    ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_ulonglong)]
    lib.gpt2cupy_launch.restype = ctypes.c_int
    lib.gpt2cupy_free.argtypes = [ctypes.c_void_p]
    lib.gpt2cupy_guarded_alloc.argtypes = [ctypes.c_ulonglong, ctypes.POINTER(ctypes.c_void_p),
                                           ctypes.POINTER(ctypes.c_ulonglong), ctypes.POINTER(ctypes.c_ulonglong)]
    lib.gpt2cupy_guarded_alloc.restype = ctypes.c_void_p
    lib.gpt2cupy_guarded_free.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong]
    lib.gpt2cupy_shared_overrun.argtypes = [ctypes.c_ulonglong, ctypes.POINTER(ctypes.c_ulonglong),
                                            ctypes.POINTER(ctypes.c_ulonglong)]
    return lib


def shared_overrun(address):
    """(bytes past the end of the block's shared memory, the launch's dynamic shared bytes) for a faulting
    address in the guard after a shared-memory window (runtime.cpp); (-bytes before the guard's end, the same)
    for one in the guard below it; None for any other address."""
    past_end, dynamic_bytes = ctypes.c_ulonglong(), ctypes.c_ulonglong()
    side = library().gpt2cupy_shared_overrun(address, ctypes.byref(past_end), ctypes.byref(dynamic_bytes))
    if side == 0:
        return None
    return side * past_end.value, dynamic_bytes.value


class SharedDeclaration(ctypes.Structure):
    """One __shared__ declaration of a kernel library (cuda_builtins.h): its place, size, names and function."""
    _fields_ = [("offset", ctypes.c_ulonglong), ("bytes", ctypes.c_ulonglong), ("alignment", ctypes.c_ulonglong),
                ("serial", ctypes.c_uint), ("names", ctypes.c_char_p), ("function", ctypes.c_char_p)]


# One __shared__ declaration of a kernel library, as shared_layout gives it.
SharedPlace = collections.namedtuple("SharedPlace", "offset bytes names function alignment index")


def shared_layout(kernel_library):
    """[SharedPlace] of a kernel library's __shared__ declarations in functions, in the order they lie in the
    block's shared memory. Lays them out first: call it once the library is loaded, before it runs a kernel."""
    layout = kernel_library.gpt2cupy_shared_layout
    layout.restype = ctypes.POINTER(SharedDeclaration)
    layout.argtypes = [ctypes.POINTER(ctypes.c_uint)]
    count = ctypes.c_uint()
    declarations = layout(ctypes.byref(count))
    found = [SharedPlace(declarations[k].offset, declarations[k].bytes, declarations[k].names.decode(),
                         declarations[k].function.decode(), declarations[k].alignment, k) for k in range(count.value)]
    return sorted(found)


def worker_count():
    """OS threads that run blocks: $GPT2_CUPY_CPU_THREADS, else every core."""
    configured = os.environ.get("GPT2_CUPY_CPU_THREADS")
    return int(configured) if configured else 0


def launch(entry_address, packed_arguments, grid, block, reverse_order=False, track_races=False, global_ranges=(),
           dynamic_shared_bytes=None, shared_slack_bytes=0, shared_dynamic_offset=None, shared_placement=None):
    """Run a kernel to the end. Returns (LaunchResult, printf output as text).
    track_races: the kernel was built for the race check, and its accesses are to be checked;
    global_ranges: then, the [start, end) addresses of its array arguments;
    dynamic_shared_bytes: the launch's dynamic shared memory (None: all a block may have), where bulk copies land;
    shared_slack_bytes: bytes left between the end of the block's shared memory and the guard after it;
    shared_dynamic_offset: if given, the window lies against the guard below it instead, its dynamic memory this
    many bytes above the guard's end;
    shared_placement: (offsets, bytes): the launched kernel's own offsets of the module's __shared__ declarations
    (a ctypes array by declaration index) and their total bytes; None: the module's placement of them all."""
    lib = library()
    ranges = (ctypes.c_ulonglong * max(1, 2 * len(global_ranges)))(*[bound for pair in global_ranges for bound in pair])
    shared = 2**64 - 1 if dynamic_shared_bytes is None else dynamic_shared_bytes  # the runtime caps it at its own
    request = LaunchRequest(entry_address, packed_arguments, grid, block, int(reverse_order), worker_count(),
                            int(track_races), ranges, len(global_ranges), shared, shared_slack_bytes,
                            shared_dynamic_offset is not None, shared_dynamic_offset or 0,
                            *(shared_placement if shared_placement is not None else (None, 0)))
    result = LaunchResult()
    output = ctypes.c_void_p()
    output_length = ctypes.c_ulonglong()
    lib.gpt2cupy_launch(ctypes.byref(request), ctypes.byref(result), ctypes.byref(output),
                        ctypes.byref(output_length))
    text = ""
    if output_length.value:
        text = ctypes.string_at(output.value, output_length.value).decode("utf-8", errors="replace")
        lib.gpt2cupy_free(output)
    return result, text


def view(address, like):
    """A numpy array over the memory at address, with like's dtype and shape (no copy)."""
    if like.nbytes == 0:
        return numpy.empty(like.shape, like.dtype)
    memory = (ctypes.c_char * like.nbytes).from_address(address)
    return numpy.frombuffer(memory, dtype=like.dtype).reshape(like.shape)


class GuardedCopy:
    """A copy of some bytes placed against an inaccessible region above (or below) them.

    With keep_alignment (the default) the copy keeps the source's alignment modulo 16, as a GPU
    allocation keeps vector loads aligned, so up to 15 bytes may lie between the bytes and the guard:
    they are filled with a canary, and first_overwritten_canary() finds a write into them after the
    launch. Without it, the bytes end exactly at the guard (above only).
    """

    ALIGNMENT = 16
    CANARY = 0xA5

    def __init__(self, source_address, nbytes, against_upper_guard, keep_alignment=True):
        lib = library()
        self.nbytes = nbytes
        self._mapping = ctypes.c_void_p()
        self._mapped_bytes = ctypes.c_ulonglong()
        accessible_bytes = ctypes.c_ulonglong()
        start = lib.gpt2cupy_guarded_alloc(nbytes + self.ALIGNMENT, ctypes.byref(self._mapping),
                                           ctypes.byref(self._mapped_bytes), ctypes.byref(accessible_bytes))
        if not start:
            raise MemoryError(f"no memory for a guarded copy of {nbytes} bytes")
        end = start + accessible_bytes.value
        if against_upper_guard:
            self.address = end - nbytes
            if keep_alignment:
                self.address -= (self.address - source_address) % self.ALIGNMENT
            self._slack = (self.address + nbytes, end)
        else:
            self.address = start + source_address % self.ALIGNMENT
            self._slack = (start, self.address)
        ctypes.memset(self._slack[0], self.CANARY, self._slack[1] - self._slack[0])
        ctypes.memmove(self.address, source_address, nbytes)

    @property
    def slack_bytes(self):
        return self._slack[1] - self._slack[0]

    def in_guard(self, address):
        """Whether address falls in the inaccessible memory around the copy."""
        start = self._mapping.value
        inside = self.address <= address < self.address + self.nbytes
        return start <= address < start + self._mapped_bytes.value and not inside

    def first_overwritten_canary(self):
        """The address of the first slack byte a kernel wrote to, or None."""
        low, high = self._slack
        if high == low:
            return None
        changed = numpy.flatnonzero(view(low, numpy.empty(high - low, numpy.uint8)) != self.CANARY)
        return low + int(changed[0]) if changed.size else None

    def free(self):
        library().gpt2cupy_guarded_free(self._mapping, self._mapped_bytes)


class PlainCopy:
    """A copy of some bytes in ordinary memory."""

    def __init__(self, source_address, nbytes):
        self._buffer = numpy.empty(max(nbytes, 1), dtype=numpy.uint8)
        self.address = self._buffer.ctypes.data
        self.nbytes = nbytes
        ctypes.memmove(self.address, source_address, nbytes)

    @property
    def slack_bytes(self):
        return self._slack[1] - self._slack[0]

    def in_guard(self, address):
        return False

    def first_overwritten_canary(self):
        return None

    def free(self):
        self._buffer = None
