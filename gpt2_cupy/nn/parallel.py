"""DistributedDataParallel: the same model on every rank, each rank its own slice of the batch.

    model = DistributedDataParallel(model)      # rank 0's parameters broadcast to every rank
    optimizer = model.module.configure_optimizers(...)
    _, loss = model(inputs, targets)            # this rank's rows of the batch
    loss.backward()                             # gradient buckets all-reduced (averaged) as they fill
    optimizer.step()                            # every rank takes the same step

The gradients live in the optimizer's flat buffer (gpt2_cupy.optim). DistributedDataParallel groups the
parameters into buckets of about bucket_cap_mb, in the order their gradients are complete in the backward, so
that the first bucket fills first. Before the first backward that order is a guess, PyTorch's: the reverse of
module.parameters(), since the backward visits the last layers first. The first backward records the order in
which the gradients really arrive (a weight tied to the first layer and the output head arrives last, say), and
the buckets are made again in that order, rank 0's for every rank, for the steps after it.

A bucket's gradients lie in one or a few runs of the flat buffer: the optimizer packs the matrices (the group
with weight decay) apart from the biases and LayerNorm weights, so a layer's gradients are two runs. Each run
is all-reduced in place, with no copy. When the last gradient of a bucket has been added, its all-reduces are
queued on the group's own stream (after an event on the compute stream), and the backward of the earlier
layers goes on meanwhile on the compute stream: communication overlaps computation. Buckets are launched in
the same order on every rank (NCCL requires it), each once all before it are launched. When the last bucket
is launched, the compute stream is made to wait for all of them, so whatever runs after the backward
(clipping, the optimizer's step) reads averaged gradients. The host never waits, except once, at the end of
the first backward, to read rank 0's arrival order.

When is a parameter's gradient complete? After the forward, DistributedDataParallel walks the new graph
and counts, for each parameter, the Nodes with an edge to it. The backward frees each Node's saved arrays
(ctx.free_saved()) right after the Node's gradients have been added; that call is where the count goes
down. A backward with retain_graph=True frees nothing: its buckets are never launched, and the next
forward raises (as PyTorch's does when a reduction did not finish).

The forward runs with this rank's rows placed in the global batch (random.dropout_batch_part): with dropout,
rank r's B rows draw the random numbers of rows rB to (r+1)B - 1 of N·B rows in one process, so that N ranks
take exactly one process's steps. Every rank must take the same number of rows.

Under no_sync() the forward prepares nothing: gradients only add up locally (gradient accumulation);
the forward after the block, and its backward, all-reduce the sum.

With a ZeroRedundancyOptimizer (gpt2_cupy.zero) the buckets are not used: that optimizer reduce-scatters
the whole buffer in its step. As PyTorch's, the constructor broadcasts rank 0's parameters and buffers. Where
it differs from PyTorch: a parameter must not be used by some ranks and not by others.
"""

import contextlib
import time
import weakref

import numpy

from gpt2_cupy import backend, distributed
from gpt2_cupy.autograd import AccumulateGrad, Tensor, is_grad_enabled, topological_order
from gpt2_cupy.random import dropout_batch_part
from gpt2_cupy.nn import Module
from gpt2_cupy.zero import ZeroRedundancyOptimizer

DEFAULT_BUCKET_CAP_MB = 25  # PyTorch's default: large enough that each all-reduce runs near full bandwidth


class Bucket:
    """Parameters whose gradients are all-reduced together, and the runs [start, stop) of the flat gradient
    buffer that hold them (one run for each stretch of parameters packed one after the other)."""

    def __init__(self, parameters, runs):
        self.parameters, self.runs = parameters, runs
        self.pending = 0   # gradients still to come in this backward
        self.works = []    # the queued all-reduces, one a run

    @property
    def elements(self):
        return sum(stop - start for start, stop in self.runs)

    def __repr__(self):
        return f"Bucket({len(self.parameters)} parameters in runs {self.runs})"


