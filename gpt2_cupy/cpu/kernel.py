"""RawKernel and RawModule for the CPU executor, called exactly like CuPy's.

    kernel = RawKernel(code, "vector_add")
    kernel((blocks,), (threads,), (a, b, out, numpy.int32(n)))

A call checks the launch configuration and every argument against the kernel's parameter list (which
the compiler reports, so the check cannot drift from the source), packs the arguments and runs the
kernel to the end. Errors name what is wrong in the learner's terms.
"""

import ctypes
import re
import struct
import sys

import numpy

from . import checked_launch, checks, runtime, source, toolchain
from .errors import CompileError, KernelError, KernelNotFoundError, LaunchError, OutOfBoundsError, RaceError

# What a launch raises about the learner's kernel or call (as opposed to a bug of the executor).
LEARNER_ERRORS = (CompileError, KernelError, KernelNotFoundError, LaunchError, TypeError, ValueError)

# A GPU's limits (compute capability 9.0, H100), which a launch here must respect too.
MAX_BLOCK_DIMENSIONS = (1024, 1024, 64)
MAX_GRID_DIMENSIONS = (2**31 - 1, 65535, 65535)
DEFAULT_DYNAMIC_SHARED_BYTES = 48 * 1024
MAX_DYNAMIC_SHARED_BYTES = 227 * 1024
STATIC_SHARED_LIMIT_BYTES = 48 * 1024
# The __shared__ variables of all a module's functions lie below a block's dynamic shared memory, in a window
# of runtime.cpp's (shared_arena_bytes: 4 MiB) that holds them, the dynamic memory and the room after it.
MODULE_SHARED_LIMIT_BYTES = 1024 * 1024
DYNAMIC_SHARED_ALIGNMENT = 128  # runtime.cpp's dynamic_shared_alignment
# A GPU gives a block its shared memory (__shared__ variables and dynamic memory together) in whole units of this
# many bytes: a read past the last array that stays inside the last unit does not fault. On an H100, 8 floats of
# __shared__ read up to their 32nd float run on, and 128 bytes of dynamic memory read at byte 128 stop the kernel
# (tests/test_conformance_shared_bounds.py).
SHARED_ALLOCATION_BYTES = 128
# Below a block's own shared memory an H100 keeps 1 KiB for the system, inside the block's window: a read a little
# before the first array does not fault there.
RESERVED_SHARED_BYTES = 1024

_C_NAMES = {("i", 1): "signed char", ("u", 1): "unsigned char", ("i", 2): "short", ("u", 2): "unsigned short",
            ("i", 4): "int", ("u", 4): "unsigned int", ("i", 8): "long long", ("u", 8): "unsigned long long",
            ("f", 2): "__half", ("f", 4): "float", ("f", 8): "double", ("b", 1): "bool", ("v", 0): "void"}
_NUMPY_TYPES = {("i", 1): numpy.int8, ("u", 1): numpy.uint8, ("i", 2): numpy.int16, ("u", 2): numpy.uint16,
                ("i", 4): numpy.int32, ("u", 4): numpy.uint32, ("i", 8): numpy.int64, ("u", 8): numpy.uint64,
                ("f", 2): numpy.float16, ("f", 4): numpy.float32, ("f", 8): numpy.float64, ("b", 1): numpy.bool_}
_BF16_TYPES = ("__nv_bfloat16", "nv_bfloat16")  # <cuda_bf16.h>'s element type: two bytes, seen as unsigned
_STRUCT_CODES = {("i", 1): "b", ("u", 1): "B", ("i", 2): "h", ("u", 2): "H", ("i", 4): "i", ("u", 4): "I",
                 ("i", 8): "q", ("u", 8): "Q", ("f", 2): "e", ("f", 4): "f", ("f", 8): "d", ("b", 1): "?"}


_ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth")


def ordinal(index):
    """'first' for 0, 'second' for 1, ...: how a person counts a kernel's arguments."""
    if index < len(_ORDINALS):
        return _ORDINALS[index]
    suffix = "th" if 10 <= (index + 1) % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get((index + 1) % 10, "th")
    return f"{index + 1}{suffix}"


def with_article(noun):
    """'an int', 'a float': the article a noun takes."""
    return ("an " if noun[:1].lower() in "aeiou" else "a ") + noun


def _compiler_type_name(described):
    """The parameter's type as the compiler spelled it (`const float*`), from `... [with T = const float*]`."""
    text = (described.type_name or b"").decode(errors="replace")
    start = text.find("T = ")
    if start < 0:
        return None
    name = text[start + 4:]
    for end in (";", "]"):
        if end in name:
            name = name[:name.rindex(end)] if end == "]" else name[:name.index(end)]
    return name.strip().replace(" *", "*") or None


