"""AdamW's bf16 working copy (bf16_working_copy=True): bf16 of every master, written by the update kernel.

The reference for the copy is ml_dtypes' rounding of the float32 master in numpy (round to nearest even).
A model trained with the copy must give the same losses, bit for bit, as one that converts its weights
before every forward; and a parameter changed outside the optimizer must be read at its new value.
"""

import ml_dtypes
import numpy as np
import pytest

import gpt2_cupy as torch
from gpt2_cupy import amp, backend, optim
from gpt2_cupy.model import GPT, GPTConfig
from gpt2_cupy.ops import adamw as kernels_of
from gpt2_cupy.train import Trainer, make_config

BF16 = np.dtype(ml_dtypes.bfloat16)
TINY = GPTConfig(block_size=16, vocab_size=96, n_layer=2, n_head=2, n_embd=32)
xp = backend.xp


def host(array):
    backend.synchronize()
    return np.asarray(backend.asnumpy(array))


def as_bf16_bits(array):
    """The bits of an array of bf16 values, to compare two of them exactly (NaN included)."""
    return host(array).astype(BF16).view(np.uint16)


class Parameter:
    def __init__(self, values):
        self.data, self.grad = xp.asarray(values), None


def test_the_copy_is_bf16_of_every_master_after_each_step(rng):
    """Two groups, parameters of sizes that are not multiples of 16, one without a gradient (skipped, so its
    master is put back), values spread over many binades: after each step, every element of every copy is
    ml_dtypes' bf16 of the float32 master, bit for bit."""
    shapes = [(7, 5), (33,), (3, 4, 2), (9,)]
    parameters = [Parameter((rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 3, shape)).astype(np.float32))
                  for shape in shapes]
    optimizer = optim.AdamW([{"params": parameters[:2], "weight_decay": 0.1},
                             {"params": parameters[2:], "weight_decay": 0.0}], lr=0.05, bf16_working_copy=True)
    assert optimizer.flat_params_bf16.dtype == BF16 and optimizer.flat_params_bf16.size == optimizer.flat_params.size
    for step in range(3):
        for p in parameters[:3]:   # the last one gets no gradient: the step leaves it as it is
            p.grad = xp.asarray(rng.standard_normal(p.data.shape).astype(np.float32))
        before = host(parameters[3].data).copy()
        optimizer.step()
        for p in parameters:
            expected = host(p.data).astype(BF16).view(np.uint16)
            np.testing.assert_array_equal(host(p._working_copy.array).view(np.uint16), expected)
            assert p._working_copy.equals_bf16_of(p.data)
        np.testing.assert_array_equal(host(parameters[3].data), before)


def test_the_update_with_a_copy_moves_the_masters_as_without_one(rng):
    """The same masters and moments from the kernel with and without the bf16 output (n = 64, one group)."""
    n = 64
    start = rng.standard_normal(n).astype(np.float32)
    grads = xp.asarray(rng.standard_normal(n).astype(np.float32))
    hyperparameters = xp.asarray(np.array([[1e-2, 0.9, 0.95, 1e-8, 0.1]]))
    group_ends = xp.asarray(np.array([n], dtype=np.int32))
    results = []
    for copy in (None, xp.zeros(n, dtype=BF16)):
        params, m, v = xp.asarray(start.copy()), xp.zeros(n, np.float32), xp.zeros(n, np.float32)
        step, scalars = xp.zeros(1, np.int32), xp.zeros((1, 2), np.float32)
        kernels_of.adamw_prepare_step(scalars, step, hyperparameters)
        kernels_of.adamw_update(params, m, v, grads, hyperparameters, scalars, group_ends, params_bf16=copy)
        results.append((host(params).copy(), host(m).copy(), host(v).copy()))
        if copy is not None:
            np.testing.assert_array_equal(host(copy).view(np.uint16), host(params).astype(BF16).view(np.uint16))
    for without, with_copy in zip(*results):
        np.testing.assert_array_equal(without, with_copy)


def test_a_wrong_copy_buffer_is_refused():
    n = 16
    buffers = [xp.zeros(n, np.float32) for _ in range(4)]
    hyperparameters = xp.zeros((1, kernels_of.HYPERPARAMETERS))
    scalars, group_ends = xp.zeros((1, 2), np.float32), xp.asarray(np.array([n], dtype=np.int32))
    with pytest.raises(TypeError, match="params_bf16"):
        kernels_of.adamw_update(*buffers, hyperparameters, scalars, group_ends, params_bf16=xp.zeros(n, np.float32))
    with pytest.raises(ValueError, match="params_bf16"):
        kernels_of.adamw_update(*buffers, hyperparameters, scalars, group_ends, params_bf16=xp.zeros(n + 4, BF16))


def _tiny_model_and_optimizer(bf16_working_copy):
    torch.manual_seed(0)
    model = GPT(TINY)
    optimizer = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95))
    if bf16_working_copy:
        optimizer.keep_bf16_working_copy()
    return model, optimizer


def _eager_bf16_losses(bf16_working_copy, batches):
    model, optimizer = _tiny_model_and_optimizer(bf16_working_copy)
    losses = []
    for idx, targets in batches:
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            _, loss = model(idx, targets)
        loss.backward()
        optimizer.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(host(loss.data).item())
    return losses


