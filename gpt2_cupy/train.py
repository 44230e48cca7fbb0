"""Training a GPT on a corpus: `python -m gpt2_cupy.train --corpus tinyshakespeare --preset tiny --steps 50`.

    config = make_config(corpus="tinyshakespeare", preset="tiny", max_steps=50)
    trainer = Trainer(config)          # prepares the corpus, builds the model and AdamW (or resumes)
    trainer.run()                      # the loop, evaluations, checkpoints, the log and its plot

One step: for each of grad_accum micro-batches, forward and backward (the gradients add up in the
optimizer's flat buffer); then clip the gradient norm, set the learning rate, one AdamW step, zero the
gradients. With cuda_graph (the default) the step runs as CUDA graphs (gpt2_cupy.graphs), captured after
one eager step and replayed with no Python per kernel, with the same results bit for bit: see
gpt2_cupy.training_graphs. Everything a run writes goes to out_dir (default runs/<corpus>-<preset>/):

    checkpoint.npz   model, optimizer state, step, the data sampler's and dropout's random state
    best.npz         the same at the evaluation with the lowest validation loss so far: on a small corpus the
                     model starts to memorise its training text, and the validation loss rises again
    log.jsonl        one json line per step ({"step", "loss", "lr", ...}) and per evaluation ({"val_loss"})
    loss.png         training and validation loss

A run resumed from its checkpoint (--resume) continues bit for bit: its losses equal those of a run that
was never interrupted. Ctrl-C finishes the current step, saves a checkpoint and stops.

On several GPUs (`--nproc N`, or torchrun's RANK, WORLD_SIZE, LOCAL_RANK; gpt2_cupy.launch): a step's
global batch is N·B windows, drawn by the same generator on every rank, and rank r trains on rows r·B to
(r+1)·B - 1, so N ranks of B rows take the step one process of N·B rows takes. The model is wrapped in
DistributedDataParallel (gpt2_cupy.nn.parallel), which averages the gradients; with --zero, AdamW's state
is sharded (ZeRO-1, gpt2_cupy.zero). The logged loss and the validation loss are averaged over the ranks;
rank 0 alone writes the log, the plot and the checkpoints, which resume with any N. A distributed step
runs eagerly: the CUDA graphs are not captured around NCCL's calls. Ctrl-C reaches the launcher, which
stops every rank at once without saving; --resume continues from the last checkpoint written.
"""

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy

from gpt2_cupy import backend, checkpoint, data, distributed, launch
from gpt2_cupy.amp import BFLOAT16, autocast
from gpt2_cupy.autograd import no_grad
from gpt2_cupy.random import dropout_rng_state, manual_seed
from gpt2_cupy.llama import Llama, LlamaConfig
from gpt2_cupy.model import GPT, GPTConfig
from gpt2_cupy.nn.parallel import DistributedDataParallel
from gpt2_cupy.ops.arrays import ceil_div
from gpt2_cupy.precision import PRECISIONS, set_float32_matmul_precision
from gpt2_cupy.training_graphs import TrainingGraphs
from gpt2_cupy.zero import shard_optimizer

RUNS_DIR = Path("runs")
DTYPES = ("float32", "bf16")  # of the activations: bf16 runs the forward under gpt2_cupy.autocast

# Model sizes and the training settings that go with them. tiny trains on the CPU executor in seconds;
# course is the chapter's GPU model (10.7M parameters besides the embeddings); gpt2 is GPT-2 small, 124M.
# course's 1000 steps of 16,384 tokens pass over tinyshakespeare's 0.35M training tokens 46 times and over
# aozora's 0.96M 17 times: trained longer, the model memorises its training text and the validation loss
# climbs (chapter 14 shows 3,700 steps), even with dropout 0.2, which nanoGPT also uses for Shakespeare.
PRESETS = {
    "tiny": dict(n_layer=2, n_head=2, n_embd=64, block_size=64, batch_size=8, learning_rate=2e-3, dropout=0.0,
                 warmup_steps=10, max_steps=50, eval_interval=25, eval_batches=4, checkpoint_interval=25),
    "course": dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=64, learning_rate=1e-3, dropout=0.2,
                   warmup_steps=100, max_steps=1000, eval_interval=100, eval_batches=20, checkpoint_interval=500),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, batch_size=8, learning_rate=6e-4, dropout=0.0,
                 warmup_steps=700, max_steps=20000, eval_interval=500, eval_batches=20, checkpoint_interval=1000),
}