class Parameter:
    """One kernel parameter: its name in the source, its C type, and what a call may pass for it."""

    def __init__(self, name, described):
        self.name = name
        self.kind = described.kind.decode()
        self.element = (described.element_kind.decode(), described.element_size)
        self.is_pointer = self.kind == "p"
        self.is_by_value_struct = self.kind == "s"
        self.size = described.size
        self.alignment = max(1, described.alignment)
        self.c_type = _compiler_type_name(described) or (
            _C_NAMES.get(self.element, "struct") + ("*" if self.is_pointer else ""))
        if self.is_pointer:
            self.struct_code = "Q"
        elif self.is_by_value_struct:
            self.struct_code = f"{self.size}s"  # a struct, vector type by value: its bytes
        elif (self.kind, self.size) in _STRUCT_CODES:
            self.struct_code = _STRUCT_CODES[(self.kind, self.size)]
        else:  # a scalar type with no struct code: passed by its bytes, like a struct
            self.is_by_value_struct = True
            self.struct_code = f"{self.size}s"
        self.numpy_type = _NUMPY_TYPES.get(self.element) if not self.is_by_value_struct else None
        self._accepted_dtypes = {}

    def accepts_dtype(self, dtype):
        """Whether an array of this dtype may be passed for this pointer parameter."""
        accepted = self._accepted_dtypes.get(dtype)
        if accepted is None:
            accepted = self._accepted_dtypes[dtype] = self._element_matches(dtype)
        return accepted

    def _element_matches(self, dtype):
        kind, size = self.element
        if kind == "v" or (kind in "iu" and size == 1):
            return True  # void* and char*: raw bytes of anything
        if self._pointee() in _BF16_TYPES:
            # bf16 elements: an array of bfloat16 (ml_dtypes'), or of uint16 holding the same bits
            return dtype.itemsize == 2 and dtype.name in ("bfloat16", "uint16")
        dtype_kind = {"i": "i", "u": "i", "f": "f", "b": "b"}.get(dtype.kind)
        return dtype.itemsize == size and dtype_kind == {"i": "i", "u": "i", "f": "f", "b": "b", "s": None}.get(kind)


    def _pointee(self):
        """The pointed-at type's name without const or volatile: `__nv_bfloat16` for `const __nv_bfloat16*`."""
        words = self.c_type.rstrip("* ").replace("*", " ").split()
        return " ".join(word for word in words if word not in ("const", "volatile", "__restrict__"))


def _argument_layout(parameters):
    """The struct format of the packed arguments: laid out as a C struct of the parameters would be."""
    layout, end = "=", 0
    for parameter in parameters:
        padding = -end % parameter.alignment
        layout += "x" * padding + parameter.struct_code
        end += padding + parameter.size
    return layout


