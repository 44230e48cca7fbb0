"""LayerNorm and DyT (chapter 05): gpt2_cupy.ops.layernorm and gpt2_cupy.ops.dyt against float64 numpy,
finite differences and PyTorch.

Row lengths cover both kernel layouts (float4 groups when C is a multiple of 4 and the arrays are aligned,
single floats otherwise) and lengths that are not multiples of 32 or 128; the parameter gradients, sums over
many rows, are checked against the float32 rounding bound of a sum (testing.assert_within_summation_bound),
and must come out bit for bit the same on a second run (deterministic), and added into their buffers.
"""


import numpy as np
import pytest

from gpt2_cupy import backend
from gpt2_cupy.ops import dyt as dyt_ops
from gpt2_cupy.ops import layernorm as layernorm_ops
from gpt2_cupy.ops.dyt import dyt_backward, dyt_forward
from gpt2_cupy.ops.layernorm import layernorm_backward, layernorm_forward
from gpt2_cupy.testing import (assert_within_summation_bound, finite_difference_gradient, relative_error,
                               summation_bound)

from tests.references import layer_norm as layernorm_reference, layer_norm_backward as layernorm_backward_terms
from bench import layernorm_variants  # (the backward kernels with other launch sizes, the first ones)

TOLERANCE = 1e-5
EPS = 1e-5  # GPT-2's
COLUMNS = [1, 3, 4, 31, 33, 100, 768, 1000, 1600]


def inputs(rng, shape):
    C = shape[-1]
    x = rng.normal(0.5, 2.0, shape).astype(np.float32)
    weight = rng.normal(1.0, 0.3, C).astype(np.float32)
    bias = rng.normal(0.0, 0.3, C).astype(np.float32)
    dout = rng.normal(size=shape).astype(np.float32)
    return x, weight, bias, dout


def assert_within_sum_of_computed_terms(got, terms, start):
    """got = start + Σ terms, for terms the kernel computes in float32 (dout * xhat, dout * tanh): within the
    summation bound plus a relative TOLERANCE of each term (a sum of many rows averages the terms' own rounding
    errors out, a sum of one row does not)."""
    error = np.abs(np.asarray(got, np.float64) - (start + terms.sum(axis=0)))
    assert np.all(error <= summation_bound(terms, start) + TOLERANCE * np.abs(terms).sum(axis=0))


def misaligned(to_device, array):
    """A contiguous device copy of `array` starting 4 bytes past a 16-byte boundary."""
    buffer = to_device(np.zeros(array.size + 4, dtype=np.float32))
    view = buffer[1:array.size + 1].reshape(array.shape)
    view[...] = to_device(array)
    assert backend.address(view) % 16 == 4
    return view


# ---- LayerNorm -----------------------------------------------------------------------------------------

def test_reference_backward_matches_central_differences(rng):
    x = rng.normal(size=(2, 3, 6))
    weight, bias, dout = rng.normal(size=6), rng.normal(size=6), rng.normal(size=(2, 3, 6))
    dx, dweight_terms = layernorm_backward_terms(dout, x, weight)
    numeric = finite_difference_gradient(lambda: np.sum(dout * layernorm_reference(x, weight, bias)[0]), x)
    assert relative_error(dx, numeric) < 1e-8
    numeric_weight = finite_difference_gradient(lambda: np.sum(dout * layernorm_reference(x, weight, bias)[0]), weight)
    assert relative_error(dweight_terms.reshape(-1, 6).sum(axis=0), numeric_weight) < 1e-8


@pytest.mark.parametrize("columns", COLUMNS)
def test_layernorm_matches_float64(columns, rng, to_device, to_host):
    shape = (3, 29, columns)
    x, weight, bias, dout = inputs(rng, shape)
    y, mean, rstd = layernorm_forward(to_device(x), to_device(weight), to_device(bias))
    y_reference, mean_reference, rstd_reference = layernorm_reference(x, weight, bias)
    assert mean.shape == rstd.shape == (3, 29)
    assert relative_error(to_host(y), y_reference) < TOLERANCE
    assert relative_error(to_host(mean), mean_reference) < TOLERANCE
    assert relative_error(to_host(rstd), rstd_reference) < TOLERANCE

    start_weight, start_bias = rng.normal(size=columns).astype(np.float32), rng.normal(size=columns).astype(np.float32)
    dweight, dbias = to_device(start_weight), to_device(start_bias)
    dx = layernorm_backward(to_device(dout), to_device(x), to_device(weight), mean, rstd, dweight=dweight, dbias=dbias)
    dx_reference, dweight_terms = layernorm_backward_terms(dout, x, weight)
    if columns == 1:  # a row of one element normalises to 0 whatever it is: dx is exactly 0
        assert np.all(to_host(dx) == 0)
    else:
        assert relative_error(to_host(dx), dx_reference) < TOLERANCE
    assert_within_summation_bound(to_host(dweight), dweight_terms.reshape(-1, columns), start_weight)
    assert_within_summation_bound(to_host(dbias), dout.reshape(-1, columns), start_bias)


