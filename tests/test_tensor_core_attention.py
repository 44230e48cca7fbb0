"""Attention on tensor cores in bf16, TF32 and 3xTF32 (gpt2_cupy.ops.tensor_core_attention) against float64 numpy.

The reference computes exactly, in float64, from the same bf16 (or float32) inputs. The kernels round in
known places, and every element of every result must lie within what those roundings can do (first order,
times 1.01 for the second-order terms). In bf16, with u = 2⁻⁸, bf16's unit roundoff (8 significant bits,
to nearest):

  out   P is rounded to bf16 before P V, each weight by at most u of itself: u Σ_j P_ij |v_j|; then the
        result is rounded to bf16: u |out_i|.
  lse   float32 throughout: the error of the scores it is the log-sum-exp of, and FLOAT32_SLACK (1 + |lse|).
  dv    P rounded before Pᵀ dO: u Σ_i P_ij |dout_i|, and the output's rounding u |dv_j|.
  dq    dS = P ⊙ (dP - row_dot) is rounded to bf16 before dS K and dSᵀ Q: u |dS_ij| per term; row_dot
  dk    comes from the bf16 out the forward returned, not the exact O: P_ij |dout_i · (out_i - O_i)| per
        term; then the output's rounding, u |dq_i| (u |dk_j|).
In TF32 (float32 inputs, Format TF32 below) the tensor cores read q, k, v and dout cut toward zero to 11
significant bits: the reference starts from those values (tf32_read), as the bf16 one starts from the bf16
inputs. P and dS are rounded to TF32 to nearest (u = 2⁻¹¹), and the outputs are float32 (FLOAT32_SLACK).
row_dot alone reads the whole float32 dout: 2⁻¹⁰ of Σ |dout ⊙ out| apart from what the reference's uses.
Besides, every float32 sum of products on a tensor core is within MMA_UNIT of the sum of its terms'
magnitudes per mma.sync (as in tests/test_tensor_core_gemm.py), which moves each score by δS and each
weight P by δS relative; the rest of the float32 work (exp2f, sums over T, the online rescaling) stays
within FLOAT32_SLACK relative. On the CPU executor the largest error of each result is 0.25 to 0.9 of
its bound (lse: far less, its bound allows float32 sums over T in any order); a kernel that cuts P toward
zero instead of rounding it to nearest, skips a rescaling of the running sum, or is 0.4 % off fails (in
TF32: cuts P toward zero, or is 0.05 % off).

3xTF32 (precision="highest") is checked by its accuracy instead: out, lse, dq, dk and dv within
THREE_TF32_TOLERANCE of float64 (max |error| / max |reference|, the inputs exact in both), and no further from
it than twice the error of chapter 08's float32 kernels on the same inputs.

Sequence lengths 1, 17, 33, 50, 100 and 200 are not multiples of the kernels' 16-row fragments, their 32- and
64-row tiles or their blocks of 64 or 128 rows (4 warps of one or two 16-row strips); 200 keys are four
tiles, so the two-stage pipeline refills each stage. Grouped-query attention:
H = 4 query heads over H_kv = 1 or 2 key/value heads.
"""

import math
from typing import NamedTuple

import numpy as np
import pytest
from ml_dtypes import bfloat16

from gpt2_cupy import backend
from gpt2_cupy.ops import tensor_core_attention as attention_ops
from gpt2_cupy.ops.attention import attention_backward, attention_forward
from gpt2_cupy.ops.tensor_core_attention import tensor_core_attention_backward, tensor_core_attention_forward
from gpt2_cupy.testing import finite_difference_gradient, relative_error, torch_or_none

BF16_UNIT = 2.0 ** -8         # bf16's unit roundoff
MMA_UNIT = 2.0 ** -20         # a tensor core's float32 sum, of the sum of magnitudes, per mma.sync
FLOAT32_SLACK = 2.0 ** -16    # the rest of the float32 work, relative
SECOND_ORDER = 1.01


def tf32_read(x):
    """float32 x as a TF32 tensor core reads it: its upper 19 bits (rounded toward zero), as float64."""
    return (np.asarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)


class Format(NamedTuple):
    """How the kernels of one element type read their inputs and where they round, as relative errors."""
    dtype: type
    read: object           # an input as the tensor cores read it, as float64
    input_unit: float      # of that reading, relative (row_dot reads the whole input)
    weight_unit: float     # P and dS, rounded as the next product's input
    output_unit: float     # out, dq, dk, dv as stored
    k_per_mma: int         # elements of k one mma.sync sums


BF16 = Format(bfloat16, lambda x: np.asarray(x, np.float64), 0.0, BF16_UNIT, BF16_UNIT, 16)
TF32 = Format(np.float32, tf32_read, 2.0 ** -10, 2.0 ** -11, FLOAT32_SLACK, 8)
FORMATS = {"bf16": BF16, "tf32": TF32}


# ---- the float64 reference --------------------------------------------------------------------------------