class Function:
    """A compiled kernel, launched like CuPy's: function(grid, block, args, shared_mem=0)."""

    def __init__(self, name, signature, entry_address, entry, static_shared_bytes=0, shared_layout=(),
                 module_kernels=(), code=""):
        self.name = name
        self.max_threads_per_block = signature.max_threads_per_block if signature else 1024
        self.static_shared_bytes = static_shared_bytes
        # its module's __shared__ declarations (runtime.shared_layout), and the kernel's own placement of those it
        # can reach, which its launches use (the race check's build keeps the module's)
        self.module_shared_layout = list(shared_layout)
        self.shared_layout = _kernel_shared_layout(self.module_shared_layout, name, module_kernels, code)
        self._shared_placement, self._bytes_below_window = _launch_placement(self.module_shared_layout,
                                                                             self.shared_layout)
        # What a GPU reports for a kernel until it is raised: the 48 KiB a block gets, less its __shared__ arrays.
        self._max_dynamic_shared_size_bytes = DEFAULT_DYNAMIC_SHARED_BYTES - static_shared_bytes
        names = signature.parameter_names if signature else []
        self.parameters = [Parameter(names[i] if i < len(names) else f"argument {i}", entry.parameters[i])
                           for i in range(entry.parameter_count)]
        self._entry_address = entry_address
        self._pack = struct.Struct(_argument_layout(self.parameters)).pack
        # The entry of the same kernel built for the race check (set by RawModule.get_function).
        self.race_check_entry_address = lambda: None

    @property
    def max_dynamic_shared_size_bytes(self):
        return self._max_dynamic_shared_size_bytes

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value):
        most = MAX_DYNAMIC_SHARED_BYTES - self.static_shared_bytes
        if not 0 <= int(value) <= most:
            static = f" besides its {self.static_shared_bytes} bytes of __shared__ arrays" if self.static_shared_bytes else ""
            raise LaunchError(f"kernel '{self.name}': max_dynamic_shared_size_bytes={value}, but a block may have at "
                              f"most {most} bytes of dynamic shared memory{static} (227 KiB in all)")
        self._max_dynamic_shared_size_bytes = int(value)

    def __call__(self, grid, block, args, shared_mem=0, *, check_bounds=None, check_races=None):
        try:
            self._call(grid, block, args, shared_mem, check_bounds, check_races)
        except LEARNER_ERRORS as error:
            # Raised afresh here, so that the traceback shows the learner's launch, then the message,
            # rather than the executor's insides.
            raise error.with_traceback(None) from None

    def _call(self, grid, block, args, shared_mem, check_bounds, check_races):
        grid = self._dimensions("grid", grid, MAX_GRID_DIMENSIONS)
        block = self._dimensions("block", block, MAX_BLOCK_DIMENSIONS)
        self._check_launch(block, shared_mem)
        args = tuple(args) if isinstance(args, (tuple, list)) else None
        if args is None:
            raise TypeError(f"kernel '{self.name}': args must be a tuple of arrays and scalars")
        values = self._argument_values(args)
        bounds, races = checks.wanted(check_bounds, check_races)
        if not (bounds or races):
            self._raise_for(self._launch(grid, block, values, shared_mem=shared_mem))
            return
        arrays = [(i, a) for i, a in enumerate(args) if self.parameters[i].is_pointer and isinstance(a, numpy.ndarray)]
        checked_launch.launch_checked(self, grid, block, values, arrays, bounds, races, shared_mem)

    # ---- checking a launch ---------------------------------------------------------------------------
    def _dimensions(self, what, value, limits):
        # CuPy takes only tuples here; accepting more would let code run on the CPU and fail on a GPU.
        if not isinstance(value, tuple):
            raise TypeError(f"kernel '{self.name}': {what} must be a tuple such as (n,) or (x, y), got "
                            f"{type(value).__name__} {value!r} (CuPy refuses anything else)")
        if not 1 <= len(value) <= 3:
            raise LaunchError(f"kernel '{self.name}': {what} must have 1 to 3 dimensions, got {value!r}")
        for size in value:
            if not isinstance(size, (int, numpy.integer)) or isinstance(size, bool):
                raise TypeError(f"kernel '{self.name}': {what} sizes must be integers, got {type(size).__name__} "
                                f"{size!r} in {value!r} (CuPy refuses it too: use // rather than /)")
        value = tuple(int(v) for v in value) + (1,) * (3 - len(value))
        # CuPy launches max(1, n) blocks and threads along each axis, so `(n + 255) // 256` blocks with n = 0
        # runs one block, and a block of 0 threads runs one thread.
        value = tuple(max(1, size) for size in value)
        for axis, (size, limit) in enumerate(zip(value, limits)):
            if not 1 <= size <= limit:
                raise LaunchError(f"kernel '{self.name}': {what} size {size} along {'xyz'[axis]} is outside "
                                  f"1..{limit}, so a GPU would refuse this launch")
        return value

    def _check_launch(self, block, shared_mem):
        threads = block[0] * block[1] * block[2]
        if threads > self.max_threads_per_block:
            why = ("its __launch_bounds__" if self.max_threads_per_block < 1024 else "a block")
            raise LaunchError(f"kernel '{self.name}': a block of {threads} threads ({block[0]}x{block[1]}x{block[2]}), "
                              f"but {why} allows at most {self.max_threads_per_block}; a GPU refuses this launch")
        # As on a GPU: the dynamic shared memory a launch asks for is at most max_dynamic_shared_size_bytes,
        # 48 KiB less the static part unless raised (up to 227 KiB in all).
        limit = self.max_dynamic_shared_size_bytes
        raised = limit != DEFAULT_DYNAMIC_SHARED_BYTES - self.static_shared_bytes
        if not 0 <= int(shared_mem) <= limit:
            hint = (" (raise kernel.max_dynamic_shared_size_bytes to go past 48 KiB, up to 227 KiB)"
                    if not raised and shared_mem + self.static_shared_bytes <= MAX_DYNAMIC_SHARED_BYTES else "")
            static = (f" besides the kernel's {self.static_shared_bytes} bytes of __shared__ arrays"
                      if self.static_shared_bytes else "")
            raise LaunchError(f"kernel '{self.name}': shared_mem={shared_mem} bytes of dynamic shared memory"
                              f"{static}, more than the {limit} a block may have{hint}")

    def _argument_values(self, args):
        """What goes into each 8-byte argument slot, after checking each argument against its parameter."""
        if len(args) != len(self.parameters):
            listed = ", ".join(f"{p.c_type} {p.name}" for p in self.parameters)
            raise TypeError(f"kernel '{self.name}' takes {len(self.parameters)} arguments ({listed}), "
                            f"but the call passed {len(args)}")
        values = []
        for index, (parameter, value) in enumerate(zip(self.parameters, args)):
            if parameter.is_pointer:
                values.append(self._pointer(index, parameter, value))
            elif parameter.is_by_value_struct:
                values.append(self._by_value_struct(index, parameter, value))
            else:
                values.append(self._scalar(index, parameter, value))
        return values

    def _where(self, index, parameter):
        return f"kernel '{self.name}', the {ordinal(index)} argument ('{parameter.c_type} {parameter.name}')"

    def _by_value_struct(self, index, parameter, value):
        """A struct or vector type by value takes a numpy scalar of its size, as CuPy does: its bytes are passed
        (numpy.complex64 for a float2, a scalar of a structured dtype with the struct's layout for others)."""
        if isinstance(value, numpy.generic) and value.dtype.itemsize == parameter.size:
            return value.tobytes()
        got = (f"numpy.{type(value).__name__} of {value.dtype.itemsize} bytes" if isinstance(value, numpy.generic)
               else with_article(type(value).__name__))
        raise TypeError(
            f"{self._where(index, parameter)}: got {got}; a {parameter.c_type} passed by value takes a numpy scalar "
            f"of {parameter.size} bytes laid out like it (numpy.complex64 for a float2, numpy.complex128 for a "
            f"double2, or numpy.zeros((), dtype=numpy.dtype([...]))[()] with the struct's fields)")

    def _pointer(self, index, parameter, value):
        if _is_null_pointer(value):
            return 0
        if value is None:
            raise TypeError(f"{self._where(index, parameter)}: got None, which CuPy does not pass as a null pointer "
                            "(it passes no argument at all). For NULL pass 0, as CuPy takes it")
        if not isinstance(value, numpy.ndarray):
            raise TypeError(f"{self._where(index, parameter)}: expects an array (or 0 for a null pointer), "
                            f"got {type(value).__name__}")
        if not value.flags.c_contiguous:
            raise ValueError(f"{self._where(index, parameter)}: the array is not C-contiguous (a transposed or "
                             "sliced view?); a kernel indexes raw memory, so pass numpy.ascontiguousarray(...)")
        if not parameter.accepts_dtype(value.dtype):
            raise TypeError(f"{self._where(index, parameter)}: got an array of {value.dtype}; its elements would "
                            f"be read as {parameter.c_type.rstrip('* ')} and give garbage (on a GPU, silently)")
        return value.__array_interface__["data"][0]

    def _scalar(self, index, parameter, value):
        expected = parameter.numpy_type
        if type(value) is expected:
            return value
        if (isinstance(value, numpy.integer) and parameter.kind in "iu"
                and value.dtype.itemsize == parameter.size):
            return value.view(expected)  # numpy.int32 for an unsigned int: CuPy passes its bits
        if isinstance(value, bool) and expected is numpy.bool_:
            return value
        if type(value) is int and expected in (numpy.int64, numpy.uint64):
            return value
        if type(value) is float and expected is numpy.float64:
            return value
        if (type(value) is int or isinstance(value, numpy.integer)) and parameter.kind in "iu":
            what = "a Python int" if type(value) is int else f"numpy.{type(value).__name__}"
            bits = 64 if type(value) is int else 8 * value.dtype.itemsize
            raise TypeError(
                f"{self._where(index, parameter)}: got {what}. CuPy passes it as a {bits}-bit "
                f"integer, of which {with_article(parameter.c_type)} parameter reads the first {parameter.size} bytes: "
                f"right while the value fits, by the luck of byte order, and never checked. Say what the kernel "
                f"takes: numpy.{expected.__name__}(...)")
        if type(value) is int:
            got = "a Python int, which CuPy passes as a 64-bit integer (long long)"
        elif type(value) is float:
            got = "a Python float, which CuPy passes as a 64-bit double"
        elif isinstance(value, numpy.ndarray):
            got = f"an array of shape {value.shape}"
        elif isinstance(value, numpy.generic):
            got = f"numpy.{type(value).__name__}"
        else:
            got = type(value).__name__
        fix = f"; pass numpy.{expected.__name__}(...)" if expected is not None else ""
        raise TypeError(f"{self._where(index, parameter)}: got {got}, which does not match the parameter's type "
                        f"{parameter.c_type}: the kernel would read its bytes as garbage{fix}")

    # ---- launching -----------------------------------------------------------------------------------
    def _launch(self, grid, block, values, reverse_order=False, show_output=True, track_races=False, global_ranges=(),
                shared_mem=None, unchecked_alignment=False, shared_against_lower_guard=False):
        """track_races: run the build whose every memory access is checked (see checked_launch);
        shared_mem: the launch's dynamic shared memory in bytes (None: as much as a block may have);
        unchecked_alignment: run that build without tracking, for its lack of alignment checks (the bounds
        check's pass on arrays moved off their alignment);
        shared_against_lower_guard: the block's shared memory starts against an inaccessible guard rather than
        ending against one (the bounds check's pass with arrays against the guards below them)."""
        race_build = track_races or unchecked_alignment
        entry_address = (self.race_check_entry_address() if race_build else None) or self._entry_address
        track_races = track_races and entry_address != self._entry_address
        # (the race check's build is another library, whose declarations need not register in the same order)
        own = entry_address == self._entry_address
        layout = self.shared_layout if own else self.module_shared_layout
        result, output = runtime.launch(entry_address, self._pack(*values), grid, block, reverse_order, track_races,
                                        global_ranges, shared_mem, _shared_slack_bytes(layout, shared_mem),
                                        _dynamic_offset_above_lower_guard(layout, shared_mem) +
                                        (self._bytes_below_window if own else 0)
                                        if shared_against_lower_guard else None,
                                        self._shared_placement if own else None)
        if output and show_output:
            sys.stdout.write(output)
            sys.stdout.flush()
        return result

    def _raise_for(self, result, locate=None, bounds_checked=False):
        """The Python exception for a failed launch. locate(address) -> (index, array, element) or None
        says which array argument a faulting address ran off (the bounds check's guard pages)."""
        if result.failure == runtime.OK:
            return
        if result.failure == runtime.INTERRUPTED:
            raise KeyboardInterrupt(f"kernel '{self.name}' was interrupted; its outputs are incomplete")
        where = f"block ({', '.join(map(str, result.block))}), thread ({', '.join(map(str, result.thread))})"
        message = result.message.decode(errors="replace")
        found = locate(result.fault_address) if result.failure == runtime.MEMORY_FAULT and locate else None
        if found:
            index, array, element = found
            access = {1: "write", 0: "read"}.get(result.fault_is_write, "access")
            raise OutOfBoundsError(
                f"kernel '{self.name}', {where}: out-of-bounds {access} of '{self.parameters[index].name}' at "
                f"element {element}; {_valid_indices(array)}")
        overrun = runtime.shared_overrun(result.fault_address) if result.failure == runtime.MEMORY_FAULT else None
        if overrun:
            access = {1: "write", 0: "read"}.get(result.fault_is_write, "access")
            raise OutOfBoundsError(f"kernel '{self.name}', {where}: out-of-bounds {access} of shared memory, "
                                   f"{_shared_overrun_message(self.shared_layout, *overrun)}")
        if result.failure == runtime.ASSERTION_FAILED:
            raise KernelError(f"kernel '{self.name}', {where}: {message}")
        if result.failure == runtime.UNDEFINED_SHUFFLE:
            raise RaceError(f"kernel '{self.name}', {where}: {message}")
        if result.failure == runtime.MEMORY_FAULT and bounds_checked:
            raise KernelError(f"kernel '{self.name}', {where}: {message}; it is in no array argument's reach "
                              "(2^32 elements either side): a pointer not from the arguments, or uninitialised?")
        if result.failure == runtime.MEMORY_FAULT:
            raise KernelError(f"kernel '{self.name}', {where}: {message}. Run with the bounds check on "
                              "(check_bounds=True, or `with backend.checks(bounds=True):`) to learn which array")
        raise KernelError(f"kernel '{self.name}', {where}: {message}")

    def _with_addresses(self, values, addresses):
        """The argument values with the pointers of some array parameters replaced."""
        replaced = list(values)
        for index, address in addresses.items():
            replaced[index] = address
        return replaced


