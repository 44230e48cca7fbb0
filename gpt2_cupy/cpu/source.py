"""Reading a kernel source the way NVRTC would, and turning it into one C++ translation unit.

Three jobs: find the kernels in the source (name, parameter names, __launch_bounds__), translate the
NVRTC options the C++ compiler understands, and assemble the unit that is compiled: the CUDA built-ins
header, the source (line numbers kept, so compiler messages point at the learner's lines), and one small
entry function per kernel that tells the runtime its parameter types.

Kernels are found in the preprocessor's output, not in the source as written: a kernel inside `#if 0` is
not there, one defined by a macro is. For that one run, __global__, __shared__ and __launch_bounds__ expand
to markers that survive preprocessing; the marked text is then both read and compiled.
"""

import bisect
import re
from dataclasses import dataclass, field

from . import inline_asm, toolchain
from .errors import CompileError
from .toolchain import SOURCE_NAME, source_location

ENTRIES_NAME = "gpt2cupy-entries"

GLOBAL_MARKER = "__gpt2cupy_global__"
SHARED_MARKER = "__gpt2cupy_shared__"
BOUNDS_MARKER = "__gpt2cupy_launch_bounds__"

# What the learner's source sees before its first line: the built-ins, the markers, and the two names
# NVRTC knows without any #include.
_PRELUDE = f"""#include "cuda_builtins.h"
typedef decltype(sizeof(0)) size_t;
namespace gpt2cupy {{
// `extern __shared__ T name[];` becomes a pointer to the block's dynamic shared memory, of whatever type.
struct DynamicShared {{
    void* memory;
    template <class T> operator T*() const {{ return static_cast<T*>(memory); }}
}};
}}
#undef __global__
#define __global__ {GLOBAL_MARKER}
#undef __shared__
#define __shared__ {SHARED_MARKER}
#undef __launch_bounds__
#define __launch_bounds__(...) {BOUNDS_MARKER}(__VA_ARGS__)
#line 1 "{SOURCE_NAME}"
"""

# `extern __shared__ float buffer[];`, with the specifiers in any order nvcc accepts (`extern float
# __shared__ buffer[];`, `__shared__ extern ...`) and any __align__ or other attribute: every such array
# starts at the block's dynamic shared memory. A declaration that begins with one of the two words is a
# candidate; _is_extern_shared says whether it has both.
_EXTERN_SHARED = re.compile(
    rf"(?<!\w)(?P<declaration>(?:extern|{SHARED_MARKER})\b[^;{{}}]*?)\b(?P<name>[A-Za-z_]\w*)\s*\[\s*\]\s*;")
_EXTERN_OR_SHARED = re.compile(rf"\b(?:extern|{SHARED_MARKER})\b")


# `static` in a __shared__ declaration (`static __shared__ float partial[32];`, the block-reduction idiom in a
# __device__ function, or `__shared__ static ...`): a __shared__ variable is static already, one per block,
# and __shared__ becomes `static thread_local` here, so the learner's own `static` is dropped, in either order.
_STATIC_OF_SHARED = re.compile(
    rf"\bstatic\b(?P<between>[^;{{}}]*?\b{SHARED_MARKER}\b)|(?<=\b{SHARED_MARKER}\b)(?P<after>[^;{{}}]*?)\bstatic\b")


def _declarators(declaration):
    """The declaration after __shared__ (`float tile[32][33], row[8]`) cut at its top-level commas: [text, ...]."""
    pieces, depth, angle, start = [], 0, 0, 0
    for position, character in enumerate(declaration):
        if character in "([{":
            depth += 1
        elif character in ")]}":
            depth -= 1
        elif depth == 0 and character in "<>":  # template arguments (a declarator has no comparison here)
            angle += 1 if character == "<" else -1
        elif depth == 0 and angle == 0 and character == ",":
            pieces.append(declaration[start:position])
            start = position + 1
    return pieces + [declaration[start:]]


_ATTRIBUTE = re.compile(r"\b(?:__attribute__|alignas|__declspec)\s*\(")


def _declared_name(declarator):
    """The name a declarator declares (`tile` of `__attribute__((aligned(16))) float tile[32][33]`), or None
    where it is not a plain name, pointer or array (a function pointer, an initializer)."""
    while (attribute := _ATTRIBUTE.search(declarator)) is not None:
        inside = _parameter_list(declarator, attribute.end() - 1)
        declarator = declarator[:attribute.start()] + " " + declarator[attribute.end() + len(inside) + 1:]
    before_bounds = re.split(r"\[", declarator, maxsplit=1)[0]
    if re.search(r"[()=]", before_bounds):
        return None
    name = re.search(r"([A-Za-z_]\w*)\s*$", before_bounds)
    return name.group(1) if name else None


