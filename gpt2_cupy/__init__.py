"""gpt2_cupy: GPT-2 trained with CUDA C kernels, run by CuPy on a GPU or by the CPU executor.

With PyTorch's names, so that PyTorch code runs with its imports changed:

    import gpt2_cupy as torch
    import gpt2_cupy.nn as nn
    from gpt2_cupy.nn import functional as F
    torch.manual_seed(1337)                  # dropout's masks and the initial weights
    with torch.no_grad(): ...                # nothing recorded
    torch.save(model.state_dict(), path); model.load_state_dict(torch.load(path, map_location="cpu"))
    torch.optim.AdamW, torch.nn.utils.clip_grad_norm_, torch.from_numpy, torch.float32, torch.long, ...
    torch.cuda.is_available(), torch.backends.cuda.matmul.allow_tf32, torch.amp.autocast, torch.cuda.amp.GradScaler
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16): ...   # bf16 mixed precision (gpt2_cupy.amp)

Importing the package compiles nothing: each kernel compiles when first used.
"""

import builtins as _builtins
import contextlib
import math
import sys
import types

import ml_dtypes
import numpy

from gpt2_cupy import amp, backend
from gpt2_cupy.autograd import no_grad
from gpt2_cupy.tensor import Tensor  # Tensor with its operators and methods
from gpt2_cupy.devices import device
from gpt2_cupy import random as _random
from gpt2_cupy.random import (Generator, default_generator, get_rng_state, initial_seed, manual_seed,  # as torch's
                              seed, set_rng_state)
from gpt2_cupy.amp import autocast, get_autocast_dtype, is_autocast_enabled  # as torch's
from gpt2_cupy.precision import get_float32_matmul_precision, set_float32_matmul_precision  # as torch's

__version__ = "0.1.0"

_FROM_AUTOGRAD = ("Function", "is_grad_enabled")
_FROM_SERIALIZATION = ("save", "load")
_SUBMODULES = ("nn", "optim", "functional", "autograd", "backend", "model", "utils")

# dtype names, as torch's: numpy dtypes here. bfloat16 is ml_dtypes' (the numpy dtype JAX and CuPy use too);
# float16 names a dtype that no kernel takes (tensors of it are refused: .to(float16) raises).
float32 = float = numpy.dtype(numpy.float32)
float16 = half = numpy.dtype(numpy.float16)
bfloat16 = numpy.dtype(ml_dtypes.bfloat16)
float64 = double = numpy.dtype(numpy.float64)
int64 = long = numpy.dtype(numpy.int64)
int32 = int = numpy.dtype(numpy.int32)
uint8 = numpy.dtype(numpy.uint8)
bool = numpy.dtype(numpy.bool_)  # noqa: A001  (torch.bool)
pi, e, inf, nan = numpy.pi, numpy.e, numpy.inf, numpy.nan


def dtype_of(value):
    """A numpy dtype from a dtype name of this module, a numpy dtype, or a string ("float32", "bfloat16")."""
    return numpy.dtype(value)


def from_numpy(array):
    """A Tensor over a numpy array, its strides kept (on the CPU it shares the array's memory, as torch's;
    on a GPU it is a copy)."""
    if not isinstance(array, numpy.ndarray):
        raise TypeError(f"expected np.ndarray (got {type(array).__name__})")
    if _builtins.any(stride < 0 for stride in array.strides):
        raise ValueError("At least one stride in the given numpy array is negative, and tensors with negative "
                         "strides are not currently supported. (You can probably work around this by making a "
                         "copy of your array  with array.copy().) ")
    return Tensor(backend.xp.asarray(array))


def _array_of(data):
    """data as a numpy or backend array: lists of numbers or of one-element tensors, numbers, arrays, Tensors."""
    if isinstance(data, Tensor):
        return data._data
    if isinstance(data, (backend.xp.ndarray, numpy.ndarray)):
        return data
    if isinstance(data, (list, tuple)):  # lists of one-element tensors, as torch.tensor([t1, t2]) takes
        data = [item.item() if isinstance(item, Tensor) else _array_of(item) if isinstance(item, (list, tuple))
                else item for item in data]
    return numpy.array(data)


