"""The CPU executor's errors: each mistake a learner can make is reported clearly, and the process survives.

A GPU reports many of these mistakes late, vaguely, or not at all; the CPU executor's job is to name the
kernel, the parameter, the source line, or the block and thread that went wrong.
"""

import os
import re
import time
import uuid

import numpy as np
import pytest

from gpt2_cupy import backend

pytestmark = pytest.mark.cpu_only

if backend.name == "cpu":
    from gpt2_cupy.cpu import CompileError, KernelError, LaunchError, RawKernel, RawModule


SCALE = r"""
extern "C" __global__ void scale(const float* x, float* out, float factor, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = factor * x[i];
    }
}
"""


def scale_arguments(n=100):
    """Arguments that match `scale` exactly: (x, out, factor, n)."""
    return (np.ones(n, dtype=np.float32), np.zeros(n, dtype=np.float32), np.float32(2.0), np.int32(n))


def line_of(code, text):
    """The 1-based line of `code` (as the compiler numbers it) that contains `text`."""
    matches = [number for number, line in enumerate(code.split("\n"), start=1) if text in line]
    assert len(matches) == 1, f"{text!r} should be on exactly one line"
    return matches[0]


def launch_once(kernel):
    """Launch a kernel of signature (const float*, float*, float, int) once and return its output."""
    x, out, factor, n = scale_arguments()
    kernel((1,), (128,), (x, out, factor, n))
    return out


# ---------------------------------------------------------------------------------------------------------
# Compile errors
# ---------------------------------------------------------------------------------------------------------

UNDECLARED = r"""extern "C" __global__ void uses_an_undeclared_name(float* out, int n)
{
    int i = threadIdx.x;
    if (i < n) {
        out[i] = not_declared_anywhere * 2.0f;
    }
}
"""


def test_compile_error_names_the_source_line():
    """A compile error raises CompileError quoting the compiler, with kernel.cu:LINE: counted from the code string."""
    kernel = RawKernel(UNDECLARED, "uses_an_undeclared_name")
    with pytest.raises(CompileError) as info:
        kernel((1,), (32,), (np.zeros(32, dtype=np.float32), np.int32(32)))
    message = str(info.value)
    assert f"kernel.cu:{line_of(UNDECLARED, 'not_declared_anywhere')}:" in message
    assert "not_declared_anywhere" in message


def test_compile_error_line_counts_a_leading_newline():
    """Line 1 is the first line of the string, even when the string starts with a newline (as r\"\"\" strings often do)."""
    code = "\n\n" + UNDECLARED  # the mistake moves down two lines
    with pytest.raises(CompileError) as info:
        RawKernel(code, "uses_an_undeclared_name")((1,), (32,), (np.zeros(32, dtype=np.float32), np.int32(32)))
    assert f"kernel.cu:{line_of(code, 'not_declared_anywhere')}:" in str(info.value)


def test_compile_error_for_a_syntax_error_in_a_module():
    """A syntax error in a RawModule is a CompileError too, raised by the time a function is launched."""
    code = r"""
extern "C" __global__ void missing_brace(float* out)
{
    out[0] = 1.0f;
"""
    with pytest.raises(CompileError):
        module = RawModule(code=code)
        module.get_function("missing_brace")((1,), (1,), (np.zeros(1, dtype=np.float32),))


@pytest.mark.parametrize(
    "body, what",
    [
        ("out[0] = INFINITY;", "INFINITY without an include"),
        ("out[0] = FLT_MAX;", "FLT_MAX without an include"),
        ("out[0] = (float)rand();", "rand(), a host library function"),
        ('FILE* f = fopen("x.txt", "r"); out[0] = 0.0f;', "fopen, a host library function"),
        ("std::vector<float> v(3); out[0] = v[0];", "std::vector, a host library class"),
    ],
)
def test_what_nvrtc_rejects_is_rejected_on_the_cpu_too(body, what):
    """Code that NVRTC would not compile (host-only functions, undeclared constants) is a CompileError, not silently accepted."""
    code = 'extern "C" __global__ void host_only(float* out)\n{\n    ' + body + "\n}\n"
    with pytest.raises(CompileError):
        RawKernel(code, "host_only")((1,), (1,), (np.zeros(1, dtype=np.float32),))


NOT_EXTERN_C = r"""
__global__ void not_extern_c(float* out)
{
    out[threadIdx.x] = 1.0f;
}
"""


