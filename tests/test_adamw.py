"""AdamW, SGD and gradient clipping on flat buffers (chapter 10): gpt2_cupy.optim and gpt2_cupy.ops.adamw.

Several steps of each optimizer are compared with a float64 numpy reference that follows
torch.optim.AdamW / torch.optim.SGD formula by formula (and with PyTorch itself on a GPU where it is
installed). Parameter sizes are not multiples of 4 or 16, so the padding between parameters in the flat
buffer is exercised; groups have different weight decays.
"""

import numpy as np
import pytest

from gpt2_cupy import backend, optim
from gpt2_cupy.autograd import Tensor
from gpt2_cupy.testing import relative_error, torch_or_none

SHAPES = [(5, 7), (3,), (11, 2), (1,), (4, 4)]
DECAY = [0.1, 0.0, 0.1, 0.0, 0.1]  # matrices decay, vectors do not (nanoGPT's groups)
TOLERANCE = 1e-5


class Parameter:
    """What the optimizer needs of a parameter: .data, .grad and (optionally) .requires_grad."""

    def __init__(self, data, requires_grad=True):
        self.data = data
        self.grad = None
        self.requires_grad = requires_grad


def make_parameters(rng, to_device, shapes=SHAPES):
    values = [rng.normal(size=shape).astype(np.float32) for shape in shapes]
    return values, [Parameter(to_device(value)) for value in values]


def two_groups(parameters, decay=DECAY):
    return [{"params": [p for p, d in zip(parameters, decay) if d], "weight_decay": 0.1},
            {"params": [p for p, d in zip(parameters, decay) if not d], "weight_decay": 0.0}]


def adamw_reference(theta, gradients, learning_rates, weight_decay, betas=(0.9, 0.999), eps=1e-8):
    """θ after len(gradients) AdamW steps, in float64, as torch.optim.AdamW writes them."""
    theta = theta.astype(np.float64)
    m, v = np.zeros_like(theta), np.zeros_like(theta)
    beta1, beta2 = betas
    for t, (g, lr) in enumerate(zip(gradients, learning_rates), start=1):
        theta = theta - lr * weight_decay * theta
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        theta = theta - lr / (1 - beta1**t) * m / (np.sqrt(v) / np.sqrt(1 - beta2**t) + eps)
    return theta


def sgd_reference(theta, gradients, lr, momentum, weight_decay):
    theta, buffer = theta.astype(np.float64), None
    for g in gradients:
        g = g + weight_decay * theta
        buffer = g.copy() if buffer is None else momentum * buffer + g
        theta = theta - lr * buffer
    return theta


def set_gradients(parameters, gradients, to_device):
    for p, g in zip(parameters, gradients):
        p.grad = to_device(g)  # a new array, as PyTorch code may set it: the step copies it into its buffer


def random_gradients(rng, steps, shapes=SHAPES):
    return [[rng.normal(size=shape).astype(np.float32) for shape in shapes] for _ in range(steps)]


