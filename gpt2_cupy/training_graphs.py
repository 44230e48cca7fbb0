"""A Trainer's step and evaluation as CUDA graphs (gpt2_cupy.graphs): see TrainingGraphs.

    graphs = TrainingGraphs(trainer)              # trainer: a gpt2_cupy.train.Trainer
    with graphs.warm_up(): <one eager step>       # its memory comes from the graphs' pool
    graphs.capture_training(); graphs.accumulate(); graphs.update()
    graphs.capture_evaluation(); graphs.evaluate(batches)
"""

import numpy

from gpt2_cupy import backend
from gpt2_cupy.autograd import no_grad
from gpt2_cupy.random import dropout_rng_state
from gpt2_cupy.graphs import CUDAGraph, graph, graph_pool_handle, use_pool
from gpt2_cupy.ops.residual import residual_forward
from gpt2_cupy.precision import get_float32_matmul_precision

# The trainer's graphs may take new memory into their pool while capturing: the warm-up leaves every block
# the step needs in the pool, but CuPy may have split them differently than the capture asks for them.
# Host reads stay refused in this mode too (gpt2_cupy.backend refuses them while any capture runs).
CAPTURE_MODE = "relaxed"


class TrainingGraphs:
    """A Trainer's step and evaluation as CUDA graphs (gpt2_cupy.graphs), sharing one memory pool:

        micro_step_graph   forward, loss and backward of the batch in the static buffers inputs and targets;
                           the gradients add into the optimizer's flat buffer, the loss into report[0]
        clip_graph         the gradients' global norm into report[1], the gradients clipped (when grad_clip > 0)
        update_graph       one AdamW step (learning rate and step count read from device memory), then the
                           gradients and the report zeroed for the next step
        evaluation_graph   forward and loss of the validation batch in val_inputs, val_targets under no_grad,
                           the loss added into val_total

    A step: for each micro-batch, copy the batch into inputs and targets and replay micro_step_graph;
    replay clip_graph; read report (loss sum and norm) with one host copy; stop there on a NaN loss, before
    anything is updated; write the learning rate into the optimizer's device array; replay update_graph.

    Why the step waits for the GPU once, between the gradients and the update: the host needs the loss for
    the log anyway, and with it in hand a non-finite loss skips the update on the host, so the parameters
    and AdamW's moments stay as they were, exactly as in the eager step. The alternative, one graph for the
    whole step with the update skipped on the device (AdamW reading a "loss is finite" flag), would let the
    host queue the next step before this one ends; what that wait costs has not been measured here.

    Everything a graph reads at a replay is in device memory, the same arrays every time: the batch, the
    learning rate (optimizer.upload_hyperparameters()), AdamW's step count, dropout's Philox (seed, offset),
    which the captured dropout kernels advance on the device. What a replay cannot see is what was fixed at
    capture: the module modes (train or eval), dropout probabilities, the clipping threshold, the matmul
    precision, which arrays the parameters are. Before each replay a signature of those is compared with
    the one at capture; when it differs the step runs eagerly again (the warm-up) and the graphs are
    captured anew, rather than replaying a graph of another model.
    """

    def __init__(self, trainer):
        self.trainer = trainer
        self.pool = None
        self.training_signature = self.evaluation_signature = None  # what each was captured with (None: not yet)
        self.report = None        # (loss sum, gradient norm) of the current step, float32
        self.val_total = None     # the sum of an evaluation's losses, float32 (1,)
        self.modules = self.parameters = None   # the model's, listed at the first signature

    def signature(self):
        trainer = self.trainer
        if self.modules is None:   # the trainer's model keeps its modules and parameters: listed once, not per step
            self.modules, self.parameters = list(trainer.model.modules()), trainer.model.parameters()
        modules = self.modules
        return (tuple(module.training for module in modules), tuple(getattr(module, "p", None) for module in modules),
                tuple(id(parameter._data) for parameter in self.parameters), id(dropout_rng_state()),
                get_float32_matmul_precision(), trainer.config.grad_clip, trainer.config.batch_size,
                trainer.config.block_size)

    def training_is_current(self):
        return self.training_signature is not None and self.training_signature == self.signature()

    def evaluation_is_current(self):
        return self.evaluation_signature is not None and self.evaluation_signature == self.signature()

    def warm_up(self):
        """The block runs eagerly with the graphs' pool, so that the capture after it finds its memory there."""
        if self.pool is None:
            self.pool = graph_pool_handle()
        return use_pool(self.pool)

    def static_batch(self):
        """Two (B, T) int32 device buffers for a graph's input ids and targets; zeros are valid ids."""
        shape = (self.trainer.config.batch_size, self.trainer.config.block_size)
        return backend.xp.zeros(shape, dtype=numpy.int32), backend.xp.zeros(shape, dtype=numpy.int32)

    # ---- training -----------------------------------------------------------------------------------------

    def capture_training(self):
        trainer, model, optimizer = self.trainer, self.trainer.model, self.trainer.optimizer
        self.training_signature = None
        if self.report is None:
            self.report = backend.xp.zeros(2, dtype=numpy.float32)
            self.inputs, self.targets = self.static_batch()
        loss_sum, norm = self.report[0:1], self.report[1:2]
        self.micro_step_graph, self.clip_graph, self.update_graph = CUDAGraph(), None, CUDAGraph()
        with graph(self.micro_step_graph, pool=self.pool, capture_error_mode=CAPTURE_MODE):
            loss = trainer.loss(self.inputs, self.targets)
            loss.backward(trainer.backward_seed)
            residual_forward(loss_sum, loss._data.reshape(1), out=loss_sum)
        del loss  # the graph's activations go back to the pool
        if trainer.config.grad_clip > 0:
            self.clip_graph = CUDAGraph()
            with graph(self.clip_graph, pool=self.pool, capture_error_mode=CAPTURE_MODE):
                backend.copy_into(norm, optimizer.clip_grad_norm_(trainer.config.grad_clip).reshape(1))
        optimizer.upload_hyperparameters()  # the warm-up's values, already on the device: nothing to copy
        with graph(self.update_graph, pool=self.pool, capture_error_mode=CAPTURE_MODE):
            optimizer.step()
            optimizer.zero_grad()
            backend.fill_zero(self.report)
        self.training_signature = self.signature()

    def accumulate(self):
        """The micro-steps and the clipping, replayed; (loss sum, norm) as host floats."""
        trainer = self.trainer
        for _ in range(trainer.config.grad_accum):
            inputs, targets = trainer.train_batches.sample()
            backend.copy_into(self.inputs, inputs)
            backend.copy_into(self.targets, targets)
            self.micro_step_graph.replay()
        if self.clip_graph is not None:
            self.clip_graph.replay()
        loss_sum, norm = (float(value) for value in backend.asnumpy(self.report))
        return loss_sum, norm

    def update(self):
        self.trainer.optimizer.upload_hyperparameters()  # this step's learning rate
        self.update_graph.replay()

    def forget_step(self):
        """Zero the loss sum and norm of a step that is abandoned (the gradients are the optimizer's to zero)."""
        if self.report is not None:
            backend.fill_zero(self.report)

    # ---- evaluation ---------------------------------------------------------------------------------------

    def capture_evaluation(self):
        self.evaluation_signature = None
        if self.val_total is None:
            self.val_total = backend.xp.zeros(1, dtype=numpy.float32)
            self.val_inputs, self.val_targets = self.static_batch()
        self.evaluation_graph = CUDAGraph()
        with no_grad(), graph(self.evaluation_graph, pool=self.pool, capture_error_mode=CAPTURE_MODE):
            loss = self.trainer.loss(self.val_inputs, self.val_targets)
            residual_forward(self.val_total, loss._data.reshape(1), out=self.val_total)
        del loss
        self.evaluation_signature = self.signature()

    def evaluate(self, batches):
        """The sum of the losses of batches, replayed one by one; a host float."""
        backend.fill_zero(self.val_total)
        for inputs, targets in batches:
            backend.copy_into(self.val_inputs, inputs)
            backend.copy_into(self.val_targets, targets)
            self.evaluation_graph.replay()
        return float(backend.asnumpy(self.val_total)[0])