@pytest.mark.parametrize(
    "get_kernel",
    [
        lambda: RawModule(code=NOT_EXTERN_C).get_function("not_extern_c"),
        lambda: RawKernel(NOT_EXTERN_C, "not_extern_c"),
    ],
    ids=["RawModule", "RawKernel"],
)
def test_kernel_without_extern_c_is_not_found_by_its_plain_name(get_kernel):
    """A kernel with a C++ (mangled) name is not found by its plain name, as with CuPy; the error names it."""
    with pytest.raises(Exception) as info:
        get_kernel()((1,), (1,), (np.zeros(1, dtype=np.float32),))
    assert "not_extern_c" in str(info.value)


def test_kernel_without_extern_c_is_found_through_name_expressions():
    """The same C++ kernel is reachable when it is listed in name_expressions."""
    out = np.zeros(4, dtype=np.float32)
    RawModule(code=NOT_EXTERN_C, name_expressions=["not_extern_c"]).get_function("not_extern_c")((1,), (4,), (out,))
    np.testing.assert_array_equal(out, np.ones(4))


# ---------------------------------------------------------------------------------------------------------
# Arguments that do not match the kernel's parameters
# ---------------------------------------------------------------------------------------------------------


def test_wrong_number_of_arguments_is_a_type_error():
    """Passing 3 arguments to a kernel of 4 parameters raises TypeError instead of reading garbage."""
    x, out, factor, n = scale_arguments()
    with pytest.raises(TypeError):
        RawKernel(SCALE, "scale")((1,), (128,), (x, out, factor))
    with pytest.raises(TypeError):
        RawKernel(SCALE, "scale")((1,), (128,), (x, out, factor, n, n))


def test_python_int_for_an_int_parameter_is_a_type_error_mentioning_64_bit():
    """A plain Python int is passed as 64 bits by CuPy, which garbles an `int` parameter; say so, naming 'n'."""
    x, out, factor, _ = scale_arguments()
    with pytest.raises(TypeError) as info:
        RawKernel(SCALE, "scale")((1,), (128,), (x, out, factor, 100))
    message = str(info.value)
    assert re.search(r"\bn\b", message), message
    assert "64-bit" in message


def test_numpy_int64_for_an_int_parameter_is_a_type_error():
    """np.int64 for an `int` parameter is rejected, naming the parameter."""
    x, out, factor, _ = scale_arguments()
    with pytest.raises(TypeError) as info:
        RawKernel(SCALE, "scale")((1,), (128,), (x, out, factor, np.int64(100)))
    assert re.search(r"\bn\b", str(info.value)), str(info.value)


def test_numpy_float64_for_a_float_parameter_is_a_type_error():
    """np.float64 (or a Python float) for a `float` parameter is rejected, naming 'factor'."""
    x, out, _, n = scale_arguments()
    with pytest.raises(TypeError) as info:
        RawKernel(SCALE, "scale")((1,), (128,), (x, out, np.float64(2.0), n))
    assert "factor" in str(info.value)
    with pytest.raises(TypeError) as info:
        RawKernel(SCALE, "scale")((1,), (128,), (x, out, 2.0, n))
    assert "factor" in str(info.value)


def test_float64_array_for_a_float_pointer_is_a_type_error():
    """A float64 array passed to `const float* x` is rejected, naming 'x'."""
    _, out, factor, n = scale_arguments()
    with pytest.raises(TypeError) as info:
        RawKernel(SCALE, "scale")((1,), (128,), (np.ones(100, dtype=np.float64), out, factor, n))
    assert re.search(r"\bx\b", str(info.value)), str(info.value)


def test_int32_array_for_a_float_pointer_is_a_type_error():
    """An int32 array passed to `float* out` is rejected too, naming 'out'."""
    x, _, factor, n = scale_arguments()
    with pytest.raises(TypeError) as info:
        RawKernel(SCALE, "scale")((1,), (128,), (x, np.zeros(100, dtype=np.int32), factor, n))
    assert "out" in str(info.value)


def test_non_contiguous_array_is_a_value_error():
    """A strided view (x[::2]) is not the flat buffer the kernel indexes: ValueError."""
    x, out, factor, n = scale_arguments(200)
    with pytest.raises(ValueError):
        RawKernel(SCALE, "scale")((1,), (128,), (x[::2], out[:100], factor, np.int32(100)))


# ---------------------------------------------------------------------------------------------------------
# Launch configurations a GPU refuses
# ---------------------------------------------------------------------------------------------------------


def launch_once_with(block, shared_mem=0, kernel=None):
    """Launch `scale` (or the given kernel of the same signature) on one block of the given shape."""
    kernel = kernel or RawKernel(SCALE, "scale")
    x, out, factor, n = scale_arguments()
    kernel((1,), block, (x, out, factor, n), shared_mem=shared_mem)


