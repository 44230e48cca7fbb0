"""Registers, spills and shared memory of chapter 00's and 01's kernels, as the compiler reports them.

    python -m bench.kernel_resources      needs nvcc, not a GPU: writes bench/kernel_resources.json

The compiler decides how many registers a thread of each kernel gets; that number, with the block's
threads and shared memory, decides how many blocks fit on a multiprocessor (chapter 00, section 10).
`nvcc -cubin -Xptxas -v` prints it for every kernel of a file:

    ptxas info    : Function properties for vector_add
        0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
    ptxas info    : Used 12 registers, used 0 barriers

On a GPU, CuPy reads the same numbers from the loaded kernel: RawKernel.attributes["num_regs"],
["local_size_bytes"] (spilled registers live there) and ["shared_size_bytes"].
"""

import datetime
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from gpt2_cupy import kernels

ARCHITECTURE = "sm_90"  # an H100's compute capability, 9.0
KERNEL_FILES = ["steps/vector_add", "steps/matmul_tiled", "steps/matmul_register_blocked", "steps/matmul_float4",
                "steps/matmul_transposed_a", "steps/matmul_warp_tiles", "steps/matmul_double_buffered"]
_FUNCTION = re.compile(r"Function properties for (\w+)\s*\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
                       r"(\d+) bytes spill loads\s*\n[^\n]*Used (\d+) registers(?:, used \d+ barriers)?(?:, (\d+) bytes smem)?")


def nvcc_or_none():
    return shutil.which("nvcc")


def ptxas_report(file_name, architecture=ARCHITECTURE):
    """{kernel: {registers, spill_stores, spill_loads, stack_bytes, shared_bytes}} of kernels/<file_name>.cu."""
    path = kernels.directory().joinpath(*f"{file_name}.cu".split("/"))
    command = [nvcc_or_none(), "-std=c++17", f"-arch={architecture}", "-cubin", "-Xptxas", "-v", "-o", "/dev/null",
               f"-I{kernels.include_directory()}", str(path)]
    log = subprocess.run(command, capture_output=True, text=True, check=True).stderr
    return {name: {"registers": int(registers), "spill_stores": int(stores), "spill_loads": int(loads),
                   "stack_bytes": int(stack), "shared_bytes": int(shared or 0)}
            for name, stack, stores, loads, registers, shared in _FUNCTION.findall(log)}


def compiler_version():
    """'nvcc, release 13.0, V13.0.88': the line of `nvcc --version` that names the release."""
    lines = subprocess.run([nvcc_or_none(), "--version"], capture_output=True, text=True).stdout.splitlines()
    release = next((line for line in lines if "release" in line), lines[-1])
    return "nvcc, " + release.split(", ", 1)[-1].strip()


def main():
    if nvcc_or_none() is None:
        sys.exit("nvcc is not on PATH: install the CUDA toolkit (no GPU needed) to read the compiler's report")
    results = {"compiler": compiler_version(), "architecture": ARCHITECTURE,
               "date": datetime.date.today().isoformat(), "kernels": {}}
    for file_name in KERNEL_FILES:
        results["kernels"].update(ptxas_report(file_name))
    for name, row in results["kernels"].items():
        print(f"{name:26s} {row['registers']:4d} registers, {row['spill_stores']} bytes spilled, "
              f"{row['shared_bytes']:6d} bytes of shared memory")
    path = Path(__file__).resolve().parent / "kernel_resources.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"written: {path}")


if __name__ == "__main__":
    main()
