"""Data parallelism without several GPUs: N simulated ranks (gpt2_cupy.distributed.run_simulated) against one
process with N times the batch; the collectives against float64 numpy; buckets, ZeRO-1's shards, the
launcher's failures, bad input."""

import os
import signal
import subprocess
import sys
import time
from functools import lru_cache

import numpy as np
import pytest

from gpt2_cupy import backend, distributed
from gpt2_cupy import train as training
from gpt2_cupy.autograd import Context
from gpt2_cupy.checkout import REPOSITORY
from gpt2_cupy.random import manual_seed
from gpt2_cupy.launch import ChildFailedError, launch
from gpt2_cupy.model import GPT, GPTConfig
from gpt2_cupy.nn.parallel import BucketTimeline, DistributedDataParallel, make_buckets
from gpt2_cupy.train import Trainer, make_config
from gpt2_cupy.zero import ZeroRedundancyOptimizer, shard_optimizer

# Smaller than the tiny preset: a step takes a fraction of a second on the CPU executor.
SMALL = dict(corpus="tinyshakespeare", preset="tiny", n_layer=1, n_head=2, n_embd=32, block_size=16, max_steps=3,
             warmup_steps=1, eval_interval=3, eval_batches=1, checkpoint_interval=3, progress=False)
ROWS = 2  # rows per rank: even, so that numpy draws N·ROWS window starts as it draws N times ROWS
xp = backend.xp
RTOL = 1e-5  # float32 rounding, grown through three AdamW steps (whose m/√v divides small numbers)
# AdamW moves a parameter by about the learning rate whatever its gradient's size: for a gradient near ε, the
# rounding of a sum taken in another order (N ranks' averages against one process's sum) changes m/(√v + ε) by
# a visible fraction. The parameters must agree within 1 % of the steps' largest possible move.
PARAMETER_ATOL = 0.01 * SMALL["max_steps"] * make_config(**SMALL).learning_rate


def as_numpy(array):
    return np.asarray(backend.asnumpy(array), dtype=np.float64)


def losses(records):
    return np.array([r.get("loss", r.get("val_loss")) for r in records])


def gradient_norms(records):
    return np.array([r["grad_norm"] for r in records if "grad_norm" in r])


@lru_cache(maxsize=None)
def one_process(out_dir, batch_size, grad_accum):
    """Losses, gradient norms and flat parameters of one process (the reference), cached across the tests."""
    trainer = Trainer(make_config(**SMALL, batch_size=batch_size, grad_accum=grad_accum, out_dir=out_dir))
    records = trainer.run()
    return losses(records), gradient_norms(records), as_numpy(trainer.optimizer.flat_params)


def simulated_run(world_size, out_dir, zero=False, grad_accum=1, stop_after=None, **options):
    """(each rank's log records, each rank's flat parameters) of a run on world_size simulated ranks."""
    def rank_main(rank):
        trainer = Trainer(make_config(**{**SMALL, **options}, batch_size=ROWS, grad_accum=grad_accum, zero=zero,
                                      out_dir=out_dir))
        return trainer.run(stop_after=stop_after), as_numpy(trainer.optimizer.flat_params)
    return zip(*distributed.run_simulated(world_size, rank_main))


# ---- the collectives -----------------------------------------------------------------------------------------