@pytest.mark.parametrize("block", [(1025,), (2048, 1, 1), (32, 32, 2), (1, 1, 65), (1, 1025, 1)])
def test_block_beyond_cuda_limits_is_a_launch_error(block):
    """More than 1024 threads in a block, or a block dimension over (1024, 1024, 64), raises LaunchError."""
    with pytest.raises(LaunchError):
        launch_once_with(block=block)


@pytest.mark.parametrize("grid, block", [(1, (128,)), ((1,), 128), ([1], (128,))])
def test_grid_and_block_must_be_tuples_as_cupy_requires(grid, block):
    """CuPy takes grid and block only as tuples; a plain int or a list is a TypeError here too."""
    kernel = RawKernel(SCALE, "scale")
    x, out, factor, n = scale_arguments()
    with pytest.raises(TypeError, match="must be a tuple"):
        kernel(grid, block, (x, out, factor, n))


def test_largest_legal_block_runs():
    """1024 threads, and a (1, 16, 64) block, are legal and run."""
    kernel = RawKernel(SCALE, "scale")
    x, out, factor, _ = scale_arguments(1024)
    kernel((1,), (1024,), (x, out, factor, np.int32(1024)))
    np.testing.assert_array_equal(out, 2 * x)
    launch_once_with(block=(1, 16, 64))


def test_dynamic_shared_memory_over_48_kib_needs_the_attribute():
    """shared_mem over 48 KiB is a LaunchError until max_dynamic_shared_size_bytes is raised (as on a GPU)."""
    kernel = RawKernel(SCALE, "scale")
    launch_once_with(block=(32,), shared_mem=48 * 1024, kernel=kernel)  # exactly 48 KiB is fine
    with pytest.raises(LaunchError):
        launch_once_with(block=(32,), shared_mem=48 * 1024 + 4, kernel=kernel)
    kernel.max_dynamic_shared_size_bytes = 100 * 1024
    launch_once_with(block=(32,), shared_mem=100 * 1024, kernel=kernel)
    with pytest.raises(LaunchError):
        launch_once_with(block=(32,), shared_mem=100 * 1024 + 4, kernel=kernel)


# ---------------------------------------------------------------------------------------------------------
# Device-side assert and printf
# ---------------------------------------------------------------------------------------------------------

ASSERTS = r"""
extern "C" __global__ void check_non_negative(const float* x, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        assert(x[i] >= 0.0f);
    }
}
"""


def test_failed_assert_names_kernel_block_thread_and_condition():
    """assert(x[i] >= 0.0f) failing at element 37 (block 2, thread 5 of 16) raises KernelError saying where and what."""
    x = np.ones(100, dtype=np.float32)
    x[37] = -1.0
    with pytest.raises(KernelError) as info:
        RawKernel(ASSERTS, "check_non_negative")((7,), (16,), (x, np.int32(100)))
    message = str(info.value)
    assert "check_non_negative" in message
    assert "block (2, 0, 0)" in message
    assert "thread (5, 0, 0)" in message
    assert "x[i] >= 0.0f" in message


def test_assert_that_holds_is_silent():
    """The same kernel on valid data runs without an error."""
    RawKernel(ASSERTS, "check_non_negative")((7,), (16,), (np.ones(100, dtype=np.float32), np.int32(100)))


def test_failed_assert_in_a_two_dimensional_launch_reports_y_coordinates():
    """The block and thread reported are three-dimensional coordinates, here with y != 0."""
    code = r"""
extern "C" __global__ void check_matrix(const int* m, int cols)
{
    int row = blockIdx.y * blockDim.y + threadIdx.y;
    int col = blockIdx.x * blockDim.x + threadIdx.x;
    assert(m[row * cols + col] != 7);
}
"""
    m = np.zeros((8, 8), dtype=np.int32)
    m[5, 6] = 7  # row 5 = block y 1, thread y 1 ; col 6 = block x 1, thread x 2
    with pytest.raises(KernelError) as info:
        RawKernel(code, "check_matrix")((2, 2), (4, 4), (m, np.int32(8)))
    message = str(info.value)
    assert "block (1, 1, 0)" in message
    assert "thread (2, 1, 0)" in message


def test_the_process_survives_a_failed_kernel():
    """After a failed assert, the executor still compiles and runs kernels normally."""
    x = -np.ones(10, dtype=np.float32)
    with pytest.raises(KernelError):
        RawKernel(ASSERTS, "check_non_negative")((1,), (16,), (x, np.int32(10)))
    out = launch_once(RawKernel(SCALE, "scale"))
    np.testing.assert_array_equal(out, np.full(100, 2.0))


