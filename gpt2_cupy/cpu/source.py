"""Reading a kernel source the way NVRTC would, and turning it into one C++ translation unit.

Three jobs: find the kernels in the source (name, parameter names, __launch_bounds__), translate the
NVRTC options the C++ compiler understands, and assemble the unit that is compiled: the CUDA built-ins
header, the source as written (line numbers kept, so compiler messages point at the learner's lines),
and one small entry function per kernel that tells the runtime its parameter types.
"""

import re
from dataclasses import dataclass, field

from .errors import CompileError

SOURCE_NAME = "kernel.cu"
ENTRIES_NAME = "gpt2cupy-entries"

# `extern __shared__ float buffer[];`: every such array starts at the block's dynamic shared memory.
_EXTERN_SHARED = re.compile(
    r"extern\s+__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s*)?(?P<type>[A-Za-z_][\w\s:<>,*]*?)\s*"
    r"(?:__align__\s*\(\s*\d+\s*\)\s*)?(?P<name>[A-Za-z_]\w*)\s*\[\s*\]\s*;"
)
_GLOBAL_FUNCTION = re.compile(
    r"__global__\s+(?:__launch_bounds__\s*\((?P<bounds_before>[^)]*)\)\s*)?void\s+"
    r"(?:__launch_bounds__\s*\((?P<bounds_after>[^)]*)\)\s*)?(?P<name>[A-Za-z_]\w*)\s*\("
)
_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)

# NVRTC options with no meaning on a CPU: accepted and ignored.
_IGNORED_OPTION_PREFIXES = (
    "--use_fast_math", "-use_fast_math", "--fmad", "-fmad", "-lineinfo", "--generate-line-info",
    "-G", "--device-debug", "-arch", "--gpu-architecture", "-maxrregcount", "--maxrregcount",
    "-rdc", "--relocatable-device-code", "--extra-device-vectorization", "-default-device",
    "--ftz", "-ftz", "--prec-div", "-prec-div", "--prec-sqrt", "-prec-sqrt", "-dopt", "--dopt",
    "--expt-relaxed-constexpr", "--expt-extended-lambda", "-restrict", "--restrict", "-dw", "--disable-warnings",
    "-w", "--std", "-std", "-no-source-include", "--no-source-include",
)


@dataclass
class KernelSignature:
    name: str
    parameter_names: list = field(default_factory=list)
    max_threads_per_block: int = 1024
    is_template: bool = False


def _blank_comments(code):
    """Comments replaced by spaces of the same shape, so offsets and line numbers stay put."""
    return _COMMENT.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), code)


def _parameter_list(code, open_paren):
    """The text between the parenthesis at open_paren and its partner."""
    depth = 0
    for position in range(open_paren, len(code)):
        if code[position] == "(":
            depth += 1
        elif code[position] == ")":
            depth -= 1
            if depth == 0:
                return code[open_paren + 1:position]
    return code[open_paren + 1:]


def _split_parameters(text):
    pieces, depth, start = [], 0, 0
    for position, character in enumerate(text):
        if character in "(<[":
            depth += 1
        elif character in ")>]":
            depth -= 1
        elif character == "," and depth == 0:
            pieces.append(text[start:position])
            start = position + 1
    pieces.append(text[start:])
    return [piece.strip() for piece in pieces if piece.strip() and piece.strip() != "void"]


def _parameter_name(declaration, index):
    declaration = declaration.split("=")[0]
    declaration = re.sub(r"\[[^\]]*\]", "", declaration)
    identifiers = re.findall(r"[A-Za-z_]\w*", declaration)
    qualifiers = {"const", "volatile", "__restrict__", "__restrict", "restrict", "unsigned", "signed"}
    if len(identifiers) >= 2 and identifiers[-1] not in qualifiers:
        return identifiers[-1]
    return f"argument {index}"


def _is_template(code, start):
    """Whether the declaration that ends at `start` began with `template <...>`."""
    preceding = code[:start]
    boundary = max(preceding.rfind(";"), preceding.rfind("}"), preceding.rfind("{"))
    return re.search(r"\btemplate\s*<", preceding[boundary + 1:]) is not None


