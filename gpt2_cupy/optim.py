"""Optimizers with PyTorch's interface, on one flat buffer of parameters and one of gradients.

    optimizer = optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    optimizer = optim.AdamW([{"params": matrices, "weight_decay": 0.1},
                             {"params": biases_and_norms, "weight_decay": 0.0}], lr=6e-4)
    optimizer.zero_grad()                     # one memset over all gradients; every .grad is None again
    loss.backward()
    norm = optimizer.clip_grad_norm_(1.0)     # the norm before clipping: a new device array of shape ()
    for group in optimizer.param_groups:
        group["lr"] = learning_rate           # takes effect at the next step
    optimizer.step()                          # one launch for every parameter (after a one-thread launch
                                              # that advances the step count)
    checkpoint = optimizer.state_dict()       # numpy arrays; load_state_dict(checkpoint) resumes bit for bit

A parameter is a Tensor (its values a float32 array of the backend, p._data) or any object with `.data`
(such an array), `.grad` (None, a Tensor or an array) and, optionally, `.requires_grad`. At construction the
optimizer copies every parameter into ONE flat buffer, `optimizer.flat_params`, and makes its array a view
into it (so that `p.data += x` writes there); it also reserves for each parameter a view
into ONE gradient buffer, `optimizer.flat_grads` (p._grad_slot), which the autograd makes the parameter's
.grad when it first adds a gradient, so that the backward's kernels add straight into the flat buffer.
That is a speed-up, not a rule code has to follow: before each step (and clip_grad_norm_) the optimizer
checks every parameter and copies into its buffers a .data or a .grad that was replaced by another array
(`p.data = ...`, `p.grad = ...`, a second optimizer over the same parameters). Groups are consecutive
stretches of the buffers, each parameter starting at a multiple of 16 elements (64 bytes), so one kernel
launch updates every group, each with its own hyperparameters. A parameter listed twice (tied weights)
is packed once, in the first group that lists it.

As PyTorch's optimizers do, a step leaves untouched every parameter whose .grad is None (unused by the
forward, or zeroed with set_to_none) or that does not require grad (frozen): the launch updates the whole
buffer, and those parameters and their state are put back afterwards. One difference remains: AdamW's
step count is one for all parameters, where PyTorch counts each parameter's own steps, so a parameter
skipped at some steps gets the bias correction of the optimizer's step count.

The hyperparameters of every group live in a small float64 device array, copied from `param_groups`
at a step where one of them changed; the step count and the bias corrections are computed on the device.

bf16 working copy (AdamW(..., bf16_working_copy=True); the train CLI's --dtype bf16 turns it on): the
optimizer also keeps `flat_params_bf16`, a bf16 buffer parallel to flat_params, and each step's update
kernel writes bf16 of every updated master into it in the same pass. Under gpt2_cupy.autocast the
products read a parameter's view of it (p._working_copy) instead of converting the parameter again, but
only while it is known to equal bf16(p.data): see WorkingCopy.

Ready for CUDA graphs (gpt2_cupy.graphs): zero_grad, clip_grad_norm_ and step launch kernels and
backend.fill_zero / copy_into only, never a host copy, so each can be captured and replayed. A captured
step() reads the hyperparameters from the device array: change the learning rate with
`group["lr"] = ...; optimizer.upload_hyperparameters()` before the replay, outside the capture.
"""

import numpy as np

from gpt2_cupy import backend
from gpt2_cupy.autograd import GradientSlot, Tensor, bump_version, storage_version
from gpt2_cupy.elementwise import converted
from gpt2_cupy.graphs import is_current_stream_capturing
from gpt2_cupy.ops import adamw as kernels_of
from gpt2_cupy.ops.arrays import BFLOAT16, LARGEST_INT, ceil_div

ALIGNMENT = 16  # elements: every parameter starts 64 bytes into the buffer, so float4 never straddles two


