"""Where the CUDA C of the kernels lies, and the compiler options that let a kernel include kernels/include/.

    directory()           the folder of the .cu files: a wheel's gpt2_cupy/kernel_sources/, else a checkout's kernels/
    include_directory()   its include/, the device helpers kernels share (`#include "warp.cuh"`)
    include_options()     -I that folder, and a hash of its headers (an edited header compiles again)
    source(name)          the text of kernels/<name>.cu

gpt2_cupy.kernels compiles these files on the active backend; gpt2_cupy.backend adds include_options() to
every compile. This module knows files only, so both can import it.
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