def find_kernels(code):
    """Every __global__ function in the source, by name."""
    text = _blank_comments(code)
    kernels = {}
    for match in _GLOBAL_FUNCTION.finditer(text):
        name = match.group("name")
        parameters = _split_parameters(_parameter_list(text, match.end() - 1))
        bounds = match.group("bounds_before") or match.group("bounds_after")
        max_threads = 1024
        if bounds:
            first = bounds.split(",")[0].strip()
            if first.isdigit():
                max_threads = min(1024, int(first))
        kernels[name] = KernelSignature(
            name=name,
            parameter_names=[_parameter_name(p, i) for i, p in enumerate(parameters)],
            max_threads_per_block=max_threads,
            is_template=_is_template(text, match.start()),
        )
    return kernels


def compiler_flags(options):
    """The C++ compiler's flags for a tuple of NVRTC options; an option NVRTC would not know is refused."""
    flags = []
    options = list(options)
    while options:
        option = options.pop(0)
        if option in ("-D", "-U", "-I", "--define-macro", "--undefine-macro", "--include-path") and options:
            option = option + ("=" if option.startswith("--") else "") + options.pop(0)
        for long, short in (("--define-macro=", "-D"), ("--undefine-macro=", "-U"), ("--include-path=", "-I")):
            if option.startswith(long):
                option = short + option[len(long):]
        if option.startswith(("-D", "-U", "-I")):
            flags.append(option)
        elif option.startswith(("-std=c++", "--std=c++")):
            version = option.split("c++")[1]
            # The built-ins header needs C++17; a newer standard is passed on.
            if version in ("20", "2a", "23", "2b"):
                flags.append(f"-std=c++{version}")
        elif option.startswith(_IGNORED_OPTION_PREFIXES):
            continue
        else:
            raise CompileError(f"unknown compiler option {option!r} (NVRTC would refuse it too)")
    return tuple(flags)


def translation_unit(code, entry_expressions):
    """The C++ that is compiled: header, the learner's source with its own line numbers, the entries.

    entry_expressions: C++ expressions naming kernels (`vector_add`, `softmax<float, 256>`); the entry
    for the i-th is the C function gpt2cupy_entry_<i>.
    """
    def pointer_to_dynamic_shared(match):
        return (f"static thread_local {match.group('type').strip()}* const {match.group('name')} = "
                f"reinterpret_cast<{match.group('type').strip()}*>(gpt2cupy_dynamic_shared_memory());")

    rewritten = _EXTERN_SHARED.sub(pointer_to_dynamic_shared, code)
    entries = "\n".join(
        f'extern "C" const gpt2cupy::KernelEntry* gpt2cupy_entry_{index}() '
        f"{{ return gpt2cupy::Entry<&{expression}, decltype(&{expression})>::entry(); }}"
        for index, expression in enumerate(entry_expressions)
    )
    return (f'#include "cuda_builtins.h"\n#line 1 "{SOURCE_NAME}"\n{rewritten}\n'
            f'#line 1 "{ENTRIES_NAME}"\n{entries}\n')


def describe_compile_failure(log, code, what):
    """The compiler's log, kept to what concerns the learner's source, with that source's lines numbered."""
    lines = [line for line in log.splitlines() if line.strip()]
    about_source = [line for line in lines if SOURCE_NAME in line or not line.startswith(("/", "In file"))]
    message = "\n".join(about_source) or log
    message = re.sub(r"/[^\s:]*/unit\.cpp", "kernel-unit.cpp", message)
    wrong_lines = sorted({int(n) for n in re.findall(rf"{re.escape(SOURCE_NAME)}:(\d+):", message)})
    numbered = code.splitlines()
    excerpt = "\n".join(f"{n:4d} | {numbered[n - 1]}" for n in wrong_lines if 0 < n <= len(numbered))
    if ENTRIES_NAME in message and not wrong_lines:
        message += ("\n(the kernel could not be called as written: is it a __global__ function returning void, "
                    "and, for a template, a name expression with all template arguments?)")
    return f"compiling {what} for the CPU failed:\n{message}" + (f"\n\nthe lines in question:\n{excerpt}" if excerpt else "")