def test_adamw_matches_float64_over_several_steps(rng, to_device, to_host):
    values, parameters = make_parameters(rng, to_device)
    optimizer = optim.AdamW(two_groups(parameters), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    gradients = random_gradients(rng, 6)
    learning_rates = [1e-2, 1e-2, 5e-3, 5e-3, 2e-3, 2e-3]  # a schedule: set in param_groups, used next step
    for step, lr in enumerate(learning_rates):
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad()
        set_gradients(parameters, gradients[step], to_device)
        optimizer.step()
    assert to_host(optimizer.state["step"])[0] == 6
    for i, p in enumerate(parameters):
        reference = adamw_reference(values[i], [g[i] for g in gradients], learning_rates, DECAY[i], betas=(0.9, 0.95))
        assert relative_error(to_host(p.data), reference) < TOLERANCE


def test_sgd_momentum_matches_float64(rng, to_device, to_host):
    for momentum, weight_decay in [(0.0, 0.0), (0.9, 0.0), (0.9, 0.01)]:
        values, parameters = make_parameters(rng, to_device)
        optimizer = optim.SGD(parameters, lr=0.1, momentum=momentum, weight_decay=weight_decay)
        gradients = random_gradients(rng, 4)
        for step in range(4):
            optimizer.zero_grad()
            set_gradients(parameters, gradients[step], to_device)
            optimizer.step()
        for i, p in enumerate(parameters):
            reference = sgd_reference(values[i], [g[i] for g in gradients], 0.1, momentum, weight_decay)
            assert relative_error(to_host(p.data), reference) < TOLERANCE


def test_parameters_and_gradients_are_views_into_one_buffer(rng, to_device, to_host):
    values, parameters = make_parameters(rng, to_device)
    existing = rng.normal(size=SHAPES[0]).astype(np.float32)
    parameters[0].grad = to_device(existing)
    tied = parameters[2]
    optimizer = optim.AdamW(two_groups(parameters) + [{"params": [tied]}])  # a parameter listed twice
    xp = backend.xp
    for value, p in zip(values, parameters):
        assert xp.shares_memory(p.data, optimizer.flat_params)
        assert np.array_equal(to_host(p.data), value) and p.data.shape == value.shape
        offset = (backend.address(p.data) - backend.address(optimizer.flat_params)) // 4
        assert offset % optim.ALIGNMENT == 0
    assert xp.shares_memory(parameters[0].grad, optimizer.flat_grads)
    assert np.array_equal(to_host(parameters[0].grad), existing)  # a gradient already there is kept
    assert all(p.grad is None for p in parameters[1:])             # the others get theirs from the backward
    assert sum(len(group["params"]) for group in optimizer.param_groups) == len(parameters)  # tied: packed once
    optimizer.zero_grad(set_to_none=False)
    assert not to_host(optimizer.flat_grads).any() and xp.shares_memory(parameters[0].grad, optimizer.flat_grads)
    optimizer.zero_grad()                                          # PyTorch's default: set_to_none=True
    assert all(p.grad is None for p in parameters)


def test_gradient_norm_and_clipping(rng, to_device, to_host):
    shapes = [(300, 257), (1000,), (3,)]  # several norm blocks; sizes not multiples of 4
    _, parameters = make_parameters(rng, to_device, shapes)
    optimizer = optim.AdamW(parameters)
    gradients = [rng.normal(size=shape).astype(np.float32) for shape in shapes]
    set_gradients(parameters, gradients, to_device)
    expected = np.sqrt(sum((g.astype(np.float64) ** 2).sum() for g in gradients))
    norm = optimizer.clip_grad_norm_(10 * expected)  # no clipping: the gradients stay as they are
    assert norm.shape == () and relative_error(to_host(norm), expected) < TOLERANCE
    assert all(np.array_equal(to_host(p.grad), g) for p, g in zip(parameters, gradients))
    first = to_host(optimizer.clip_grad_norm_(1.0)).copy()  # clipping to norm 1
    scale = 1.0 / (expected + 1e-6)
    for p, g in zip(parameters, gradients):
        assert relative_error(to_host(p.grad), g * scale) < TOLERANCE
    assert first == to_host(norm)  # the same bits as the first computation: a fixed order of additions
    clipped = np.sqrt(sum((to_host(p.grad).astype(np.float64) ** 2).sum() for p in parameters))
    assert abs(clipped - 1.0) < 1e-5


def test_state_dict_resumes_bit_for_bit(rng, to_device, to_host):
    values, parameters = make_parameters(rng, to_device)
    optimizer = optim.AdamW(two_groups(parameters), lr=3e-3)
    gradients = random_gradients(rng, 5)
    for step in range(3):
        optimizer.zero_grad()
        set_gradients(parameters, gradients[step], to_device)
        optimizer.step()
    checkpoint = optimizer.state_dict()
    saved = [to_host(p.data).copy() for p in parameters]
    assert isinstance(checkpoint["state"]["exp_avg"], np.ndarray) and checkpoint["state"]["step"][0] == 3
    assert checkpoint["param_groups"][0]["weight_decay"] == 0.1
    for step in (3, 4):
        optimizer.zero_grad()
        set_gradients(parameters, gradients[step], to_device)
        optimizer.step()
    resumed_parameters = [Parameter(to_device(value)) for value in saved]
    resumed = optim.AdamW(two_groups(resumed_parameters), lr=1.0)  # lr comes back from the checkpoint
    resumed.load_state_dict(checkpoint)
    for step in (3, 4):
        resumed.zero_grad()
        set_gradients(resumed_parameters, gradients[step], to_device)
        resumed.step()
    for p, q in zip(parameters, resumed_parameters):
        assert np.array_equal(to_host(p.data), to_host(q.data))
    sgd = optim.SGD(parameters, lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="SGD.load_state_dict"):
        sgd.load_state_dict(checkpoint)


def test_bad_arguments_are_named(rng, to_device):
    _, parameters = make_parameters(rng, to_device)
    with pytest.raises(TypeError, match=r"AdamW: param_groups\[0\]\['params'\]\[1\].data has dtype float64"):
        optim.AdamW([parameters[0], Parameter(to_device(np.zeros(3)))])
    with pytest.raises(TypeError, match="AdamW: .*must have .data"):
        optim.AdamW([np.zeros(3, np.float32)])
    with pytest.raises(ValueError, match="AdamW: param_groups\\[0\\]: betas"):
        optim.AdamW(parameters, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="AdamW: param_groups\\[1\\] has keys \\['momentum'\\]"):
        optim.AdamW([{"params": parameters[:2]}, {"params": parameters[2:], "momentum": 0.9}])
    with pytest.raises(ValueError, match="SGD: got an empty list"):
        optim.SGD([], lr=0.1)
    with pytest.raises(ValueError, match="SGD: param_groups\\[0\\]: lr"):
        optim.SGD(parameters, lr=-1.0)


@pytest.mark.skipif(torch_or_none() is None or backend.name != "cuda", reason="needs PyTorch and a GPU")
def test_matches_torch_adamw(rng, to_device, to_host):
    torch = torch_or_none()
    values, parameters = make_parameters(rng, to_device)
    optimizer = optim.AdamW(two_groups(parameters), lr=1e-2, betas=(0.9, 0.95))
    torch_parameters = [torch.tensor(value, device="cuda", requires_grad=True) for value in values]
    torch_optimizer = torch.optim.AdamW(two_groups(torch_parameters), lr=1e-2, betas=(0.9, 0.95), fused=True)
    for gradients in random_gradients(rng, 5):
        optimizer.zero_grad()
        set_gradients(parameters, gradients, to_device)
        optimizer.step()
        for tp, g in zip(torch_parameters, gradients):
            tp.grad = torch.tensor(g, device="cuda")
        torch_optimizer.step()
    for p, tp in zip(parameters, torch_parameters):
        assert relative_error(to_host(p.data), tp.detach().cpu().numpy()) < TOLERANCE


def test_flat_buffer_kernels_refuse_lengths_not_multiple_of_4(to_device):
    from gpt2_cupy.ops.adamw import clip_gradients, sgd_update

    buffer = to_device(np.zeros(6, np.float32))
    with pytest.raises(ValueError, match="clip_gradients: the flat buffers have 6 elements"):
        clip_gradients(buffer, to_device(np.ones(1, np.float32)), 1.0)
    hyperparameters = to_device(np.zeros((1, 5), np.float64))
    with pytest.raises(ValueError, match="sgd_update: grads"):
        sgd_update(to_device(np.zeros(8, np.float32)), to_device(np.zeros(8, np.float32)), buffer,
                   hyperparameters, to_device(np.array([8], np.int32)))


# ---- PyTorch's rules for which parameters a step touches -----------------------------------------------

def linear_loss(layer, x, u):
    """Σ u · layer(x) through the autograd: d loss / d weight = uᵀ x, d loss / d bias = Σ u."""
    from gpt2_cupy.nn import functional as F
    from gpt2_cupy.autograd import Tensor
    y = layer(Tensor(x))
    n = y.numel()
    return F.linear(y.reshape(1, n), Tensor(u.reshape(1, n))).reshape(())


def test_a_frozen_parameter_is_untouched_even_with_weight_decay(rng, to_device, to_host):
    from gpt2_cupy import nn
    layer = nn.Linear(5, 4)
    layer.weight.requires_grad = False
    frozen, bias = to_host(layer.weight.data).copy(), to_host(layer.bias.data).copy()
    optimizer = optim.AdamW(layer.parameters(), lr=0.1, weight_decay=0.5)
    x64, u64 = rng.normal(size=(3, 5)), rng.normal(size=(3, 4))
    for _ in range(2):
        optimizer.zero_grad()
        linear_loss(layer, to_device(x64.astype(np.float32)), to_device(u64.astype(np.float32))).backward()
        optimizer.step()
    assert layer.weight.grad is None and np.array_equal(to_host(layer.weight.data), frozen)
    reference = adamw_reference(bias, [u64.sum(axis=0)] * 2, [0.1, 0.1], 0.5)
    assert relative_error(to_host(layer.bias.data), reference) < TOLERANCE


def test_a_parameter_the_forward_does_not_use_is_skipped(rng, to_device, to_host):
    from gpt2_cupy import nn
    used, unused = nn.Linear(5, 4), nn.Linear(5, 4)
    before = [to_host(p.data).copy() for p in unused.parameters()]
    used_before = to_host(used.weight.data).copy()
    optimizer = optim.AdamW(used.parameters() + unused.parameters(), lr=0.1, weight_decay=0.1)
    x, u = to_device(rng.normal(size=(3, 5)).astype(np.float32)), to_device(rng.normal(size=(3, 4)).astype(np.float32))
    optimizer.zero_grad()
    linear_loss(used, x, u).backward()
    optimizer.step()
    assert all(p.grad is None for p in unused.parameters())
    assert all(np.array_equal(to_host(p.data), b) for p, b in zip(unused.parameters(), before))
    assert not to_host(optimizer.state["exp_avg"][optimizer._packed[2][1]]).any()  # nor its moments
    assert np.abs(to_host(used.weight.data) - used_before).min() > 0.09  # AdamW's first step moves each by ~lr
    # Used at the next step, it moves.
    optimizer.zero_grad()
    linear_loss(unused, x, u).backward()
    optimizer.step()
    assert not np.array_equal(to_host(unused.weight.data), before[0])


def test_training_continues_after_a_second_optimizer_or_a_new_data_array(rng, to_device, to_host):
    from gpt2_cupy import nn
    layer = nn.Linear(5, 4)
    first = optim.SGD(layer.parameters(), lr=0.1)
    second = optim.SGD(layer.parameters(), lr=0.1)   # packs the parameters again, into its own buffer
    x64, u64 = rng.normal(size=(3, 5)), rng.normal(size=(3, 4))
    x, u = to_device(x64.astype(np.float32)), to_device(u64.astype(np.float32))
    weight = to_host(layer.weight.data).astype(np.float64)
    for optimizer in (first, second, first):
        optimizer.zero_grad()
        linear_loss(layer, x, u).backward()
        optimizer.step()
        weight = weight - 0.1 * u64.T @ x64
        assert relative_error(to_host(layer.weight.data), weight) < TOLERANCE
    new_weight = rng.normal(size=(4, 5)).astype(np.float32)
    layer.weight.data = Tensor(to_device(new_weight))  # replaced, not written into
    first.zero_grad()
    linear_loss(layer, x, u).backward()
    first.step()
    assert relative_error(to_host(layer.weight.data), new_weight - 0.1 * u64.T @ x64) < TOLERANCE
    layer.weight.data = Tensor(to_device(np.zeros((2, 2), np.float32)))
    with pytest.raises(ValueError, match=r"SGD.step: a parameter's .data was replaced by .* shape \(2, 2\)"):
        first.step()


def test_clip_grad_norm_returns_a_new_array_each_call(rng, to_device, to_host):
    _, parameters = make_parameters(rng, to_device)
    optimizer = optim.AdamW(parameters)
    gradients = [rng.normal(size=shape).astype(np.float32) for shape in SHAPES]
    set_gradients(parameters, gradients, to_device)
    first = optimizer.clip_grad_norm_(1e9)
    set_gradients(parameters, [2 * g for g in gradients], to_device)
    second = optimizer.clip_grad_norm_(1e9)
    expected = np.sqrt(sum((g.astype(np.float64) ** 2).sum() for g in gradients))
    assert relative_error(to_host(first), expected) < TOLERANCE          # kept, not overwritten
    assert relative_error(to_host(second), 2 * expected) < TOLERANCE
