"""Tensor's operators and functions, each an autograd Function on the generated kernels.

    arithmetic    a + b, a - b, a * b, a / b, a ** b, -a, a @ b   (broadcasting; Python numbers either side)
    comparisons   a == b, a != b, a < b, a <= b, a > b, a >= b    (bool tensors, no gradient)
    functions     exp log sqrt rsqrt tanh sigmoid relu silu abs clamp, sin cos tan ... log10 erf floor round
                  (UNARY), maximum minimum atan2, where, masked_fill, tril, triu
    reductions    sum mean var std prod max min amax amin argmax argmin norm all any cumsum  (over dim, keepdim)
    products      a @ b, einsum (pairs of operands as batched matrix products)
    movement      view reshape permute transpose unsqueeze squeeze flatten expand contiguous, indexing,
                  cat stack chunk unbind, flip roll repeat repeat_interleave sort, gather scatter scatter_add
                  (differentiable indexes)
    sampling      topk multinomial, normal_ uniform_                                     (generator=)
    counting      unique bincount histc histogram isclose allclose                      (no gradient)
    in place      add_ sub_ mul_ div_ zero_ fill_ copy_ clamp_ masked_fill_ scatter_ scatter_add_, x[key] = value
                  (recorded in a graph)

Elementwise operations are one line each: an expression for the generated kernel (gpt2_cupy.elementwise)
and one for each input's gradient. An input that was broadcast receives the sum of its gradient over the
axes it was broadcast along (sum_to, a generated reduction), as the chain rule says: each of its elements
was used once per position it was copied to.

Movements return views, as PyTorch's do: a transpose or a slice shares the tensor's memory and only
changes the strides the generated kernels read it through; contiguous() copies into row-major order.

Types follow PyTorch's promotion: bool < integers < floats; a Python number only lifts the category (an
int tensor times 2.5 is float32, a float32 tensor plus 1 stays float32); / is always true division.
bfloat16 is a float type narrower than float32: bf16 with bf16 (or with a Python number) stays bf16, bf16
with float32 gives float32. bf16 operations compute in float32 and round their result once (elementwise's
doc), and an input's gradient always has the input's dtype, as in PyTorch.
"""

import builtins
import collections
import math
import re

import numpy

from gpt2_cupy import amp, backend
from gpt2_cupy.autograd import (Function, Tensor, View, bump_version, is_grad_enabled, regenerate_view, storage_of,
                                storage_version, take_place)
from gpt2_cupy.dispatch import batched_matmul, matmul as dispatch_matmul
from gpt2_cupy.elementwise import broadcast_shapes, check_writable, converted, copy, elementwise
from gpt2_cupy.ops.arrays import BFLOAT16, FLOAT32
from gpt2_cupy.random import host_stream
from gpt2_cupy.reduction import normalize_dims, reduce

INT64 = numpy.dtype(numpy.int64)
BOOL = numpy.dtype(numpy.bool_)


# ---- types ---------------------------------------------------------------------------------------------

def is_floating(dtype):
    """float16, 32, 64 or bfloat16 (whose numpy kind is "V", a type numpy itself does not know)."""
    return numpy.dtype(dtype).kind == "f" or numpy.dtype(dtype) == BFLOAT16


def _category(dtype):
    return 2 if is_floating(dtype) else {"b": 0, "i": 1, "u": 1}[numpy.dtype(dtype).kind]


def _widest(dtypes):
    top = max(_category(d) for d in dtypes)
    return max((numpy.dtype(d) for d in dtypes if _category(d) == top), key=lambda d: d.itemsize)


def _python_number_dtype(value):
    return BOOL if isinstance(value, bool) else INT64 if isinstance(value, int) else FLOAT32


def result_type(*operands):
    """PyTorch's type promotion: tensors with dimensions decide, then 0-d tensors, then Python numbers, each
    only when it is of a higher category (bool, integer, float) than what came before."""
    groups = ([o.dtype for o in operands if isinstance(o, backend.xp.ndarray) and o.ndim > 0],
              [o.dtype for o in operands if isinstance(o, backend.xp.ndarray) and o.ndim == 0],
              [_python_number_dtype(o) for o in operands if not isinstance(o, backend.xp.ndarray)])
    result = None
    for group in groups:
        if group:
            candidate = _widest(group)
            if result is None or _category(candidate) > _category(result):
                result = candidate
    return result


def floating(dtype):
    """The type a float function of dtype returns: float32 for integers and bools, as PyTorch's exp(int)."""
    return numpy.dtype(dtype) if is_floating(dtype) else FLOAT32


def as_operand(value):
    """A Tensor's array, a Python number as it is; anything else is refused with its type."""
    if isinstance(value, Tensor):
        return value._data
    if isinstance(value, (bool, int, float)) or isinstance(value, backend.xp.ndarray):
        return value
    if isinstance(value, numpy.generic):
        return value.item()
    raise TypeError(f"unsupported operand type: {type(value).__name__} (expected a Tensor or a number)")


# ---- gradients of broadcast inputs ------------------------------------------------------------------------

def sum_to(gradient, shape):
    """gradient summed over the axes that broadcasting added or stretched, to give `shape`."""
    shape = tuple(shape)
    if tuple(gradient.shape) == shape:
        return gradient
    leading = gradient.ndim - len(shape)
    dims = tuple(range(leading)) + tuple(leading + axis for axis, size in enumerate(shape)
                                         if size == 1 and gradient.shape[leading + axis] != 1)
    return reduce("sum_to", "sum", gradient, dims, keepdim=True).reshape(shape)


# ---- elementwise -----------------------------------------------------------------------------------------

# name: (expression of a and b, d/da of the loss, d/db of the loss), the gradients over a, b, the output
# `out` and the upstream gradient `dout`, as operands (a, b, out, dout) of a generated kernel.
BINARY = {
    "add": ("a + b", "d", "d"),
    "sub": ("a - b", "d", "-d"),
    "mul": ("a * b", "d * b", "d * a"),
    "div": ("a / b", "d / b", "-d * a / (b * b)"),
    "pow": ("powf(a, b)", "d * b * powf(a, b - 1.0f)", "d * c * logf(a)"),
    # on a tie each side receives half, as PyTorch's maximum and minimum
    "maximum": ("a > b || a != a ? a : b", "a > b ? d : (a == b ? 0.5f * d : 0.0f)",
                "b > a ? d : (a == b ? 0.5f * d : 0.0f)"),
    "minimum": ("a < b || a != a ? a : b", "a < b ? d : (a == b ? 0.5f * d : 0.0f)",
                "b < a ? d : (a == b ? 0.5f * d : 0.0f)"),
    "atan2": ("atan2f(a, b)", "d * b / (a * a + b * b)", "-d * a / (a * a + b * b)"),
}
FLOAT_RESULTS = ("div", "atan2")  # true division and atan2 of integers give floats
# The kernels' operand letters for the gradients: a, b are the inputs, c the output, d the upstream gradient.
COMPARISONS = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}


class Binary(Function):
    accepts_strided = True

    @staticmethod
    def forward(ctx, a, b, name):
        dtype = result_type(a, b)
        if name in FLOAT_RESULTS or (name == "pow" and _category(dtype) == 2):
            dtype = floating(dtype)
        expression = BINARY[name][0]
        if name == "pow" and not is_floating(dtype):  # integer powers, exactly, through double
            expression = "(long long)rint(pow((double)a, (double)b))"
        out = elementwise(name, expression, [a, b], compute_dtype=dtype, names=["self", "other"])
        # Only what the gradient rules read is kept: a sum keeps nothing of its operands, a product both.
        used = set(re.findall(r"\b[abc]\b", BINARY[name][1] + " " + BINARY[name][2]))
        ctx.save_for_backward(*(array if letter in used else None for letter, array in zip("abc", (a, b, out))))
        ctx.name, ctx.shapes = name, (numpy.shape(a), numpy.shape(b))
        ctx.dtypes = (getattr(a, "dtype", None), getattr(b, "dtype", None))
        return out

    @staticmethod
    def backward(ctx, dout):
        _, rule_a, rule_b = BINARY[ctx.name]
        operands = [0.0 if array is None else array for array in ctx.saved_tensors] + [dout]
        gradients = []
        for needed, rule, shape, dtype in zip(ctx.needs_input_grad, (rule_a, rule_b), ctx.shapes, ctx.dtypes):
            if not needed:
                gradients.append(None)
                continue
            gradient = elementwise(f"{ctx.name}_backward", rule, operands, compute_dtype=dout.dtype)
            gradients.append(converted(sum_to(gradient, shape), dtype))
        return gradients[0], gradients[1], None




def binary(name, a, b):
    """a op b for Tensors or numbers (at least one a Tensor)."""
    return Binary.apply(_lift(a), _lift(b), name)


def _lift(value):
    return value if isinstance(value, Tensor) else as_operand(value)


def compare(name, a, b):
    if a is None or b is None:  # tensor == None is False, != None True, as Python's default equality
        if name in ("eq", "ne"):
            return name == "ne"
        raise TypeError(f"'{COMPARISONS[name]}' not supported between a Tensor and NoneType")
    a, b = as_operand(a), as_operand(b)
    dtype = result_type(a, b)
    return Tensor(elementwise(name, f"a {COMPARISONS[name]} b", [a, b], compute_dtype=dtype, out_dtype=BOOL,
                              names=["self", "other"]))


def logical(name, a, b):
    """a & b, a | b for bool tensors (and bools)."""
    a, b = as_operand(a), as_operand(b)
    for operand in (a, b):
        if getattr(operand, "dtype", BOOL) != BOOL and not isinstance(operand, bool):
            raise TypeError(f"{name}: only bool tensors are supported here (got {operand.dtype})")
    expression = "a && b" if name == "and" else "a || b"
    return Tensor(elementwise(f"logical_{name}", expression, [a, b], compute_dtype=BOOL, names=["self", "other"]))


