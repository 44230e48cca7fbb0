"""DistributedDataParallel: the same model on every rank, each rank its own slice of the batch.

    model = DistributedDataParallel(model)      # rank 0's parameters broadcast to every rank
    optimizer = model.module.configure_optimizers(...)
    _, loss = model(inputs, targets)            # this rank's rows of the batch
    loss.backward()                             # gradient buckets all-reduced (averaged) as they fill
    optimizer.step()                            # every rank takes the same step

The gradients live in the optimizer's flat buffer (gpt2_cupy.optim). DistributedDataParallel cuts that
buffer into buckets of about bucket_cap_mb, from its end backwards: the backward produces the gradients of
the last layers first, and those sit at the end. A bucket is a slice of the flat buffer, so it is
all-reduced in place with no copy. When the last gradient of a bucket has been added, the bucket's
all-reduce is queued on the group's own stream (after an event on the compute stream), and the backward of
the earlier layers goes on meanwhile on the compute stream: communication overlaps computation. Buckets
are launched in the same order on every rank (NCCL requires it), each once all before it are launched.
When the last bucket is launched, the compute stream is made to wait for all of them, so whatever runs
after the backward (clipping, the optimizer's step) reads averaged gradients. The host never waits.

When is a parameter's gradient complete? After the forward, DistributedDataParallel walks the new graph
and counts, for each parameter, the Nodes with an edge to it. The backward frees each Node's saved arrays
(ctx.free_saved()) right after the Node's gradients have been added; that call is where the count goes
down. A backward with retain_graph=True frees nothing: its buckets are never launched, and the next
forward raises (as PyTorch's does when a reduction did not finish).

Under no_sync() the forward prepares nothing: gradients only add up locally (gradient accumulation);
the forward after the block, and its backward, all-reduce the sum.

With a ZeroRedundancyOptimizer (gpt2_cupy.zero) the buckets are not used: that optimizer reduce-scatters
the whole buffer in its step. Where it differs from PyTorch: the module's buffers are not broadcast (GPT-2's
are computed, not learned); a parameter must not be used by some ranks and not by others.
"""

import contextlib
import weakref

from gpt2_cupy import distributed
from gpt2_cupy.autograd import AccumulateGrad, Tensor, is_grad_enabled, topological_order
from gpt2_cupy.nn import Module
from gpt2_cupy.zero import ZeroRedundancyOptimizer

DEFAULT_BUCKET_CAP_MB = 25  # PyTorch's default: large enough that each all-reduce runs near full bandwidth


class Bucket:
    """A slice [start, stop) of the flat gradient buffer and the parameters whose gradients lie in it."""

    def __init__(self, start, stop, parameters):
        self.start, self.stop, self.parameters = start, stop, parameters
        self.pending = 0   # gradients still to come in this backward
        self.work = None   # the queued all-reduce

    def __repr__(self):
        return f"Bucket([{self.start}, {self.stop}), {len(self.parameters)} parameters)"


def make_buckets(packed, buffer_length, cap_bytes, itemsize=4):
    """Buckets over [0, buffer_length), from the end backwards, each closed once it holds cap_bytes.

    packed: (parameter, its slice of the flat buffer) pairs. Each bucket starts where its first-packed
    parameter starts and stops where the next bucket starts (the padding between parameters included),
    so the buckets cover the buffer exactly once.
    """
    buckets, stop, parameters = [], buffer_length, []
    for parameter, where in sorted(packed, key=lambda entry: entry[1].start, reverse=True):
        parameters.append(parameter)
        if (stop - where.start) * itemsize >= cap_bytes:
            buckets.append(Bucket(where.start, stop, parameters))
            stop, parameters = where.start, []
    if parameters or stop > 0:
        buckets.append(Bucket(0, stop, parameters))
    return buckets


