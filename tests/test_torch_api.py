"""The names PyTorch code uses: `import gpt2_cupy as torch`, `import gpt2_cupy.nn as nn`, F.

Module's tree (apply, children, buffers, repr, to), the small layers (GELU, ReLU, SiLU, Identity,
Sequential, ModuleList slices) against float64 numpy and finite differences, nn.init's distributions,
nn.utils.clip_grad_norm_ against numpy, and torch.save/torch.load, which refuses by default a file that
would run code when unpickled.
"""

import math
import os
import pickle
from collections import OrderedDict

import numpy as np
import pytest

import gpt2_cupy as torch
import gpt2_cupy.nn as nn
from gpt2_cupy import backend
from gpt2_cupy.testing import finite_difference_gradient, relative_error

TOLERANCE = 1e-5


def check_activation(module, reference, rng, to_device, to_host):
    """module(x) against reference(x) in float64, and its gradient against central differences."""
    x64 = rng.normal(size=(3, 17)) * 2
    dout = rng.normal(size=x64.shape)
    x = torch.Tensor(to_device(x64.astype(np.float32)), requires_grad=True)
    y = module(x)
    assert relative_error(to_host(y._data), reference(x64)) < TOLERANCE
    y.backward(to_device(dout.astype(np.float32)))
    numeric = finite_difference_gradient(lambda: np.sum(dout * reference(x64)), x64)
    assert relative_error(to_host(x.grad), numeric) < 1e-4


def test_gelu_relu_silu_identity_modules(rng, to_device, to_host):
    erf = np.vectorize(math.erf)
    check_activation(nn.GELU(), lambda x: 0.5 * x * (1 + erf(x / math.sqrt(2))), rng, to_device, to_host)
    check_activation(nn.GELU(approximate="tanh"),
                     lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))),
                     rng, to_device, to_host)
    check_activation(nn.ReLU(), lambda x: np.maximum(x, 0), rng, to_device, to_host)
    check_activation(nn.SiLU(), lambda x: x / (1 + np.exp(-x)), rng, to_device, to_host)
    x = torch.Tensor(to_device(np.ones(3, np.float32)))
    assert nn.Identity(54, unused="argument")(x) is x


def test_sequential_runs_its_modules_in_order(rng, to_device, to_host):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2))
    x64 = rng.normal(size=(4, 5))
    w1, b1, w2, b2 = (to_host(p._data).astype(np.float64) for p in model.parameters())
    expected = np.maximum(x64 @ w1.T + b1, 0) @ w2.T + b2
    y = model(torch.Tensor(to_device(x64.astype(np.float32))))
    assert relative_error(to_host(y._data), expected) < TOLERANCE
    assert [name for name, _ in model.named_parameters()] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert len(model) == 3 and isinstance(model[1], nn.ReLU) and len(model[1:]) == 2
    named = nn.Sequential(OrderedDict(fc=nn.Linear(5, 8), act=nn.GELU()))
    assert [name for name, _ in named.named_children()] == ["fc", "act"]


def test_module_tree_apply_children_buffers_and_repr(to_device, to_host):
    class Block(nn.Module):
        def __init__(self):
            self.fc = nn.Linear(4, 4, bias=False)
            self.norm = nn.LayerNorm(4)
            self.register_buffer("mask", to_device(np.tril(np.ones((3, 3), np.float32))))
            self.register_buffer("scratch", to_device(np.zeros(2, np.float32)), persistent=False)

    model = nn.ModuleDict(dict(blocks=nn.ModuleList([Block(), Block()]), drop=nn.Dropout(0.1)))
    assert [name for name, _ in model.named_children()] == ["blocks", "drop"]
    assert len(list(model.modules())) == 9                   # itself, the list, 2 × (block, fc, norm), drop
    visited = []
    model.apply(lambda module: visited.append(type(module).__name__))
    assert visited[-1] == "ModuleDict" and visited.count("Linear") == 2
    zeroed = model.apply(lambda m: nn.init.zeros_(m.fc.weight) if isinstance(m, Block) else None)
    assert zeroed is model and not to_host(model.blocks[0].fc.weight._data).any()
    assert "blocks.0.mask" in model.state_dict() and "blocks.0.scratch" not in model.state_dict()
    assert all("mask" not in name for name, _ in model.named_parameters())
    assert np.array_equal(to_host(model.blocks[1].mask._data), np.tril(np.ones((3, 3))))
    assert model.to("cuda") is model and model.to(torch.float32) is model
    with pytest.raises(NotImplementedError, match="ModuleDict.to: dtype float16 is not supported yet"):
        model.to(torch.float16)
    assert repr(model) == """ModuleDict(
  (blocks): ModuleList(
    (0): Block(
      (fc): Linear(in_features=4, out_features=4, bias=False)
      (norm): LayerNorm((4,), eps=1e-05, elementwise_affine=True)
    )
    (1): Block(
      (fc): Linear(in_features=4, out_features=4, bias=False)
      (norm): LayerNorm((4,), eps=1e-05, elementwise_affine=True)
    )
  )
  (drop): Dropout(p=0.1, inplace=False)
)"""


