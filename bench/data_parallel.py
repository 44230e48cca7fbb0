"""The data-parallel path on one GPU (chapter 18's benchmark): what NCCL, the buckets and ZeRO-1 cost at N = 1.

    python -m bench.data_parallel [--steps 12]

GPT-2 124M (the gpt2 preset), B = 8, T = 1024, float32, on tinyshakespeare, trained by gpt2_cupy.train:

    plain, CUDA graphs   the one-GPU trainer as it runs by default
    plain, eager         the same launch by launch (a distributed step runs eagerly)
    NCCL, DDP            a process group of one rank: DistributedDataParallel's bucketed all-reduces
    NCCL, DDP + ZeRO-1   the same with the optimizer's state sharded (over one rank: reduce-scatter,
                         all-gather and the norm's all-reduce, all of the whole buffer)

Tokens/s from the median step time after two warm-up steps, and the time of one all-reduce of the whole
gradient buffer (at N = 1 NCCL copies it). Measured scaling over several GPUs needs a machine with
several; this is what one GPU can say. Writes bench/data_parallel.json.
"""

import argparse
import gc
import tempfile
import time

import numpy as np

from gpt2_cupy import backend, benchmark, distributed
from gpt2_cupy.train import Trainer, make_config

B, T = 8, 1024


def tokens_per_second(steps, cuda_graph=True, zero=False):
    config = make_config(corpus="tinyshakespeare", preset="gpt2", batch_size=B, block_size=T, max_steps=10 ** 6,
                         cuda_graph=cuda_graph, zero=zero, progress=False,
                         out_dir=tempfile.mkdtemp(prefix="bench-data-parallel-"))
    trainer = Trainer(config)
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        trainer.train_step()  # returns host floats: the step has finished on the GPU
        seconds.append(time.perf_counter() - started)
    state_bytes = sum(buffer.nbytes for buffer in trainer.optimizer.state.values())
    gradients = trainer.optimizer.flat_grads
    del trainer
    gc.collect()
    return B * T / float(np.median(seconds[2:])), state_bytes, gradients


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    arguments = parser.parse_args(argv)
    benchmark.require_gpu()
    from cupy.cuda import nccl

    rows, state = {}, {}
    rows["plain, CUDA graphs"], state["plain"], _ = tokens_per_second(arguments.steps)
    rows["plain, eager"], _, _ = tokens_per_second(arguments.steps, cuda_graph=False)
    distributed.init_process_group("nccl", world_size=1, rank=0)
    try:
        rows["NCCL, DDP"], _, gradients = tokens_per_second(arguments.steps)
        rows["NCCL, DDP + ZeRO-1"], state["ZeRO-1, N = 1"], _ = tokens_per_second(arguments.steps, zero=True)
        all_reduce_ms = 1e3 * benchmark.seconds_per_call(
            lambda: distributed.all_reduce(gradients, op=distributed.ReduceOp.AVG))
    finally:
        distributed.destroy_process_group()
    results = dict(model="gpt2 preset (124M), float32", batch_size=B, block_size=T, world_size=1,
                   nccl_version=nccl.get_version(), tokens_per_second=rows, optimizer_state_bytes=state,
                   gradient_bytes=int(gradients.nbytes), all_reduce_ms=all_reduce_ms)
    table = [f"{name:22} {value:>10,.0f} tokens/s" for name, value in rows.items()]
    table.append(f"one all-reduce of {gradients.nbytes / 1e6:.0f} MB of gradients at N = 1: {all_reduce_ms:.2f} ms")
    benchmark.report("data_parallel", results, table)


if __name__ == "__main__":
    main()
