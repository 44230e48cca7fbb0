"""The CUDA C of every kernel, one .cu file each, exported from the chapters' cells.

    gpt2_cupy/kernels/NAME.cu         the package's kernels, one file per op, named after it
    gpt2_cupy/kernels/steps/NAME.cu   teaching steps that only a chapter, its tests and its benchmark run

`python -m gpt2_cupy.export chapters/` (or `make kernels`) writes these files from the notebook cells marked
`# export: gpt2_cupy/kernels/NAME.cu`; tests/test_export.py fails when a file and its cell differ.

Every kernel takes its outputs first, then its inputs, then sizes and scalars (llm.c's rule):
`gelu_forward(float* out, const float* x, int n)`.
"""

from functools import lru_cache
from importlib import resources


def source(name):
    """The CUDA C text of gpt2_cupy/kernels/<name>.cu (name may be "steps/<name>")."""
    path = resources.files(__name__).joinpath(*f"{name}.cu".split("/"))
    if not path.is_file():
        root = resources.files(__name__)
        available = sorted([p.name[:-3] for p in root.iterdir() if p.name.endswith(".cu")]
                           + [f"steps/{p.name[:-3]}" for p in root.joinpath("steps").iterdir() if p.name.endswith(".cu")])
        raise FileNotFoundError(f"no kernel file gpt2_cupy/kernels/{name}.cu; there are: {', '.join(available) or 'none'}")
    return path.read_text()


@lru_cache(maxsize=None)
def module(name, options=(), name_expressions=()):
    """gpt2_cupy/kernels/<name>.cu compiled as a RawModule of the active backend (once per process)."""
    from gpt2_cupy import backend

    return backend.RawModule(code=source(name), options=tuple(options),
                             name_expressions=tuple(name_expressions) or None)


@lru_cache(maxsize=None)
def function(file_name, kernel_name=None, **module_options):
    """One kernel of gpt2_cupy/kernels/<file_name>.cu, ready to launch: function(grid, block, args, shared_mem=0).

    Looked up once per process: ops call this on every launch and get the same object back.
    """
    return module(file_name, **module_options).get_function(kernel_name or file_name.split("/")[-1])
