"""Conformance of pointer arguments that are not a whole array of their own, under the bounds and race checks:

- a view (`base[3:]`, CUDA's `d_base + 3`) read before its start: a 1-D stencil given `in + RADIUS` reads
  in[-RADIUS .. -1], which are base's elements, and a GPU reads them without a fault. The checks must let it read
  them too, with the same values; a read that leaves the allocation the view was cut from is reported.
- a null pointer (CuPy's 0) for an output the kernel is told not to write, as llm.c's fused classifier is given
  `probs = NULL`: the kernel only compares it with null, or only forms addresses from it, and the checks report
  nothing.

The kernels run on the active backend, inside `backend.checks(bounds=True, races=True)` (the CPU executor's checks;
on a GPU the block runs unchecked), and their results are compared with numpy's.
"""

import numpy as np
import pytest

from gpt2_cupy import backend

RADIUS = 3

STENCIL = r"""
#define RADIUS 3
// out[i] = in[i - RADIUS] + ... + in[i + RADIUS] for i in 0 .. n - 1: `in` points RADIUS elements into its array.
extern "C" __global__ void stencil_1d(float* out, const float* in, int n)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float sum = 0.0f;
    for (int offset = -RADIUS; offset <= RADIUS; ++offset) sum += in[i + offset];
    out[i] = sum;
}
"""


def test_a_view_reads_the_elements_before_its_start(to_device, to_host, rng):
    n = 200
    values = rng.integers(-8, 9, n + 2 * RADIUS).astype(np.float32)  # small integers: the sums are exact
    base = to_device(values)
    out = to_device(np.zeros(n, np.float32))
    kernel = backend.RawKernel(STENCIL, "stencil_1d")
    with backend.checks(bounds=True, races=True):
        kernel(((n + 63) // 64,), (64,), (out, base[RADIUS:], np.int32(n)))
    expected = np.convolve(values.astype(np.float64), np.ones(2 * RADIUS + 1), mode="valid")
    assert to_host(out).tolist() == expected.tolist()


@pytest.mark.cpu_only
def test_a_view_read_past_the_start_of_its_allocation_is_reported(to_device):
    # only RADIUS - 1 elements before the view: thread 0 reads one element before the allocation
    from gpt2_cupy.cpu import OutOfBoundsError
    n = 64
    base = to_device(np.ones(n + 2 * RADIUS, np.float32))
    kernel = backend.RawKernel(STENCIL, "stencil_1d")
    with pytest.raises(OutOfBoundsError, match=r"'in' at element -3; .*a view into an allocation of 70, so the valid "
                                               r"indices are -2\.\.67"):
        with backend.checks(bounds=True):
            kernel((1,), (64,), (to_device(np.zeros(n, np.float32)), base[RADIUS - 1:], np.int32(n)))


@pytest.mark.cpu_only
def test_a_view_read_past_the_end_of_its_allocation_is_reported(to_device):
    from gpt2_cupy.cpu import OutOfBoundsError
    n = 64
    base = to_device(np.ones(n + 2 * RADIUS, np.float32))
    kernel = backend.RawKernel(STENCIL, "stencil_1d")
    with pytest.raises(OutOfBoundsError, match=r"'in' at element 66; .*valid indices are -4\.\.65"):
        with backend.checks(bounds=True):
            kernel((1,), (64,), (to_device(np.zeros(n, np.float32)), base[RADIUS + 1:], np.int32(n)))


# probs may be null (0): then the kernel neither reads nor writes it. WRITE_PROBS says so at compile time too, and
# the row's address is formed from probs either way, as llm.c's kernels form theirs.
OPTIONAL_OUTPUT = r"""
template <bool WRITE_PROBS>
__global__ void softmax_rows(float* losses, float* probs, const float* logits, const int* targets, int columns)
{
    const float* row = logits + blockIdx.x * columns;
    float* probs_row = probs + blockIdx.x * columns;  // an address formed from a null pointer, never used then
    if (threadIdx.x != 0) return;
    float largest = row[0];
    for (int c = 1; c < columns; ++c) largest = fmaxf(largest, row[c]);
    float total = 0.0f;
    for (int c = 0; c < columns; ++c) total += expf(row[c] - largest);
    for (int c = 0; c < columns; ++c)
        if (WRITE_PROBS && probs != nullptr) probs_row[c] = expf(row[c] - largest) / total;
    losses[blockIdx.x] = -(row[targets[blockIdx.x]] - largest - logf(total));
}
"""


@pytest.mark.parametrize("write_probs", [False, True])
def test_a_null_pointer_the_kernel_never_dereferences_is_not_reported(write_probs, to_device, to_host, rng):
    rows, columns = 4, 10
    logits = rng.standard_normal((rows, columns)).astype(np.float32)
    targets = rng.integers(0, columns, rows).astype(np.int32)
    name = f"softmax_rows<{'true' if write_probs else 'false'}>"
    kernel = backend.RawModule(code=OPTIONAL_OUTPUT, name_expressions=[name]).get_function(name)
    losses = to_device(np.zeros(rows, np.float32))
    with backend.checks(bounds=True, races=True):
        kernel((rows,), (32,), (losses, 0, to_device(logits), to_device(targets), np.int32(columns)))
    x = logits.astype(np.float64)
    log_softmax = x - x.max(1, keepdims=True) - np.log(np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True))
    np.testing.assert_allclose(to_host(losses), -log_softmax[np.arange(rows), targets], rtol=1e-5, atol=1e-6)