def test_layernorm_without_bias_and_misaligned(rng, to_device, to_host):
    x, weight, _, dout = inputs(rng, (37, 768))
    y, mean, rstd = layernorm_forward(misaligned(to_device, x), to_device(weight), None)
    assert relative_error(to_host(y), layernorm_reference(x, weight, None)[0]) < TOLERANCE
    dweight = to_device(np.zeros(768, np.float32))
    dx = layernorm_backward(misaligned(to_device, dout), to_device(x), to_device(weight), mean, rstd, dweight=dweight)
    dx_reference, dweight_terms = layernorm_backward_terms(dout, x, weight)
    assert relative_error(to_host(dx), dx_reference) < TOLERANCE
    assert_within_summation_bound(to_host(dweight), dweight_terms)


def test_layernorm_gradients_match_central_differences(rng, to_device, to_host):
    """Through the float32 ops: dx, dweight and dbias of L = sum(dout * y), against float64 differences."""
    x, weight, bias, dout = (a.astype(np.float64) for a in inputs(rng, (2, 3, 40)))

    def loss():
        return np.sum(dout * layernorm_reference(x, weight, bias)[0])

    numeric = [finite_difference_gradient(loss, a) for a in (x, weight, bias)]
    y, mean, rstd = layernorm_forward(*(to_device(a.astype(np.float32)) for a in (x, weight, bias)))
    dweight, dbias = to_device(np.zeros(40, np.float32)), to_device(np.zeros(40, np.float32))
    dx = layernorm_backward(to_device(dout.astype(np.float32)), to_device(x.astype(np.float32)),
                            to_device(weight.astype(np.float32)), mean, rstd, dweight=dweight, dbias=dbias)
    for got, expected in zip((dx, dweight, dbias), numeric):
        assert relative_error(to_host(got), expected) < 1e-5


def test_layernorm_parameter_gradients_are_deterministic_and_accumulate(rng, to_device, to_host):
    x, weight, bias, dout = inputs(rng, (4, 300, 768))
    y, mean, rstd = layernorm_forward(to_device(x), to_device(weight), to_device(bias))
    runs = []
    for _ in range(2):
        dweight, dbias = to_device(np.zeros(768, np.float32)), to_device(np.zeros(768, np.float32))
        layernorm_backward(to_device(dout), to_device(x), to_device(weight), mean, rstd, dweight=dweight, dbias=dbias)
        runs.append((to_host(dweight), to_host(dbias)))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
    dweight, dbias = to_device(runs[0][0]), to_device(runs[0][1])
    layernorm_backward(to_device(dout), to_device(x), to_device(weight), mean, rstd, dweight=dweight, dbias=dbias)
    np.testing.assert_allclose(to_host(dweight), 2 * runs[0][0], rtol=1e-6, atol=1e-4)
    np.testing.assert_allclose(to_host(dbias), 2 * runs[0][1], rtol=1e-6, atol=1e-4)


def test_layernorm_backward_does_not_depend_on_the_gpu(rng, to_device, to_host, monkeypatch):
    """The backward's grid is a fixed number of rows per block, not sized by the multiprocessor count: the same
    bits on a GPU of any size."""
    x, weight, bias, dout = (to_device(a) for a in inputs(rng, (3, 45, 100)))
    y, mean, rstd = layernorm_forward(x, weight, bias)
    runs = []
    for multiprocessors in (132, 7):
        monkeypatch.setattr(backend, "multiprocessor_count", lambda count=multiprocessors: count)
        dweight, dbias = to_device(np.zeros(100, np.float32)), to_device(np.zeros(100, np.float32))
        dx = layernorm_backward(dout, x, weight, mean, rstd, dweight=dweight, dbias=dbias)
        runs.append([to_host(a) for a in (dx, dweight, dbias)])
    for first, second in zip(*runs):
        np.testing.assert_array_equal(first, second)


