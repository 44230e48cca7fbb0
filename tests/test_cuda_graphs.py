"""gpt2_cupy.graphs: capture and replay on either backend, what capture forbids, and training with graphs,
bit for bit the same as launch by launch."""

import re

import numpy as np
import pytest

import gpt2_cupy
from gpt2_cupy import backend, graphs
from gpt2_cupy import train as training
from gpt2_cupy.autograd import Tensor
from gpt2_cupy.random import dropout_rng_state, manual_seed
from gpt2_cupy.nn import functional as F
from gpt2_cupy.ops.gelu import gelu_forward
from gpt2_cupy.ops.residual import residual_forward
from tests import references

N = 1000  # not a multiple of any block size


def gelu_tanh(x):
    """GELU's tanh form in float64: the reference."""
    return references.gelu(x.astype(np.float64), "tanh")


# ---- the capture API -------------------------------------------------------------------------------------


def test_capture_runs_nothing_and_every_replay_runs_the_kernels_on_the_captured_buffers(rng, to_device, to_host):
    x, y, total = (to_device(np.zeros(N, np.float32)) for _ in range(3))
    g = gpt2_cupy.cuda.CUDAGraph()
    with gpt2_cupy.cuda.graph(g):
        gelu_forward(x, out=y)
        residual_forward(total, y, out=total)  # total += y: a second replay adds again
    assert not to_host(y).any() and not to_host(total).any()  # recorded, not run
    expected_total = np.zeros(N, np.float32)
    for values in rng.standard_normal((3, N)).astype(np.float32):
        backend.copy_into(x, to_device(values))
        g.replay()
        replayed = to_host(y)
        np.testing.assert_allclose(replayed, gelu_tanh(values), rtol=1e-5, atol=1e-6)
        assert np.array_equal(replayed, to_host(gelu_forward(to_device(values))))  # the eager launch's bits
        expected_total += replayed  # float32 additions, in the kernel's order
        assert np.array_equal(to_host(total), expected_total)


def test_fill_zero_and_copy_into_are_recorded_and_run_at_each_replay(rng, to_device, to_host):
    source, destination = (to_device(rng.standard_normal(N).astype(np.float32)) for _ in range(2))
    zeroed = to_device(np.ones(N, np.float32))
    before = to_host(destination).copy()
    g = gpt2_cupy.cuda.CUDAGraph()
    with gpt2_cupy.cuda.graph(g):
        backend.copy_into(destination, source)
        backend.fill_zero(zeroed)
    assert np.array_equal(to_host(destination), before) and (to_host(zeroed) == 1).all()
    for _ in range(2):
        values = rng.standard_normal(N).astype(np.float32)
        backend.copy_into(source, to_device(values))
        backend.copy_into(zeroed, to_device(np.ones(N, np.float32)))
        g.replay()
        assert np.array_equal(to_host(destination), values) and not to_host(zeroed).any()


def test_array_functions_of_backend_xp_run_again_at_each_replay(rng, to_device, to_host):
    # On a GPU, CuPy's functions launch kernels that the capture records; the CPU's recording runs numpy's
    # again. New zeros each replay: a kernel that adds into them must not see the last replay's sum.
    a, b = (to_device(np.zeros(N, np.float32)) for _ in range(2))

    def step():
        joined = backend.xp.concatenate([a, b])
        summed = backend.xp.zeros(N, dtype=np.float32)
        residual_forward(summed, a, out=summed)
        return joined, summed

    pool = graphs.graph_pool_handle()
    with graphs.use_pool(pool):
        step()
    g = gpt2_cupy.cuda.CUDAGraph()
    with gpt2_cupy.cuda.graph(g, pool=pool):
        joined, summed = step()
    for _ in range(2):
        values = rng.standard_normal((2, N)).astype(np.float32)
        backend.copy_into(a, to_device(values[0]))
        backend.copy_into(b, to_device(values[1]))
        g.replay()
        assert np.array_equal(to_host(joined), values.reshape(-1))
        assert np.array_equal(to_host(summed), values[0])


def test_a_write_into_out_is_recorded_not_run_at_capture(to_device, to_host):
    # A capture runs nothing on a GPU; on the CPU, an array function writing into out= is recorded and not
    # run either, so the counter keeps its warm-up value until the first replay, then steps once per replay.
    counter = to_device(np.zeros(2, np.int32))
    pool = graphs.graph_pool_handle()
    with graphs.use_pool(pool):
        backend.xp.add(counter, 1, out=counter)   # the warm-up runs
    g = gpt2_cupy.cuda.CUDAGraph()
    with gpt2_cupy.cuda.graph(g, pool=pool):
        backend.xp.add(counter, 1, out=counter)
    assert to_host(counter).tolist() == [1, 1]
    for expected in (2, 3):
        g.replay()
        assert to_host(counter).tolist() == [expected, expected]


def test_copy_into_refuses_another_shape_or_dtype(to_device):
    with pytest.raises(ValueError, match=r"copy_into: dst is float32 \(3,\), src float64 \(3,\)"):
        backend.copy_into(to_device(np.zeros(3, np.float32)), np.zeros(3))
    with pytest.raises(ValueError, match=r"src float32 \(4,\)"):
        backend.copy_into(to_device(np.zeros(3, np.float32)), np.zeros(4, np.float32))


