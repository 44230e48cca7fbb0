"""Functional ops: each a forward kernel and its backward, launched on the active backend.

The op contract, which every op here follows (and which the autograd tape relies on):

    y[, saved...] = X_forward(inputs..., *, options..., out=None)
    dinput[s]     = X_backward(dout, saved..., *, dparam=..., options..., out=None)

- The forward returns its output; where the backward needs more than the inputs (LayerNorm's mean and
  reciprocal standard deviation, attention's log-sum-exp), it returns them too, after the output.
- The backward takes the upstream gradient first, always named `dout`, then what the forward saw or saved.
- Activation gradients are returned (or written into `out` when given: a new array otherwise).
- Parameter gradients are ADDED into the caller's buffers (`dweight=`, `dbias=`, ...): a parameter used
  twice (tied embeddings), or over several micro-batches, sums its gradients in place; the optimizer
  zeroes those buffers once per step.
- Arrays are the backend's (cupy on a GPU, numpy on the CPU), float32 unless said otherwise, C-contiguous.
  A public op checks its arguments once (gpt2_cupy.ops.arrays.check) and raises a TypeError or ValueError
  naming the op and the argument; the internal functions it calls do not check again.
- Kernels take their outputs first, then inputs, then sizes (kernels/__init__.py).
"""
