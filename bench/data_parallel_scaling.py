"""Training on several GPUs of one machine through NCCL, against one GPU: throughput, equality, and when each
gradient bucket's all-reduce runs against the backward.

    python -m bench.data_parallel_scaling --nproc 2 [--steps 40]   on a machine with that many GPUs;
                                                                   writes bench/data_parallel_scaling.json
    python -m bench.data_parallel_scaling --tiny                   anywhere (the CPU executor too): the same
                                                                   code on simulated ranks and a tiny model;
                                                                   measures nothing, writes nothing

GPT-2 124M (12 layers, 768 channels, T = 1024, its vocabulary padded to 50,304: 124,475,904 parameters) on
tinyshakespeare, B = 8 rows per GPU, activations in bf16 (--dtype float32 for float32). Each run is a fresh
`python -m gpt2_cupy.train`, whose log.jsonl gives every step's tokens/s and loss:

    one GPU                      the plain trainer, its step captured as CUDA graphs
    N GPUs                       --nproc N: every rank a B-row share of each step, gradients averaged by NCCL
                                 in buckets during the backward (the trainer runs a distributed step launch by
                                 launch: its NCCL calls are not captured in graphs)
    one GPU, N micro-batches     --grad-accum N: the same N·B rows a step as N GPUs take, on one GPU
    N GPUs, ZeRO-1               --nproc N --zero: AdamW's state sharded over the ranks

Tokens/s: the median over the steps after the first five (compiling, capturing). Scaling: N GPUs' tokens/s
against N times one GPU's. Equality: each step's loss on N GPUs against one GPU with N micro-batches, which
compute the same sums in another order (rounding apart).

The timeline: N ranks started by the launcher (this script again, with --timeline-rank) each train the same
model a few steps through DistributedDataParallel and record, for the last step, when each bucket's
all-reduce is issued and when it completes, in milliseconds from the backward's start, from CUDA events
(nn.parallel.BucketTimeline); rank 0's is stored, with the bytes of AdamW's state a rank keeps, and under
ZeRO-1 (which should be 1/N of it, padding apart). chapters/18_data_parallel.ipynb shows the stored results.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy

from gpt2_cupy import backend, benchmark, distributed
from gpt2_cupy.amp import BFLOAT16, autocast
from gpt2_cupy.random import manual_seed
from gpt2_cupy.launch import launch
from gpt2_cupy.model import GPT, GPTConfig
from gpt2_cupy.nn.parallel import BucketTimeline, DistributedDataParallel
from gpt2_cupy.train import Trainer, make_config
from gpt2_cupy.zero import shard_optimizer

B, T, VOCAB_SIZE = 8, 1024, 50_304
WARM_STEPS = 5
TIMELINE_STEPS = 4  # the last one is recorded: the buckets follow the arrival order, the kernels are compiled
GPT2 = dict(n_layer=12, n_head=12, n_embd=768, block_size=T, vocab_size=VOCAB_SIZE)
# --tiny: a model and run that take seconds on the CPU executor
TINY = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
TINY_TRAINING = dict(corpus="tinyshakespeare", preset="tiny", n_layer=2, n_head=2, n_embd=32, block_size=16,
                     batch_size=2, max_steps=WARM_STEPS + 2, warmup_steps=1, eval_interval=1_000_000,
                     checkpoint_interval=1_000_000, progress=False)


def train(out_dir, steps, dtype, *options):
    """The per-step records of one `python -m gpt2_cupy.train` run into out_dir."""
    command = [sys.executable, "-m", "gpt2_cupy.train", "--corpus", "tinyshakespeare", "--preset", "gpt2",
               "--vocab-size", str(VOCAB_SIZE), "--dtype", dtype, "--batch-size", str(B), "--block-size", str(T),
               "--steps", str(steps), "--eval-interval", "1000000", "--checkpoint-interval", "1000000",
               "--no-progress", "--seed", "7", "--out-dir", str(out_dir), *options]
    subprocess.run(command, check=True)
    lines = (out_dir / "log.jsonl").read_text().splitlines()
    return training_records(map(json.loads, lines))


def training_records(records):
    return [record for record in records if "loss" in record and "val_loss" not in record]


def runs_of(N):
    """{name: options of the train command} of the four runs the scaling compares."""
    return {"one GPU": (), f"{N} GPUs": ("--nproc", str(N)), f"one GPU, {N} micro-batches": ("--grad-accum", str(N)),
            f"{N} GPUs, ZeRO-1": ("--nproc", str(N), "--zero")}


def tiny_runs(N, dtype):
    """The four runs of runs_of(N) in this process, on simulated ranks, with a tiny model: their records."""
    records = {}
    for name, options in runs_of(N).items():
        nproc = int(options[options.index("--nproc") + 1]) if "--nproc" in options else None
        grad_accum = int(options[options.index("--grad-accum") + 1]) if "--grad-accum" in options else 1
        with tempfile.TemporaryDirectory(prefix="bench-data-parallel-") as directory:
            config = make_config(**TINY_TRAINING, dtype=dtype, grad_accum=grad_accum, zero="--zero" in options,
                                 out_dir=directory)
            if nproc is None:
                records[name] = training_records(Trainer(config).run())
            else:
                records[name] = training_records(distributed.run_simulated(nproc, lambda rank: Trainer(config).run())[0])
    return records


def compare(records, N):
    """Tokens/s, the scaling and the loss differences of the four runs' records."""
    speeds = {name: statistics.median(r["tokens_per_second"] for r in rows[WARM_STEPS:])
              for name, rows in records.items()}
    together, accumulated = records[f"{N} GPUs"], records[f"one GPU, {N} micro-batches"]
    differences = [abs(a["loss"] - b["loss"]) for a, b in zip(together, accumulated)]
    return dict(tokens_per_second=speeds, scaling=speeds[f"{N} GPUs"] / (N * speeds["one GPU"]),
                losses={name: [r["loss"] for r in rows] for name, rows in records.items()},
                largest_loss_difference=max(differences),
                largest_relative_loss_difference=max(d / abs(b["loss"]) for d, b in zip(differences, accumulated)))


