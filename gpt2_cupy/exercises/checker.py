"""The graded exercises' machinery: run a learner's kernel at several sizes and name the first thing wrong.

How to add an exercise to chapter NN
------------------------------------
1. In `gpt2_cupy/exercises/chapter_NN.py` (chapters 00-09 have one; for a new chapter create it from
   chapter_00.py and add it to `_CHAPTERS` in `gpt2_cupy/exercises/__init__.py`), append an `Exercise` to
   `EXERCISES` (chapter_00.py is a complete example):

       def _scale_arguments(size, rng):
           n = size["n"]
           return [Output("out", (n,)),                                   # outputs first (house style)
                   Input("x", rng.standard_normal(n, dtype=numpy.float32)),
                   Scalar("alpha", numpy.float32(0.5)),
                   Scalar("n", numpy.int32(n))]

       Exercise(
           id="NN.scale", title="Scale a vector", kernel="scale",
           arguments=_scale_arguments,
           launch=lambda size: ((blocks(size["n"], 256),), (256,)),      # (grid, block[, shared_mem])
           reference=lambda x, alpha, n: {"out": alpha * x.astype(numpy.float64)},
           sizes=({"n": 1}, {"n": 255}, {"n": 257}, {"n": 4099}),     # ragged: not multiples of the block
           rtol=2.0**-23, atol=0.0)

   `reference` receives every Input and Scalar by name (Inputs as the float32 arrays the kernel gets, an
   Output with `initial=` as that initial array) and returns {output name: float64 expected array}.
   Keep sizes small (the CPU runs each one under the bounds and race checks): a few thousand elements.
2. In the chapter: a markdown cell that states the task, the kernel's signature and its launch, and what to
   try; a skeleton code cell that assigns the source with `// your code here` in the kernel's body and calls
   `exercises.check("NN.scale", source)` (its stored output is the skeleton's verdict, the same on every
   machine); below it the solution, a collapsed code cell (metadata `"jupyter": {"source_hidden": true,
   "outputs_hidden": true}`, tag `solution`) whose first line is `# export: kernels/exercises/NN_scale.cu`,
   which assigns the solution's source as its first string literal and checks it. Then run
   `python -m gpt2_cupy.export chapters/` to write kernels/exercises/NN_scale.cu. A solution may not define
   a __device__ function that another kernel file defines (tests/test_export.py): write it inline, or
   #include the kernels/include/ header that has it. State the tolerance and its reason in the task's text.
3. In tests/test_exercises.py, add the exercise's broken versions to BROKEN: text replacements of the
   solution that remove the bounds guard, write to the wrong element, and (where it has one) remove a
   __syncthreads(); "nothing written" is derived for every exercise. The tests fail for an exercise
   without them. Each replaced text must occur exactly once in the solution. The missing-barrier case is
   asserted on the CPU only: on a GPU a race may not bite.

What a check does, at each size in order, stopping at the first problem:
  - every Output is filled with a NaN of its own bits (integers: SENTINEL) and followed by a guard region of
    the same, every Input by a guard of plain NaN; the kernel gets the arrays' first elements only, so a
    write past the end lands in the guard (a GPU cannot tell; the guard can);
  - on the CPU the launch runs under the executor's bounds and race checks (gpt2_cupy.cpu.checks), whose
    first report is translated into the learner's words, thread and block included;
  - then: a guard written ("out[1000] was written, past the end of out"), an element never written, or the
    first element off the reference by more than atol + rtol * |expected|, with its index and both values.
Every verdict depends on the source and the exercise only, never on the machine's numbers, so the stored
verdict of a skeleton reads the same on a GPU and on the CPU. Only the CPU can name a thread that reads
past an end or races; on a GPU such a kernel fails on its guard region or its values, or (a race that
happens not to bite) passes.
"""

import re
import zlib
from dataclasses import dataclass
from typing import Callable

import numpy

from gpt2_cupy import backend

SENTINEL = -123456789  # what an integer output holds before the launch: a value no exercise computes
# What a float32 output and its guard hold before the launch: a NaN with bits of its own, so that a NaN a
# kernel computes (a GPU writes 0x7FFFFFFF) or copies from an input (numpy's 0x7FC00000) counts as written.
UNWRITTEN_FLOAT32_BITS = 0x7FC5EA1F
GUARD_ELEMENTS = 1024  # at least this many elements after every array (more when the grid has more threads)


