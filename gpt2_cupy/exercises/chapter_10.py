"""Chapter 10's graded exercises: the gradient norm's first pass with loads in flight, and clipping fused
into the AdamW step."""

import numpy

from gpt2_cupy.exercises.checker import Exercise, Input, Output, Scalar, blocks

NORM_BLOCKS, NORM_THREADS = 8, 128   # a fixed grid, as the shipped norm's: the partial sums' count never changes
THREADS_PER_BLOCK = 256


def _partial_sums_arguments(size, rng):
    n = size["n"]
    return [Output("partial_sums", (NORM_BLOCKS,)),
            Input("grads", rng.standard_normal(n, dtype=numpy.float32)),
            Scalar("n", numpy.int32(n))]


def _partial_sums_reference(grads, n):
    # Element i belongs to block (i / NORM_THREADS) % NORM_BLOCKS: the grid-stride loop's share.
    owner = (numpy.arange(n) // NORM_THREADS) % NORM_BLOCKS
    squares = grads.astype(numpy.float64) ** 2
    return {"partial_sums": numpy.bincount(owner, weights=squares, minlength=NORM_BLOCKS)}


def _adamw_clipped_arguments(size, rng):
    n = size["n"]
    grads = rng.standard_normal(n, dtype=numpy.float32) * numpy.float32(size["gradient_scale"])
    norm = numpy.array([numpy.sqrt((grads.astype(numpy.float64) ** 2).sum())], dtype=numpy.float32)
    step = size["step"]
    return [Output("params", (n,), initial=rng.standard_normal(n, dtype=numpy.float32)),
            Output("m", (n,), initial=rng.standard_normal(n, dtype=numpy.float32) * numpy.float32(0.1)),
            Output("v", (n,), initial=rng.uniform(0.0, 0.1, n).astype(numpy.float32)),
            Input("grads", grads),
            Input("norm", norm),
            Scalar("max_norm", numpy.float32(1.0)),
            Scalar("lr", numpy.float32(1e-2)),
            Scalar("beta1", numpy.float32(0.9)),
            Scalar("beta2", numpy.float32(0.95)),
            Scalar("eps", numpy.float32(1e-8)),
            Scalar("weight_decay", numpy.float32(0.1)),
            Scalar("bias_correction1", numpy.float32(1 - 0.9**step)),
            Scalar("bias_correction2", numpy.float32(1 - 0.95**step)),
            Scalar("n", numpy.int32(n))]


def _adamw_clipped_reference(params, m, v, grads, norm, max_norm, lr, beta1, beta2, eps, weight_decay,
                             bias_correction1, bias_correction2, n):
    f = numpy.float64
    scale = min(1.0, f(max_norm) / (f(norm[0]) + 1e-6))
    g = grads.astype(f) * scale
    theta = params.astype(f) * (1 - f(lr) * f(weight_decay))
    m = f(beta1) * m.astype(f) + (1 - f(beta1)) * g
    v = f(beta2) * v.astype(f) + (1 - f(beta2)) * g * g
    theta = theta - f(lr) * (m / f(bias_correction1)) / (numpy.sqrt(v / f(bias_correction2)) + f(eps))
    return {"params": theta, "m": m, "v": v}


EXERCISES = [
    Exercise(
        id="10.gradient_norm_partial_sums", title="The gradient norm's first pass, four loads in flight per thread",
        kernel="gradient_norm_partial_sums",
        arguments=_partial_sums_arguments,
        launch=lambda size: ((NORM_BLOCKS,), (NORM_THREADS,)),
        reference=_partial_sums_reference,
        sizes=({"n": 1}, {"n": 1000}, {"n": 4097}, {"n": 20011}),
        rtol=1e-5),   # float32 sums of up to a few thousand positive terms, in another order than numpy's
    Exercise(
        id="10.adamw_clipped", title="Clipping fused into the AdamW step", kernel="adamw_clipped",
        arguments=_adamw_clipped_arguments,
        launch=lambda size: ((blocks(size["n"], THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,)),
        reference=_adamw_clipped_reference,
        # a norm far above max_norm (clipped) and one below it (left alone), at ragged sizes
        sizes=({"n": 1, "gradient_scale": 0.1, "step": 1}, {"n": 255, "gradient_scale": 1.0, "step": 3},
               {"n": 1000, "gradient_scale": 0.01, "step": 10}, {"n": 3001, "gradient_scale": 2.0, "step": 100}),
        rtol=1e-5, atol=1e-7),
]
