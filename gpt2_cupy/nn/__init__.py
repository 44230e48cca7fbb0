"""Layers with parameters, in PyTorch's torch.nn names.

    Module        named_parameters, named_modules, children, apply, state_dict, load_state_dict, to, repr
    Linear, LayerNorm, DyT, Embedding, Dropout          the layers GPT-2 needs, over the course's kernels
    BatchNorm1d                                         makemore's, from Tensor operations
    GELU, ReLU, SiLU, Tanh, Sigmoid, LeakyReLU, Softmax, LogSoftmax, Flatten, Identity
    MSELoss, CrossEntropyLoss, RMSNorm, Sequential, ModuleList, ModuleDict, Parameter
    Linear, Embedding, LayerNorm and RMSNorm take PyTorch's dtype= (float32 or bfloat16) and device= (any
    name: one backend holds every array)
    nn.init (normal_, zeros_, ones_, uniform_, xavier_uniform_), nn.utils.clip_grad_norm_, nn.functional (F)

A Module finds its parameters and sub-modules by looking at its own attributes, in the order they were
set (as torch.nn.Module does), so `named_parameters()` gives names like "transformer.h.0.attn.c_attn.weight".
`state_dict()` shares storage with the parameters, as PyTorch's does: each entry is a detached Tensor over
the parameter's own array, so `state_dict()[name].copy_(src)` writes the parameter, and a checkpoint taken
from it should be saved (gpt2_cupy.save) or copied before training goes on. Where this differs from
PyTorch: an optimizer moves the parameters into its flat buffer when it is built, so a state_dict taken
before that keeps the arrays the parameters had then. `load_state_dict()` copies
values (arrays or Tensors) into the existing arrays, so views the optimizer made into its flat buffer stay
valid.

Initial weights are drawn with numpy from the generator gpt2_cupy.manual_seed seeds, then copied to the
backend: the same seed gives the same model on a GPU and on the CPU.
"""

import math
from collections import OrderedDict

import ml_dtypes
import numpy

from gpt2_cupy import backend
from gpt2_cupy.autograd import Tensor, bump_version
from gpt2_cupy.elementwise import converted
from gpt2_cupy.tensor_ops import is_floating
from gpt2_cupy.random import init_generator
from gpt2_cupy.nn import functional as F
from gpt2_cupy.nn import init, utils

BFLOAT16 = numpy.dtype(ml_dtypes.bfloat16)


class Parameter(Tensor):
    """A Tensor a Module owns and the optimizer updates: requires_grad by default. Parameter(tensor) shares
    the tensor's array, as PyTorch's does."""

    def __init__(self, data=None, requires_grad=True):
        if data is None:
            data = numpy.empty(0, numpy.float32)
        if isinstance(data, Tensor):
            data = data._data
        super().__init__(backend.xp.asarray(data, dtype=numpy.float32), requires_grad=requires_grad)

    def __repr__(self):
        return f"Parameter(shape={self.shape}, requires_grad={self.requires_grad})"