@dataclass(frozen=True)
class Output:
    """An array the kernel writes: float32 (or another dtype) of `shape`; `initial`, when given, is what it
    holds before the launch (a kernel that adds into it, as gradients are added), else NaN or SENTINEL."""
    name: str
    shape: tuple
    dtype: type = numpy.float32
    initial: numpy.ndarray = None


@dataclass(frozen=True)
class Input:
    """An array the kernel reads."""
    name: str
    array: numpy.ndarray


@dataclass(frozen=True)
class Scalar:
    """A scalar parameter, a numpy scalar of the parameter's exact type (numpy.int32 for `int`)."""
    name: str
    value: object


@dataclass(frozen=True)
class Exercise:
    """One graded exercise: the kernel the learner writes, how it is launched, and what it must compute."""
    id: str              # "NN.name": the chapter's number, a dot, a short name
    title: str
    kernel: str          # the name of the extern "C" __global__ function the source must define
    arguments: Callable  # (size, numpy Generator) -> [Output | Input | Scalar], in the kernel's parameter order
    launch: Callable     # size -> (grid, block) or (grid, block, shared_mem_bytes)
    reference: Callable  # (**inputs and scalars by name) -> {output name: float64 expected array}
    sizes: tuple         # dicts of named sizes, e.g. {"n": 257}; include ones that are not multiples of the block
    rtol: float          # an element passes when |actual - expected| <= atol + rtol * |expected|
    atol: float = 0.0
    options: tuple = ()  # compiler options, e.g. ("-arch=sm_90a",) for wgmma and TMA

    @property
    def chapter(self):
        return self.id.split(".")[0]

    @property
    def file_name(self):
        """The solution's file under kernels/exercises/, without .cu: "NN_name"."""
        return self.id.replace(".", "_")


@dataclass(frozen=True)
class Result:
    """A check's verdict: passed or not, and the one line that says why."""
    passed: bool
    message: str

    def __str__(self):
        return self.message

    def _ipython_display_(self):
        """Nothing: check() has printed the verdict already, so a notebook cell ending in a check shows it once."""


def blocks(count, per_block):
    """ceil(count / per_block): the blocks that cover `count` elements or rows."""
    return (count + per_block - 1) // per_block


def seed_of(exercise_id):
    """The exercise's random seed: the same inputs on every machine and at every check."""
    return zlib.crc32(exercise_id.encode())


def run_check(exercise, source):
    """The Result of `source` on `exercise` (printing nothing)."""
    if not isinstance(source, str):
        raise TypeError(f"{exercise.id}: source must be the kernel's CUDA C as a str (the string you would give "
                        f"RawKernel), got {type(source).__name__}")
    problem = _signature_problem(exercise, source)
    if problem:
        return Result(False, f"{exercise.id}: {problem}")
    try:
        kernel = backend.RawKernel(source, exercise.kernel, options=exercise.options)
        kernel.compile()
    except Exception as error:  # NVRTC's CompileException on a GPU, the executor's CompileError on the CPU
        return Result(False, f"{exercise.id}: the kernel does not compile: {_first_compiler_error(str(error))}")
    rng = numpy.random.default_rng(seed_of(exercise.id))
    for size in exercise.sizes:
        problem = _problem_at_size(exercise, kernel, source, size, rng)
        if problem:
            return Result(False, f"{exercise.id}: failed at {_describe_size(size)}: {problem}")
    sizes = "; ".join(_describe_size(size) for size in exercise.sizes)
    return Result(True, f"{exercise.id}: passed at {sizes} (each element within {_describe_tolerance(exercise)} "
                        "of the float64 reference)")


# ---- before the launch: the source's kernel and its parameters -------------------------------------------

