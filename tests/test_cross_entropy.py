"""Cross-entropy fused with its softmax (chapter 09): gpt2_cupy.ops.cross_entropy.

Every result is compared with a float64 numpy reference, whose gradient is itself checked against central
finite differences; on a GPU with PyTorch installed, also with torch.nn.functional.cross_entropy.
Vocabularies: 1, 33, 50257 (GPT-2's: a multiple of nothing) and 50304 (llm.c's padded one); neither is a
multiple of the 1024 threads of a row's block.
"""

import numpy as np
import pytest

from gpt2_cupy import backend
from gpt2_cupy.ops.cross_entropy import can_cache_row, cross_entropy_backward, cross_entropy_forward, cross_entropy_fused
from gpt2_cupy.testing import finite_difference_gradient, relative_error, torch_or_none

TOLERANCE = 1e-5
VOCABULARIES = [1, 33, 50257, 50304]


def reference(logits, targets, ignore_index):
    """(loss, lse, dlogits) in float64: the mean over counted rows, and its gradient for dout = 1."""
    x = logits.astype(np.float64)
    maximum = x.max(axis=1, keepdims=True)
    lse = (maximum + np.log(np.exp(x - maximum).sum(axis=1, keepdims=True)))[:, 0]
    counted = targets != ignore_index
    rows, safe_targets = np.arange(len(targets)), np.where(counted, targets, 0)
    count = counted.sum()
    loss = (lse - x[rows, safe_targets])[counted].sum() / count if count else np.nan
    dlogits = np.exp(x - lse[:, None])
    dlogits[rows, safe_targets] -= 1.0
    dlogits[~counted] = 0.0
    return loss, lse, dlogits / max(count, 1)


def scalar(value):
    """A float32 device array of shape () (to_device would make it (1,): ascontiguousarray is at least 1-d)."""
    return backend.xp.array(np.float32(value))


def inputs(rng, N, V, scale=3.0, ignored=(0,), ignore_index=-1):
    logits = (rng.normal(size=(N, V)) * scale).astype(np.float32)
    targets = rng.integers(0, V, N).astype(np.int32)
    targets[list(ignored)] = ignore_index
    return logits, targets


def test_reference_gradient_matches_finite_differences(rng):
    logits, targets = inputs(rng, 4, 7)
    x = logits.astype(np.float64)
    numeric = finite_difference_gradient(lambda: reference(x, targets, -1)[0], x)
    assert relative_error(reference(x, targets, -1)[2], numeric) < 1e-8


@pytest.mark.parametrize("V", VOCABULARIES)
def test_forward_backward_and_fused_match_float64(V, rng, to_device, to_host):
    logits, targets = inputs(rng, 5, V, ignored=(1,))
    loss_ref, lse_ref, dlogits_ref = reference(logits, targets, -1)
    x, t = to_device(logits), to_device(targets)
    loss, lse = cross_entropy_forward(x, t, ignore_index=-1)
    dout = scalar(0.5)
    dlogits = cross_entropy_backward(dout, x, t, lse, ignore_index=-1)
    fused_loss, fused_dlogits = cross_entropy_fused(x, t, ignore_index=-1)
    assert loss.shape == () and loss.dtype == np.float32
    assert relative_error(to_host(loss), loss_ref) < TOLERANCE
    assert relative_error(to_host(lse), lse_ref) < TOLERANCE
    assert relative_error(to_host(dlogits), 0.5 * dlogits_ref) < TOLERANCE
    assert relative_error(to_host(fused_loss), loss_ref) < TOLERANCE
    assert relative_error(to_host(fused_dlogits), dlogits_ref) < TOLERANCE
    assert np.array_equal(to_host(x), logits)  # not in place unless asked


@pytest.mark.parametrize("V", [2, 3, 4, 5, 6, 7, 9, 1031])
def test_rows_starting_anywhere_against_a_16_byte_boundary(V, rng, to_device, to_host):
    """The cached kernel reads a row as a head of 0 to 3 floats, float4s and a tail: with V not a multiple of 4,
    successive rows start at every offset from a 16-byte boundary, and short rows may be all head and tail."""
    logits, targets = inputs(rng, 9, V, ignored=(3,))
    x, t = to_device(logits), to_device(targets)
    assert can_cache_row(V, x, x)
    loss, dlogits = cross_entropy_fused(x, t, ignore_index=-1)
    loss_ref, _, dlogits_ref = reference(logits, targets, -1)
    assert relative_error(to_host(loss), loss_ref) < TOLERANCE
    assert relative_error(to_host(dlogits), dlogits_ref) < TOLERANCE


