"""Chapter 17a's kernels timed on a GPU: RMSNorm, RoPE and SwiGLU at Llama-2-7B's widths, in GB/s against the
device's copy and against PyTorch's equivalents where it is installed. `python -m bench.llama` writes
bench/llama.json, which the chapter shows on a machine without a GPU.

Bytes that must move per call (float32):
    RMSNorm forward   read x, write y              2 N C (+ N for rstd)
    RMSNorm backward  read dout, x, write dx       3 N C (+ N for rstd); the first layout reads dout and x again
                                                   for dweight's column sums, 2 N C more that it need not move
    RoPE (q)          read x, write y              2 B T H D
    SwiGLU forward    read gate, up, write y       3 N I
    SwiGLU backward   read dout, gate, up, write dgate, dup    5 N I
RMSNorm is timed as the op launches it (the row in registers; the backward with BACKWARD_ROWS_PER_BLOCK = 16 rows
per block, and with 8 and 32) and in chapter 17a's first layout (a warp per row, the row read twice, dweight from a
second kernel).
"""

from gpt2_cupy import backend, benchmark
from gpt2_cupy.ops import rmsnorm as rmsnorm_ops
from gpt2_cupy.ops.rmsnorm import rmsnorm_backward, rmsnorm_forward
from gpt2_cupy.ops.rope import rope_backward, rope_forward
from gpt2_cupy.ops.swiglu import swiglu_backward, swiglu_forward
from gpt2_cupy.testing import torch_or_none

B, T, C, H, INTERMEDIATE = 4, 1024, 4096, 32, 11008   # Llama-2-7B's widths, a batch of 4 × 1024 tokens
D = C // H
FLOAT = 4


def runs(xp):
    """{name: (bytes that must move, a call)} for our kernels and, when PyTorch is installed, its equivalents."""
    N = B * T
    x, dout = xp.random.standard_normal((N, C), dtype=xp.float32), xp.random.standard_normal((N, C), dtype=xp.float32)
    weight, dweight = xp.ones(C, dtype=xp.float32), xp.zeros(C, dtype=xp.float32)
    y, dx = xp.empty_like(x), xp.empty_like(x)
    _, rstd = rmsnorm_forward(x, weight)
    q = xp.random.standard_normal((B, T, H, D), dtype=xp.float32)
    q_out = xp.empty_like(q)
    gate, up = (xp.random.standard_normal((N, INTERMEDIATE), dtype=xp.float32) for _ in range(2))
    hidden, dgate, dup = (xp.empty_like(gate) for _ in range(3))
    layout = rmsnorm_ops.row_layout("rmsnorm", C, (x, dout, y, dx, weight))
    table = {
        "RMSNorm forward": (FLOAT * (2 * N * C + N), lambda: rmsnorm_forward(x, weight, out=y)),
        "RMSNorm backward": (FLOAT * (3 * N * C + N), lambda: rmsnorm_backward(dout, x, weight, rstd,
                                                                               dweight=dweight, out=dx)),
        **{f"RMSNorm backward, {rows} rows per block": (
            FLOAT * (3 * N * C + N),
            lambda rows=rows: rmsnorm_ops._backward(layout, dx, dweight, dout, x, weight, rstd, N, C, rows))
           for rows in (8, 32)},
        "RMSNorm forward, first layout (a warp per row)": (
            FLOAT * (2 * N * C + N), lambda: rmsnorm_ops.first_layout_forward(y, rstd, x, weight)),
        "RMSNorm backward, first layout (a warp per row, dweight apart)": (
            FLOAT * (3 * N * C + N), lambda: rmsnorm_ops.first_layout_backward(dx, dweight, dout, x, weight, rstd)),
        "RoPE forward (rotate_half)": (FLOAT * 2 * q.size, lambda: rope_forward(q, out=q_out)),
        "RoPE forward (interleaved)": (FLOAT * 2 * q.size, lambda: rope_forward(q, interleaved=True, out=q_out)),
        "RoPE backward": (FLOAT * 2 * q.size, lambda: rope_backward(q, out=q_out)),
        "SwiGLU forward": (FLOAT * 3 * gate.size, lambda: swiglu_forward(gate, up, out=hidden)),
        "SwiGLU backward": (FLOAT * 5 * gate.size, lambda: swiglu_backward(hidden, gate, up, out=(dgate, dup))),
    }
    torch = torch_or_none()
    if torch is not None:
        x_t, weight_t, gate_t, up_t = (torch.from_dlpack(a) for a in (x, weight, gate, up))
        if hasattr(torch.nn.functional, "rms_norm"):
            table["torch RMSNorm forward (F.rms_norm)"] = (
                FLOAT * (2 * N * C), lambda: torch.nn.functional.rms_norm(x_t, (C,), weight_t, 1e-6))
        table["torch SwiGLU forward (F.silu(gate) * up)"] = (
            FLOAT * 3 * gate.size, lambda: torch.nn.functional.silu(gate_t) * up_t)
    return table


def measure():
    benchmark.require_gpu()
    results = {}
    for name, (bytes_moved, run) in runs(backend.xp).items():
        seconds = benchmark.seconds_per_call(run)
        results[name] = {"gb_per_s": benchmark.gigabytes_per_second(bytes_moved, seconds),
                         "microseconds": seconds * 1e6}
    return {**benchmark.measured_on(), "copy_bandwidth_gb_per_s": benchmark.copy_bandwidth() / 1e9,
            "shape": {"B": B, "T": T, "C": C, "H": H, "intermediate_size": INTERMEDIATE}, "results": results}


def table(measured):
    ceiling = measured["copy_bandwidth_gb_per_s"]
    results = measured["results"]
    lines = [f"{measured['device']}, {measured['date']}: copy bandwidth {ceiling:.0f} GB/s, {measured['shape']}"]
    lines += benchmark.bandwidth_rows({name: r["gb_per_s"] for name, r in results.items()}, ceiling,
                                      {name: r["microseconds"] / 1e6 for name, r in results.items()})
    return lines


if __name__ == "__main__":
    measured = measure()
    benchmark.report("llama", measured, table(measured))