def test_collectives_match_float64_numpy():
    N, n = 3, 40
    inputs = [np.random.default_rng(rank).standard_normal(N * n).astype(np.float32) for rank in range(N)]
    total = np.sum([x.astype(np.float64) for x in inputs], axis=0)

    def rank_main(rank):
        mine = xp.asarray(inputs[rank])
        summed, averaged, scattered = mine.copy(), mine.copy(), mine.copy()
        distributed.all_reduce(summed)
        distributed.all_reduce(averaged, op=distributed.ReduceOp.AVG)
        distributed.reduce_scatter_tensor(scattered[rank * n:(rank + 1) * n], scattered)  # in place, as ZeRO does
        gathered = xp.zeros(N * n, np.float32)
        gathered[rank * n:(rank + 1) * n] = mine[:n]
        distributed.all_gather_into_tensor(gathered, gathered[rank * n:(rank + 1) * n])
        pieces = [xp.zeros(n, np.float32) for _ in range(N)]
        distributed.all_gather(pieces, mine[:n])
        received = mine[:n].copy()
        distributed.broadcast(received, src=1)
        return [as_numpy(a) for a in (summed, averaged, scattered[rank * n:(rank + 1) * n], gathered,
                                      xp.concatenate(pieces), received)]

    for rank, (summed, averaged, scattered, gathered, pieces, received) in enumerate(distributed.run_simulated(N, rank_main)):
        np.testing.assert_allclose(summed, total, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(averaged, total / N, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(scattered, total[rank * n:(rank + 1) * n], rtol=1e-6, atol=1e-6)
        expected_gather = np.concatenate([x[:n] for x in inputs])
        np.testing.assert_array_equal(gathered, expected_gather)
        np.testing.assert_array_equal(pieces, expected_gather)
        np.testing.assert_array_equal(received, inputs[1][:n])


def test_the_simulated_sum_is_taken_in_rank_order():
    # 1e8 + 1 - 1e8 in float32 is 0 taken left to right, 1 taken in another order: rank order is the contract
    values = [np.float32(1e8), np.float32(1.0), np.float32(-1e8)]

    def rank_main(rank):
        array = xp.asarray(np.array([values[rank]], dtype=np.float32))
        distributed.all_reduce(array)
        return float(as_numpy(array)[0])

    assert distributed.run_simulated(3, rank_main) == [0.0, 0.0, 0.0]


# ---- N ranks against one process -----------------------------------------------------------------------------

@pytest.mark.parametrize("world_size, zero", [(2, False), (3, False), (2, True), (3, True)],
                         ids=["2-ranks", "3-ranks", "2-ranks-zero", "3-ranks-zero"])
def test_n_ranks_take_the_steps_of_one_process_with_n_times_the_batch(tmp_path_factory, world_size, zero):
    # two micro-batches per step: the gradients add up locally (no_sync) and are averaged once
    records, parameters = simulated_run(world_size, str(tmp_path_factory.mktemp("ranks")), zero=zero, grad_accum=2)
    expected_losses, expected_norms, expected_parameters = one_process(str(tmp_path_factory.mktemp("one")),
                                                                       world_size * ROWS, 2)
    for rank in range(world_size):
        np.testing.assert_allclose(losses(records[rank]), expected_losses, rtol=RTOL)
        # AdamW does not see a constant factor in the gradients; the norm before clipping does
        np.testing.assert_allclose(gradient_norms(records[rank]), expected_norms, rtol=RTOL)
        np.testing.assert_allclose(parameters[rank][:expected_parameters.size], expected_parameters, rtol=0,
                                   atol=PARAMETER_ATOL)
        np.testing.assert_array_equal(parameters[rank], parameters[0])  # every rank holds the same model


@pytest.mark.parametrize("world_size, zero", [(2, False), (3, True)], ids=["2-ranks", "3-ranks-zero"])
def test_with_dropout_n_ranks_draw_the_masks_of_one_process_rows(tmp_path_factory, world_size, zero):
    """Dropout 0.1 in the residual stream and the attention weights: rank r's B rows must draw the random numbers
    of rows rB to (r+1)B - 1 of one process's N·B rows, so that N ranks take one process's steps."""
    options = dict(dropout=0.1, max_steps=2, eval_interval=2, checkpoint_interval=2)
    records, _ = simulated_run(world_size, str(tmp_path_factory.mktemp("ranks")), zero=zero, **options)
    expected = Trainer(make_config(**{**SMALL, **options}, batch_size=world_size * ROWS,
                                   out_dir=str(tmp_path_factory.mktemp("one")))).run()
    for rank in range(world_size):
        np.testing.assert_allclose(losses(records[rank]), losses(expected), rtol=RTOL)
        np.testing.assert_allclose(gradient_norms(records[rank]), gradient_norms(expected), rtol=RTOL)
    assert gradient_norms(expected).size == 2  # two training steps were compared


def test_n_ranks_equal_one_process_accumulating_n_micro_batches(tmp_path_factory):
    records, parameters = simulated_run(2, str(tmp_path_factory.mktemp("ranks")))
    expected_losses, _, expected_parameters = one_process(str(tmp_path_factory.mktemp("one")), ROWS, 2)
    training_steps = slice(1, -1)  # the first and last records are evaluations, of 2·ROWS rows here and ROWS there
    np.testing.assert_allclose(losses(records[0])[training_steps], expected_losses[training_steps], rtol=RTOL)
    np.testing.assert_allclose(parameters[0], expected_parameters, rtol=0, atol=PARAMETER_ATOL)


def test_a_checkpoint_of_rank_0_resumes_with_another_number_of_ranks(tmp_path):
    options = dict(max_steps=4, eval_interval=2, checkpoint_interval=2)
    whole, _ = simulated_run(2, str(tmp_path / "whole"), **options)
    first, _ = simulated_run(2, str(tmp_path / "parts"), zero=True, stop_after=2, **options)  # sharded state
    config = make_config(**{**SMALL, **options}, batch_size=2 * ROWS, out_dir=str(tmp_path / "parts"))
    second = Trainer(config, resume=True).run()  # one process, the same global batch
    np.testing.assert_allclose(losses(first[0] + second), losses(whole[0]), rtol=RTOL)
    logged = training.read_log(tmp_path / "parts" / "log.jsonl")  # written once, by rank 0
    assert [r["step"] for r in logged] == [r["step"] for r in whole[0]]


# ---- buckets -------------------------------------------------------------------------------------------------

def small_model():
    manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32, dropout=0.0))
    return model, model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))