def _shared_declarations(text):
    """Every __shared__ declaration of the text made C++ (extern ones were made pointers before).

    In a function, the declaration becomes a local struct of its variables, placed in the block's shared-memory
    window, and a reference to each variable: `__shared__ float tile[32][33], row[8];` becomes
        struct gpt2cupy_shared_1 { float tile[32][33], row[8]; (its names and function) };
        auto& gpt2cupy_shared_1_ = gpt2cupy::shared_variable<gpt2cupy_shared_1>();
        auto& tile = gpt2cupy_shared_1_.tile; auto& row = gpt2cupy_shared_1_.row;
    all on the declaration's line. A GPU lays out a kernel's __shared__ variables in one window that ends where
    its memory does, and so does cuda_builtins.h: an access past the end faults there and here alike.

    Elsewhere (at namespace scope, or a declarator that is not a plain name, pointer or array) it stays a
    `static thread_local` variable, one per block as well, with an empty initializer on each declarator.
    Without one g++ guards a thread_local array of a class type (__half, __nv_bfloat16) with a flag that the
    first of the block's threads writes and the others read, which the race check would report as a race; the
    zeros of an empty initializer are set before any thread runs. (A __shared__ variable with an initializer
    of its own was refused before: _refuse_initialized_shared.)"""
    in_function = _function_scopes(text)
    pieces, copied = [], 0
    for serial, marker in enumerate(re.finditer(rf"\b{SHARED_MARKER}\b", text)):
        if marker.start() < copied:
            continue
        end = text.find(";", marker.end())
        if end < 0:
            break
        line_start = text.rfind("\n", 0, marker.start()) + 1
        statement_start = max(line_start, *(text.rfind(c, 0, marker.start()) + 1 for c in ";{}"))
        specifiers = text[statement_start:marker.start()]
        declarators = _declarators(text[marker.end():end])
        names = [_declared_name(d) for d in declarators]
        lines = "\n" * text.count("\n", statement_start, end)
        if in_function(marker.start()) and None not in names:
            struct = f"gpt2cupy_shared_{serial}"
            members = " ".join(f"{specifiers}{text[marker.end():end]}".split())
            references = " ".join(f"auto& {name} = {struct}_.{name};" for name in names)
            replacement = (f"struct {struct} {{ {members}; "
                           f"static constexpr unsigned serial() {{ return {serial}; }} "
                           f'static constexpr const char* names() {{ return "{", ".join(names)}"; }} '
                           "static constexpr const char* where() { return __PRETTY_FUNCTION__; } }; "
                           f"auto& {struct}_ = gpt2cupy::shared_variable<{struct}>(); {references}")
        else:
            replacement = f"{specifiers}static thread_local {'{}, '.join(declarators)}{{}}"
        pieces.append(text[copied:statement_start] + replacement + lines)
        copied = end
    return "".join(pieces) + text[copied:]


def _is_extern_shared(declaration):
    return re.search(r"\bextern\b", declaration) is not None and SHARED_MARKER in declaration
_GLOBAL_FUNCTION = re.compile(
    rf"{GLOBAL_MARKER}\b(?P<head>(?:[^;{{}}()]|\((?:[^()]|\([^()]*\))*\))*?)\b(?!(?:{BOUNDS_MARKER}|__attribute__|__declspec|alignas)\b)(?P<name>[A-Za-z_]\w*)\s*\(")
# A __launch_bounds__ call after _numbered_launch_bounds: its arguments, which may nest parentheses deeper than
# a regular expression can follow (a macro such as THREADS_FOR(ROWS) expands to ((ROWS) / 4 * 8)), replaced
# by their index in a list.
_NUMBERED_LAUNCH_BOUNDS = re.compile(rf"{BOUNDS_MARKER}\((?P<index>\d+)\)")

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


def _first_number(expression):
    """The value of a __launch_bounds__ argument such as `256` or `(32 * 8)`, or None if not a plain number."""
    first = expression.split(",")[0].strip()
    if re.fullmatch(r"[\d\s+\-*/()uUlL]+", first):
        try:
            return int(eval(re.sub(r"(?<=\d)[uUlL]+", "", first).replace("/", "//"), {"__builtins__": {}}))
        except (SyntaxError, ZeroDivisionError, TypeError):
            return None
    return None


