"""Compiling CUDA C for the CPU: find a C++ compiler, build shared libraries, cache them on disk.

A library is named by a hash of everything that goes into it (the source, the options, the executor's
headers and runtime, the compiler's version), so a kernel is compiled once per machine, not per run.
"""

import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

from .errors import CompileError

HERE = Path(__file__).resolve().parent
# The CUDA headers a kernel may #include (<cooperative_groups.h>, <cuda_fp16.h>, ...), written for the
# executor; any other #include fails here as it would under NVRTC.
INCLUDE_DIRECTORY = HERE / "include"
HEADERS = ("executor_abi.h", "cuda_builtins.h")
RUNTIME_SOURCE = "runtime.cpp"
# The name the kernel's source goes by in the preprocessor's line markers and in compiler messages.
SOURCE_NAME = "kernel.cu"
_LINE_MARKER = re.compile(r'^# (\d+) "([^"]*)"', re.M)

# -O2 for speed; no -ffast-math, so results stay IEEE; no -march=native, so they match from machine to machine.
# -Werror=vla: an array sized by a variable (warpSize, a parameter) is refused, as nvcc refuses it.
# -fno-strict-aliasing: kernels read one object through a pointer of another type (a uint4 loaded at once,
# read as eight bf16; float4 stores into a float array), which NVCC compiles as written; with strict aliasing
# the C++ compiler may assume such reads never see the writes and return what was there before.
COMMON_FLAGS = ("-std=c++17", "-O2", "-fno-strict-aliasing", "-fPIC", "-fno-math-errno", "-Wno-unknown-pragmas",
                "-Werror=vla")


def cache_directory():
    """Where compiled kernels live: $GPT2_CUPY_CACHE_DIR, else ~/.cache/gpt2_cupy/cpu."""
    configured = os.environ.get("GPT2_CUPY_CACHE_DIR")
    if configured:
        directory = Path(configured)
    else:
        directory = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gpt2_cupy" / "cpu"
    directory.mkdir(parents=True, exist_ok=True)
    return directory


@lru_cache(maxsize=None)
def compiler():
    """The C++ compiler: $CXX, else g++, clang++ or c++, whichever is found first."""
    candidates = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "clang++", "c++"]
    for candidate in candidates:
        path = shutil.which(candidate)
        if path:
            return path
    raise CompileError(
        "The CPU executor compiles CUDA C kernels with a C++ compiler and found none "
        f"(looked for {', '.join(candidates)}). Install one: on Debian or Ubuntu `sudo apt install g++`, "
        "on Fedora `sudo dnf install gcc-c++`, on macOS `xcode-select --install`; or set CXX to its path."
    )


@lru_cache(maxsize=None)
def compiler_version():
    result = subprocess.run([compiler(), "--version"], capture_output=True, text=True)
    return result.stdout.splitlines()[0] if result.stdout else compiler()


def shared_library_flags():
    # GCC would mark static variables of template instances "unique", which the dynamic linker merges
    # across libraries: two kernels of one name from different sources would share their __shared__ arrays.
    unique = ("-fno-gnu-unique",) if "clang" not in compiler_version().lower() else ()
    if platform.system() == "Darwin":
        # The kernels' calls into the runtime are resolved when the library is loaded.
        return ("-dynamiclib", "-undefined", "dynamic_lookup") + unique
    # -Bsymbolic: a kernel's library calls its own functions, so a kernel named like a C library
    # function (div, index, random, time) is the kernel, not libc's function of that name.
    # -fstack-clash-protection: a thread's large local array touches its stack page by page, so
    # running past the stack faults in the guard below it instead of in a neighbour's stack.
    return ("-shared", "-Wl,-Bsymbolic", "-fstack-clash-protection") + unique


def _fingerprint(*parts):
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode() if isinstance(part, str) else part)
        digest.update(b"\0")
    digest.update(compiler_version().encode())
    digest.update(" ".join(COMMON_FLAGS + shared_library_flags()).encode())
    for name in HEADERS + (RUNTIME_SOURCE,):
        digest.update((HERE / name).read_bytes())
    for header in sorted(INCLUDE_DIRECTORY.rglob("*")):  # the CUDA headers a kernel may #include
        if header.is_file():
            digest.update(str(header.relative_to(INCLUDE_DIRECTORY)).encode() + b"\0" + header.read_bytes())
    return digest.hexdigest()[:24]


# For the race check: every load and store of the kernel calls the runtime (__tsan_read4(address), ...),
# and so does every atomic. Compiled, then linked without the sanitizer's own library: the runtime
# answers those calls.
def race_check_flags():
    if "clang" in compiler_version().lower():
        return ("-fsanitize=thread",)
    return ("-fsanitize=thread", "--param=tsan-instrument-func-entry-exit=0")


