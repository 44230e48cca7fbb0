"""Chapter 16b's FlashAttention steps (kernels/steps/attention_*.cu) against float64 numpy, on ragged T.

Inputs are bf16 and the reference takes the same bf16 values, so the error is the kernels' own: P (and dS)
rounded to bf16 before their products, relative u = 2^-8 on each term, and float32 sums.
"""

import ml_dtypes
import numpy as np
import pytest

from gpt2_cupy import backend, kernels
from gpt2_cupy.testing import finite_difference_gradient, relative_error

D = 64
TOLERANCE = 2.0 ** -7   # a few roundings of P or dS to bf16 (u = 2^-8), relative to the largest element


def blocks(n, size):
    return (n + size - 1) // size


def bf16(rng, shape):
    return rng.standard_normal(shape).astype(ml_dtypes.bfloat16)


def bits(array):
    return np.ascontiguousarray(array).view(np.uint16)


def reference(q, k, v, dout, causal):
    """out, lse and dq, dk, dv in float64 from the bf16 inputs; k, v shared by heads // kv_heads query heads."""
    group = q.shape[0] // k.shape[0]
    q, k, v, dout = (a.astype(np.float64) for a in (q, k, v, dout))
    k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
    T, scale = q.shape[1], 1 / np.sqrt(D)
    s = scale * q @ k.transpose(0, 2, 1)
    if causal:
        s[:, np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] = -np.inf
    lse = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
    p = np.exp(s - lse[..., None])
    out = p @ v
    dv = p.transpose(0, 2, 1) @ dout
    ds = p * (dout @ v.transpose(0, 2, 1) - (dout * out).sum(-1, keepdims=True))
    dq, dk = scale * ds @ k, scale * ds.transpose(0, 2, 1) @ q
    fold = lambda a: a.reshape(-1, group, *a.shape[1:]).sum(1)   # a key head's gradient sums over its group
    return out, lse, dq, fold(dk), fold(dv)


SIZES = [(1, 1, 1), (2, 2, 17), (4, 2, 40), (3, 1, 33)]   # (heads, kv_heads, T): T not a multiple of 16


@pytest.mark.parametrize("T", [1, 17, 40])
def test_scores(T, rng, to_device, to_host):
    q, k = bf16(rng, (2, T, D)), bf16(rng, (2, T, D))
    scores = to_device(np.full((2, T, T), np.nan, dtype=np.float32))
    kernels.function("steps/attention_scores_mma")((blocks(T, 16), 2), (32,), (
        scores, to_device(bits(q)), to_device(bits(k)), np.int32(T), np.float32(D ** -0.5)))
    expected = D ** -0.5 * q.astype(np.float64) @ k.astype(np.float64).transpose(0, 2, 1)
    assert relative_error(to_host(scores), expected) < 2.0 ** -16   # exact products, float32 sums (truncated on a GPU)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads, kv_heads, T", SIZES)
def test_forward_steps(heads, kv_heads, T, causal, rng, to_device, to_host):
    q, k, v = bf16(rng, (heads, T, D)), bf16(rng, (kv_heads, T, D)), bf16(rng, (kv_heads, T, D))
    out_expected, lse_expected, *_ = reference(q, k, v, np.zeros_like(q), causal)
    names = ["attention_forward_mma"] + (["attention_forward_online_softmax"] if heads == kv_heads else [])
    for name in names:
        out = to_device(np.full((heads, T, D), np.nan, dtype=np.float32))
        lse = to_device(np.full((heads, T), np.nan, dtype=np.float32))
        sizes = (np.int32(T),) if name == "attention_forward_online_softmax" else (
            np.int32(T), np.int32(heads), np.int32(kv_heads))
        kernels.function(f"steps/{name}")((blocks(T, 16), heads), (32,), (
            out, lse, to_device(bits(q)), to_device(bits(k)), to_device(bits(v)), *sizes,
            np.float32(D ** -0.5), np.int32(causal)))
        assert relative_error(to_host(out), out_expected) < TOLERANCE, name
        assert relative_error(to_host(lse), lse_expected) < 2.0 ** -14, name