def _valid_indices(array):
    """What an array argument's indices may be, in words: those of its elements, and for a view those of the
    allocation around it, which a GPU reads without a fault too."""
    start, end = checked_launch.allocation_of(array)
    itemsize = max(array.itemsize, 1)
    first, last = (start - array.ctypes.data) // itemsize, (end - array.ctypes.data) // itemsize - 1
    if (first, last) == (0, array.size - 1):
        return f"it has {array.size} elements ({array.dtype}, valid indices 0..{array.size - 1})"
    return (f"it has {array.size} elements ({array.dtype}) and is a view into an allocation of "
            f"{(end - start) // itemsize}, so the valid indices are {first}..{last}")


def _is_null_pointer(value):
    """What CuPy passes as a null pointer: an integer 0 of 8 bytes (a Python int becomes a numpy.int64)."""
    if isinstance(value, bool) or isinstance(value, numpy.bool_):
        return False
    if isinstance(value, int):
        return value == 0
    return isinstance(value, numpy.integer) and value.dtype.itemsize == 8 and value == 0


def _kernel_library(code, prepared, options, entry_expressions, what, for_race_check=False):
    unit = source.translation_unit(prepared, entry_expressions)
    flags = source.compiler_flags(options)
    library = toolchain.build_kernel(unit, flags, lambda log: source.describe_compile_failure(log, code, what),
                                     for_race_check)
    loaded = ctypes.CDLL(str(library))
    return loaded, runtime.shared_layout(loaded)