# name: (expression of a, what backward reads as `a`: the input x or the output y, the gradient from a and
# the upstream gradient b). Float functions of integer tensors give float32, as PyTorch's do.
UNARY = {
    "neg": ("-a", "x", "-b"),
    "exp": ("expf(a)", "y", "b * a"),
    "log": ("logf(a)", "x", "b / a"),
    "sqrt": ("sqrtf(a)", "y", "b * 0.5f / a"),
    "rsqrt": ("rsqrtf(a)", "y", "b * -0.5f * a * a * a"),
    "tanh": ("tanhf(a)", "y", "b * (1.0f - a * a)"),
    "sigmoid": ("1.0f / (1.0f + expf(-a))", "y", "b * a * (1.0f - a)"),
    "relu": ("a > 0 ? a : 0", "y", "a > 0 ? b : 0.0f"),
    "silu": ("a / (1.0f + expf(-a))", "x", "b * (1.0f + a * (1.0f - 1.0f / (1.0f + expf(-a)))) / (1.0f + expf(-a))"),
    "abs": ("a < 0 ? -a : a", "x", "a > 0 ? b : (a < 0 ? -b : 0.0f)"),
    "square": ("a * a", "x", "2.0f * a * b"),
    "sign": ("(a > 0) - (a < 0)", "x", "0.0f"),
    "sin": ("sinf(a)", "x", "b * cosf(a)"),
    "cos": ("cosf(a)", "x", "-b * sinf(a)"),
    "tan": ("tanf(a)", "y", "b * (1.0f + a * a)"),
    "asin": ("asinf(a)", "x", "b * rsqrtf(1.0f - a * a)"),
    "acos": ("acosf(a)", "x", "-b * rsqrtf(1.0f - a * a)"),
    "atan": ("atanf(a)", "x", "b / (1.0f + a * a)"),
    "sinh": ("sinhf(a)", "x", "b * coshf(a)"),
    "cosh": ("coshf(a)", "x", "b * sinhf(a)"),
    "log10": ("log10f(a)", "x", "b / (a * 2.302585093f)"),
    "log2": ("log2f(a)", "x", "b / (a * 0.6931471806f)"),
    "log1p": ("log1pf(a)", "x", "b / (1.0f + a)"),
    "expm1": ("expm1f(a)", "y", "b * (a + 1.0f)"),
    "exp2": ("exp2f(a)", "y", "b * a * 0.6931471806f"),
    "erf": ("erff(a)", "x", "b * 1.1283791671f * expf(-a * a)"),
    "reciprocal": ("1.0f / a", "y", "-b * a * a"),
    "floor": ("floorf(a)", "x", "0.0f"),
    "ceil": ("ceilf(a)", "x", "0.0f"),
    "round": ("rintf(a)", "x", "0.0f"),   # half to even, as PyTorch's
    "trunc": ("truncf(a)", "x", "0.0f"),
    "frac": ("a - truncf(a)", "x", "b"),
}
KEEPS_TYPE = ("neg", "relu", "abs", "square", "sign")  # the rest are float functions
ROUNDINGS = ("floor", "ceil", "round", "trunc")  # of an integer tensor: the tensor itself, as PyTorch's


class Unary(Function):
    accepts_strided = True

    @staticmethod
    def forward(ctx, x, name):
        expression, reads, _ = UNARY[name]
        dtype = x.dtype if name in KEEPS_TYPE or (name in ROUNDINGS and not is_floating(x.dtype)) \
            else floating(x.dtype)
        if name in ROUNDINGS and not is_floating(x.dtype):
            expression = "a"
        if name == "neg" and dtype == BOOL:
            raise TypeError("Negation, the `-` operator, on a bool tensor is not supported. If you are trying to "
                            "invert a mask, use the `~` or `logical_not()` operator instead.")
        y = elementwise(name, expression, [x], compute_dtype=dtype)
        ctx.save_for_backward(x if reads == "x" else y)
        ctx.name = name
        return y

    @staticmethod
    def backward(ctx, dout):
        (saved,) = ctx.saved_tensors
        return elementwise(f"{ctx.name}_backward", UNARY[ctx.name][2], [saved, dout], compute_dtype=dout.dtype), None


def unary(name, x):
    return Unary.apply(x, name)


CLAMP = "a < b ? b : (a > c ? c : a)"  # a clamped to [b, c]


def clamp_bounds(x, low, high):
    """The type clamp computes in, and its bounds as numbers of that type (None: no bound)."""
    dtype = result_type(x, *[v for v in (low, high) if v is not None])
    low = -math.inf if low is None else low
    high = math.inf if high is None else high
    if not is_floating(dtype):  # integer bounds: the widest a long long holds
        low, high = max(low, -2**63), min(high, 2**63 - 1)
    return dtype, low, high


class Clamp(Function):
    accepts_strided = True

    @staticmethod
    def forward(ctx, x, low, high):
        ctx.save_for_backward(x)
        ctx.low, ctx.high = low, high
        dtype, low, high = clamp_bounds(x, low, high)
        return elementwise("clamp", CLAMP, [x, low, high], compute_dtype=dtype)

    @staticmethod
    def backward(ctx, dout):
        (x,) = ctx.saved_tensors
        low = -math.inf if ctx.low is None else ctx.low
        high = math.inf if ctx.high is None else ctx.high
        # the gradient passes where low <= x <= high (both ends included, as PyTorch's)
        return elementwise("clamp_backward", "(a >= b && a <= c) ? d : 0.0f", [x, low, high, dout],
                           compute_dtype=dout.dtype), None, None


def clamp(x, min=None, max=None):
    if min is None and max is None:
        raise RuntimeError("torch.clamp: At least one of 'min' or 'max' must not be None")
    return Clamp.apply(x, min, max)


class Where(Function):
    accepts_strided = True

    @staticmethod
    def forward(ctx, condition, a, b):
        _check_bool("where", "condition", condition)
        ctx.save_for_backward(condition)
        ctx.shapes = [getattr(v, "shape", ()) for v in (a, b)]
        ctx.dtypes = [getattr(v, "dtype", None) for v in (a, b)]
        return elementwise("where", "a ? b : c", [condition, a, b], compute_dtype=result_type(a, b),
                           names=["condition", "input", "other"])

    @staticmethod
    def backward(ctx, dout):
        (condition,) = ctx.saved_tensors
        gradients = [None, None]
        for index, expression in enumerate(("a ? b : 0.0f", "a ? 0.0f : b")):
            if ctx.needs_input_grad[index + 1]:
                gradient = elementwise("where_backward", expression, [condition, dout], compute_dtype=dout.dtype)
                gradients[index] = converted(sum_to(gradient, ctx.shapes[index]), ctx.dtypes[index])
        return None, *gradients


def where(condition, input, other):
    return Where.apply(condition, _lift(input), _lift(other))


def masked_fill(x, mask, value):
    """x with `value` where mask (bool, broadcast to x's shape) is True: where(mask, value, x)."""
    if isinstance(value, Tensor):
        value = value.item()
    mask_array = mask._data if isinstance(mask, Tensor) else mask
    _check_bool("masked_fill", "mask", mask_array)
    if broadcast_shapes("masked_fill", [mask_array.shape, x.shape], ["mask", "self"]) != x.shape:
        raise RuntimeError(f"masked_fill: the mask {tuple(mask_array.shape)} must broadcast to self {x.shape}")
    return Where.apply(mask, value, x)


def _check_bool(operation, name, array):
    if not isinstance(array, backend.xp.ndarray) or array.dtype != BOOL:
        got = array.dtype if isinstance(array, backend.xp.ndarray) else type(array).__name__
        raise RuntimeError(f"{operation}: expected {name} to be a bool tensor, but got {got}")


class Triangle(Function):
    """tril and triu: elements above (tril) or below (triu) the diagonal set to 0, on the last two axes."""
    accepts_strided = True

    @staticmethod
    def forward(ctx, x, diagonal, upper):
        ctx.diagonal, ctx.upper = diagonal, upper
        return _triangle(x, diagonal, upper)

    @staticmethod
    def backward(ctx, dout):
        return _triangle(dout, ctx.diagonal, ctx.upper), None, None


def _triangle(x, diagonal, upper):
    if x.ndim < 2:
        raise RuntimeError(f"{'triu' if upper else 'tril'}: input tensor must have at least 2 dimensions, "
                           f"got shape {tuple(x.shape)}")
    rows = backend.xp.arange(x.shape[-2], dtype=numpy.int32).reshape(-1, 1)
    columns = backend.xp.arange(x.shape[-1], dtype=numpy.int32)
    keep = "c - b >= d" if upper else "c - b <= d"  # column - row against the diagonal's offset
    # every operand is converted to the compute type: a bool one would turn rows and columns into bools
    compute = numpy.dtype(numpy.int32) if x.dtype == BOOL else x.dtype
    return elementwise("triu" if upper else "tril", f"({keep}) ? a : 0", [x, rows, columns, int(diagonal)],
                       compute_dtype=compute, out_dtype=x.dtype)


# ---- matrix products -------------------------------------------------------------------------------------

def _batched_product(operation, a, b, transpose_a=False, transpose_b=False, out_dtype=None):
    """op(a) @ op(b) over broadcast batch axes: a (..., M, K), b (..., K, N) -> (..., M, N), of a's dtype
    (float32, or bf16), or of out_dtype: float32 from bf16 inputs keeps the tensor cores' sums unrounded."""
    a_rows = a.shape[-1] if transpose_a else a.shape[-2]
    b_columns = b.shape[-2] if transpose_b else b.shape[-1]
    batch = broadcast_shapes(operation, [a.shape[:-2], b.shape[:-2]], ["input", "other"])
    out_dtype = a.dtype if out_dtype is None else out_dtype
    if b.ndim == 2 and not transpose_a:  # (..., M, K) @ (K, N): one matrix product over all rows
        rows = _contiguous(a).reshape(-1, a.shape[-1])
        out = backend.xp.empty((rows.shape[0], b_columns), dtype=out_dtype)
        product = dispatch_matmul(rows, _contiguous(b), transpose_b=transpose_b, out=out)
        return product.reshape(batch + (a_rows, b_columns))
    count = math.prod(batch)
    a = _contiguous(backend.xp.broadcast_to(a, batch + a.shape[-2:])).reshape((count,) + a.shape[-2:])
    b = _contiguous(backend.xp.broadcast_to(b, batch + b.shape[-2:])).reshape((count,) + b.shape[-2:])
    out = backend.xp.empty((count, a_rows, b_columns), dtype=out_dtype)
    batched_matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b, out=out)
    return out.reshape(batch + (a_rows, b_columns))


def _contiguous(array):
    return array if array.flags.c_contiguous else copy("contiguous", array)


