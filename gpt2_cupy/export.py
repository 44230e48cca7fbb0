"""One source for every kernel: the chapter cell that teaches it, copied into kernels/.

A code cell whose first line is `# export: kernels/NAME.cu` exports the first string literal it assigns.
The package's kernels, one file per op named after it, go to kernels/; teaching steps that only a chapter,
its tests and its benchmark run (the naive matmul, say) go to kernels/steps/; the graded exercises'
solutions (gpt2_cupy.exercises) go to kernels/exercises/NN_name.cu; device helpers that several
kernels share (the warp reductions, say) go to kernels/include/NAME.cuh, exported by the chapter that
teaches them:

    # export: kernels/steps/vector_add.cu
    vector_add_source = r'''
    extern "C" __global__ void vector_add(...) { ... }
    '''

    python -m gpt2_cupy.export chapters/          rewrite kernels/**/*.cu and kernels/include/*.cuh
    python -m gpt2_cupy.export --check chapters/  exit 1 and name the files that differ (what the tests do)
"""

import argparse
import ast
import json
import re
import sys
from pathlib import Path

from gpt2_cupy.checkout import REPOSITORY

EXPORT_MARK = re.compile(r"^#\s*export:\s*(kernels/(?:(?:steps/|exercises/)?[\w.-]+\.cu|include/[\w.-]+\.cuh))\s*$")


def _cell_text(cell):
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def _first_string_assigned(code, where):
    for statement in ast.parse(code).body:
        if (isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Constant)
                and isinstance(statement.value.value, str)):
            return statement.value.value
    raise ValueError(f"{where}: an export cell must assign the kernel source as a string literal")


def exported_kernels(notebook):
    """[(kernels/NAME.cu, source text)] for the export cells of one notebook, in order."""
    cells = json.loads(Path(notebook).read_text())["cells"]
    exports = []
    for number, cell in enumerate(cells):
        if cell.get("cell_type") != "code":
            continue
        text = _cell_text(cell)
        mark = EXPORT_MARK.match(text.splitlines()[0]) if text.strip() else None
        if mark:
            kernel_source = _first_string_assigned(text, f"{notebook}, cell {number}")
            exports.append((mark.group(1), kernel_source.strip("\n") + "\n"))
    return exports


def all_exports(notebooks):
    """{kernels/NAME.cu: (notebook, source)} over notebooks; a file exported twice is an error."""
    found = {}
    for notebook in notebooks:
        for target, kernel_source in exported_kernels(notebook):
            if target in found:
                raise ValueError(f"{target} is exported by both {found[target][0]} and {notebook}")
            found[target] = (notebook, kernel_source)
    return found


def notebooks_in(paths):
    notebooks = []
    for path in map(Path, paths):
        notebooks += sorted(path.glob("*.ipynb")) if path.is_dir() else [path]
    return notebooks


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", default=[str(REPOSITORY / "chapters")])
    parser.add_argument("--check", action="store_true", help="report differences, write nothing")
    arguments = parser.parse_args(argv)
    differing = []
    for target, (notebook, kernel_source) in all_exports(notebooks_in(arguments.paths)).items():
        path = REPOSITORY / target
        if path.exists() and path.read_text() == kernel_source:
            continue
        differing.append(f"{target} (from {notebook})")
        if not arguments.check:
            path.write_text(kernel_source)
    verb = "differ from their cells" if arguments.check else "written"
    print(f"{len(differing)} kernel files {verb}" + "".join(f"\n  {d}" for d in differing))
    return 1 if arguments.check and differing else 0


if __name__ == "__main__":
    sys.exit(main())