# Where cuda_builtins.h's SharedDeclaration says a declaration lies: the __PRETTY_FUNCTION__ of a member of its local
# struct, "static constexpr const char* row_sums(float*, int)::gpt2cupy_shared_3::where()", with
# " [with T = float]" after it in an instance of a template.
_DECLARING_FUNCTION = re.compile(r".*?\bconst char\* (?P<function>.*)::gpt2cupy_shared_\d+::where\(\)(?P<instance>.*)")


def _declaring_function(place):
    """(the name of the function a __shared__ declaration is in, that function's instance) or (None, None)
    where its description cannot be read."""
    found = _DECLARING_FUNCTION.fullmatch(place.function)
    if found is None:
        return None, None
    name = re.match(r"\s*([A-Za-z_]\w*)\s*(?:<|\()", found.group("function"))
    return (name.group(1) if name else None), found.group("function") + found.group("instance")


def _static_shared_bytes(shared_layout, kernel_name):
    """The bytes of the __shared__ variables declared in a kernel's body (what a GPU counts as its static
    shared memory); those of __device__ functions it calls are not counted here. For a template kernel,
    whose instances cannot be told apart by name here, the largest instance's."""
    base = kernel_name.split("<")[0].strip()
    per_instance = {}
    for place in shared_layout:
        name, instance = _declaring_function(place)
        if name == base:
            per_instance[instance] = per_instance.get(instance, 0) + place.bytes
    return max(per_instance.values(), default=0)


