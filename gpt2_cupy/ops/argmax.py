"""The index of the largest element along the last axis: greedy generation's next token, chosen on the device.

    index = argmax_forward(logits, out=None)

logits (..., V) float32 or bf16; index (..., 1) int64, the shape of torch.argmax(logits, dim=-1, keepdim=True).
The first of equal largest elements wins, and NaN counts as the largest (the first NaN wins), as numpy's and
PyTorch's argmax. Forward only: an index has no gradient.

Kernels (kernels/argmax.cu): argmax_partial reduces stretches of ELEMENTS_PER_BLOCK elements of a row, a block
each; argmax_rows reduces a row's stretches with one warp. A general reduction gives a single row one block,
many times slower on a vocabulary's logits (bench/design_choices.json).
"""

import numpy as np

from gpt2_cupy import backend, kernels
from gpt2_cupy.ops.arrays import LARGEST_GRID_Y, WARP_SIZE, ceil_div, check, output, storage_c_type, storage_dtype

THREADS = 256                # kernels/argmax.cu's ARGMAX_THREADS
ELEMENTS_PER_BLOCK = 4096    # kernels/argmax.cu's ELEMENTS_PER_BLOCK


def argmax_forward(logits, out=None):
    """The index (..., 1) int64 of the largest element of each row of logits (..., V)."""
    name = "argmax_forward"
    dtype = storage_dtype(name, "logits", logits)
    sizes = check(name, logits=(logits, ("...", "V"), dtype))
    leading, V = sizes["..."], sizes["V"]
    out = output(name, out, leading + (1,), dtype=np.int64)
    rows = out.size
    if rows == 0:
        return out
    if V == 0:
        raise ValueError(f"{name}: logits has an empty last axis: an empty row has no largest element")
    if rows > LARGEST_GRID_Y:
        raise ValueError(f"{name}: {rows} rows; one launch takes at most {LARGEST_GRID_Y}")
    blocks = ceil_div(V, ELEMENTS_PER_BLOCK)
    partial_values = backend.xp.empty((rows, blocks), dtype=np.float32)
    partial_indices = backend.xp.empty((rows, blocks), dtype=np.int64)
    kernel_name = f"argmax_partial<{storage_c_type(dtype)}>"
    backend.launch_dependent(kernels.function("argmax", kernel_name, name_expressions=(kernel_name,)),
                             (blocks, rows), (THREADS,), (partial_values, partial_indices, logits, np.int32(V)))
    backend.launch_dependent(kernels.function("argmax", "argmax_rows"), (rows,), (WARP_SIZE,),
                             (out, partial_values, partial_indices, np.int32(blocks)))
    return out