class Module:
    training = True

    def __call__(self, *arguments, **options):
        return self.forward(*arguments, **options)

    def __getattr__(self, name):
        # Only called when normal lookup fails: buffers live in self._buffers, as in torch.nn.Module.
        buffers = self.__dict__.get("_buffers", {})
        if name in buffers:
            return buffers[name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def register_buffer(self, name, tensor, persistent=True):
        """A tensor the module keeps that is not a parameter (a mask, running statistics): in state_dict
        unless persistent=False, never in parameters()."""
        if "_buffers" not in self.__dict__:
            self._buffers, self._non_persistent = {}, set()
        if tensor is not None and not isinstance(tensor, Tensor):
            tensor = Tensor(backend.xp.asarray(tensor))
        self._buffers[name] = tensor
        if not persistent:
            self._non_persistent.add(name)

    def named_buffers(self, prefix="", remove_duplicate=True):
        for module_prefix, module in self.named_modules(prefix=prefix, remove_duplicate=remove_duplicate):
            for name, tensor in module.__dict__.get("_buffers", {}).items():
                if tensor is not None:
                    yield f"{module_prefix}.{name}" if module_prefix else name, tensor

    def buffers(self):
        return [tensor for _, tensor in self.named_buffers()]

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

    def _persistent_buffers(self):
        return {name: tensor for name, tensor in self.named_buffers(remove_duplicate=False)
                if name.rpartition(".")[2] not in self._owner_of(name).__dict__.get("_non_persistent", ())}

    def _owner_of(self, name):
        module = self
        for part in name.split(".")[:-1]:
            module = getattr(module, part)
        return module

    def state_dict(self):
        """OrderedDict {name: Tensor}: parameters, tied ones under each of their names (as PyTorch's), then
        buffers. Each Tensor is detached (requires_grad=False) and shares its parameter's array: a write into
        it is a write into the model."""
        tensors = dict(self.named_parameters(remove_duplicate=False)) | self._persistent_buffers()
        return OrderedDict((name, tensor.detach()) for name, tensor in tensors.items())

    def load_state_dict(self, state_dict, strict=True):
        """Copy values (numpy or backend arrays, or Tensors) into the parameters and buffers in place.

        strict: the names must match exactly (PyTorch's RuntimeError otherwise). Returns the missing and
        unexpected names, as PyTorch's does.
        """
        tensors = dict(self.named_parameters(remove_duplicate=False)) | self._persistent_buffers()
        missing = [name for name in tensors if name not in state_dict]
        unexpected = [name for name in state_dict if name not in tensors]
        if strict and (missing or unexpected):
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__}:\n\t"
                               f"Missing key(s) in state_dict: {', '.join(map(repr, missing))}.\n\t"
                               f"Unexpected key(s) in state_dict: {', '.join(map(repr, unexpected))}.")
        for name, value in state_dict.items():
            if name not in tensors:
                continue
            value = value._data if isinstance(value, Tensor) else value
            tensor = tensors[name]
            if tuple(value.shape) != tensor.shape:
                raise RuntimeError(f"load_state_dict: size mismatch for {name}: copying a param with shape "
                                   f"{tuple(value.shape)}, the shape in current model is {tensor.shape}")
            tensor._data[...] = backend.xp.asarray(value, dtype=tensor.dtype)
            bump_version(tensor._data)   # an in-place write, as PyTorch's copy_ into the parameter
        return missing, unexpected

    def apply(self, fn):
        """fn(module) for every sub-module, then for this one (as torch's: nanoGPT initialises weights so)."""
        for child in self.children():
            child.apply(fn)
        fn(self)
        return self

    def to(self, *arguments, **options):
        """As PyTorch's: a device ("cpu", "cuda") maps to the active backend, where every array already is;
        a dtype (float32 or bfloat16) converts every parameter and every floating-point buffer (a norm's
        running statistics) in place, each converted once (a tied matrix stays one matrix); integer and bool
        buffers keep their dtype. bf16 parameters are for inference (generation); training keeps float32
        masters and runs bf16 under gpt2_cupy.autocast. Returns self."""
        for argument in (*arguments, *options.values()):
            if argument is None or isinstance(argument, str) or type(argument).__name__ == "device":
                continue
            dtype = numpy.dtype(argument)
            if dtype not in (numpy.float32, BFLOAT16):
                raise NotImplementedError(f"{type(self).__name__}.to: dtype {argument} is not supported yet; "
                                          "parameters are float32 or bfloat16")
            for parameter in self.parameters():
                parameter._data = converted(parameter._data, dtype)
            for buffer in self.buffers():
                if is_floating(buffer.dtype):
                    buffer._data = converted(buffer._data, dtype)
        return self

    def bfloat16(self):
        return self.to(BFLOAT16)

    def float(self):
        return self.to(numpy.float32)

    def cuda(self, device=None):
        return self

    def cpu(self):
        return self

    def extra_repr(self):
        """The layer's own settings, inside the parentheses of its repr: Linear(in_features=..., ...)."""
        return ""

    def __repr__(self):
        lines = [f"({name}): " + repr(child).replace("\n", "\n  ") for name, child in self.named_children()]
        if not lines:
            return f"{type(self).__name__}({self.extra_repr()})"
        extra = [self.extra_repr()] if self.extra_repr() else []
        return f"{type(self).__name__}(\n" + "".join(f"  {line}\n" for line in extra + lines) + ")"

    def train(self, mode=True):
        for _, module in self.named_modules():
            module.training = mode
        return self

    def eval(self):
        return self.train(False)

    def zero_grad(self, set_to_none=True):
        """Every parameter's .grad to None (PyTorch's default), or zeroed in place with set_to_none=False."""
        for parameter in self.parameters():
            if set_to_none:
                parameter.grad = None
            elif parameter.grad is not None:
                backend.fill_zero(parameter.grad._data)  # in place: the buffer may be a view into the optimizer's flat one