def option(default, help, flag=None, choices=None):
    """A TrainConfig field and its command-line option: --the-name (or flag), its help and choices; a bool
    field is a switch, --name and --no-name."""
    return field(default=default, metadata=dict(help=help, flag=flag, choices=choices))


@dataclass
class TrainConfig:
    """Everything a run is set by; each field is also an option of `python -m gpt2_cupy.train` (parse_arguments).
    None: the preset's value (PRESETS)."""
    corpus: str = option("tinyshakespeare", "tinyshakespeare, aozora, or a directory with train.bin and val.bin")
    data_dir: str = option(None, f"the folder of the named corpora (None: ${data.DATA_DIR_VARIABLE}, then the "
                                 "repository's data/)")
    preset: str = option("tiny", "model sizes and training settings (PRESETS)", choices=tuple(PRESETS))
    model: str = option("gpt2", "gpt2, or llama (RMSNorm, RoPE, SwiGLU, no biases, no dropout) of the preset's size",
                        choices=("gpt2", "llama"))
    n_layer: int = option(None, "transformer blocks")
    n_head: int = option(None, "attention heads")
    n_embd: int = option(None, "C, channels of the residual stream")
    block_size: int = option(None, "T, the context length: the context the model sees")
    batch_size: int = option(None, "B, windows per micro-batch")
    grad_accum: int = option(1, "micro-batches per optimizer step: B·T·grad_accum tokens per step")
    max_steps: int = option(None, "optimizer steps", flag="--steps")
    learning_rate: float = option(None, "the peak learning rate, reached after the warmup", flag="--lr")
    min_lr_fraction: float = option(0.1, "the cosine decay ends at the peak learning rate times this")
    warmup_steps: int = option(None, "steps of linear learning-rate warmup", flag="--warmup")
    weight_decay: float = option(0.1, "on matrices and embeddings only (model.configure_optimizers)")
    beta1: float = option(0.9, "AdamW's beta1")
    beta2: float = option(0.95, "AdamW's beta2")
    grad_clip: float = option(1.0, "the gradient's global norm is clipped to this; 0: no clipping")
    dropout: float = option(None, "the dropout probability")
    bias: bool = option(True, "biases in the Linear layers and the norms (--no-bias: none)")
    norm: str = option("layernorm", "GPT-2's norm: LayerNorm, or DyT (dynamic tanh)", choices=("layernorm", "dyt"))
    attention: str = option("softmax", "GPT-2's attention weights: softmax, or ReLU (chapter 08)",
                            choices=("softmax", "relu"))
    matmul_precision: str = option("highest", "float32 products (set_float32_matmul_precision): highest "
                                              "(float32), high (TF32), medium (bf16 inputs)", choices=PRECISIONS)
    dtype: str = option("float32", "bf16: activations in bf16 under autocast, float32 master weights, AdamW state "
                                   "and sums", choices=DTYPES)
    cuda_graph: bool = option(True, "run the step and the evaluation as CUDA graphs (the CPU executor records and "
                                    "replays them too); --no-cuda-graph launches kernel by kernel, for debugging")
    vocab_size: int = option(None, "None: the corpus's tokenizer's (or, without one, the largest id + 1)")
    eval_interval: int = option(None, "steps between evaluations on the validation split")
    eval_batches: int = option(None, "validation batches per evaluation (the same ones; at most all of them)")
    checkpoint_interval: int = option(None, "steps between checkpoints")
    seed: int = option(1337, "initial weights, dropout, and the order of the training windows")
    out_dir: str = option(None, "None: runs/<corpus>-<preset>")
    progress: bool = option(True, "the tqdm progress bar")
    zero: bool = option(False, "with several ranks: ZeRO-1, AdamW's state sharded over the ranks")


# GPTConfig's fields, which TrainConfig repeats as options (the vocabulary comes from the corpus).
GPT_FIELDS = tuple(name for name in (f.name for f in fields(GPTConfig)) if name != "vocab_size")


