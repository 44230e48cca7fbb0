"""torch.nn.init's common initialisers: each fills a tensor in place, under no graph, and returns it.

The numbers are drawn with numpy from the default generator gpt2_cupy.manual_seed seeds (as nn's layers
draw theirs), or from generator= when given, then copied to the backend: the same seed gives the same
weights on a GPU and on the CPU.
"""

import math

import numpy

from gpt2_cupy import backend
from gpt2_cupy.autograd import bump_version
from gpt2_cupy.random import host_stream


def _fill(tensor, values):
    tensor._data[...] = backend.xp.asarray(numpy.asarray(values, dtype=tensor.dtype))
    bump_version(tensor._data)   # an in-place write, as PyTorch's init functions are
    return tensor


def normal_(tensor, mean=0.0, std=1.0, generator=None):
    return _fill(tensor, host_stream(generator).normal(mean, std, tensor.shape))


def uniform_(tensor, a=0.0, b=1.0, generator=None):
    return _fill(tensor, host_stream(generator).uniform(a, b, tensor.shape))


def trunc_normal_(tensor, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None):
    """N(mean, std²) redrawn until inside [a, b] (bounds in the tensor's units, as PyTorch's)."""
    random = host_stream(generator)
    values = random.normal(mean, std, tensor.shape)
    outside = (values < a) | (values > b)
    while outside.any():
        values[outside] = random.normal(mean, std, int(outside.sum()))
        outside = (values < a) | (values > b)
    return _fill(tensor, values)


def constant_(tensor, val):
    return _fill(tensor, numpy.full(tensor.shape, val))


def zeros_(tensor):
    return constant_(tensor, 0.0)


def ones_(tensor):
    return constant_(tensor, 1.0)


def _fan_in_and_fan_out(tensor):
    if tensor.ndim < 2:
        raise ValueError(f"Fan in and fan out can not be computed for tensor with fewer than 2 dimensions "
                         f"(got shape {tensor.shape})")
    receptive_field = math.prod(tensor.shape[2:])
    return tensor.shape[1] * receptive_field, tensor.shape[0] * receptive_field


def xavier_uniform_(tensor, gain=1.0, generator=None):
    """U(±a), a = gain·√(6 / (fan_in + fan_out)) (Glorot and Bengio 2010)."""
    fan_in, fan_out = _fan_in_and_fan_out(tensor)
    bound = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return uniform_(tensor, -bound, bound, generator)


def xavier_normal_(tensor, gain=1.0, generator=None):
    """N(0, std²), std = gain·√(2 / (fan_in + fan_out))."""
    fan_in, fan_out = _fan_in_and_fan_out(tensor)
    return normal_(tensor, 0.0, gain * math.sqrt(2.0 / (fan_in + fan_out)), generator)


# gain: the factor that keeps the variance of activations through the nonlinearity (PyTorch's table)
_GAINS = {"linear": 1.0, "conv1d": 1.0, "conv2d": 1.0, "conv3d": 1.0, "sigmoid": 1.0, "tanh": 5.0 / 3,
          "relu": math.sqrt(2.0), "selu": 3.0 / 4}


def calculate_gain(nonlinearity, param=None):
    if nonlinearity == "leaky_relu":
        slope = 0.01 if param is None else param
        return math.sqrt(2.0 / (1 + slope ** 2))
    if nonlinearity not in _GAINS:
        raise ValueError(f"Unsupported nonlinearity {nonlinearity}")
    return _GAINS[nonlinearity]


def _kaiming_std(tensor, a, mode, nonlinearity):
    if mode not in ("fan_in", "fan_out"):
        raise ValueError(f"Mode {mode} not supported, please use one of fan_in, fan_out")
    fan_in, fan_out = _fan_in_and_fan_out(tensor)
    return calculate_gain(nonlinearity, a) / math.sqrt(fan_in if mode == "fan_in" else fan_out)


def kaiming_normal_(tensor, a=0, mode="fan_in", nonlinearity="leaky_relu", generator=None):
    """N(0, std²), std = gain / √fan (He et al. 2015)."""
    return normal_(tensor, 0.0, _kaiming_std(tensor, a, mode, nonlinearity), generator)


def kaiming_uniform_(tensor, a=0, mode="fan_in", nonlinearity="leaky_relu", generator=None):
    """U(±√3·std), std = gain / √fan."""
    bound = math.sqrt(3.0) * _kaiming_std(tensor, a, mode, nonlinearity)
    return uniform_(tensor, -bound, bound, generator)
