"""RawKernel and RawModule for the CPU executor, called exactly like CuPy's.

    kernel = RawKernel(code, "vector_add")
    kernel((blocks,), (threads,), (a, b, out, numpy.int32(n)))

A call checks the launch configuration and every argument against the kernel's parameter list (which
the compiler reports, so the check cannot drift from the source), packs the arguments and runs the
kernel to the end. Errors name what is wrong in the learner's terms.
"""

import ctypes
import struct
import sys

import numpy

from . import checked_launch, checks, runtime, source, toolchain
from .errors import CompileError, KernelError, KernelNotFoundError, LaunchError, OutOfBoundsError

# A GPU's limits (compute capability 9.0, H100), which a launch here must respect too.
MAX_BLOCK_DIMENSIONS = (1024, 1024, 64)
MAX_GRID_DIMENSIONS = (2**31 - 1, 65535, 65535)
DEFAULT_DYNAMIC_SHARED_BYTES = 48 * 1024
MAX_DYNAMIC_SHARED_BYTES = 227 * 1024

_C_NAMES = {("i", 1): "signed char", ("u", 1): "unsigned char", ("i", 2): "short", ("u", 2): "unsigned short",
            ("i", 4): "int", ("u", 4): "unsigned int", ("i", 8): "long long", ("u", 8): "unsigned long long",
            ("f", 4): "float", ("f", 8): "double", ("b", 1): "bool", ("v", 0): "void"}
_NUMPY_TYPES = {("i", 1): numpy.int8, ("u", 1): numpy.uint8, ("i", 2): numpy.int16, ("u", 2): numpy.uint16,
                ("i", 4): numpy.int32, ("u", 4): numpy.uint32, ("i", 8): numpy.int64, ("u", 8): numpy.uint64,
                ("f", 4): numpy.float32, ("f", 8): numpy.float64, ("b", 1): numpy.bool_}
_STRUCT_CODES = {("i", 1): "b", ("u", 1): "B", ("i", 2): "h", ("u", 2): "H", ("i", 4): "i", ("u", 4): "I",
                 ("i", 8): "q", ("u", 8): "Q", ("f", 4): "f", ("f", 8): "d", ("b", 1): "?"}


class Parameter:
    """One kernel parameter: its name in the source, its C type, and what a call may pass for it."""

    def __init__(self, name, described):
        self.name = name
        self.kind = described.kind.decode()
        self.element = (described.element_kind.decode(), described.element_size)
        self.is_pointer = self.kind == "p"
        self.c_type = _C_NAMES.get(self.element, "a struct") + (" *" if self.is_pointer else "")
        if self.is_pointer:
            self.struct_code = "Q"
        elif (self.kind, described.size) in _STRUCT_CODES:
            self.struct_code = _STRUCT_CODES[(self.kind, described.size)] + "x" * (8 - described.size)
        else:
            self.struct_code = None  # a struct or vector type by value: nothing from Python fits
        self.numpy_type = _NUMPY_TYPES.get(self.element)
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
        dtype_kind = {"i": "i", "u": "i", "f": "f", "b": "b"}.get(dtype.kind)
        return dtype.itemsize == size and dtype_kind == {"i": "i", "u": "i", "f": "f", "b": "b", "s": None}.get(kind)