def _function_bodies(code, name):
    """The text of every body of the functions called `name` in code (each definition, overload or template),
    or None where none is found."""
    bodies = []
    for found in re.finditer(rf"\b{re.escape(name)}\s*(?:<[^;{{}}]*?>\s*)?\(", code):
        depth = 0
        for position in range(found.end() - 1, len(code)):          # the parameter list
            depth += {"(": 1, ")": -1}.get(code[position], 0)
            if depth == 0:
                break
        after = re.match(r"[^;{}()]*\{", code[position + 1:])        # qualifiers, then the body's brace
        if after is None:
            continue                                                  # a call or a declaration, not a definition
        start = position + 1 + after.end() - 1
        depth = 0
        for end in range(start, len(code)):
            depth += {"{": 1, "}": -1}.get(code[end], 0)
            if depth == 0:
                bodies.append(code[start:end + 1])
                break
    return bodies or None


def _reachable_functions(code, kernel_base, declaring_names):
    """Which of declaring_names (functions that declare __shared__ variables) the kernel may call, directly or
    through one another: a name written in a body reached. Where a body cannot be found, its name counts as
    reached (an array too many in the window hides an overrun; one too few would report a false one)."""
    reached, pending = {kernel_base}, [kernel_base]
    while pending:
        bodies = _function_bodies(code, pending.pop())
        if bodies is None:
            return set(declaring_names) | reached
        for name in declaring_names - reached:
            if any(re.search(rf"\b{re.escape(name)}\b", body) for body in bodies):
                reached.add(name)
                pending.append(name)
    return reached


def _kernel_shared_layout(shared_layout, kernel_name, module_kernels, code=""):
    """The module's __shared__ declarations a kernel can reach, placed one after another in the module's order:
    those of its own body and those of the functions it may call (never another kernel). A GPU gives a kernel
    only its own variables, so an access past them runs off its shared memory there; with the module's other
    variables beside them here, it would land in theirs and go unseen."""
    base = kernel_name.split("<")[0].strip()
    declared_in = [_declaring_function(place)[0] for place in shared_layout]
    functions = set(declared_in) - {None} - set(module_kernels)
    # (most modules declare no __shared__ outside their kernels: nothing to look for in the source)
    reachable = _reachable_functions(code, base, functions) if code and functions else functions
    placed, end = [], 0
    for place, name in zip(shared_layout, declared_in):
        if name is not None and name != base and (name in module_kernels or name not in reachable):
            continue
        offset = _round_up(end, place.alignment)
        placed.append(place._replace(offset=offset))
        end = offset + place.bytes
    return placed


def _launch_placement(module_layout, kernel_layout):
    """((offsets by declaration index, the kernel's bytes of them), bytes below the window) for runtime.launch.
    The declarations the kernel cannot reach lie below its window, apart from its own: were one reached after
    all (a call the source scan missed), it would neither alias the kernel's arrays nor fault."""
    offsets = (ctypes.c_ulonglong * max(1, len(module_layout)))()
    own = {place.index for place in kernel_layout}
    below = 0
    for place in module_layout:
        if place.index not in own:
            below = _round_up(below + place.bytes, max(place.alignment, 16))
            offsets[place.index] = 2**64 - below
    for place in kernel_layout:
        offsets[place.index] = place.offset
    return (offsets, _shared_total_bytes(kernel_layout)), below


def _shared_slack_bytes(shared_layout, dynamic_bytes):
    """Where the guard after the block's shared memory must lie, past its end, so that only an access no GPU layout
    keeps inside the window faults: the bytes of the __shared__ declarations below the last one (reading past the
    end of the last by fewer bytes may, on a GPU that put it lower, read another), and the rest of the last
    SHARED_ALLOCATION_BYTES unit the block's shared memory is given in. A read that reaches the guard is past the
    end of the window in any order and in any unit."""
    total = _shared_total_bytes(shared_layout) + dynamic_bytes
    rest_of_unit = _round_up(total, SHARED_ALLOCATION_BYTES) - total
    return (shared_layout[-1].offset if shared_layout else 0) + rest_of_unit