@pytest.mark.parametrize("rows_per_block", [1, 7, 32, 1000])
@pytest.mark.parametrize("columns", [3, 768])
def test_layernorm_backward_kernels_agree_for_any_rows_per_block(rows_per_block, columns, rng, to_device, to_host):
    """layernorm_backward_shared with blocks of any number of rows (the last block partly empty), and the first
    kernel, layernorm_backward: the same dx, and parameter gradients within the summation bound."""
    x, weight, bias, dout = inputs(rng, (5, 41, columns))
    rows = 5 * 41
    y, mean, rstd = layernorm_forward(to_device(x), to_device(weight), to_device(bias))
    layout = layernorm_ops.row_layout("test", columns, (to_device(x),))
    dx_reference, dweight_terms = layernorm_backward_terms(dout, x, weight)
    for run in (lambda *arrays: layernorm_variants.layernorm_backward_shared(*arrays, rows_per_block),
                layernorm_variants.layernorm_backward_registers):
        dx = to_device(np.empty_like(x))
        dweight, dbias = to_device(np.zeros(columns, np.float32)), to_device(np.zeros(columns, np.float32))
        run(layout, dx, dweight, dbias, to_device(dout), to_device(x), to_device(weight), mean, rstd, rows, columns)
        assert relative_error(to_host(dx), dx_reference) < TOLERANCE
        assert_within_summation_bound(to_host(dweight), dweight_terms.reshape(-1, columns))
        assert_within_summation_bound(to_host(dbias), dout.reshape(-1, columns))


@pytest.mark.parametrize("stripes", [1, 8, 32])
@pytest.mark.parametrize("parts, columns", [(1, 5), (17, 33), (130, 768)])
def test_column_sums_add_every_part_into_the_sums(stripes, parts, columns, rng, to_device, to_host):
    """add_column_sums (column_sums_accumulate): each of two sums gets its own partial rows added, every part
    once (the unrolled loop's remainder included), with any number of rows of threads; a single sum gets the
    same bits as the first of two."""
    partials = rng.normal(size=(2, parts, columns)).astype(np.float32)
    start = rng.normal(size=(2, columns)).astype(np.float32)
    sums = (to_device(start[0]), to_device(start[1]))
    layernorm_variants.add_column_sums(sums, to_device(partials), stripes)
    for got, first, terms in zip(sums, start, partials):
        assert_within_summation_bound(to_host(got), terms, first)
    alone = to_device(start[0])
    layernorm_variants.add_column_sums((alone,), to_device(partials[:1]), stripes)
    np.testing.assert_array_equal(to_host(alone), to_host(sums[0]))


def test_layernorm_backward_without_bias_leaves_dweight_unchanged(rng, to_device, to_host):
    x, weight, bias, dout = (to_device(a) for a in inputs(rng, (3, 50, 100)))
    y, mean, rstd = layernorm_forward(x, weight, bias)
    runs = []
    for dbias in (to_device(np.zeros(100, np.float32)), None):
        dweight = to_device(np.ones(100, np.float32))
        dx = layernorm_backward(dout, x, weight, mean, rstd, dweight=dweight, dbias=dbias)
        runs.append([to_host(a) for a in (dx, dweight)])
    for first, second in zip(*runs):
        np.testing.assert_array_equal(first, second)


def test_layernorm_of_a_constant_row_is_its_bias(to_device, to_host):
    x = np.full((2, 64), 3.25, np.float32)  # variance 0: rstd = 1 / sqrt(eps), no division by zero
    weight, bias = np.full(64, 2.0, np.float32), np.arange(64, dtype=np.float32)
    y, _, rstd = layernorm_forward(to_device(x), to_device(weight), to_device(bias))
    np.testing.assert_array_equal(to_host(y), np.tile(bias, (2, 1)))
    np.testing.assert_allclose(to_host(rstd), 1 / np.sqrt(EPS), rtol=1e-6)