def repeat_kv(x, heads):
    """(B, H_kv, T, d) -> (B, H, T, d): key/value head h // (H // H_kv) for query head h."""
    return np.repeat(x, heads // x.shape[1], axis=1)


def group_sum(x, kv_heads):
    """(B, H, T, d) -> (B, H_kv, T, d): the sum over the query heads that share each key/value head."""
    B, H, T, d = x.shape
    return x.reshape(B, kv_heads, H // kv_heads, T, d).sum(axis=2)


def reference_probabilities(q, k, causal, scale):
    """P (B, H, T, T) and lse (B, H, T) in float64, k already repeated per query head."""
    T = q.shape[-2]
    scores = scale * q @ np.swapaxes(k, -1, -2)
    if causal:
        scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
    largest = scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores - largest)
    total = weights.sum(axis=-1, keepdims=True)
    return weights / total, (largest + np.log(total))[..., 0]


def reference_forward(q, k, v, causal=True, scale=None):
    """(out, lse) in float64 from float64 q (B, H, T, d) and k, v (B, H_kv, T, d)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    p, lse = reference_probabilities(q, repeat_kv(k, q.shape[1]), causal, scale)
    return p @ repeat_kv(v, q.shape[1]), lse


def reference_backward(dout, q, k, v, causal=True, scale=None):
    """(dq, dk, dv) in float64, from the graph: dV = Pᵀ dO, dP = dO Vᵀ, dS = P ⊙ (dP - rowsum(dP ⊙ P)),
    dQ = scale dS K, dK = scale dSᵀ Q; dk and dv summed over the query heads of each key/value head."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    H, H_kv = q.shape[1], k.shape[1]
    k_heads, v_heads = repeat_kv(k, H), repeat_kv(v, H)
    p, _ = reference_probabilities(q, k_heads, causal, scale)
    dp = dout @ np.swapaxes(v_heads, -1, -2)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    dv = np.swapaxes(p, -1, -2) @ dout
    return scale * ds @ k_heads, group_sum(scale * np.swapaxes(ds, -1, -2) @ q, H_kv), group_sum(dv, H_kv)


def product_errors(a, b, fmt):
    """How far each element of a bᵀ summed on tensor cores may be from the exact one: a float32 sum per mma.sync."""
    mmas = a.shape[-1] // fmt.k_per_mma + 1
    return MMA_UNIT * mmas * np.abs(a) @ np.swapaxes(np.abs(b), -1, -2)


def score_errors(q, k, scale, fmt=BF16):
    """δS (B, H, T, T): how far a score of q, k summed on tensor cores may be from the exact one."""
    return abs(scale) * product_errors(q, k, fmt)


def weight_errors(p, lse, score_error):
    """η (B, H, T, T): the relative error of each float32 weight P before rounding: its score's error, the
    error of its row's normalisation (a P-weighted mean of the scores' errors), and FLOAT32_SLACK."""
    row_error = (p * score_error).sum(axis=-1, keepdims=True)
    return score_error + row_error + FLOAT32_SLACK * (1 + np.abs(lse[..., None]))


def forward_bounds(q, k, v, causal, scale, fmt=BF16):
    """(out, lse, bound on out, bound on lse), float64, from float64 copies of the inputs."""
    H = q.shape[1]
    k_heads, v_heads = repeat_kv(k, H), repeat_kv(v, H)
    p, lse = reference_probabilities(q, k_heads, causal, scale)
    out = p @ v_heads
    score_error = score_errors(q, k_heads, scale, fmt)
    eta = weight_errors(p, lse, score_error)
    out_bound = (p * (fmt.weight_unit + eta)) @ np.abs(v_heads) + fmt.output_unit * np.abs(out)
    lse_bound = (p * score_error).sum(axis=-1) + FLOAT32_SLACK * (1 + np.abs(lse))
    return out, lse, SECOND_ORDER * out_bound, SECOND_ORDER * lse_bound


def backward_bounds(dout, q, k, v, kernel_out, causal, scale, fmt=BF16):
    """(dq, dk, dv) and a bound on each, float64; kernel_out is the out the backward is given."""
    H, H_kv, T = q.shape[1], k.shape[1], q.shape[2]
    k_heads, v_heads = repeat_kv(k, H), repeat_kv(v, H)
    p, lse = reference_probabilities(q, k_heads, causal, scale)
    exact_out = p @ v_heads
    dp = dout @ np.swapaxes(v_heads, -1, -2)
    row_dot = (dout * exact_out).sum(axis=-1, keepdims=True)
    ds = p * (dp - row_dot)
    eta = weight_errors(p, lse, score_errors(q, k_heads, scale, fmt))
    # row_dot as the kernel forms it: from kernel_out, in float32
    row_dot_error = np.abs((dout * (kernel_out - exact_out)).sum(axis=-1, keepdims=True))
    row_dot_error += (FLOAT32_SLACK + fmt.input_unit) * (np.abs(dout) * np.abs(kernel_out)).sum(axis=-1, keepdims=True)
    dp_error = product_errors(dout, v_heads, fmt)
    sum_error = MMA_UNIT * (T // fmt.k_per_mma + 1)   # of a sum over T on tensor cores, relative to its magnitudes
    ds_error = (fmt.weight_unit + eta + sum_error) * np.abs(ds) + p * (dp_error + row_dot_error)
    dq = scale * ds @ k_heads
    dk = group_sum(scale * np.swapaxes(ds, -1, -2) @ q, H_kv)
    dv = group_sum(np.swapaxes(p, -1, -2) @ dout, H_kv)
    dq_bound = abs(scale) * ds_error @ np.abs(k_heads) + fmt.output_unit * np.abs(dq)
    dk_bound = group_sum(abs(scale) * np.swapaxes(ds_error, -1, -2) @ np.abs(q), H_kv) + fmt.output_unit * np.abs(dk)
    dv_weights = (fmt.weight_unit + eta + sum_error) * p
    dv_bound = group_sum(np.swapaxes(dv_weights, -1, -2) @ np.abs(dout), H_kv) + fmt.output_unit * np.abs(dv)
    return (dq, dk, dv), tuple(SECOND_ORDER * b for b in (dq_bound, dk_bound, dv_bound))


def assert_within(name, got, expected, bound):
    error = np.abs(np.asarray(got, np.float64) - expected)
    worst = np.unravel_index(np.argmax(error - bound), error.shape)
    assert np.all(error <= bound), (f"{name}: error {error[worst]:.3g} above the bound {bound[worst]:.3g} at "
                                    f"{worst}; largest error {error.max():.3g}")


def bf16_inputs(rng, B, H, H_kv, T, d, dtype=bfloat16):
    """q, k, v, dout as bf16 (or dtype) numpy arrays (q, dout: (B, H, T, d); k, v: (B, H_kv, T, d))."""
    shapes = [(B, H, T, d), (B, H_kv, T, d), (B, H_kv, T, d), (B, H, T, d)]
    return [rng.standard_normal(shape).astype(dtype) for shape in shapes]


def wide(*arrays):
    return [np.asarray(a, np.float64) for a in arrays]


# ---- the reference itself --------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [True, False])
def test_reference_backward_matches_finite_differences(rng, causal):
    q, dout = rng.standard_normal((2, 1, 4, 3, 4))   # B = 1, H = 4 query heads
    k, v = rng.standard_normal((2, 1, 2, 3, 4))      # H_kv = 2
    scale = 0.7

    def loss():
        return float((dout * reference_forward(q, k, v, causal, scale)[0]).sum())

    for name, array, gradient in zip("qkv", (q, k, v), reference_backward(dout, q, k, v, causal, scale)):
        error = relative_error(gradient, finite_difference_gradient(loss, array))
        assert error < 1e-8, f"d{name}: {error:.3g}"


# ---- the kernels against it -------------------------------------------------------------------------------

CASES = [(1, 2, 2, T, d, causal) for T in (1, 17, 64, 100) for d in (64, 128) for causal in (True, False)]
CASES += [(2, 4, 1, 100, 64, True), (2, 4, 2, 17, 128, True), (1, 4, 2, 64, 128, False), (1, 4, 1, 100, 128, False),
          (1, 2, 1, 200, 64, False), (1, 2, 2, 200, 128, True), (2, 2, 1, 33, 32, True), (1, 4, 2, 50, 32, False)]


# TF32 on fewer cases: the CPU executor runs its twice as many mma.sync twice as long
TF32_CASES = [(1, 2, 2, 17, 64, True), (1, 2, 2, 100, 128, False), (2, 4, 1, 100, 64, True), (1, 2, 1, 200, 64, False),
              (2, 2, 1, 33, 32, True), (1, 4, 2, 64, 128, True)]


@pytest.mark.parametrize("fmt, B, H, H_kv, T, d, causal",
                         [("bf16", *case) for case in CASES] + [("tf32", *case) for case in TF32_CASES])
def test_matches_float64_within_the_rounding_bounds(rng, to_device, to_host, fmt, B, H, H_kv, T, d, causal):
    fmt = FORMATS[fmt]
    q, k, v, dout = bf16_inputs(rng, B, H, H_kv, T, d, fmt.dtype)
    device_q, device_k, device_v, device_dout = (to_device(a) for a in (q, k, v, dout))
    out, lse = tensor_core_attention_forward(device_q, device_k, device_v, causal=causal)
    assert out.dtype == fmt.dtype and out.shape == q.shape and lse.dtype == np.float32 and lse.shape == (B, H, T)
    scale = 1.0 / math.sqrt(d)
    q64, k64, v64, dout64 = (fmt.read(x) for x in (q, k, v, dout))
    expected_out, expected_lse, out_bound, lse_bound = forward_bounds(q64, k64, v64, causal, scale, fmt)
    assert_within("out", to_host(out), expected_out, out_bound)
    assert_within("lse", to_host(lse), expected_lse, lse_bound)

    grads = tensor_core_attention_backward(device_dout, device_q, device_k, device_v, out, lse, causal=causal)
    expected, bounds = backward_bounds(dout64, q64, k64, v64, wide(to_host(out))[0], causal, scale, fmt)
    for name, got, reference, bound, like in zip(("dq", "dk", "dv"), grads, expected, bounds, (q, k, v)):
        assert got.dtype == fmt.dtype and got.shape == like.shape
        assert_within(name, to_host(got), reference, bound)


# ---- 3xTF32: float32's accuracy ----------------------------------------------------------------------------

# max |error| / max |reference| of out, lse, dq, dk and dv against float64 from the same float32 inputs. The
# largest over every result of THREE_TF32_CASES and ACCURACY_CASES: 7.1e-7 on the CPU executor, 6.0e-7 on an
# H200 (chapter 08's float32 kernels 1.3e-6 and 9.2e-7; TF32 2.7e-3).
THREE_TF32_TOLERANCE = 3e-6
THREE_TF32_CASES = TF32_CASES + [(1, 4, 2, 50, 32, False), (1, 2, 2, 130, 128, True)]
# Chapter 08's float32 kernels on the same inputs: 3xTF32's error of each result at most this many times theirs.
# Measured on ACCURACY_CASES: at most 1.26 on the CPU executor, 0.90 on an H200; up to 1.8 on an H200 at T = 17
# (THREE_TF32_CASES' first), where the float32 kernels' sums are shortest.
AS_ACCURATE_AS_FLOAT32 = 2.0
ACCURACY_CASES = [(1, 2, 2, 100, 64, True), (1, 4, 2, 90, 64, False), (1, 2, 2, 130, 128, True),
                  (2, 2, 1, 70, 32, False)]


def float32_errors(q, k, v, dout, results, causal):
    """{name: max |error| / max |reference|} of results (out, lse, dq, dk, dv) against float64."""
    q64, k64, v64, dout64 = wide(q, k, v, dout)
    references = (*reference_forward(q64, k64, v64, causal), *reference_backward(dout64, q64, k64, v64, causal))
    return {name: relative_error(got, reference)
            for name, got, reference in zip(("out", "lse", "dq", "dk", "dv"), results, references)}


def three_tf32_results(to_device, to_host, q, k, v, dout, causal):
    """out, lse, dq, dk, dv of the tensor-core kernels at precision "highest", as numpy arrays."""
    device_q, device_k, device_v, device_dout = (to_device(a) for a in (q, k, v, dout))
    out, lse = tensor_core_attention_forward(device_q, device_k, device_v, causal=causal, precision="highest")
    assert out.dtype == lse.dtype == np.float32 and out.shape == q.shape
    gradients = tensor_core_attention_backward(device_dout, device_q, device_k, device_v, out, lse, causal=causal,
                                               precision="highest")
    assert all(g.dtype == np.float32 and g.shape == like.shape for g, like in zip(gradients, (q, k, v)))
    return [to_host(x) for x in (out, lse, *gradients)]


@pytest.mark.parametrize("B, H, H_kv, T, d, causal", THREE_TF32_CASES)
def test_3xtf32_has_float32_accuracy(rng, to_device, to_host, B, H, H_kv, T, d, causal):
    q, k, v, dout = bf16_inputs(rng, B, H, H_kv, T, d, np.float32)
    errors = float32_errors(q, k, v, dout, three_tf32_results(to_device, to_host, q, k, v, dout, causal), causal)
    assert all(error < THREE_TF32_TOLERANCE for error in errors.values()), errors


@pytest.mark.parametrize("B, H, H_kv, T, d, causal", ACCURACY_CASES)
def test_3xtf32_is_as_accurate_as_chapter_08s_float32_kernels(rng, to_device, to_host, B, H, H_kv, T, d, causal):
    """The same float32 inputs through 3xTF32 and through chapter 08's float32 kernels (gpt2_cupy.ops.attention),
    each result's error against float64 compared."""
    q, k, v, dout = bf16_inputs(rng, B, H, H_kv, T, d, np.float32)
    three_tf32 = float32_errors(q, k, v, dout, three_tf32_results(to_device, to_host, q, k, v, dout, causal), causal)
    device_q, device_k, device_v, device_dout = (to_device(a) for a in (q, k, v, dout))
    out, lse = attention_forward(device_q, device_k, device_v, causal=causal)
    gradients = attention_backward(device_dout, device_q, device_k, device_v, out, lse, causal=causal)
    float32 = float32_errors(q, k, v, dout, [to_host(x) for x in (out, lse, *gradients)], causal)
    for name in ("out", "dq", "dk", "dv"):   # lse comes from the same float32 softmax in both
        assert three_tf32[name] <= AS_ACCURATE_AS_FLOAT32 * float32[name], (
            f"{name}: 3xTF32's error {three_tf32[name]:.3g}, the float32 kernels' {float32[name]:.3g}")


def test_precision_argument(rng, to_device, to_host):
    """float32 inputs: None is "high" (TF32, the same bits), "highest" 3xTF32; bf16 inputs run as bf16 whatever
    the precision; other names are PyTorch's ValueError, and "medium" asks for bf16 inputs."""
    q, k, v, dout = (to_device(a) for a in bf16_inputs(rng, 1, 2, 2, 20, 32, np.float32))
    default, lse = tensor_core_attention_forward(q, k, v)
    high, _ = tensor_core_attention_forward(q, k, v, precision="high")
    assert np.array_equal(to_host(default), to_host(high))
    gradients = tensor_core_attention_backward(dout, q, k, v, default, lse)
    high_gradients = tensor_core_attention_backward(dout, q, k, v, default, lse, precision="high")
    assert all(np.array_equal(to_host(a), to_host(b)) for a, b in zip(gradients, high_gradients))
    highest, _ = tensor_core_attention_forward(q, k, v, precision="highest")
    assert not np.array_equal(to_host(highest), to_host(default))
    q16, k16, v16 = (to_device(to_host(x).astype(bfloat16)) for x in (q, k, v))
    plain, _ = tensor_core_attention_forward(q16, k16, v16)
    for precision in ("highest", "high", "medium"):
        got, _ = tensor_core_attention_forward(q16, k16, v16, precision=precision)
        assert np.array_equal(bits(to_host(got)), bits(to_host(plain)))
    with pytest.raises(ValueError, match=r"tensor_core_attention_forward: precision must be one of \('highest', "
                                         r"'high', 'medium'\) or None, got 'low'"):
        tensor_core_attention_forward(q16, k16, v16, precision="low")
    with pytest.raises(ValueError, match="tensor_core_attention_backward: precision 'medium' multiplies in bf16"):
        tensor_core_attention_backward(dout, q, k, v, default, lse, precision="medium")
    with pytest.raises(ValueError, match="tensor_core_attention_forward: precision 'medium' multiplies in bf16"):
        tensor_core_attention_forward(q, k, v, precision="medium")


def test_scale_and_out(rng, to_device, to_host):
    """A scale other than 1/√d (negative too: masked keys stay hidden) reaches every kernel; out= is
    filled and returned."""
    q, k, v, dout = bf16_inputs(rng, 1, 2, 1, 40, 64)
    q64, k64, v64, dout64 = wide(q, k, v, dout)
    for scale in (0.3, -0.2):
        out = to_device(np.full(q.shape, np.nan, dtype=bfloat16))
        returned, lse = tensor_core_attention_forward(*(to_device(a) for a in (q, k, v)), scale=scale, out=out)
        assert returned is out
        expected_out, expected_lse, out_bound, lse_bound = forward_bounds(q64, k64, v64, True, scale)
        assert_within("out", to_host(out), expected_out, out_bound)
        assert_within("lse", to_host(lse), expected_lse, lse_bound)
        grads = tensor_core_attention_backward(*(to_device(a) for a in (dout, q, k, v)), out, lse, scale=scale)
        expected, bounds = backward_bounds(dout64, q64, k64, v64, wide(to_host(out))[0], True, scale)
        for name, got, reference, bound in zip(("dq", "dk", "dv"), grads, expected, bounds):
            assert_within(name, to_host(got), reference, bound)


@pytest.mark.parametrize("H_kv", [1, 2])
def test_grouped_query_attention_equals_repeated_heads(rng, to_device, to_host, H_kv):
    """K and V shared by H / H_kv query heads give what the same K and V repeated per head give: out, lse and
    dq bit for bit; dk and dv the sums over each group's heads (each head's rounded to bf16 there, the
    group's sum rounded once here)."""
    H, T, d = 4, 70, 64
    q, k, v, dout = bf16_inputs(rng, 2, H, H_kv, T, d)
    grouped = [to_device(a) for a in (q, k, v)]
    repeated = [to_device(a) for a in (q, repeat_kv(k, H), repeat_kv(v, H))]
    out, lse = tensor_core_attention_forward(*grouped)
    out_repeated, lse_repeated = tensor_core_attention_forward(*repeated)
    assert np.array_equal(to_host(out).view(np.uint16), to_host(out_repeated).view(np.uint16))
    assert np.array_equal(to_host(lse), to_host(lse_repeated))
    dq, dk, dv = tensor_core_attention_backward(to_device(dout), *grouped, out, lse)
    dq_repeated, dk_heads, dv_heads = tensor_core_attention_backward(to_device(dout), *repeated, out, lse)
    assert np.array_equal(to_host(dq).view(np.uint16), to_host(dq_repeated).view(np.uint16))
    for name, got, per_head in (("dk", dk, dk_heads), ("dv", dv, dv_heads)):
        per_head = wide(to_host(per_head))[0]
        got = wide(to_host(got))[0]
        summed = group_sum(per_head, H_kv)
        bound = BF16_UNIT * (group_sum(np.abs(per_head), H_kv) + np.abs(got)) * SECOND_ORDER
        assert_within(name, got, summed, bound + FLOAT32_SLACK * group_sum(np.abs(per_head), H_kv))


def test_backward_is_deterministic(rng, to_device, to_host):
    arrays = [to_device(a) for a in bf16_inputs(rng, 1, 4, 2, 100, 64)]
    q, k, v, dout = arrays
    out, lse = tensor_core_attention_forward(q, k, v)
    first = [to_host(g).view(np.uint16) for g in tensor_core_attention_backward(dout, q, k, v, out, lse)]
    second = [to_host(g).view(np.uint16) for g in tensor_core_attention_backward(dout, q, k, v, out, lse)]
    assert all(np.array_equal(a, b) for a, b in zip(first, second))


def test_keys_past_the_block_are_never_read(rng, to_device, to_host):
    """Causal: NaN in every key and value after position 64 (the first block of queries, and the first key
    tile). The first 64 queries must not see them, so the kernels skip them rather than multiply them by a
    zero weight (0 · NaN is NaN); out and dq of those queries are finite and right."""
    rows, T, d = 64, 90, 64
    q, k, v, dout = bf16_inputs(rng, 1, 2, 2, T, d)
    k[:, :, rows:], v[:, :, rows:] = np.nan, np.nan
    device = [to_device(a) for a in (q, k, v, dout)]
    out, lse = tensor_core_attention_forward(*device[:3])
    q64, k64, v64, dout64 = wide(q[:, :, :rows], k[:, :, :rows], v[:, :, :rows], dout[:, :, :rows])
    expected_out, _, out_bound, _ = forward_bounds(q64, k64, v64, True, 1 / math.sqrt(d))
    assert_within("out", to_host(out)[:, :, :rows], expected_out, out_bound)
    dq, _, _ = tensor_core_attention_backward(device[3], *device[:3], out, lse)
    (expected_dq, _, _), (dq_bound, _, _) = backward_bounds(dout64, q64, k64, v64, wide(to_host(out)[:, :, :rows])[0],
                                                            True, 1 / math.sqrt(d))
    assert_within("dq", to_host(dq)[:, :, :rows], expected_dq, dq_bound)


@pytest.mark.parametrize("fmt", ["bf16", "tf32", "3xtf32"])
@pytest.mark.parametrize("kernel", ["forward", "dk_dv", "dq"])
def test_every_tile_choice(rng, to_device, to_host, kernel, fmt):
    """Each kernel launched directly with every candidate shape that bench/tensor_core_attention.py times
    (the op uses one per format and d), on 100 positions (causal) and 2 query heads per key/value head; the
    backward passes from the op's forward. bf16 and TF32 within their rounding bounds, 3xTF32 within
    THREE_TF32_TOLERANCE."""
    B, H, H_kv, T, d = 1, 4, 2, 100, 64
    three_tf32 = fmt == "3xtf32"
    precision, kernel_format = ("highest", "Tf32x3") if three_tf32 else (None, None)
    fmt = TF32 if three_tf32 else FORMATS[fmt]
    q, k, v, dout = bf16_inputs(rng, B, H, H_kv, T, d, fmt.dtype)
    xp, scale = backend.xp, np.float32(1 / math.sqrt(d))
    device_q, device_k, device_v, device_dout = (to_device(a) for a in (q, k, v, dout))
    out, lse = tensor_core_attention_forward(device_q, device_k, device_v, precision=precision)
    row_dot = xp.empty((B, H, T), np.float32)
    attention_ops._row_dot(row_dot, device_dout, out)
    names = ("out", "lse", "dq", "dk", "dv")
    if three_tf32:
        q64, k64, v64, dout64 = wide(q, k, v, dout)
        references = (*reference_forward(q64, k64, v64, True, scale), *reference_backward(dout64, q64, k64, v64,
                                                                                          True, scale))
        expected, bounds = dict(zip(names, references)), dict.fromkeys(names)
    else:
        q64, k64, v64, dout64 = (fmt.read(x) for x in (q, k, v, dout))
        expected_out, expected_lse, out_bound, lse_bound = forward_bounds(q64, k64, v64, True, scale, fmt)
        expected_gradients, gradient_bounds = backward_bounds(dout64, q64, k64, v64, wide(to_host(out))[0], True,
                                                              scale, fmt)
        expected = dict(zip(names, (expected_out, expected_lse, *expected_gradients)))
        bounds = dict(zip(names, (out_bound, lse_bound, *gradient_bounds)))

    def check(name, got, shape):
        if three_tf32:
            error = relative_error(to_host(got), expected[name])
            assert error < THREE_TF32_TOLERANCE, f"{name}, {shape}: relative error {error:.3g}"
        else:
            assert_within(f"{name}, {shape}", to_host(got), expected[name], bounds[name])

    for warps, tile, strips in attention_ops.TILE_CANDIDATES[kernel]:
        shape = f"{warps} warps of {strips} strips, tile {tile}"
        if kernel == "forward":
            out, lse = xp.empty(q.shape, fmt.dtype), xp.empty((B, H, T), np.float32)
            attention_ops._forward(out, lse, device_q, device_k, device_v, True, scale, warps, tile, strips,
                                   kernel_format)
            check("out", out, shape)
            check("lse", lse, shape)
        elif kernel == "dk_dv":
            dk, dv = xp.empty(k.shape, fmt.dtype), xp.empty(v.shape, fmt.dtype)
            attention_ops._dk_dv(dk, dv, device_dout, device_q, device_k, device_v, lse, row_dot, True, scale,
                                 warps, tile, strips, kernel_format)
            check("dk", dk, shape)
            check("dv", dv, shape)
        else:
            dq = xp.empty(q.shape, fmt.dtype)
            attention_ops._dq(dq, device_dout, device_q, device_k, device_v, lse, row_dot, True, scale, warps, tile,
                              strips, kernel_format)
            check("dq", dq, shape)


def bits(array):
    return np.asarray(array).view(np.uint16)


@pytest.mark.parametrize("H_kv", [4, 2])
def test_heads_read_and_written_where_they_lie(rng, to_device, to_host, H_kv):
    """q, k, v as the (B, H, T, d) views of one (B, T, (H + 2 H_kv) d) product's output, and dout as the view
    of a (B, T, H d) gradient, give the bits their contiguous copies give. out lies as (B, T, H d), ready for
    the next product; dq, dk, dv lie in one new (B, T, (H + 2 H_kv) d) array, where q, k, v lay in theirs."""
    from gpt2_cupy.ops.arrays import storage_of
    B, H, T, d = 2, 4, 50, 64
    widths = (H * d, H_kv * d, H_kv * d)
    qkv = rng.standard_normal((B, T, sum(widths))).astype(bfloat16)
    dy = rng.standard_normal((B, T, H * d)).astype(bfloat16)
    device_qkv, device_dy = to_device(qkv), to_device(dy)
    starts = np.cumsum((0,) + widths)
    views = [device_qkv[..., start:start + width].reshape(B, T, width // d, d).transpose(0, 2, 1, 3)
             for start, width in zip(starts, widths)]
    dout_view = device_dy.reshape(B, T, H, d).transpose(0, 2, 1, 3)
    copies = [to_device(np.ascontiguousarray(to_host(x))) for x in views + [dout_view]]

    out, lse = tensor_core_attention_forward(*views)
    out_copied, lse_copied = tensor_core_attention_forward(*copies[:3])
    assert np.array_equal(bits(to_host(out)), bits(to_host(out_copied)))
    assert np.array_equal(to_host(lse), to_host(lse_copied))
    assert out.transpose(0, 2, 1, 3).flags.c_contiguous                  # (B, T, H, d) in memory

    gradients = tensor_core_attention_backward(dout_view, *views, out, lse)
    copied = tensor_core_attention_backward(copies[3], *copies[:3], out_copied, lse_copied)
    for name, got, expected in zip(("dq", "dk", "dv"), gradients, copied):
        assert np.array_equal(bits(to_host(got)), bits(to_host(expected))), name
    whole = storage_of(gradients[0])
    assert whole.shape == qkv.shape and all(storage_of(g) is whole for g in gradients)
    joined = np.concatenate([to_host(g).transpose(0, 2, 1, 3).reshape(B, T, -1) for g in copied], axis=-1)
    assert np.array_equal(bits(to_host(whole)), bits(joined))


def test_gradients_of_overlapping_or_partial_views_get_arrays_of_their_own(to_device):
    """k and v that are one array, or views that leave part of their storage out, must not share a gradient
    buffer: each gets a C-contiguous array of its own."""
    from gpt2_cupy.ops.arrays import empty_like_views, storage_of
    kv = to_device(np.zeros((1, 2, 8, 64), bfloat16))
    dk, dv = empty_like_views(kv, kv)
    assert dk.flags.c_contiguous and dv.flags.c_contiguous and storage_of(dk) is not storage_of(dv)
    packed = to_device(np.zeros((1, 8, 3 * 128), bfloat16))
    q, k = (packed[..., start:start + 128].reshape(1, 8, 2, 64).transpose(0, 2, 1, 3) for start in (0, 128))
    dq, dk = empty_like_views(q, k)
    assert dq.flags.c_contiguous and dk.flags.c_contiguous and storage_of(dq) is not storage_of(dk)


def test_a_layout_the_kernels_cannot_read_is_copied_first(rng, to_device, to_host):
    """q whose head dimension is not contiguous (a (B, H, d, T) array seen as (B, H, T, d)) is copied, not
    misread: the same bits as its contiguous copy."""
    q, k, v, _ = bf16_inputs(rng, 1, 2, 2, 40, 64)
    q_columns = to_device(np.ascontiguousarray(q.transpose(0, 1, 3, 2))).transpose(0, 1, 3, 2)
    out, _ = tensor_core_attention_forward(q_columns, to_device(k), to_device(v))
    expected, _ = tensor_core_attention_forward(*(to_device(a) for a in (q, k, v)))
    assert np.array_equal(bits(to_host(out)), bits(to_host(expected)))


def test_split_heads_through_the_tape(rng, to_device, to_host):
    """GPT-2's attention block in bf16 (split, view, transpose, attention, transpose back): the gradient of the
    q, k, v product's output has the bits that the same block with every view copied to contiguous gives."""
    from gpt2_cupy import functional as F
    from gpt2_cupy.autograd import Tensor
    B, H, T, d = 1, 2, 40, 64
    C = H * d
    qkv_host = rng.standard_normal((B, T, 3 * C)).astype(bfloat16)
    dy = Tensor(to_device(rng.standard_normal((B, T, C)).astype(bfloat16)))

    def block(copy):
        qkv = Tensor(to_device(qkv_host), requires_grad=True)
        heads = [x.view(B, T, H, d).transpose(1, 2) for x in qkv.split(C, dim=2)]
        if copy:
            heads = [x.contiguous().clone() for x in heads]
        y = F.scaled_dot_product_attention(*heads, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        (y * dy).sum().backward()
        return to_host(y.data), to_host(qkv.grad)

    (y, grad), (y_copied, grad_copied) = block(False), block(True)
    assert np.array_equal(bits(y), bits(y_copied)) and np.array_equal(bits(grad), bits(grad_copied))


@pytest.mark.parametrize("d", attention_ops.HEAD_SIZES)
def test_row_dot_of_views(rng, to_device, to_host, d):
    """rowsum(dout ⊙ out), dout the (B, H, T, d) view of a (B, T, H d) gradient and out contiguous, d / 8 lanes
    a row: against float64, within float32's rounding of a d-term sum."""
    B, H, T = 2, 3, 21
    dy = rng.standard_normal((B, T, H * d)).astype(bfloat16)
    out = rng.standard_normal((B, H, T, d)).astype(bfloat16)
    dout = to_device(dy).reshape(B, T, H, d).transpose(0, 2, 1, 3)
    row_dot = backend.xp.empty((B, H, T), np.float32)
    attention_ops._row_dot(row_dot, dout, to_device(out))
    terms = dy.astype(np.float64).reshape(B, T, H, d).transpose(0, 2, 1, 3) * out.astype(np.float64)
    assert_within("row_dot", to_host(row_dot), terms.sum(-1), d * 2.0 ** -24 * np.abs(terms).sum(-1))


def test_bad_arguments(to_device):
    def zeros(shape, dtype=bfloat16):
        return to_device(np.zeros(shape, dtype))

    q, kv = zeros((1, 4, 8, 64)), zeros((1, 2, 8, 64))
    with pytest.raises(TypeError, match="tensor_core_attention_forward: q has dtype float16; it must be bfloat16 or "
                                        "float32"):
        tensor_core_attention_forward(zeros((1, 4, 8, 64), np.float16), kv, kv)
    with pytest.raises(TypeError, match="tensor_core_attention_forward: k has dtype bfloat16"):
        tensor_core_attention_forward(zeros((1, 4, 8, 64), np.float32), kv, kv)
    with pytest.raises(ValueError, match="head size d .* must be one of"):
        tensor_core_attention_forward(*(zeros((1, 2, 8, 48)),) * 3)
    with pytest.raises(ValueError, match="H must be a multiple of H_kv"):
        tensor_core_attention_forward(zeros((1, 3, 8, 64)), kv, kv)
    with pytest.raises(ValueError, match="k has shape .* T = 9"):
        tensor_core_attention_forward(q, zeros((1, 2, 9, 64)), kv)
    with pytest.raises(ValueError, match="v has shape"):
        tensor_core_attention_forward(q, kv, zeros((1, 1, 8, 64)))
    with pytest.raises(ValueError, match="must have shape"):
        tensor_core_attention_forward(zeros((4, 8, 64)), kv, kv)
    with pytest.raises(ValueError, match="out has shape"):
        tensor_core_attention_forward(q, kv, kv, out=zeros((1, 4, 8, 32)))
    storage = zeros(4 * 8 * 64 + 1)
    with pytest.raises(ValueError, match="q must start on a 16-byte boundary"):
        tensor_core_attention_forward(storage[1:].reshape(1, 4, 8, 64), kv, kv)
    out, lse = tensor_core_attention_forward(q, kv, kv)
    with pytest.raises(TypeError, match="tensor_core_attention_backward: lse has dtype bfloat16"):
        tensor_core_attention_backward(q, q, kv, kv, out, out[..., 0].copy())
    with pytest.raises(ValueError, match="tensor_core_attention_backward: lse"):
        tensor_core_attention_backward(q, q, kv, kv, out, zeros((1, 4, 7), np.float32))
    with pytest.raises(TypeError, match="tensor_core_attention_backward: dout has dtype float32"):
        tensor_core_attention_backward(zeros((1, 4, 8, 64), np.float32), q, kv, kv, out, lse)


def test_empty_inputs(to_device):
    q, kv = to_device(np.zeros((2, 4, 0, 64), bfloat16)), to_device(np.zeros((2, 2, 0, 64), bfloat16))
    out, lse = tensor_core_attention_forward(q, kv, kv)
    assert out.shape == q.shape and lse.shape == (2, 4, 0)
    dq, dk, dv = tensor_core_attention_backward(q, q, kv, kv, out, lse)
    assert dq.shape == q.shape and dk.shape == dv.shape == kv.shape


def test_against_torch(rng, to_device, to_host):
    """PyTorch's scaled_dot_product_attention in bf16 on the same inputs (its flash kernels round in the
    same places), at a size the CPU executor would take long over: ours and PyTorch's both within 2 % of
    float64 (max |error| / max |reference|)."""
    torch = torch_or_none()
    if torch is None or backend.name != "cuda":
        pytest.skip("needs PyTorch and a GPU (the comparison runs on the GPU machine)")
    B, H, H_kv, T, d = 2, 8, 2, 1000, 128
    q, k, v, dout = bf16_inputs(rng, B, H, H_kv, T, d)
    tensors = [torch.from_numpy(a.astype(np.float32)).to("cuda").to(torch.bfloat16)   # exact both ways
               for a in (q, repeat_kv(k, H), repeat_kv(v, H), dout)]
    for tensor in tensors[:3]:
        tensor.requires_grad_(True)
    expected = torch.nn.functional.scaled_dot_product_attention(*tensors[:3], is_causal=True)
    expected.backward(tensors[3])
    out, lse = tensor_core_attention_forward(*(to_device(a) for a in (q, k, v)))
    grads = tensor_core_attention_backward(*(to_device(a) for a in (dout, q, k, v)), out, lse)
    q64, k64, v64, dout64 = wide(q, k, v, dout)
    references = [reference_forward(q64, k64, v64)[0], *reference_backward(dout64, q64, k64, v64)]
    theirs = [expected.detach(), tensors[0].grad, tensors[1].grad, tensors[2].grad]
    theirs = [t.float().cpu().numpy() for t in theirs]
    theirs[1:] = [theirs[1], group_sum(theirs[2], H_kv), group_sum(theirs[3], H_kv)]
    for name, ours, their, reference in zip(("out", "dq", "dk", "dv"), (out, *grads), theirs, references):
        ours = to_host(ours).astype(np.float64)
        assert relative_error(ours, reference) < 2e-2, name
        assert relative_error(their, reference) < 2e-2, name
