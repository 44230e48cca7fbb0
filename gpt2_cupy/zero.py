"""ZeRO-1: each of N ranks keeps AdamW's moments for 1/N of the parameters, as llm.c does.

    optimizer = ZeroRedundancyOptimizer(groups, optimizer_class=AdamW, lr=6e-4, betas=(0.9, 0.95))
    loss.backward()                      # every rank: the gradients of its own batch, in the flat buffer
    norm = optimizer.clip_grad_norm_(1.0)
    optimizer.step()

The flat buffers are padded to N equal slices (shards) of S elements; rank r owns flat[r·S : (r+1)·S].
A step is three collectives and one launch:

    reduce-scatter   rank r's shard of the gradients ← the average over the ranks of that shard
                     (each rank sends and receives (N-1)/N of the buffer: half an all-reduce)
    AdamW            the same fused kernel (kernels/adamw.cu) on rank r's shard: its parameters, its
                     gradients, and its m and v, the only ones this rank keeps
    all-gather       every rank's parameters ← every rank's updated shard (the other half of an all-reduce)

So the communication equals one all-reduce, and AdamW's state takes 2·S floats per rank instead of 2·N·S.
Clipping needs the norm of all the gradients: each rank's sum of squares over its shard, all-reduced.

Where it differs from torch.distributed.optim.ZeroRedundancyOptimizer: only AdamW, partitioned by
elements (not whole parameters, as torch does); state_dict() is itself a collective (every rank calls it,
all get the whole state), where torch asks for consolidate_state_dict() first. The state_dict is that of
an AdamW over the same parameters, so a checkpoint resumes with another N, or without ZeRO.
"""

import numpy as np

from gpt2_cupy import backend, distributed
from gpt2_cupy.elementwise import converted
from gpt2_cupy.ops import adamw as kernels_of
from gpt2_cupy.ops.arrays import BFLOAT16, ceil_div
from gpt2_cupy.optim import ALIGNMENT, AdamW, _device_copy


