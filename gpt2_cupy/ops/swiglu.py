"""SwiGLU, the gated activation of Llama's MLP, fused, forward and backward, elementwise on float32 arrays.

    y = swiglu_forward(gate, up)                  silu(gate) * up
    dgate, dup = swiglu_backward(dout, gate, up)

gate and up are the two projections of the MLP's input (gate_proj(x), up_proj(x)), of one shape, any shape
(in Llama (B, T, intermediate_size)); y, dout, dgate and dup have that shape too. The forward also takes bf16
gate and up (generation in bf16). The kernels are
kernels/swiglu.cu, taught in chapters/17a_llama.ipynb; arrays that start at a 16-byte aligned address go
through the float4 kernels.
"""

import numpy as np

from gpt2_cupy import kernels
from gpt2_cupy.elementwise import contiguous

from .arrays import (FLOAT32, THREADS_PER_BLOCK, ceil_div, check, check_views, launch_elementwise, output,
                     element_offset, rows_apart, storage_c_type, storage_dtype, storage_of)


def swiglu_forward(gate, up, out=None):
    """silu(gate) * up, elementwise. Returns y (or out) of gate's shape, C-contiguous. gate and up float32, or
    both bf16 (y bf16, computed in float32 and rounded once: generation in bf16). gate and up may be views:
    bf16 ones whose rows lie evenly spaced and alike (the two halves of one product's output) are read where
    they lie; any others are copied first."""
    dtype = storage_dtype("swiglu_forward", "gate", gate)
    check_views("swiglu_forward", gate=(gate, ("...",), dtype), up=(up, ("...",), dtype))
    out = output("swiglu_forward", out, gate.shape, dtype=dtype)
    row_stride = rows_apart(gate) if dtype != FLOAT32 and gate.ndim else None
    if row_stride is None or rows_apart(up) != row_stride:
        gate, up = contiguous(gate), contiguous(up)
        row_stride = gate.shape[-1] if gate.ndim else 1
    if dtype == FLOAT32:
        launch_elementwise("swiglu", "swiglu_forward", (out, gate, up), gate.size)
    elif gate.size:
        name = f"swiglu_forward_stored<{storage_c_type(dtype)}>"
        kernels.function("swiglu", name, name_expressions=(name,))(
            (ceil_div(gate.size, THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,),
            (out, storage_of(gate), storage_of(up), np.int32(gate.size), np.int32(gate.shape[-1] if gate.ndim else 1),
             np.int64(row_stride), np.int64(element_offset(gate)), np.int64(element_offset(up))))
    return out


def swiglu_backward(dout, gate, up, out=None):
    """(dgate, dup) for the upstream gradient dout; out, when given, is the pair of arrays to write them into."""
    check("swiglu_backward", dout=(dout, ("...",)), gate=(gate, ("...",)), up=(up, ("...",)))
    dgate, dup = (None, None) if out is None else out
    dgate = output("swiglu_backward", dgate, gate.shape, name="out[0] (dgate)")
    dup = output("swiglu_backward", dup, gate.shape, name="out[1] (dup)")
    launch_elementwise("swiglu", "swiglu_backward", (dgate, dup, dout, gate, up), gate.size)
    return dgate, dup