class MatMul(Function):
    """a @ b. a_bf16 and b_bf16: autocast's bf16 copies of a and b (matmul passes them inside an autocast
    block); the product then runs in bf16, and the gradients keep a's and b's own dtypes."""
    accepts_strided = True

    @staticmethod
    def forward(ctx, a, b, a_bf16=None, b_bf16=None):
        for name, array in (("input", a), ("other", b)):
            if array.dtype not in (FLOAT32, BFLOAT16):
                raise TypeError(f"matmul: {name} has dtype {array.dtype}; the matmul kernels take float32 or bfloat16")
            if array.ndim == 0:
                raise RuntimeError(f"matmul: both arguments to matmul need to be at least 1D, but they are "
                                   f"{a.ndim}D and {b.ndim}D")
        ctx.dtypes = (a.dtype, b.dtype)
        if a_bf16 is not None:
            a, b = a_bf16, b_bf16
        if a.dtype != b.dtype:
            raise RuntimeError(f"expected m1 and m2 to have the same dtype, but got: {a.dtype} != {b.dtype}")
        ctx.shapes = (a.shape, b.shape)
        a2 = a.reshape(1, -1) if a.ndim == 1 else a  # a vector is a one-row (or one-column) matrix
        b2 = b.reshape(-1, 1) if b.ndim == 1 else b
        if a2.shape[-1] != b2.shape[-2]:
            raise RuntimeError(f"matmul: mat1 and mat2 shapes cannot be multiplied (input {tuple(a.shape)}, "
                               f"other {tuple(b.shape)}: {a2.shape[-1]} != {b2.shape[-2]})")
        ctx.save_for_backward(a2, b2)
        out = _batched_product("matmul", a2, b2)
        ctx.full_shape = out.shape
        if a.ndim == 1:
            out = out.reshape(out.shape[:-2] + out.shape[-1:])
        if b.ndim == 1:
            out = out.reshape(out.shape[:-1])
        return out

    @staticmethod
    def backward(ctx, dout):
        a2, b2 = ctx.saved_tensors
        dout = dout.reshape(ctx.full_shape)
        da = db = None
        if ctx.needs_input_grad[0]:  # dA = dout Bᵀ
            da = _batched_product("matmul_backward", dout, b2, transpose_b=True, out_dtype=ctx.dtypes[0])
            da = sum_to(da, a2.shape).reshape(ctx.shapes[0])
        if ctx.needs_input_grad[1]:  # dB = Aᵀ dout
            db = _batched_product("matmul_backward", a2, dout, transpose_a=True, out_dtype=ctx.dtypes[1])
            db = sum_to(db, b2.shape).reshape(ctx.shapes[1])
        return da, db, None, None


def matmul(a, b):
    """a @ b, batched and broadcasting as torch.matmul; inside gpt2_cupy.autocast in bf16 (float32 inputs
    converted, a parameter's copy cached for the block), with a bf16 result."""
    if amp.autocast_dtype() is not None:
        return MatMul.apply(a, b, amp.product_input(a), amp.product_input(b))
    return MatMul.apply(a, b)


# ---- reductions ------------------------------------------------------------------------------------------

def _expand_back(dout, shape, dims, keepdim):
    """A reduction's upstream gradient (its kept shape) laid out again over the input's shape (a copy)."""
    if not keepdim:
        for dim in dims:
            dout = backend.xp.expand_dims(dout, dim)
    return copy("expand", backend.xp.broadcast_to(dout, shape))


class Sum(Function):
    accepts_strided = True

    @staticmethod
    def forward(ctx, x, dims, keepdim, mean):
        dims = normalize_dims("mean" if mean else "sum", dims, x.ndim)
        ctx.shape, ctx.dims, ctx.keepdim = x.shape, dims, keepdim
        count = math.prod(x.shape[d] for d in dims)
        if mean and not is_floating(x.dtype):
            raise RuntimeError(f"mean(): could not infer output dtype. Input dtype must be either a floating point "
                               f"or complex dtype. Got: {x.dtype}")
        ctx.scale = 1.0 / count if mean and count else (math.nan if mean else 1.0)
        return reduce("mean" if mean else "sum", "sum", x, dims, keepdim, scale=ctx.scale)

    @staticmethod
    def backward(ctx, dout):
        gradient = _expand_back(dout, ctx.shape, ctx.dims, ctx.keepdim)
        if ctx.scale != 1.0:
            gradient = elementwise("mean_backward", "a * b", [gradient, ctx.scale], compute_dtype=gradient.dtype)
        return gradient, None, None, None


def sum(x, dim=None, keepdim=False, dtype=None):
    out = Sum.apply(x, dim, keepdim, False)
    return out if dtype is None else out.to(dtype)


def mean(x, dim=None, keepdim=False, dtype=None):
    return Sum.apply(x if dtype is None else x.to(dtype), dim, keepdim, True)


def var(x, dim=None, unbiased=True, keepdim=False, correction=None):
    """Σ (x - mean)² / (count - correction); correction 1 (unbiased, the default) or 0, as PyTorch's."""
    if correction is None:
        correction = 1 if unbiased else 0
    dims = normalize_dims("var", dim, x.ndim)
    count = math.prod(x.shape[d] for d in dims)
    centered = x - mean(x, dims, keepdim=True)
    return sum(centered * centered, dims, keepdim=keepdim) / max(0, count - correction)


def std(x, dim=None, unbiased=True, keepdim=False, correction=None):
    return var(x, dim, unbiased, keepdim, correction).sqrt()


class Extreme(Function):
    """max or min over one dim: (values, indices); the gradient goes to the index that was picked."""
    accepts_strided = True

    @staticmethod
    def forward(ctx, x, dim, keepdim, kind):
        (dim,) = normalize_dims(kind, dim, x.ndim) or (0,)
        values, indices = reduce(kind, kind, x, (dim,) if x.ndim else (), keepdim)
        ctx.save_for_backward(indices)
        ctx.shape, ctx.dim, ctx.keepdim = x.shape, dim, keepdim
        return values, indices

    @staticmethod
    def backward(ctx, dvalues, dindices):
        (indices,) = ctx.saved_tensors
        if not ctx.shape:
            return dvalues.copy(), None, None, None
        if not ctx.keepdim:
            indices, dvalues = (backend.xp.expand_dims(a, ctx.dim) for a in (indices, dvalues))
        positions = backend.xp.arange(ctx.shape[ctx.dim], dtype=numpy.int64)
        positions = positions.reshape((-1,) + (1,) * (len(ctx.shape) - 1 - ctx.dim))
        return elementwise("extreme_backward", "(a == b) ? c : 0", [indices, positions, dvalues],
                           compute_dtype=dvalues.dtype), None, None, None


class ExtremeOfAll(Function):
    """max() or min() of every element: the gradient is shared evenly among the elements equal to it."""
    accepts_strided = True

    @staticmethod
    def forward(ctx, x, kind):
        if x.size == 0:
            raise RuntimeError(f"{kind}(): Expected reduction dim to be specified for input.numel() == 0. "
                               "Specify the reduction dim with the 'dim' argument.")
        value, _ = reduce(kind, kind, x, None, False)
        ctx.save_for_backward(x, value)
        return value

    @staticmethod
    def backward(ctx, dout):
        x, value = ctx.saved_tensors
        hits = elementwise("extreme_hits", "a == b", [x, value], compute_dtype=x.dtype, out_dtype=BOOL)
        count = reduce("extreme_count", "sum", hits, None)
        return elementwise("extreme_backward", "a ? b / (float)c : 0.0f", [hits, dout, count],
                           compute_dtype=dout.dtype), None


MaxMin = collections.namedtuple("MaxMin", ["values", "indices"])


def extreme(kind, x, dim=None, keepdim=False):
    """max/min: of all elements (a Tensor), over dim ((values, indices)), or against another tensor."""
    if isinstance(dim, Tensor):  # torch.max(a, b): the elementwise maximum
        return where(compare("gt" if kind == "max" else "lt", x, dim), x, dim)
    if dim is None:
        return ExtremeOfAll.apply(x, kind)
    values, indices = Extreme.apply(x, dim, keepdim, kind)
    return MaxMin(values, indices.detach())


def argextreme(kind, x, dim=None, keepdim=False):
    """argmax/argmin: int64 indices; without dim, into the flattened tensor."""
    data = x._data
    if dim is None:
        data, dim = _contiguous(data).reshape(-1), 0
        keepdim = False if not keepdim else keepdim
    _, indices = reduce(f"arg{kind}", kind, data, (dim,) if data.ndim else (), keepdim)
    if keepdim and x._data.ndim != data.ndim:
        indices = indices.reshape((1,) * x.ndim)
    return Tensor(indices)


# ---- softmax over any axis ----------------------------------------------------------------------------------

class LogSoftmax(Function):
    accepts_strided = True

    @staticmethod
    def forward(ctx, x, dim):
        (dim,) = normalize_dims("log_softmax", dim, x.ndim)
        largest, _ = reduce("log_softmax", "max", x, (dim,), keepdim=True)
        shifted_exp = elementwise("log_softmax", "expf(a - b)", [x, largest])
        total = reduce("log_softmax", "sum", shifted_exp, (dim,), keepdim=True)
        out = elementwise("log_softmax", "a - b - logf(c)", [x, largest, total], compute_dtype=x.dtype)
        ctx.save_for_backward(out)
        ctx.dim = dim
        return out

    @staticmethod
    def backward(ctx, dout):
        (out,) = ctx.saved_tensors  # d/dx = dout - softmax · Σ dout over the axis
        total = reduce("log_softmax_backward", "sum", dout, (ctx.dim,), keepdim=True)
        return elementwise("log_softmax_backward", "a - expf(b) * c", [dout, out, total],
                           compute_dtype=dout.dtype), None


def log_softmax(x, dim):
    return LogSoftmax.apply(x, dim)


# ---- movement: views ------------------------------------------------------------------------------------------

VIEW_ERROR = ("view size is not compatible with input tensor's size and stride (at least one dimension spans across "
              "two contiguous subspaces). Use .reshape(...) instead.")