def _build(library, translation_unit, flags, describe, compile_flags=(), cuda_headers=True):
    """Compile one C++ translation unit into `library`, atomically, unless it is already there."""
    if library.exists():
        return library
    with tempfile.TemporaryDirectory(dir=library.parent) as work:
        source = Path(work) / "unit.cpp"
        source.write_text(translation_unit)
        partial = Path(work) / library.name
        # The CUDA headers are for kernels; the runtime includes the system's own.
        include = ["-I", str(HERE)] + (["-I", str(INCLUDE_DIRECTORY)] if cuda_headers else [])
        if compile_flags:
            objects = Path(work) / "unit.o"
            steps = [[compiler(), "-c", *COMMON_FLAGS, *compile_flags, *flags, *include, "-o", str(objects), str(source)],
                     [compiler(), *COMMON_FLAGS, *shared_library_flags(), "-o", str(partial), str(objects)]]
        else:
            steps = [[compiler(), *COMMON_FLAGS, *shared_library_flags(), *flags, *include,
                      "-o", str(partial), str(source)]]
        for command in steps:
            result = subprocess.run(command, capture_output=True, text=True, cwd=work)
            if result.returncode != 0:
                raise CompileError(describe(result.stderr))
        os.replace(partial, library)  # another process may have built the same library: either is fine
    return library


def _included_headers(flags):
    """The names and texts of the headers under each -I folder: the preprocessor's output depends on them,
    so a header edited after a kernel was first compiled must give a new cache entry."""
    parts = []
    for flag in flags:
        if flag.startswith("-I") and Path(flag[2:]).is_dir():
            for header in sorted(Path(flag[2:]).rglob("*")):
                if header.is_file():
                    parts += [str(header), header.read_bytes()]
    return parts


def preprocess(text, flags, describe):
    """The C preprocessor's output for `text` (macros expanded, #if'd-out code gone, line markers kept),
    cached like a library; `describe` turns the compiler's log into a message."""
    # -nostdinc: no system header either; #include <cstdint> fails here as it does under NVRTC.
    options = ("-E", "-nostdinc", "-nostdinc++")
    # The output names each header by its path (line markers, which the executor reads to tell its own
    # headers from the kernel's): the same text preprocessed from another copy of the package differs.
    key = _fingerprint(text, *options, *flags, *_included_headers(flags), str(HERE))
    output = cache_directory() / f"preprocessed-{key}.ii"
    if output.exists():
        return output.read_text()
    with tempfile.TemporaryDirectory(dir=output.parent) as work:
        source = Path(work) / "unit.cpp"
        source.write_text(text)
        partial = Path(work) / output.name
        command = [compiler(), *options, *COMMON_FLAGS, *flags,
                   "-I", str(HERE), "-I", str(INCLUDE_DIRECTORY),
                   "-o", str(partial), str(source)]
        result = subprocess.run(command, capture_output=True, text=True, cwd=work)
        if result.returncode != 0:
            raise CompileError(describe(result.stderr))
        os.replace(partial, output)
    return output.read_text()


def source_location(preprocessed, offset):
    """(file, line) of a place in the preprocessor's output, from its line markers: file is SOURCE_NAME for
    the learner's source, else the path of the header it comes from; (None, None) before the first marker."""
    line, file = 1, None
    for marker in _LINE_MARKER.finditer(preprocessed, 0, offset):
        line, file = int(marker.group(1)), marker.group(2)
        marker_end = marker.end()
    if file is None:
        return None, None
    return file, line + preprocessed.count("\n", marker_end, offset) - 1


def build_runtime():
    """The executor's runtime library, built on first use."""
    library = cache_directory() / f"runtime-{_fingerprint('runtime')}.so"
    code = (HERE / RUNTIME_SOURCE).read_text()
    return _build(library, code, ("-pthread",), lambda log: "building the CPU executor's runtime failed:\n" + log,
                  cuda_headers=False)


# Every load and store of a kernel checks that its address is a multiple of its size, as a GPU's memory
# instructions require: a misaligned one executes ud2 (SIGILL), which the runtime reports as a misaligned
# access. Without it the CPU reads a float4 split into floats from any address, where the GPU stops.
# The build for the race check has none: the checks run it after a pass of this one has checked every access
# at the arrays' own alignment, and the bounds check runs it on bytes moved off their alignment on purpose.
ALIGNMENT_CHECK_FLAGS = ("-fsanitize=alignment", "-fsanitize-undefined-trap-on-error")


def build_kernel(translation_unit, flags, describe, for_race_check=False):
    """A kernel library from the translation unit; `describe` turns the compiler's log into a message.
    for_race_check: built so that its every memory access is reported to the runtime, with no alignment check."""
    if for_race_check:
        extra = race_check_flags()
        library = cache_directory() / f"kernel-races-{_fingerprint(translation_unit, *extra, *flags)}.so"
        return _build(library, translation_unit, flags, describe, compile_flags=extra)
    flags = (*ALIGNMENT_CHECK_FLAGS, *flags)
    library = cache_directory() / f"kernel-{_fingerprint(translation_unit, *flags)}.so"
    return _build(library, translation_unit, flags, describe)