def test_eager_bf16_training_gives_the_same_losses_with_the_copy(rng):
    batches = [(xp.asarray(rng.integers(0, TINY.vocab_size, (2, 16))),
                xp.asarray(rng.integers(0, TINY.vocab_size, (2, 16)))) for _ in range(4)]
    with_copy = _eager_bf16_losses(True, batches)
    assert with_copy == _eager_bf16_losses(False, batches)
    assert len(set(with_copy)) == len(with_copy)   # the weights moved: each step's loss is another


@pytest.mark.parametrize("cuda_graph", [True, False], ids=["graphs", "eager"])
def test_the_trainer_in_bf16_gives_the_same_losses_with_the_copy(tmp_path, monkeypatch, cuda_graph):
    """--dtype bf16 turns the copy on; with the trainer's CUDA graphs the replayed forward reads the copy that
    the replayed AdamW wrote. Four steps and an evaluation: bit for bit the losses of the trainer that
    converts its weights before every forward."""
    options = dict(corpus="tinyshakespeare", preset="tiny", n_layer=1, n_head=2, n_embd=32, block_size=16,
                   batch_size=2, max_steps=4, warmup_steps=1, eval_interval=4, eval_batches=1,
                   checkpoint_interval=100, progress=False, dtype="bf16", cuda_graph=cuda_graph)

    def records(name):
        trainer = Trainer(make_config(**options, out_dir=str(tmp_path / name)))
        return trainer, [(r.get("loss"), r.get("val_loss")) for r in trainer.run()]

    trainer, with_copy = records("copy")
    assert trainer.optimizer.bf16_working_copy
    monkeypatch.setattr(optim.AdamW, "keep_bf16_working_copy", lambda optimizer: None)
    trainer, without = records("converted")
    assert not getattr(trainer.optimizer, "bf16_working_copy", False)
    assert with_copy == without


def _changed(kind, model, optimizer, parameter, values):
    """Change `parameter` to `values` outside the optimizer, one way of those a user has."""
    if kind == "copy_":
        with torch.no_grad():
            parameter.copy_(torch.Tensor(xp.asarray(values)))
    elif kind == "setitem":
        with torch.no_grad():
            parameter[...] = torch.Tensor(xp.asarray(values))
    elif kind == "add_":
        with torch.no_grad():
            parameter.add_(torch.Tensor(xp.asarray(values - host(parameter.data))))
    elif kind == "load_state_dict":
        state = {name: host(p.data).copy() for name, p in model.named_parameters(remove_duplicate=False)}
        name = next(name for name, p in model.named_parameters() if p is parameter)
        state[name] = values
        model.load_state_dict(state)
    elif kind == "data_replaced":
        parameter.data = torch.Tensor(xp.asarray(values))
    elif kind == "optimizer_load_state_dict":   # a resume: the masters loaded first (raw), then the optimizer
        backend.copy_into(parameter._data, xp.asarray(values))
        optimizer.load_state_dict(optimizer.state_dict())
    elif kind == "init":
        torch.nn.init.normal_(parameter, mean=0.5, std=0.01)
        values[...] = host(parameter.data)


@pytest.mark.parametrize("kind", ["copy_", "setitem", "add_", "load_state_dict", "data_replaced",
                                  "optimizer_load_state_dict", "init"])
def test_a_parameter_changed_outside_the_optimizer_is_read_at_its_new_value(rng, kind):
    """After a step the copy is valid; then the first Linear's weight changes another way. The next autocast
    forward must read bf16 of the new weight: its logits equal those of a model without a copy holding
    the same weights (with the copy used regardless, they would be the old weight's)."""
    idx = xp.asarray(rng.integers(0, TINY.vocab_size, (2, 16)))
    model, optimizer = _tiny_model_and_optimizer(True)
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
        _, loss = model(idx, idx)
    loss.backward()
    optimizer.step()
    weight = model.transformer.h[0].attn.c_attn.weight
    assert weight._working_copy.equals_bf16_of(weight._data)
    values = (host(weight.data) + 0.25).astype(np.float32)
    _changed(kind, model, optimizer, weight, values)
    np.testing.assert_array_equal(host(weight.data), values)
    assert not weight._working_copy.equals_bf16_of(weight._data)
    np.testing.assert_array_equal(as_bf16_bits(amp.product_input(weight)), values.astype(BF16).view(np.uint16))

    reference, _ = _tiny_model_and_optimizer(False)
    reference.load_state_dict({name: host(p.data) for name, p in model.named_parameters(remove_duplicate=False)})
    with torch.no_grad(), torch.autocast(device_type="cuda", dtype=torch.bfloat16):
        logits, _ = model(idx)
        expected, _ = reference(idx)
    np.testing.assert_array_equal(as_bf16_bits(logits.data), as_bf16_bits(expected.data))
    # the next step writes the copy again, and the products read it
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
        _, loss = model(idx, idx)
    loss.backward()
    optimizer.step()
    assert amp.product_input(weight) is weight._working_copy.array


def test_before_the_first_step_the_products_convert(rng):
    model, optimizer = _tiny_model_and_optimizer(True)
    weight = model.transformer.h[0].mlp.c_fc.weight
    assert not weight._working_copy.equals_bf16_of(weight._data)
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
        converted = amp.product_input(weight)
    assert converted is not weight._working_copy.array
    np.testing.assert_array_equal(as_bf16_bits(converted), host(weight.data).astype(BF16).view(np.uint16))
