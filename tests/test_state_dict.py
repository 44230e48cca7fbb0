"""Module.state_dict() shares storage with the parameters, as PyTorch's does."""

import io
from collections import OrderedDict

import numpy as np

import gpt2_cupy as torch
from gpt2_cupy import nn
from gpt2_cupy.autograd import Tensor


class Tied(nn.Module):
    """A Linear and a second name for its weight (a tied output layer), and a buffer."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.head = nn.Linear(3, 4, bias=False)
        self.head.weight = self.fc.weight
        self.register_buffer("scale", Tensor(np.array([2.0, 3.0], np.float32)))


def test_entries_are_detached_tensors_over_the_parameters_arrays(to_host):
    model = Tied()
    state = model.state_dict()
    assert isinstance(state, OrderedDict)
    assert list(state) == ["fc.weight", "fc.bias", "head.weight", "scale"]
    for name, value in state.items():
        assert isinstance(value, Tensor) and not value.requires_grad and value.grad_fn is None, name
    assert state["fc.weight"]._data is model.fc.weight._data and state["head.weight"]._data is model.fc.weight._data
    assert state["scale"]._data is model.scale._data
    assert model.fc.weight.requires_grad  # detaching the entry leaves the parameter as it was


def test_copy_into_an_entry_writes_the_parameter(rng, to_device, to_host):
    model = Tied()
    new_weight = rng.normal(size=(4, 3)).astype(np.float32)
    new_bias = rng.normal(size=(4,)).astype(np.float32)
    with torch.no_grad():
        model.state_dict()["fc.weight"].copy_(Tensor(to_device(new_weight)))
        model.state_dict()["fc.bias"].copy_(Tensor(to_device(new_bias)))
    np.testing.assert_array_equal(to_host(model.fc.weight._data), new_weight)
    np.testing.assert_array_equal(to_host(model.head.weight._data), new_weight)  # the tied name too
    x = rng.normal(size=(2, 3)).astype(np.float32)
    out = to_host(model.fc(Tensor(to_device(x)))._data)
    np.testing.assert_allclose(out, x.astype(np.float64) @ new_weight.T + new_bias, rtol=1e-5, atol=1e-6)


def test_an_entry_follows_the_parameter_as_it_trains(rng, to_device, to_host):
    model = Tied()
    # built first: the optimizer moves the parameters into its flat buffer (a state_dict taken before
    # that holds the arrays they had then)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    state = model.state_dict()
    before = state["fc.bias"].numpy().copy()
    model.fc(Tensor(to_device(rng.normal(size=(2, 3)).astype(np.float32)))).sum().backward()
    optimizer.step()
    # d sum / d bias = 2 (the batch), so SGD moves each bias element by -0.5 * 2
    np.testing.assert_allclose(state["fc.bias"].numpy(), before - 1.0, rtol=0, atol=1e-6)


def test_save_load_and_load_state_dict_round_trip(rng, to_device, to_host):
    model = Tied()
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    expected = {name: value.numpy().copy() for name, value in model.state_dict().items()}
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert list(loaded) == list(expected)
    for name, value in loaded.items():
        assert isinstance(value, Tensor) and not value.requires_grad, name
        np.testing.assert_array_equal(value.numpy(), expected[name])
    other = Tied()
    missing, unexpected = other.load_state_dict(loaded)
    assert missing == [] and unexpected == []
    for name, value in other.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), expected[name])
    assert other.head.weight is other.fc.weight  # tying survives the load
    # the loaded Tensors were copied in, not adopted: changing them leaves the model alone
    loaded["fc.bias"]._data[...] = 0
    np.testing.assert_array_equal(other.fc.bias.detach().numpy(), expected["fc.bias"])