def _signature_problem(exercise, source):
    """A sentence when the source lacks the kernel or gives it the wrong number of parameters, else ''."""
    name = re.escape(exercise.kernel)
    found = re.search(r'(?:extern\s+"C"\s+__global__|__global__\s+extern\s+"C")\s+void\s+'
                      r"(?:__launch_bounds__\s*\([^)]*\)\s*)?" + name + r"\s*\(([^)]*)\)", _without_comments(source))
    if not found:
        return f'the source defines no kernel `extern "C" __global__ void {exercise.kernel}(...)`'
    parameters = [p for p in found.group(1).split(",") if p.strip() and p.strip() != "void"]
    wanted = exercise.arguments(exercise.sizes[0], numpy.random.default_rng(0))
    if len(parameters) != len(wanted):
        names = ", ".join(argument.name for argument in wanted)
        return (f"{exercise.kernel} has {len(parameters)} parameters, but the exercise passes {len(wanted)}: "
                f"({names})")
    return ""


def _without_comments(source):
    return re.sub(r"/\*.*?\*/|//[^\n]*", " ", source, flags=re.S)


def _first_compiler_error(log):
    """'line 5: ...' from a compiler's log: NVRTC writes `(5): error: ...`, g++ `kernel.cu:5:12: error: ...`."""
    for line in log.splitlines():
        found = re.search(r"\((\d+)\): (?:catastrophic )?error: (.*)", line) or \
            re.search(r"\.cu:(\d+):\d+: (?:fatal )?error: (.*)", line)
        if found:
            return f"line {found.group(1)}: {found.group(2).strip()}"
    lines = [line.strip() for line in log.splitlines() if "error" in line.lower()]
    return lines[0] if lines else log.strip().splitlines()[0]


# ---- one size: launch, then compare ----------------------------------------------------------------------

def _problem_at_size(exercise, kernel, source, size, rng):
    arguments = exercise.arguments(size, rng)
    launch = exercise.launch(size)
    grid, block = launch[0], launch[1]
    shared_mem = launch[2] if len(launch) > 2 else 0
    threads = int(numpy.prod(grid)) * int(numpy.prod(block))
    guard = max(GUARD_ELEMENTS, threads)
    buffers, values, copies = {}, [], []
    for argument in arguments:
        if isinstance(argument, Scalar):
            values.append(argument.value)
            continue
        host = _guarded(argument, guard)
        device = backend.xp.asarray(host)
        count = host.size - guard
        # On the CPU the kernel gets an allocation of exactly its elements: a view's whole allocation is
        # memory a GPU may touch, so the executor's bounds check sees only an allocation's end. On a GPU the
        # view is given, and the guard region after it catches a stray write.
        given = device[:count]
        if not backend.ON_GPU:
            given = given.copy()
            copies.append((device[:count], given))  # copied back into the guarded buffer after the launch
        buffers[argument.name] = (argument, device, count)
        values.append(given.reshape(_shape_of(argument)))
    try:
        with backend.checks(bounds=True, races=True):
            kernel(tuple(grid), tuple(block), tuple(values), shared_mem=shared_mem)
        backend.synchronize()
    except Exception as error:
        return _executor_report(error, source)
    for view, given in copies:
        view[...] = given
    named = {a.name: (a.array if isinstance(a, Input) else a.value) for a in arguments if not isinstance(a, Output)}
    named.update({a.name: a.initial for a in arguments if isinstance(a, Output) and a.initial is not None})
    expected = exercise.reference(**named)
    for argument in arguments:
        if isinstance(argument, Input):
            continue
        if isinstance(argument, Output):
            _, device, count = buffers[argument.name]
            problem = _output_problem(exercise, argument, backend.asnumpy(device), count, expected[argument.name])
            if problem:
                return problem
    for argument in arguments:
        if isinstance(argument, Input):
            _, device, count = buffers[argument.name]
            if not numpy.array_equal(backend.asnumpy(device)[:count], argument.array.ravel(), equal_nan=True):
                return f"the input {argument.name} was changed: a kernel must only read its inputs"
    return ""


def _shape_of(argument):
    return argument.array.shape if isinstance(argument, Input) else tuple(argument.shape)