def tensor(data, dtype=None, device=None, requires_grad=False, pin_memory=False):
    """A new Tensor, always a C-contiguous copy of data (a list, a number, a numpy or backend array of any
    layout, a Tensor); float32 for floats, int64 for integers, as torch.tensor."""
    array = _array_of(data)
    if dtype is None and array.dtype.kind == "f":
        dtype = float32  # float64 too: the kernels compute in float32 (torch keeps a float64 array's dtype)
    dtype = array.dtype if dtype is None else dtype_of(dtype)
    if isinstance(array, numpy.ndarray):  # a float64 list to bfloat16: one rounding (ml_dtypes')
        array = array.astype(dtype, order="C")
    return Tensor(backend.xp.array(array, dtype=dtype, order="C", copy=True), requires_grad=requires_grad)


def as_tensor(data, dtype=None, device=None):
    """data itself when it is a Tensor of that dtype, a Tensor over the same memory for a backend array of
    that dtype (its strides kept), else a new tensor (torch.as_tensor)."""
    if isinstance(data, Tensor) and (dtype is None or dtype_of(dtype) == data.dtype):
        return data
    if isinstance(data, backend.xp.ndarray) and (dtype is None or dtype_of(dtype) == data.dtype):
        return Tensor(data)
    if isinstance(data, numpy.ndarray) and not backend.ON_GPU and dtype is None and data.dtype != numpy.float64:
        return from_numpy(data)
    return tensor(data, dtype=dtype)


# ---- factories: new tensors on the active backend; random ones from manual_seed's generator --------------

def _shape(size):
    return tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list)) else tuple(size)


def _made(array, dtype, requires_grad):
    dtype = dtype_of(float32 if dtype is None else dtype)
    return Tensor(backend.xp.asarray(numpy.asarray(array).astype(dtype)), requires_grad=requires_grad)


def zeros(*size, dtype=None, device=None, requires_grad=False):
    return _made(numpy.zeros(_shape(size)), dtype, requires_grad)


def ones(*size, dtype=None, device=None, requires_grad=False):
    return _made(numpy.ones(_shape(size)), dtype, requires_grad)


def empty(*size, dtype=None, device=None, requires_grad=False):
    # uninitialised, as torch.empty: made in its own dtype, so that no stray bits are cast (and overflow)
    return _made(numpy.empty(_shape(size), dtype_of(float32 if dtype is None else dtype)), dtype, requires_grad)


def full(size, fill_value, dtype=None, device=None, requires_grad=False):
    """size filled with fill_value; the dtype follows the value (float32, int64 or bool), as torch.full's."""
    if dtype is None:
        dtype = bool if isinstance(fill_value, _builtins.bool) else int64 if isinstance(fill_value, _builtins.int) \
            else float32
    return _made(numpy.full(_shape((size,)), fill_value), dtype, requires_grad)


def arange(start, end=None, step=1, dtype=None, device=None, requires_grad=False):
    """start, start + step, ... below end; int64 when every argument is an int, else float32 (as torch)."""
    if end is None:
        start, end = 0, start
    if dtype is None:
        integers = all(isinstance(v, _builtins.int) for v in (start, end, step))
        dtype = int64 if integers else float32
    return _made(numpy.arange(start, end, step), dtype, requires_grad)


def rand(*size, generator=None, dtype=None, device=None, requires_grad=False):
    """Uniform in [0, 1), from generator or the default generator."""
    return _made(_random.host_stream(generator).random(_shape(size)), dtype, requires_grad)


def randn(*size, generator=None, dtype=None, device=None, requires_grad=False):
    """Standard normal, from generator or the default generator."""
    return _made(_random.host_stream(generator).standard_normal(_shape(size)), dtype, requires_grad)


def randint(low, high=None, size=None, *, generator=None, dtype=None, device=None, requires_grad=False):
    """Integers in [low, high) (int64), randint(high, size) or randint(low, high, size) as torch's."""
    if size is None:
        low, high, size = 0, low, high
    if size is None:
        raise TypeError("randint() missing 1 required positional arguments: \"size\"")
    return _made(_random.host_stream(generator).integers(low, high, size=tuple(size)),
                 int64 if dtype is None else dtype, requires_grad)


def randperm(n, *, generator=None, dtype=None, device=None, requires_grad=False):
    """A random permutation of 0 .. n-1 (int64)."""
    return _made(_random.host_stream(generator).permutation(n), int64 if dtype is None else dtype, requires_grad)


def normal(mean, std, size=None, *, generator=None, dtype=None, device=None, requires_grad=False):
    """N(mean, std²): numbers and a size, or tensors (broadcast) for the means and deviations."""
    mean_array, std_array = (backend.asnumpy(v._data) if is_tensor(v) else v for v in (mean, std))
    shape = numpy.broadcast_shapes(numpy.shape(mean_array), numpy.shape(std_array)) if size is None else _shape((size,))
    values = _random.host_stream(generator).normal(mean_array, std_array, shape)
    return _made(values, dtype, requires_grad)