class Optimizer:
    """What AdamW and SGD share: parameter groups, the flat buffers, zero_grad, the gradient norm, checkpoints."""

    name = "Optimizer"
    state_names = ()  # the subclass's flat state buffers, each as long as the parameters' buffer

    def __init__(self, params_or_groups, defaults):
        self.defaults = dict(defaults)
        self.param_groups = [self._group(number, group) for number, group in enumerate(_as_groups(self.name, params_or_groups))]
        self._pack()
        xp = backend.xp
        self.state = {name: xp.zeros(self._state_length(), dtype=np.float32) for name in self.state_names}
        self._hyperparameters = xp.zeros((len(self.param_groups), kernels_of.HYPERPARAMETERS), dtype=np.float64)
        self._uploaded = None
        self._norm = xp.zeros((), dtype=np.float32)
        self._partial_sums = xp.zeros(kernels_of.norm_blocks(self.flat_params.size), dtype=np.float32)

    # ---- parameter groups and the flat buffers ----------------------------------------------------------

    def _group(self, number, group):
        unknown = set(group) - set(self.defaults) - {"params"}
        if unknown:
            raise ValueError(f"{self.name}: param_groups[{number}] has keys {sorted(unknown)} that {self.name} does "
                             f"not know; it knows {sorted(self.defaults)}")
        group = {**self.defaults, **group, "params": list(group["params"])}
        self._check_hyperparameters(group, number)
        return group

    def _pack(self):
        xp = backend.xp
        seen, offsets, end = set(), [], 0
        for number, group in enumerate(self.param_groups):
            kept = []
            for index, p in enumerate(group["params"]):
                _check_parameter(self.name, number, index, p)
                if id(p) in seen:
                    continue
                seen.add(id(p))
                kept.append(p)
                offsets.append((p, end))
                end += ceil_div(_values(p).size, ALIGNMENT) * ALIGNMENT
            group["params"] = kept
            group["_end"] = end
        if end > LARGEST_INT:
            raise ValueError(f"{self.name}: {end} parameters; the kernels index with int, at most {LARGEST_INT}")
        length = self._buffer_length(end)
        self.flat_params = xp.zeros(length, dtype=np.float32)
        self.flat_grads = xp.zeros(length, dtype=np.float32)
        self._packed = []  # (parameter, its stretch of the buffers, its view of flat_params, its GradientSlot)
        for p, offset in offsets:
            shape, size = _values(p).shape, _values(p).size
            self.flat_params[offset:offset + size] = _values(p).reshape(-1)
            _set_values(p, self.flat_params[offset:offset + size].reshape(shape))
            slot = GradientSlot(self.flat_grads[offset:offset + size].reshape(shape), owner=self)
            slot.zeroed = p.grad is None
            if p.grad is not None:
                slot.array[...] = _grad_array(p)
                p.grad = slot.array
            p._grad_slot = slot
            self._packed.append((p, slice(offset, offset + size), _values(p), slot))
        self._group_ends = xp.asarray(np.array([group.pop("_end") for group in self.param_groups], dtype=np.int32))

    def _buffer_length(self, packed_length):
        """How long the flat buffers are: the packed parameters' length (ZeroRedundancyOptimizer pads it)."""
        return packed_length

    def _state_length(self):
        """How long each state buffer is: the whole flat buffer (ZeroRedundancyOptimizer keeps one slice)."""
        return self.flat_params.size

    def _gather(self):
        """Bring every parameter's .data and .grad into the flat buffers; return the packed entries to skip.

        Usually nothing moves: .data is the optimizer's view and .grad its slot (or None). A parameter whose
        .data or .grad was replaced by another array is copied in, and its .data and .grad become the
        views again. Skipped: parameters with no gradient or that do not require grad; their slots hold
        zeros, so that the gradient norm does not count them.
        """
        skipped = []
        for entry in self._packed:
            p, _, data_view, slot = entry
            if _values(p) is not data_view:
                _check_replacement(self.name, "data", _values(p), data_view)
                backend.copy_into(data_view, _values(p))
                bump_version(data_view)   # new values in the flat buffer: a bf16 working copy is stale
                _set_values(p, data_view)
            if p.grad is None or not getattr(p, "requires_grad", True):
                skipped.append(entry)
                if p.grad is None and not slot.zeroed:
                    backend.fill_zero(slot.array)
                    slot.zeroed = True
            elif _grad_array(p) is not slot.array:
                _check_replacement(self.name, "grad", _grad_array(p), slot.array)
                backend.copy_into(slot.array, _grad_array(p))
                p.grad, slot.zeroed = slot.array, False
        return skipped

    def _update_all_but(self, skipped, update):
        """Run update() (one launch over the whole buffer), then put the skipped parameters and their state back."""
        buffers = [self.flat_params] + [self.state[name] for name in self.state_names]
        kept = [(p_slice, [_device_copy(buffer[p_slice]) for buffer in buffers]) for _, p_slice, _, _ in skipped]
        update()
        for p_slice, copies in kept:
            for buffer, copy in zip(buffers, copies):
                backend.copy_into(buffer[p_slice], copy)

    def upload_hyperparameters(self):
        """Copy the groups' hyperparameters to the device when one changed since the last upload.

        step() does it first; a step() captured in a CUDA graph reads what was uploaded last, so call this
        before each replay, after changing param_groups (the learning rate of the schedule).
        """
        values = tuple(tuple(self._hyperparameter_values(group)) for group in self.param_groups)
        if values != self._uploaded:
            backend.refuse_under_capture(f"{self.name}.step() with changed hyperparameters (their upload is a "
                                         "host-to-device copy; call upload_hyperparameters() before capture "
                                         "and before each replay)")
            for number, group in enumerate(self.param_groups):
                self._check_hyperparameters(group, number)
            table = np.zeros((len(values), kernels_of.HYPERPARAMETERS), dtype=np.float64)
            table[:, :len(values[0])] = values
            backend.copy_into(self._hyperparameters, table)
            self._uploaded = values

    # ---- what every step needs ---------------------------------------------------------------------------

    def zero_grad(self, set_to_none=True):
        """Zero every gradient: one memset over the flat buffer; with set_to_none (PyTorch's default) every
        .grad becomes None as well, so that a parameter the next forward does not use is skipped."""
        backend.fill_zero(self.flat_grads)
        for p, _, _, slot in self._packed:
            if set_to_none or p.grad is None:
                p.grad, slot.zeroed = None, True

    def clip_grad_norm_(self, max_norm):
        """Scale all gradients by min(1, max_norm / (norm + 1e-6)), as torch.nn.utils.clip_grad_norm_ does.

        Returns the global norm before clipping as a new float32 device array of shape () (no host sync).
        """
        if not max_norm > 0:
            raise ValueError(f"{self.name}.clip_grad_norm_: max_norm must be > 0, got {max_norm}")
        self._gather()
        kernels_of.gradient_norm(self.flat_grads, self._partial_sums, self._norm)
        kernels_of.clip_gradients(self.flat_grads, self._norm, max_norm)
        return _device_copy(self._norm)  # the caller's own: the next call overwrites self._norm

    # ---- checkpoints -------------------------------------------------------------------------------------

    def state_dict(self):
        """{"state": {name: numpy array}, "param_groups": [hyperparameters and parameter indices]}."""
        state = {name: backend.asnumpy(buffer).copy() for name, buffer in self.state.items()}
        groups, first = [], 0
        for group in self.param_groups:
            count = len(group["params"])
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": list(range(first, first + count))})
            first += count
        return {"state": state, "param_groups": groups, "flat_size": int(self.flat_params.size)}

    def load_state_dict(self, state_dict):
        """Restore the state and the hyperparameters of state_dict(): the next step continues bit for bit."""
        if state_dict.get("flat_size") != self.flat_params.size or len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError(f"{self.name}.load_state_dict: the checkpoint holds {len(state_dict['param_groups'])} "
                             f"groups over {state_dict.get('flat_size')} elements; this optimizer has "
                             f"{len(self.param_groups)} groups over {self.flat_params.size}: not the same parameters")
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"{self.name}.load_state_dict: a group of {len(saved['params'])} parameters in the "
                                 f"checkpoint, {len(group['params'])} here")
        for name in self.state:
            saved = np.asarray(state_dict["state"][name])
            if saved.shape != tuple(self.state[name].shape):
                raise ValueError(f"{self.name}.load_state_dict: state {name!r} has shape {saved.shape}, "
                                 f"expected {tuple(self.state[name].shape)}")
            self.state[name][...] = backend.xp.asarray(saved.astype(self.state[name].dtype))
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self._uploaded = None
        self._forget_working_copies()

    def _forget_working_copies(self):
        """Mark every bf16 working copy as not written (a checkpoint resumes other masters): the products
        convert the parameters again until the next step writes the copies."""
        for p, _, _, _ in self._packed:
            copy = getattr(p, "_working_copy", None)
            if copy is not None and copy.owner is self:
                copy.version = None

    def __repr__(self):
        groups = "\n".join(f"  group {n}: {len(g['params'])} parameters, "
                           + ", ".join(f"{k}={v}" for k, v in g.items() if k != "params")
                           for n, g in enumerate(self.param_groups))
        return f"{self.name} over {self.flat_params.size} elements (one flat buffer)\n{groups}"