def bucket_timeline(model_config, rows, dtype, steps=TIMELINE_STEPS):
    """This rank's timeline of the last of `steps` training steps through DistributedDataParallel (inside a
    process group, NCCL or simulated), with the model's parameter count and the buckets' sizes in bytes."""
    manual_seed(0)
    model = GPT(GPTConfig(dropout=0.0, **model_config))
    optimizer = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95))
    tiny = model_config["n_embd"] < 128
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.02 if tiny else None)  # a tiny model: buckets of 20 kB
    generator = numpy.random.default_rng(distributed.get_rank())
    tokens = generator.integers(0, model_config["vocab_size"], size=(rows, model_config["block_size"] + 1))
    batch = backend.xp.asarray(tokens.astype(numpy.int32))
    with autocast(device_type="cuda", dtype=BFLOAT16 if dtype == "bf16" else None):
        for step in range(steps):
            _, loss = ddp(batch[:, :-1], batch[:, 1:])
            if step == steps - 1:
                ddp.reducer.timeline = timeline = BucketTimeline()
                timeline.start()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    timeline.end()
    times = timeline.milliseconds()
    times["bucket_bytes"] = [4 * bucket.elements for bucket in ddp.reducer.buckets]
    times["parameters"] = sum(p.numel() for p in model.parameters())
    times["world_size"] = distributed.get_world_size()
    times["adamw_state_bytes"] = state_bytes(optimizer)
    times["zero_state_bytes_per_rank"] = state_bytes(shard_optimizer(
        GPT(GPTConfig(dropout=0.0, **model_config)).configure_optimizers(0.1, 6e-4, (0.9, 0.95))))
    return times


def state_bytes(optimizer):
    """The bytes of AdamW's state this rank keeps: m and v (of its shard, under ZeRO-1), and the step count."""
    return sum(buffer.nbytes for buffer in optimizer.state.values())