def infer_shape(shape, numel):
    """shape with its one -1 filled in; PyTorch's error when the sizes do not give numel elements."""
    shape = tuple(int(s) for s in shape)
    if shape.count(-1) > 1:
        raise RuntimeError("only one dimension can be inferred")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape and known and numel % known == 0:
        shape = tuple(numel // known if s == -1 else s for s in shape)
    if math.prod(shape) != numel or any(s < 0 for s in shape):
        raise RuntimeError(f"shape '{list(shape)}' is invalid for input of size {numel}")
    return shape


def view_strides(shape, strides, new_shape):
    """The strides of `new_shape` over the same memory, or None if it needs a copy (PyTorch's computeStride).

    Axes can be merged or split only within a run of axes that is contiguous in memory (each stride the
    next stride times the next size); a new axis must not straddle two such runs.
    """
    if math.prod(shape) == 0 or not shape:
        return True
    new_strides = [0] * len(new_shape)
    view_axis = len(new_shape) - 1
    chunk_base_stride = strides[-1] if strides else 1
    tensor_elements, view_elements = 1, 1
    for axis in range(len(shape) - 1, -1, -1):
        tensor_elements *= shape[axis]
        if axis == 0 or (shape[axis - 1] != 1 and strides[axis - 1] != tensor_elements * chunk_base_stride):
            while view_axis >= 0 and (view_elements < tensor_elements or new_shape[view_axis] == 1):
                new_strides[view_axis] = view_elements * chunk_base_stride
                view_elements *= new_shape[view_axis]
                view_axis -= 1
            if view_elements != tensor_elements:
                return None
            if axis > 0:
                chunk_base_stride = strides[axis - 1]
                tensor_elements, view_elements = 1, 1
    return view_axis == -1 and new_strides


def _view(name, x, make, undo):
    out = View.apply(x, name, make, undo)
    remember_base(out, x, make, undo)
    return out


def remember_base(view, x, make, undo):
    """A view keeps the tensor whose memory it shares (PyTorch's ._base: the first one, never a view) and
    how to take it from that tensor again (_view_of_base) and send a gradient back to it (_grad_to_base):
    an in-place write into the view must change the base's place in the graph too."""
    if storage_of(view._data) is not storage_of(x._data):
        return  # a copy (clone, contiguous, a reshape that could not be a view), not a view
    base = getattr(x, "_base", None)
    if base is None:
        view._base, view._view_of_base, view._grad_to_base = x, make, undo
    else:
        outer_make, outer_undo = x._view_of_base, x._grad_to_base
        view._base = base
        view._view_of_base = lambda a: make(outer_make(a))
        view._grad_to_base = lambda d: outer_undo(undo(d))


def view(x, shape):
    shape = infer_shape(shape, x.numel())
    if view_strides(x.shape, [s // x._data.itemsize for s in x._data.strides], shape) is None:
        raise RuntimeError(VIEW_ERROR)
    old = x.shape
    return _view("view", x, lambda a: a.reshape(shape), lambda d: _reshape_array(d, old))


def _reshape_array(array, shape):
    """A reshaped array: a view when the strides allow it, else a contiguous copy first."""
    if view_strides(array.shape, [s // array.itemsize for s in array.strides], tuple(shape)) is None:
        array = copy("reshape", array)
    return array.reshape(shape)


def reshape(x, shape):
    shape = infer_shape(shape, x.numel())
    old = x.shape
    return _view("reshape", x, lambda a: _reshape_array(a, shape), lambda d: _reshape_array(d, old))


def permute(x, dims):
    dims = normalize_permutation(dims, x.ndim)
    inverse = tuple(numpy.argsort(dims))
    return _view("permute", x, lambda a: a.transpose(dims), lambda d: d.transpose(inverse))


def normalize_permutation(dims, ndim):
    dims = tuple(normalize_dims("permute", (d,), ndim)[0] for d in dims) if ndim else tuple(dims)
    if sorted(dims) != list(range(ndim)):
        raise RuntimeError(f"permute(sparse_coo): number of dimensions in the tensor input does not match the length "
                           f"of the desired ordering of dimensions i.e. input.dim() = {ndim} is not equal to "
                           f"len(dims) = {len(dims)}" if len(dims) != ndim else
                           f"permute(): duplicate dims are not allowed in {dims}")
    return dims


def transpose(x, dim0, dim1):
    if x.ndim == 0:
        return x
    order = list(range(x.ndim))
    a, b = (normalize_dims("transpose", (d,), x.ndim)[0] for d in (dim0, dim1))
    order[a], order[b] = order[b], order[a]
    return permute(x, order)


def unsqueeze(x, dim):
    (dim,) = normalize_dims("unsqueeze", (dim,), x.ndim + 1)
    return reshape(x, x.shape[:dim] + (1,) + x.shape[dim:])


def squeeze(x, dim=None):
    if dim is None:
        dims = [d for d, size in enumerate(x.shape) if size == 1]
    else:
        dims = [d for d in normalize_dims("squeeze", dim, x.ndim) if x.shape[d] == 1] if x.ndim else []
    return reshape(x, tuple(size for d, size in enumerate(x.shape) if d not in dims))


def flatten(x, start_dim=0, end_dim=-1):
    if x.ndim == 0:
        return reshape(x, (1,))
    start, end = (normalize_dims("flatten", (d,), x.ndim)[0] for d in (start_dim, end_dim))
    if start > end:
        raise RuntimeError("flatten() has invalid args: start_dim cannot come after end_dim")
    return reshape(x, x.shape[:start] + (math.prod(x.shape[start:end + 1]),) + x.shape[end + 1:])


def expand(x, sizes):
    sizes = tuple(sizes)
    if len(sizes) < x.ndim:
        raise RuntimeError(f"expand: the number of sizes provided ({len(sizes)}) must be greater or equal to the "
                           f"number of dimensions in the tensor ({x.ndim})")
    leading = len(sizes) - x.ndim
    shape = tuple(x.shape[axis - leading] if size == -1 else size for axis, size in enumerate(sizes))
    for axis, size in enumerate(x.shape):
        if size != 1 and size != shape[leading + axis]:
            raise RuntimeError(f"The expanded size of the tensor ({shape[leading + axis]}) must match the existing "
                               f"size ({size}) at non-singleton dimension {leading + axis}.  Target sizes: "
                               f"{list(sizes)}.  Tensor sizes: {list(x.shape)}")
    old = x.shape
    return _view("expand", x, lambda a: backend.xp.broadcast_to(a, shape), lambda d: sum_to(d, old))


def clone(x):
    return _view("clone", x, lambda a: copy("clone", a), lambda d: d)


def contiguous(x):
    if x._data.flags.c_contiguous:
        return x
    return _view("contiguous", x, lambda a: copy("contiguous", a), lambda d: d)


# ---- indexing ------------------------------------------------------------------------------------------------

def _index_key(x, key):
    """key with Tensors as arrays and lists as int64 arrays; whether it is advanced (copies) or basic (a view)."""
    parts = key if isinstance(key, tuple) else (key,)
    converted, advanced = [], False
    for part in parts:
        if isinstance(part, Tensor):
            part = part._data
        if isinstance(part, list):
            part = backend.xp.asarray(numpy.array(part))
        if isinstance(part, slice) and part.step is not None and part.step <= 0:
            raise ValueError("step must be greater than zero")
        if isinstance(part, backend.xp.ndarray):
            advanced = True
            if part.dtype.kind not in "biu":
                raise IndexError(f"tensors used as indices must be long, int, byte or bool tensors, not {part.dtype}")
        converted.append(part)
    converted = _expand_ellipsis(converted, x.ndim)
    _check_index_bounds(x.shape, converted)
    return tuple(converted), advanced


def _expand_ellipsis(parts, ndim):
    """parts with `...` (or nothing, at the end) replaced by full slices of the axes no other part consumes."""
    consumed = builtins.sum(part.ndim if isinstance(part, backend.xp.ndarray) and part.dtype == BOOL else 1
                                   for part in parts if part is not None and part is not Ellipsis)
    if consumed > ndim:
        raise IndexError(f"too many indices for tensor of dimension {ndim}")
    at = next((i for i, part in enumerate(parts) if part is Ellipsis), None)
    if at is None:
        return parts
    return parts[:at] + [slice(None)] * (ndim - consumed) + parts[at + 1:]


def _check_index_bounds(shape, parts):
    """PyTorch's IndexError for an integer index outside its axis (numpy and CuPy would wrap or clip some)."""
    axis = 0
    for part in parts:
        if part is None:
            continue
        if isinstance(part, backend.xp.ndarray) and part.dtype == BOOL:
            if tuple(part.shape) != tuple(shape[axis:axis + part.ndim]):
                raise IndexError(f"The shape of the mask {tuple(part.shape)} at index {axis} does not match the "
                                 f"shape of the indexed tensor {tuple(shape)}")
            axis += part.ndim
            continue
        size = shape[axis]
        if isinstance(part, int) and not -size <= part < size:
            raise IndexError(f"index {part} is out of bounds for dimension {axis} with size {size}")
        if isinstance(part, backend.xp.ndarray) and part.size:
            low, high = int(part.min()), int(part.max())  # a host read, as PyTorch's own bounds check on the GPU
            if low < -size or high >= size:
                bad = high if high >= size else low
                raise IndexError(f"index {bad} is out of bounds for dimension {axis} with size {size}")
        axis += 1


class Index(Function):
    accepts_strided = True

    @staticmethod
    def forward(ctx, x, key, advanced):
        ctx.shape, ctx.key, ctx.advanced, ctx.dtype = x.shape, key, advanced, x.dtype
        ctx.is_view = not advanced  # a basic index (slices, integers) is a view; an advanced one a copy
        ctx.view_version = storage_version(x)
        return x[key]

    @staticmethod
    def backward(ctx, dout):
        if ctx.advanced:  # an index may repeat: each of its uses adds its gradient
            return _added_at(backend.xp.zeros(ctx.shape, dtype=dout.dtype), ctx.key, dout), None, None
        gradient = backend.xp.zeros(ctx.shape, dtype=dout.dtype)
        gradient[ctx.key] = dout
        return gradient, None, None


def index(x, key):
    key, advanced = _index_key(x, key)
    if not advanced:  # a trailing ... keeps a one-element result a view (numpy would give a copied scalar)
        key = key + (Ellipsis,)
    out = Index.apply(x, key, advanced)
    if not advanced:
        remember_base(out, x, lambda a: a[key], scatter_into(x.shape, key))
    return out


def scatter_into(shape, key):
    """The gradient of x[key] (a basic index) sent back to x: zeros of x's shape, dout at x[key]."""
    def undo(dout):
        gradient = backend.xp.zeros(shape, dtype=dout.dtype)
        gradient[key] = dout
        return gradient
    return undo


def index_put(x, key, value):
    """x[key] = value in place. Inside a graph (x or value requires grad) it is recorded as PyTorch's
    CopySlices records it: x becomes "x as it was, with value at key", so that value's gradient is the
    gradient at key and x's old elements there receive none. A leaf that requires grad refuses, as PyTorch."""
    key, advanced = _index_key(x, key)
    if not _records(x, value):
        x._data[key] = value._data if isinstance(value, Tensor) else value
        bump_version(x._data)
        return
    if not advanced:  # a basic index is a view: the in-place copy into it records CopySlices on x
        target = index(x, key)
        value = value if isinstance(value, Tensor) else Tensor(backend.xp.asarray(value, x.dtype))
        extra = value.ndim - target.ndim  # leading axes of size 1 are dropped, as PyTorch's and numpy's do
        if extra > 0 and builtins.all(size == 1 for size in value.shape[:extra]):
            value = reshape(value, value.shape[extra:])
        copy_(target, value)
        return
    _become(x, IndexPut.apply(x, _lift(value), key))


class IndexPut(Function):
    """x with value written at an advanced index (a copy; _become writes it into x's own array)."""
    accepts_strided = True

    @staticmethod
    def forward(ctx, x, value, key):
        ctx.key, ctx.value_shape = key, numpy.shape(value)
        ctx.value_dtype = getattr(value, "dtype", None)
        out = copy("index_put", x)
        out[key] = value
        return out

    @staticmethod
    def backward(ctx, dout):
        to_x = copy("index_put_backward", dout)
        to_x[ctx.key] = 0  # overwritten: x's old elements there send nothing back
        to_value = None
        if ctx.needs_input_grad[1]:
            selected = dout[ctx.key]
            to_value = converted(sum_to(selected, ctx.value_shape), ctx.value_dtype)
        return to_x, to_value, None


# ---- in place ------------------------------------------------------------------------------------------------
#
# An in-place operation writes its result into self's own array, through the generated kernel's `out`, so
# every reference and view sees it, and a CUDA graph capture records it as one more kernel. When nothing
# asks for a gradient (no_grad, or no operand requires grad) that is all. Otherwise the operation is
# recorded as its out-of-place twin, x.add_(y) as x + y, and self takes the result's place in the graph:
# its values (written into its array) and its grad_fn. Saved arrays that the write changes are caught at
# backward by their storage's version.

LEAF_IN_PLACE = "a leaf Variable that requires grad is being used in an in-place operation."
VIEW_OF_LEAF_IN_PLACE = "a view of a leaf Variable that requires grad is being used in an in-place operation."
_TYPE_NAMES = {"float32": "Float", "float64": "Double", "bfloat16": "BFloat16", "float16": "Half",
               "int64": "Long", "int32": "Int", "bool": "Bool", "uint8": "Byte"}


def _records(x, *operands):
    """Whether the in-place operation on x joins a graph; PyTorch's errors where it may not."""
    if not is_grad_enabled():
        return False
    if x.requires_grad and x.is_leaf:
        raise RuntimeError(LEAF_IN_PLACE)
    base = getattr(x, "_base", None)
    if base is not None and base.is_leaf and base.requires_grad:
        raise RuntimeError(VIEW_OF_LEAF_IN_PLACE)
    return x.requires_grad or builtins.any(isinstance(o, Tensor) and o.requires_grad for o in operands)


def _check_target(operation, x, shape, result_dtype=None):
    """x can hold the result: the operands broadcast to x's shape, the result's type casts to x's, and no two
    of x's elements share memory (an expanded tensor's do). x may be a view: the kernel writes by strides."""
    if tuple(shape) != x.shape:
        raise RuntimeError(f"{operation}: output with shape {list(x.shape)} doesn't match the broadcast shape "
                           f"{list(shape)}")
    if result_dtype is not None and _category(result_dtype) > _category(x.dtype):
        raise RuntimeError(f"{operation}: result type {_TYPE_NAMES.get(numpy.dtype(result_dtype).name)} can't be "
                           f"cast to the desired output type {_TYPE_NAMES.get(x.dtype.name, x.dtype.name)}")
    check_writable(operation, x._data, [])


def _write(operation, expression, x, operands, compute_dtype):
    """x = expression(x's array and operands...) in place, by the generated kernel; x's version goes up."""
    elementwise(operation, expression, [x._data, *operands], compute_dtype=compute_dtype, out_dtype=x.dtype,
                out=x._data)
    bump_version(x._data)
    return x


def _become(x, result):
    """x takes result's values, in its own array, and result's place in the graph (x = result, in place).

    When x is a view, its base changed too: as PyTorch's CopySlices, the base's place in the graph moves
    on to "the base as it was, with result written where x is", and x becomes a view of that again."""
    if result.dtype != x.dtype:
        result = result.to(x.dtype)
    elementwise("copy_", "a", [result._data], compute_dtype=x.dtype, out=x._data)
    bump_version(x._data)
    base = getattr(x, "_base", None)
    if base is None:
        take_place(x, result)
        return x
    take_place(base, CopySlices.apply(base, result, x._view_of_base))
    regenerate_view(x)
    return x


class CopySlices(Function):
    """The base of a view after an in-place write into the view (PyTorch's CopySlices): the base as it was,
    with result where the view is. The base's array already holds it; the backward splits the gradient:
    the view's part goes to result, the rest to the base as it was."""
    accepts_strided = True

    @staticmethod
    def forward(ctx, base, result, view_of_base):
        ctx.view_of_base = view_of_base
        return base

    @staticmethod
    def backward(ctx, dout):
        to_result = copy("copy_slices_backward", ctx.view_of_base(dout))
        to_base = copy("copy_slices_backward", dout)
        backend.fill_zero(ctx.view_of_base(to_base))  # the view's elements were overwritten: the old base gets none
        return to_base, to_result, None


def _operand_shapes(*operands):
    return [o.shape for o in operands if isinstance(o, backend.xp.ndarray)]


def add_(x, other, alpha=1, name="add_"):
    """x += alpha * other (sub_ passes -alpha)."""
    operand = as_operand(other)
    dtype = result_type(x._data, operand)
    _check_target(name, x, broadcast_shapes(name, [x.shape] + _operand_shapes(operand), ["self", "other"]), dtype)
    if _records(x, other):
        scaled = other if alpha == 1 else (other * alpha if isinstance(other, Tensor) else operand * alpha)
        return _become(x, binary("add", x, scaled))
    return _write(name, "a + c * b", x, [operand, alpha], dtype)


def binary_(name, x, other):
    """x *= other or x /= other."""
    operand = as_operand(other)
    dtype = result_type(x._data, operand)
    if name == "div":
        dtype = floating(dtype)
    _check_target(f"{name}_", x, broadcast_shapes(f"{name}_", [x.shape] + _operand_shapes(operand),
                                                  ["self", "other"]), dtype)
    if _records(x, other):
        # the product's gradient reads x's old values, which the write replaces: it gets a copy of them
        return _become(x, binary(name, clone(x), other))
    return _write(f"{name}_", BINARY[name][0], x, [operand], dtype)


def fill_(x, value):
    """Every element of x set to value (a number or a 0-d tensor), converted to x's dtype."""
    operand = as_operand(value)
    if isinstance(operand, backend.xp.ndarray) and operand.ndim != 0:
        raise RuntimeError(f"fill_ only supports 0-dimension value tensor but got tensor with "
                           f"{operand.ndim} dimensions.")
    _check_target("fill_", x, x.shape)
    if _records(x, value):
        return _become(x, where(_all_true(), value, x))
    return _write("fill_", "b", x, [operand], x.dtype)


def copy_(x, src):
    """x's elements set to src's, broadcast to x's shape and converted to x's dtype."""
    if not isinstance(src, Tensor):
        raise TypeError(f"copy_(): argument 'src' must be Tensor, not {type(src).__name__}")
    _check_target("copy_", x, broadcast_shapes("copy_", [x.shape, src.shape], ["self", "src"]))
    if _records(x, src):
        return _become(x, where(_all_true(), src, x))
    return _write("copy_", "b", x, [src._data], x.dtype)


def clamp_(x, min=None, max=None):
    if min is None and max is None:
        raise RuntimeError("torch.clamp: At least one of 'min' or 'max' must not be None")
    dtype, low, high = clamp_bounds(x._data, min, max)
    _check_target("clamp_", x, x.shape, dtype)
    if _records(x):
        return _become(x, Clamp.apply(clone(x), min, max))
    return _write("clamp_", CLAMP, x, [low, high], dtype)


def masked_fill_(x, mask, value):
    """value where mask (bool, broadcast to x's shape) is True; x elsewhere."""
    mask_array = mask._data if isinstance(mask, Tensor) else mask
    _check_bool("masked_fill_", "mask", mask_array)
    operand = as_operand(value)
    if isinstance(operand, backend.xp.ndarray) and operand.ndim != 0:
        raise RuntimeError(f"masked_fill_ only supports a 0-dimensional value tensor, but got tensor with "
                           f"{operand.ndim} dimension(s).")
    _check_target("masked_fill_", x, broadcast_shapes("masked_fill_", [x.shape, mask_array.shape],
                                                      ["self", "mask"]))
    if _records(x, value):
        return _become(x, where(mask, value, x))
    return _write("masked_fill_", "b ? c : a", x, [mask_array, operand], x.dtype)


def fill_random_(x, values):
    """x's elements set to values drawn on the host (normal_, uniform_, random_): a write that no graph
    records, as PyTorch's random fills."""
    _records(x)
    x._data[...] = backend.xp.asarray(numpy.asarray(values).astype(x.dtype))
    bump_version(x._data)
    return x


def normal_(x, mean=0.0, std=1.0, generator=None):
    return fill_random_(x, host_stream(generator).normal(mean, std, x.shape))


def uniform_(x, low=0.0, high=1.0, generator=None):
    return fill_random_(x, host_stream(generator).uniform(low, high, x.shape))


def _all_true():
    """A 0-d True mask: where(True, src, x) is src, with no gradient to x (x's old values are overwritten)."""
    return backend.xp.ones((), dtype=BOOL)


# ---- joining ---------------------------------------------------------------------------------------------------

class Cat(Function):
    accepts_strided = True

    @staticmethod
    def forward(ctx, dim, *arrays):
        ctx.dim, ctx.sizes = dim, [a.shape[dim] for a in arrays]
        return backend.xp.concatenate(arrays, axis=dim)

    @staticmethod
    def backward(ctx, dout):
        ends = numpy.cumsum(ctx.sizes)[:-1].tolist()
        return (None, *backend.xp.split(dout, ends, axis=ctx.dim))


def cat(tensors, dim=0):
    tensors = list(tensors)
    if not tensors:
        raise RuntimeError("torch.cat(): expected a non-empty list of Tensors")
    (dim,) = normalize_dims("cat", (dim,), tensors[0].ndim)
    first = tensors[0].shape
    for index, t in enumerate(tensors):
        if t.ndim != len(first) or t.shape[:dim] + t.shape[dim + 1:] != first[:dim] + first[dim + 1:]:
            raise RuntimeError(f"torch.cat(): Sizes of tensors must match except in dimension {dim}. Expected "
                               f"{list(first)} but got {list(t.shape)} for tensor number {index} in the list")
    dtype = result_type(*[t._data for t in tensors])
    return Cat.apply(dim, *[t if t.dtype == dtype else t.to(dtype) for t in tensors])


def stack(tensors, dim=0):
    tensors = list(tensors)
    if not tensors:
        raise RuntimeError("stack expects a non-empty TensorList")
    for index, t in enumerate(tensors):
        if t.shape != tensors[0].shape:
            raise RuntimeError(f"stack expects each tensor to be equal size, but got {list(tensors[0].shape)} at "
                               f"entry 0 and {list(t.shape)} at entry {index}")
    return cat([unsqueeze(t, dim) for t in tensors], dim)


# ---- types -------------------------------------------------------------------------------------------------------

class Cast(Function):
    accepts_strided = True

    @staticmethod
    def forward(ctx, x, dtype):
        ctx.dtype = x.dtype
        return converted(x, dtype)

    @staticmethod
    def backward(ctx, dout):
        return converted(dout, ctx.dtype) if is_floating(ctx.dtype) else None, None


def to_dtype(x, dtype):
    dtype = numpy.dtype(dtype)
    if dtype == x.dtype:
        return x
    return Cast.apply(x, dtype)


# ---- sampling ----------------------------------------------------------------------------------------------------

TopK = collections.namedtuple("TopK", ["values", "indices"])


def topk(x, k, dim=-1, largest=True, sorted=True):
    """The k largest (or smallest) elements along dim, largest first, and their int64 indices."""
    (dim,) = normalize_dims("topk", (dim,), x.ndim)
    if not 0 <= k <= x.shape[dim]:
        raise RuntimeError(f"selected index k out of range: k = {k}, dimension {dim} has size {x.shape[dim]}")
    keys = -x._data if largest else x._data
    order = backend.xp.argsort(keys, axis=dim, kind="stable")
    indices = backend.xp.take(order, backend.xp.arange(k), axis=dim).astype(numpy.int64)
    return TopK(gather(x, dim, Tensor(indices)), Tensor(indices))


def gather(x, dim, index):
    """out[i][j] = x[i][index[i][j]] along dim (index the same rank as x)."""
    index = index._data if isinstance(index, Tensor) else index
    return Index.apply(x, _along_index(dim, index), True)


def multinomial(probabilities, num_samples, replacement=False, generator=None):
    """num_samples indices per row, drawn with the given (unnormalised) weights; from generator, or the
    default generator manual_seed seeds."""
    weights = backend.asnumpy(probabilities._data).astype(numpy.float64)
    rows = weights.reshape(-1, weights.shape[-1])
    if (rows < 0).any() or not numpy.isfinite(rows).all():
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
    if (rows.sum(axis=1) <= 0).any():
        raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
    if not replacement and num_samples > rows.shape[1]:
        raise RuntimeError("cannot sample n_sample > prob_dist.size(-1) samples without replacement")
    random = host_stream(generator)
    drawn = numpy.stack([random.choice(rows.shape[1], size=num_samples, replace=replacement, p=row / row.sum())
                         for row in rows])
    shape = weights.shape[:-1] + (num_samples,)
    return Tensor(backend.xp.asarray(drawn.reshape(shape).astype(numpy.int64)))


# ---- logic over elements -----------------------------------------------------------------------------------------

def _nonzero_count(x, dims, keepdim):
    """How many elements of x along dims are not zero (int64), by the generated kernels."""
    nonzero = elementwise("nonzero", "a != 0", [x._data], compute_dtype=x.dtype, out_dtype=BOOL)
    dims = normalize_dims("count", dims, x.ndim) if x.ndim else ()
    return reduce("count_nonzero", "sum", nonzero, dims if dims else None, keepdim) if x.ndim else \
        nonzero.astype(INT64), (math.prod(x.shape[d] for d in dims) if dims else x.numel())


def all_of(x, dim=None, keepdim=False):
    """True where every element along dim (or of all) is nonzero: a bool tensor."""
    count, total = _nonzero_count(x, dim, keepdim)
    return Tensor(elementwise("all", "a == b", [count, total], compute_dtype=INT64, out_dtype=BOOL))


def any_of(x, dim=None, keepdim=False):
    """True where some element along dim (or of all) is nonzero: a bool tensor."""
    count, _ = _nonzero_count(x, dim, keepdim)
    return Tensor(elementwise("any", "a > 0", [count], compute_dtype=INT64, out_dtype=BOOL))


def isclose(input, other, rtol=1e-05, atol=1e-08, equal_nan=False):
    """|input - other| <= atol + rtol |other| elementwise (infinities equal to themselves), as torch.isclose."""
    a, b = as_operand(input), as_operand(other)
    nan = " || (a != a && b != b)" if equal_nan else ""
    return Tensor(elementwise("isclose", f"a == b || fabs(a - b) <= c + d * fabs(b){nan}",
                              [a, b, float(atol), float(rtol)], compute_dtype=numpy.float64, out_dtype=BOOL))


def allclose(input, other, rtol=1e-05, atol=1e-08, equal_nan=False):
    return builtins.bool(all_of(isclose(input, other, rtol, atol, equal_nan)).item())


# ---- reordering: each an index, so that the gradient flows back through Index ----------------------------------

def _along(x, dim, positions):
    """x indexed by the integer array `positions` (any shape along dim) on axis dim: a differentiable copy."""
    key = (slice(None),) * dim + (positions,)
    return Index.apply(x, key, True)


def flip(x, dims):
    dims = normalize_dims("flip", (dims,) if isinstance(dims, int) else tuple(dims), x.ndim)
    for dim in dims:
        x = _along(x, dim, backend.xp.arange(x.shape[dim] - 1, -1, -1))
    return x


def roll(x, shifts, dims=None):
    """Elements shifted along dims (wrapping around); without dims, over the flattened tensor."""
    if dims is None:
        return roll(flatten(x), shifts, 0).view(x.shape)
    shifts = (shifts,) if isinstance(shifts, int) else tuple(shifts)
    dims = normalize_dims("roll", (dims,) if isinstance(dims, int) else tuple(dims), x.ndim)
    if len(shifts) != len(dims):
        raise RuntimeError(f"shifts and dimensions must align. shifts: {len(shifts)}, dims:{len(dims)}")
    for shift, dim in zip(shifts, dims):
        size = x.shape[dim]
        x = _along(x, dim, (backend.xp.arange(size) - shift) % builtins.max(size, 1))
    return x


def repeat_interleave(x, repeats, dim=None, output_size=None):
    """Each element repeated `repeats` times along dim (an int or one count per element); flattened first
    without dim."""
    if dim is None:
        x, dim = flatten(x), 0
    (dim,) = normalize_dims("repeat_interleave", (dim,), x.ndim)
    counts = backend.asnumpy(repeats._data) if isinstance(repeats, Tensor) else repeats
    positions = numpy.repeat(numpy.arange(x.shape[dim]), counts)
    return _along(x, dim, backend.xp.asarray(positions))


def repeat(x, sizes):
    """x tiled sizes[i] times along each axis (torch.Tensor.repeat, numpy's tile)."""
    sizes = tuple(sizes)
    if len(sizes) < x.ndim:
        raise RuntimeError("Number of dimensions of repeat dims can not be smaller than number of dimensions of tensor")
    x = reshape(x, (1,) * (len(sizes) - x.ndim) + x.shape)
    interleaved = tuple(d for pair in zip(sizes, x.shape) for d in pair)
    spread = reshape(x, tuple(d for size in x.shape for d in (1, size)))
    return reshape(expand(spread, interleaved), tuple(r * size for r, size in zip(sizes, x.shape)))


SortResult = collections.namedtuple("SortResult", ["values", "indices"])


def argsort(x, dim=-1, descending=False, stable=False):
    (dim,) = normalize_dims("argsort", (dim,), x.ndim) if x.ndim else (0,)
    keys = x._data
    if descending:  # stable among equals: sort the reversed axis ascending, then reverse back
        keys = backend.xp.flip(keys, axis=dim)
        order = backend.xp.flip(backend.xp.argsort(keys, axis=dim, kind="stable"), axis=dim)
        order = x.shape[dim] - 1 - order if x.ndim else order
    else:
        order = backend.xp.argsort(keys, axis=dim, kind="stable")
    return Tensor(backend.xp.ascontiguousarray(order).astype(INT64))


def sort(x, dim=-1, descending=False, stable=False):
    """(values, indices) along dim, ascending unless descending; equal elements keep their order."""
    indices = argsort(x, dim, descending, stable)
    if x.ndim == 0:
        return SortResult(x, indices)
    (dim,) = normalize_dims("sort", (dim,), x.ndim)
    return SortResult(gather(x, dim, indices), indices)


def unique(x, sorted=True, return_inverse=False, return_counts=False, dim=None):
    """The distinct elements, in ascending order; with the inverse indices and the counts when asked."""
    if dim is not None:
        raise NotImplementedError("unique: dim= is not supported; the elements of the flattened tensor are")
    values, inverse, counts = backend.xp.unique(x._data, return_inverse=True, return_counts=True)
    results = [Tensor(values)]
    if return_inverse:
        results.append(Tensor(inverse.reshape(x.shape).astype(INT64)))
    if return_counts:
        results.append(Tensor(counts.astype(INT64)))
    return results[0] if len(results) == 1 else tuple(results)


class CumulativeSum(Function):
    accepts_strided = True

    @staticmethod
    def forward(ctx, x, dim):
        ctx.dim = dim
        dtype = INT64 if not is_floating(x.dtype) else x.dtype
        return backend.xp.cumsum(converted(x, dtype) if dtype != BFLOAT16 else converted(x, FLOAT32),
                                 axis=dim).astype(dtype)

    @staticmethod
    def backward(ctx, dout):  # each input element reaches every later output: a reversed cumulative sum
        flipped = backend.xp.flip(dout, axis=ctx.dim)
        return backend.xp.ascontiguousarray(backend.xp.flip(backend.xp.cumsum(flipped, axis=ctx.dim),
                                                            axis=ctx.dim)).astype(dout.dtype), None


def cumsum(x, dim, dtype=None):
    (dim,) = normalize_dims("cumsum", (dim,), x.ndim) if x.ndim else (0,)
    out = CumulativeSum.apply(x if x.ndim else reshape(x, (1,)), dim)
    out = out if x.ndim else reshape(out, ())
    return out if dtype is None else out.to(dtype)


class Product(Function):
    """The product along one axis. Its gradient for x[k] is dout times the product of every other element of
    the slice, computed as (product of those before k) * (product of those after k): exact where the slice
    holds zeros, unlike dout * prod / x[k], which divides by zero there."""
    accepts_strided = True

    @staticmethod
    def forward(ctx, x, dim, keepdim):
        ctx.save_for_backward(x)
        ctx.dim, ctx.keepdim = dim, keepdim
        dtype = x.dtype if is_floating(x.dtype) else INT64  # of integers and bools: int64, as PyTorch's
        values = converted(x, FLOAT32 if dtype == BFLOAT16 else dtype)
        # asarray: numpy's product of a whole vector is a numpy scalar, not an array
        return converted(backend.xp.asarray(backend.xp.prod(values, axis=dim, keepdims=keepdim)), dtype)

    @staticmethod
    def backward(ctx, dout):
        (x,) = ctx.saved_tensors
        values = converted(x, FLOAT32 if x.dtype == BFLOAT16 else x.dtype)
        others = _exclusive_product(values, ctx.dim) * _exclusive_product(values, ctx.dim, reverse=True)
        upstream = dout if ctx.keepdim else backend.xp.expand_dims(dout, ctx.dim)
        return converted(others * converted(upstream, others.dtype), x.dtype), None, None


def _exclusive_product(values, axis, reverse=False):
    """Along axis, the product of the elements strictly before each one (after it, with reverse); 1 for the
    first (last). Only multiplications: no division by an element, so zeros are exact."""
    if values.shape[axis] == 0:
        return values
    if reverse:
        return backend.xp.flip(_exclusive_product(backend.xp.flip(values, axis=axis), axis), axis=axis)
    ones = backend.xp.ones_like(backend.xp.take(values, backend.xp.arange(1), axis=axis))
    before = backend.xp.take(values, backend.xp.arange(values.shape[axis] - 1), axis=axis)
    return backend.xp.concatenate([ones, backend.xp.cumprod(before, axis=axis)], axis=axis)


def prod(x, dim=None, keepdim=False, dtype=None):
    """The product of all elements (a 0-d tensor), or along dim (one int, as PyTorch's); x converted to dtype
    first when given. Integer and bool tensors give int64."""
    if isinstance(dim, (tuple, list)):
        raise TypeError(f"prod(): argument 'dim' must be int, not {type(dim).__name__}")
    x = x if dtype is None else x.to(dtype)
    if dim is None:
        return Product.apply(reshape(x, (-1,)), 0, False)
    (dim,) = normalize_dims("prod", (dim,), x.ndim) if x.ndim else (0,)
    out = Product.apply(x if x.ndim else reshape(x, (1,)), dim, keepdim and x.ndim > 0)
    return out if x.ndim else reshape(out, ())


# ---- einsum: labelled axes, taken apart into diagonals, sums and batched products ---------------------------------
#
# Each operand's axes get labels: its letters, and for the axes an ellipsis covers negative integers counted from
# the right (-1 the last), so that ellipses of different ranks line up as broadcasting does. A label repeated
# within one operand takes that operand's diagonal; a label that no other operand and not the output needs is
# summed at once; the operands are then contracted two at a time, left to right, each pair as one batched matrix
# product: the labels both share and still need are the batch axes, those both share and no longer need the
# summed axis K, and each one's own labels its M and N.

def einsum(equation, *operands):
    """torch.einsum: sums of products of the operands' elements over the labels the equation names, e.g.
    einsum("bij,bjk->bik", a, b) is a @ b; operands may also come as one list. Without "->" the output is the
    ellipsis's axes, then the letters used once, in alphabetical order (uppercase first)."""
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if not operands:
        raise ValueError("einsum(): must specify the equation string and at least one operand, or at least one "
                         "operand and its subscripts list")
    terms, output_term = _parse_einsum(equation, len(operands))
    labelled = [_einsum_labels(term, t.ndim, n) for n, (term, t) in enumerate(zip(terms, operands))]
    widest = builtins.max(builtins.sum(isinstance(label, int) for label in labels) for labels in labelled)
    ellipsis = list(range(-widest, 0))  # the broadcast ellipsis's labels
    output = _einsum_output(output_term, labelled, ellipsis)
    _einsum_sizes(operands, labelled)
    items = [_diagonal_of(t, labels) for t, labels in zip(operands, labelled)]
    items = [_sum_unneeded(t, labels, _labels_needed(items, n, output)) for n, (t, labels) in enumerate(items)]
    while len(items) > 1:
        (a, a_labels), (b, b_labels) = items[:2]
        items = [_contract(a, a_labels, b, b_labels, _labels_needed(items[1:], 0, output))] + items[2:]
    x, labels = _sum_unneeded(*items[0], set(output))
    return permute(x, [labels.index(label) for label in output]) if output else x


def _parse_einsum(equation, count):
    """The terms of the operands and of the output (None without "->"): lists of letters and "..."."""
    arrow = equation.find("->")
    left = equation if arrow < 0 else equation[:arrow]
    terms, start = [], 0
    for text in left.split(","):
        terms.append(_einsum_term(text, start, f"operand {len(terms)}"))
        start += len(text) + 1
    if len(terms) > count:
        raise RuntimeError("einsum(): fewer operands were provided than specified in the equation")
    if len(terms) < count:
        raise RuntimeError("einsum(): more operands were provided than specified in the equation")
    return terms, None if arrow < 0 else _einsum_term(equation[arrow + 2:], arrow + 2, "output")


def _einsum_term(text, start, owner):
    """One term's letters and "...", spaces skipped; PyTorch's errors for a stray '.' or another character."""
    tokens, at = [], 0
    while at < len(text):
        character = text[at]
        if character == ".":
            if "..." in tokens:
                raise RuntimeError(f"einsum(): found '.' for {owner} for which an ellipsis was already found"
                                   if owner != "output" else
                                   "einsum(): found '.' for output but an ellipsis (...) was already found")
            if text[at:at + 3] != "...":
                raise RuntimeError(f"einsum(): found '.' for {owner} that is not part of any ellipsis"
                                   + (" (...)" if owner == "output" else ""))
            tokens.append("...")
            at += 3
            continue
        if not (character.isascii() and character.isalpha()) and character != " ":
            raise RuntimeError(f"einsum(): invalid subscript given at index {start + at} in the equation string, "
                               "subscripts must be in [a-zA-Z]")
        if character != " ":
            tokens.append(character)
        at += 1
    return tokens


def _einsum_labels(term, ndim, n):
    """One label per axis of operand n: its letters, and -k .. -1 for the k axes its ellipsis covers."""
    letters = [token for token in term if token != "..."]
    if "..." not in term:
        if len(letters) != ndim:
            raise RuntimeError(f"einsum(): the number of subscripts in the equation ({len(letters)}) does not match "
                               f"the number of dimensions ({ndim}) for operand {n} and no ellipsis was given")
        return letters
    if len(letters) > ndim:
        raise RuntimeError(f"einsum(): the number of subscripts in the equation ({len(letters)}) is more than the "
                           f"number of dimensions ({ndim}) for operand {n}")
    at = term.index("...")
    return term[:at] + list(range(len(letters) - ndim, 0)) + term[at + 1:]


def _einsum_output(term, labelled, ellipsis):
    """The output's labels: as written (its "..." the ellipsis's axes; without one, those axes are summed), or
    without "->", the ellipsis's axes then the letters used exactly once, sorted."""
    letters = [label for labels in labelled for label in labels if isinstance(label, str)]
    if term is None:
        return ellipsis + sorted(label for label in set(letters) if letters.count(label) == 1)
    for label in term:
        if label != "..." and term.count(label) > 1:
            raise RuntimeError(f"einsum(): output subscript {label} appears more than once in the output")
        if label != "..." and label not in letters:
            raise RuntimeError(f"einsum(): output subscript {label} does not appear in the equation for any input "
                               "operand")
    at = term.index("...") if "..." in term else len(term)
    return term[:at] + (ellipsis if "..." in term else []) + term[at + 1:]


def _einsum_sizes(operands, labelled):
    """Each label's size, checked as PyTorch's: equal within an operand; across operands equal or 1 (which
    broadcasts)."""
    sizes = {}
    for n, (t, labels) in enumerate(zip(operands, labelled)):
        own = {}
        for axis, (label, size) in enumerate(zip(labels, t.shape)):
            if own.get(label, size) != size:
                raise RuntimeError(f"einsum(): subscript {label} is repeated for operand {n} but the sizes don't "
                                   f"match, {size} != {own[label]}")
            own[label] = size
            if size != 1 and sizes.get(label, 1) not in (1, size):
                raise RuntimeError(
                    f"einsum(): subscript {label} has size {size} for operand {n} which does not broadcast with "
                    f"previously seen size {sizes[label]}" if isinstance(label, str) else
                    f"einsum(): dimension {axis} covered by ellipsis in operand {n} has size {size} which does not "
                    f"broadcast with previously seen ellipsis with size {sizes[label]} for the respective dimension")
            if size != 1:
                sizes[label] = size
    return sizes


def _diagonal_of(x, labels):
    """x with every label once: the axes of a repeated label replaced by their diagonal (x[i, i] for "ii"),
    moved to the front, as a differentiable index."""
    labels = list(labels)
    for label in dict.fromkeys(labels):
        axes = [axis for axis, other in enumerate(labels) if other == label]
        if len(axes) < 2:
            continue
        rest = [axis for axis in range(len(labels)) if axis not in axes]
        x = permute(x, axes + rest)
        positions = backend.xp.arange(x.shape[0])
        x = Index.apply(x, (positions,) * len(axes), True)
        labels = [label] + [labels[axis] for axis in rest]
    return x, labels


def _labels_needed(items, n, output):
    """The labels that items other than the n-th, or the output, have."""
    return set(output).union(*(labels for m, (_, labels) in enumerate(items) if m != n))


def _sum_unneeded(x, labels, needed):
    """x summed over its labels that are not needed, and the labels left."""
    dims = [axis for axis, label in enumerate(labels) if label not in needed]
    if not dims:
        return x, labels
    return sum(x, dims), [label for label in labels if label in needed]


def _contract(a, a_labels, b, b_labels, needed):
    """The product of two labelled operands, summed over the labels both have and `needed` lacks, as one
    batched matrix product (batch..., M, K) @ (batch..., K, N)."""
    batch = [label for label in a_labels if label in b_labels and label in needed]
    summed = [label for label in a_labels if label in b_labels and label not in needed]
    a_only = [label for label in a_labels if label not in b_labels]
    b_only = [label for label in b_labels if label not in a_labels]
    for label in summed:  # size 1 against n: the other side's sum over it first, as broadcasting says
        a_size, b_size = a.shape[a_labels.index(label)], b.shape[b_labels.index(label)]
        if a_size != b_size:
            if a_size == 1:
                b = sum(b, b_labels.index(label), keepdim=True)
            else:
                a = sum(a, a_labels.index(label), keepdim=True)
    a_sizes, b_sizes = dict(zip(a_labels, a.shape)), dict(zip(b_labels, b.shape))
    a = permute(a, [a_labels.index(label) for label in batch + a_only + summed])
    b = permute(b, [b_labels.index(label) for label in batch + summed + b_only])
    rows, inner, columns = (math.prod(sizes[label] for label in labels)
                            for sizes, labels in ((a_sizes, a_only), (a_sizes, summed), (b_sizes, b_only)))
    a = reshape(a, [a_sizes[label] for label in batch] + [rows, inner])
    b = reshape(b, [b_sizes[label] for label in batch] + [inner, columns])
    product = matmul(a, b) if is_floating(a.dtype) and is_floating(b.dtype) else \
        sum(unsqueeze(a, -1) * unsqueeze(b, -3), -2)  # integers: the matmul kernels take floats only
    shape = list(product.shape[:len(batch)]) + [a_sizes[label] for label in a_only] + \
        [b_sizes[label] for label in b_only]
    return reshape(product, shape), batch + a_only + b_only


# ---- scatter: gather's inverse ---------------------------------------------------------------------------------
#
# gather reads x at _along_index's key, scatter writes there: for every position p of index, the position of x
# that is p with its dim-th coordinate replaced by index[p]. Only the part of src of index's shape is used.

def _along_index(dim, index):
    """The advanced key for gather and scatter: open grids of index's positions, index itself along dim."""
    rank = len(index.shape)
    grids = [backend.xp.arange(size).reshape([size if axis == a else 1 for axis in range(rank)])
             for a, size in enumerate(index.shape)]
    grids[dim] = index
    return tuple(grids)


def _scatter_key(x, dim, index, src):
    """dim (non-negative) and the key for scatter into x, after PyTorch's checks of index and src (whose
    messages say scatter for scatter_add too, as PyTorch's do)."""
    (dim,) = normalize_dims("scatter", (dim,), x.ndim)
    positions = index._data if isinstance(index, Tensor) else index
    if positions.dtype != INT64:
        raise RuntimeError("scatter(): Expected dtype int64 for index")
    if isinstance(src, Tensor) and src.dtype != x.dtype:
        raise RuntimeError("scatter(): Expected self.dtype to be equal to src.dtype")
    if positions.size:
        _check_scatter_shapes(x, dim, positions, src)
        low, high = int(positions.min()), int(positions.max())  # a host read, as PyTorch's own check
        if low < 0 or high >= x.shape[dim]:
            raise RuntimeError(f"index {high if high >= x.shape[dim] else low} is out of bounds for dimension "
                               f"{dim} with size {x.shape[dim]}")
    return _along_index(dim, positions)


def _check_scatter_shapes(x, dim, positions, src):
    """index as many axes as x (and src), no longer than x along the other axes, nor than src along any."""
    if positions.ndim != x.ndim:
        raise RuntimeError("Index tensor must have the same number of dimensions as self tensor")
    wrong = any(size > x.shape[axis] for axis, size in enumerate(positions.shape) if axis != dim)
    message = f"Expected index {list(positions.shape)} to be smaller than self {list(x.shape)} apart from dimension " \
              f"{dim}"
    if isinstance(src, Tensor):
        if src.ndim != positions.ndim:
            raise RuntimeError("Index tensor must have the same number of dimensions as src tensor")
        wrong = wrong or any(size > src.shape[axis] for axis, size in enumerate(positions.shape))
        message += f" and to be smaller size than src {list(src.shape)}"
    if wrong:
        raise RuntimeError(message)


def _scattered_part(src, key):
    """src's part of the key's shape (a differentiable view), or a number as it is."""
    if not isinstance(src, Tensor):
        return as_operand(src)
    return src[tuple(slice(0, size) for size in numpy.broadcast_shapes(*(k.shape for k in key)))]


def scatter(x, dim, index, src, reduce=None):
    """x with src's elements (or the number src) written at index along dim: out[i][index[i][j]] = src[i][j]
    for dim 1. The gradient reaches x where nothing was written and src where it was read (IndexPut's)."""
    if reduce is not None:
        if reduce != "add":
            raise NotImplementedError(f"scatter(reduce={reduce!r}): only reduce='add' is supported")
        return scatter_add(x, dim, index, src)
    key = _scatter_key(x, dim, index, src)
    return IndexPut.apply(x, _lift(_scattered_part(src, key)), key)


class ScatterAdd(Function):
    """x with src added at key (repeated positions add up): the gradient is dout for x, dout at key for src."""
    accepts_strided = True

    @staticmethod
    def forward(ctx, x, src, key):
        ctx.key = key
        return _added_at(copy("scatter_add", x), key, src)

    @staticmethod
    def backward(ctx, dout):
        to_src = copy("scatter_add_backward", dout[ctx.key]) if ctx.needs_input_grad[1] else None
        return copy("scatter_add_backward", dout), to_src, None


def scatter_add(x, dim, index, src):
    """x with src's elements added at index along dim: out[i][index[i][j]] += src[i][j] for dim 1."""
    if not isinstance(src, Tensor):
        raise TypeError(f"scatter_add(): argument 'src' must be Tensor, not {type(src).__name__}")
    key = _scatter_key(x, dim, index, src)
    return ScatterAdd.apply(x, _scattered_part(src, key), key)


def _added_at(target, key, values):
    """target with values added at key, repeated positions each adding (ufunc.at); bf16 summed in float32.
    Writes into target unless it is bf16; use the result."""
    wide = converted(target, FLOAT32) if target.dtype == BFLOAT16 else target
    backend.xp.add.at(wide, key, converted(values, wide.dtype))
    return converted(wide, target.dtype)


def _scatter_in_place(operation, scattered, x, src):
    """x set to `scattered` (scatter's or scatter_add's result) in place; recorded in a graph as in-place
    operations are (_become)."""
    _check_target(operation, x, x.shape)
    if _records(x, src):
        return _become(x, scattered(x))
    return _write(operation, "b", x, [scattered(x.detach())._data], x.dtype)


def scatter_(x, dim, index, src, reduce=None):
    return _scatter_in_place("scatter_", lambda t: scatter(t, dim, index, src, reduce), x, src)


def scatter_add_(x, dim, index, src):
    return _scatter_in_place("scatter_add_", lambda t: scatter_add(t, dim, index, src), x, src)


# ---- counting ------------------------------------------------------------------------------------------------------

def bincount(x, weights=None, minlength=0):
    counts = numpy.bincount(backend.asnumpy(x._data), None if weights is None else backend.asnumpy(weights._data),
                            minlength)
    return Tensor(backend.xp.asarray(counts if weights is not None else counts.astype(INT64)))


def histc(x, bins=100, min=0, max=0):
    """Counts in `bins` equal bins over [min, max] (the data's own range when both are 0), float as torch's."""
    values = backend.asnumpy(x._data).astype(numpy.float64).reshape(-1)
    low, high = (values.min(), values.max()) if min == max == 0 and values.size else (min, max)
    if low == high:
        low, high = low - 1, high + 1
    counts, _ = numpy.histogram(values[(values >= low) & (values <= high)], bins=bins, range=(low, high))
    return Tensor(backend.xp.asarray(counts.astype(x.dtype if is_floating(x.dtype) else FLOAT32)))


Histogram = collections.namedtuple("Histogram", ["hist", "bin_edges"])


def histogram(x, bins=100, *, range=None, weight=None, density=False):
    values = backend.asnumpy(x._data).astype(numpy.float64).reshape(-1)
    if isinstance(bins, Tensor):
        bins = backend.asnumpy(bins._data)
    weights = None if weight is None else backend.asnumpy(weight._data).reshape(-1)
    counts, edges = numpy.histogram(values, bins=bins, range=range, weights=weights, density=density)
    return Histogram(*(Tensor(backend.xp.asarray(a.astype(x.dtype))) for a in (counts, edges)))


# ---- norms and extremes over several axes ---------------------------------------------------------------------------

def norm(x, p="fro", dim=None, keepdim=False, dtype=None):
    """The p-norm over dim (all elements by default): 2 (or "fro"), 1, inf, or any positive p."""
    x = x if dtype is None else x.to(dtype)
    if p in ("fro", 2, 2.0):
        return unary("sqrt", sum(x * x, dim, keepdim))
    if p == math.inf:
        return amax(unary("abs", x), dim, keepdim)
    return sum(binary("pow", unary("abs", x), p), dim, keepdim) ** (1.0 / p)


def amax(x, dim=None, keepdim=False, kind="max"):
    """The largest (amax) or smallest (amin) element over one or several axes (all without dim)."""
    if dim is None or dim == ():
        return extreme(kind, x) if not keepdim else reshape(extreme(kind, x), (1,) * x.ndim)
    dims = sorted(normalize_dims(f"a{kind}", (dim,) if isinstance(dim, int) else tuple(dim), x.ndim), reverse=True)
    for d in dims:
        x = extreme(kind, x, d, keepdim=True).values
    return x if keepdim else squeeze(x, tuple(dims))


def amin(x, dim=None, keepdim=False):
    return amax(x, dim, keepdim, kind="min")


# ---- pieces ------------------------------------------------------------------------------------------------------

def chunk(x, chunks, dim=0):
    """At most `chunks` pieces of equal size along dim (the last smaller), views of x."""
    (dim,) = normalize_dims("chunk", (dim,), x.ndim)
    size = builtins.max(1, -(-x.shape[dim] // chunks))
    return tuple(index(x, (slice(None),) * dim + (slice(start, start + size),))
                 for start in range(0, builtins.max(x.shape[dim], 1), size))


def unbind(x, dim=0):
    (dim,) = normalize_dims("unbind", (dim,), x.ndim)
    return tuple(index(x, (slice(None),) * dim + (i,)) for i in range(x.shape[dim]))


# ---- selecting -----------------------------------------------------------------------------------------------------

def index_select(x, dim, index):
    """The entries of x at `index` (a 1-D integer tensor) along dim: a differentiable copy."""
    (dim,) = normalize_dims("index_select", (dim,), x.ndim)
    positions = index._data if isinstance(index, Tensor) else backend.xp.asarray(index)
    if positions.ndim != 1:
        raise IndexError("index_select(): Index is supposed to be a vector")
    return _along(x, dim, positions)


def nonzero(x, as_tuple=False):
    """The int64 coordinates of the nonzero elements, one row each (or one tensor per axis with as_tuple)."""
    coordinates = backend.xp.nonzero(x._data)
    if as_tuple:
        return tuple(Tensor(c.astype(INT64)) for c in coordinates)
    return Tensor(backend.xp.stack(coordinates, axis=1).astype(INT64) if coordinates else
                  backend.xp.zeros((int(builtins.bool(x._data)), 0), dtype=INT64))


def masked_select(x, mask):
    """The elements of x where mask (broadcast to x's shape) is True, as a 1-D tensor: a differentiable copy."""
    mask_array = mask._data if isinstance(mask, Tensor) else mask
    _check_bool("masked_select", "mask", mask_array)
    shape = broadcast_shapes("masked_select", [x.shape, mask_array.shape], ["self", "mask"])
    return Index.apply(expand(x, shape) if x.shape != shape else x,
                       (backend.xp.broadcast_to(mask_array, shape),), True)