HOST_COPIES = {
    "backend.asnumpy": lambda t: backend.asnumpy(t._data),
    ".item()": lambda t: t.item(),
    "float()": float,
    ".tolist()": lambda t: t.tolist(),
    "print": repr,
    "backend.synchronize()": lambda t: backend.synchronize(),
}


@pytest.mark.parametrize("call", HOST_COPIES, ids=list(HOST_COPIES))
def test_a_host_copy_inside_capture_raises_naming_the_call_and_leaves_no_capture_behind(call, to_device, to_host):
    values = Tensor(to_device(np.ones(1, np.float32)))
    g = gpt2_cupy.cuda.CUDAGraph()
    named = "backend.synchronize()" if call == "backend.synchronize()" else "backend.asnumpy"
    with pytest.raises(RuntimeError, match=rf"{re.escape(named)}.*inside CUDA graph capture: capture forbids host "
                                           "copies"):
        with gpt2_cupy.cuda.graph(g):
            HOST_COPIES[call](values)
    with pytest.raises(RuntimeError, match="nothing captured"):
        g.replay()
    assert not graphs.is_current_stream_capturing()
    assert backend.xp.__name__ == ("cupy" if backend.name == "cuda" else "numpy")
    with gpt2_cupy.cuda.graph(g):  # a capture works again afterwards
        residual_forward(values._data, values._data, out=values._data)
    g.replay()
    assert to_host(values._data)[0] == 2.0


@pytest.mark.skipif(backend.name != "cuda", reason="on the CPU executor int() of an array reads host memory: "
                                                   "it runs once, at capture")
def test_cupys_own_host_read_inside_capture_is_named(to_device):
    values = to_device(np.ones(4, np.float32))
    with pytest.raises(RuntimeError, match="capture forbids host copies"):
        with gpt2_cupy.cuda.graph(gpt2_cupy.cuda.CUDAGraph()):
            int(values[0])


def test_new_memory_inside_capture_raises_with_its_size_unless_the_warm_up_made_it(rng, to_device, to_host):
    with pytest.raises(RuntimeError, match=r"new memory inside CUDA graph capture: 4000 bytes .*use_pool"):
        with gpt2_cupy.cuda.graph(gpt2_cupy.cuda.CUDAGraph()):
            backend.xp.zeros(N, dtype=np.float32)
    x = to_device(rng.standard_normal(N).astype(np.float32))
    pool = graphs.graph_pool_handle()
    with graphs.use_pool(pool):
        gelu_forward(x)  # the warm-up: its output's block stays in the pool, free again
    g = gpt2_cupy.cuda.CUDAGraph()
    with gpt2_cupy.cuda.graph(g, pool=pool):
        y = gelu_forward(x)  # a new array, from the warm-up's block
    values = rng.standard_normal(N).astype(np.float32)
    backend.copy_into(x, to_device(values))
    g.replay()
    assert np.array_equal(to_host(y), to_host(gelu_forward(to_device(values))))
    assert g.pool() is pool


def test_dropout_draws_new_numbers_at_every_replay_as_successive_eager_calls_do(to_device, to_host):
    x = Tensor(to_device(np.ones(N, np.float32)))
    manual_seed(7)
    eager = [to_host(F.dropout(x, 0.5)._data) for _ in range(3)]
    pool = graphs.graph_pool_handle()
    with graphs.use_pool(pool):
        F.dropout(x, 0.5)
    manual_seed(7)  # the warm-up drew numbers: start again from offset 0
    g = gpt2_cupy.cuda.CUDAGraph()
    with gpt2_cupy.cuda.graph(g, pool=pool):
        y = F.dropout(x, 0.5)
    assert to_host(dropout_rng_state())[1] == 0  # the capture drew nothing
    replayed = []
    for replay in range(3):
        g.replay()
        replayed.append(to_host(y._data).copy())
        assert to_host(dropout_rng_state())[1] == (replay + 1) * N  # the offset advances on the device
    for mask in replayed:
        assert set(np.unique(mask)) == {0.0, 2.0}  # dropped, or kept and scaled by 1 / (1 - p)
        assert 0.4 < (mask != 0).mean() < 0.6
    assert not np.array_equal(replayed[0], replayed[1]) and not np.array_equal(replayed[1], replayed[2])
    assert all(np.array_equal(a, b) for a, b in zip(replayed, eager))


def test_what_the_api_refuses(to_device):
    g = gpt2_cupy.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="nothing captured"):
        g.replay()
    with pytest.raises(ValueError, match="capture_error_mode='loose'"):
        with gpt2_cupy.cuda.graph(g, capture_error_mode="loose"):
            pass
    with pytest.raises(TypeError, match="pool must come from graph_pool_handle"):
        with gpt2_cupy.cuda.graph(g, pool=object()):
            pass
    with pytest.raises(RuntimeError, match="captures do not nest"):
        with gpt2_cupy.cuda.graph(g):
            with gpt2_cupy.cuda.graph(gpt2_cupy.cuda.CUDAGraph()):
                pass
    values = to_device(np.ones(4, np.float32))
    with gpt2_cupy.cuda.graph(g):
        backend.fill_zero(values)
    with pytest.raises(RuntimeError, match="call reset"):
        with gpt2_cupy.cuda.graph(g):
            pass
    g.reset()
    with pytest.raises(RuntimeError, match="nothing captured"):
        g.replay()


