"""Mixed precision as PyTorch users know it: bf16 autocast, and a GradScaler that bf16 does not need.

    with gpt2_cupy.autocast(device_type="cuda", dtype=gpt2_cupy.bfloat16):   # also gpt2_cupy.amp.autocast
        logits, loss = model(idx, targets)                                    # and gpt2_cupy.cuda.amp.autocast
    loss.backward()                                                           # outside the block, as in PyTorch
    optimizer.step()

Inside the block, the products take bf16 inputs: F.linear (nn.Linear) and @ (matmul) convert a float32
input to bf16 (a parameter once per block: the copy is cached until the outermost block ends, as PyTorch's
weight cache is), multiply on tensor cores with float32 sums, add the bias in float32, and round once to a
bf16 output. F.embedding gives bf16 rows from its float32 table. Every other op follows its input's dtype,
inside a block or not: bf16 in, bf16 out (the residual +, LayerNorm, GELU, dropout, split, view,
transpose, contiguous, attention), computed in float32 and rounded once on store. So GPT-2's whole
residual stream is bf16 from the embedding to the logits, half the bytes of float32, as llm.c keeps it.

What stays float32: the parameters (the master weights) and AdamW's moments; every sum inside a kernel (the
products' accumulators, the reductions); LayerNorm's mean and 1/std; cross-entropy's log-sum-exp and its
loss, a float32 number from bf16 logits.

Gradients, as under PyTorch's autocast: a tensor's gradient has that tensor's dtype. Activation gradients
flow in bf16 between bf16 ops. A parameter's gradient is summed in float32 and added in float32 into the
optimizer's flat float32 buffer: the Linear weight's on tensor cores with float32 output, LayerNorm's and
the embedding's by their float32 column sums. AdamW updates the float32 masters; with
bf16_working_copy=True (the train CLI's --dtype bf16) it also writes each master's bf16 copy in the same
pass, and the products read that copy instead of converting the weights before each forward.

bf16 keeps float32's 8 exponent bits, so its gradients neither overflow nor underflow where float32's do not:
training needs no loss scaling, and GradScaler stays a no-op that passes the loss through.

Where this differs from PyTorch, and why:
- PyTorch's LayerNorm and embedding give float32 under autocast; here they give bf16, so that every
  activation between ops travels in bf16, half the bytes (llm.c keeps its residual stream so too).
- dtype=None means float32 here (PyTorch's default for "cuda" is float16, which no kernel of the package
  takes): autocast(device_type="cuda") without a dtype changes nothing; dtype=float16 raises.
- device_type="cpu" is always a no-op. device_type="cuda" runs the bf16 kernels on either backend: the
  CPU executor runs the same CUDA C, bit for bit, so the bf16 path is tested without a GPU.
"""

import functools

import ml_dtypes
import numpy

from gpt2_cupy.autograd import Tensor
from gpt2_cupy.elementwise import converted

BFLOAT16 = numpy.dtype(ml_dtypes.bfloat16)
FLOAT32 = numpy.dtype(numpy.float32)
FLOAT16 = numpy.dtype(numpy.float16)
DEVICE_TYPES = ("cuda", "cpu")

_blocks = []         # the dtype of each "cuda" `with` block entered and not yet left, innermost last (None: off)
_weight_cache = {}   # id(parameter) -> (parameter, the array its copy was made from, the bf16 copy)