class ZeroRedundancyOptimizer(AdamW):
    name = "ZeroRedundancyOptimizer"

    def __init__(self, params, optimizer_class=AdamW, **defaults):
        # bf16_working_copy=True: the copy is converted from the whole buffer after the all-gather of the
        # masters, one launch (the collectives move float32 only)
        if optimizer_class is not AdamW:
            raise NotImplementedError(f"ZeroRedundancyOptimizer shards AdamW only, not {optimizer_class.__name__}")
        self.rank, self.world_size = distributed.get_rank(), distributed.get_world_size()
        super().__init__(params, **defaults)
        self.shard_size = self.flat_params.size // self.world_size
        self.shard = slice(self.rank * self.shard_size, (self.rank + 1) * self.shard_size)
        # Each group's end inside this rank's shard: groups before it end at 0, groups after it at S.
        ends = backend.asnumpy(self._group_ends).astype(np.int64) - self.shard.start
        self._shard_group_ends = backend.xp.asarray(np.clip(ends, 0, self.shard_size).astype(np.int32))
        self._shard_partial_sums = backend.xp.zeros(kernels_of.norm_blocks(self.shard_size), dtype=np.float32)
        self._gradients_reduced = False  # this step's reduce-scatter has run

    def _buffer_length(self, packed_length):
        self.packed_length = packed_length
        shard = ceil_div(ceil_div(packed_length, self.world_size), ALIGNMENT) * ALIGNMENT  # float4 per shard
        return shard * self.world_size

    def _state_length(self):
        return self.flat_params.size // self.world_size

    def _reduce_gradients(self):
        """This rank's shard of the gradients ← their average over the ranks (once per step)."""
        if not self._gradients_reduced:
            distributed.reduce_scatter_tensor(self.flat_grads[self.shard], self.flat_grads,
                                              op=distributed.ReduceOp.AVG)
            self._gradients_reduced = True

    def zero_grad(self, set_to_none=True):
        super().zero_grad(set_to_none)
        self._gradients_reduced = False

    def clip_grad_norm_(self, max_norm):
        """The global norm from every rank's sum of squares; each rank clips its own shard."""
        if not max_norm > 0:
            raise ValueError(f"{self.name}.clip_grad_norm_: max_norm must be > 0, got {max_norm}")
        self._gather()
        self._reduce_gradients()
        gradients = self.flat_grads[self.shard]
        kernels_of.gradient_norm(gradients, self._shard_partial_sums, self._norm)
        sum_of_squares = (self._norm * self._norm).reshape(1)
        distributed.all_reduce(sum_of_squares, op=distributed.ReduceOp.SUM)
        backend.copy_into(self._norm, backend.xp.sqrt(sum_of_squares).reshape(()))
        kernels_of.clip_gradients(gradients, self._norm, max_norm)
        return _device_copy(self._norm)

    def step(self):
        """Reduce-scatter the gradients, AdamW on this rank's shard, all-gather the parameters."""
        skipped = self._gather()
        self._reduce_gradients()
        self.upload_hyperparameters()
        kernels_of.adamw_prepare_step(self._step_scalars, self.state["step"], self._hyperparameters)
        kept_parameters = [(p_slice, _device_copy(self.flat_params[p_slice])) for _, p_slice, _, _ in skipped]
        kept_state = [(local, [_device_copy(self.state[name][local]) for name in self.state_names])
                      for local in self._shard_parts([p_slice for _, p_slice, _, _ in skipped])]
        kernels_of.adamw_update(self.flat_params[self.shard], self.state["exp_avg"], self.state["exp_avg_sq"],
                                self.flat_grads[self.shard], self._hyperparameters, self._step_scalars,
                                self._shard_group_ends)
        for local, copies in kept_state:  # parameters without a gradient keep their moments, as in AdamW
            for name, copy in zip(self.state_names, copies):
                backend.copy_into(self.state[name][local], copy)
        distributed.all_gather_into_tensor(self.flat_params, self.flat_params[self.shard])
        for p_slice, copy in kept_parameters:
            backend.copy_into(self.flat_params[p_slice], copy)
        if self.flat_params_bf16 is not None:
            converted(self.flat_params, BFLOAT16, out=self.flat_params_bf16)
        self._working_copies_written([])
        self._gradients_reduced = False

    def _shard_parts(self, slices):
        """The parts of these slices of the flat buffer that fall in this rank's shard, as slices of the shard."""
        parts = []
        for whole in slices:
            start, stop = max(whole.start, self.shard.start), min(whole.stop, self.shard.stop)
            if start < stop:
                parts.append(slice(start - self.shard.start, stop - self.shard.start))
        return parts

    def state_dict(self):
        """AdamW's state_dict over the whole (unpadded) buffer, gathered from every rank: call it on every rank."""
        whole_state = {}
        for name in self.state_names:
            whole = backend.xp.empty(self.flat_params.size, dtype=np.float32)
            distributed.all_gather_into_tensor(whole, self.state[name])
            whole_state[name] = backend.asnumpy(whole[:self.packed_length]).copy()
        whole_state["step"] = backend.asnumpy(self.state["step"]).copy()
        saved = super().state_dict()
        return {**saved, "state": whole_state, "flat_size": self.packed_length}

    def load_state_dict(self, state_dict):
        """Take this rank's shard of an AdamW state_dict (saved with any number of ranks, or none)."""
        if state_dict.get("flat_size") != self.packed_length:
            raise ValueError(f"{self.name}.load_state_dict: the checkpoint's buffer holds {state_dict.get('flat_size')} "
                             f"elements, this optimizer's {self.packed_length}: not the same parameters")
        shards = {}
        for name, saved in state_dict["state"].items():
            saved = np.asarray(saved)
            if name in self.state_names:
                padded = np.zeros(self.flat_params.size, dtype=np.float32)
                padded[:saved.size] = saved
                saved = padded[self.shard]
            shards[name] = saved
        super().load_state_dict({**state_dict, "state": shards, "flat_size": self.flat_params.size})


def shard_optimizer(optimizer):
    """A ZeroRedundancyOptimizer with the groups and hyperparameters of an AdamW (which it replaces: the
    parameters move into the new flat buffers)."""
    groups = [{key: value for key, value in group.items()} for group in optimizer.param_groups]
    return ZeroRedundancyOptimizer(groups, optimizer_class=AdamW, bf16_working_copy=optimizer.bf16_working_copy,
                                   **optimizer.defaults)
