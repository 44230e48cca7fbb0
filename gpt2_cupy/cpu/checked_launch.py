"""The bounds and race checks: a launch run more than once, each time on fresh copies of its arrays.

bounds  The arrays' bytes are copied right against an inaccessible region, above them and then below
        them (and the block's shared memory, which always ends at a guard, starts at one in that second
        pass), so the first access past either end faults; the fault's address names the array, the element,
        the block and the thread. The copies keep the arrays' 16-byte alignment, as GPU memory does, which
        can leave a few bytes between an array and its guard: a write there is found after the launch,
        and a read there by one more pass with the bytes exactly against the guard, unaligned.
races   The launch runs again, with the threads (and blocks) in the opposite order, built so that every load,
        store and atomic of the kernel is reported to the runtime (the compiler's -fsanitize=thread
        instrumentation, answered by runtime.cpp). Two threads touching one place, at least one writing,
        with no barrier between them and not through atomics, is a race: reported with the place, the two
        threads, and what to do. Blocks are ordered only as on a GPU: a block reads another block's writes
        safely after the writer's __threadfence() and atomic ticket (the "last block" pattern). Outputs that differ between the runs with no such pair found differ only
        by the order of atomic operations (stream compaction, float atomicAdd sums), which CUDA allows.

Arguments that share memory (an in-place kernel given the same array twice, or overlapping views) share
one copy, so the kernel sees the aliasing it would see on a GPU. Every run starts from the original bytes,
and the first run's results are the ones written back.
"""

import ctypes
from dataclasses import dataclass, field

import numpy

from . import runtime
from .errors import OutOfBoundsError, RaceError

# Floating-point results may differ in their last bits when atomicAdd sums in another order: that is
# not a race. Differences larger than this, relative to the array's largest magnitude, are.
RACE_RELATIVE_TOLERANCE = 1e-5


@dataclass
class Region:
    """Bytes [start, end) of host memory, and the array arguments (index, array) that lie in them."""
    start: int
    end: int
    members: list = field(default_factory=list)

    @property
    def nbytes(self):
        return self.end - self.start


def allocation_of(array):
    """[start, end) of the memory an array argument was cut from: for a view (`base[3:]`, CUDA's `d_base + 3`)
    its base's, as a GPU reads base[2] through `in[-1]` without a fault; for an array of its own, its bytes."""
    start, end = array.ctypes.data, array.ctypes.data + array.nbytes
    owner = array
    while isinstance(owner.base, numpy.ndarray):
        owner = owner.base
    if owner is not array and owner.flags.c_contiguous:
        owner_start = owner.ctypes.data
        if owner_start <= start and end <= owner_start + owner.nbytes:
            return owner_start, owner_start + owner.nbytes
    return start, end


def regions_of(arrays):
    """The memory regions of the array arguments [(index, array)], each the whole allocation it was cut from
    (allocation_of), overlapping ones merged."""
    spans = sorted((*allocation_of(array), index, array) for index, array in arrays)
    regions = []
    for start, end, index, array in spans:
        if regions and start < regions[-1].end:
            regions[-1].end = max(regions[-1].end, end)
        else:
            regions.append(Region(start, end))
        regions[-1].members.append((index, array))
    return regions


def launch_checked(function, grid, block, values, arrays, bounds, races, shared_mem=None):
    """Launch `function` (a kernel.Function) with the checks asked for; raise what they find."""
    regions = regions_of(arrays)

    def run(make_copy, reverse_order=False, show_output=False, track_races=False, unchecked_alignment=False,
            shared_below=False):
        copies = [make_copy(region) for region in regions]
        addresses = {index: copy.address + (array.ctypes.data - region.start)
                     for region, copy in zip(regions, copies) for index, array in region.members}
        ranges = [(copy.address, copy.address + copy.nbytes) for copy in copies] if track_races else ()
        result = function._launch(grid, block, function._with_addresses(values, addresses), reverse_order,
                                  show_output, track_races, ranges, shared_mem, unchecked_alignment, shared_below)
        return result, copies

    def above_guard(region):
        return runtime.GuardedCopy(region.start, region.nbytes, against_upper_guard=True)

    def exactly_above_guard(region):
        return runtime.GuardedCopy(region.start, region.nbytes, against_upper_guard=True, keep_alignment=False)

    def below_guard(region):
        return runtime.GuardedCopy(region.start, region.nbytes, against_upper_guard=False)

    def plain(region):
        return runtime.PlainCopy(region.start, region.nbytes)

    result, kept = run(above_guard if bounds else plain, show_output=True)
    try:
        function._raise_for(result, locate=lambda address: _locate(address, regions, kept), bounds_checked=bounds)
        if bounds:
            _raise_for_overwritten_canary(function, regions, kept)
            result, below = run(below_guard, shared_below=True)  # shared memory against its lower guard too
            try:
                function._raise_for(result, locate=lambda address: _locate(address, regions, below), bounds_checked=True)
                _raise_for_overwritten_canary(function, regions, below)
            finally:
                _free(below)
            if any(copy.slack_bytes for copy in kept):
                result, exact = run(exactly_above_guard, unchecked_alignment=True)  # off alignment on purpose
                try:
                    # Only a fault in a guard counts here: any other (a misaligned access, or a fault
                    # elsewhere) is a vector load or store of the shifted bytes, which cannot happen on a GPU.
                    found = _locate(result.fault_address, regions, exact) if result.failure == runtime.MEMORY_FAULT else None
                    shifted_bytes_only = (runtime.OK, runtime.MEMORY_FAULT, runtime.MISALIGNED_ACCESS)
                    if found or result.failure not in shifted_bytes_only:
                        function._raise_for(result, locate=lambda address: found, bounds_checked=True)
                finally:
                    _free(exact)
        if races:
            result, backward = run(plain, reverse_order=True, track_races=True)
            try:
                function._raise_for(result)
                _raise_for_race(function, result, regions, kept, backward)
            finally:
                _free(backward)
        for region, copy in zip(regions, kept):
            ctypes.memmove(region.start, copy.address, region.nbytes)
    finally:
        _free(kept)