def test_buckets_cover_every_gradient_exactly_once():
    model, optimizer = small_model()
    packed = [(p, where) for p, where, _, _ in optimizer._packed]
    cap_bytes = 20_000
    order = list(reversed(list(model.parameters())))
    buckets = make_buckets(packed, order, cap_bytes)
    assert len(buckets) > 3
    covered = np.zeros(optimizer.flat_grads.size, dtype=int)
    for bucket in buckets:
        for start, stop in bucket.runs:
            covered[start:stop] += 1
        for p in bucket.parameters:
            where = next(w for q, w in packed if q is p)
            assert any(start <= where.start and where.stop <= stop for start, stop in bucket.runs)
    for _, where in packed:
        assert (covered[where] == 1).all()
    assert (covered <= 1).all()
    assert [id(p) for b in buckets for p in b.parameters] == [id(p) for p in order]  # in the order given
    assert all(b.elements * 4 >= cap_bytes for b in buckets[:-1])
    last_layer = {id(p) for name, p in model.named_parameters() if name.startswith("transformer.h.1.")}
    assert {id(p) for p in buckets[0].parameters} <= last_layer | {id(p) for p in model.transformer.ln_f.parameters()}


def backward_timeline(monkeypatch, model_options, cap_mb, steps=1):
    """One rank's backwards under DistributedDataParallel: for each step, the number of Nodes whose backward
    had run when each bucket's first all-reduce was issued, and the number of Nodes in the backward."""
    nodes_done, issued = [0], []
    original_free_saved, original_all_reduce = Context.free_saved, distributed.all_reduce

    def counting_free_saved(ctx):
        nodes_done[0] += 1
        original_free_saved(ctx)

    def recording_all_reduce(array, *arguments, **options):
        issued.append((nodes_done[0], array.data.ptr if hasattr(array, "data") and hasattr(array.data, "ptr")
                       else array.__array_interface__["data"][0]))
        return original_all_reduce(array, *arguments, **options)

    monkeypatch.setattr(Context, "free_saved", counting_free_saved)
    monkeypatch.setattr(distributed, "all_reduce", recording_all_reduce)
    batch = xp.asarray(np.random.default_rng(0).integers(0, 64, size=(2, 17)).astype(np.int32))

    def rank_main(rank):
        manual_seed(0)
        model = GPT(GPTConfig(block_size=16, vocab_size=64, n_head=2, n_embd=32, dropout=0.0, **model_options))
        model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
        ddp = DistributedDataParallel(model, bucket_cap_mb=cap_mb)
        timeline = []
        for _ in range(steps):
            nodes_done[0], issued[:] = 0, []
            _, loss = ddp(batch[:, :-1], batch[:, 1:])
            loss.backward()
            firsts = {}
            for bucket in ddp.reducer.buckets:  # the node count when the bucket's first run was issued
                first_run = bucket.runs[0][0]
                firsts[len(firsts)] = next(done for done, pointer in issued
                                           if pointer == address_of(ddp.module, first_run))
            timeline.append((list(firsts.values()), nodes_done[0]))
        return timeline

    return distributed.run_simulated(1, rank_main)[0]