class Function:
    """A compiled kernel, launched like CuPy's: function(grid, block, args, shared_mem=0)."""

    def __init__(self, name, signature, entry_address, entry):
        self.name = name
        self.max_threads_per_block = signature.max_threads_per_block if signature else 1024
        self.max_dynamic_shared_size_bytes = DEFAULT_DYNAMIC_SHARED_BYTES
        names = signature.parameter_names if signature else []
        self.parameters = [Parameter(names[i] if i < len(names) else f"argument {i}", entry.parameters[i])
                           for i in range(entry.parameter_count)]
        self._entry_address = entry_address
        self._pack = struct.Struct("=" + "".join(p.struct_code or "8x" for p in self.parameters)).pack

    def __call__(self, grid, block, args, shared_mem=0, *, check_bounds=None, check_races=None):
        grid = self._dimensions("grid", grid, MAX_GRID_DIMENSIONS)
        block = self._dimensions("block", block, MAX_BLOCK_DIMENSIONS)
        self._check_launch(block, shared_mem)
        args = tuple(args) if isinstance(args, (tuple, list)) else None
        if args is None:
            raise TypeError(f"kernel '{self.name}': args must be a tuple of arrays and scalars")
        values = self._argument_values(args)
        bounds, races = checks.wanted(check_bounds, check_races)
        if not (bounds or races):
            self._raise_for(self._launch(grid, block, values))
            return
        arrays = [(i, a) for i, a in enumerate(args) if self.parameters[i].is_pointer]
        checked_launch.launch_checked(self, grid, block, values, arrays, bounds, races)

    # ---- checking a launch ---------------------------------------------------------------------------
    def _dimensions(self, what, value, limits):
        # CuPy takes only tuples here; accepting more would let code run on the CPU and fail on a GPU.
        if not isinstance(value, tuple):
            raise TypeError(f"kernel '{self.name}': {what} must be a tuple such as (n,) or (x, y), got "
                            f"{type(value).__name__} {value!r} (CuPy refuses anything else)")
        if not 1 <= len(value) <= 3:
            raise LaunchError(f"kernel '{self.name}': {what} must have 1 to 3 dimensions, got {value!r}")
        value = tuple(int(v) for v in value) + (1,) * (3 - len(value))
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
        limit = min(self.max_dynamic_shared_size_bytes, MAX_DYNAMIC_SHARED_BYTES)
        if not 0 <= int(shared_mem) <= limit:
            hint = (" (raise kernel.max_dynamic_shared_size_bytes to go past 48 KiB, up to 227 KiB)"
                    if limit == DEFAULT_DYNAMIC_SHARED_BYTES and shared_mem <= MAX_DYNAMIC_SHARED_BYTES else "")
            raise LaunchError(f"kernel '{self.name}': shared_mem={shared_mem} bytes of dynamic shared memory, "
                              f"more than the {limit} a block may have{hint}")

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
            elif parameter.struct_code is not None:
                values.append(self._scalar(index, parameter, value))
        return values

    def _where(self, index, parameter):
        return f"kernel '{self.name}', argument {index} ('{parameter.c_type} {parameter.name}')"

    def _pointer(self, index, parameter, value):
        if not isinstance(value, numpy.ndarray):
            raise TypeError(f"{self._where(index, parameter)}: expects an array, got {type(value).__name__}")
        if not value.flags.c_contiguous:
            raise ValueError(f"{self._where(index, parameter)}: the array is not C-contiguous (a transposed or "
                             "sliced view?); a kernel indexes raw memory, so pass numpy.ascontiguousarray(...)")
        if not parameter.accepts_dtype(value.dtype):
            raise TypeError(f"{self._where(index, parameter)}: got an array of {value.dtype}; its elements would "
                            f"be read as {parameter.c_type[:-2]} and give garbage (on a GPU, silently)")
        return value.__array_interface__["data"][0]

    def _scalar(self, index, parameter, value):
        expected = parameter.numpy_type
        if type(value) is expected:
            return value
        if isinstance(value, bool) and expected is numpy.bool_:
            return value
        if type(value) is int and expected in (numpy.int64, numpy.uint64):
            return value
        if type(value) is float and expected is numpy.float64:
            return value
        if type(value) is int and parameter.kind in "iu":
            raise TypeError(
                f"{self._where(index, parameter)}: got a Python int. CuPy passes a Python int as a 64-bit "
                f"integer, of which a {parameter.c_type} parameter reads the first {parameter.element[1]} bytes: "
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
        raise TypeError(f"{self._where(index, parameter)}: got {got}, which does not match the parameter's "
                        f"{parameter.c_type}: the kernel would read its bytes as garbage{fix}")

    # ---- launching -----------------------------------------------------------------------------------
    def _launch(self, grid, block, values, reverse_order=False, show_output=True):
        result, output = runtime.launch(self._entry_address, self._pack(*values), grid, block, reverse_order)
        if output and show_output:
            sys.stdout.write(output)
            sys.stdout.flush()
        return result

    def _raise_for(self, result, locate=None):
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
                f"element {element}; it has {array.size} elements ({array.dtype}, valid indices 0..{array.size - 1})")
        if result.failure == runtime.ASSERTION_FAILED:
            raise KernelError(f"kernel '{self.name}', {where}: {message}")
        if result.failure == runtime.MEMORY_FAULT:
            raise KernelError(f"kernel '{self.name}', {where}: {message}. Run with the bounds check on "
                              "(check_bounds=True, or `with backend.checks(bounds=True):`) to learn which array")
        raise KernelError(f"kernel '{self.name}', {where}: {message}")

    def _with_addresses(self, values, addresses):
        """The argument values with the pointers of some array parameters replaced."""
        replaced, slot = list(values), 0
        for index, parameter in enumerate(self.parameters):
            if parameter.struct_code is None:
                continue
            if index in addresses:
                replaced[slot] = addresses[index]
            slot += 1
        return replaced