def _free(copies):
    for copy in copies:
        copy.free()


def _locate(address, regions, copies):
    """(argument index, array, element index) of a faulting address in a guard, or None."""
    for region, copy in zip(regions, copies):
        if not (copy.in_guard(address) or address == copy.first_overwritten_canary()):
            continue
        above = address >= copy.address + copy.nbytes
        # The argument whose end (or start) is the region's: the one the access ran off.
        index, array = max(region.members, key=lambda m: m[1].ctypes.data + m[1].nbytes) if above else \
            min(region.members, key=lambda m: m[1].ctypes.data)
        start_in_copy = copy.address + (array.ctypes.data - region.start)
        return index, array, (address - start_in_copy) // max(array.itemsize, 1)
    return None


def _raise_for_overwritten_canary(function, regions, copies):
    """A write into the few bytes between an array and its guard, found after the launch."""
    for copy in copies:
        address = copy.first_overwritten_canary()
        if address is not None:
            index, array, element = _locate(address, regions, copies)
            raise OutOfBoundsError(
                f"kernel '{function.name}': out-of-bounds write of '{function.parameters[index].name}' at element "
                f"{element}; it has {array.size} elements ({array.dtype}, valid indices 0..{array.size - 1}). "
                "Found after the launch, in the bytes just past the array, so which thread wrote is not known")


def _inside(address, regions, copies):
    """(argument index, array, element) of an address inside an array argument's copy, or None."""
    for region, copy in zip(regions, copies):
        for index, array in region.members:
            start = copy.address + (array.ctypes.data - region.start)
            if start <= address < start + array.nbytes:
                return index, array, (address - start) // max(array.itemsize, 1)
    return None


_RACE_STORIES = {
    runtime.READ_MODIFY_WRITE: (
        "{first} and {second} both read it and write it back with no atomic operation, so one thread's update "
        "can overwrite the other's (a GPU loses such updates: many threads doing `x += 1` count far less than "
        "they should). Use atomicAdd (or atomicMax, atomicCAS...), or give each thread an element of its own"),
    runtime.WRITE_THEN_WRITE: (
        "{first} and {second} both write it between the same barriers: which value stays depends on an order "
        "CUDA does not promise. Let one thread write it, or use an atomic operation"),
    runtime.WRITE_THEN_READ: (
        "{first} writes it and {second} reads it with no __syncthreads() (or __syncwarp() within a warp, or a "
        "wait on the mbarrier the write arrived at or its bulk copy completed) between them, so the read may "
        "come before the write"),
    runtime.WRITE_THEN_READ_WITHOUT_FENCE: (
        "{first} writes it and {second}, in another block, reads it after an atomic operation (the \"last block\" "
        "pattern), but {first} called no __threadfence() between its write and its block's atomic operation: on a "
        "GPU the write may not have reached memory when the other block reads it. Call __threadfence() after "
        "the write, before the atomic operation that counts the block as done"),
    runtime.READ_THEN_WRITE: (
        "{first} reads it and {second} writes it with no __syncthreads() (or __syncwarp() within a warp, or a "
        "wait on the mbarrier the read arrived at, before the write or the bulk copy that wrote) between them, "
        "so the read may see the new value or the old one"),
    runtime.ATOMIC_AND_PLAIN: (
        "{first} and {second} touch it, one through an atomic operation and the other with a plain load or "
        "store, with no __syncthreads() (or __syncwarp() within a warp) between them: the plain access may come "
        "before or after the atomic updates (a sum one thread starts at zero needs a __syncthreads() before any "
        "thread adds to it, and another before it is read)"),
}


