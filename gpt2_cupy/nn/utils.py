"""torch.nn.utils.clip_grad_norm_: scale the gradients of parameters so that their global norm is at most max_norm."""

import numpy

from gpt2_cupy import backend
from gpt2_cupy.autograd import Tensor


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """Scale every .grad by min(1, max_norm / (norm + 1e-6)); return the norm before clipping, a new Tensor.

    When the parameters are exactly those of one optimizer, whose flat gradient buffer holds their
    gradients, this is that optimizer's clip_grad_norm_: two kernels over the flat buffer and no host copy.
    Otherwise the norm is summed over each gradient with the array module's operations.
    """
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    parameters = list(parameters)
    if float(norm_type) != 2.0 or error_if_nonfinite:
        raise NotImplementedError("clip_grad_norm_: only norm_type=2.0 and error_if_nonfinite=False are supported yet")
    owners = {id(getattr(getattr(p, "_grad_slot", None), "owner", None)) for p in parameters}
    owner = getattr(getattr(parameters[0], "_grad_slot", None), "owner", None) if parameters else None
    if owner is not None and len(owners) == 1 and {id(p) for p in parameters} == {id(e[0]) for e in owner._packed}:
        return Tensor(owner.clip_grad_norm_(max_norm))
    xp = backend.xp
    grads = [p.grad._data for p in parameters if p.grad is not None]
    norm = xp.sqrt(sum((xp.sum(g.astype(numpy.float64) ** 2) for g in grads), xp.zeros((), numpy.float64)))
    factor = xp.minimum(1.0, max_norm / (norm + 1e-6)).astype(numpy.float32)
    for g in grads:
        g *= factor
    return Tensor(norm.astype(numpy.float32))
