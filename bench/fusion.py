"""Fusion, measured: LayerNorm and causal attention written from tensor operations, one kernel per
operation, against chapter 05's and chapter 08's fused kernels.

    python -m bench.fusion          on a GPU: prints a table, writes bench/fusion.json
    python -m bench.fusion --tiny   anywhere (the CPU executor too): every case once at tiny sizes, checked
                                    against float64 numpy, nothing timed

At GPT-2's sizes: LayerNorm over (B, T, C) = (8, 1024, 768), attention over (B, H, T, d) = (8, 12, 1024, 64).
Each case is timed forward, and forward plus backward, with the median of benchmark.seconds_per_call. The
bytes are napkin math (layer_norm_traffic, attention_traffic): every launch reads each array it takes and
writes each array it makes once, the least that must cross the memory bus; their total over the copy
bandwidth is the fastest the forward could run. PyTorch eager runs the same two functions on its own tensors
(its own kernel per operation), and its fused F.layer_norm and F.scaled_dot_product_attention, in the same run.
"""

import math
import sys

import numpy as np

from gpt2_cupy import backend, benchmark
from gpt2_cupy import autograd
from gpt2_cupy.testing import relative_error, torch_or_none

FLOAT, BOOL = 4, 1  # bytes
EPS = 1e-5          # GPT-2's LayerNorm epsilon
LAYER_NORM_SHAPE = (8, 1024, 768)      # (B, T, C)
ATTENTION_SHAPE = (8, 12, 1024, 64)    # (B, H, T, d): GPT-2 small's 12 heads of 64
TINY_LAYER_NORM_SHAPE = (2, 5, 100)
TINY_ATTENTION_SHAPE = (1, 2, 37, 32)


# ---- the two functions, as the textbooks write them ------------------------------------------------------

def layer_norm_from_operations(x, weight, bias, eps=EPS):
    """LayerNorm over the last axis, one tensor operation at a time (runs on gpt2_cupy's and torch's tensors)."""
    mean = x.mean(dim=-1, keepdim=True)                   # (B, T, 1)
    var = x.var(dim=-1, keepdim=True, unbiased=False)     # (B, T, 1)
    x_hat = (x - mean) / (var + eps).sqrt()               # (B, T, C)
    return weight * x_hat + bias


def attention_from_operations(q, k, v, mask):
    """Causal attention of q, k, v (B, H, T, d), as nanoGPT's manual path: mask is (1, 1, T_max, T_max), ones
    on and below the diagonal (nanoGPT's `bias` buffer), T_max >= T."""
    T, d = q.shape[-2], q.shape[-1]
    att = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(d))            # (B, H, T, T)
    att = att.masked_fill(mask[:, :, :T, :T] == 0, float("-inf"))
    att = att.softmax(dim=-1)
    return att @ v                                                   # (B, H, T, d)


def causal_mask(module, T):
    """(1, 1, T, T) float ones on and below the diagonal, made by `module` (gpt2_cupy or torch)."""
    return module.tril(module.ones(T, T, device="cuda")).view(1, 1, T, T)


# ---- napkin math ---------------------------------------------------------------------------------------------

def layer_norm_traffic(B, T, C):
    """{"from operations": [(operation, bytes read, bytes written)], "fused": [...]}, one entry per kernel launch
    of layer_norm_from_operations and of F.layer_norm, in the order they run. x.var is five operations."""
    rows, matrix, vector = B * T * FLOAT, B * T * C * FLOAT, C * FLOAT
    return {
        "from operations": [
            ("mean = x.mean(-1)           reduction", matrix, rows),
            ("x.var: x.mean(-1)           reduction", matrix, rows),
            ("x.var: x - mean             elementwise", matrix + rows, matrix),
            ("x.var: centered * centered  elementwise", matrix, matrix),
            ("x.var: .sum(-1)             reduction", matrix, rows),
            ("x.var: / C                  elementwise", rows, rows),
            ("x - mean                    elementwise", matrix + rows, matrix),
            ("var + eps                   elementwise", rows, rows),
            (".sqrt()                     elementwise", rows, rows),
            ("/                           elementwise", matrix + rows, matrix),
            ("weight *                    elementwise", matrix + vector, matrix),
            ("+ bias                      elementwise", matrix + vector, matrix),
        ],
        "fused": [("F.layer_norm                layernorm_forward", matrix + 2 * vector, matrix + 2 * rows)],
    }