def _guarded(argument, guard):
    """The argument's elements, then `guard` more: plain NaN after an input, _unwritten after an output."""
    if isinstance(argument, Input):
        dtype = argument.array.dtype
        filler = numpy.full(guard, numpy.nan if dtype.kind == "f" else _integer_filler(dtype), dtype=dtype)
        return numpy.concatenate([argument.array.ravel(), filler])
    dtype = numpy.dtype(argument.dtype)
    count = int(numpy.prod(argument.shape))
    flat = (numpy.asarray(argument.initial, dtype=dtype).ravel() if argument.initial is not None
            else _unwritten(count, dtype))
    return numpy.concatenate([flat, _unwritten(guard, dtype)])


def _integer_filler(dtype):
    """SENTINEL where the integer type holds it; else its largest value (for uint16 bf16 bits: a NaN)."""
    information = numpy.iinfo(dtype)
    return SENTINEL if information.min <= SENTINEL <= information.max else information.max


def _unwritten(count, dtype):
    """`count` elements of what an output holds before the launch."""
    if dtype == numpy.float32:
        return numpy.full(count, UNWRITTEN_FLOAT32_BITS, dtype=numpy.uint32).view(numpy.float32)
    return numpy.full(count, numpy.nan if dtype.kind == "f" else SENTINEL, dtype=dtype)


def _still_unwritten(values, dtype):
    """Where `values` hold, bit for bit, what _unwritten put there."""
    unsigned = numpy.dtype(f"u{dtype.itemsize}")
    return values.view(unsigned) == _unwritten(1, dtype).view(unsigned)[0]


def _describe_unwritten(dtype):
    return "NaN" if numpy.dtype(dtype).kind == "f" else str(SENTINEL)


def _output_problem(exercise, argument, whole, count, expected):
    """What is wrong with one output (its `count` elements, then the guard), or ''."""
    name, dtype = argument.name, numpy.dtype(argument.dtype)
    guard = whole[count:]
    written = numpy.flatnonzero(~_still_unwritten(guard, dtype))
    if written.size:
        return (f"{name}[{count + int(written[0])}] was written, past the end of {name} ({_extent(count)}): a "
                "thread whose index lies past the end must do nothing. Is the bounds check missing?")
    actual = whole[:count].astype(numpy.float64)
    expected = numpy.asarray(expected, dtype=numpy.float64).ravel()
    if argument.initial is not None:
        before = numpy.asarray(argument.initial, dtype=dtype).ravel()
        if numpy.array_equal(whole[:count], before) and not numpy.array_equal(expected, before):
            return (f"{name} was never written: every element still holds what it held before the launch (the "
                    f"kernel adds into {name}: `+=`)")
    else:
        never = numpy.flatnonzero(_still_unwritten(whole[:count], dtype))
        if never.size == count:
            every = "its only element still holds" if count == 1 else f"all {count} of its elements still hold"
            return f"{name} was never written: {every} the {_describe_unwritten(dtype)} it held before the launch"
        if never.size:
            others = f", nor were {never.size - 1} other elements" if never.size > 1 else ""
            return (f"{name}{_index(argument, int(never[0]))} was never written (it still holds the "
                    f"{_describe_unwritten(dtype)} it held before the launch){others}")
    with numpy.errstate(invalid="ignore"):
        wrong = ~(numpy.abs(actual - expected) <= exercise.atol + exercise.rtol * numpy.abs(expected))
    wrong &= ~(numpy.isnan(actual) & numpy.isnan(expected))
    if wrong.any():
        first = int(numpy.flatnonzero(wrong)[0])
        return (f"{name}{_index(argument, first)} is {_number(actual[first])}, expected {_number(expected[first])} "
                f"({int(wrong.sum())} of {count} elements are off by more than {_describe_tolerance(exercise)})")
    return ""


def _index(argument, flat):
    """'[37]', or '[2, 5]' for a two-dimensional output."""
    shape = tuple(argument.shape)
    return f"[{', '.join(map(str, numpy.unravel_index(flat, shape)))}]" if len(shape) > 1 else f"[{flat}]"


def _extent(count):
    return f"it has {count} element{'s' if count != 1 else ''}, valid indices 0..{count - 1}"


def _number(value):
    return "NaN" if numpy.isnan(value) else f"{value:.6g}"