def test_arrays_off_16_bytes_take_the_kernel_that_reads_twice(rng, to_device, to_host):
    """float4s need 16-byte aligned rows: logits one float into an allocation cannot be cached that way."""
    N, V = 4, 1031
    logits, targets = inputs(rng, N, V)
    storage = to_device(np.concatenate([np.zeros(1, np.float32), logits.ravel()]))
    x, t = storage[1:].reshape(N, V), to_device(targets)
    assert not can_cache_row(V, x, x)
    loss, dlogits = cross_entropy_fused(x, t, ignore_index=-1)
    loss_ref, _, dlogits_ref = reference(logits, targets, -1)
    assert relative_error(to_host(loss), loss_ref) < TOLERANCE
    assert relative_error(to_host(dlogits), dlogits_ref) < TOLERANCE


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_backward_by_16_byte_groups_gives_the_bits_of_one_at_a_time(dtype, rng, to_device, to_host):
    """Rows of whole 16-byte groups on 16 bytes (V = 1032: 258 float4s, 129 groups of 8 bf16) take the grouped
    gradient; the same logits one element into an allocation take the element-by-element loop. Every element
    of dlogits has the same bits both ways, and is within the storage's rounding of float64."""
    from ml_dtypes import bfloat16
    N, V = 3, 1032
    logits, targets = inputs(rng, N, V, ignored=())
    logits = logits.astype(bfloat16 if dtype == "bfloat16" else np.float32)
    aligned = to_device(logits)
    storage = to_device(np.concatenate([np.zeros(1, logits.dtype), logits.ravel()]))
    shifted = storage[1:].reshape(N, V)
    t = to_device(targets)
    _, lse = cross_entropy_forward(aligned, t, ignore_index=-1)
    grouped = to_host(cross_entropy_backward(scalar(1.0), aligned, t, lse, ignore_index=-1))
    single = to_host(cross_entropy_backward(scalar(1.0), shifted, t, lse, ignore_index=-1,
                                            out=to_device(np.zeros(N * V + 1, logits.dtype))[1:].reshape(N, V)))
    assert np.array_equal(grouped.view(np.uint8), single.view(np.uint8))
    expected = reference(logits.astype(np.float64), targets, -1)[2]
    unit = 2.0 ** -8 if dtype == "bfloat16" else 1e-6
    assert np.all(np.abs(grouped.astype(np.float64) - expected) <= unit * np.abs(expected) + 1e-7)


def test_in_place_gives_the_same_bits(rng, to_device, to_host):
    logits, targets = inputs(rng, 6, 50257, ignored=(2, 4))
    x, t = to_device(logits), to_device(targets)
    loss, dlogits = cross_entropy_fused(x, t, ignore_index=-1)
    in_place_loss, in_place = cross_entropy_fused(x, t, ignore_index=-1, dlogits=x)
    assert in_place is x
    assert np.array_equal(to_host(in_place), to_host(dlogits)) and to_host(in_place_loss) == to_host(loss)
    y = to_device(logits)
    _, lse = cross_entropy_forward(y, t, ignore_index=-1)
    backward_in_place = cross_entropy_backward(scalar(1.0), y, t, lse, ignore_index=-1, out=y)
    assert relative_error(to_host(backward_in_place), reference(logits, targets, -1)[2]) < TOLERANCE


def test_large_logits_do_not_overflow(rng, to_device, to_host):
    logits, targets = inputs(rng, 3, 1000, ignored=())
    logits[0, :10] = 3e38   # exp would overflow float32 without subtracting the maximum
    logits[1] += 1e4
    logits[2, 5] = -3e38
    loss, dlogits = cross_entropy_fused(to_device(logits), to_device(targets), ignore_index=-1)
    loss_ref, _, dlogits_ref = reference(logits, targets, -1)
    assert np.isfinite(to_host(loss)) and relative_error(to_host(loss), loss_ref) < TOLERANCE
    dlogits = to_host(dlogits)
    assert relative_error(dlogits[[0, 2]], dlogits_ref[[0, 2]]) < TOLERANCE
    # Near 1e4 a float32 lse carries up to half an ulp of 1e4 (5e-4) of rounding, and every probability
    # exp(x - lse) that relative error; the reference sees the same float32 logits but rounds nothing.
    assert relative_error(dlogits[1], dlogits_ref[1]) < 2**-24 * 1e4