def _kernel_library(code, options, entry_expressions, what):
    unit = source.translation_unit(code, entry_expressions)
    flags = source.compiler_flags(options)
    library = toolchain.build_kernel(unit, flags, lambda log: source.describe_compile_failure(log, code, what))
    return ctypes.CDLL(str(library))


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
        self._kernels = source.find_kernels(code)
        plain = [name for name, kernel in self._kernels.items() if not kernel.is_template]
        self._expressions = plain + [e for e in self.name_expressions if e not in plain]
        self._library = None
        self._functions = {}

    def compile(self, log_stream=None):
        runtime.library()  # kernels resolve their calls into the runtime when loaded
        if self._library is None:
            self._library = _kernel_library(self.code, self.options, self._expressions, "the module")
        return self

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
        function = Function(name, signature, address, entry)
        self._functions[name] = function
        return function


class RawKernel:
    """One kernel from a source string, like cupy.RawKernel; compiled at the first call (or .compile())."""

    def __init__(self, code, name, options=(), **ignored):
        self.code = code
        self.name = name
        self.options = tuple(options)
        self._function = None
        self._max_dynamic_shared_size_bytes = DEFAULT_DYNAMIC_SHARED_BYTES

    def compile(self, log_stream=None):
        if self._function is None:
            if self.name not in source.find_kernels(self.code):
                raise KernelNotFoundError(f"no __global__ function named '{self.name}' in the kernel source")
            module = RawModule(code=self.code, options=self.options)
            try:
                self._function = module.get_function(self.name)
            except CompileError as error:
                raise CompileError(str(error).replace("the module", f"kernel '{self.name}'", 1)) from None
            self._function.max_dynamic_shared_size_bytes = self._max_dynamic_shared_size_bytes
        return self._function

    @property
    def max_dynamic_shared_size_bytes(self):
        return self._max_dynamic_shared_size_bytes

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value):
        if not 0 <= int(value) <= MAX_DYNAMIC_SHARED_BYTES:
            raise LaunchError(f"max_dynamic_shared_size_bytes={value}: a block may have at most "
                              f"{MAX_DYNAMIC_SHARED_BYTES} bytes")
        self._max_dynamic_shared_size_bytes = int(value)
        if self._function is not None:
            self._function.max_dynamic_shared_size_bytes = int(value)

    @property
    def max_threads_per_block(self):
        return self.compile().max_threads_per_block

    def __call__(self, grid, block, args, shared_mem=0, **checks_wanted):
        function = self._function or self.compile()
        function(grid, block, args, shared_mem, **checks_wanted)
