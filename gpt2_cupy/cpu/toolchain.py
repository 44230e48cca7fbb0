"""Compiling CUDA C for the CPU: find a C++ compiler, build shared libraries, cache them on disk.

A library is named by a hash of everything that goes into it (the source, the options, the executor's
headers and runtime, the compiler's version), so a kernel is compiled once per machine, not per run.
"""

import hashlib
import os
import platform
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

# -O2 for speed; no -ffast-math, so results stay IEEE; no -march=native, so they match from machine to machine.
COMMON_FLAGS = ("-std=c++17", "-O2", "-fPIC", "-fno-math-errno", "-Wno-unknown-pragmas")


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
    return ("-shared",) + unique


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


def _build(library, translation_unit, flags, describe):
    """Compile one C++ translation unit into `library`, atomically, unless it is already there."""
    if library.exists():
        return library
    with tempfile.TemporaryDirectory(dir=library.parent) as work:
        source = Path(work) / "unit.cpp"
        source.write_text(translation_unit)
        partial = Path(work) / library.name
        command = [compiler(), *COMMON_FLAGS, *shared_library_flags(), *flags, "-I", str(HERE),
                   "-I", str(INCLUDE_DIRECTORY),
                   "-o", str(partial), str(source)]
        result = subprocess.run(command, capture_output=True, text=True, cwd=work)
        if result.returncode != 0:
            raise CompileError(describe(result.stderr))
        os.replace(partial, library)  # another process may have built the same library: either is fine
    return library


def build_runtime():
    """The executor's runtime library, built on first use."""
    library = cache_directory() / f"runtime-{_fingerprint('runtime')}.so"
    code = (HERE / RUNTIME_SOURCE).read_text()
    return _build(library, code, ("-pthread",), lambda log: "building the CPU executor's runtime failed:\n" + log)


def build_kernel(translation_unit, flags, describe):
    """A kernel library from the translation unit; `describe` turns the compiler's log into a message."""
    library = cache_directory() / f"kernel-{_fingerprint(translation_unit, *flags)}.so"
    return _build(library, translation_unit, flags, describe)