class ModuleList(Module):
    """Modules numbered 0, 1, ...: their parameters are named "h.0.…", "h.1.…"."""

    def __init__(self, modules=()):
        self._length = 0
        self.extend(modules)

    def append(self, module):
        setattr(self, str(self._length), module)
        self._length += 1
        return self

    def extend(self, modules):
        for module in modules:
            self.append(module)
        return self

    def __len__(self):
        return self._length

    def __getitem__(self, index):
        if isinstance(index, slice):
            return type(self)([self[i] for i in range(self._length)[index]])
        return getattr(self, str(range(self._length)[index]))

    def __iter__(self):
        return (self[index] for index in range(self._length))


class ModuleDict(Module):
    """Modules under names: transformer.wte, transformer.h, ..."""

    def __init__(self, modules=None):
        for name, module in (modules or {}).items():
            setattr(self, name, module)

    def __getitem__(self, name):
        return getattr(self, name)

    def __contains__(self, name):
        return isinstance(self.__dict__.get(name), Module)

    def keys(self):
        return [name for name, _ in self.named_children()]

    def items(self):
        return list(self.named_children())

    def values(self):
        return list(self.children())


class Sequential(Module):
    """Modules applied in order: Sequential(a, b, c)(x) = c(b(a(x))); from modules or an OrderedDict of them."""

    def __init__(self, *modules):
        if len(modules) == 1 and isinstance(modules[0], OrderedDict):
            for name, module in modules[0].items():
                setattr(self, name, module)
        else:
            for index, module in enumerate(modules):
                setattr(self, str(index), module)

    def __len__(self):
        return len(list(self.children()))

    def __getitem__(self, index):
        children = list(self.children())
        if isinstance(index, slice):
            return Sequential(*children[index])
        return children[index]

    def __iter__(self):
        return self.children()

    def forward(self, x):
        for module in self.children():
            x = module(x)
        return x


def _to_dtype(module, dtype):
    """A layer's dtype= argument: its parameters converted (float32 or bfloat16, as Module.to takes)."""
    if dtype is not None:
        module.to(dtype)


def _normal(shape, std):
    return Parameter(init_generator().normal(0.0, std, shape).astype(numpy.float32))


def _uniform(shape, bound):
    return Parameter(init_generator().uniform(-bound, bound, shape).astype(numpy.float32))


class Linear(Module):
    """y = x Wᵀ + b, weight (out_features, in_features); initialised as PyTorch's, U(±1/√in_features)."""

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
        self.in_features, self.out_features = in_features, out_features
        bound = 1 / math.sqrt(in_features)
        self.weight = _uniform((out_features, in_features), bound)
        self.bias = _uniform((out_features,), bound) if bias else None
        _to_dtype(self, dtype)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class LayerNorm(Module):
    """Normalise over the last axis, then weight (ones) and bias (zeros, or none with bias=False)."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, device=None, dtype=None):
        if not elementwise_affine:
            raise NotImplementedError("LayerNorm(elementwise_affine=False): the kernels take a weight and a bias")
        self.normalized_shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.eps = eps
        self.weight = Parameter(numpy.ones(self.normalized_shape, numpy.float32))
        self.bias = Parameter(numpy.zeros(self.normalized_shape, numpy.float32)) if bias else None
        _to_dtype(self, dtype)

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine=True"


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

    def __init__(self, num_embeddings, embedding_dim, padding_idx=None, device=None, dtype=None):
        if padding_idx is not None:
            raise NotImplementedError("Embedding(padding_idx=...) is not supported")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = _normal((num_embeddings, embedding_dim), 1.0)
        _to_dtype(self, dtype)

    def forward(self, idx):
        return F.embedding(idx, self.weight)

    def extra_repr(self):
        return f"{self.num_embeddings}, {self.embedding_dim}"


class BatchNorm1d(Module):
    """Each of num_features channels normalised over the batch (inputs (N, C) or (N, C, L)), then weight
    (ones) and bias (zeros) with affine. Training uses the batch's statistics and moves the running_mean and
    running_var buffers towards them by momentum (momentum=None: their plain average over all batches so far,
    counted by num_batches_tracked); evaluation uses the running ones (the batch's without
    track_running_stats)."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True, device=None,
                 dtype=None):
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.affine, self.track_running_stats = affine, track_running_stats
        self.weight = Parameter(numpy.ones(num_features, numpy.float32)) if affine else None
        self.bias = Parameter(numpy.zeros(num_features, numpy.float32)) if affine else None
        tracked = track_running_stats
        self.register_buffer("running_mean", numpy.zeros(num_features, numpy.float32) if tracked else None)
        self.register_buffer("running_var", numpy.ones(num_features, numpy.float32) if tracked else None)
        self.register_buffer("num_batches_tracked", numpy.zeros((), numpy.int64) if tracked else None)
        _to_dtype(self, dtype)

    def forward(self, input):
        if input.ndim not in (2, 3):
            raise ValueError(f"expected 2D or 3D input (got {input.ndim}D input)")
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # the cumulative average: the n-th batch weighs 1/n
                momentum = 1.0 / self.num_batches_tracked.item()
        return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                            self.training or not self.track_running_stats, momentum, self.eps)

    def extra_repr(self):
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
                f"track_running_stats={self.track_running_stats}")


