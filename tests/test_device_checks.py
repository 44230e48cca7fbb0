"""Range checks on the device (gpt2_cupy.device_checks): cross_entropy's targets and embedding's ids are
checked by a kernel, with no host read in the call, and the error is raised at the next synchronisation,
inside a CUDA graph's replay too."""

import math

import numpy as np
import pytest

import gpt2_cupy
from gpt2_cupy import backend, device_checks, graphs
from gpt2_cupy.autograd import Tensor
from gpt2_cupy.nn import functional as F

C = 11  # classes


@pytest.fixture(autouse=True)
def no_pending_check():
    """A test that leaves a failed check unread must not fail the next test's first host read."""
    device_checks.clear()
    yield
    device_checks.clear()


@pytest.fixture
def host_reads(monkeypatch):
    """Counts every host read and synchronisation the backend makes (the flags' own reads included)."""
    counts = {"reads": 0}
    for name in ("asnumpy", "unchecked_asnumpy", "synchronize"):
        original = getattr(backend, name)

        def counted(*arguments, original=original):
            counts["reads"] += 1
            return original(*arguments)

        monkeypatch.setattr(backend, name, counted)
    return counts


def cross_entropy_float64(logits, targets, ignore_index):
    logits = logits.astype(np.float64)
    log_p = logits - logits.max(1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(1, keepdims=True))
    kept = targets != ignore_index
    return -log_p[kept, targets[kept]].mean()


def logits_tensor(rng, to_device, rows=6):
    return Tensor(to_device(rng.normal(size=(rows, C)).astype(np.float32)), requires_grad=True)


def test_a_bad_target_raises_at_the_next_read_naming_its_row_and_the_call_reads_nothing(rng, to_device,
                                                                                          host_reads):
    logits = logits_tensor(rng, to_device)
    targets = to_device(np.array([1, 4, 11, 0, -1, 3], np.int64))
    loss = F.cross_entropy(logits, targets, ignore_index=-1)
    assert host_reads["reads"] == 0  # no wait for the device in the call
    with pytest.raises(IndexError, match=r"cross_entropy: Target 11 is out of bounds: target\[2\] = 11, but input "
                                         r"has 11 classes .*ignore_index = -1"):
        loss.item()
    assert math.isnan(loss.item())  # raised once: the flag is cleared, and the bad row's loss is NaN


def test_the_first_bad_row_is_named_whatever_order_the_threads_ran(rng, to_device):
    targets = np.arange(300, dtype=np.int64) % C
    targets[[271, 40, 199]] = [-7, 12, C]  # 40 is the first bad row; -100 (ignore_index) is not bad
    targets[10] = -100
    loss = F.cross_entropy(Tensor(to_device(rng.normal(size=(300, C)).astype(np.float32))), to_device(targets))
    with pytest.raises(IndexError, match=r"Target 12 is out of bounds: target\[40\] = 12"):
        loss.item()
    targets[40] = 0
    F.cross_entropy(Tensor(to_device(rng.normal(size=(300, C)).astype(np.float32))), to_device(targets))
    with pytest.raises(IndexError, match=r"Target 11 is out of bounds: target\[199\] = 11"):
        backend.synchronize()
    targets[199] = 0
    F.cross_entropy(Tensor(to_device(rng.normal(size=(300, C)).astype(np.float32))), to_device(targets))
    with pytest.raises(IndexError, match=r"Target -7 is out of bounds: target\[271\] = -7"):
        backend.synchronize()


SYNC_POINTS = {
    ".item()": lambda loss: loss.item(),
    "float()": float,
    ".tolist()": lambda loss: loss.tolist(),
    ".numpy()": lambda loss: loss.detach().numpy(),
    "print": repr,
    "backend.asnumpy": lambda loss: backend.asnumpy(loss.data),
    "backend.synchronize()": lambda loss: backend.synchronize(),
    "gpt2_cupy.cuda.synchronize()": lambda loss: gpt2_cupy.cuda.synchronize(),
}


