"""float64 numpy references that several test files compare with, one home each. Each is checked once against
central finite differences or the textbook formula: LayerNorm in tests/test_layernorm.py, GELU in
tests/test_gelu_residual.py.

    layer_norm(x, weight, bias, eps=1e-5) -> (y, mean, rstd)     over the last axis; bias None for none
    layer_norm_backward(dout, x, weight, eps=1e-5) -> (dx, dout · x̂), the per-row terms of dweight
    gelu(x, approximate)             "none" (erf) or "tanh" (GPT-2's)
    gelu_derivative(x, approximate)
"""

import math

import numpy as np

SQRT_2_OVER_PI = math.sqrt(2 / math.pi)
CUBIC = 0.044715                      # GELU's tanh form: tanh(√(2/π) (x + CUBIC x³))
erfc = np.vectorize(math.erfc, otypes=[np.float64])


def layer_norm(x, weight, bias, eps=1e-5):
    x = np.asarray(x, np.float64)
    mean = x.mean(axis=-1, keepdims=True)
    rstd = 1 / np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + eps)
    y = (x - mean) * rstd * weight + (0 if bias is None else bias)
    return y, mean[..., 0], rstd[..., 0]


def layer_norm_backward(dout, x, weight, eps=1e-5):
    dout, x = np.asarray(dout, np.float64), np.asarray(x, np.float64)
    mean = x.mean(axis=-1, keepdims=True)
    rstd = 1 / np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + eps)
    x_hat = (x - mean) * rstd
    g = weight * dout
    dx = rstd * (g - g.mean(axis=-1, keepdims=True) - x_hat * (g * x_hat).mean(axis=-1, keepdims=True))
    return dx, dout * x_hat


def gelu(x, approximate):
    if approximate == "tanh":
        u = SQRT_2_OVER_PI * (x + CUBIC * x**3)
        return x / (1 + np.exp(-2 * u))  # = x (1 + tanh u) / 2, without its cancellation for negative x
    return 0.5 * x * erfc(-x / math.sqrt(2))


def gelu_derivative(x, approximate):
    if approximate == "tanh":
        u = SQRT_2_OVER_PI * (x + CUBIC * x**3)
        half_one_plus_tanh = 1 / (1 + np.exp(-2 * u))
        return half_one_plus_tanh + 0.5 * x / np.cosh(u) ** 2 * SQRT_2_OVER_PI * (1 + 3 * CUBIC * x**2)
    return 0.5 * erfc(-x / math.sqrt(2)) + x * np.exp(-0.5 * x**2) / math.sqrt(2 * math.pi)