class autocast:
    """torch.autocast: inside the block the products run in bf16 (see the module's doc).

    One object serves many `with` blocks (nanoGPT enters its `ctx` every step), may be nested in itself,
    and decorates functions (each call runs inside the block). enabled=False, or dtype float32 or None,
    runs float32 inside (also inside an enabled outer block, as PyTorch's does).
    """

    def __init__(self, device_type="cuda", dtype=None, enabled=True, cache_enabled=None):
        if device_type not in DEVICE_TYPES:
            raise RuntimeError(f"User specified an unsupported autocast device_type '{device_type}'; "
                               f"use one of {DEVICE_TYPES}")
        dtype = None if dtype is None else numpy.dtype(dtype)
        if dtype == FLOAT16 and enabled and device_type == "cuda":
            raise NotImplementedError("autocast: float16 is not supported; use dtype=gpt2_cupy.bfloat16 (bf16 "
                                      "needs no loss scaling) or float32")
        if dtype not in (None, FLOAT32, BFLOAT16, FLOAT16):
            raise ValueError(f"autocast: dtype {dtype} is not supported; use gpt2_cupy.bfloat16 or float32")
        self.device_type, self.dtype, self.enabled = device_type, dtype, bool(enabled)
        self.cache_enabled = True if cache_enabled is None else bool(cache_enabled)

    def _block_dtype(self):
        """The dtype the products run in inside this block: bf16 or None (float32)."""
        return BFLOAT16 if self.enabled and self.dtype == BFLOAT16 else None

    def __enter__(self):
        if self.device_type == "cuda":
            _blocks.append((self._block_dtype(), self.cache_enabled))
        return self

    def __exit__(self, *exception):
        if self.device_type == "cuda":
            _blocks.pop()
            if not _blocks:
                _weight_cache.clear()   # the parameters may change before the next block: cast them again
        return False

    def __call__(self, function):
        @functools.wraps(function)
        def inside_autocast(*arguments, **options):
            with self:
                return function(*arguments, **options)
        return inside_autocast


def get_autocast_dtype(device_type="cuda"):
    """The dtype the products run in: bfloat16 inside an enabled "cuda" block, else float32."""
    return BFLOAT16 if device_type == "cuda" and autocast_dtype() is not None else FLOAT32


def is_autocast_enabled(device_type="cuda"):
    """Whether the products run in bf16 here: inside an enabled autocast(dtype=bfloat16) block."""
    return device_type == "cuda" and autocast_dtype() is not None


def autocast_dtype():
    """bfloat16 inside an enabled block, None outside (and where an inner block disabled it)."""
    return _blocks[-1][0] if _blocks else None


def as_bf16(array):
    """A backend array in bf16: itself if it is bf16 already, else a rounded copy (a generated kernel)."""
    return converted(array, BFLOAT16)


def product_input(tensor):
    """The bf16 array a product reads for `tensor` under autocast. A parameter of an AdamW with
    bf16_working_copy=True: the copy its last step wrote, while that still equals bf16 of the parameter
    (gpt2_cupy.optim.WorkingCopy). Another leaf that requires grad (a parameter) is converted once per
    outermost block and cached, as PyTorch's weight cache does; anything else each time."""
    array = tensor._data if isinstance(tensor, Tensor) else tensor
    working_copy = getattr(tensor, "_working_copy", None)
    if working_copy is not None and working_copy.equals_bf16_of(array):
        return working_copy.array
    cacheable = (isinstance(tensor, Tensor) and tensor.is_leaf and tensor.requires_grad and _blocks
                 and _blocks[-1][1] and array.dtype != BFLOAT16)
    if not cacheable:
        return as_bf16(array)
    cached = _weight_cache.get(id(tensor))
    if cached is None or cached[1] is not array:   # new, or its .data was replaced since
        cached = (tensor, array, as_bf16(array))
        _weight_cache[id(tensor)] = cached
    return cached[2]


class GradScaler:
    """torch.cuda.amp.GradScaler as a no-op: float32 and bf16 training need no loss scaling (bf16 has float32's
    exponent range); float16, which would, is not supported."""

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 enabled=True, device="cuda"):
        self.enabled = enabled

    def scale(self, loss):
        return loss

    def unscale_(self, optimizer):
        pass

    def step(self, optimizer):
        optimizer.step()

    def update(self, new_scale=None):
        pass

    def get_scale(self):
        return 1.0

    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict):
        pass