def address_of(model, element):
    optimizer = next(p for p in model.parameters())._grad_slot.owner
    flat = optimizer.flat_grads[element:]
    return flat.data.ptr if hasattr(flat.data, "ptr") else flat.__array_interface__["data"][0]


def test_the_first_bucket_is_reduced_while_the_backward_is_in_its_first_half(monkeypatch):
    """The overlap data parallelism is for: the first bucket (the last layer's gradients) is all-reduced while
    the backward still has the earlier layers to go, and each later bucket after the one before it."""
    for (issued, nodes), step in zip(backward_timeline(monkeypatch, dict(n_layer=4), cap_mb=0.02, steps=2), (1, 2)):
        assert len(issued) > 3, step
        assert issued[0] < nodes / 2, f"step {step}: the first bucket waited for {issued[0]} of {nodes} Nodes"
        assert issued == sorted(issued)
        assert issued[-2] < nodes, f"step {step}: all but the last bucket are reduced before the backward ends"


def test_buckets_follow_the_order_gradients_arrive_in_after_the_first_backward():
    """The tied embedding (transformer.wte, also the output head) is the first parameter registered, so the
    reverse of the registration order guesses it arrives last, which it does: the embedding's backward adds
    the last contribution. The position embedding also arrives at the very end. The recorded order is what
    rank 0's backward saw, and the buckets made after the first backward follow it."""
    def rank_main(rank):
        model, optimizer = small_model()
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.02)
        batch = xp.asarray(np.random.default_rng(rank).integers(0, 64, size=(2, 17)).astype(np.int32))
        for _ in range(2):
            _, loss = ddp(batch[:, :-1], batch[:, 1:])
            loss.backward()
        names = {id(p): name for name, p in model.named_parameters()}
        return ([names[id(p)] for p in ddp.reducer.arrival_order],
                [[names[id(p)] for p in bucket.parameters] for bucket in ddp.reducer.buckets])

    (order, buckets), (order_1, buckets_1) = distributed.run_simulated(2, rank_main)
    assert order == order_1 and buckets == buckets_1  # rank 0's order on every rank
    assert sorted(order) == sorted(name for name, _ in small_model()[0].named_parameters())
    assert set(order[-2:]) == {"transformer.wte.weight", "transformer.wpe.weight"}
    assert order.index("transformer.h.1.mlp.c_proj.weight") < order.index("transformer.h.0.mlp.c_proj.weight")
    assert [name for bucket in buckets for name in bucket] == order


