"""Every kernel file a chapter exports (kernels/*.cu, kernels/steps/*.cu, kernels/exercises/*.cu) is launched in
that chapter, and a cell that launches it shows, in its stored outputs, a check against a reference that passed.

A cell launches a kernel file when it is the export cell and runs the kernel there, or uses a name that carries
the kernel: the variable its source was assigned to, a name imported from the gpt2_cupy.ops module that launches
it, a string naming the kernel (`kernels.function("steps/NAME")`, a helper given "NAME"), and then, following the
chapter's cells in order, every name assigned from an expression that uses such a name, and every function whose
body uses one (a module built from the source, a helper that launches it). Its outputs count as a passed check
when they say True, passed or within, and never False, failed, ABOVE or an error, and the cell is compared by
nbval (no NBVAL_IGNORE_OUTPUT), so that the check is re-run on both backends."""

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted(path.stem for path in (ROOT / "chapters").glob("*.ipynb"))
KERNEL_EXPORT = re.compile(r"^# export: kernels/((?:steps/|exercises/)?[\w.-]+)\.cu$")
SOURCE_VARIABLE = re.compile(r"^(\w+) = r['\"]", re.MULTILINE)
PASSED = re.compile(r"\bTrue\b|\bpassed\b|\bwithin\b")
FAILED = re.compile(r"\bFalse\b|\bfailed\b|\bABOVE\b|\bnot within\b|Error\b|Traceback")


def code_cells(chapter):
    notebook = json.loads((ROOT / "chapters" / f"{chapter}.ipynb").read_text())
    return [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]


def source_of(cell):
    return "".join(cell["source"])


def output_text(cell):
    parts = []
    for output in cell.get("outputs", []):
        parts.append("".join(output.get("text", "")))
        parts.append("".join(output.get("data", {}).get("text/plain", "")))
        if output.get("output_type") == "error":
            parts.append("Error " + output.get("ename", ""))
    return "\n".join(parts)


def ops_modules_launching(kernel_file):
    """The gpt2_cupy.ops modules whose code launches a kernel of kernels/kernel_file.cu."""
    return [path.stem for path in (ROOT / "gpt2_cupy" / "ops").glob("*.py")
            if f'kernels.function("{kernel_file}"' in path.read_text()]


def exported_kernels(chapter):
    """[(kernel file relative to kernels/ without .cu, its source variable, its export cell)]."""
    found = []
    for cell in code_cells(chapter):
        source = source_of(cell)
        match = KERNEL_EXPORT.match(source.split("\n", 1)[0])
        if match:
            variable = SOURCE_VARIABLE.search(source)
            found.append((match.group(1), variable.group(1) if variable else None, cell))
    return found


def names_used(node):
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | \
        {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def carrying_names(cells, kernel_file, variable, ops):
    """The names (and strings) through which the chapter's cells reach the kernel file, in the cells' order."""
    stem = kernel_file.rsplit("/", 1)[-1]
    carried = {kernel_file, stem} | ({variable} if variable else set())
    for cell in cells:
        try:
            tree = ast.parse(source_of(cell))
        except SyntaxError:
            continue
        for statement in tree.body:
            if isinstance(statement, ast.ImportFrom) and statement.module in {f"gpt2_cupy.ops.{op}" for op in ops}:
                carried |= {alias.asname or alias.name for alias in statement.names}
            elif isinstance(statement, (ast.FunctionDef, ast.ClassDef)) and names_used(statement) & carried:
                carried.add(statement.name)
            elif isinstance(statement, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and statement.value is not None \
                    and names_used(statement.value) & carried:
                targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
                carried |= {n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name)}
    return carried


def launches(cell, export_cell, carried):
    if cell is export_cell:
        # the export cell runs its kernel itself when code follows the source string
        return bool(output_text(cell).strip())
    try:
        return bool(names_used(ast.parse(source_of(cell))) & carried)
    except SyntaxError:
        return False


def shows_passed_check(cell):
    if source_of(cell).startswith("# NBVAL_IGNORE_OUTPUT"):
        return False
    text = output_text(cell)
    return bool(PASSED.search(text)) and not FAILED.search(text)


EXPORTS = [(chapter, kernel_file) for chapter in CHAPTERS for kernel_file, _, _ in exported_kernels(chapter)]


def test_the_course_exports_kernel_files():
    """Checked over something: the course exports shipped kernels, steps and exercise solutions."""
    files = [kernel_file for _, kernel_file in EXPORTS]
    assert any("/" not in f for f in files) and any(f.startswith("steps/") for f in files) \
        and any(f.startswith("exercises/") for f in files)


@pytest.mark.parametrize("chapter, kernel_file", EXPORTS)
def test_exported_kernel_is_launched_and_checked(chapter, kernel_file):
    cells = code_cells(chapter)
    (variable, export_cell), = [(v, c) for f, v, c in exported_kernels(chapter) if f == kernel_file]
    carried = carrying_names(cells, kernel_file, variable, ops_modules_launching(kernel_file))
    launching = [cell for cell in cells if launches(cell, export_cell, carried)]
    assert launching, f"{chapter}: kernels/{kernel_file}.cu is exported but no cell launches it"
    assert any(shows_passed_check(cell) for cell in launching), (
        f"{chapter}: no cell launching kernels/{kernel_file}.cu shows a passed check against a reference "
        f"(outputs saying True or passed, none saying False, failed or an error, compared by nbval)")