PRINTF = r"""
extern "C" __global__ void say_hello(const float* x)
{
    printf("block %d thread %d: x = %.2f\n", blockIdx.x, threadIdx.x, x[blockIdx.x * blockDim.x + threadIdx.x]);
}
"""


def test_printf_output_reaches_python_stdout_in_thread_order(capsys):
    """Device printf lines appear on sys.stdout after the launch: blocks in order, threads in order within a block."""
    x = np.arange(6, dtype=np.float32) / 4
    RawKernel(PRINTF, "say_hello")((2,), (3,), (x,))
    expected = "".join(f"block {b} thread {t}: x = {x[3 * b + t]:.2f}\n" for b in range(2) for t in range(3))
    assert capsys.readouterr().out == expected


def test_printf_formats_strings_ints_and_floats(capsys):
    """printf understands %s, %d, %u, %x, %f, %e and %%, as C's printf does."""
    code = r"""
extern "C" __global__ void formats(int value)
{
    printf("%s|%d|%u|%x|%5.1f|%.3e|100%%\n", "text", value, (unsigned int)value, value, 3.14159f, 12345.678);
}
"""
    RawKernel(code, "formats")((1,), (1,), (np.int32(255),))
    assert capsys.readouterr().out == "text|255|255|ff|  3.1|1.235e+04|100%\n"


def test_printf_is_the_same_on_every_run(capsys):
    """Two launches print exactly the same text (the output is deterministic)."""
    x = np.arange(64, dtype=np.float32)
    kernel = RawKernel(PRINTF, "say_hello")
    kernel((2,), (32,), (x,))
    first = capsys.readouterr().out
    kernel((2,), (32,), (x,))
    assert capsys.readouterr().out == first
    assert first.count("\n") == 64


# ---------------------------------------------------------------------------------------------------------
# Compilation cache
# ---------------------------------------------------------------------------------------------------------


def test_same_source_is_compiled_only_once():
    """A second RawKernel of identical source reuses the compiled code: building and launching it is fast."""
    # A fresh comment makes this source new to the cache, so the first construction really compiles.
    code = f"// cache test {uuid.uuid4().hex}\n" + SCALE
    start = time.perf_counter()
    first = launch_once(RawKernel(code, "scale"))
    first_seconds = time.perf_counter() - start

    start = time.perf_counter()
    second = launch_once(RawKernel(code, "scale"))
    second_seconds = time.perf_counter() - start

    np.testing.assert_array_equal(first, second)
    assert second_seconds < 0.2, f"the second build+launch took {second_seconds:.3f} s (first: {first_seconds:.3f} s)"


def test_kernels_of_the_same_name_from_different_sources_stay_distinct():
    """Editing a kernel and building it again under the same name runs the new code, not the old one."""
    first_version = r"""
extern "C" __global__ void edited_kernel(int* out) { out[threadIdx.x] = 1; }
"""
    second_version = r"""
extern "C" __global__ void edited_kernel(int* out) { out[threadIdx.x] = 2; }
"""
    first, second = np.zeros(4, dtype=np.int32), np.zeros(4, dtype=np.int32)
    RawKernel(first_version, "edited_kernel")((1,), (4,), (first,))
    RawKernel(second_version, "edited_kernel")((1,), (4,), (second,))
    np.testing.assert_array_equal(first, np.full(4, 1))
    np.testing.assert_array_equal(second, np.full(4, 2))


def test_different_options_are_compiled_separately():
    """The same source with different -D options gives different kernels (the cache key includes the options)."""
    code = r"""
extern "C" __global__ void fill(int* out) { out[threadIdx.x] = VALUE; }
"""
    one, two = np.zeros(4, dtype=np.int32), np.zeros(4, dtype=np.int32)
    RawKernel(code, "fill", options=("-DVALUE=1",))((1,), (4,), (one,))
    RawKernel(code, "fill", options=("-DVALUE=2",))((1,), (4,), (two,))
    np.testing.assert_array_equal(one, np.full(4, 1))
    np.testing.assert_array_equal(two, np.full(4, 2))


# ---------------------------------------------------------------------------------------------------------
# Interrupting a kernel that never ends
# ---------------------------------------------------------------------------------------------------------

ENDLESS = r"""
extern "C" __global__ void endless(int* counters, int n)
{
    int i = threadIdx.x;
    while (i < n) {          // the learner forgot to advance i
        counters[i % 4] += 1;
    }
}
"""