def _describe_tolerance(exercise):
    parts = [f"{exercise.rtol:.3g} relative"] if exercise.rtol else []
    parts += [f"{exercise.atol:.3g} absolute"] if exercise.atol else []
    return " + ".join(parts) if parts else "0 (exactly equal)"


def _describe_size(size):
    return ", ".join(f"{name} = {value}" for name, value in size.items())


# ---- the CPU executor's reports, in the learner's words ------------------------------------------------

_OUT_OF_BOUNDS = re.compile(r"block \(([\d, ]+)\), thread \(([\d, ]+)\): out-of-bounds (read|write|access) of "
                            r"'(\w+)' at element (-?\d+); it has (\d+) elements")
_OUT_OF_BOUNDS_AFTER = re.compile(r"out-of-bounds write of '(\w+)' at element (-?\d+); it has (\d+) elements")
_THREAD = r"[Tt]hread \(([\d, ]+)\) of block \(([\d, ]+)\)"
_RACE_WRITE_READ = re.compile(_THREAD + r" (writes|reads) it and " + _THREAD + r" (reads|writes) it")
_RACE_PLACE = re.compile(r"race on ('(\w+)' element (\d+)|shared memory)")


def _executor_report(error, source):
    """A failed launch in the learner's words: the CPU executor's bounds and race reports, else its message."""
    message = str(error)
    found = _OUT_OF_BOUNDS.search(message)
    if found:
        block, thread, access, array, element, size = found.groups()
        element, size = int(element), int(size)
        where = "before the start" if element < 0 else ("one past its end" if element == size else "past its end")
        access = {"read": "read", "write": "wrote", "access": "touched"}[access]
        return (f"thread {_coordinates(thread)} of block {_coordinates(block)} {access} {array}[{element}], {where} "
                f"({_extent(size)}). Is the bounds check missing or wrong?")
    found = _OUT_OF_BOUNDS_AFTER.search(message)
    if found:
        array, element, size = found.groups()
        return (f"{array}[{element}] was written, past the end of {array} ({_extent(int(size))}): a thread whose "
                "index lies past the end must do nothing. Is the bounds check missing?")
    if "race" in message:
        return _race_report(message, source)
    without_kernel_name = re.sub(r"^kernel '\w+',? ?", "", message)
    return f"the kernel failed: {without_kernel_name.splitlines()[0]}"


def _race_report(message, source):
    place = _RACE_PLACE.search(message)
    if place and place.group(2):
        what = f"{place.group(2)}[{place.group(3)}]"
    else:
        shared = re.findall(r"__shared__\s+[\w\s]*?(\w+)\s*\[", _without_comments(source))
        what = (f"`{shared[0]}`" if len(shared) == 1 else
                f"shared memory ({' or '.join(f'`{name}`' for name in shared)})" if shared else "shared memory")
    pair = _RACE_WRITE_READ.search(message)
    if pair:
        thread1, block1, verb1, thread2, block2, _ = pair.groups()
        writer, reader = ((thread1, block1), (thread2, block2)) if verb1 == "writes" else ((thread2, block2), (thread1, block1))
        return (f"a race on {what}: thread {_coordinates(writer[0])} of block {_coordinates(writer[1])} writes it "
                f"and thread {_coordinates(reader[0])} of block {_coordinates(reader[1])} reads it with nothing "
                "between them to order the two: a __syncthreads() is missing between the writes and the reads")
    if "read-modify-write" in message:
        return (f"a race on {what}: several threads read it and write it back with no atomic operation, so "
                "updates are lost. Use atomicAdd, or give each thread an element of its own")
    if "both write it" in message:
        return (f"a race on {what}: two threads write it between the same barriers, so which value stays is "
                "left to chance. Let one thread write each element")
    return f"a race on {what}: {message.split(': ', 2)[-1].splitlines()[0]}"


def _coordinates(text):
    """'37' for (37, 0, 0), '(3, 1)' for (3, 1, 0): as many coordinates as are not trailing zeros."""
    values = [int(v) for v in text.split(",")]
    while len(values) > 1 and values[-1] == 0:
        values.pop()
    return str(values[0]) if len(values) == 1 else f"({', '.join(map(str, values))})"