_RACE_NAMES = {
    runtime.READ_MODIFY_WRITE: "lost update", runtime.WRITE_THEN_WRITE: "two writes",
    runtime.WRITE_THEN_READ: "a write and a read", runtime.READ_THEN_WRITE: "a read and a write",
    runtime.WRITE_THEN_READ_WITHOUT_FENCE: "another block's write read without a __threadfence()",
    runtime.ATOMIC_AND_PLAIN: "an atomic operation and a plain access",
}


def _raise_for_race(function, result, regions, forward_copies, backward_copies):
    """The race check's verdict. A run built so that every access is checked found two threads touching one
    place with nothing ordering them (raise, naming the place, the threads and the fix), or none: then
    outputs that differ between the runs differ only by the order of atomic operations, which is allowed.
    Where the compiler could not build the checked kernel, outputs that differ are reported."""
    if function.race_check_entry_address() is None:
        _compare(function, regions, forward_copies, backward_copies)
        return
    races = result.kept_races()
    if not races:
        return
    differ = ""
    for region, forward, backward in zip(regions, forward_copies, backward_copies):
        for index, array in region.members:
            offset = array.ctypes.data - region.start
            changed = elements_that_differ(runtime.view(forward.address + offset, array),
                                           runtime.view(backward.address + offset, array))
            if changed.size and not differ:
                differ = (f" '{function.parameters[index].name}' differs in {changed.size} of {array.size} elements "
                          f"when the threads run in another order (first at element {int(changed[0])}).")
    first, second = _race_threads(races[0])
    place = _race_place(function, races[0], regions, backward_copies)
    kind = "read-modify-write race" if races[0].kind == runtime.READ_MODIFY_WRITE else "race"
    story = _RACE_STORIES[races[0].kind].format(first=first, second=second)
    raise RaceError(f"kernel '{function.name}': {kind} on {place}:{differ} {story[0].upper()}{story[1:]}"
                    f"{_other_races(function, result, races[1:], regions, backward_copies)}")


def _race_place(function, race, regions, copies):
    found = _inside(race.address, regions, copies)
    return (f"'{function.parameters[found[0]].name}' element {found[2]}" if found
            else "shared memory (or another variable outside the array arguments)")


def _race_threads(race):
    """(the thread that touched the place first, the one that touched it second), in words."""
    def coordinates(values):
        return f"({', '.join(map(str, values))})"
    return (f"thread {coordinates(race.other_thread)} of block {coordinates(race.other_block)}",
            f"thread {coordinates(race.thread)} of block {coordinates(race.block)}")


def _other_races(function, result, races, regions, copies):
    """The launch's other races, one line each, and how many more were found."""
    if not races:
        return ""
    lines = [f"  {_race_place(function, race, regions, copies)}: {_RACE_NAMES[race.kind]}, "
             f"{' then '.join(_race_threads(race))}" for race in races]
    unlisted = result.race_count - 1 - len(races)
    more = f"\n  ... and {unlisted} more" if unlisted else ""
    return f"\n{result.race_count - 1} more race(s) in this launch:\n" + "\n".join(lines) + more


def _compare(function, regions, forward_copies, backward_copies):
    for region, forward, backward in zip(regions, forward_copies, backward_copies):
        for index, array in region.members:
            offset = array.ctypes.data - region.start
            a = runtime.view(forward.address + offset, array)
            b = runtime.view(backward.address + offset, array)
            differ = elements_that_differ(a, b)
            if differ.size:
                a, b, first = a.ravel(), b.ravel(), int(differ[0])
                raise RaceError(
                    f"kernel '{function.name}': '{function.parameters[index].name}' differs in {differ.size} of "
                    f"{a.size} elements when the threads run in the opposite order (first at element {first}: "
                    f"{a[first].item()!r} vs {b[first].item()!r}). A thread reads memory that another thread "
                    "writes, with no __syncthreads() (or __syncwarp()) between them, or several threads update "
                    "it without an atomic operation")


def elements_that_differ(a, b):
    """Flat indices where two results of one launch differ by more than the order of float sums explains."""
    a, b = a.ravel(), b.ravel()
    if a.dtype.kind != "f":
        return numpy.flatnonzero(a != b)
    both_nan = numpy.isnan(a) & numpy.isnan(b)
    with numpy.errstate(invalid="ignore"):
        scale = max(float(numpy.nanmax(numpy.abs(a), initial=0.0)), float(numpy.nanmax(numpy.abs(b), initial=0.0)))
        far = numpy.abs(a.astype(numpy.float64) - b) > RACE_RELATIVE_TOLERANCE * scale
    return numpy.flatnonzero(~both_nan & (far | (numpy.isnan(a) != numpy.isnan(b))))
