"""backend.launch_dependent, CUDA's programmatic dependent launch (kernels/include/dependent_launch.cuh), on
both backends: a chain of kernels that each start before the one ahead of them has ended, and wait only where
they read its output, gives exactly the results of ordinary launches, launch by launch and replayed from a
captured CUDA graph. Each consumer reads elements that other blocks of the producer wrote (a missing wait
would read them unwritten on a GPU), and reads a table written by no kernel before its wait, as the GEMV reads
its weights. The CPU executor runs the instructions as no-ops: its launches never overlap."""

import numpy as np
import pytest

import gpt2_cupy
from gpt2_cupy import backend

CHAIN = r"""
#include "dependent_launch.cuh"

// out[i] = 3 x[n - 1 - i] + table[i % 4] after `rounds` rounds of x -> 5 x + 1, modulo 2^32: exact, so any
// element read before its producer wrote it shows.
extern "C" __global__ void step(unsigned* out, const unsigned* x, const unsigned* table, int n, int rounds)
{
    let_next_kernel_start();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    unsigned offset = i < n ? table[i % 4] : 0;  // before the wait: no kernel of the chain writes the table
    wait_for_previous_kernel();
    if (i < n) {
        unsigned v = x[n - 1 - i];               // written by another block of the kernel before
        for (int r = 0; r < rounds; r++) v = 5 * v + 1;
        out[i] = 3 * v + offset;
    }
}
"""

N, ROUNDS, STEPS = 5000, 50, 12


def reference(x, table):
    v = x.astype(np.uint64)
    for _ in range(STEPS):
        w = v[::-1].copy()
        for _ in range(ROUNDS):
            w = (5 * w + 1) % 2**32
        v = (3 * w + table[np.arange(N) % 4].astype(np.uint64)) % 2**32
    return v.astype(np.uint32)


def run_chain(kernel, buffers, table, launch):
    for s in range(STEPS):
        out, x = buffers[(s + 1) % 2], buffers[s % 2]
        launch(kernel, ((N + 127) // 128,), (128,), (out, x, table, np.int32(N), np.int32(ROUNDS)))
    return buffers[STEPS % 2]


def ordinary(kernel, grid, block, args):
    kernel(grid, block, args)


@pytest.mark.parametrize("launch", [backend.launch_dependent, ordinary], ids=["dependent", "ordinary"])
def test_dependent_launches_give_the_results_of_ordinary_ones(rng, to_device, to_host, launch):
    kernel = backend.RawKernel(CHAIN, "step")
    x = rng.integers(0, 2**32, N, dtype=np.uint64).astype(np.uint32)
    table = rng.integers(0, 2**32, 4, dtype=np.uint64).astype(np.uint32)
    buffers = [to_device(x), to_device(np.zeros(N, np.uint32))]
    result = run_chain(kernel, buffers, to_device(table), launch)
    np.testing.assert_array_equal(to_host(result), reference(x, table))


def test_dependent_launches_replayed_from_a_graph(rng, to_device, to_host):
    kernel = backend.RawKernel(CHAIN, "step")
    table = to_device(rng.integers(0, 2**32, 4, dtype=np.uint64).astype(np.uint32))
    buffers = [to_device(np.zeros(N, np.uint32)) for _ in range(2)]
    g = gpt2_cupy.cuda.CUDAGraph()
    with gpt2_cupy.cuda.graph(g):
        result = run_chain(kernel, buffers, table, backend.launch_dependent)
    for _ in range(3):
        x = rng.integers(0, 2**32, N, dtype=np.uint64).astype(np.uint32)
        backend.copy_into(buffers[0], to_device(x))
        g.replay()
        np.testing.assert_array_equal(to_host(result), reference(x, to_host(table)))


def test_switched_off_dependent_launches_are_ordinary_ones(rng, to_device, to_host, monkeypatch):
    monkeypatch.setattr(backend, "DEPENDENT_LAUNCHES", False)
    kernel = backend.RawKernel(CHAIN, "step")
    x = rng.integers(0, 2**32, N, dtype=np.uint64).astype(np.uint32)
    table = rng.integers(0, 2**32, 4, dtype=np.uint64).astype(np.uint32)
    result = run_chain(kernel, [to_device(x), to_device(np.zeros(N, np.uint32))], to_device(table),
                       backend.launch_dependent)
    np.testing.assert_array_equal(to_host(result), reference(x, table))