@pytest.mark.parametrize("read", SYNC_POINTS, ids=list(SYNC_POINTS))
def test_every_synchronisation_point_reports(read, rng, to_device):
    loss = F.cross_entropy(logits_tensor(rng, to_device), to_device(np.array([1, 2, 3, 4, 5, -3], np.int64)))
    with pytest.raises(IndexError, match=r"Target -3 is out of bounds: target\[5\]"):
        SYNC_POINTS[read](loss)


def test_good_targets_give_the_float64_loss_and_gradient_with_no_error(rng, to_device, to_host):
    logits = logits_tensor(rng, to_device, rows=9)
    targets = rng.integers(0, C, size=9)
    targets[[2, 7]] = -100
    loss = F.cross_entropy(logits, to_device(targets))
    loss.backward()
    values = to_host(logits.data)
    expected = cross_entropy_float64(values, targets, -100)
    assert abs(loss.item() - expected) < 1e-6 * abs(expected)
    softmax = np.exp(values - values.max(1, keepdims=True))
    softmax /= softmax.sum(1, keepdims=True)
    onehot = np.zeros_like(softmax)
    kept = targets != -100
    onehot[np.arange(9)[kept], targets[kept]] = 1
    expected_gradient = (softmax - onehot) * kept[:, None] / kept.sum()
    np.testing.assert_allclose(to_host(logits.grad), expected_gradient, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_other_reductions_defer_the_error_too(reduction, rng, to_device):
    losses = F.cross_entropy(logits_tensor(rng, to_device), to_device(np.array([1, 2, 30, 4, 5, 6], np.int64)),
                             reduction=reduction)
    with pytest.raises(IndexError, match=r"Target 30 is out of bounds: target\[2\]"):
        losses.tolist()
    rows = np.atleast_1d(np.array(losses.tolist()))
    assert np.isnan(rows).any()


def test_a_bad_embedding_id_raises_at_the_next_read_naming_its_place(rng, to_device, host_reads):
    weight = Tensor(to_device(rng.normal(size=(7, 4)).astype(np.float32)), requires_grad=True)
    ids = to_device(np.array([[0, 6, 2], [7, 1, 3]], np.int64))
    rows = F.embedding(ids, weight)
    assert host_reads["reads"] == 0
    with pytest.raises(IndexError, match=r"embedding: index out of range in self: idx\[1, 0\] = 7, but weight has 7 "
                                         r"rows"):
        rows.sum().item()
    good = rng.integers(0, 7, size=(2, 3))
    np.testing.assert_array_equal(F.embedding(to_device(good), weight).detach().numpy(),
                                  weight.detach().numpy()[good])


def test_a_captured_step_reports_a_bad_target_at_the_read_after_its_replay(rng, to_device):
    logits = to_device(rng.normal(size=(6, C)).astype(np.float32))
    targets = to_device(np.array([1, 2, 3, 4, 5, 6], np.int32))

    def step():
        return F.cross_entropy(Tensor(logits), targets)

    pool = graphs.graph_pool_handle()
    with graphs.use_pool(pool):
        step()
    g = gpt2_cupy.cuda.CUDAGraph()
    with gpt2_cupy.cuda.graph(g, pool=pool):
        loss = step()
    g.replay()
    expected = cross_entropy_float64(backend.asnumpy(logits), np.arange(1, 7), -100)
    assert abs(loss.item() - expected) < 1e-6 * abs(expected)
    backend.copy_into(targets, to_device(np.array([1, 2, 3, 4, -5, 6], np.int32)))
    g.replay()
    with pytest.raises(IndexError, match=r"Target -5 is out of bounds: target\[4\]"):
        loss.item()
    backend.copy_into(targets, to_device(np.array([1, 2, 3, 4, 5, 6], np.int32)))
    g.replay()
    assert abs(loss.item() - expected) < 1e-6 * abs(expected)  # the error went with the bad batch
