"""SwiGLU, the gated activation of Llama's MLP, fused, forward and backward, elementwise on float32 arrays.

    y = swiglu_forward(gate, up)                  silu(gate) * up
    dgate, dup = swiglu_backward(dout, gate, up)

gate and up are the two projections of the MLP's input (gate_proj(x), up_proj(x)), of one shape, any shape
(in Llama (B, T, intermediate_size)); y, dout, dgate and dup have that shape too. The kernels are
kernels/swiglu.cu, taught in chapters/17_llama.ipynb; arrays that start at a 16-byte aligned address go
through the float4 kernels.
"""

from .arrays import check, launch_elementwise, output


def swiglu_forward(gate, up, out=None):
    """silu(gate) * up, elementwise. Returns y (or out) of gate's shape."""
    check("swiglu_forward", gate=(gate, ("...",)), up=(up, ("...",)))
    out = output("swiglu_forward", out, gate.shape)
    launch_elementwise("swiglu", "swiglu_forward", (out, gate, up), gate.size)
    return out


def swiglu_backward(dout, gate, up, out=None):
    """(dgate, dup) for the upstream gradient dout; out, when given, is the pair of arrays to write them into."""
    check("swiglu_backward", dout=(dout, ("...",)), gate=(gate, ("...",)), up=(up, ("...",)))
    dgate, dup = (None, None) if out is None else out
    dgate = output("swiglu_backward", dgate, gate.shape, name="out[0] (dgate)")
    dup = output("swiglu_backward", dup, gate.shape, name="out[1] (dup)")
    launch_elementwise("swiglu", "swiglu_backward", (dgate, dup, dout, gate, up), gate.size)
    return dgate, dup

