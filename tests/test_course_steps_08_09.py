"""The teaching steps of chapters 08 and 09 (kernels/steps/), against float64 numpy on sizes that are not
multiples of the block: the fused attention forward with one thread per query row (from global memory, then
from shared-memory tiles), its backward (also against central differences), and cross-entropy with one block
per row."""

import math

import numpy as np
import pytest

from gpt2_cupy import backend, kernels
from gpt2_cupy.testing import finite_difference_gradient, relative_error

ROWS_PER_BLOCK = 64
FORWARD_STEPS = [("attention_forward_row", "attention_forward_row"),
                 ("attention_forward_key_tiles", "attention_forward_key_tiles")]


def step(file_name, kernel_name, d):
    name = f"{kernel_name}<{d}>"
    return kernels.function(f"steps/{file_name}", name, name_expressions=(name,))


def attention_reference(q, k, v, causal):
    """out, lse and P of (heads, T, d) arrays, in float64."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    T, d = q.shape[-2:]
    scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(d)
    scores = np.where(np.tril(np.ones((T, T), bool)) | (not causal), scores, -np.inf)
    top = scores.max(axis=-1, keepdims=True)
    lse = top + np.log(np.exp(scores - top).sum(axis=-1, keepdims=True))
    p = np.exp(scores - lse)
    return p @ v, lse[..., 0], p


def forward(file_name, kernel_name, q, k, v, causal):
    heads, T, d = q.shape
    out, lse = backend.xp.empty((heads, T, d), np.float32), backend.xp.empty((heads, T), np.float32)
    step(file_name, kernel_name, d)((math.ceil(T / ROWS_PER_BLOCK), heads), (ROWS_PER_BLOCK,),
                                    (out, lse, *(backend.xp.asarray(a) for a in (q, k, v)), np.int32(T), np.int32(causal)))
    return out, lse


def backward(dout, q, k, v, out, lse, causal):
    heads, T, d = q.shape
    dq, dk, dv = (backend.xp.empty((heads, T, d), np.float32) for _ in range(3))
    rowdot = backend.xp.empty((heads, T), np.float32)
    dout, q, k, v = (backend.xp.asarray(np.asarray(a, np.float32)) for a in (dout, q, k, v))
    grid, sizes = (math.ceil(T / ROWS_PER_BLOCK), heads), (np.int32(T), np.int32(causal))
    step("attention_backward_rows", "attention_backward_dq_row", d)(
        grid, (ROWS_PER_BLOCK,), (dq, rowdot, dout, out, q, k, v, lse, *sizes))
    step("attention_backward_rows", "attention_backward_dk_dv_row", d)(
        grid, (ROWS_PER_BLOCK,), (dk, dv, dout, q, k, v, lse, rowdot, *sizes))
    return dq, dk, dv


@pytest.mark.parametrize("file_name, kernel_name", FORWARD_STEPS)
@pytest.mark.parametrize("T", [1, 17, 65, 130])
@pytest.mark.parametrize("d", [32, 64])
@pytest.mark.parametrize("causal", [True, False])
def test_forward_steps_match_float64(file_name, kernel_name, T, d, causal, rng):
    q, k, v = (rng.standard_normal((3, T, d)).astype(np.float32) for _ in range(3))
    out, lse = forward(file_name, kernel_name, q, k, v, causal)
    expected_out, expected_lse, _ = attention_reference(q, k, v, causal)
    assert relative_error(out, expected_out) < 1e-5
    assert relative_error(lse, expected_lse) < 1e-5


@pytest.mark.parametrize("T", [1, 17, 65, 130])
@pytest.mark.parametrize("causal", [True, False])
def test_backward_step_matches_float64(T, causal, rng):
    q, k, v, dout = (rng.standard_normal((2, T, 32)).astype(np.float32) for _ in range(4))
    out, lse = forward(*FORWARD_STEPS[1], q, k, v, causal)
    _, _, p = attention_reference(q, k, v, causal)
    dout64 = dout.astype(np.float64)
    dp = dout64 @ np.swapaxes(v.astype(np.float64), -1, -2)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True)) / math.sqrt(32)
    expected = (ds @ k.astype(np.float64), np.swapaxes(ds, -1, -2) @ q.astype(np.float64),
                np.swapaxes(p, -1, -2) @ dout64)
    largest = max(np.abs(e).max() for e in expected)  # T = 1: dq = dk = 0
    for got, reference in zip(backward(dout, q, k, v, out, lse, causal), expected):
        assert np.abs(backend.asnumpy(got) - reference).max() / largest < 1e-5


def test_backward_step_matches_central_differences(rng):
    q, k, v, dout = (rng.standard_normal((1, 6, 32)) for _ in range(4))
    out, lse = forward(*FORWARD_STEPS[0], *(a.astype(np.float32) for a in (q, k, v)), True)
    gradients = backward(dout, q, k, v, out, lse, True)
    loss = lambda: float(np.sum(dout * attention_reference(q, k, v, True)[0]))
    for got, array in zip(gradients, (q, k, v)):
        assert relative_error(got, finite_difference_gradient(loss, array)) < 1e-5


def test_backward_step_gives_the_same_bits_twice(rng):
    q, k, v, dout = (rng.standard_normal((2, 130, 64)).astype(np.float32) for _ in range(4))
    out, lse = forward(*FORWARD_STEPS[1], q, k, v, True)
    first, second = backward(dout, q, k, v, out, lse, True), backward(dout, q, k, v, out, lse, True)
    assert all(np.array_equal(backend.asnumpy(a), backend.asnumpy(b)) for a, b in zip(first, second))


@pytest.mark.parametrize("V", [1, 33, 50257])
def test_cross_entropy_block_per_row_matches_float64(V, rng):
    N, ignore_index = 5, -1
    logits = rng.normal(0.0, 3.0, (N, V)).astype(np.float32)
    targets = rng.integers(0, V, N).astype(np.int32)
    targets[1] = ignore_index
    kernel = kernels.function("steps/cross_entropy_block_per_row")
    kernel.max_dynamic_shared_size_bytes = 227 * 1024 - 256  # past 48 KiB; 256 B are its static arrays
    dlogits, row_losses = backend.xp.empty((N, V), np.float32), backend.xp.empty(N, np.float32)
    kernel((N,), (1024,), (dlogits, row_losses, backend.xp.asarray(logits), backend.xp.asarray(targets), np.int32(V),
                           np.int32(ignore_index), np.float32(1 / 4)), shared_mem=4 * V)
    z = logits.astype(np.float64)
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    counted = targets != ignore_index
    safe = np.where(counted, targets, 0)
    expected_losses = np.where(counted, lse - z[np.arange(N), safe], 0.0)
    expected = np.exp(z - lse[:, None])
    expected[np.arange(N), safe] -= 1
    expected[~counted] = 0
    assert relative_error(row_losses, expected_losses) < 1e-5
    assert relative_error(dlogits, expected / 4) < 1e-5
