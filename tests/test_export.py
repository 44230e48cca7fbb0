"""Each kernel exists once: gpt2_cupy/kernels/**/*.cu must equal the chapter cells that export them."""

import shutil
import subprocess

import pytest

from gpt2_cupy.export import REPOSITORY, all_exports, notebooks_in

KERNELS = REPOSITORY / "gpt2_cupy" / "kernels"
EXPORTS = all_exports(notebooks_in([REPOSITORY / "chapters"]))


def test_chapters_export_kernels():
    """The course exports kernels at all (a check over nothing would pass vacuously)."""
    assert len(EXPORTS) >= 1


@pytest.mark.parametrize("target", sorted(EXPORTS))
def test_kernel_file_equals_its_chapter_cell(target):
    """gpt2_cupy/kernels/NAME.cu is the text of the cell that exports it (run `make kernels` after editing a cell)."""
    notebook, cell_source = EXPORTS[target]
    path = REPOSITORY / target
    assert path.exists(), f"{target} is exported by {notebook} but missing: run `make kernels`"
    assert path.read_text() == cell_source, f"{target} differs from its cell in {notebook}: run `make kernels`"


def test_every_kernel_file_comes_from_a_chapter():
    """No kernel file is edited on its own: each one has its cell."""
    files = {str(path.relative_to(REPOSITORY)) for path in KERNELS.rglob("*.cu")}
    assert files - set(EXPORTS) == set()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("target", sorted(EXPORTS))
def test_kernel_compiles_with_nvcc_without_warnings(target, tmp_path):
    """What runs on the CPU also compiles for an H100 (sm_90), with every warning an error."""
    result = subprocess.run(
        ["nvcc", "-std=c++17", "-arch=sm_90", "--ptx", "-Werror", "all-warnings",
         "-o", str(tmp_path / "kernel.ptx"), str(REPOSITORY / target)],
        capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