class AdamW(Optimizer):
    """torch.optim.AdamW: m, v with bias corrections, eps outside the square root, decoupled weight decay.

    For each element, at step t (t = 1 first), with g its gradient:
        θ ← θ - lr·λ·θ
        m ← β₁ m + (1 - β₁) g          v ← β₂ v + (1 - β₂) g²
        θ ← θ - lr / (1 - β₁ᵗ) · m / (√v / √(1 - β₂ᵗ) + ε)

    bf16_working_copy (not in PyTorch; default False): also keep `flat_params_bf16`, bf16 of every master,
    written by the update kernel in the same pass. gpt2_cupy.autocast's products then read each parameter's
    bf16 copy instead of converting the float32 master before every forward (one conversion kernel per
    weight and step, each reading the master again). The results are the same bits: the copy is exactly
    the conversion. Before the first step, and after a change to a parameter that the optimizer did not
    make, the products convert as without it (WorkingCopy says which changes are seen).
    """

    name = "AdamW"
    state_names = ("exp_avg", "exp_avg_sq")   # m and v; the step count is state["step"], an int32 (1,)

    def __init__(self, params_or_groups, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=None,
                 bf16_working_copy=False):
        # fused: accepted as torch.optim.AdamW accepts it (nanoGPT passes fused=True); the update here is
        # always one fused kernel.
        super().__init__(params_or_groups, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.state["step"] = backend.xp.zeros(1, dtype=np.int32)
        self._step_scalars = backend.xp.zeros((len(self.param_groups), 2), dtype=np.float32)
        self.bf16_working_copy = False
        self.flat_params_bf16 = None
        if bf16_working_copy:
            self.keep_bf16_working_copy()

    def keep_bf16_working_copy(self):
        """From the next step on, also write bf16 of every master into flat_params_bf16 (bf16_working_copy=True
        given afterwards: the train CLI's --dtype bf16 turns it on for the model's own optimizer)."""
        if self.bf16_working_copy:
            return
        self.bf16_working_copy = True
        self.flat_params_bf16 = backend.xp.zeros(self.flat_params.size, dtype=BFLOAT16)
        for p, p_slice, data_view, _ in self._packed:
            p._working_copy = WorkingCopy(self.flat_params_bf16[p_slice].reshape(data_view.shape), data_view,
                                          owner=self)

    def _hyperparameter_values(self, group):
        beta1, beta2 = group["betas"]
        return (float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]))

    def _check_hyperparameters(self, group, number):
        lr, betas, eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        where = f"{self.name}: param_groups[{number}]"
        if not lr >= 0:
            raise ValueError(f"{where}: lr = {lr}; it must be >= 0")
        if len(betas) != 2 or not all(0 <= beta < 1 for beta in betas):
            raise ValueError(f"{where}: betas = {betas}; both must be in [0, 1)")
        if not eps >= 0 or not weight_decay >= 0:
            raise ValueError(f"{where}: eps = {eps}, weight_decay = {weight_decay}; both must be >= 0")

    def step(self):
        """One AdamW update of every parameter from its gradient (a one-thread launch, then one launch)."""
        skipped = self._gather()
        self.upload_hyperparameters()
        kernels_of.adamw_prepare_step(self._step_scalars, self.state["step"], self._hyperparameters)
        self._update_all_but(skipped, lambda: kernels_of.adamw_update(
            self.flat_params, self.state["exp_avg"], self.state["exp_avg_sq"], self.flat_grads,
            self._hyperparameters, self._step_scalars, self._group_ends, params_bf16=self.flat_params_bf16))
        self._working_copies_written(skipped)

    def _working_copies_written(self, skipped):
        """After a step: the skipped parameters' copies converted from their restored masters, and every
        copy marked as equal to bf16 of its master as the flat buffer stands now."""
        if self.flat_params_bf16 is None:
            return
        for p, p_slice, _, _ in skipped:
            converted(self.flat_params[p_slice], BFLOAT16, out=self.flat_params_bf16[p_slice])
        if is_current_stream_capturing():
            return   # recorded, not run: the copies are written at the replays, and are valid if they were
        version = storage_version(self.flat_params)
        for p, _, _, _ in self._packed:
            p._working_copy.version = version