def _numbered_launch_bounds(text):
    """(text with each `__launch_bounds__(arguments)` written as `__launch_bounds__(i)`, [arguments, ...]):
    the arguments are found by matching parentheses, at any depth."""
    pieces, arguments, copied = [], [], 0
    for marker in re.finditer(rf"{BOUNDS_MARKER}\s*\(", text):
        if marker.start() < copied:
            continue
        open_paren = marker.end() - 1
        inside = _parameter_list(text, open_paren)
        pieces.append(text[copied:marker.start()] + f"{BOUNDS_MARKER}({len(arguments)})")
        arguments.append(inside)
        copied = open_paren + len(inside) + 2
    pieces.append(text[copied:])
    return "".join(pieces), arguments


def find_kernels(preprocessed, bounds_arguments):
    """Every __global__ function in the preprocessed source, by name; the source's __launch_bounds__ are
    numbered (_numbered_launch_bounds), and bounds_arguments holds their arguments."""
    kernels = {}
    for match in _GLOBAL_FUNCTION.finditer(preprocessed):
        name = match.group("name")
        parameters = _split_parameters(_parameter_list(preprocessed, match.end() - 1))
        max_threads = 1024
        bounds = _NUMBERED_LAUNCH_BOUNDS.search(match.group("head"))
        if bounds:
            first = _first_number(bounds_arguments[int(bounds.group("index"))])
            if first:
                max_threads = min(1024, first)
        kernels[name] = KernelSignature(
            name=name,
            parameter_names=[_parameter_name(p, i) for i, p in enumerate(parameters)],
            max_threads_per_block=max_threads,
            is_template=_is_template(preprocessed, match.start()),
        )
    return kernels


def _source_line(preprocessed, offset):
    """The learner's line number of a place in the preprocessor's output, or None outside their source."""
    file, line = source_location(preprocessed, offset)
    return line if file == SOURCE_NAME else None


def _refuse_initialized_shared(preprocessed, code):
    """NVRTC refuses `__shared__ float total = 0;`: shared memory is not initialised at a block's start."""
    for marker in re.finditer(rf"{SHARED_MARKER}\b", preprocessed):
        statement = preprocessed[marker.end():preprocessed.find(";", marker.end())]
        if re.search(r"(?<![=!<>])=(?!=)", statement):
            line = _source_line(preprocessed, marker.start())
            lines = code.splitlines()
            shown = f"\n\nthe line in question:\n{line:4d} | {lines[line - 1]}" if line and 0 < line <= len(lines) else ""
            raise CompileError(
                f"{SOURCE_NAME}:{line}: error: a __shared__ variable cannot have an initializer (NVRTC refuses it: "
                "shared memory holds no value when a block starts). Declare it without one and let one thread "
                f"assign it, then __syncthreads(){shown}")


# Braces, and the string and character literals that might hold one.
_BRACE_OR_LITERAL = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|[{};]')
_NAMESPACE_OPENING = re.compile(r'(?:\binline\s+)?\bnamespace\b[^;]*$|\bextern\s*"C(?:\+\+)?"\s*$')


def _function_scopes(text):
    """in_function(offset): whether an offset of `text` lies inside a function's body (rather than at
    namespace scope, or in an extern "C" { } block)."""
    inside = []        # for each brace open at this point: whether it opens (or lies in) a function's body
    changes = [(0, False)]  # (offset, inside a function from there on)
    statement_start = 0
    for token in _BRACE_OR_LITERAL.finditer(text):
        kind = token.group()
        if kind == "{":
            opens_namespace = _NAMESPACE_OPENING.search(text[statement_start:token.start()]) is not None
            inside.append(not opens_namespace or (bool(inside) and inside[-1]))
            changes.append((token.start(), inside[-1]))
        elif kind == "}" and inside:
            inside.pop()
            changes.append((token.start(), bool(inside) and inside[-1]))
        if kind in "{};":
            statement_start = token.end()
    offsets = [offset for offset, _ in changes]

    def in_function(offset):
        return changes[bisect.bisect_right(offsets, offset) - 1][1]
    return in_function


@dataclass
class PreparedSource:
    """A kernel source after the preprocessor: the kernels it defines and the text to compile."""
    kernels: dict
    body: str