def test_layernorm_matches_pytorch(rng, to_device, to_host):
    torch = pytest.importorskip("torch")
    x, weight, bias, dout = inputs(rng, (2, 5, 768))
    tensors = [torch.tensor(a.astype(np.float64), requires_grad=True) for a in (x, weight, bias)]
    y_torch = torch.nn.functional.layer_norm(tensors[0], (768,), tensors[1], tensors[2], eps=EPS)
    y_torch.backward(torch.tensor(dout.astype(np.float64)))
    y, mean, rstd = layernorm_forward(to_device(x), to_device(weight), to_device(bias))
    dweight, dbias = to_device(np.zeros(768, np.float32)), to_device(np.zeros(768, np.float32))
    dx = layernorm_backward(to_device(dout), to_device(x), to_device(weight), mean, rstd, dweight=dweight, dbias=dbias)
    assert relative_error(to_host(y), y_torch.detach().numpy()) < TOLERANCE
    for got, tensor in zip((dx, dweight, dbias), tensors):
        assert relative_error(to_host(got), tensor.grad.numpy()) < TOLERANCE


def test_layernorm_bad_inputs(to_device):
    x = to_device(np.zeros((4, 8), np.float32))
    weight = to_device(np.ones(8, np.float32))
    with pytest.raises(ValueError, match="layernorm_forward: weight has shape"):
        layernorm_forward(x, to_device(np.ones(7, np.float32)), None)
    with pytest.raises(TypeError, match="layernorm_forward: bias has dtype float64"):
        layernorm_forward(x, weight, to_device(np.ones(8, np.float64)))
    with pytest.raises(ValueError, match="layernorm_forward: rows of C = 3000"):
        layernorm_forward(to_device(np.zeros((2, 3000), np.float32)), to_device(np.ones(3000, np.float32)), None)
    _, mean, rstd = layernorm_forward(x, weight, None)
    with pytest.raises(ValueError, match="layernorm_backward: mean has shape"):
        layernorm_backward(x, x, weight, to_device(np.zeros(5, np.float32)), rstd, dweight=weight)
    with pytest.raises(TypeError, match="layernorm_backward: dweight"):
        layernorm_backward(x, x, weight, mean, rstd, dweight=None)


# ---- DyT -----------------------------------------------------------------------------------------------

def dyt_reference(x, alpha, weight, bias):
    return weight * np.tanh(alpha * np.asarray(x, np.float64)) + (0 if bias is None else bias)


def dyt_backward_terms(dout, x, alpha, weight):
    """(dx, elementwise dalpha terms, elementwise dweight terms) in float64."""
    dout, x = np.asarray(dout, np.float64), np.asarray(x, np.float64)
    t = np.tanh(alpha * x)
    g = dout * weight * (1 - t * t)
    return g * alpha, g * x, dout * t


def test_dyt_reference_backward_matches_central_differences(rng):
    x, weight, bias, dout = (rng.normal(size=s) for s in ((2, 3, 5), 5, 5, (2, 3, 5)))
    alpha = np.array([0.8])
    dx, dalpha_terms, dweight_terms = dyt_backward_terms(dout, x, alpha, weight)

    def loss():
        return np.sum(dout * dyt_reference(x, alpha, weight, bias))

    assert relative_error(dx, finite_difference_gradient(loss, x)) < 1e-8
    assert relative_error([dalpha_terms.sum()], finite_difference_gradient(loss, alpha)) < 1e-8
    assert relative_error(dweight_terms.reshape(-1, 5).sum(0), finite_difference_gradient(loss, weight)) < 1e-8


@pytest.mark.parametrize("columns", COLUMNS)
def test_dyt_matches_float64(columns, rng, to_device, to_host):
    shape = (3, 29, columns)
    x, weight, bias, dout = inputs(rng, shape)
    alpha = np.array([0.6], np.float32)
    y = dyt_forward(to_device(x), to_device(alpha), to_device(weight), to_device(bias))
    assert relative_error(to_host(y), dyt_reference(x, alpha, weight, bias)) < TOLERANCE
    starts = [rng.normal(size=n).astype(np.float32) for n in (1, columns, columns)]
    dalpha, dweight, dbias = (to_device(s) for s in starts)
    dx = dyt_backward(to_device(dout), to_device(x), to_device(alpha), to_device(weight),
                      dalpha=dalpha, dweight=dweight, dbias=dbias)
    dx_reference, dalpha_terms, dweight_terms = dyt_backward_terms(dout, x, alpha, weight)
    assert relative_error(to_host(dx), dx_reference) < TOLERANCE
    assert_within_summation_bound(to_host(dalpha), dalpha_terms.reshape(-1, 1), starts[0])
    assert_within_summation_bound(to_host(dweight), dweight_terms.reshape(-1, columns), starts[1])
    assert_within_summation_bound(to_host(dbias), dout.reshape(-1, columns), starts[2])


