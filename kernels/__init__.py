"""The CUDA C of every kernel the package runs, one .cu file each, exported from the chapters' cells.

`python -m gpt2_cupy.export chapters/` (or `make kernels`) writes these files from the notebook cells marked
`# export: kernels/NAME.cu`; tests/test_export.py fails when a file and its cell differ.
"""

from functools import lru_cache
from importlib import resources


def source(name):
    """The CUDA C text of kernels/<name>.cu."""
    path = resources.files(__name__) / f"{name}.cu"
    if not path.is_file():
        available = sorted(p.name[:-3] for p in resources.files(__name__).iterdir() if p.name.endswith(".cu"))
        raise FileNotFoundError(f"no kernel file kernels/{name}.cu; there are: {', '.join(available) or 'none'}")
    return path.read_text()


@lru_cache(maxsize=None)
def module(name, options=(), name_expressions=()):
    """kernels/<name>.cu compiled as a RawModule of the active backend (once per process)."""
    from gpt2_cupy import backend

    return backend.RawModule(code=source(name), options=tuple(options),
                             name_expressions=tuple(name_expressions) or None)


def function(file_name, kernel_name=None, **module_options):
    """One kernel of kernels/<file_name>.cu, ready to launch: function(grid, block, args, shared_mem=0)."""
    return module(file_name, **module_options).get_function(kernel_name or file_name)
