"""Chapter 17a's graded exercises: RMSNorm's forward, a warp per row, and RoPE with the interleaved pairing."""

import numpy

from gpt2_cupy.exercises.checker import Exercise, Input, Output, Scalar, blocks

WARPS_PER_BLOCK = 8     # rmsnorm_forward: a warp per row, 8 rows a block of 256 threads
ROPE_THREADS = 256      # rope_interleaved: a thread per pair of channels


def _rmsnorm_arguments(size, rng):
    rows, columns = size["rows"], size["columns"]
    return [Output("out", (rows, columns)),
            Output("rstd", (rows,)),
            Input("x", rng.normal(0.5, 2.0, (rows, columns)).astype(numpy.float32)),
            Input("weight", rng.normal(1.0, 0.3, columns).astype(numpy.float32)),
            Scalar("rows", numpy.int32(rows)),
            Scalar("columns", numpy.int32(columns)),
            Scalar("eps", numpy.float32(1e-6))]


def _rmsnorm_reference(x, weight, rows, columns, eps):
    x = x.astype(numpy.float64)
    rstd = 1.0 / numpy.sqrt((x * x).mean(axis=1) + float(eps))
    return {"out": x * rstd[:, None] * weight.astype(numpy.float64), "rstd": rstd}


def _rope_arguments(size, rng):
    B, T, H, D = size["B"], size["T"], size["H"], size["D"]
    inv_freq = (1.0 / numpy.float32(10000.0) ** (numpy.arange(0, D, 2, dtype=numpy.float32) / numpy.float32(D)))
    return [Output("y", (B, T, H, D)),
            Input("x", rng.standard_normal((B, T, H, D), dtype=numpy.float32)),
            Input("inv_freq", inv_freq.astype(numpy.float32)),
            Scalar("pairs", numpy.int32(B * T * H * D // 2)),
            Scalar("T", numpy.int32(T)),
            Scalar("H", numpy.int32(H)),
            Scalar("D", numpy.int32(D))]


def _rope_reference(x, inv_freq, pairs, T, H, D):
    # The angles from the float32 frequencies the kernel gets, in float64: the kernel's float32 angle is off by
    # at most a few units in its last place, well inside atol at these positions.
    x = x.astype(numpy.float64)
    angles = numpy.arange(T)[:, None] * inv_freq.astype(numpy.float64)[None, :]       # (T, D/2)
    cos, sin = numpy.cos(angles)[None, :, None, :], numpy.sin(angles)[None, :, None, :]
    a, b = x[..., 0::2], x[..., 1::2]                                                   # adjacent channels
    y = numpy.empty_like(x)
    y[..., 0::2], y[..., 1::2] = a * cos - b * sin, a * sin + b * cos
    return {"y": y}


EXERCISES = [
    Exercise(
        id="17a.rmsnorm_forward", title="RMSNorm's forward, a warp per row", kernel="rmsnorm_forward",
        arguments=_rmsnorm_arguments,
        launch=lambda size: ((blocks(size["rows"], WARPS_PER_BLOCK),), (WARPS_PER_BLOCK * 32,)),
        reference=_rmsnorm_reference,
        sizes=({"rows": 1, "columns": 1}, {"rows": 5, "columns": 31}, {"rows": 9, "columns": 100},
               {"rows": 17, "columns": 257}),
        rtol=1e-5, atol=1e-6),
    Exercise(
        id="17a.rope_interleaved", title="RoPE with adjacent channels paired (Meta's llama/model.py)",
        kernel="rope_interleaved",
        arguments=_rope_arguments,
        launch=lambda size: ((blocks(size["B"] * size["T"] * size["H"] * size["D"] // 2, ROPE_THREADS),),
                             (ROPE_THREADS,)),
        reference=_rope_reference,
        sizes=({"B": 1, "T": 1, "H": 1, "D": 2}, {"B": 1, "T": 7, "H": 3, "D": 8}, {"B": 2, "T": 13, "H": 2, "D": 16},
               {"B": 1, "T": 33, "H": 4, "D": 64}),
        rtol=1e-5, atol=2e-5),
]