@pytest.mark.parametrize("blocks", [1, 8])
def test_ctrl_c_stops_a_kernel_that_loops_forever(blocks):
    """An interrupt (Ctrl-C, or Jupyter's stop button) ends the launch with KeyboardInterrupt, and the
    executor works afterwards."""
    import os
    import signal
    import threading
    import time

    kernel = RawKernel(ENDLESS, "endless")
    counters = np.zeros(4, dtype=np.int32)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    started = time.perf_counter()
    timer.start()
    with pytest.raises(KeyboardInterrupt, match="endless"):
        kernel((blocks,), (64,), (counters, np.int32(10)))
    timer.join()
    assert 0.4 < time.perf_counter() - started < 5.0  # it ran until the interrupt, and stopped soon after
    out = launch_once(RawKernel(SCALE, "scale"))
    x, _, _, _ = scale_arguments()
    np.testing.assert_array_equal(out, 2 * x)


def test_an_edited_header_is_compiled_again(tmp_path):
    """A kernel that #includes a header from an -I folder sees the header's current text, not a cached one."""
    header = tmp_path / "answer.cuh"
    code = '#include "answer.cuh"\nextern "C" __global__ void answer(int* out) { out[threadIdx.x] = ANSWER; }\n'
    results = []
    for value in (41, 42):
        header.write_text(f"#define ANSWER {value}\n")
        out = np.zeros(4, dtype=np.int32)
        RawKernel(code, "answer", options=("-I", str(tmp_path)))((1,), (4,), (out,))
        results.append(out.tolist())
    assert results == [[41] * 4, [42] * 4]


NULL_OR_ARRAY = r"""
extern "C" __global__ void maybe_write(float* out) { if (out != nullptr) out[threadIdx.x] = 1.0f; }
"""


@pytest.mark.parametrize("value, says", [(None, "got None, which CuPy does not pass as a null pointer"),
                                         (np.int32(0), "expects an array (or 0 for a null pointer), got int32"),
                                         (12345, "expects an array (or 0 for a null pointer), got int")])
def test_only_an_eight_byte_zero_is_a_null_pointer(value, says):
    """CuPy passes None as no argument at all, a numpy.int32 as 4 bytes, and a non-zero int as an address."""
    with pytest.raises(TypeError, match=re.escape(says)):
        RawKernel(NULL_OR_ARRAY, "maybe_write")((1,), (4,), (value,))


def test_a_null_pointer_passes_the_checks():
    RawKernel(NULL_OR_ARRAY, "maybe_write")((1,), (4,), (0,), check_bounds=True, check_races=True)


GRID_SYNC = r"""
#include <cooperative_groups.h>
namespace cg = cooperative_groups;
extern "C" __global__ void two_phases(float* out)
{
    out[blockIdx.x] = 1.0f;
    cg::this_grid().sync();
    out[blockIdx.x] += out[(blockIdx.x + 1) % gridDim.x];
}
"""


@pytest.mark.parametrize("cooperative", [False, True])
def test_a_grid_wide_sync_is_refused_with_what_to_do(cooperative):
    kernel = RawKernel(GRID_SYNC, "two_phases", enable_cooperative_groups=cooperative)
    with pytest.raises(KernelError, match=r"grid_group::sync\(\).*split the kernel in two launches"):
        kernel((4,), (32,), (np.zeros(4, dtype=np.float32),))


def test_a_second_copy_of_the_package_does_not_reuse_the_firsts_preprocessed_kernels(tmp_path):
    """The preprocessor's output names the executor's headers by path; a copy of the package elsewhere (a
    second clone sharing the kernel cache) must preprocess again, or its own headers look like the kernel's."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import gpt2_cupy

    copy = tmp_path / "copy"
    shutil.copytree(Path(gpt2_cupy.__file__).parent, copy / "gpt2_cupy", ignore=shutil.ignore_patterns("__pycache__"))
    code = ('extern "C" __global__ void stamp(long long* out) { out[threadIdx.x] = clock64() > 0 ? 7 : 0; }')
    script = (f"import numpy as np\nfrom gpt2_cupy.cpu import RawKernel\nout = np.zeros(4, dtype=np.int64)\n"
              f"RawKernel({code!r}, 'stamp')((1,), (4,), (out,))\nprint(out.tolist())")
    outputs = []
    for package_parent in (Path(gpt2_cupy.__file__).parent.parent, copy):
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                env={**os.environ, "PYTHONPATH": str(package_parent)}, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        outputs.append(result.stdout.strip())
    assert outputs == ["[7, 7, 7, 7]"] * 2