def test_dyt_without_bias_misaligned_and_deterministic(rng, to_device, to_host):
    x, weight, _, dout = inputs(rng, (4, 300, 768))
    alpha = to_device(np.array([0.5], np.float32))
    y = dyt_forward(misaligned(to_device, x), alpha, to_device(weight), None)
    assert relative_error(to_host(y), dyt_reference(x, 0.5, weight, None)) < TOLERANCE
    runs = []
    for _ in range(2):
        dalpha, dweight = to_device(np.zeros(1, np.float32)), to_device(np.zeros(768, np.float32))
        dx = dyt_backward(misaligned(to_device, dout), to_device(x), alpha, to_device(weight),
                          dalpha=dalpha, dweight=dweight)
        runs.append((to_host(dalpha), to_host(dweight), to_host(dx)))
    for first, second in zip(*runs):
        np.testing.assert_array_equal(first, second)
    assert relative_error(runs[0][2], dyt_backward_terms(dout, x, 0.5, weight)[0]) < TOLERANCE


def test_dyt_gradients_match_central_differences(rng, to_device, to_host):
    x, weight, bias, dout = (a.astype(np.float64) for a in inputs(rng, (2, 3, 12)))
    alpha = np.array([0.7])

    def loss():
        return np.sum(dout * dyt_reference(x, alpha, weight, bias))

    numeric = [finite_difference_gradient(loss, a) for a in (x, alpha, weight, bias)]
    device = [to_device(a.astype(np.float32)) for a in (x, alpha, weight)]
    gradients = [to_device(np.zeros(n, np.float32)) for n in (1, 12, 12)]
    dx = dyt_backward(to_device(dout.astype(np.float32)), *device,
                      dalpha=gradients[0], dweight=gradients[1], dbias=gradients[2])
    for got, expected in zip((dx, *gradients), numeric):
        assert relative_error(to_host(got), expected) < 1e-5


def test_dyt_bad_inputs(to_device):
    x = to_device(np.zeros((4, 8), np.float32))
    weight = to_device(np.ones(8, np.float32))
    with pytest.raises(ValueError, match=r"dyt_forward: alpha must have shape \(1,\)"):
        dyt_forward(x, to_device(np.ones(2, np.float32)), weight, None)
    with pytest.raises(TypeError, match="dyt_forward: alpha"):
        dyt_forward(x, 0.5, weight, None)
    with pytest.raises(ValueError, match="dyt_backward: dweight has shape"):
        dyt_backward(x, x, to_device(np.ones(1, np.float32)), weight,
                     dalpha=to_device(np.zeros(1, np.float32)), dweight=to_device(np.zeros(9, np.float32)))
    with pytest.raises(TypeError, match="dyt_backward: dalpha is None"):
        dyt_backward(x, x, to_device(np.ones(1, np.float32)), weight, dalpha=None, dweight=weight)


@pytest.mark.parametrize("shape", [(2, 9, 33), (2, 64, 4), (3, 70, 1000), (130, 13)])
def test_dyt_backward_kernels_agree_and_counters_return_to_zero(shape, rng, to_device, to_host):
    """dyt_backward_columns (one launch, the last block of each stripe of columns finishes it) against the
    first kernel, dyt_backward, for rows that are and are not a multiple of the rows per block and one or several
    stripes of columns; afterwards its counters are back at zero, ready for the next launch, and the results of
    a second launch are the same bits."""
    x, weight, bias, dout = inputs(rng, shape)
    rows, columns = int(np.prod(shape[:-1])), shape[-1]
    alpha = to_device(np.array([0.6], np.float32))
    dx_reference, dalpha_terms, dweight_terms = dyt_backward_terms(dout, x, 0.6, weight)
    layout = layernorm_ops.row_layout("test", columns, (to_device(x),))
    results = []
    for run in (lambda *arrays: layernorm_variants.dyt_backward_columns(layout[0], *arrays),
                lambda *arrays: layernorm_variants.dyt_backward_columns(layout[0], *arrays),
                lambda *arrays: layernorm_variants.dyt_backward_rows(layout, *arrays)):
        dx = to_device(np.empty_like(x))
        gradients = [to_device(np.zeros(n, np.float32)) for n in (1, columns, columns)]
        run(dx, *gradients, to_device(dout), to_device(x), alpha, to_device(weight), rows, columns)
        assert relative_error(to_host(dx), dx_reference) < TOLERANCE
        assert_within_summation_bound(to_host(gradients[0]), dalpha_terms.reshape(-1, 1))
        assert_within_summation_bound(to_host(gradients[1]), dweight_terms.reshape(-1, columns))
        assert_within_summation_bound(to_host(gradients[2]), dout.reshape(-1, columns))
        results.append([to_host(a) for a in (dx, *gradients)])
    for first, second in zip(results[0], results[1]):
        np.testing.assert_array_equal(first, second)
    assert not to_host(dyt_ops.counters(1)).any()