def test_module_list_slices_and_parameter_of_a_tensor(to_device, to_host):
    layers = nn.ModuleList([nn.Linear(2, 2) for _ in range(4)])
    tail = layers[1:3]
    assert isinstance(tail, nn.ModuleList) and len(tail) == 2 and tail[0] is layers[1] and layers[-1] is layers[3]
    layers.append(nn.Identity())
    assert len(layers) == 5
    values = torch.Tensor(to_device(np.arange(6, dtype=np.float32).reshape(2, 3)))
    parameter = nn.Parameter(values)
    assert parameter.requires_grad and parameter._data is values._data   # shares the tensor's array


def test_load_state_dict_takes_tensors_or_arrays(rng, to_device, to_host):
    layer = nn.Linear(3, 2)
    weight, bias = rng.normal(size=(2, 3)).astype(np.float32), rng.normal(size=2).astype(np.float32)
    layer.load_state_dict({"weight": torch.Tensor(to_device(weight)), "bias": to_device(bias)})
    assert np.array_equal(to_host(layer.weight._data), weight) and np.array_equal(to_host(layer.bias._data), bias)
    layer.load_state_dict({"weight": weight * 2, "bias": bias})  # numpy arrays on either backend
    assert np.array_equal(to_host(layer.weight._data), weight * 2)


def test_init_functions_draw_the_stated_distributions(to_host):
    torch.manual_seed(0)
    weight = nn.Parameter(np.zeros((300, 200), np.float32))
    values = to_host(nn.init.normal_(weight, mean=1.0, std=0.5)._data)
    assert abs(values.mean() - 1.0) < 0.01 and abs(values.std() - 0.5) < 0.01   # 60 000 draws
    values = to_host(nn.init.uniform_(weight, -2.0, 3.0)._data)
    assert values.min() >= -2.0 and values.max() < 3.0 and abs(values.mean() - 0.5) < 0.03
    bound = math.sqrt(6 / (200 + 300))
    values = to_host(nn.init.xavier_uniform_(weight)._data)
    assert np.abs(values).max() <= bound and np.abs(values).max() > 0.99 * bound
    assert not to_host(nn.init.zeros_(weight)._data).any() and (to_host(nn.init.ones_(weight)._data) == 1).all()
    torch.manual_seed(5)
    first = to_host(nn.init.normal_(weight)._data).copy()
    torch.manual_seed(5)
    assert np.array_equal(to_host(nn.init.normal_(weight)._data), first)


def test_clip_grad_norm_returns_the_norm_as_a_new_tensor(rng, to_device, to_host):
    layers = [nn.Linear(7, 5), nn.Linear(5, 3)]
    parameters = [p for layer in layers for p in layer.parameters()]
    gradients = [rng.normal(size=p.shape).astype(np.float32) for p in parameters]
    expected = math.sqrt(sum((g.astype(np.float64) ** 2).sum() for g in gradients))
    for fused in (False, True):
        if fused:  # the parameters are exactly one optimizer's: its two kernels over the flat buffer
            torch.optim.AdamW(parameters)
        for p, g in zip(parameters, gradients):
            p.grad = to_device(g)
        norm = nn.utils.clip_grad_norm_(parameters, 1.0)
        again = nn.utils.clip_grad_norm_(parameters, 1.0)
        assert isinstance(norm, torch.Tensor) and norm is not again
        assert relative_error(to_host(norm._data), expected) < TOLERANCE      # kept: not overwritten by again
        assert abs(to_host(again._data) - 1.0) < 1e-5
        for p, g in zip(parameters, gradients):
            assert relative_error(to_host(p.grad), g / (expected + 1e-6)) < TOLERANCE