def _dynamic_offset_above_lower_guard(shared_layout, dynamic_bytes):
    """Where the dynamic memory starts above the guard below the window, for the window to lie against that guard
    as _shared_slack_bytes has it lie against the guard above: the first __shared__ declaration as many bytes
    above the guard as the others and the system's reserved bytes take (a read that far before it lies before the
    window in any order), all of them below the dynamic memory, aligned as cuda_builtins.h places them."""
    if not shared_layout:
        return RESERVED_SHARED_BYTES
    # cuda_builtins.h starts the declarations at (dynamic memory - total) rounded down to their largest alignment
    alignment = max(max(place.alignment for place in shared_layout), 16)
    total = _shared_total_bytes(shared_layout)
    others = total - shared_layout[0].bytes
    offset = _round_up(others + RESERVED_SHARED_BYTES, alignment) + _round_up(total, alignment)
    # (with dynamic memory, the window is moved up to keep it aligned as a launch's dynamic memory is: 128 bytes)
    return _round_up(offset, DYNAMIC_SHARED_ALIGNMENT) if dynamic_bytes != 0 else offset


def _shared_total_bytes(shared_layout):
    return max((place.offset + place.bytes for place in shared_layout), default=0)


def _round_up(value, multiple):
    return (value + multiple - 1) // multiple * multiple


def _shared_overrun_message(shared_layout, past_end, dynamic_bytes):
    """What a fault past the block's shared memory ran off (before its start, for a negative past_end), in words."""
    if past_end < 0:
        first = f"'{shared_layout[0].names}'" if shared_layout else "the dynamic shared memory"
        return (f"before the start of {first}, the first of the block's shared memory. A GPU stops the kernel there "
                "with an illegal address")
    arrays = ", ".join(f"'{place.names}' ({place.bytes} bytes)" for place in shared_layout)
    static = f"the kernel's __shared__ variables {arrays}" if arrays else "no __shared__ variables"
    dynamic = (f"then the launch's {dynamic_bytes} bytes of dynamic shared memory (extern __shared__, shared_mem)"
               if dynamic_bytes else "no dynamic shared memory (shared_mem=0)")
    last = ("the dynamic shared memory" if dynamic_bytes else f"'{shared_layout[-1].names}'" if shared_layout
            else "shared memory")
    where = "right at the end" if past_end == 0 else f"{past_end} bytes past the end"
    return (f"{where} of {last}, the last of the block's shared memory ({static}; {dynamic}). A GPU stops the "
            "kernel there with an illegal address")


def _entry(library, index):
    get_entry = getattr(library, f"gpt2cupy_entry_{index}")
    get_entry.restype = ctypes.POINTER(runtime.KernelEntry)
    pointer = get_entry()
    return ctypes.cast(pointer, ctypes.c_void_p).value, pointer.contents


class RawModule:
    """Several kernels (and templates, through name_expressions) from one source, like cupy.RawModule."""

    def __init__(self, code=None, options=(), name_expressions=None, **ignored):
        if code is None:
            raise TypeError("RawModule needs code=... (the CPU executor compiles source, not cubin/ptx files)")
        self.code = code
        self.options = tuple(options)
        self.name_expressions = tuple(name_expressions or ())
        self._prepared = None
        self._library = None
        self._race_check_library = None
        self._functions = {}

    @property
    def _source(self):
        """The source after the preprocessor, with the kernels it defines (prepared once, on first need)."""
        if self._prepared is None:
            self._prepared = source.prepare(self.code, self.options)
        return self._prepared

    @property
    def _kernels(self):
        return self._source.kernels

    @property
    def _expressions(self):
        plain = [name for name, kernel in self._kernels.items() if not kernel.is_template]
        return plain + [e for e in self.name_expressions if e not in plain]

    def compile(self, log_stream=None):
        runtime.library()  # kernels resolve their calls into the runtime when loaded
        if self._library is None:
            library, shared_layout = _kernel_library(self.code, self._source, self.options, self._expressions,
                                                     "the module")
            total = _shared_total_bytes(shared_layout)
            if total > MODULE_SHARED_LIMIT_BYTES:
                raise CompileError(f"the module's __shared__ variables take {total} bytes in all, more than the "
                                   f"{MODULE_SHARED_LIMIT_BYTES} the CPU executor lays out for one module: compile "
                                   "its kernels in several modules")
            self._library, self._shared_layout = library, shared_layout
        return self

    def _race_check_entry_address(self, name):
        """The entry of kernel `name` in the module built for the race check (built on first need), or None
        where this compiler cannot build it (the check then compares the outputs of two orders)."""
        if self._race_check_library is None:
            try:
                self._race_check_library, _ = _kernel_library(self.code, self._source, self.options,
                                                              self._expressions, "the module", for_race_check=True)
            except (CompileError, OSError):
                self._race_check_library = False
        if not self._race_check_library:
            return None
        return _entry(self._race_check_library, self._expressions.index(name))[0]

    def get_global(self, name):
        """The memory of a __device__ or __constant__ variable, to fill or read from Python."""
        self.compile()
        try:
            address = ctypes.addressof(ctypes.c_char.in_dll(self._library, name))
        except ValueError:
            raise KernelNotFoundError(f"no __device__ or __constant__ variable '{name}' in the module "
                                      "(declared at file scope, outside any namespace?)") from None
        return GlobalMemory(address, _symbol_size(address), self._library)

    def get_function(self, name):
        if name in self._functions:
            return self._functions[name]
        if name not in self._expressions:
            known = ", ".join(self._expressions) or "none"
            hint = (" (a template kernel is reached through name_expressions=[...] given to RawModule)"
                    if name.split("<")[0] in self._kernels else "")
            raise KernelNotFoundError(f"no kernel '{name}' in the module{hint}; kernels found: {known}")
        self.compile()
        base_name = name.split("<")[0].strip()
        signature = self._kernels.get(base_name)
        if name not in self.name_expressions and not hasattr(self._library, name):
            raise KernelNotFoundError(
                f"kernel '{name}' is not declared extern \"C\", so its compiled name is mangled and CuPy cannot "
                f"find it either: write extern \"C\" __global__ void {name}(...), or pass it in name_expressions")
        address, entry = _entry(self._library, self._expressions.index(name))
        static_shared = _static_shared_bytes(self._shared_layout, name)
        if static_shared > STATIC_SHARED_LIMIT_BYTES:
            raise CompileError(
                f"kernel '{name}' declares {static_shared} bytes of __shared__ arrays, more than the "
                f"{STATIC_SHARED_LIMIT_BYTES} (48 KiB) a kernel may declare statically (ptxas refuses: 'uses too "
                "much shared data'). Beyond 48 KiB, use extern __shared__ (dynamic) memory and raise "
                "max_dynamic_shared_size_bytes")
        function = Function(name, signature, address, entry, static_shared_bytes=static_shared,
                            shared_layout=self._shared_layout, module_kernels=set(self._kernels),
                            code=self._source.body)
        function.race_check_entry_address = lambda: self._race_check_entry_address(name)
        self._functions[name] = function
        return function


