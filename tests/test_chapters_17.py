"""Chapters 17a and 17b: every kernel file they export is launched and checked in the chapter, and the GEMV's
teaching step (kernels/steps/gemv_warp_per_row.cu) computes W x against float64 numpy on ragged sizes."""

import json
import re
from pathlib import Path

import numpy as np
import pytest

from gpt2_cupy import backend, kernels
from gpt2_cupy.testing import relative_error

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = ("17a_llama", "17b_generation")
EXPORT = re.compile(r"^# export: kernels/(\w+)\.cu$")            # a shipped kernel, not include/, steps/, exercises/
STEP_EXPORT = re.compile(r"^# export: kernels/steps/(\w+)\.cu$")
SOURCE_VARIABLE = re.compile(r"^(\w+) = r['\"]", re.MULTILINE)


def code_cells(chapter):
    notebook = json.loads((ROOT / "chapters" / f"{chapter}.ipynb").read_text())
    return ["".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "code"]


def exported(chapter, pattern):
    """[(file name, the variable its source is assigned to)] of the chapter's export cells matching pattern."""
    found = []
    for source in code_cells(chapter):
        match = pattern.match(source.split("\n", 1)[0])
        if match:
            found.append((match.group(1), SOURCE_VARIABLE.search(source).group(1)))
    return found


def ops_modules_launching(file_name):
    """The gpt2_cupy.ops modules whose code launches a kernel of kernels/file_name.cu."""
    return [path.stem for path in (ROOT / "gpt2_cupy" / "ops").glob("*.py")
            if f'kernels.function("{file_name}"' in path.read_text()]


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_exported_kernel_is_launched_and_checked(chapter):
    cells = code_cells(chapter)
    kernel_files = exported(chapter, EXPORT) + exported(chapter, STEP_EXPORT)
    assert kernel_files, f"{chapter} exports no kernel file"
    for file_name, variable in kernel_files:
        ops = ops_modules_launching(file_name)
        # A cell builds a module from the source (a step does so in its own export cell), or imports an op that
        # launches it, and prints a comparison with a reference.
        launching = [cell for cell in cells if re.search(rf"RawModule\(code={variable}\)", cell)
                     or any(re.search(rf"from gpt2_cupy\.ops\.{op} import", cell) for op in ops)]
        assert launching, f"{chapter}: kernels/{file_name}.cu is exported but no cell launches it"
        assert any(re.search(r"within|equals|equal", cell) for cell in launching), \
            f"{chapter}: the cells launching kernels/{file_name}.cu print no check against a reference"


@pytest.mark.parametrize("N, K", [(1, 1), (7, 33), (77, 100), (300, 1031)])
def test_gemv_warp_per_row_step(N, K):
    rng = np.random.default_rng(N * 1000 + K)
    x, weight = rng.standard_normal(K).astype(np.float32), rng.standard_normal((N, K)).astype(np.float32)
    y = backend.xp.full(N + 8, np.nan, dtype=np.float32)                  # 8 more: a stray write shows
    kernels.function("steps/gemv_warp_per_row", "gemv_warp_per_row")(
        (-(-N // 8),), (256,), (y, backend.xp.asarray(x), backend.xp.asarray(weight), np.int32(N), np.int32(K)))
    y = backend.asnumpy(y)
    assert relative_error(y[:N], weight.astype(np.float64) @ x.astype(np.float64)) < 1e-5
    assert np.isnan(y[N:]).all()