def attention_traffic(B, H, T, d):
    """The same for attention_from_operations and F.scaled_dot_product_attention(..., is_causal=True)."""
    heads, scores, mask = B * H * T * d * FLOAT, B * H * T * T * FLOAT, T * T
    return {
        "from operations": [
            ("k.transpose(-2, -1), copied   elementwise", heads, heads),
            ("q @ kᵀ                        batched matmul", 2 * heads, scores),
            ("* scale                       elementwise", scores, scores),
            ("mask[:, :, :T, :T] == 0       elementwise", mask * FLOAT, mask * BOOL),
            ("masked_fill                   elementwise", scores + mask * BOOL, scores),
            ("softmax(dim=-1)               chapter 04's kernel", scores, scores),
            ("att @ v                       batched matmul", scores + heads, heads),
        ],
        "fused": [("scaled_dot_product_attention  attention_forward", 3 * heads, heads + B * H * T * FLOAT)],
    }


def total_bytes(launches):
    return sum(read + written for _, read, written in launches)


# ---- float64 references ----------------------------------------------------------------------------------

def layer_norm_reference(x, weight, bias, eps=EPS):
    mean = x.mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + eps) * weight + bias


def attention_reference(q, k, v):
    T, d = q.shape[-2:]
    scores = np.where(np.tril(np.ones((T, T), bool)), q @ np.swapaxes(k, -1, -2) / math.sqrt(d), -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True) @ v


# ---- the cases -----------------------------------------------------------------------------------------------

def inputs(layer_norm_shape, attention_shape, seed=0):
    """Random float64 numpy inputs: {"x", "weight", "bias", "dy"} and {"q", "k", "v", "dout"}."""
    random = np.random.default_rng(seed)
    C = layer_norm_shape[-1]
    layer_norm = {"x": random.normal(0.5, 2.0, layer_norm_shape), "weight": random.normal(1.0, 0.3, C),
                  "bias": random.normal(0.0, 0.3, C), "dy": random.standard_normal(layer_norm_shape)}
    attention = {name: random.standard_normal(attention_shape) for name in ("q", "k", "v", "dout")}
    return layer_norm, attention


def cases(layer_norm_shape, attention_shape):
    """{"layer_norm": {name: (forward(), forward_and_backward())}, "attention": {...}}: gpt2_cupy's two ways,
    and PyTorch eager's two ways when it imports on a GPU. The forwards take inputs that require no gradient
    (nothing is recorded); the backwards add into the inputs' .grad call after call."""
    import gpt2_cupy
    from gpt2_cupy.nn import functional as F

    layer_norm, attention = inputs(layer_norm_shape, attention_shape)
    C, T = layer_norm_shape[-1], attention_shape[-2]
    modules = {"": (gpt2_cupy, F)}
    torch = torch_or_none()
    if torch is not None and backend.name == "cuda":
        modules["PyTorch, "] = (torch, torch.nn.functional)
    fused_names = {"": ("fused (chapter 05)", "fused (chapter 08)"),
                   "PyTorch, ": ("F.layer_norm", "F.scaled_dot_product_attention")}
    results = {"layer_norm": {}, "attention": {}}
    for prefix, (module, functional) in modules.items():
        def tensors(arrays, upstream):
            """(leaves that require grad, the same values as constants), all on the GPU as float32."""
            leaves = {name: module.tensor(a, dtype=module.float32, device="cuda", requires_grad=name != upstream)
                      for name, a in arrays.items()}
            return leaves, {name: t.detach() for name, t in leaves.items()}

        def runs(function, leaves, constants, upstream):
            return (lambda: function(constants)), (lambda: function(leaves).backward(leaves[upstream]))

        leaves, constants = tensors(layer_norm, "dy")
        fused_layer_norm, fused_attention = fused_names[prefix]
        results["layer_norm"][prefix + "from operations"] = runs(
            lambda t: layer_norm_from_operations(t["x"], t["weight"], t["bias"]), leaves, constants, "dy")
        results["layer_norm"][prefix + fused_layer_norm] = runs(
            lambda t, f=functional: f.layer_norm(t["x"], (C,), t["weight"], t["bias"], EPS), leaves, constants, "dy")
        leaves, constants = tensors(attention, "dout")
        mask = causal_mask(module, T)
        results["attention"][prefix + "from operations"] = runs(
            lambda t, mask=mask: attention_from_operations(t["q"], t["k"], t["v"], mask), leaves, constants, "dout")
        results["attention"][prefix + fused_attention] = runs(
            lambda t, f=functional: f.scaled_dot_product_attention(t["q"], t["k"], t["v"], is_causal=True),
            leaves, constants, "dout")
    return results


def as_numpy(tensor):
    return backend.asnumpy(tensor.data) if isinstance(tensor, autograd.Tensor) else tensor.detach().cpu().numpy()


def check(layer_norm_shape=TINY_LAYER_NORM_SHAPE, attention_shape=TINY_ATTENTION_SHAPE):
    """Every case's forward once against float64 numpy, then its backward once: what --tiny runs."""
    layer_norm, attention = inputs(layer_norm_shape, attention_shape)
    references = {"layer_norm": layer_norm_reference(layer_norm["x"], layer_norm["weight"], layer_norm["bias"]),
                  "attention": attention_reference(attention["q"], attention["k"], attention["v"])}
    for operation, runs in cases(layer_norm_shape, attention_shape).items():
        for name, (forward, forward_and_backward) in runs.items():
            error = relative_error(as_numpy(forward()), references[operation])
            forward_and_backward()
            print(f"  {operation:<10s} {name:<42s} relative error {error:.1e}")
            assert error < 1e-5, (operation, name)


def measure():
    benchmark.require_gpu()
    results = {"copy_bandwidth_gb_per_s": benchmark.copy_bandwidth() / 1e9}
    traffic = {"layer_norm": layer_norm_traffic(*LAYER_NORM_SHAPE), "attention": attention_traffic(*ATTENTION_SHAPE)}
    shapes = {"layer_norm": LAYER_NORM_SHAPE, "attention": ATTENTION_SHAPE}
    for operation, runs in cases(LAYER_NORM_SHAPE, ATTENTION_SHAPE).items():
        forward = {name: benchmark.seconds_per_call(run) * 1e6 for name, (run, _) in runs.items()}
        both = {name: benchmark.seconds_per_call(run) * 1e6 for name, (_, run) in runs.items()}
        results[operation] = {
            "shape": list(shapes[operation]),
            "launches": {name: len(launches) for name, launches in traffic[operation].items()},
            "bytes": {name: total_bytes(launches) for name, launches in traffic[operation].items()},
            "forward_microseconds": forward, "forward_and_backward_microseconds": both}
    return results


def table(measured):
    ceiling = measured["copy_bandwidth_gb_per_s"]
    lines = [f"{backend.device_name()}: copy bandwidth {ceiling:.0f} GB/s"]
    for operation in ("layer_norm", "attention"):
        result = measured[operation]
        lines.append(f"{operation} at {tuple(result['shape'])}:")
        for name, count in result["launches"].items():
            megabytes = result["bytes"][name] / 1e6
            at_copy = result["bytes"][name] / (ceiling * 1e9) * 1e6
            lines.append(f"  {name:<20s} {count:2d} launches, {megabytes:8.1f} MB moved, {at_copy:7.1f} µs at "
                         "the copy bandwidth")
        width = max(map(len, result["forward_microseconds"]))
        for name, forward in result["forward_microseconds"].items():
            lines.append(f"  {name:<{width}s} forward {forward:8.1f} µs, forward and backward "
                         f"{result['forward_and_backward_microseconds'][name]:8.1f} µs")
    return lines


if __name__ == "__main__":
    if "--tiny" in sys.argv[1:]:
        check()
    else:
        measured = measure()
        benchmark.report("fusion", measured, table(measured))