def timeline_table(times):
    lines = [f"AdamW's state: {times['adamw_state_bytes'] / 1e6:.2f} MB a rank; under ZeRO-1 "
             f"{times['zero_state_bytes_per_rank'] / 1e6:.2f} MB, "
             f"{times['zero_state_bytes_per_rank'] / times['adamw_state_bytes']:.3f} of it "
             f"(1/N = {1 / times['world_size']:.3f})",
             f"buckets ({len(times['issued'])}), milliseconds from the backward's start (it ends at "
             f"{times['end']:.2f} ms, after waiting for every all-reduce):"]
    for number, (issued, complete, size) in enumerate(zip(times["issued"], times["complete"], times["bucket_bytes"])):
        lines.append(f"  bucket {number:2}: {size / 1e6:7.2f} MB, issued {issued:8.2f}, complete {complete:8.2f}")
    return lines


def timeline_rank(path, dtype):
    """One rank of the launched timeline run: rank 0 writes the timeline to path."""
    distributed.init_process_group("nccl")
    try:
        times = bucket_timeline(GPT2, B, dtype)
        if distributed.get_rank() == 0:
            Path(path).write_text(json.dumps(times))
    finally:
        distributed.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--dtype", choices=("bf16", "float32"), default="bf16")
    parser.add_argument("--tiny", action="store_true", help="simulated ranks and a tiny model: checks the code, "
                                                            "measures nothing, writes nothing")
    parser.add_argument("--timeline-rank", metavar="PATH", help=argparse.SUPPRESS)  # a rank the launcher started
    arguments = parser.parse_args(argv)
    N, dtype = arguments.nproc, arguments.dtype
    if arguments.timeline_rank:
        timeline_rank(arguments.timeline_rank, dtype)
        return
    if arguments.tiny:
        results = compare(tiny_runs(N, dtype), N)
        times = distributed.run_simulated(N, lambda rank: bucket_timeline(TINY, 2, dtype))[0]
        for line in [f"{name:28} {speed:>10,.0f} tokens/s" for name, speed in results["tokens_per_second"].items()]:
            print(line)
        print(f"loss on {N} simulated ranks against one process with {N} micro-batches: largest difference "
              f"{results['largest_loss_difference']:.1e}")
        print("\n".join(timeline_table(times)))
        print("(--tiny: simulated ranks on this machine; nothing measured, nothing written)")
        return
    benchmark.require_gpu()
    gpus = backend.xp.cuda.runtime.getDeviceCount()
    if gpus < N:
        raise SystemExit(f"--nproc {N} needs as many GPUs; this machine has {gpus}")
    records = {}
    with tempfile.TemporaryDirectory(prefix="bench-data-parallel-") as directory:
        for number, (name, options) in enumerate(runs_of(N).items()):
            records[name] = train(Path(directory) / str(number), arguments.steps, dtype, *options)
        timeline_path = Path(directory) / "timeline.json"
        launch([sys.executable, "-m", "bench.data_parallel_scaling", "--timeline-rank", str(timeline_path),
                "--dtype", dtype, "--nproc", str(N)], N)
        times = json.loads(timeline_path.read_text())
    results = dict(model=f"GPT-2 124M ({times['parameters']:,} parameters, vocabulary {VOCAB_SIZE:,}) on "
                         f"tinyshakespeare, {dtype}", parameters=times["parameters"], vocab_size=VOCAB_SIZE,
                   dtype=dtype, batch_size_per_gpu=B, block_size=T, nproc=N, steps=arguments.steps,
                   cuda_graphs={name: "--nproc" not in options for name, options in runs_of(N).items()},
                   gpus=[backend.xp.cuda.runtime.getDeviceProperties(i)["name"].decode() for i in range(N)],
                   **compare(records, N), timeline=times)
    table = [f"{name:28} {speed:>10,.0f} tokens/s" for name, speed in results["tokens_per_second"].items()]
    table.append(f"{N} GPUs against {N} x one GPU: {results['scaling']:.2f}")
    table.append(f"loss on {N} GPUs against one GPU with {N} micro-batches, {arguments.steps} steps: largest "
                 f"difference {results['largest_loss_difference']:.1e} (relative "
                 f"{results['largest_relative_loss_difference']:.1e})")
    table.extend(timeline_table(times))
    benchmark.report("data_parallel_scaling", results, table)


if __name__ == "__main__":
    main()
