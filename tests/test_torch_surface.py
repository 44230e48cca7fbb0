"""PyTorch's surface that Zero-to-Hero, makemore, minGPT and LLMs-from-scratch call (issue 43), each against
float64 numpy or finite differences. Layouts of every op: test_any_layout.py."""

import math

import numpy as np
import pytest

import gpt2_cupy as torch
import gpt2_cupy.nn as nn
from gpt2_cupy import backend
from gpt2_cupy.nn import functional as F
from gpt2_cupy.utils.data import DataLoader, Dataset, RandomSampler, TensorDataset, random_split
from test_any_layout import UNARY_REFERENCES, NO_GRADIENT


def host(t):
    return backend.asnumpy(t.detach().data).astype(np.float64)


@pytest.mark.parametrize("name", [n for n in UNARY_REFERENCES if n not in NO_GRADIENT])
def test_unary_gradient_against_finite_differences(name):
    reference, (low, high) = UNARY_REFERENCES[name]
    x64 = np.random.default_rng(0).uniform(low, high, 7)
    if name == "frac":
        x64 = x64[np.abs(x64 - np.round(x64)) > 0.05]  # away from the jumps
    x = torch.tensor(x64, requires_grad=True)
    getattr(x, name)().sum().backward()
    h = 1e-6
    numeric = (reference(x64 + h) - reference(x64 - h)) / (2 * h)
    assert np.allclose(host(x.grad), numeric, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("name, reference", [("maximum", np.maximum), ("minimum", np.minimum), ("atan2", np.arctan2)])
def test_binary_gradients_against_finite_differences(name, reference):
    a64, b64 = np.random.default_rng(1).uniform(0.3, 2, (2, 6))
    a, b = torch.tensor(a64, requires_grad=True), torch.tensor(b64, requires_grad=True)
    getattr(torch, name)(a, b).sum().backward()
    h = 1e-6
    assert np.allclose(host(a.grad), (reference(a64 + h, b64) - reference(a64 - h, b64)) / (2 * h), rtol=1e-4, atol=1e-5)
    assert np.allclose(host(b.grad), (reference(a64, b64 + h) - reference(a64, b64 - h)) / (2 * h), rtol=1e-4, atol=1e-5)


def test_maximum_splits_the_gradient_of_a_tie():
    a, b = torch.tensor([1.0, 2.0], requires_grad=True), torch.tensor([1.0, 3.0], requires_grad=True)
    torch.maximum(a, b).sum().backward()
    assert host(a.grad).tolist() == [0.5, 0.0] and host(b.grad).tolist() == [0.5, 1.0]


def test_movement_gradients():
    x64 = np.arange(12.0).reshape(3, 4)
    weights = np.random.default_rng(2).standard_normal
    for function, reference in [
            (lambda t: t.flip(1), lambda a: a[:, ::-1]), (lambda t: t.roll(1, 0), lambda a: np.roll(a, 1, 0)),
            (lambda t: t.repeat_interleave(3, dim=1), lambda a: np.repeat(a, 3, 1)),
            (lambda t: t.repeat(2, 2), lambda a: np.tile(a, (2, 2))), (lambda t: t.cumsum(1), lambda a: a.cumsum(1)),
            (lambda t: t.sort(1, descending=True).values, lambda a: -np.sort(-a, 1))]:
        x = torch.tensor(x64 * 0.37 % 1.3, requires_grad=True)
        w = weights(tuple(reference(x64).shape))
        (function(x) * torch.tensor(w)).sum().backward()
        # the gradient is the weights carried back: d/dx Σ w · f(x) by finite differences of the reference
        numeric = np.zeros_like(x64)
        base = x64 * 0.37 % 1.3
        for i in np.ndindex(base.shape):
            step = np.zeros_like(base)
            step[i] = 1e-3
            numeric[i] = ((w * reference(base + step)).sum() - (w * reference(base - step)).sum()) / 2e-3
        assert np.allclose(host(x.grad), numeric, atol=1e-4)


def test_norm_amax_all_any():
    a64 = np.random.default_rng(3).standard_normal((3, 5))
    a = torch.tensor(a64)
    assert np.isclose(a.norm().item(), np.linalg.norm(a64), rtol=1e-6)
    assert np.isclose(a.norm(1).item(), np.abs(a64).sum(), rtol=1e-6)
    assert np.allclose(host(a.norm(dim=1)), np.linalg.norm(a64, axis=1), rtol=1e-6)
    assert np.allclose(host(a.amax(1, keepdim=True)), a64.max(1, keepdims=True), rtol=1e-6)
    assert torch.all(a < 10).item() and not torch.any(a > 10).item()
    assert host(torch.all(a > -1, dim=0)).tolist() == (a64 > -1).all(0).tolist()


def test_unique_sort_argsort_stable():
    values = np.array([3, 1, 3, 2, 1, 3])
    unique, inverse, counts = torch.tensor(values).unique(return_inverse=True, return_counts=True)
    expected = np.unique(values, return_inverse=True, return_counts=True)
    assert [host(t).tolist() for t in (unique, inverse, counts)] == [e.tolist() for e in expected]
    order = torch.tensor(values).argsort(descending=True)
    assert host(order).tolist() == [0, 2, 5, 3, 1, 4]   # equal values keep their order
    assert host(torch.tensor(values).sort().indices).tolist() == np.argsort(values, kind="stable").tolist()


def test_histogram_histc_bincount():
    x64 = np.random.default_rng(4).standard_normal(200)
    x = torch.tensor(x64)
    counts, edges = np.histogram(x64, 7)
    hist = torch.histogram(x, bins=7)
    assert np.array_equal(host(hist.hist), counts) and np.allclose(host(hist.bin_edges), edges, rtol=1e-6)
    assert np.array_equal(host(torch.histc(x, bins=5, min=-1, max=1)),
                          np.histogram(x64[(x64 >= -1) & (x64 <= 1)], 5, (-1, 1))[0])
    assert host(torch.bincount(torch.tensor([1, 1, 4]))).tolist() == [0, 2, 0, 0, 1]


def test_one_hot_and_losses():
    ids = torch.tensor([0, 2, 1, 2])
    assert np.array_equal(host(F.one_hot(ids)), np.eye(3)[[0, 2, 1, 2]])
    assert F.one_hot(ids, num_classes=5).dtype == torch.int64 and F.one_hot(ids, 5).shape == (4, 5)
    with pytest.raises(RuntimeError, match="LongTensor"):
        F.one_hot(torch.tensor([0.5]))
    a64, b64 = np.random.default_rng(5).standard_normal((2, 8))
    assert np.isclose(nn.MSELoss()(torch.tensor(a64), torch.tensor(b64)).item(), ((a64 - b64) ** 2).mean(), rtol=1e-6)
    logits64, targets = np.random.default_rng(6).standard_normal((4, 3)), np.array([0, 2, 1, 1])
    z = logits64 - logits64.max(1, keepdims=True)
    expected = -(z[range(4), targets] - np.log(np.exp(z).sum(1))).mean()
    assert np.isclose(nn.CrossEntropyLoss()(torch.tensor(logits64), torch.tensor(targets)).item(), expected, rtol=1e-6)


def test_retain_grad_keeps_a_non_leafs_gradient():
    x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    y = x * 2
    y.retain_grad()
    z = y * y
    z.retain_grad()
    z.sum().backward()
    assert host(y.grad).tolist() == [4.0, 8.0, 12.0] and host(z.grad).tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(RuntimeError, match="requires_grad=False"):
        torch.ones(2).retain_grad()


def test_small_methods():
    x = torch.zeros(3, 4)
    assert x.nelement() == 12 and torch.numel(x) == 12 and x.element_size() == 4
    assert torch.zeros(2, dtype=torch.bfloat16).element_size() == 2
    assert isinstance(x.data_ptr(), int) and x[1].data_ptr() == x.data_ptr() + 16
    assert (x == None) is False and (x != None) is True  # noqa: E711  (Llama's token == eos_id with eos_id None)
    assert np.allclose(host(torch.linspace(-1, 1, 5)), np.linspace(-1, 1, 5))
    assert torch.linspace(0, 1, 3).dtype == torch.float32
    assert np.allclose(host(x.sum(1, keepdims=True)), np.zeros((3, 1))) and x.mean(0, keepdims=True).shape == (1, 4)
    assert x.t().shape == (4, 3) and x.type() in ("torch.FloatTensor", "torch.cuda.FloatTensor")
    assert x.type(torch.long).dtype == torch.int64 and x.new_zeros(2).dtype == torch.float32
    assert torch.allclose(torch.tensor([1.0]), torch.tensor([1.0 + 1e-7])) and not torch.allclose(x, x + 1)
    assert torch.Size([2, 3]).numel() == 6 and torch.Size([2, 3]) == (2, 3)
    assert [t.shape for t in torch.ones(5, 2).chunk(2)] == [(3, 2), (2, 2)] and len(torch.ones(3, 2).unbind(0)) == 3


def test_devices_name_the_active_backend():
    assert torch.device("cuda:1").index == 1 and torch.device("cpu").type == "cpu" and str(torch.device("cuda", 0)) == "cuda:0"
    assert torch.device("cuda") == "cuda" and torch.device("cpu") != "bfloat16"
    assert torch.backends.mps.is_available() is False
    with pytest.raises(RuntimeError, match="device type"):
        torch.device("tpu")
    x = torch.ones(2)
    for device in ("cpu", "cuda", torch.device("cuda"), torch.device("mps")):
        assert x.to(device) is x
    assert x.device.type == backend.name


def test_inference_mode_as_context_and_decorator():
    w = torch.ones(2, requires_grad=True)
    with torch.inference_mode():
        assert not (w * 2).requires_grad

    @torch.inference_mode()
    def f():
        return w * 2
    assert not f().requires_grad
    with torch.inference_mode(False):
        assert (w * 2).requires_grad


def test_module_constructors_take_dtype_and_device():
    layer = nn.Linear(3, 2, bias=False, dtype=torch.bfloat16, device="cuda")
    assert layer.weight.dtype == torch.bfloat16
    assert nn.Embedding(4, 3, dtype=torch.float32, device=torch.device("cpu")).weight.dtype == torch.float32
    assert nn.RMSNorm(3, eps=1e-5, dtype=torch.bfloat16).weight.dtype == torch.bfloat16
    assert nn.LayerNorm(3, dtype=torch.float32).weight.shape == (3,)
    x64 = np.random.default_rng(7).standard_normal((2, 3))
    for module, reference in [(nn.Tanh(), np.tanh), (nn.Sigmoid(), lambda a: 1 / (1 + np.exp(-a))),
                              (nn.LeakyReLU(0.2), lambda a: np.where(a > 0, a, 0.2 * a)),
                              (nn.Softmax(dim=1), lambda a: np.exp(a) / np.exp(a).sum(1, keepdims=True))]:
        assert np.allclose(host(module(torch.tensor(x64))), reference(x64), rtol=1e-5, atol=1e-6)


def test_init_functions_draw_the_right_distribution():
    w = torch.empty(400, 300)
    nn.init.kaiming_normal_(w, nonlinearity="relu")
    assert np.isclose(host(w).std(), math.sqrt(2 / 300), rtol=0.02)
    nn.init.xavier_normal_(w)
    assert np.isclose(host(w).std(), math.sqrt(2 / 700), rtol=0.02)
    nn.init.trunc_normal_(w, std=1.0, a=-1.0, b=1.0)
    assert host(w).min() >= -1 and host(w).max() <= 1
    assert nn.init.calculate_gain("tanh") == 5 / 3


class Squares(Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return torch.tensor([i, i * i]), i


def test_dataloader_batches_and_shuffles():
    batches = list(DataLoader(Squares(), batch_size=4))
    assert [tuple(b[0].shape) for b in batches] == [(4, 2), (4, 2), (2, 2)]
    assert host(batches[0][1]).tolist() == [0, 1, 2, 3] and host(batches[1][0])[:, 1].tolist() == [16, 25, 36, 49]
    assert len(DataLoader(Squares(), batch_size=4, drop_last=True)) == 2
    torch.manual_seed(0)
    seen = sorted(int(v) for b in DataLoader(Squares(), batch_size=3, shuffle=True) for v in host(b[1]))
    assert seen == list(range(10))
    g = torch.Generator().manual_seed(1)
    drawn = list(RandomSampler(Squares(), replacement=True, num_samples=50, generator=g))
    assert len(drawn) == 50 and set(drawn) <= set(range(10))
    parts = random_split(TensorDataset(torch.arange(10)), [0.7, 0.3], generator=torch.Generator().manual_seed(0))
    assert [len(p) for p in parts] == [7, 3]
    assert sorted(int(p[i][0].item()) for p in parts for i in range(len(p))) == list(range(10))