# ---- training with graphs --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A directory of random token files (ids below 50): the tiny preset trains on it in seconds."""
    from gpt2_cupy.data import write_tokens

    directory = tmp_path_factory.mktemp("corpus")
    generator = np.random.default_rng(28)
    write_tokens(directory / "train.bin", generator.integers(0, 50, 20000))
    write_tokens(directory / "val.bin", generator.integers(0, 50, 2000))
    return directory


# The tiny preset's two layers and two heads, narrower and shorter, so that a run takes a few seconds here.
SMALLER = dict(n_embd=32, block_size=32, batch_size=4)


def tiny_run(corpus, tmp_path, name, cuda_graph, changes_after=None, **options):
    """Train the tiny preset (SMALLER) for 4 steps; (log records, dropout offset after each step, final state).

    changes_after: (step, function(trainer)) to change the trainer between two steps.
    """
    config = training.make_config(**{**dict(corpus=str(corpus), preset="tiny", **SMALLER, max_steps=4,
                                            eval_interval=2, eval_batches=2, checkpoint_interval=4, progress=False),
                                     **options, "out_dir": str(tmp_path / name), "cuda_graph": cuda_graph})
    trainer = training.Trainer(config)
    offsets, step = [], trainer.train_step

    def step_and_note_the_dropout_offset():
        if changes_after is not None and trainer.step == changes_after[0]:
            changes_after[1](trainer)
        result = step()
        offsets.append(int(backend.asnumpy(dropout_rng_state())[1]))
        return result

    trainer.train_step = step_and_note_the_dropout_offset
    records = trainer.run()
    optimizer = trainer.optimizer
    state = {"params": optimizer.flat_params, "step": optimizer.state["step"],
             **{name: optimizer.state[name] for name in ("exp_avg", "exp_avg_sq")}}
    return records, offsets, {name: backend.asnumpy(array).copy() for name, array in state.items()}


class ReplayCounter:
    def __init__(self, monkeypatch):
        self.count = 0
        replay = graphs.CUDAGraph.replay

        def counted(graph):
            self.count += 1
            return replay(graph)

        monkeypatch.setattr(graphs.CUDAGraph, "replay", counted)


def assert_same_training(graphed, eager):
    (records, offsets, state), (eager_records, eager_offsets, eager_state) = graphed, eager
    keys = ("step", "loss", "grad_norm", "lr", "val_loss")
    assert [[r.get(k) for k in keys] for r in records] == [[r.get(k) for k in keys] for r in eager_records]
    assert offsets == eager_offsets
    for name, values in eager_state.items():
        assert np.array_equal(state[name], values), name


def test_the_tiny_preset_trains_with_graphs_bit_for_bit_as_without(corpus, tmp_path, monkeypatch):
    # Dropout on and two micro-batches per step: the masks must differ from step to step and match eager's.
    options = dict(dropout=0.1, grad_accum=2)
    eager = tiny_run(corpus, tmp_path, "eager", False, **options)
    replays = ReplayCounter(monkeypatch)
    graphed = tiny_run(corpus, tmp_path, "graphed", True, **options)
    assert_same_training(graphed, eager)
    offsets = graphed[1]
    assert all(later > earlier for earlier, later in zip([0] + offsets, offsets))  # new numbers every step
    # The first step and the first evaluation run eagerly (the warm-up), the rest replay: 3 steps of two
    # micro-steps, a clip and an update; 2 evaluations of 2 batches.
    assert replays.count == 3 * (2 + 1 + 1) + 2 * 2


def test_a_change_the_graphs_depend_on_captures_them_again(corpus, tmp_path, monkeypatch):
    # After two steps: higher dropout, no clipping, two micro-batches. A replay of the old graphs would
    # drop with the old probability and clip; the losses would differ from eager's.
    def change(trainer):
        for module in trainer.model.modules():
            if isinstance(module, gpt2_cupy.nn.Dropout):
                module.p = 0.3
        trainer.config.grad_clip = 0.0
        trainer.config.grad_accum = 2

    options = dict(dropout=0.1, changes_after=(2, change))
    eager = tiny_run(corpus, tmp_path, "eager", False, **options)
    captures = []
    capture_training = training.TrainingGraphs.capture_training
    monkeypatch.setattr(training.TrainingGraphs, "capture_training",
                        lambda self: captures.append(self.trainer.step) or capture_training(self))
    graphed = tiny_run(corpus, tmp_path, "graphed", True, **options)
    assert_same_training(graphed, eager)
    assert captures == [1, 3]  # after the first step, and after the step run eagerly past the change
    assert [r["grad_norm"] for r in graphed[0] if "loss" in r][2:] == [0.0, 0.0]  # unclipped: no norm taken
