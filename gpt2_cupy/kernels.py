"""The CUDA C of every kernel, exported from the chapters' cells into kernels/ at the repository's top.

    kernels/NAME.cu           the package's kernels, one file per op, named after it
    kernels/steps/NAME.cu     teaching steps that only a chapter, its tests and its benchmark run
    kernels/exercises/NN_name.cu  the graded exercises' solutions (gpt2_cupy.exercises)
    kernels/include/NAME.cuh  device helpers that kernels share (`#include "warp.cuh"`), one home each

`python -m gpt2_cupy.export chapters/` (or `make kernels`) writes these files from the notebook cells marked
`# export: kernels/NAME.cu`; tests/test_export.py fails when a file and its cell differ.

Every kernel takes its outputs first, then its inputs, then sizes and scalars (llm.c's rule):
`gelu_forward(float* out, const float* x, int n)`.

A wheel carries the same files inside the package (gpt2_cupy/kernel_sources/, see pyproject.toml); a
checkout or an editable install reads them where they are edited, in kernels/.
"""

import hashlib
from functools import lru_cache
from pathlib import Path

from gpt2_cupy.checkout import REPOSITORY

_PACKAGED = Path(__file__).resolve().parent / "kernel_sources"


@lru_cache(maxsize=None)
def directory():
    """The folder that holds the .cu files: the wheel's copy, else the checkout's kernels/."""
    if (_PACKAGED / "include").is_dir():
        return _PACKAGED
    if REPOSITORY is not None and (REPOSITORY / "kernels" / "include").is_dir():
        return REPOSITORY / "kernels"
    raise FileNotFoundError(
        f"gpt2_cupy finds no kernels: {_PACKAGED} (an installed wheel's copy) does not exist, and the package "
        "does not run from a clone of the repository with its kernels/ folder. Install it from a wheel, "
        "or from a clone (pip install -e .).")


def include_directory():
    """kernels/include/, where the shared device helpers live."""
    return directory() / "include"


@lru_cache(maxsize=None)
def include_options():
    """The compiler options that let any kernel `#include "NAME.cuh"` from kernels/include/.

    CuPy keeps a compiled module under a hash of its source and options, not of the headers it includes,
    so the headers' own hash goes into the options too: an edited header compiles the kernel again.
    """
    digest = hashlib.sha256()
    for header in sorted(include_directory().glob("*.cuh")):
        digest.update(header.name.encode() + b"\0" + header.read_bytes())
    return (f"-I{include_directory()}", f"-DGPT2_CUPY_HEADERS=0x{digest.hexdigest()[:15]}")


def source(name):
    """The CUDA C text of kernels/<name>.cu (name may be "steps/<name>")."""
    path = directory().joinpath(*f"{name}.cu".split("/"))
    if not path.is_file():
        available = sorted(str(p.relative_to(directory()))[:-3] for p in directory().rglob("*.cu"))
        raise FileNotFoundError(f"no kernel file kernels/{name}.cu; there are: {', '.join(available) or 'none'}")
    return path.read_text()


@lru_cache(maxsize=None)
def module(name, options=(), name_expressions=()):
    """kernels/<name>.cu compiled as a RawModule of the active backend (once per process)."""
    from gpt2_cupy import backend

    return backend.RawModule(code=source(name), options=tuple(options),
                             name_expressions=tuple(name_expressions) or None)


@lru_cache(maxsize=None)
def function(file_name, kernel_name=None, **module_options):
    """One kernel of kernels/<file_name>.cu, ready to launch: function(grid, block, args, shared_mem=0).

    Looked up once per process: ops call this on every launch and get the same object back.
    """
    return module(file_name, **module_options).get_function(kernel_name or file_name.split("/")[-1])