def test_the_bucket_timeline_shows_the_first_bucket_complete_in_the_backward_s_first_half():
    """BucketTimeline on two simulated ranks, 4 layers, small buckets: on rank 1, the last to arrive at every
    all-reduce, a bucket completes as it is issued, so the first bucket's all-reduce is complete before half the
    backward has run (it would not be if the first bucket waited for the first layer's gradients); on
    every rank each bucket completes after its issue and before the backward returns."""
    def rank_main(rank):
        manual_seed(0)
        model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=4, n_head=2, n_embd=32, dropout=0.0))
        model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.02)
        batch = xp.asarray(np.random.default_rng(rank).integers(0, 64, size=(2, 17)).astype(np.int32))
        timelines = []
        for _ in range(2):
            _, loss = ddp(batch[:, :-1], batch[:, 1:])
            ddp.reducer.timeline = timeline = BucketTimeline()
            timeline.start()
            loss.backward()
            timeline.end()
            timelines.append((timeline.milliseconds(), len(ddp.reducer.buckets)))
        return timelines

    for rank, timelines in enumerate(distributed.run_simulated(2, rank_main)):
        for times, buckets in timelines:
            issued, complete = np.array(times["issued"]), np.array(times["complete"])
            assert len(issued) == len(complete) == buckets > 3
            assert np.all(np.diff(issued) >= 0) and np.all(issued <= complete) and np.all(complete <= times["end"])
            if rank == 1:  # its backward never waits for another rank: its clock is its own backward's
                assert complete[0] < times["end"] / 2, f"the first bucket completed at {complete[0]:.2f} ms of a " \
                                                       f"{times['end']:.2f} ms backward"
    with pytest.raises(RuntimeError, match="call start"):
        distributed.run_simulated(1, lambda rank: BucketTimeline().milliseconds())


def test_module_buffers_are_broadcast_from_rank_0():
    def rank_main(rank):
        model, optimizer = small_model()
        model.register_buffer("counts", xp.full(3, rank + 1, dtype=np.int64))
        DistributedDataParallel(model, bucket_cap_mb=0.02)
        return backend.asnumpy(model.counts.data).tolist()

    assert distributed.run_simulated(2, rank_main) == [[1, 1, 1], [1, 1, 1]]


def test_buckets_are_all_reduced_during_the_backward_and_averaged(monkeypatch):
    """Two ranks, small buckets: the averaged gradients against float64 numpy's mean of each rank's alone,
    and the first bucket's all-reduce launched before the backward's last Node ran."""
    batches = [xp.asarray(np.random.default_rng(rank).integers(0, 64, size=(2, 17)).astype(np.int32))
               for rank in range(2)]

    def gradients_of(rank):
        model, optimizer = small_model()
        _, loss = model(batches[rank][:, :-1], batches[rank][:, 1:])
        loss.backward()
        return as_numpy(optimizer.flat_grads)

    expected = (gradients_of(0) + gradients_of(1)) / 2
    nodes_done, launched_after = [0], []
    original_free_saved, original_all_reduce = Context.free_saved, distributed.all_reduce

    def counting_free_saved(ctx):
        nodes_done[0] += 1
        original_free_saved(ctx)

    def recording_all_reduce(*arguments, **options):
        launched_after.append(nodes_done[0])
        return original_all_reduce(*arguments, **options)

    monkeypatch.setattr(Context, "free_saved", counting_free_saved)
    monkeypatch.setattr(distributed, "all_reduce", recording_all_reduce)

    def rank_main(rank):
        model, optimizer = small_model()
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.02)
        _, loss = ddp(batches[rank][:, :-1], batches[rank][:, 1:])
        loss.backward()
        return as_numpy(optimizer.flat_grads), sum(len(b.runs) for b in ddp.reducer.buckets), nodes_done[0]

    results = distributed.run_simulated(2, rank_main)
    for gradients, _, _ in results:
        np.testing.assert_allclose(gradients, expected, rtol=1e-5, atol=1e-7)
    runs, nodes_of_both_backwards = results[0][1], results[1][2]
    assert runs > 3 and len(launched_after) == 2 * runs  # one all-reduce for each run of each bucket
    assert launched_after[0] < nodes_of_both_backwards / 2 - 1  # rank 0's first bucket: mid-backward


# ---- ZeRO-1 --------------------------------------------------------------------------------------------------