class GlobalMemory:
    """A __device__ or __constant__ variable of a compiled module: what CuPy's RawModule.get_global returns
    (a cupy.cuda.MemoryPointer), with the same ways to fill and read it from the host."""

    def __init__(self, address, size, keep_alive):
        self.ptr = address
        self.size = size
        self._library = keep_alive  # the variable lives as long as its library is loaded

    def copy_from_host(self, memory, size):
        ctypes.memmove(self.ptr, _host_address(memory), self._checked(size))

    def copy_to_host(self, memory, size):
        ctypes.memmove(_host_address(memory), self.ptr, self._checked(size))

    def memset(self, value, size):
        ctypes.memset(self.ptr, value, self._checked(size))

    def _checked(self, size):
        if self.size is not None and not 0 <= size <= self.size:
            raise ValueError(f"{size} bytes do not fit the variable's {self.size}")
        return size


def _host_address(memory):
    if isinstance(memory, numpy.ndarray):
        return memory.ctypes.data
    return memory.value if isinstance(memory, ctypes.c_void_p) else int(memory)


def _symbol_size(address):
    """The size in bytes of the variable at address, from the library's symbol table (glibc), or None."""
    try:
        dladdr1 = ctypes.CDLL(None).dladdr1
    except AttributeError:
        return None

    class DlInfo(ctypes.Structure):
        _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                    ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]

    info, symbol = DlInfo(), ctypes.c_void_p()
    dladdr1.argtypes = [ctypes.c_void_p, ctypes.POINTER(DlInfo), ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
    if not dladdr1(address, ctypes.byref(info), ctypes.byref(symbol), 1) or not symbol.value:  # RTLD_DL_SYMENT
        return None
    return ctypes.c_uint64.from_address(symbol.value + 16).value  # Elf64_Sym.st_size


class RawKernel:
    """One kernel from a source string, like cupy.RawKernel; compiled at the first call (or .compile())."""

    def __init__(self, code, name, options=(), **ignored):
        self.code = code
        self.name = name
        self.options = tuple(options)
        self._function = None

    def compile(self, log_stream=None):
        if self._function is None:
            module = RawModule(code=self.code, options=self.options)
            try:
                if self.name not in module._kernels:
                    raise KernelNotFoundError(f"no __global__ function named '{self.name}' in the kernel source")
                self._function = module.get_function(self.name)
            except CompileError as error:
                raise CompileError(str(error).replace("the module", f"kernel '{self.name}'", 1)) from None
        return self._function

    # Like CuPy's, reading or setting the attribute compiles the kernel: the answer depends on its
    # __shared__ arrays.
    @property
    def max_dynamic_shared_size_bytes(self):
        return self.compile().max_dynamic_shared_size_bytes

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value):
        self.compile().max_dynamic_shared_size_bytes = value

    @property
    def max_threads_per_block(self):
        return self.compile().max_threads_per_block

    def __call__(self, grid, block, args, shared_mem=0, **checks_wanted):
        try:
            function = self._function or self.compile()
            function(grid, block, args, shared_mem, **checks_wanted)
        except LEARNER_ERRORS as error:
            raise error.with_traceback(None) from None  # the learner's line first, then the message