class WorkingCopy:
    """A parameter's bf16 copy in its AdamW's flat_params_bf16, for the products under autocast.

    Seen: every change made through a Tensor (copy_, p[...] = x, add_ under no_grad, nn.init,
    Module.load_state_dict), `p.data = ...`, optimizer.load_state_dict. Not seen: a write straight into the
    backend array (`p._data[...] = x`, numpy's or CuPy's own functions), which passes by every version
    counter as it passes by PyTorch's autograd: write through the Tensor (`with no_grad(): p.copy_(x)`).
    """

    def __init__(self, array, master, owner):
        self.array, self.master, self.owner = array, master, owner
        self.version = None   # the master storage's version when the step wrote the copy; None: not written

    def equals_bf16_of(self, data):
        """Whether self.array holds bf16 of `data` (a parameter's .data) right now."""
        # Valid while p.data is the master the step wrote it from (no `p.data = ...`) and that storage's
        # in-place version (autograd.storage_version, which every in-place Tensor write bumps) is unchanged.
        return self.version is not None and data is self.master and storage_version(data) == self.version


class SGD(Optimizer):
    """torch.optim.SGD with momentum (no dampening, no Nesterov): b ← μ b + (g + λθ), θ ← θ - lr·b."""

    name = "SGD"
    state_names = ("momentum_buffer",)

    def __init__(self, params_or_groups, lr=1e-3, momentum=0.0, weight_decay=0.0):
        super().__init__(params_or_groups, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    def _hyperparameter_values(self, group):
        return (float(group["lr"]), float(group["momentum"]), float(group["weight_decay"]))

    def _check_hyperparameters(self, group, number):
        for key in ("lr", "momentum", "weight_decay"):
            if not group[key] >= 0:
                raise ValueError(f"{self.name}: param_groups[{number}]: {key} = {group[key]}; it must be >= 0")

    def step(self):
        """One SGD update of every parameter (one launch)."""
        skipped = self._gather()
        self.upload_hyperparameters()
        self._update_all_but(skipped, lambda: kernels_of.sgd_update(
            self.flat_params, self.state["momentum_buffer"], self.flat_grads, self._hyperparameters, self._group_ends))


def _device_copy(array):
    """A new device array with array's values (a device-to-device copy, which a graph can capture)."""
    copy = backend.xp.empty(array.shape, dtype=array.dtype)
    backend.copy_into(copy, array)
    return copy


def _as_groups(name, params_or_groups):
    """A list of group dicts from an iterable of parameters or of dicts (torch's two forms)."""
    items = list(params_or_groups)
    if not items:
        raise ValueError(f"{name}: got an empty list of parameters")
    if all(isinstance(item, dict) for item in items):
        for number, group in enumerate(items):
            if "params" not in group:
                raise ValueError(f"{name}: param_groups[{number}] has no 'params'")
        return [dict(group) for group in items]
    if any(isinstance(item, dict) for item in items):
        raise TypeError(f"{name}: pass either parameters or dicts of parameter groups, not a mixture")
    return [{"params": items}]


def _check_parameter(name, group_number, index, p):
    where = f"{name}: param_groups[{group_number}]['params'][{index}]"
    data = _values(p) if isinstance(p, Tensor) else getattr(p, "data", None)
    if not isinstance(data, backend.xp.ndarray):
        raise TypeError(f"{where} must have .data, a {backend.xp.__name__}.ndarray (the active backend's "
                        f"arrays); got {type(p).__name__} with .data of type {type(data).__name__}")
    if data.dtype != np.float32:
        raise TypeError(f"{where}.data has dtype {data.dtype}; the optimizer works on float32")
    grad = _grad_array(p)
    if grad is not None and (not isinstance(grad, backend.xp.ndarray) or grad.shape != data.shape):
        raise ValueError(f"{where}.grad must be None or an array of .data's shape {data.shape}")


def _values(p):
    """p's values as a backend array: a Tensor's own array (its .data is a Tensor over it), another parameter
    object's .data."""
    return p._data if isinstance(p, Tensor) else p.data


def _set_values(p, array):
    """p's values are array from now on (a view into the flat buffer), as _values reads them."""
    if isinstance(p, Tensor):
        p._data = array
    else:
        p.data = array


def _grad_array(p):
    """p's gradient as a backend array: a Tensor's .grad is a Tensor, another parameter object's an array."""
    grad = getattr(p, "grad", None)
    return grad._data if isinstance(grad, Tensor) else grad


def _check_replacement(name, attribute, array, packed):
    """A .data or .grad set to a new array must still fit the parameter's place in the flat buffers."""
    if not isinstance(array, backend.xp.ndarray) or tuple(array.shape) != tuple(packed.shape):
        shape = getattr(array, "shape", None)
        raise ValueError(f"{name}.step: a parameter's .{attribute} was replaced by {type(array).__name__} of shape "
                         f"{shape}; the optimizer packed it with shape {tuple(packed.shape)} (build a new "
                         "optimizer after changing a parameter's shape)")