def test_torch_names(to_device, to_host):
    assert torch.long == np.int64 and torch.float32 == np.float32 and torch.int32 == np.int32
    array = np.arange(5)
    tensor = torch.from_numpy(array)
    assert tensor.dtype == np.int64 and np.array_equal(to_host(tensor._data), array)
    assert torch.tensor([1.5, 2]).dtype == np.float32 and torch.tensor([1, 2]).dtype == np.int64
    assert torch.cuda.is_available() == (backend.name == "cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cuda.matmul.allow_tf32 = False
    with torch.no_grad():
        assert not torch.is_grad_enabled()
    assert torch.is_grad_enabled()

    class Counting:
        steps = 0

        def step(self):
            self.steps += 1

    scaler, optimizer, loss = torch.cuda.amp.GradScaler(enabled=False), Counting(), torch.Tensor(np.ones(()))
    with torch.amp.autocast(device_type="cpu", dtype=torch.bfloat16):
        assert scaler.scale(loss) is loss
    scaler.step(optimizer)
    scaler.update()
    assert optimizer.steps == 1


def test_save_and_load_state_dicts_and_checkpoints(tmp_path, rng, to_device, to_host):
    model = nn.Sequential(nn.Linear(3, 4), nn.GELU())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.Tensor(to_device(np.arange(4)))
    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": 7,
                  "config": {"n_layer": 2, "name": "tiny"}, "ids": ids, "array": to_device(np.ones(2, np.float32))}
    torch.save(checkpoint, tmp_path / "ckpt.pt")
    loaded = torch.load(tmp_path / "ckpt.pt", map_location="cpu")
    assert loaded["iter_num"] == 7 and loaded["config"] == {"n_layer": 2, "name": "tiny"}
    assert np.array_equal(to_host(loaded["ids"]._data), np.arange(4)) and isinstance(loaded["ids"], torch.Tensor)
    assert isinstance(loaded["array"], backend.xp.ndarray)
    for name, value in checkpoint["model"].items():
        assert np.array_equal(loaded["model"][name], value)
    other = nn.Sequential(nn.Linear(3, 4), nn.GELU())
    other.load_state_dict(loaded["model"])
    assert np.array_equal(to_host(other[0].weight._data), to_host(model[0].weight._data))
    resumed = torch.optim.AdamW(other.parameters(), lr=1e-3)
    resumed.load_state_dict(loaded["optimizer"])


class _RunsCode:
    """A pickle that calls os.makedirs when it is unpickled: what a malicious file can do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.makedirs, (self.path,)


def test_load_refuses_a_file_that_would_run_code(tmp_path):
    made_by_the_file = str(tmp_path / "made_by_the_file")
    with open(tmp_path / "bad.pt", "wb") as file:
        pickle.dump({"weights": np.zeros(3), "payload": _RunsCode(made_by_the_file)}, file)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed: the file names posix.makedirs|"
                                                     "Weights only load failed: the file names os.makedirs"):
        torch.load(tmp_path / "bad.pt")
    assert not os.path.exists(made_by_the_file)
    with open(tmp_path / "objects.pt", "wb") as file:
        pickle.dump(np.array([{"a": 1}], dtype=object), file)
    with pytest.raises(pickle.UnpicklingError, match="array of Python objects"):
        torch.load(tmp_path / "objects.pt")
    torch.load(tmp_path / "bad.pt", weights_only=False)   # asked for explicitly: the caller trusts the file
    assert os.path.exists(made_by_the_file)


def test_one_autocast_object_serves_many_with_blocks():
    """nanoGPT builds `ctx = torch.amp.autocast(...)` once and enters it every step, as PyTorch allows."""
    import gpt2_cupy as torch

    ctx = torch.amp.autocast(device_type="cuda", dtype=torch.bfloat16)
    entered = 0
    for _ in range(3):
        with ctx:
            entered += 1
    assert entered == 3
