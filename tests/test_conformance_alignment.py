"""Conformance of misaligned memory accesses: a GPU's load and store instructions need an address that is a
multiple of their size (a float4 16 bytes, a float2 8, a float 4), and a kernel that breaks the rule stops
with "misaligned address". The CPU executor stops it too, with a KernelError that says "misaligned access",
even where the access is one a CPU would happily make at any address (a float4 read through a cast pointer and
used field by field). The same kernels at aligned addresses give the same results on both.

A misaligned access ends a GPU's CUDA context for good, so on the GPU each faulting launch runs in a process of
its own.
"""

import numpy as np
import pytest

from gpt2_cupy import backend
from gpt2_cupy.testing import launch_in_a_process_of_its_own

# out[0] = the sum of the 4, 2 or 1 floats at x + shift bytes, read as one float4, float2 or float; out[1] = 1
# after a float2 store at out + 2 + shift / 4 floats. shift = 0 is aligned for all of them.
ACCESSES = r"""
extern "C" __global__ void read_float4(float* out, const float* x, int shift)
{
    float4 v = *reinterpret_cast<const float4*>(reinterpret_cast<const char*>(x) + shift);
    out[0] = v.x + v.y + v.z + v.w;
}

extern "C" __global__ void read_float(float* out, const float* x, int shift)
{
    out[0] = *reinterpret_cast<const float*>(reinterpret_cast<const char*>(x) + shift);
}

extern "C" __global__ void write_float2(float* out, const float* x, int shift)
{
    *reinterpret_cast<float2*>(reinterpret_cast<char*>(out + 2) + shift) = make_float2(x[0], x[1]);
    out[1] = 1.0f;
}
"""
KERNELS = ("read_float4", "read_float", "write_float2")
MISALIGNED_SHIFTS = {"read_float4": (4, 8), "read_float": (2,), "write_float2": (4,)}

def launch_elsewhere(name, shift):
    return launch_in_a_process_of_its_own(ACCESSES, name, np.float32, shift)


@pytest.mark.parametrize("name", KERNELS)
def test_aligned_accesses_read_and_write_what_they_address(to_device, to_host, name):
    kernel = backend.RawModule(code=ACCESSES).get_function(name)
    out, x = to_device(np.zeros(8, np.float32)), to_device(np.arange(1, 9, dtype=np.float32))
    kernel((1,), (1,), (out, x, np.int32(0)))
    got = to_host(out)
    expected = {"read_float4": [10.0, 0.0], "read_float": [1.0, 0.0],
                "write_float2": [0.0, 1.0, 1.0, 2.0]}[name]
    assert got[:len(expected)].tolist() == expected


@pytest.mark.parametrize("name, shift", [(name, shift) for name in KERNELS for shift in MISALIGNED_SHIFTS[name]])
def test_a_misaligned_access_stops_the_kernel(to_device, name, shift):
    if backend.name == "cuda":
        assert "misaligned address" in launch_elsewhere(name, shift)
        return
    from gpt2_cupy.cpu import KernelError
    kernel = backend.RawModule(code=ACCESSES).get_function(name)
    out, x = to_device(np.zeros(8, np.float32)), to_device(np.arange(1, 9, dtype=np.float32))
    with pytest.raises(KernelError, match=f"kernel '{name}'.*misaligned access"):
        kernel((1,), (1,), (out, x, np.int32(shift)))