def _like(factory):
    def like(input, dtype=None, device=None, requires_grad=False):
        return factory(input.shape, dtype=input.dtype if dtype is None else dtype, requires_grad=requires_grad)
    like.__name__ = factory.__name__ + "_like"
    like.__doc__ = f"{factory.__name__} of input's shape and dtype."
    return like


zeros_like, ones_like, empty_like, rand_like, randn_like = (_like(f) for f in (zeros, ones, empty, rand, randn))


def full_like(input, fill_value, dtype=None, device=None, requires_grad=False):
    return full(input.shape, fill_value, dtype=input.dtype if dtype is None else dtype, requires_grad=requires_grad)


def linspace(start, end, steps, *, dtype=None, device=None, requires_grad=False):
    """steps numbers evenly spaced from start to end, both included (computed in float64, then converted)."""
    return _made(numpy.linspace(_builtins.float(start), _builtins.float(end), _builtins.int(steps)), dtype,
                 requires_grad)


def logspace(start, end, steps, base=10.0, *, dtype=None, device=None, requires_grad=False):
    return _made(numpy.logspace(_builtins.float(start), _builtins.float(end), _builtins.int(steps), base=base),
                 dtype, requires_grad)


def eye(n, m=None, *, dtype=None, device=None, requires_grad=False):
    return _made(numpy.eye(n, m), dtype, requires_grad)


def numel(input):
    return input.numel()


def split(tensor, split_size_or_sections, dim=0):
    return tensor.split(split_size_or_sections, dim)


def get_default_dtype():
    """float32: factories and floats from Python numbers."""
    return float32


def set_default_dtype(d):
    if dtype_of(d) != float32:
        raise NotImplementedError(f"set_default_dtype({d}): the default dtype is float32 (the kernels' own)")


def is_floating_point(input):
    return input.is_floating_point()


class Size(tuple):
    """torch.Size: a tuple of sizes (Tensor.shape is a plain tuple here, equal to it)."""

    def numel(self):
        return math.prod(self)


def set_printoptions(precision=None, threshold=None, edgeitems=None, linewidth=None, profile=None, sci_mode=None):
    """How tensors print (numpy's print options, which their repr uses)."""
    options = {"precision": precision, "threshold": threshold, "edgeitems": edgeitems, "linewidth": linewidth}
    if profile == "full":
        options["threshold"] = sys.maxsize
    if sci_mode is not None:
        options["suppress"] = not sci_mode
    numpy.set_printoptions(**{name: value for name, value in options.items() if value is not None})


def inference_mode(mode=True):
    """torch.inference_mode: no_grad (nothing recorded) when mode is True; a context manager and a decorator."""
    return no_grad() if mode else contextlib.nullcontext()


def equal(input, other):
    """torch.equal: True when both tensors have the same shape and the same values (a Python bool)."""
    a, b = backend.asnumpy(input._data), backend.asnumpy(other._data)
    return a.shape == b.shape and _builtins.bool((a == b).all())


def is_tensor(value):
    return isinstance(value, Tensor)


def _cuda_is_available():
    return backend.ON_GPU


def _cuda_is_bf16_supported(including_emulation=True):
    """torch.cuda.is_bf16_supported: True on a GPU of compute capability 8.0 or more (Ampere on), whose
    tensor cores multiply bf16; False without a GPU, as PyTorch answers on a machine without CUDA, although
    the CPU executor runs the bf16 kernels too (autocast(device_type="cuda") works there: gpt2_cupy.amp)."""
    if not backend.ON_GPU:
        return False
    return _builtins.int(backend.xp.cuda.Device().compute_capability) >= 80  # (this module's int is torch.int)


cuda = types.SimpleNamespace(
    is_available=_cuda_is_available,
    is_bf16_supported=_cuda_is_bf16_supported,
    amp=types.SimpleNamespace(GradScaler=amp.GradScaler, autocast=amp.autocast),
    synchronize=lambda device=None: backend.synchronize(),
    # one generator seeds both backends here, so torch.cuda.manual_seed(s) is torch.manual_seed(s)
    manual_seed=manual_seed,
    manual_seed_all=manual_seed,
    CUDAGraph=lambda: __import__("gpt2_cupy.graphs").graphs.CUDAGraph(),
    graph=lambda cuda_graph, pool=None, stream=None, capture_error_mode="global":
        __import__("gpt2_cupy.graphs").graphs.graph(cuda_graph, pool, stream, capture_error_mode),
)