def prepare(code, options):
    """Preprocess `code` with the NVRTC `options`, find its kernels, and rewrite it into compilable C++."""
    flags = compiler_flags(options)
    preprocessed = toolchain.preprocess(_PRELUDE + code, flags,
                                        lambda log: describe_compile_failure(log, code, "the module"))
    user_start = preprocessed.find(f'"{SOURCE_NAME}"')
    user_start = preprocessed.rfind("\n", 0, user_start) + 1 if user_start >= 0 else 0
    header, user = preprocessed[:user_start], preprocessed[user_start:]
    _refuse_initialized_shared(user, code)  # before numbering, which may join lines: it reports line numbers
    user = inline_asm.translate(user, code, architecture(options))  # as well; keeps every line where it was
    user, bounds_arguments = _numbered_launch_bounds(user)
    kernels = find_kernels(user, bounds_arguments)

    in_function = _function_scopes(user)

    def pointer_to_dynamic_shared(match):
        # Inside a function, a plain local pointer. A thread_local one would be initialised by whichever
        # thread of the block gets there first and read by the others: to the race check, a write and
        # reads of one variable with no barrier between them.
        # ([[maybe_unused]]: NVCC says nothing of an extern __shared__ array a kernel does not use.)
        declaration = match.group("declaration")
        if not _is_extern_shared(declaration):
            return match.group()
        element_type = " ".join(_EXTERN_OR_SHARED.sub(" ", declaration).split())
        storage = "[[maybe_unused]] " + ("" if in_function(match.start()) else "static thread_local ")
        return (f"{storage}{element_type}* const {match.group('name')} = "
                "gpt2cupy::DynamicShared{gpt2cupy_dynamic_shared_memory()};")

    body = _EXTERN_SHARED.sub(pointer_to_dynamic_shared, user)
    body = _STATIC_OF_SHARED.sub(lambda match: match.group("between") or match.group("after") or "", body)
    body = _shared_declarations(body)
    body = _NUMBERED_LAUNCH_BOUNDS.sub("", body).replace(GLOBAL_MARKER, "")
    return PreparedSource(kernels=kernels, body=header + body)


def architecture(options):
    """The GPU architecture an -arch=... (or --gpu-architecture=...) option names ("sm_90a"), else None."""
    for option in options:
        for prefix in ("-arch=", "--gpu-architecture="):
            if option.startswith(prefix):
                return option[len(prefix):]
    return None


def compiler_flags(options):
    """The C++ compiler's flags for a tuple of NVRTC options; an option NVRTC would not know is refused."""
    # NVRTC defines this macro for the sm_90a features (wgmma); __CUDA_ARCH__ is 900 either way.
    flags = ["-D__CUDA_ARCH_FEAT_SM90_ALL"] if architecture(options) in inline_asm.WGMMA_ARCHITECTURES else []
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


