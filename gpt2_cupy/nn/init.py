"""torch.nn.init's common initialisers: each fills a tensor in place, under no graph, and returns it.

The numbers are drawn with numpy from the generator gpt2_cupy.manual_seed seeds (as nn's layers draw
theirs), then copied to the backend: the same seed gives the same weights on a GPU and on the CPU.
"""

import math

import numpy

from gpt2_cupy import backend
from gpt2_cupy.autograd import bump_version, init_generator


def _fill(tensor, values):
    tensor.data[...] = backend.xp.asarray(numpy.asarray(values, dtype=tensor.dtype))
    bump_version(tensor.data)   # an in-place write, as PyTorch's init functions are
    return tensor


def normal_(tensor, mean=0.0, std=1.0):
    return _fill(tensor, init_generator().normal(mean, std, tensor.shape))


def uniform_(tensor, a=0.0, b=1.0):
    return _fill(tensor, init_generator().uniform(a, b, tensor.shape))


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


def xavier_uniform_(tensor, gain=1.0):
    """U(±a), a = gain·√(6 / (fan_in + fan_out)) (Glorot and Bengio 2010)."""
    fan_in, fan_out = _fan_in_and_fan_out(tensor)
    bound = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return uniform_(tensor, -bound, bound)