def test_zero_shards_cover_the_flat_buffer_and_hold_a_third_of_the_state():
    N = 3

    def rank_main(rank):
        model, adamw = small_model()
        whole_state = sum(buffer.nbytes for buffer in adamw.state.values())
        optimizer = shard_optimizer(adamw)
        assert isinstance(optimizer, ZeroRedundancyOptimizer)
        return optimizer.shard, optimizer.flat_params.size, optimizer.packed_length, whole_state, \
            sum(buffer.nbytes for buffer in optimizer.state.values())

    results = distributed.run_simulated(N, rank_main)
    shards = sorted(shard for shard, *_ in results)
    padded, packed = results[0][1], results[0][2]
    assert shards[0].start == 0 and shards[-1].stop == padded
    assert all(a.stop == b.start for a, b in zip(shards, shards[1:]))  # no gap, no overlap
    assert packed <= padded < packed + N * 16
    whole_state, shard_state = results[0][3], results[0][4]
    step_bytes = 4  # the int32 step count, kept whole on every rank
    assert shard_state - step_bytes == pytest.approx((whole_state - step_bytes) * (padded / packed) / N)


# ---- failures and bad input ----------------------------------------------------------------------------------

def test_a_failing_rank_is_named_and_the_others_do_not_hang():
    def rank_main(rank):
        if rank == 2:
            raise ValueError("out of memory, say")
        distributed.barrier()  # would wait forever for rank 2

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 2 failed: ValueError: out of memory, say"):
        distributed.run_simulated(3, rank_main)
    assert time.monotonic() - started < 5


def test_the_launcher_stops_every_rank_when_one_fails():
    code = "import os, sys, time; sys.exit(3) if os.environ['RANK'] == '1' else time.sleep(60)"
    started = time.monotonic()
    with pytest.raises(ChildFailedError, match="rank 1 exited with code 3") as failure:
        launch([sys.executable, "-c", code], 3)
    assert failure.value.rank == 1 and time.monotonic() - started < 20  # the sleeping ranks were stopped


