"""The optimizer's kernels on flat buffers: AdamW and SGD updates, the global gradient norm, clipping.

    adamw_prepare_step(step_scalars, step, hyperparameters)       t += 1, bias corrections, on the device
    adamw_update(params, m, v, grads, hyperparameters, step_scalars, group_ends, params_bf16=None)
    sgd_update(params, momentum_buffer, grads, hyperparameters, group_ends)
    gradient_norm(grads, partial_sums, norm)                     norm[()] = ||grads||, deterministic
    clip_gradients(grads, norm, max_norm)                         grads *= min(1, max_norm / (norm + 1e-6))

params, grads, m, v, momentum_buffer: float32, 1-D, the same length n, a multiple of 4 (gpt2_cupy.optim
pads every parameter to 16 elements). group_ends: int32 (groups,), where each group's stretch of the
buffers ends. hyperparameters: float64 (groups, 5) = (lr, beta1, beta2, eps, weight_decay) for AdamW,
(lr, momentum, weight_decay, 0, 0) for SGD. step: int32 (1,). step_scalars: float32 (groups, 2).
params_bf16: None, or a bf16 (n,) buffer that adamw_update fills with bf16 of the updated params (the
working copy that bf16 autocast's products read), in the same pass.
All scalars that change between steps are read from these device arrays: nothing here copies to the host.
gpt2_cupy.optim wraps them in torch-style optimizers; the kernels are kernels/adamw.cu, taught in
chapters/10_adamw.ipynb.
"""

import numpy as np

from gpt2_cupy import kernels
from gpt2_cupy.elementwise import grid_stride_blocks
from gpt2_cupy.ops.arrays import BFLOAT16, THREADS_PER_BLOCK, ceil_div, check

HYPERPARAMETERS = 5       # kernels/adamw.cu: per group, five float64 numbers
NORM_THREADS = 256        # kernels/adamw.cu: the norm kernels' block size
NORM_BLOCKS = 1024        # at most this many partial sums: fills an H100 (132 SMs x 8 blocks), fixed for determinism


def adamw_prepare_step(step_scalars, step, hyperparameters):
    groups = _check_groups("adamw_prepare_step", hyperparameters)
    check("adamw_prepare_step", step_scalars=(step_scalars, (groups, 2)), step=(step, (1,), np.int32))
    kernels.function("adamw", "adamw_prepare_step")((1,), (1,), (step_scalars, step, hyperparameters,
                                                                 np.int32(groups)))


def adamw_update(params, m, v, grads, hyperparameters, step_scalars, group_ends, params_bf16=None):
    n = _check_flat("adamw_update", params=params, m=m, v=v, grads=grads)
    groups = _check_groups("adamw_update", hyperparameters, group_ends)
    check("adamw_update", step_scalars=(step_scalars, (groups, 2)))
    if params_bf16 is not None:
        check("adamw_update", params_bf16=(params_bf16, (n,), BFLOAT16))
    if n:
        # a GPU: one step of the grid-stride loop per thread; the CPU executor: a few blocks (elementwise.py)
        blocks = grid_stride_blocks(ceil_div(n // 4, THREADS_PER_BLOCK))
        kernels.function("adamw", "adamw_update")(
            (blocks,), (THREADS_PER_BLOCK,),
            (params, 0 if params_bf16 is None else params_bf16, m, v, grads, hyperparameters, step_scalars,
             group_ends, np.int32(groups), np.int32(n)))


def sgd_update(params, momentum_buffer, grads, hyperparameters, group_ends):
    n = _check_flat("sgd_update", params=params, momentum_buffer=momentum_buffer, grads=grads)
    groups = _check_groups("sgd_update", hyperparameters, group_ends)
    if n:
        kernels.function("adamw", "sgd_update")(
            (ceil_div(n // 4, THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,),
            (params, momentum_buffer, grads, hyperparameters, group_ends, np.int32(groups), np.int32(n)))


def norm_blocks(n):
    """How many partial sums gradient_norm makes for n elements: the same n always gives the same grid."""
    return max(1, min(NORM_BLOCKS, ceil_div(n // 4, NORM_THREADS)))


def gradient_norm(grads, partial_sums, norm):
    """norm (float32, shape () or (1,)) = sqrt(Σ grads²): per-block partial sums, then one fixed-order sum."""
    n = _check_flat("gradient_norm", grads=grads)
    blocks = norm_blocks(n)
    check("gradient_norm", partial_sums=(partial_sums, (blocks,)))
    if norm.size != 1:
        raise ValueError(f"gradient_norm: norm must hold one number, got shape {norm.shape}")
    kernels.function("adamw", "gradient_norm_partial_sums")((blocks,), (NORM_THREADS,), (partial_sums, grads, np.int32(n)))
    kernels.function("adamw", "gradient_norm_finish")((1,), (NORM_THREADS,), (norm, partial_sums, np.int32(blocks)))


def clip_gradients(grads, norm, max_norm):
    """grads *= min(1, max_norm / (norm + 1e-6)) in place, norm read from the device (as torch clips)."""
    n = _check_flat("clip_gradients", grads=grads)
    if n:
        kernels.function("adamw", "clip_gradients")((ceil_div(n // 4, THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,),
                                                    (grads, norm, np.float32(max_norm), np.int32(n)))


def _check_flat(operation, **buffers):
    sizes = check(operation, **{name: (array, ("n",)) for name, array in buffers.items()})
    if sizes["n"] % 4:
        raise ValueError(f"{operation}: the flat buffers have {sizes['n']} elements; the kernels need a multiple "
                         "of 4 (gpt2_cupy.optim pads every parameter to 16)")
    return sizes["n"]


def _check_groups(operation, hyperparameters, group_ends=None):
    sizes = check(operation, hyperparameters=(hyperparameters, ("groups", HYPERPARAMETERS), np.float64),
                  group_ends=(group_ends, ("groups",), np.int32))
    return sizes["groups"]