def make_buckets(packed, order, cap_bytes, itemsize=4):
    """Buckets of the parameters taken in `order` (the first to be complete first), each closed once it holds
    cap_bytes.

    packed: (parameter, its slice of the flat buffer) pairs, in the order the optimizer packed them. Neighbours
    in that order that fall in one bucket make one run, the padding between them included, so every
    parameter's slice is in exactly one run of exactly one bucket.
    """
    position = {id(p): number for number, (p, _) in enumerate(packed)}
    slices = {id(p): where for p, where in packed}
    buckets, parameters, size = [], [], 0
    for parameter in order:
        parameters.append(parameter)
        size += slices[id(parameter)].stop - slices[id(parameter)].start
        if size * itemsize >= cap_bytes:
            buckets.append(parameters)
            parameters, size = [], 0
    if parameters:
        buckets.append(parameters)
    made = []
    for parameters in buckets:
        numbers = sorted(position[id(p)] for p in parameters)
        runs = []
        for number in numbers:
            where = packed[number][1]
            if runs and runs[-1][2] == number - 1:   # the packed neighbour of the run's last parameter
                runs[-1] = (runs[-1][0], where.stop, number)
            else:
                runs.append((where.start, where.stop, number))
        made.append(Bucket(parameters, [(start, stop) for start, stop, _ in runs]))
    return made


class BucketTimeline:
    """When each bucket's all-reduces are issued and when they complete, in milliseconds from the backward's
    start, for one backward: set reducer.timeline = BucketTimeline() before it, call start() just before
    loss.backward() and end() just after, then read milliseconds().

    Over NCCL the marks are CUDA events: issued on the compute stream as the bucket is launched, complete on the
    communication stream after its last all-reduce, the end on the compute stream after the backward (which
    waits for every all-reduce). On simulated ranks they are the host's clock after a synchronize: a collective
    completes when the last rank arrives at it."""

    def __init__(self):
        self.on_device = distributed.uses_nccl()
        self.origin, self.issued, self.works, self.finish = None, [], [], None

    def mark(self):
        if self.on_device:
            event = backend.xp.cuda.Event()
            event.record()
            return event
        backend.synchronize()
        return time.perf_counter()

    def start(self):
        self.origin, self.issued, self.works, self.finish = self.mark(), [], [], None

    def record(self, issued, works):
        """The reducer's call for each bucket it launches: the mark taken before its all-reduces were queued, and
        their works."""
        self.issued.append(issued)
        self.works.append(works)

    def end(self):
        self.finish = self.mark()

    def _milliseconds(self, mark):
        if self.on_device:
            mark.synchronize()
            return backend.xp.cuda.get_elapsed_time(self.origin, mark)
        return (mark - self.origin) * 1e3

    def milliseconds(self):
        """{"issued": [ms a bucket], "complete": [ms a bucket], "end": ms}: from the backward's start."""
        if self.finish is None:
            raise RuntimeError("BucketTimeline.milliseconds: call start() before the backward and end() after it")
        complete = [self._milliseconds(works[-1].done_event) if self.on_device else
                    (max(work.collective.done_at for work in works) - self.origin) * 1e3 for works in self.works]
        return {"issued": [self._milliseconds(mark) for mark in self.issued], "complete": complete,
                "end": self._milliseconds(self.finish)}