# How the runtime calls a kernel: gpt2cupy_entry_<i>() describes the kernel's parameters (kind, size,
# alignment, the type's name as the compiler spells it) and gives a function that unpacks a buffer laid
# out like a C struct of the parameters and calls the kernel with them. The parameters' types come from
# the compiler, so a struct, a vector type or an enum by value is passed by its bytes, at its alignment.
ENTRY_SUPPORT = r"""
namespace gpt2cupy { namespace {
template <class T> constexpr const char* type_name() { return __PRETTY_FUNCTION__; }
template <class T, bool = __is_enum(T)> struct ParameterOf {
    static constexpr ParameterType type() {
        ParameterType described = Describe<T>::type();
        described.alignment = alignof(T);
        described.type_name = type_name<T>();
        return described;
    }
};
template <class T> struct ParameterOf<T, true> {  // an enum: its underlying integer, named as the enum
    static constexpr ParameterType type() {
        ParameterType described = Describe<__underlying_type(T)>::type();
        described.alignment = alignof(T);
        described.type_name = type_name<T>();
        return described;
    }
};
template <class... A> struct ArgumentLayout {
    struct Offsets { unsigned long at[sizeof...(A) + 1]; };
    static constexpr Offsets offsets() {
        const unsigned long sizes[] = {sizeof(A)..., 0};
        const unsigned long alignments[] = {alignof(A)..., 1};
        Offsets result{};
        unsigned long end = 0;
        for (unsigned long i = 0; i < sizeof...(A); ++i) {
            end = (end + alignments[i] - 1) / alignments[i] * alignments[i];
            result.at[i] = end;
            end += sizes[i];
        }
        return result;
    }
};
template <class T> inline __attribute__((always_inline)) const T& argument_at(const unsigned char* packed, unsigned long offset, void* room) {
    __builtin_memcpy(room, packed + offset, sizeof(T));
    return *static_cast<const T*>(room);
}
template <auto Kernel, class Signature> struct KernelCall;
template <auto Kernel, class... A> struct KernelCall<Kernel, void (*)(A...)> {
    static_assert(sizeof...(A) <= max_parameters, "too many kernel parameters");
    template <unsigned... I>
    static void call(const unsigned char* packed, Indices<I...>) {
        constexpr auto offsets = ArgumentLayout<A...>::offsets();
        constexpr unsigned long sizes[] = {sizeof(A)..., 1};
        constexpr unsigned long largest = [&] {
            unsigned long most = 1;
            for (unsigned long size : sizes) most = size > most ? size : most;
            return most;
        }();
        // Each argument is copied into aligned room of its own (the packed buffer's own alignment is unknown).
        struct alignas(16) alignas(A...) Room { unsigned char bytes[largest]; };
        Room rooms[sizeof...(A) + 1];
        (void)offsets; (void)rooms;
        Kernel(argument_at<A>(packed, offsets.at[I], rooms[I].bytes)...);
    }
    static void invoke(const unsigned char* packed) { call(packed, typename MakeIndices<sizeof...(A)>::type{}); }
    static const KernelEntry* entry() {
        static const KernelEntry description = {(int)sizeof...(A), {ParameterOf<A>::type()...}, &invoke};
        return &description;
    }
};
} }  // namespace gpt2cupy::(unnamed)
// The library's __shared__ declarations, for messages and for each kernel's count of static shared memory.
extern "C" const gpt2cupy::SharedDeclaration* gpt2cupy_shared_layout(unsigned* count) {
    gpt2cupy::place_shared_declarations();
    *count = gpt2cupy::shared_layout.count;
    return gpt2cupy::shared_layout.declarations;
}
"""


def translation_unit(prepared, entry_expressions):
    """The C++ that is compiled: the preprocessed source (with its line markers) and the entries.

    entry_expressions: C++ expressions naming kernels (`vector_add`, `softmax<float, 256>`); the entry
    for the i-th is the C function gpt2cupy_entry_<i>.
    """
    entries = "\n".join(
        f'extern "C" const gpt2cupy::KernelEntry* gpt2cupy_entry_{index}() '
        f"{{ return gpt2cupy::KernelCall<&{expression}, decltype(&{expression})>::entry(); }}"
        for index, expression in enumerate(entry_expressions)
    )
    return f'{prepared.body}\n#line 1 "{ENTRIES_NAME}"\n{ENTRY_SUPPORT}\n{entries}\n'


def describe_compile_failure(log, code, what):
    """The compiler's log, kept to what concerns the learner's source, with that source's lines numbered."""
    lines = [line for line in log.splitlines() if line.strip()]
    # (a header's static_assert says what the executor leaves out, and what to use instead: kept, by the header's
    # name as the kernel includes it)
    refusals = [re.sub(rf"^{re.escape(str(toolchain.INCLUDE_DIRECTORY))}/([^:]+):\d+:\d+: error: static assertion failed: ",
                       r"<\1>: ", line) for line in lines if "static assertion failed: not on the CPU executor" in line]
    about_source = [line for line in lines if SOURCE_NAME in line or not line.startswith(("/", "In file"))]
    message = "\n".join(refusals + about_source) or log
    message = re.sub(r"/[^\s:]*/unit\.cpp", "kernel-unit.cpp", message)
    wrong_lines = sorted({int(n) for n in re.findall(rf"{re.escape(SOURCE_NAME)}:(\d+):", message)})
    numbered = code.splitlines()
    excerpt = "\n".join(f"{n:4d} | {numbered[n - 1]}" for n in wrong_lines if 0 < n <= len(numbered))
    if re.search(r"\bwarpSize\b", excerpt) and re.search(r"constant|variable length|variably modified", message):
        message += ("\n(warpSize is a variable in CUDA, not a compile-time constant: nvcc refuses it as an array "
                    "size or template argument too. Use 32, or a constant of your own such as WARP_SIZE)")
    if ENTRIES_NAME in message and not wrong_lines:
        message += ("\n(the kernel could not be called as written: is it a __global__ function returning void, "
                    "and, for a template, a name expression with all template arguments?)")
    return f"compiling {what} for the CPU failed:\n{message}" + (f"\n\nthe lines in question:\n{excerpt}" if excerpt else "")