def llama_config(config, vocab_size):
    """A Llama of the preset's size: its width, layers and heads; the MLP's width 8/3 of the model's rounded up to
    a multiple of 64 (three matrices as many parameters as GPT-2's two of 4 C), as Meta sized Llama's."""
    return LlamaConfig(vocab_size=vocab_size, hidden_size=config.n_embd,
                       intermediate_size=ceil_div(8 * config.n_embd // 3, 64) * 64, num_hidden_layers=config.n_layer,
                       num_attention_heads=config.n_head, max_position_embeddings=config.block_size)


def gpt_config(config, vocab_size):
    """The GPTConfig of a run: every GPTConfig field is a TrainConfig option of the same name."""
    return GPTConfig(**{name: getattr(config, name) for name in GPT_FIELDS}, vocab_size=vocab_size)


def make_config(**options):
    """A TrainConfig with every None filled in from the preset, refused if an option is unknown."""
    known = {field.name for field in fields(TrainConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"make_config: unknown options {unknown}; the options are {sorted(known)}")
    config = TrainConfig(**options)
    if config.model == "llama" and config.dropout:   # asked for explicitly: the preset's value is not applied
        raise ValueError(f"dropout={config.dropout}: the Llama has no dropout layers (nor has Meta's); use 0")
    if config.preset not in PRESETS:
        raise ValueError(f"unknown preset {config.preset!r}; the presets are {', '.join(PRESETS)}")
    for name, value in PRESETS[config.preset].items():
        if getattr(config, name) is None:
            setattr(config, name, value)
    if config.model not in ("gpt2", "llama"):
        raise ValueError(f"model={config.model!r}; use 'gpt2' or 'llama'")
    if config.model == "llama":
        config.dropout = 0.0
    if config.dtype not in DTYPES:
        raise ValueError(f"dtype={config.dtype!r}; use one of {', '.join(DTYPES)}")
    if config.dtype == "bf16" and (config.model == "llama" or config.norm == "dyt"):
        raise ValueError(f"dtype='bf16' trains GPT-2 with LayerNorm: the kernels of "
                         f"{'Llama' if config.model == 'llama' else 'DyT'} take float32 only; use dtype='float32'")
    if config.matmul_precision not in PRECISIONS:
        raise ValueError(f"matmul_precision={config.matmul_precision!r}; use one of {', '.join(PRECISIONS)}")
    if config.out_dir is None:
        suffix = "-llama" if config.model == "llama" else ""
        config.out_dir = str(RUNS_DIR / f"{Path(config.corpus).name}-{config.preset}{suffix}")
    for name in ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "grad_accum", "eval_batches",
                 "eval_interval", "checkpoint_interval"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name} = {getattr(config, name)}: it must be at least 1")
    if config.max_steps < 0 or config.warmup_steps < 0:
        raise ValueError(f"max_steps = {config.max_steps}, warmup_steps = {config.warmup_steps}: both must be >= 0")
    return config


# ---------------------------------------------------------------------------------------------------------
# The corpus
# ---------------------------------------------------------------------------------------------------------


@dataclass
class CorpusFiles:
    train: Path
    val: Path
    tokenizer: Path  # None for a directory of token files without a tokenizer.model


def open_corpus(corpus, progress=True, data_dir=None):
    """The token files (and tokenizer) of a named corpus, prepared when needed, or of a directory."""
    if corpus in data.CORPORA:
        prepared = data.prepare(corpus, data_dir=data_dir, progress=progress)
        return CorpusFiles(prepared.train, prepared.val, prepared.tokenizer)
    directory = Path(corpus)
    if not directory.is_dir():
        raise ValueError(f"corpus {corpus!r} is neither one of {', '.join(data.CORPORA)} nor a directory")
    missing = [name for name in ("train.bin", "val.bin") if not (directory / name).exists()]
    if missing:
        raise FileNotFoundError(f"{directory}: no {' or '.join(missing)} (token files in llm.c's format)")
    tokenizer = directory / "tokenizer.model"
    return CorpusFiles(directory / "train.bin", directory / "val.bin", tokenizer if tokenizer.exists() else None)


def largest_token(tokens):
    return int(tokens.max()) if len(tokens) else -1


# ---------------------------------------------------------------------------------------------------------
# The learning-rate schedule
# ---------------------------------------------------------------------------------------------------------


def learning_rate(step, config):
    """The learning rate of optimizer step `step` (0 first): a linear warmup, then a cosine down to the minimum.

    Warmup: Adam's second-moment estimates start from zero and are noisy for the first steps; small steps
    until they settle keep the first updates from throwing the weights far off.
    """
    peak = config.learning_rate
    lowest = peak * config.min_lr_fraction
    if step < config.warmup_steps:
        return peak * (step + 1) / config.warmup_steps
    if step >= config.max_steps:
        return lowest
    progress = (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps)
    return lowest + 0.5 * (1.0 + math.cos(math.pi * progress)) * (peak - lowest)


# ---------------------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------------------


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite."""


class Trainer:
    def __init__(self, config, resume=False):
        self.config = config
        self.out_dir = Path(config.out_dir)
        self.checkpoint_path = self.out_dir / "checkpoint.npz"
        self.best_path = self.out_dir / "best.npz"
        self.log_path = self.out_dir / "log.jsonl"
        self.plot_path = self.out_dir / "loss.png"

        self.distributed = distributed.is_initialized()
        self.rank, self.world_size = (distributed.get_rank(), distributed.get_world_size()) if self.distributed else (0, 1)
        self.is_main = self.rank == 0  # writes the log, the plot and the checkpoints
        if config.zero and not self.distributed:
            raise ValueError("zero=True shards the optimizer over the ranks of a process group: start the run with "
                             "--nproc N (or torchrun), or leave zero off")
        self.corpus = open_corpus(config.corpus, progress=config.progress, data_dir=config.data_dir)
        self.tokenizer_bytes = self.corpus.tokenizer.read_bytes() if self.corpus.tokenizer else b""
        train_tokens, val_tokens = data.read_tokens(self.corpus.train), data.read_tokens(self.corpus.val)
        vocab_size = config.vocab_size
        if vocab_size is None:
            if self.corpus.tokenizer:
                vocab_size = data.Tokenizer(self.corpus.tokenizer).vocab_size
            else:  # a multiple of 64, as GPT-2's 50257 becomes 50304: whole tiles in the output layer
                vocab_size = ceil_div(max(largest_token(train_tokens), largest_token(val_tokens)) + 1, 64) * 64
        for split, tokens in (("train.bin", train_tokens), ("val.bin", val_tokens)):
            if largest_token(tokens) >= vocab_size:
                raise ValueError(f"the corpus does not match the model: {split} holds token id {largest_token(tokens)}, "
                                 f"the model's vocabulary has {vocab_size} entries (0 to {vocab_size - 1})")

        if config.model == "llama":
            self.model_config = llama_config(config, vocab_size)
        else:
            self.model_config = gpt_config(config, vocab_size)
        set_float32_matmul_precision(config.matmul_precision)
        self.autocast = autocast(device_type="cuda", dtype=BFLOAT16 if config.dtype == "bf16" else None)
        manual_seed(config.seed)
        self.model = Llama(self.model_config) if config.model == "llama" else GPT(self.model_config)
        self.optimizer = self.model.configure_optimizers(config.weight_decay, config.learning_rate,
                                                         (config.beta1, config.beta2))
        if config.dtype == "bf16":   # AdamW writes the products' bf16 weights in its update's pass
            self.optimizer.keep_bf16_working_copy()
        if config.zero:
            self.optimizer = shard_optimizer(self.optimizer)
        # what the forward runs through: on several ranks the model wrapped so that its gradients are averaged
        self.forward_model = DistributedDataParallel(self.model) if self.distributed else self.model
        # The global batch: every rank draws all N·B windows (the same generator) and trains on its own B.
        B, T = config.batch_size * self.world_size, config.block_size
        self.train_batches = data.Batches(train_tokens, B, T, seed=config.seed)
        self.val_batches = data.Batches(val_tokens, B, T)
        # A small validation split (tinyshakespeare's holds 2 batches of the course preset) is used whole.
        self.eval_batches = min(config.eval_batches, self.val_batches.sequential_batches)
        self.backward_seed = self.backward_seed_value = None  # set_backward_seed() makes it
        self.set_backward_seed()
        self.graphs = TrainingGraphs(self)
        self.step = 0
        self.stop_requested = False
        self.updating = False  # True while optimizer.step() changes the parameters
        if resume:
            self.load(self.checkpoint_path)

    # ---- one step, one evaluation -------------------------------------------------------------------------

    def train_step(self):
        """One optimizer step; returns (mean loss, gradient norm before clipping, learning rate), host floats."""
        self.model.train()
        self.set_backward_seed()
        if not self.config.cuda_graph or self.distributed:
            return self.step_with(self.accumulate_eagerly, self.update_eagerly)
        if self.graphs.training_is_current():
            return self.step_with(self.graphs.accumulate, self.graphs.update)
        # The first step, or the first after a change the graphs depend on: eagerly, with the graphs' memory
        # pool, so that every buffer the step needs exists; then the graphs are captured (nothing runs).
        with self.graphs.warm_up():
            result = self.step_with(self.accumulate_eagerly, self.update_eagerly)
        self.graphs.capture_training()
        return result

    def step_with(self, accumulate, update):
        """The step around its two halves: accumulate() the gradients, read the loss and the norm (the one
        host copy of the step, for the log, the progress bar and the NaN check); then update()."""
        loss_value, norm_value = accumulate()
        loss_value /= self.config.grad_accum
        if not math.isfinite(loss_value):
            self.forget_gradients()
            kept = f"the last checkpoint, {self.checkpoint_path}, is kept" if self.checkpoint_path.exists() else \
                "no checkpoint was written yet"
            raise TrainingDiverged(f"step {self.step + 1}: the training loss is {loss_value}; stopped before the "
                                   f"update ({kept}). Try a lower learning rate or stronger gradient clipping.")
        lr = learning_rate(self.step, self.config)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.updating = True
        update()
        self.updating = False
        self.step += 1
        return loss_value, norm_value, lr

    def loss(self, inputs, targets):
        """The model's loss on one batch, its forward in the run's dtype (the backward follows the forward's)."""
        with self.autocast:
            _, loss = self.forward_model(inputs, targets)
        return loss

    @property
    def tokens_per_step(self):
        """Tokens of one optimizer step, over every rank and micro-batch."""
        config = self.config
        return config.batch_size * config.block_size * config.grad_accum * self.world_size

    def own_rows(self, batch):
        """This rank's rows of a global batch (inputs, targets): r·B to (r+1)·B - 1."""
        B = self.config.batch_size
        return tuple(array[self.rank * B:(self.rank + 1) * B] for array in batch)

    def average_over_ranks(self, value):
        """A device scalar replaced by its mean over the ranks (in place; nothing to do in one process)."""
        if self.distributed:
            distributed.all_reduce(value.reshape(1), op=distributed.ReduceOp.AVG)
        return value

    def accumulate_eagerly(self):
        """grad_accum forwards and backwards, then clipping, launch by launch; (loss sum, norm) as host floats."""
        loss_sum = backend.xp.zeros((), dtype=numpy.float32)
        for micro_step in range(self.config.grad_accum):
            inputs, targets = self.own_rows(self.train_batches.sample())
            last = micro_step == self.config.grad_accum - 1
            # the gradients are averaged over the ranks once per step: in the backward of the last micro-batch
            with self.forward_model.no_sync() if self.distributed and not last else contextlib.nullcontext():
                loss = self.loss(inputs, targets)
                loss.backward(self.backward_seed)
            loss_sum += loss._data
        self.average_over_ranks(loss_sum)
        if self.config.grad_clip > 0:
            norm = self.optimizer.clip_grad_norm_(self.config.grad_clip)
        else:
            norm = backend.xp.zeros((), dtype=numpy.float32)
        loss_value, norm_value = (float(v) for v in backend.asnumpy(backend.xp.stack([loss_sum, norm])))
        return loss_value, norm_value

    def update_eagerly(self):
        self.optimizer.step()
        self.optimizer.zero_grad()

    def set_backward_seed(self):
        """d(loss)/d(loss) for each micro-batch's backward: 1/grad_accum, so that the summed gradient is that
        of the mean loss. Rewritten in place when grad_accum changes, so that a captured backward reads it."""
        value = numpy.float32(1.0 / self.config.grad_accum)
        if self.backward_seed is None:
            self.backward_seed = backend.xp.full((), value, dtype=numpy.float32)
        elif value != self.backward_seed_value:
            backend.copy_into(self.backward_seed, numpy.full((), value, dtype=numpy.float32))
        self.backward_seed_value = value

    def forget_gradients(self):
        """Zero what a step has accumulated so far (gradients, and the graphs' loss sum)."""
        self.optimizer.zero_grad()
        self.graphs.forget_step()

    def random_state(self):
        """Where the training windows' generator and dropout's generator are (dropout's: a device copy)."""
        return self.train_batches.random_generator.bit_generator.state, dropout_rng_state().copy()

    def undo_step(self, random_state):
        """Forget an interrupted step: its gradients and the random numbers it drew (its graph goes with its loss)."""
        batches_state, dropout_state = random_state
        self.train_batches.random_generator.bit_generator.state = batches_state
        dropout_rng_state()[...] = dropout_state
        self.forget_gradients()

    def evaluate(self):
        """The mean loss over the first eval_batches validation batches (the same ones every time)."""
        self.model.eval()
        try:
            if not self.config.cuda_graph or self.distributed:
                total = self.evaluate_eagerly()
            elif self.graphs.evaluation_is_current():
                total = self.graphs.evaluate(self.validation_batches())
            else:  # the first evaluation: eagerly in the graphs' pool, then captured
                with self.graphs.warm_up():
                    total = self.evaluate_eagerly()
                self.graphs.capture_evaluation()
        finally:
            self.model.train()
        return total / self.eval_batches

    def validation_batches(self):
        return (self.own_rows(batch) for _, batch in zip(range(self.eval_batches), self.val_batches.sequential()))

    def evaluate_eagerly(self):
        """The sum of the validation batches' losses, a host float."""
        total = backend.xp.zeros((), dtype=numpy.float32)
        with no_grad():
            for inputs, targets in self.validation_batches():
                loss = self.loss(inputs, targets)
                total += loss._data
        return float(backend.asnumpy(self.average_over_ranks(total)))

    # ---- checkpoints --------------------------------------------------------------------------------------

    def save(self, path=None):
        path = self.checkpoint_path if path is None else Path(path)
        arrays = {f"model/{name}": value for name, value in checkpoint.model_arrays(self.model).items()}
        optimizer_state = self.optimizer.state_dict()
        arrays.update({f"optimizer/{name}": value for name, value in optimizer_state["state"].items()})
        if not self.is_main:  # every rank has gathered the state above (with ZeRO a collective); rank 0 writes
            return
        arrays["tokenizer"] = numpy.frombuffer(self.tokenizer_bytes, dtype=numpy.uint8)
        meta = dict(
            step=self.step,
            model_config=asdict(self.model_config),
            train_config=asdict(self.config),
            optimizer={k: v for k, v in optimizer_state.items() if k != "state"},
            # Where the data is: the generator that picks the training windows, mid-sequence.
            batches_state=self.train_batches.random_generator.bit_generator.state,
            dropout_rng_state=[int(v) for v in backend.asnumpy(dropout_rng_state())],
        )
        checkpoint.save(path, arrays, meta)

    def load(self, path):
        arrays, meta = checkpoint.load(path)
        differences = [f"{name}: checkpoint {meta['model_config'].get(name)!r}, here {value!r}"
                       for name, value in asdict(self.model_config).items() if meta["model_config"].get(name) != value]
        if differences:
            raise ValueError(f"{path} does not match the model: " + "; ".join(differences))
        if arrays["tokenizer"].tobytes() != self.tokenizer_bytes:
            raise ValueError(f"{path} was trained with another tokenizer than {self.corpus.tokenizer}: "
                             "the same ids would mean other text")
        weights = {name[len("model/"):]: value for name, value in arrays.items() if name.startswith("model/")}
        self.model.load_state_dict(checkpoint.model_state(self.model, weights))
        state = {name[len("optimizer/"):]: value for name, value in arrays.items() if name.startswith("optimizer/")}
        self.optimizer.load_state_dict({**meta["optimizer"], "state": state})
        self.train_batches.random_generator.bit_generator.state = meta["batches_state"]
        dropout_rng_state()[...] = backend.xp.asarray(numpy.array(meta["dropout_rng_state"], dtype=numpy.uint64))
        self.step = meta["step"]

    # ---- the loop -----------------------------------------------------------------------------------------

    def run(self, stop_after=None):
        """Train up to max_steps (or stop_after steps from here); returns the log records of this run."""
        from tqdm import tqdm

        config = self.config
        self.out_dir.mkdir(parents=True, exist_ok=True)
        history = self.read_log()
        records = []
        last = config.max_steps if stop_after is None else min(config.max_steps, self.step + stop_after)
        tokens_per_step = self.tokens_per_step
        # Under the launcher, Ctrl-C reaches the launcher only, which stops every rank at once.
        previous_handler = None if self.distributed else self.catch_ctrl_c()
        bar = tqdm(total=config.max_steps, initial=self.step, disable=not (config.progress and self.is_main),
                   desc="train", dynamic_ncols=True)
        try:
            with open(self.log_path, "a") if self.is_main else contextlib.nullcontext() as log:
                def write(record):
                    records.append(record)
                    history.append(record)
                    if self.is_main:
                        log.write(json.dumps(record) + "\n")
                        log.flush()

                def evaluate_and_keep_the_best():
                    earlier = [r["val_loss"] for r in history if "val_loss" in r]
                    write(dict(step=self.step, val_loss=self.evaluate()))
                    if not earlier or history[-1]["val_loss"] < min(earlier):
                        self.save(self.best_path)

                if self.step == 0:
                    evaluate_and_keep_the_best()
                while self.step < last and not self.stop_requested:
                    started = time.perf_counter()
                    before = self.random_state()
                    try:
                        loss, norm, lr = self.train_step()
                    except KeyboardInterrupt:
                        # The CPU executor stops a kernel at Ctrl-C (it cannot wait for a long launch):
                        # the step is incomplete. Before the update, nothing but gradients and random
                        # state has changed, so the step is undone and the checkpoint is clean.
                        if self.updating:
                            raise  # parameters half updated: the previous checkpoint stays
                        self.undo_step(before)
                        self.stop_requested = True
                        break
                    seconds = time.perf_counter() - started
                    write(dict(step=self.step, loss=loss, lr=lr, grad_norm=norm, seconds=seconds,
                               tokens_per_second=tokens_per_step / seconds))
                    bar.update()
                    bar.set_postfix(loss=f"{loss:.4f}", tokens_per_s=f"{tokens_per_step / seconds:,.0f}")
                    if self.step % config.eval_interval == 0 or self.step == config.max_steps:
                        evaluate_and_keep_the_best()
                        if self.is_main:
                            plot_losses(history, self.plot_path)
                    if self.step % config.checkpoint_interval == 0:
                        self.save()
        finally:
            bar.close()
            self.restore_ctrl_c(previous_handler)
        self.save()
        if self.is_main:
            plot_losses(history, self.plot_path)
        if self.stop_requested:
            print(f"interrupted: saved {self.checkpoint_path} at step {self.step}; continue with --resume",
                  file=sys.stderr)
        return records

    def read_log(self):
        """The log's records up to this step; lines written after the checkpoint are dropped (they are redone)."""
        if not self.log_path.exists():
            return []
        records = [json.loads(line) for line in self.log_path.read_text().splitlines() if line.strip()]
        kept = [record for record in records if record["step"] <= self.step] if self.step > 0 else []
        if self.is_main:  # the other ranks only read it; the file is replaced whole, never seen half written
            data.write_atomically(self.log_path, "".join(json.dumps(r) + "\n" for r in kept).encode("utf-8"))
        return kept

    def catch_ctrl_c(self):
        """The first Ctrl-C asks the loop to stop after the current step (and save); a second one aborts."""
        if threading.current_thread() is not threading.main_thread():
            return None

        def request_stop(signum, frame):
            if self.stop_requested:
                raise KeyboardInterrupt
            self.stop_requested = True
            print("\nCtrl-C: finishing this step, then saving a checkpoint (Ctrl-C again to abort)", file=sys.stderr)

        return signal.signal(signal.SIGINT, request_stop)

    @staticmethod
    def restore_ctrl_c(previous_handler):
        if previous_handler is not None:
            signal.signal(signal.SIGINT, previous_handler)


def read_log(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_losses(records, path=None, title=None, axes=None):
    """Training loss per step and validation loss per evaluation, from log records; saved to path as PNG."""
    from matplotlib.figure import Figure  # no pyplot: no window and no global state

    figure = None
    if axes is None:
        figure = Figure(figsize=(6, 3.5), layout="constrained")
        axes = figure.add_subplot()
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if train:
        axes.plot(*zip(*train), label="train", linewidth=1, alpha=0.8)
    if val:
        axes.plot(*zip(*val), "o-", label="validation")
    axes.set_xlabel("step")
    axes.set_ylabel("cross-entropy loss")
    axes.set_title(title or "")
    axes.legend()
    if figure is not None and path is not None:
        figure.savefig(path, dpi=100)
    return figure


# ---------------------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------------------


def parse_arguments(argv=None):
    """(TrainConfig, resume) from the command line: one option per TrainConfig field, with its default and help."""
    parser = argparse.ArgumentParser(prog="python -m gpt2_cupy.train", description=__doc__.split("\n")[0],
                                     epilog="A size or schedule left at None takes the preset's value.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for config_field in fields(TrainConfig):
        metadata, name = config_field.metadata, config_field.name
        flag = metadata["flag"] or "--" + name.replace("_", "-")
        if config_field.type is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=config_field.default,
                                help=metadata["help"])
        else:
            parser.add_argument(flag, dest=name, type=config_field.type, default=config_field.default,
                                choices=metadata["choices"], help=metadata["help"])
    parser.add_argument("--resume", action="store_true", help="continue from <out-dir>/checkpoint.npz")
    parser.add_argument("--nproc", type=int,
                        help="train on this many GPUs of this machine, one process each (gpt2_cupy.launch)")
    arguments = vars(parser.parse_args(argv))
    resume = arguments.pop("resume")
    arguments.pop("nproc")  # main() starts the ranks
    return make_config(**arguments), resume


def launch_ranks(argv):
    """With --nproc N (and not already a rank): start N ranks of this command; None when there is none to start."""
    nproc_parser = argparse.ArgumentParser(add_help=False)
    nproc_parser.add_argument("--nproc", type=int)
    known, rank_argv = nproc_parser.parse_known_args(argv)
    if known.nproc is None or "WORLD_SIZE" in os.environ:
        return None
    gpus = backend.device_count()
    if known.nproc > gpus:   # one GPU per rank: refused before any rank starts, not after each one fails
        where = f"this machine has {gpus}" if gpus else "this machine has none (the kernels run on the CPU executor)"
        print(f"error: --nproc {known.nproc} trains on {known.nproc} GPUs, one process each, through NCCL; {where}. "
              "Train without --nproc, or on the CPU try gpt2_cupy.distributed.run_simulated", file=sys.stderr)
        return 1
    try:
        launch.launch([sys.executable, "-m", "gpt2_cupy.train", *rank_argv], known.nproc)
    except (launch.ChildFailedError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    launched = launch_ranks(argv)
    if launched is not None:
        return launched
    config, resume = parse_arguments(argv)
    if "WORLD_SIZE" in os.environ:  # a rank of --nproc or of torchrun
        distributed.init_process_group("nccl")
    try:
        trainer = Trainer(config, resume=resume)
        if trainer.is_main:
            print(f"{backend.device_name()}: {trainer.model.get_num_params() / 1e6:.2f}M parameters, "
                  f"{trainer.tokens_per_step} tokens per "
                  f"step on {trainer.world_size} rank(s), writing {trainer.out_dir}/", file=sys.stderr)
        trainer.run()
    except (TrainingDiverged, ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        distributed.destroy_process_group()
    if not trainer.is_main:
        return 0
    evaluations = [(r["step"], r["val_loss"]) for r in read_log(trainer.log_path) if "val_loss" in r]
    step, val_loss = evaluations[-1]
    best_step, best_loss = min(evaluations, key=lambda evaluation: evaluation[1])
    print(f"step {trainer.step}: validation loss {val_loss:.4f} at step {step}, lowest {best_loss:.4f} at step "
          f"{best_step}; checkpoints {trainer.checkpoint_path} (last) and {trainer.best_path} (lowest), "
          f"log {trainer.log_path}, plot {trainer.plot_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