class Dropout(Module):
    def __init__(self, p=0.5):
        self.p = p

    def forward(self, x):
        return F.dropout(x, self.p, self.training)

    def extra_repr(self):
        return f"p={self.p}, inplace=False"


class GELU(Module):
    def __init__(self, approximate="none"):
        self.approximate = approximate

    def forward(self, x):
        return F.gelu(x, approximate=self.approximate)

    def extra_repr(self):
        return f"approximate={self.approximate!r}"


class ReLU(Module):
    def __init__(self, inplace=False):
        self.inplace = inplace

    def forward(self, x):
        return F.relu(x)


class Tanh(Module):
    def forward(self, x):
        return F.tanh(x)


class Sigmoid(Module):
    def forward(self, x):
        return F.sigmoid(x)


class LeakyReLU(Module):
    def __init__(self, negative_slope=0.01, inplace=False):
        self.negative_slope = negative_slope

    def forward(self, x):
        return F.leaky_relu(x, self.negative_slope)

    def extra_repr(self):
        return f"negative_slope={self.negative_slope}"


class Softmax(Module):
    def __init__(self, dim=None):
        self.dim = dim

    def forward(self, x):
        return F.softmax(x, self.dim)

    def extra_repr(self):
        return f"dim={self.dim}"


class LogSoftmax(Softmax):
    def forward(self, x):
        return F.log_softmax(x, self.dim)


class Flatten(Module):
    def __init__(self, start_dim=1, end_dim=-1):
        self.start_dim, self.end_dim = start_dim, end_dim

    def forward(self, x):
        return x.flatten(self.start_dim, self.end_dim)


class MSELoss(Module):
    def __init__(self, size_average=None, reduce=None, reduction="mean"):
        self.reduction = reduction

    def forward(self, input, target):
        return F.mse_loss(input, target, reduction=self.reduction)


class CrossEntropyLoss(Module):
    def __init__(self, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean",
                 label_smoothing=0.0):
        self.weight, self.ignore_index, self.reduction = weight, ignore_index, reduction
        self.label_smoothing = label_smoothing

    def forward(self, input, target):
        return F.cross_entropy(input, target, weight=self.weight, ignore_index=self.ignore_index,
                               reduction=self.reduction, label_smoothing=self.label_smoothing)


class SiLU(Module):
    def forward(self, x):
        return F.silu(x)


class Identity(Module):
    def __init__(self, *arguments, **options):
        pass  # PyTorch's Identity accepts and ignores any arguments

    def forward(self, x):
        return x


__all__ = ["Module", "Parameter", "Linear", "LayerNorm", "DyT", "Embedding", "BatchNorm1d", "Dropout", "GELU",
           "ReLU", "SiLU", "Tanh", "Sigmoid", "LeakyReLU", "Softmax", "LogSoftmax", "Flatten", "MSELoss",
           "CrossEntropyLoss", "Identity", "Sequential", "ModuleList", "ModuleDict", "RMSNorm", "functional", "init",
           "utils"]


class RMSNorm(Module):
    """x / sqrt(mean(x²) + eps) over the last axis, times weight (ones): Llama's norm, PyTorch's nn.RMSNorm."""

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, device=None, dtype=None):
        if not elementwise_affine:
            raise NotImplementedError("RMSNorm(elementwise_affine=False): the kernel takes a weight")
        self.normalized_shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.eps = eps
        self.weight = Parameter(numpy.ones(self.normalized_shape, numpy.float32))
        _to_dtype(self, dtype)

    def forward(self, x):
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine=True"
