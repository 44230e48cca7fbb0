"""The repository the package runs from, when it runs from one: a clone on PYTHONPATH, or the editable
install `make` makes of it. There the kernels (kernels/) and the corpora (data/) are read in place. A wheel
installs the package into site-packages, whose parent is no repository: REPOSITORY is None there."""

from pathlib import Path

_PARENT = Path(__file__).resolve().parent.parent


def _is_this_repository(folder):
    project = folder / "pyproject.toml"
    return project.is_file() and 'name = "gpt2-cupy"' in project.read_text(encoding="utf-8")


REPOSITORY = _PARENT if _is_this_repository(_PARENT) else None