@pytest.mark.parametrize("strips", [1, 2])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads, kv_heads, T", SIZES + [(2, 1, 150)])
def test_pipelined_forward(heads, kv_heads, T, causal, strips, rng, to_device, to_host):
    """Steps 4 and 5: the cp.async double buffer, with one strip per warp and with two (-DSTRIPS=2); T = 150
    takes several tiles of keys and a partial last block of rows."""
    q, k, v = bf16(rng, (heads, T, D)), bf16(rng, (kv_heads, T, D)), bf16(rng, (kv_heads, T, D))
    out_expected, lse_expected, *_ = reference(q, k, v, np.zeros_like(q), causal)
    out = to_device(np.full((heads, T, D), np.nan, dtype=np.float32))
    lse = to_device(np.full((heads, T), np.nan, dtype=np.float32))
    kernel = kernels.function("steps/attention_forward_pipelined", options=(f"-DSTRIPS={strips}",))
    kernel((blocks(T, 64 * strips), heads), (128,), (out, lse, to_device(bits(q)), to_device(bits(k)), to_device(bits(v)),
                                                     np.int32(T), np.int32(heads), np.int32(kv_heads),
                                                     np.float32(D ** -0.5), np.int32(causal)))
    assert relative_error(to_host(out), out_expected) < TOLERANCE
    assert relative_error(to_host(lse), lse_expected) < 2.0 ** -14


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads, kv_heads, T", SIZES)
def test_backward_passes(heads, kv_heads, T, causal, rng, to_device, to_host):
    q, dout = bf16(rng, (heads, T, D)), bf16(rng, (heads, T, D))
    k, v = bf16(rng, (kv_heads, T, D)), bf16(rng, (kv_heads, T, D))
    out, lse, dq_expected, dk_expected, dv_expected = reference(q, k, v, dout, causal)
    row_dot = (dout.astype(np.float64) * out).sum(-1)
    common = (to_device(bits(q)), to_device(bits(k)), to_device(bits(v)), to_device(bits(dout)),
              to_device(lse.astype(np.float32)), to_device(row_dot.astype(np.float32)), np.int32(T),
              np.int32(heads), np.int32(kv_heads), np.float32(D ** -0.5), np.int32(causal))
    dk, dv = (to_device(np.full((kv_heads, T, D), np.nan, dtype=np.float32)) for _ in range(2))
    kernels.function("steps/attention_backward_dk_dv")((blocks(T, 16), kv_heads), (32,), (dk, dv, *common))
    dq = to_device(np.full((heads, T, D), np.nan, dtype=np.float32))
    kernels.function("steps/attention_backward_dq")((blocks(T, 16), heads), (32,), (dq, *common))
    assert relative_error(to_host(dv), dv_expected) < TOLERANCE
    assert relative_error(to_host(dk), dk_expected) < TOLERANCE
    assert relative_error(to_host(dq), dq_expected) < TOLERANCE


def test_reference_gradient_matches_finite_differences(rng):
    """The float64 reference's backward, the one the kernels are checked against, against central differences."""
    q, k, v = (rng.standard_normal(shape) for shape in [(2, 5, D), (1, 5, D), (1, 5, D)])
    dout = rng.standard_normal((2, 5, D))
    _, _, dq, dk, dv = reference(q, k, v, dout, causal=True)
    for array, gradient in ((q, dq), (k, dk), (v, dv)):
        numeric = finite_difference_gradient(lambda: float((reference(q, k, v, dout, True)[0] * dout).sum()), array)
        assert relative_error(gradient, numeric) < 1e-6


def test_pipelined_forward_has_no_race(rng, to_device):
    """The double buffer under the CPU executor's bounds and race checks: without the barrier after the
    cp.async wait, warps read tile rows other threads copied, and the race check reports it (on a GPU the
    checks are off and this is one more launch)."""
    q, k, v = (to_device(bits(bf16(rng, (2, 150, D)))) for _ in range(3))
    out, lse = to_device(np.zeros((2, 150, D), np.float32)), to_device(np.zeros((2, 150), np.float32))
    for strips in (1, 2):
        kernel = kernels.function("steps/attention_forward_pipelined", options=(f"-DSTRIPS={strips}",))
        with backend.checks(bounds=True, races=True):
            kernel((blocks(150, 64 * strips), 2), (128,), (out, lse, q, k, v, np.int32(150), np.int32(2), np.int32(2),
                                                           np.float32(D ** -0.5), np.int32(True)))
        backend.synchronize()