def compile(model=None, *, fullgraph=False, dynamic=None, backend="inductor", mode=None, options=None,  # noqa: A001
            disable=False):
    """torch.compile as the identity: the package has no graph compiler, and its ops already run as fused
    kernels, so the model comes back unchanged (its state_dict keys carry no '_orig_mod.' prefix). Used as
    a decorator with arguments, torch.compile(mode=...) returns the identity decorator."""
    if model is None:
        return lambda function: function
    return model


class _CudaMatmul:
    """torch.backends.cuda.matmul: allow_tf32 is PyTorch's older switch for what set_float32_matmul_precision
    chooses, and reads and writes the same setting, as PyTorch's property does: True is "high" (TF32), False
    is "highest"; it reads True at "high" and at "medium"."""

    @property
    def allow_tf32(self):
        return get_float32_matmul_precision() != "highest"

    @allow_tf32.setter
    def allow_tf32(self, allowed):
        set_float32_matmul_precision("high" if allowed else "highest")


# cudnn.allow_tf32 switches nothing: the package makes no cuDNN calls. There is no Apple GPU backend: mps is
# never available (code that prefers it then picks cuda or cpu, which both name the active backend).
backends = types.SimpleNamespace(cuda=types.SimpleNamespace(matmul=_CudaMatmul()),
                                 cudnn=types.SimpleNamespace(allow_tf32=False),
                                 mps=types.SimpleNamespace(is_available=lambda: False, is_built=lambda: False))


# torch.exp(x), torch.cat([...]), torch.where(...): the functions of Tensor's methods, from tensor_ops
_FROM_TENSOR_OPS = {
    "cat": "cat", "concat": "cat", "concatenate": "cat", "stack": "stack", "where": "where", "matmul": "matmul",
    "clamp": "clamp", "clip": "clamp", "topk": "topk", "multinomial": "multinomial", "masked_fill": "masked_fill",
    "gather": "gather", "sum": "sum", "mean": "mean", "var": "var", "std": "std", "reshape": "reshape",
    "permute": "permute", "transpose": "transpose", "unsqueeze": "unsqueeze", "squeeze": "squeeze",
    "flatten": "flatten", "allclose": "allclose", "isclose": "isclose", "bincount": "bincount", "histc": "histc",
    "histogram": "histogram", "unique": "unique", "chunk": "chunk", "unbind": "unbind",
    "index_select": "index_select", "nonzero": "nonzero", "masked_select": "masked_select", "prod": "prod",
    "einsum": "einsum", "scatter": "scatter", "scatter_add": "scatter_add",
}
_TENSOR_METHODS = ("exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "relu", "abs", "pow", "tril", "triu", "max",
                   "min", "argmax", "argmin", "softmax", "log_softmax", "clone", "square", "sign", "sin", "cos", "tan",
                   "asin", "acos", "atan", "sinh", "cosh", "log10", "log2", "log1p", "expm1", "exp2", "erf",
                   "reciprocal", "floor", "ceil", "round", "trunc", "frac", "atan2", "maximum", "minimum", "all", "any",
                   "amax", "amin", "norm", "cumsum", "sort", "argsort", "flip", "roll", "repeat_interleave", "numel",
                   "t", "split", "detach", "is_floating_point", "neg")


def __getattr__(name):
    # Function, save, torch.cat, ... are looked up here on first use (PEP 562), so that the modules behind them
    # load only when used; `from gpt2_cupy import nn, optim, functional` imports those submodules the usual way.
    import importlib

    if name in _FROM_AUTOGRAD:
        return getattr(importlib.import_module("gpt2_cupy.autograd"), name)
    if name in _FROM_SERIALIZATION:
        return getattr(importlib.import_module("gpt2_cupy.serialization"), name)
    if name in _FROM_TENSOR_OPS:
        return getattr(importlib.import_module("gpt2_cupy.tensor_ops"), _FROM_TENSOR_OPS[name])
    if name in _TENSOR_METHODS:
        return lambda input, *arguments, **options: getattr(Tensor, name)(input, *arguments, **options)
    if name in _SUBMODULES:
        return importlib.import_module(f"gpt2_cupy.{name}")
    raise AttributeError(f"module 'gpt2_cupy' has no attribute {name!r}")