class GradientReducer:
    """The buckets of one model and their all-reduces during one backward."""

    def __init__(self, parameters, cap_bytes):
        owners = [getattr(getattr(p, "_grad_slot", None), "owner", None) for p in parameters]
        owner = owners[0]
        if owner is None or any(other is not owner for other in owners):
            raise RuntimeError("DistributedDataParallel all-reduces the gradients in the optimizer's flat buffer: "
                               "create one optimizer over all the model's parameters before the first forward")
        self.optimizer, self.parameters, self.cap_bytes = owner, parameters, cap_bytes
        wanted = {id(p) for p in parameters}
        self.packed = [(p, where) for p, where, _, _ in owner._packed if id(p) in wanted]
        self.reduce_in_backward = not isinstance(owner, ZeroRedundancyOptimizer)  # which reduce-scatters in its step
        self.arrival_order = None  # recorded during the first backward, then the buckets follow it
        self.timeline = None       # a BucketTimeline, to record when each bucket is issued and complete
        self._make_buckets(list(reversed(parameters)))
        self.buckets_follow_guess = True
        self.next_bucket = len(self.buckets)  # none pending: no backward is under way

    def _make_buckets(self, order):
        self.buckets = make_buckets(self.packed, order, self.cap_bytes) if self.reduce_in_backward else []
        self.bucket_of = {id(p): bucket for bucket in self.buckets for p in bucket.parameters}

    @property
    def finished(self):
        return self.next_bucket == len(self.buckets)

    def prepare_for_backward(self, outputs):
        """Count the edges from the graph of outputs to each parameter; hook their Nodes' free_saved."""
        if not self.buckets:
            return
        if self.arrival_order is not None and self.buckets_follow_guess:
            self._make_buckets(self.arrival_order)
            self.buckets_follow_guess = False
        self.pending = {id(p): 0 for p in self.parameters}
        self.arrived = [] if self.arrival_order is None else None  # recorded in the first backward only
        for bucket in self.buckets:
            bucket.pending, bucket.works = 0, []
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
            self.pending[id(p)] += 1
            self.bucket_of[id(p)].pending += 1
        context = weakref.ref(ctx)  # a weak reference: no cycle keeps ctx (and what it saved) alive

        def free_saved_then_mark_arrived():
            ctx = context()
            del ctx.free_saved  # this instance's hook: ctx.free_saved is Context's own again
            ctx.free_saved()
            for p in parameters:
                self.pending[id(p)] -= 1
                self.bucket_of[id(p)].pending -= 1
                if self.arrived is not None and self.pending[id(p)] == 0:
                    self.arrived.append(p)
            self._launch_ready_buckets()

        ctx.free_saved = free_saved_then_mark_arrived

    def _launch_ready_buckets(self):
        """All-reduce the next buckets in order while they are complete; after the last, wait for them all."""
        flat_grads = self.optimizer.flat_grads
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
            bucket = self.buckets[self.next_bucket]
            issued = self.timeline.mark() if self.timeline is not None else None
            bucket.works = [distributed.all_reduce(flat_grads[start:stop], op=distributed.ReduceOp.AVG, async_op=True)
                            for start, stop in bucket.runs]
            if self.timeline is not None:
                self.timeline.record(issued, bucket.works)
            self.next_bucket += 1
            if self.finished:
                for launched in self.buckets:  # the compute stream waits for every all-reduce
                    for work in launched.works:
                        work.wait()
                if self.arrived is not None:
                    self._record_arrival_order()

    def _record_arrival_order(self):
        """Rank 0's order of arrival (parameters the graph did not use last), the same on every rank."""
        index = {id(p): number for number, p in enumerate(self.parameters)}
        arrived = {id(p) for p in self.arrived}
        order = [index[id(p)] for p in self.arrived] + [index[id(p)] for p in reversed(self.parameters)
                                                        if id(p) not in arrived]
        shared = backend.xp.asarray(numpy.array(order, dtype=numpy.int32))
        distributed.broadcast(shared, src=0)
        self.arrival_order = [self.parameters[number] for number in backend.asnumpy(shared).tolist()]
        self.arrived = None


def _bytes_of(array):
    """The array's bytes as uint8, sharing its memory: a buffer of any dtype (a mask, a count) is broadcast as
    it is."""
    if not array.flags.c_contiguous:
        raise ValueError("DistributedDataParallel broadcasts a module's buffers in place: make them contiguous")
    return array.reshape(-1).view(numpy.uint8)


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
            distributed.broadcast(parameter._data, src=0)
        for buffer in module.buffers():
            distributed.broadcast(_bytes_of(buffer._data), src=0)

    def forward(self, *inputs, **options):
        if self.reducer is not None and not self.reducer.finished:
            raise RuntimeError("Expected to have finished reduction in the prior iteration before starting a new "
                               "one: the last backward through this DistributedDataParallel did not reach every "
                               "parameter (a backward with retain_graph=True, or none at all)")
        with dropout_batch_part(distributed.get_rank(), distributed.get_world_size()):  # this rank's rows' masks
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
