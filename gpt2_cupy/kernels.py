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

from functools import lru_cache

from gpt2_cupy import backend
from gpt2_cupy.kernel_files import directory, include_directory, include_options, source  # noqa: F401 (kernels.source)


@lru_cache(maxsize=None)
def module(name, options=(), name_expressions=()):
    """kernels/<name>.cu compiled as a RawModule of the active backend (once per process)."""
    return backend.RawModule(code=source(name), options=tuple(options),
                             name_expressions=tuple(name_expressions) or None)


@lru_cache(maxsize=None)
def function(file_name, kernel_name=None, **module_options):
    """One kernel of kernels/<file_name>.cu, ready to launch: function(grid, block, args, shared_mem=0).

    Looked up once per process: ops call this on every launch and get the same object back.
    """
    return module(file_name, **module_options).get_function(kernel_name or file_name.split("/")[-1])
