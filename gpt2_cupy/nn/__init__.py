"""Layers with parameters, in PyTorch's torch.nn names: Module, Linear, LayerNorm, DyT, Embedding, Dropout.

A Module finds its parameters and sub-modules by looking at its own attributes, in the order they were
set (as torch.nn.Module does), so `named_parameters()` gives names like "transformer.h.0.attn.c_attn.weight".
`state_dict()` returns numpy copies (for checkpoints); `load_state_dict()` copies values into the existing
arrays, so views the optimizer made into its flat buffer stay valid.

Initial weights are drawn with numpy from the generator gpt2_cupy.manual_seed seeds, then copied to the
backend: the same seed gives the same model on a GPU and on the CPU.
"""

import math

import numpy

from gpt2_cupy import backend
from gpt2_cupy.nn import functional as F
from gpt2_cupy.autograd import Tensor, init_generator


class Parameter(Tensor):
    """A Tensor a Module owns and the optimizer updates: requires_grad by default."""

    def __init__(self, data, requires_grad=True):
        super().__init__(backend.xp.asarray(data, dtype=numpy.float32), requires_grad=requires_grad)

    def __repr__(self):
        return f"Parameter(shape={self.shape})"


class Module:
    training = True

    def __call__(self, *arguments, **options):
        return self.forward(*arguments, **options)

    def named_children(self):
        """(name, module) of the modules set directly on this one, in the order they were set."""
        for name, value in vars(self).items():
            if isinstance(value, Module):
                yield name, value

    def children(self):
        return (module for _, module in self.named_children())

    def named_modules(self, memo=None, prefix="", remove_duplicate=True):
        """(name, module) of this module and every one below it, depth first: "", "transformer",
        "transformer.h.0", ...; a module reachable twice (shared) is listed once, under its first name."""
        memo = set() if memo is None else memo
        if remove_duplicate:
            if id(self) in memo:
                return
            memo.add(id(self))
        yield prefix, self
        for name, child in self.named_children():
            yield from child.named_modules(memo, f"{prefix}.{name}" if prefix else name, remove_duplicate)

    def modules(self):
        return (module for _, module in self.named_modules())

    def named_parameters(self, prefix="", remove_duplicate=True):
        """(name, Parameter) pairs; a parameter shared by two modules (tied weights) is listed once."""
        seen = set()
        for module_prefix, module in self.named_modules(prefix=prefix, remove_duplicate=remove_duplicate):
            for name, value in vars(module).items():
                if isinstance(value, Parameter) and not (remove_duplicate and id(value) in seen):
                    seen.add(id(value))
                    yield f"{module_prefix}.{name}" if module_prefix else name, value

    def parameters(self):
        return [parameter for _, parameter in self.named_parameters()]

    def state_dict(self):
        """{name: numpy float32 copy}, tied parameters under each of their names (as PyTorch's)."""
        return {name: backend.asnumpy(p.data).copy()
                for name, p in self.named_parameters(remove_duplicate=False)}

    def load_state_dict(self, state_dict, strict=True):
        """Copy values into the parameters in place; strict: the names must match exactly."""
        parameters = dict(self.named_parameters(remove_duplicate=False))
        missing = sorted(set(parameters) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(parameters))
        if strict and (missing or unexpected):
            raise KeyError(f"load_state_dict: missing {missing}, unexpected {unexpected}")
        for name, value in state_dict.items():
            if name not in parameters:
                continue
            parameter = parameters[name]
            if tuple(value.shape) != parameter.shape:
                raise ValueError(f"load_state_dict: {name} has shape {tuple(value.shape)}, the model's "
                                 f"{parameter.shape}")
            parameter.data[...] = backend.xp.asarray(value, dtype=numpy.float32)

    def train(self, mode=True):
        for _, module in self.named_modules():
            module.training = mode
        return self

    def eval(self):
        return self.train(False)

    def zero_grad(self):
        for parameter in self.parameters():
            if parameter.grad is not None:
                parameter.grad.fill(0)  # in place: the buffer may be a view into the optimizer's flat one


class ModuleList(Module):
    """Modules numbered 0, 1, ...: their parameters are named "h.0.…", "h.1.…"."""

    def __init__(self, modules):
        for index, module in enumerate(modules):
            setattr(self, str(index), module)
        self._length = len(modules)

    def __len__(self):
        return self._length

    def __getitem__(self, index):
        return getattr(self, str(range(self._length)[index]))

    def __iter__(self):
        return (self[index] for index in range(self._length))


class ModuleDict(Module):
    """Modules under names: transformer.wte, transformer.h, ..."""

    def __init__(self, modules):
        for name, module in modules.items():
            setattr(self, name, module)


def _normal(shape, std):
    return Parameter(init_generator().normal(0.0, std, shape).astype(numpy.float32))


def _uniform(shape, bound):
    return Parameter(init_generator().uniform(-bound, bound, shape).astype(numpy.float32))


class Linear(Module):
    """y = x Wᵀ + b, weight (out_features, in_features); initialised as PyTorch's, U(±1/√in_features)."""

    def __init__(self, in_features, out_features, bias=True):
        bound = 1 / math.sqrt(in_features)
        self.weight = _uniform((out_features, in_features), bound)
        self.bias = _uniform((out_features,), bound) if bias else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class LayerNorm(Module):
    """Normalise over the last axis, then weight (ones) and bias (zeros, or none with bias=False)."""

    def __init__(self, normalized_shape, eps=1e-5, bias=True):
        self.normalized_shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.eps = eps
        self.weight = Parameter(numpy.ones(self.normalized_shape, numpy.float32))
        self.bias = Parameter(numpy.zeros(self.normalized_shape, numpy.float32)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class DyT(Module):
    """Dynamic tanh, weight * tanh(alpha x) + bias (Zhu et al. 2025): a norm layer without statistics."""

    def __init__(self, num_features, alpha_init_value=0.5, bias=True):
        self.alpha = Parameter(numpy.full((1,), alpha_init_value, numpy.float32))
        self.weight = Parameter(numpy.ones((num_features,), numpy.float32))
        self.bias = Parameter(numpy.zeros((num_features,), numpy.float32)) if bias else None

    def forward(self, x):
        return F.dyt(x, self.alpha, self.weight, self.bias)


class Embedding(Module):
    """A table of num_embeddings rows of embedding_dim; initialised N(0, 1) as PyTorch's."""

    def __init__(self, num_embeddings, embedding_dim):
        self.weight = _normal((num_embeddings, embedding_dim), 1.0)

    def forward(self, idx):
        return F.embedding(idx, self.weight)


class Dropout(Module):
    def __init__(self, p=0.5):
        self.p = p

    def forward(self, x):
        return F.dropout(x, self.p, self.training)