def test_dyt_backward_without_bias_leaves_the_other_sums_unchanged(rng, to_device, to_host):
    x, weight, bias, dout = (to_device(a) for a in inputs(rng, (3, 50, 100)))
    alpha = to_device(np.array([0.4], np.float32))
    runs = []
    for dbias in (to_device(np.zeros(100, np.float32)), None):
        dalpha, dweight = to_device(np.zeros(1, np.float32)), to_device(np.zeros(100, np.float32))
        dx = dyt_backward(dout, x, alpha, weight, dalpha=dalpha, dweight=dweight, dbias=dbias)
        runs.append([to_host(a) for a in (dx, dalpha, dweight)])
    for first, second in zip(*runs):
        np.testing.assert_array_equal(first, second)


@pytest.mark.parametrize("rows", [1, 33, 1000, 8193])
@pytest.mark.parametrize("columns", [33, 100])
def test_dyt_backward_rows_at_once_change_no_bit(rows, columns, rng, to_device, to_host):
    """dyt_backward_columns loading 1, 2, 4 or 8 rows per thread before computing them, for row counts that
    make one block, a partial block and many: the same bits whatever the rows at once (each thread adds its rows
    in the same order), and on a second launch; dx against float64; the parameter gradients ADDED into
    non-zero buffers within the summation bound; the counters back at zero."""
    x, weight, bias, dout = inputs(rng, (rows, columns))
    width = layernorm_ops.row_layout("test", columns, (to_device(x),))[0]
    starts = [rng.normal(size=n).astype(np.float32) for n in (1, columns, columns)]
    alpha = to_device(np.array([0.6], np.float32))
    arrays = [to_device(a) for a in (dout, x)]
    dx_reference, dalpha_terms, dweight_terms = dyt_backward_terms(dout, x, 0.6, weight)
    for row_slots in ((8,) if width == 1 else (4, 16)):
        results = []
        for rows_at_once in ((4, 4) if width == 1 else (1, 1, 2, 4, 8)):
            if width == 1 and rows_at_once != dyt_ops.ROWS_AT_ONCE:
                continue
            dx = to_device(np.empty_like(x))
            gradients = [to_device(s) for s in starts]
            layernorm_variants.dyt_backward_columns(width, dx, *gradients, *arrays, alpha, to_device(weight), rows,
                                                    columns, rows_per_block=64, row_slots=row_slots,
                                                    rows_at_once=rows_at_once)
            results.append([to_host(a) for a in (dx, *gradients)])
            assert not to_host(dyt_ops.counters(1)).any()
        assert relative_error(results[0][0], dx_reference) < TOLERANCE
        assert_within_sum_of_computed_terms(results[0][1], dalpha_terms.reshape(-1, 1), starts[0])
        assert_within_sum_of_computed_terms(results[0][2], dweight_terms, starts[1])
        assert_within_summation_bound(results[0][3], dout, starts[2])
        for other in results[1:]:
            for first, second in zip(results[0], other):
                np.testing.assert_array_equal(first, second)


@pytest.mark.cpu_only
@pytest.mark.parametrize("rows", [33, 200])
def test_the_dyt_backward_passes_the_race_and_bounds_checks(rows, rng, to_device):
    """The CPU executor's race check runs the launch again with every access checked: the last-block finish
    of dyt_backward_columns (partial rows written, __threadfence(), a ticket, then read by another block) must
    not race, and no access may fall outside its array."""
    from gpt2_cupy.cpu.checks import launch_checks

    x, weight, bias, dout = (to_device(a) for a in inputs(rng, (rows, 100)))
    gradients = [to_device(np.zeros(n, np.float32)) for n in (1, 100, 100)]
    alpha = to_device(np.array([0.6], np.float32))
    with launch_checks(bounds=True, races=True):
        layernorm_variants.dyt_backward_columns(4, to_device(np.empty_like(x)), *gradients, dout, x, alpha, weight,
                                                rows, 100, rows_per_block=16, row_slots=4, rows_at_once=2)
