"""The CPU executor: the same CUDA C kernels, compiled with the system's C++ compiler and run on the CPU.

Each block runs on one OS thread (blocks spread over all cores), its threads as cooperative fibers, so
__syncthreads(), shared memory and warp shuffles mean what they mean on a GPU. See runtime.cpp.
"""

import os
import platform

from .checks import launch_checks
from .errors import CompileError, KernelError, KernelNotFoundError, LaunchError, OutOfBoundsError, RaceError
from .kernel import Function, RawKernel, RawModule

__all__ = ["RawKernel", "RawModule", "Function", "CompileError", "LaunchError", "KernelError",
           "KernelNotFoundError", "OutOfBoundsError", "RaceError", "launch_checks", "describe_host"]


def describe_host():
    """A line naming the CPU executor and the machine it runs on."""
    return f"CPU executor ({platform.machine()}, {os.cpu_count()} cores)"
