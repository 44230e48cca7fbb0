"""Tensor's operators and methods: x + y, x @ w, x.sum(dim), x.view(...), x.softmax(dim), x.add_(y), ...

gpt2_cupy.autograd defines Tensor as the engine needs it (its array, its gradient, its place in the graph,
backward). The operations are Functions of gpt2_cupy.tensor_ops and gpt2_cupy.nn.functional, which sit above
the engine; their methods are written here and put on Tensor when this module is imported (importing
gpt2_cupy does it), so that the engine never imports the operations that are built on it.

    from gpt2_cupy.tensor import Tensor       the same class as gpt2_cupy.autograd.Tensor
"""

import numpy

from gpt2_cupy import backend, devices, tensor_ops
from gpt2_cupy.autograd import Tensor, as_sizes, type_name
from gpt2_cupy.nn import functional

__all__ = ["Tensor"]


class TensorMethods:
    """The methods put on Tensor (a namespace; never instantiated)."""

    def __add__(self, other):
        return tensor_ops.binary("add", self, other)

    def __radd__(self, other):
        return tensor_ops.binary("add", other, self)

    def __sub__(self, other):
        return tensor_ops.binary("sub", self, other)

    def __rsub__(self, other):
        return tensor_ops.binary("sub", other, self)

    def __mul__(self, other):
        return tensor_ops.binary("mul", self, other)

    def __rmul__(self, other):
        return tensor_ops.binary("mul", other, self)

    def __truediv__(self, other):
        return tensor_ops.binary("div", self, other)

    def __rtruediv__(self, other):
        return tensor_ops.binary("div", other, self)

    def __pow__(self, other):
        return tensor_ops.binary("pow", self, other)

    def __rpow__(self, other):
        return tensor_ops.binary("pow", other, self)

    def __matmul__(self, other):
        return tensor_ops.matmul(self, other)

    def __rmatmul__(self, other):
        return tensor_ops.matmul(other, self)

    def __neg__(self):
        return tensor_ops.unary("neg", self)

    def __eq__(self, other):
        return tensor_ops.compare("eq", self, other)

    def __ne__(self, other):
        return tensor_ops.compare("ne", self, other)

    def __lt__(self, other):
        return tensor_ops.compare("lt", self, other)

    def __le__(self, other):
        return tensor_ops.compare("le", self, other)

    def __gt__(self, other):
        return tensor_ops.compare("gt", self, other)

    def __ge__(self, other):
        return tensor_ops.compare("ge", self, other)

    def __invert__(self):
        if self.dtype != numpy.bool_:
            raise TypeError("~ (bitwise not) is only supported here for bool tensors")
        return self == False  # noqa: E712  (elementwise: a bool tensor)

    def __and__(self, other):
        return tensor_ops.logical("and", self, other)

    def __or__(self, other):
        return tensor_ops.logical("or", self, other)

    def __bool__(self):
        if self._data.size != 1:
            raise RuntimeError(f"Boolean value of Tensor with more than one value is ambiguous")
        return bool(self.item())

    def __format__(self, format_spec):
        # f"{loss:.4f}" of a 0-d tensor formats its value, as PyTorch's does; other shapes format as objects
        if self._data.ndim == 0:
            return self.item().__format__(format_spec)
        return object.__format__(self, format_spec)

    def __float__(self):
        return float(self.item())

    def __int__(self):
        return int(self.item())

    def __index__(self):
        if self.dtype.kind not in "iu" or self._data.size != 1:
            raise TypeError("only integer tensors of a single element can be converted to an index")
        return int(self.item())

    def __getitem__(self, key):
        return tensor_ops.index(self, key)

    def __setitem__(self, key, value):
        tensor_ops.index_put(self, key, value)

    def exp(self):
        return tensor_ops.unary("exp", self)

    def neg(self):
        return tensor_ops.unary("neg", self)

    negative = neg

    def square(self):
        return tensor_ops.unary("square", self)

    def sign(self):
        return tensor_ops.unary("sign", self)

    def sin(self):
        return tensor_ops.unary("sin", self)

    def cos(self):
        return tensor_ops.unary("cos", self)

    def tan(self):
        return tensor_ops.unary("tan", self)

    def asin(self):
        return tensor_ops.unary("asin", self)

    def acos(self):
        return tensor_ops.unary("acos", self)

    def atan(self):
        return tensor_ops.unary("atan", self)

    def sinh(self):
        return tensor_ops.unary("sinh", self)

    def cosh(self):
        return tensor_ops.unary("cosh", self)

    def log10(self):
        return tensor_ops.unary("log10", self)

    def log2(self):
        return tensor_ops.unary("log2", self)

    def log1p(self):
        return tensor_ops.unary("log1p", self)

    def expm1(self):
        return tensor_ops.unary("expm1", self)

    def exp2(self):
        return tensor_ops.unary("exp2", self)

    def erf(self):
        return tensor_ops.unary("erf", self)

    def reciprocal(self):
        return tensor_ops.unary("reciprocal", self)

    def floor(self):
        return tensor_ops.unary("floor", self)

    def ceil(self):
        return tensor_ops.unary("ceil", self)

    def round(self):
        return tensor_ops.unary("round", self)

    def trunc(self):
        return tensor_ops.unary("trunc", self)

    def frac(self):
        return tensor_ops.unary("frac", self)

    def atan2(self, other):
        return tensor_ops.binary("atan2", self, other)

    def log(self):
        return tensor_ops.unary("log", self)

    def sqrt(self):
        return tensor_ops.unary("sqrt", self)

    def rsqrt(self):
        return tensor_ops.unary("rsqrt", self)

    def tanh(self):
        return tensor_ops.unary("tanh", self)

    def sigmoid(self):
        return tensor_ops.unary("sigmoid", self)

    def relu(self):
        return tensor_ops.unary("relu", self)

    def abs(self):
        return tensor_ops.unary("abs", self)

    def pow(self, exponent):
        return tensor_ops.binary("pow", self, exponent)

    def clamp(self, min=None, max=None):
        return tensor_ops.clamp(self, min, max)

    clip = clamp

    def masked_fill(self, mask, value):
        return tensor_ops.masked_fill(self, mask, value)

    # In place, as PyTorch's methods ending in _: each writes into self's array (every view of it sees the
    # change), bumps its storage's version and returns self.
    def add_(self, other, alpha=1):
        return tensor_ops.add_(self, other, alpha)

    def sub_(self, other, alpha=1):
        return tensor_ops.add_(self, other, -alpha, name="sub_")

    def mul_(self, other):
        return tensor_ops.binary_("mul", self, other)

    def div_(self, other):
        return tensor_ops.binary_("div", self, other)

    def zero_(self):
        return tensor_ops.fill_(self, 0)

    def fill_(self, value):
        return tensor_ops.fill_(self, value)

    def copy_(self, src, non_blocking=False):
        return tensor_ops.copy_(self, src)

    def clamp_(self, min=None, max=None):
        return tensor_ops.clamp_(self, min, max)

    clip_ = clamp_

    def masked_fill_(self, mask, value):
        return tensor_ops.masked_fill_(self, mask, value)

    def normal_(self, mean=0.0, std=1.0, *, generator=None):
        return tensor_ops.normal_(self, mean, std, generator)

    def uniform_(self, a=0.0, b=1.0, *, generator=None):  # PyTorch names them from and to
        return tensor_ops.uniform_(self, a, b, generator)

    __iadd__ = add_   # x += y changes x itself, as in PyTorch (without them Python would rebind x to x + y)
    __isub__ = sub_
    __imul__ = mul_
    __itruediv__ = div_

    def tril(self, diagonal=0):
        return tensor_ops.Triangle.apply(self, diagonal, False)

    def triu(self, diagonal=0):
        return tensor_ops.Triangle.apply(self, diagonal, True)

    # keepdims: numpy's spelling, which PyTorch accepts too
    def sum(self, dim=None, keepdim=False, dtype=None, *, keepdims=False):
        return tensor_ops.sum(self, dim, keepdim or keepdims, dtype)

    def mean(self, dim=None, keepdim=False, dtype=None, *, keepdims=False):
        return tensor_ops.mean(self, dim, keepdim or keepdims, dtype)

    def var(self, dim=None, unbiased=True, keepdim=False, *, correction=None, keepdims=False):
        return tensor_ops.var(self, dim, unbiased, keepdim or keepdims, correction)

    def std(self, dim=None, unbiased=True, keepdim=False, *, correction=None, keepdims=False):
        return tensor_ops.std(self, dim, unbiased, keepdim or keepdims, correction)

    def prod(self, dim=None, keepdim=False, *, dtype=None):
        return tensor_ops.prod(self, dim, keepdim, dtype)

    def max(self, dim=None, keepdim=False, *, keepdims=False):
        return tensor_ops.extreme("max", self, dim, keepdim or keepdims)

    def min(self, dim=None, keepdim=False, *, keepdims=False):
        return tensor_ops.extreme("min", self, dim, keepdim or keepdims)

    def amax(self, dim=None, keepdim=False, *, keepdims=False):
        return tensor_ops.amax(self, dim, keepdim or keepdims)

    def amin(self, dim=None, keepdim=False, *, keepdims=False):
        return tensor_ops.amin(self, dim, keepdim or keepdims)

    def argmax(self, dim=None, keepdim=False, *, keepdims=False):
        return tensor_ops.argextreme("max", self, dim, keepdim or keepdims)

    def argmin(self, dim=None, keepdim=False, *, keepdims=False):
        return tensor_ops.argextreme("min", self, dim, keepdim or keepdims)

    def all(self, dim=None, keepdim=False):
        return tensor_ops.all_of(self, dim, keepdim)

    def any(self, dim=None, keepdim=False):
        return tensor_ops.any_of(self, dim, keepdim)

    def norm(self, p="fro", dim=None, keepdim=False, dtype=None):
        return tensor_ops.norm(self, p, dim, keepdim, dtype)

    def cumsum(self, dim, dtype=None):
        return tensor_ops.cumsum(self, dim, dtype)

    def sort(self, dim=-1, descending=False, stable=False):
        return tensor_ops.sort(self, dim, descending, stable)

    def argsort(self, dim=-1, descending=False, stable=False):
        return tensor_ops.argsort(self, dim, descending, stable)

    def unique(self, sorted=True, return_inverse=False, return_counts=False, dim=None):
        return tensor_ops.unique(self, sorted, return_inverse, return_counts, dim)

    def flip(self, *dims):
        return tensor_ops.flip(self, as_sizes(dims))

    def roll(self, shifts, dims=None):
        return tensor_ops.roll(self, shifts, dims)

    def repeat_interleave(self, repeats, dim=None, *, output_size=None):
        return tensor_ops.repeat_interleave(self, repeats, dim, output_size)

    def repeat(self, *sizes):
        return tensor_ops.repeat(self, as_sizes(sizes))

    def scatter(self, dim, index, src=None, *, value=None, reduce=None):
        return tensor_ops.scatter(self, dim, index, value if src is None else src, reduce)

    def scatter_(self, dim, index, src=None, *, value=None, reduce=None):
        return tensor_ops.scatter_(self, dim, index, value if src is None else src, reduce)

    def scatter_add(self, dim, index, src):
        return tensor_ops.scatter_add(self, dim, index, src)

    def scatter_add_(self, dim, index, src):
        return tensor_ops.scatter_add_(self, dim, index, src)

    def index_select(self, dim, index):
        return tensor_ops.index_select(self, dim, index)

    def nonzero(self, *, as_tuple=False):
        return tensor_ops.nonzero(self, as_tuple)

    def masked_select(self, mask):
        return tensor_ops.masked_select(self, mask)

    def chunk(self, chunks, dim=0):
        return tensor_ops.chunk(self, chunks, dim)

    def unbind(self, dim=0):
        return tensor_ops.unbind(self, dim)

    def allclose(self, other, rtol=1e-05, atol=1e-08, equal_nan=False):
        return tensor_ops.allclose(self, other, rtol, atol, equal_nan)

    def isclose(self, other, rtol=1e-05, atol=1e-08, equal_nan=False):
        return tensor_ops.isclose(self, other, rtol, atol, equal_nan)

    def maximum(self, other):
        return tensor_ops.binary("maximum", self, other)

    def minimum(self, other):
        return tensor_ops.binary("minimum", self, other)

    def histc(self, bins=100, min=0, max=0):
        return tensor_ops.histc(self, bins, min, max)

    def softmax(self, dim):
        return functional.softmax(self, dim)

    def log_softmax(self, dim):
        return tensor_ops.log_softmax(self, dim)

    def topk(self, k, dim=-1, largest=True, sorted=True):
        return tensor_ops.topk(self, k, dim, largest, sorted)

    def view(self, *shape):
        return tensor_ops.view(self, as_sizes(shape))

    def reshape(self, *shape):
        return tensor_ops.reshape(self, as_sizes(shape))

    def permute(self, *dims):
        return tensor_ops.permute(self, as_sizes(dims))

    def transpose(self, dim0, dim1):
        return tensor_ops.transpose(self, dim0, dim1)

    def t(self):
        """The transpose of a matrix (a vector or a number as it is)."""
        if self.ndim > 2:
            raise RuntimeError(f"t() expects a tensor with <= 2 dimensions, but self is {self.ndim}D")
        return self if self.ndim < 2 else self.transpose(0, 1)

    @property
    def T(self):
        return tensor_ops.permute(self, tuple(reversed(range(self.ndim))))

    def unsqueeze(self, dim):
        return tensor_ops.unsqueeze(self, dim)

    def squeeze(self, dim=None):
        return tensor_ops.squeeze(self, dim)

    def flatten(self, start_dim=0, end_dim=-1):
        return tensor_ops.flatten(self, start_dim, end_dim)

    def expand(self, *sizes):
        return tensor_ops.expand(self, as_sizes(sizes))

    def expand_as(self, other):
        return tensor_ops.expand(self, other.shape)

    def view_as(self, other):
        return tensor_ops.view(self, other.shape)

    def contiguous(self):
        return tensor_ops.contiguous(self)

    def clone(self):
        return tensor_ops.clone(self)

    def is_contiguous(self):
        return bool(self._data.flags.c_contiguous)

    def split(self, split_size, dim=-1):
        return functional.split(self, split_size, dim)

    def to(self, *arguments, dtype=None, device=None, **options):
        """.to(dtype), .to(device) or both; one backend runs everything, so a device changes nothing. A new
        dtype is a copy whose gradient is converted back (bfloat16: rounded to nearest, ties to even)."""
        for argument in arguments:
            if isinstance(argument, Tensor):
                dtype = argument.dtype
            elif isinstance(argument, devices.device):
                continue
            elif argument in ("bfloat16", "float16") or isinstance(argument, (numpy.dtype, type)):
                dtype = argument
        if dtype is None:
            return self
        if numpy.dtype(dtype) == numpy.float16:
            raise NotImplementedError(f"to: dtype {dtype} is not supported; tensors are float32, bfloat16, "
                                      "int32/int64 or bool")
        return tensor_ops.to_dtype(self, dtype)

    def float(self):
        return self.to(numpy.float32)

    def bfloat16(self):
        return self.to("bfloat16")

    def half(self):
        return self.to(numpy.float16)

    def long(self):
        return self.to(numpy.int64)

    def int(self):
        return self.to(numpy.int32)

    def bool(self):
        return self.to(numpy.bool_)

    def type(self, dtype=None, non_blocking=False):
        """Without dtype, the type's name ('torch.FloatTensor'); with one, .to(dtype)."""
        if dtype is None:
            return type_name(self.dtype)
        return self.to(dtype)

    def type_as(self, other):
        return self.to(other.dtype)

    def cuda(self, device=None):
        return self

    def cpu(self):
        return self

    def pin_memory(self):
        """Itself: page-locked host copies are for overlapping copies to the GPU; every tensor here already
        lives on the one backend, so there is nothing to pin (and .to(device, non_blocking=True) copies nothing)."""
        return self

    device = property(lambda self: devices.device(backend.DEVICE_TYPE), doc="the active backend, as a torch.device")
    is_cuda = property(lambda self: backend.ON_GPU)


def _install(methods, tensor_class):
    """Each method and property of `methods` (Python's own entries of a class body aside) on tensor_class."""
    for name, member in vars(methods).items():
        if name not in ("__module__", "__qualname__", "__doc__", "__dict__", "__weakref__"):
            setattr(tensor_class, name, member)


_install(TensorMethods, Tensor)