class GradientReducer:
    """The buckets of one model and their all-reduces during one backward."""

    def __init__(self, parameters, cap_bytes):
        owners = [getattr(getattr(p, "_grad_slot", None), "owner", None) for p in parameters]
        owner = owners[0]
        if owner is None or any(other is not owner for other in owners):
            raise RuntimeError("DistributedDataParallel all-reduces the gradients in the optimizer's flat buffer: "
                               "create one optimizer over all the model's parameters before the first forward")
        self.optimizer = owner
        self.buckets = []
        if not isinstance(owner, ZeroRedundancyOptimizer):  # which reduce-scatters the gradients in its step
            wanted = {id(p) for p in parameters}
            packed = [(p, where) for p, where, _, _ in owner._packed if id(p) in wanted]
            self.buckets = make_buckets(packed, owner.flat_grads.size, cap_bytes)
        self.bucket_of = {id(p): bucket for bucket in self.buckets for p in bucket.parameters}
        self.next_bucket = len(self.buckets)  # none pending: no backward is under way

    @property
    def finished(self):
        return self.next_bucket == len(self.buckets)

    def prepare_for_backward(self, outputs):
        """Count the edges from the graph of outputs to each bucket's parameters; hook their Nodes' free_saved."""
        if not self.buckets:
            return
        for bucket in self.buckets:
            bucket.pending, bucket.work = 0, None
        self.next_bucket = 0
        seen = set()
        for root in [t.grad_fn for t in _tensors(outputs) if t.grad_fn is not None]:
            for node in topological_order(root):
                if node in seen:
                    continue
                seen.add(node)
                parameters = [edge[0].variable for edge in node.next_edges if edge is not None and
                              isinstance(edge[0], AccumulateGrad) and id(edge[0].variable) in self.bucket_of]
                if parameters:
                    self._count(node.ctx, parameters)
        self._launch_ready_buckets()  # a bucket of parameters this graph does not use is complete already

    def _count(self, ctx, parameters):
        """One pending gradient per edge; ctx.free_saved(), which the backward calls once this Node's
        gradients have been added, marks them arrived."""
        for p in parameters:
            self.bucket_of[id(p)].pending += 1
        context = weakref.ref(ctx)  # a weak reference: no cycle keeps ctx (and what it saved) alive

        def free_saved_then_mark_arrived():
            ctx = context()
            del ctx.free_saved  # this instance's hook: ctx.free_saved is Context's own again
            ctx.free_saved()
            for p in parameters:
                self.bucket_of[id(p)].pending -= 1
            self._launch_ready_buckets()

        ctx.free_saved = free_saved_then_mark_arrived

    def _launch_ready_buckets(self):
        """All-reduce the next buckets in order while they are complete; after the last, wait for them all."""
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
            bucket = self.buckets[self.next_bucket]
            bucket.work = distributed.all_reduce(self.optimizer.flat_grads[bucket.start:bucket.stop],
                                                 op=distributed.ReduceOp.AVG, async_op=True)
            self.next_bucket += 1
            if self.finished:
                for launched in self.buckets:  # the compute stream waits for every all-reduce
                    launched.work.wait()


def _tensors(outputs):
    if isinstance(outputs, Tensor):
        return [outputs]
    if isinstance(outputs, (tuple, list)):
        return [t for item in outputs for t in _tensors(item)]
    if isinstance(outputs, dict):
        return [t for item in outputs.values() for t in _tensors(item)]
    return []


class DistributedDataParallel(Module):
    """torch.nn.parallel.DistributedDataParallel: wraps module; its parameters are module.<name>."""

    def __init__(self, module, device_ids=None, output_device=None, broadcast_buffers=True, bucket_cap_mb=None):
        if not distributed.is_initialized():
            raise RuntimeError("Default process group has not been initialized, please make sure to call "
                               "init_process_group.")
        self.module = module
        self.bucket_cap_mb = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        self.require_backward_grad_sync = True
        self.reducer = None  # made at the first forward that needs it: the optimizer must exist by then
        for parameter in module.parameters():
            distributed.broadcast(parameter.data, src=0)

    def forward(self, *inputs, **options):
        if self.reducer is not None and not self.reducer.finished:
            raise RuntimeError("Expected to have finished reduction in the prior iteration before starting a new "
                               "one: the last backward through this DistributedDataParallel did not reach every "
                               "parameter (a backward with retain_graph=True, or none at all)")
        outputs = self.module(*inputs, **options)
        if is_grad_enabled() and self.require_backward_grad_sync:
            if self.reducer is None:
                parameters = [p for p in self.module.parameters() if p.requires_grad]
                self.reducer = GradientReducer(parameters, int(self.bucket_cap_mb * 1024 * 1024))
            self.reducer.prepare_for_backward(outputs)
        return outputs

    @contextlib.contextmanager
    def no_sync(self):
        """Inside the block, backwards only add up gradients locally; the next one outside all-reduces."""
        previous, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous
