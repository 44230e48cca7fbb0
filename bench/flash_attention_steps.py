"""Chapter 16b's FlashAttention steps on a GPU, causal, bf16, d = 64, at GPT-2 124M's B = 8, H = 12 and four
lengths T: each step's forward and backward against the shipped kernels (gpt2_cupy.ops.tensor_core_attention)
and PyTorch's scaled_dot_product_attention (its flash kernel on bf16), in the same run, with a large bf16
product through cuBLAS as the FLOP line (attention is compute-bound: its work grows as T², its bytes as T).

    python -m bench.flash_attention_steps          prints a table and writes bench/flash_attention_steps.json
    python -m bench.flash_attention_steps --tiny   on any backend: every run once at a small T, no timings, no file

TFLOP/s counts what causal attention must do, half of each T x T x d product (2 T² d FLOP each, per head), as
bench/tensor_core_attention.py does: forward 2 products (S, P V), backward 5 (S again, dP, dV, dK, dQ).
"""

import sys

import numpy
from ml_dtypes import bfloat16

from gpt2_cupy import backend, benchmark, kernels
from gpt2_cupy.ops.tensor_core_attention import tensor_core_attention_backward, tensor_core_attention_forward
from gpt2_cupy.testing import torch_or_none

B, H, D = 8, 12, 64
LENGTHS = (256, 512, 1024, 2048)
TINY_LENGTH = 40
FORWARD_STEPS = ("attention_forward_online_softmax", "attention_forward_mma")
PRODUCTS = {"forward": 2, "backward": 5}
PEAK_SIZE = 8192   # the cuBLAS bf16 product that draws the FLOP line: M = N = K


def blocks(n, size):
    return (n + size - 1) // size


def causal_flop(T, products):
    return products * B * H * T * T * D   # half of 2 T² d per product and head


def step_runs(T, rng):
    """{name: run} of the steps' kernels on one set of (B H, T, D) bf16 inputs."""
    xp = backend.xp
    q, k, v, dout = (xp.asarray(rng.standard_normal((B * H, T, D)).astype(bfloat16).view(numpy.uint16)) for _ in range(4))
    out, lse = xp.empty((B * H, T, D), numpy.float32), xp.empty((B * H, T), numpy.float32)
    dq, dk, dv = (xp.empty((B * H, T, D), numpy.float32) for _ in range(3))
    row_dot = xp.zeros((B * H, T), numpy.float32)
    scale, T32, heads = numpy.float32(D ** -0.5), numpy.int32(T), numpy.int32(B * H)
    grid = (blocks(T, 16), B * H)
    forward = {name: kernels.function(f"steps/{name}") for name in FORWARD_STEPS}
    pipelined = {strips: kernels.function("steps/attention_forward_pipelined", options=(f"-DSTRIPS={strips}",))
                 for strips in (1, 2)}
    backward = (kernels.function("steps/attention_backward_dk_dv"), kernels.function("steps/attention_backward_dq"))
    common = (q, k, v, dout, lse, row_dot, T32, heads, heads, scale, numpy.int32(1))
    return {
        "step 2 (P through shared memory), forward": lambda: forward[FORWARD_STEPS[0]](
            grid, (32,), (out, lse, q, k, v, T32, scale, numpy.int32(1))),
        "step 3 (P from registers), forward": lambda: forward[FORWARD_STEPS[1]](
            grid, (32,), (out, lse, q, k, v, T32, heads, heads, scale, numpy.int32(1))),
        "step 4 (cp.async double buffer), forward": lambda: pipelined[1](
            (blocks(T, 64), B * H), (128,), (out, lse, q, k, v, T32, heads, heads, scale, numpy.int32(1))),
        "step 5 (two strips per warp), forward": lambda: pipelined[2](
            (blocks(T, 128), B * H), (128,), (out, lse, q, k, v, T32, heads, heads, scale, numpy.int32(1))),
        "step 6 (dK, dV pass; dQ pass), backward": lambda: (backward[0](grid, (32,), (dk, dv, *common)),
                                                          backward[1](grid, (32,), (dq, *common))),
    }


def shipped_runs(T, rng):
    xp = backend.xp
    q, k, v, dout = (xp.asarray(rng.standard_normal((B, H, T, D)).astype(bfloat16)) for _ in range(4))
    out, lse = tensor_core_attention_forward(q, k, v, causal=True)
    return {"shipped kernel, forward": lambda: tensor_core_attention_forward(q, k, v, causal=True, out=out),
            "shipped kernel, backward": lambda: tensor_core_attention_backward(dout, q, k, v, out, lse, causal=True)}


def torch_runs(torch, T):
    q, k, v, dout = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        out = sdpa(q, k, v, is_causal=True)

    def forward():
        with torch.no_grad(), torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            sdpa(q, k, v, is_causal=True)

    return {"PyTorch SDPA (flash), forward": forward,
            "PyTorch SDPA (flash), backward": lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)}


def peak_tflops(torch):
    """TFLOP/s of a PEAK_SIZE³ bf16 product through cuBLAS into a preallocated output: the FLOP line."""
    a, b = (torch.randn(PEAK_SIZE, PEAK_SIZE, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty_like(a)
    return benchmark.tflops(2 * PEAK_SIZE ** 3, benchmark.seconds_per_call(lambda: torch.matmul(a, b, out=c)))


def main():
    tiny = "--tiny" in sys.argv[1:]
    if not tiny:
        benchmark.require_gpu()
    torch = None if tiny else torch_or_none()
    rng = numpy.random.default_rng(0)
    results = {"shape": {"B": B, "H": H, "d": D, "causal": True, "dtype": "bf16"}, "lengths": [], "tflops": {}}
    for T in ((TINY_LENGTH,) if tiny else LENGTHS):
        runs = {**step_runs(T, rng), **shipped_runs(T, rng), **(torch_runs(torch, T) if torch else {})}
        results["lengths"].append(T)
        for name, run in runs.items():
            if tiny:
                run()
                continue
            flop = causal_flop(T, PRODUCTS[name.rsplit(", ", 1)[1]])
            results["tflops"].setdefault(name, []).append(benchmark.tflops(flop, benchmark.seconds_per_call(run)))
    backend.synchronize()
    if tiny:
        print(f"every run ran once at T = {TINY_LENGTH} on the {backend.name} backend")
        return
    if torch is not None:
        results["peak_bf16_tflops"] = peak_tflops(torch)
        results["torch"] = torch.__version__
    table = [f"{'TFLOP/s at T =':46}" + "".join(f"{T:>8}" for T in results["lengths"])]
    table += [f"{name:46}" + "".join(f"{rate:8.1f}" for rate in rates) for name, rates in results["tflops"].items()]
    if "peak_bf16_tflops" in results:
        table.append(f"cuBLAS bf16 {PEAK_SIZE}³ product: {results['peak_bf16_tflops']:.0f} TFLOP/s")
    benchmark.report("flash_attention_steps", results, table)


if __name__ == "__main__":
    main()
