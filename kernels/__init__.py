"""The CUDA C of every kernel the package runs, one .cu file each, exported from the chapters' cells.

`gpt2_cupy.kernels.source("vector_add")` reads kernels/vector_add.cu; `python -m gpt2_cupy.export chapters/`
writes these files from the notebook cells marked `# export: kernels/NAME.cu`, and tests/test_export.py fails
when a file and its cell differ.
"""

from importlib import resources


def source(name):
    """The CUDA C text of kernels/<name>.cu."""
    path = resources.files(__name__) / f"{name}.cu"
    if not path.is_file():
        available = sorted(p.name[:-3] for p in resources.files(__name__).iterdir() if p.name.endswith(".cu"))
        raise FileNotFoundError(f"no kernel file kernels/{name}.cu; there are: {', '.join(available) or 'none'}")
    return path.read_text()
