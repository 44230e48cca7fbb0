"""Each kernel exists once: kernels/**/*.cu and kernels/include/*.cuh equal the chapter cells that export
them, and no device helper is written twice."""

import re
import shutil
import subprocess
from collections import defaultdict

import pytest

from gpt2_cupy.export import REPOSITORY, all_exports, notebooks_in

KERNELS = REPOSITORY / "kernels"
INCLUDE = KERNELS / "include"
EXPORTS = all_exports(notebooks_in([REPOSITORY / "chapters"]))
KERNEL_FILES = sorted(path for path in KERNELS.rglob("*") if path.suffix in (".cu", ".cuh"))
NVCC = ["nvcc", "-std=c++17", "-arch=sm_90", f"-I{INCLUDE}", "--ptx", "-Werror", "all-warnings"]
# Kernels on Hopper's wgmma exist only for sm_90a, which their ops ask NVRTC for (gpt2_cupy.ops.wgmma_matmul).
# So do chapter 15b's levels and exercises (bench/hopper_levels.py, gpt2_cupy.exercises.chapter_15b).
SM_90A_KERNELS = {"kernels/wgmma_matmul.cu"} | {target for target in EXPORTS if target.startswith(
    ("kernels/steps/hopper_level", "kernels/exercises/15b_"))}


def test_chapters_export_kernels_and_headers():
    """The course exports kernels and shared headers at all (a check over nothing would pass vacuously)."""
    assert any(target.endswith(".cu") for target in EXPORTS)
    assert any(target.endswith(".cuh") for target in EXPORTS)


@pytest.mark.parametrize("target", sorted(EXPORTS))
def test_kernel_file_equals_its_chapter_cell(target):
    """kernels/NAME.cu is the text of the cell that exports it (run `make kernels` after editing a cell)."""
    notebook, cell_source = EXPORTS[target]
    path = REPOSITORY / target
    assert path.exists(), f"{target} is exported by {notebook} but missing: run `make kernels`"
    assert path.read_text() == cell_source, f"{target} differs from its cell in {notebook}: run `make kernels`"


def test_every_kernel_file_comes_from_a_chapter():
    """No kernel file or header is edited on its own: each one has its cell."""
    files = {str(path.relative_to(REPOSITORY)) for path in KERNEL_FILES}
    assert files - set(EXPORTS) == set()


def test_no_kernel_source_lives_inside_the_package():
    """kernels/ at the top is the one home of CUDA C: nothing is left under gpt2_cupy/ to drift from it."""
    stray = [str(p.relative_to(REPOSITORY)) for p in (REPOSITORY / "gpt2_cupy").rglob("*") if p.suffix in (".cu", ".cuh")]
    assert stray == []


# A __device__ function's definition: its name, the parenthesis after it, and the brace of its body.
DEVICE_FUNCTION = re.compile(r"__device__[^;{}()]*?\b([A-Za-z_]\w*)\s*\((?:[^;{}()]|\([^()]*\))*\)\s*(?:const\s*)?\{")


def test_no_device_helper_is_written_twice():
    """A helper two kernel files need lives once, in kernels/include/: no name is defined in two files."""
    defined_in = defaultdict(set)
    for path in KERNEL_FILES:
        for name in DEVICE_FUNCTION.findall(path.read_text()):
            defined_in[name].add(str(path.relative_to(KERNELS)))
    assert len(defined_in) > 20  # the pattern finds the helpers at all
    twice = {name: sorted(files) for name, files in defined_in.items() if len(files) > 1}
    assert twice == {}


# A #define; one right after `#ifndef NAME` is a knob's default, which a file may take from -DNAME=...
DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)", re.M)
KNOB_DEFAULT = re.compile(r"^[ \t]*#[ \t]*ifndef[ \t]+(\w+)[^\n]*\n(?:[ \t]*//[^\n]*\n)*[ \t]*#[ \t]*define[ \t]+\1\b", re.M)


def test_no_constant_is_defined_twice():
    """A macro two kernel files need lives once, in kernels/include/ (include guards and -D knobs aside)."""
    defined_in = defaultdict(set)
    for path in KERNEL_FILES:
        text = path.read_text()
        knobs = set(KNOB_DEFAULT.findall(text))
        for name in DEFINE.findall(text):
            if name not in knobs:
                defined_in[name].add(str(path.relative_to(KERNELS)))
    assert {"WARP_SIZE", "FULL_MASK", "NEGATIVE_INFINITY"} <= set(defined_in)  # the pattern finds them at all
    twice = {name: sorted(files) for name, files in defined_in.items() if len(files) > 1}
    assert twice == {}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("target", sorted(t for t in EXPORTS if t.endswith(".cu")))
def test_kernel_compiles_with_nvcc_without_warnings(target, tmp_path):
    """What runs on the CPU also compiles for an H100 (sm_90), with every warning an error, and with the
    same include path the package gives NVRTC."""
    nvcc = [("-arch=sm_90a" if option == "-arch=sm_90" and target in SM_90A_KERNELS else option) for option in NVCC]
    result = subprocess.run([*nvcc, "-o", str(tmp_path / "kernel.ptx"), str(REPOSITORY / target)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("header", sorted(t for t in EXPORTS if t.endswith(".cuh")))
def test_header_stands_alone_and_twice(header, tmp_path):
    """A header compiles on its own and when included twice: it brings what it needs and guards itself."""
    unit = tmp_path / "unit.cu"
    name = header.split("/")[-1]
    unit.write_text(f'#include "{name}"\n#include "{name}"\n')
    result = subprocess.run([*NVCC, "-o", str(tmp_path / "unit.ptx"), str(unit)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