@pytest.mark.parametrize("ignore_index", [-100, -1, 7])
def test_ignored_targets_and_all_ignored(ignore_index, rng, to_device, to_host):
    logits, targets = inputs(rng, 9, 33, ignored=(0, 3, 8), ignore_index=ignore_index)
    targets[targets == 7] = ignore_index  # a real class id can be the ignored one
    loss, dlogits = cross_entropy_fused(to_device(logits), to_device(targets), ignore_index=ignore_index)
    loss_ref, _, dlogits_ref = reference(logits, targets, ignore_index)
    assert relative_error(to_host(loss), loss_ref) < TOLERANCE
    assert relative_error(to_host(dlogits), dlogits_ref) < TOLERANCE
    everything = np.full(9, ignore_index, dtype=np.int32)
    loss, dlogits = cross_entropy_fused(to_device(logits), to_device(everything), ignore_index=ignore_index)
    assert np.isnan(to_host(loss)) and not to_host(dlogits).any()  # torch: nan, and a zero gradient
    loss, _ = cross_entropy_forward(to_device(logits), to_device(everything), ignore_index=ignore_index)
    assert np.isnan(to_host(loss))


def test_target_out_of_range_makes_the_loss_nan(rng, to_device, to_host):
    logits, targets = inputs(rng, 4, 33, ignored=())
    targets[2] = 33
    loss, dlogits = cross_entropy_fused(to_device(logits), to_device(targets), ignore_index=-1)
    assert np.isnan(to_host(loss)) and np.isnan(to_host(dlogits)[2]).all() and np.isfinite(to_host(dlogits)[0]).all()


def test_many_rows_sum_deterministically(rng, to_device, to_host):
    logits, targets = inputs(rng, 3000, 5, ignored=range(0, 3000, 7))
    x, t = to_device(logits), to_device(targets)
    first = to_host(cross_entropy_fused(x, t, ignore_index=-1)[0])
    assert to_host(cross_entropy_fused(x, t, ignore_index=-1)[0]) == first
    assert relative_error(first, reference(logits, targets, -1)[0]) < TOLERANCE


def test_bad_inputs_name_the_op_and_argument(to_device):
    logits = to_device(np.zeros((4, 10), np.float32))
    targets = to_device(np.zeros(4, np.int32))
    with pytest.raises(TypeError, match="cross_entropy_forward: targets .*int32"):
        cross_entropy_forward(logits, to_device(np.zeros(4, np.int64)))
    with pytest.raises(TypeError, match="cross_entropy_fused: logits .*float32"):
        cross_entropy_fused(to_device(np.zeros((4, 10), np.float64)), targets)
    with pytest.raises(ValueError, match="cross_entropy_fused: targets"):
        cross_entropy_fused(logits, to_device(np.zeros(5, np.int32)))
    with pytest.raises(ValueError, match="cross_entropy_fused: dlogits"):
        cross_entropy_fused(logits, targets, dlogits=to_device(np.zeros((4, 11), np.float32)))
    _, lse = cross_entropy_forward(logits, targets)
    with pytest.raises(ValueError, match="cross_entropy_backward: dout"):
        cross_entropy_backward(to_device(np.ones(1, np.float32)), logits, targets, lse)
    with pytest.raises(TypeError, match="cross_entropy_forward: ignore_index"):
        cross_entropy_forward(logits, targets, ignore_index=0.5)


@pytest.mark.skipif(torch_or_none() is None or backend.name != "cuda", reason="needs PyTorch and a GPU")
def test_matches_torch(rng, to_device, to_host):
    torch = torch_or_none()
    logits, targets = inputs(rng, 64, 50257, ignored=(0, 5))
    reference_logits = torch.tensor(logits, device="cuda", requires_grad=True)
    torch_loss = torch.nn.functional.cross_entropy(reference_logits, torch.tensor(targets, device="cuda").long(),
                                                   ignore_index=-1)
    torch_loss.backward()
    loss, dlogits = cross_entropy_fused(to_device(logits), to_device(targets), ignore_index=-1)
    assert relative_error(to_host(loss), torch_loss.item()) < TOLERANCE
    assert relative_error(to_host(dlogits), reference_logits.grad.cpu().numpy()) < TOLERANCE