def test_ctrl_c_in_the_launcher_stops_every_rank(tmp_path):
    rank_code = ("import os, pathlib, time; pathlib.Path(os.environ['PIDS'], os.environ['RANK']).write_text(str(os.getpid())); "
                 "time.sleep(60)")
    launcher_code = f"import sys; from gpt2_cupy.launch import launch; launch([sys.executable, '-c', {rank_code!r}], 2)"
    launcher = subprocess.Popen([sys.executable, "-c", launcher_code], env={**os.environ, "PIDS": str(tmp_path)},
                                stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len([path for path in tmp_path.iterdir() if path.read_text()]) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = [int(path.read_text()) for path in tmp_path.iterdir()]
    assert len(pids) == 2
    launcher.send_signal(signal.SIGINT)
    assert launcher.wait(timeout=60) != 0 and "KeyboardInterrupt" in launcher.stderr.read()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_the_cli_refuses_more_ranks_than_gpus_before_starting_any(tmp_path):
    gpus = backend.xp.cuda.runtime.getDeviceCount() if backend.name == "cuda" else 0
    result = subprocess.run([sys.executable, "-m", "gpt2_cupy.train", "--nproc", str(gpus + 1), "--out-dir",
                             str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert f"error: --nproc {gpus + 1} trains on {gpus + 1} GPUs" in result.stderr
    assert "error: rank " not in result.stderr and not any(tmp_path.iterdir())   # no rank was started


def test_bad_input_gives_clear_errors():
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        distributed.run_simulated(0, lambda rank: None)
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        distributed.init_process_group("nccl", world_size=0, rank=0)
    with pytest.raises(RuntimeError, match="rank 0 failed: TypeError: all_reduce: expected a Tensor or a"):
        distributed.run_simulated(1, lambda rank: distributed.all_reduce([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"rank must be in \[0, 1\] for world_size 2, got 2"):
        distributed.init_process_group(backend="nccl", world_size=2, rank=2)
    with pytest.raises(ValueError, match="backend 'gloo' is not supported"):
        distributed.init_process_group("gloo", world_size=1, rank=0)
    with pytest.raises(ValueError, match="nproc must be a positive int"):
        launch([sys.executable, "-c", "pass"], 0)
    with pytest.raises(RuntimeError, match="init_process_group"):
        DistributedDataParallel(small_model()[0])
    with pytest.raises(ValueError, match="zero=True shards the optimizer"):
        Trainer(make_config(**SMALL, batch_size=ROWS, zero=True, out_dir="unused"))

    def rank_main(rank):
        with pytest.raises(ValueError, match="world_size \\(2\\) times the slice"):
            distributed.reduce_scatter_tensor(xp.zeros(3, np.float32), xp.zeros(7, np.float32))
        with pytest.raises(TypeError, match="dtype int8 is not supported"):
            distributed.all_reduce(xp.zeros(3, np.int8))
        with pytest.raises(RuntimeError, match="create one optimizer"):
            DistributedDataParallel(GPT(GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=1, n_embd=8)))(
                xp.zeros((1, 8), np.int32))

    distributed.run_simulated(2, rank_main)


@pytest.mark.skipif(backend.name != "cuda", reason="NCCL needs a GPU")
def test_nccl_with_one_rank_matches_the_plain_run(tmp_path):
    """The real NCCL path at world size 1: collectives are identities (or copies), and a run through
    DistributedDataParallel and ZeRO-1 takes the plain run's steps."""
    expected_losses, expected_norms, expected_parameters = one_process(str(tmp_path / "one"), ROWS, 1)
    distributed.init_process_group("nccl", world_size=1, rank=0)
    try:
        values = xp.asarray(np.arange(8, dtype=np.float32))
        distributed.all_reduce(values, op=distributed.ReduceOp.AVG)
        shard = xp.zeros(8, np.float32)
        distributed.reduce_scatter_tensor(shard, values)
        distributed.all_gather_into_tensor(values, shard)
        distributed.broadcast(values, src=0)
        distributed.barrier()
        np.testing.assert_array_equal(as_numpy(values), np.arange(8))
        for zero in (False, True):
            trainer = Trainer(make_config(**SMALL, batch_size=ROWS, zero=zero, out_dir=str(tmp_path / f"nccl{zero}")))
            records = trainer.run()
            np.testing.assert_allclose(losses(records), expected_losses, rtol=RTOL)
            np.testing.assert_allclose(gradient_norms(records), expected_norms, rtol=RTOL)
            flat = as_numpy(trainer.optimizer.flat_params)[:expected_parameters.size]
            np.testing.assert_allclose(flat, expected_parameters, rtol=0, atol=PARAMETER_ATOL)
    finally:
        distributed.destroy_process_group()


def test_the_scaling_bench_runs_its_tiny_path_on_simulated_ranks():
    """bench/data_parallel_scaling.py --tiny: the four runs and the timeline through the bench's own code, on
    simulated ranks (the GPU run launches NCCL ranks instead): N ranks' losses equal one process's with N
    micro-batches, and every bucket completes after it is issued. A process of its own, as a learner runs it
    (and its rank threads' executor memory goes with it)."""
    command = [sys.executable, "-m", "bench.data_parallel_scaling", "--tiny", "--nproc", "2"]
    printed = subprocess.run(command, check=True, capture_output=True, text=True, cwd=REPOSITORY).stdout
    assert printed.count("tokens/s") == 4
    difference = float(printed.split("largest difference ")[1].split()[0])
    assert difference < 1e-4  # float32 rounding of losses near ln 2048 ≈ 7.6
    zero_fraction = float(printed.split(" of it (1/N")[0].split()[-1])
    assert abs(zero_fraction - 1 / 2) < 0.01  # ZeRO-1 keeps half of AdamW's state on each of 2 ranks, padding apart
    buckets = [line for line in printed.splitlines() if line.strip().startswith("bucket ")]
    assert len(buckets) > 2
    for line in buckets:
        issued, complete = float(line.split("issued")[1].split(",")[0]), float(line.split("complete")[1])
        assert issued <= complete
    help_text = subprocess.run([sys.executable, "-m", "bench.data_parallel_scaling", "--help"], check=True,
                               capture_output=True, text=True, cwd=REPOSITORY).stdout
    assert "--tiny" in help_text and "--nproc" in help_text
