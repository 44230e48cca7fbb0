"""The generated elementwise and reduction kernels against numpy, on views, broadcasts and every layout."""

import numpy as np
import pytest

from gpt2_cupy import elementwise, reduction


def test_broadcast_by_strides_matches_numpy(rng, to_device, to_host):
    a = rng.standard_normal((4, 1, 3)).astype(np.float32)
    b = rng.standard_normal((5, 1)).astype(np.float32)
    c = rng.standard_normal((3,)).astype(np.float32)
    got = elementwise.elementwise("fma", "a * b + c", [to_device(a), to_device(b), to_device(c)])
    np.testing.assert_allclose(to_host(got), a * b + c, rtol=1e-6, atol=1e-6)
    assert got.shape == (4, 5, 3)


def test_views_are_read_through_their_strides(rng, to_device, to_host):
    x = rng.standard_normal((6, 7, 5)).astype(np.float32)
    view = to_device(x).transpose(2, 0, 1)[1:4, ::2]  # a transposed, sliced, stepped view
    assert not view.flags.c_contiguous
    got = elementwise.copy("contiguous", view)
    assert got.flags.c_contiguous
    np.testing.assert_array_equal(to_host(got), x.transpose(2, 0, 1)[1:4, ::2])


def test_a_number_is_a_kernel_argument_and_comparisons_give_bool(rng, to_device, to_host):
    x = rng.standard_normal((9, 33)).astype(np.float32)
    above = elementwise.elementwise("gt", "a > b", [to_device(x), 0.25], out_dtype=np.bool_)
    assert above.dtype == np.bool_
    np.testing.assert_array_equal(to_host(above), x > 0.25)
    twice = elementwise.elementwise("mul", "a * b", [to_device(x), 2.0])
    thrice = elementwise.elementwise("mul", "a * b", [to_device(x), 3.0])
    np.testing.assert_array_equal(to_host(thrice), x * np.float32(3.0))
    np.testing.assert_array_equal(to_host(twice), x * np.float32(2.0))


def test_integer_and_mixed_dtypes(rng, to_device, to_host):
    ids = rng.integers(-100, 100, (5, 6)).astype(np.int64)
    small = rng.integers(-100, 100, (6,)).astype(np.int32)
    got = elementwise.elementwise("add", "a + b", [to_device(ids), to_device(small)], compute_dtype=np.int64)
    np.testing.assert_array_equal(to_host(got), ids + small)
    assert got.dtype == np.int64


def test_coalescing_merges_contiguous_axes():
    # a contiguous (8, 16, 12) plus a (12,) bias: two axes, (8·16, 12)
    shape = (8, 16, 12)
    strides = [(192, 12, 1), (0, 0, 1)]
    assert elementwise.coalesce(shape, strides) == ((128, 12), [(12, 1), (0, 1)])
    assert elementwise.coalesce((1, 1), [(0, 0)]) == ((1,), [(0,)])


def test_shapes_that_do_not_broadcast_name_the_operation_and_arguments(to_device):
    with pytest.raises(ValueError, match=r"add: .*self \(4, 3\), other \(2, 3\) differ at dimension 0"):
        elementwise.elementwise("add", "a + b", [to_device(np.zeros((4, 3), np.float32)),
                                                 to_device(np.zeros((2, 3), np.float32))], names=["self", "other"])


def test_one_kernel_per_rank_not_per_shape(rng, to_device):
    # the sources are keyed by expression, types and the number of coalesced axes: other sizes reuse them
    for rows in (3, 5, 17):
        x = to_device(rng.standard_normal((rows, 4, 6)).astype(np.float32))
        elementwise.elementwise("strided_sum_test", "b + a", [x[:, 1:3], x[:, :2]])  # an expression of this test's own
    keys = [key for key in elementwise._kernels if key[0] == "b + a" and key[2] == "float"]
    assert len(keys) >= 1 and len({key[-1] for key in keys}) == len(keys)


@pytest.mark.parametrize("dims", [(2,), (1,), (0,), (0, 2), (1, 2), None])
@pytest.mark.parametrize("keepdim", [False, True])
def test_reductions_over_every_layout_match_numpy(rng, to_device, to_host, dims, keepdim):
    x = rng.standard_normal((4, 37, 70)).astype(np.float32)
    axis = None if dims is None else dims
    total = reduction.reduce("sum", "sum", to_device(x), dims, keepdim)
    np.testing.assert_allclose(to_host(total), x.astype(np.float64).sum(axis=axis, keepdims=keepdim),
                               rtol=1e-5, atol=1e-5)
    largest, where = reduction.reduce("max", "max", to_device(x), dims, keepdim)
    np.testing.assert_array_equal(to_host(largest), x.max(axis=axis, keepdims=keepdim))
    if dims is not None and len(dims) == 1:
        np.testing.assert_array_equal(to_host(where), np.expand_dims(x.argmax(axis=dims[0]), dims[0])
                                      if keepdim else x.argmax(axis=dims[0]))


def test_reduction_of_a_transposed_view_and_of_integers(rng, to_device, to_host):
    x = rng.standard_normal((30, 20)).astype(np.float32)
    smallest, where = reduction.reduce("min", "min", to_device(x).T, (1,))
    np.testing.assert_array_equal(to_host(smallest), x.T.min(1))
    np.testing.assert_array_equal(to_host(where), x.T.argmin(1))
    ids = rng.integers(-9, 9, (3, 1000)).astype(np.int32)
    total = reduction.reduce("sum", "sum", to_device(ids), (1,))
    assert total.dtype == np.int64
    np.testing.assert_array_equal(to_host(total), ids.sum(1))
    count = reduction.reduce("sum", "sum", to_device(ids > 0), None)
    assert int(to_host(count)) == int((ids > 0).sum())


def test_ties_give_the_first_index_and_nan_wins(to_device, to_host):
    x = np.array([[1, 3, 3, 0], [2, np.nan, 5, np.nan]], np.float32)
    values, where = reduction.reduce("max", "max", to_device(x), (1,))
    np.testing.assert_array_equal(to_host(where), [1, 1])
    assert to_host(values)[0] == 3 and np.isnan(to_host(values)[1])


def test_reductions_are_deterministic(rng, to_device, to_host):
    x = to_device(rng.standard_normal((3, 5000)).astype(np.float32))
    first = to_host(reduction.reduce("sum", "sum", x, (1,)))
    np.testing.assert_array_equal(to_host(reduction.reduce("sum", "sum", x, (1,))), first)


def test_reduction_errors():
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(IndexError, match=r"Dimension out of range \(expected to be in range of \[-2, 1\], but got 2\)"):
        reduction.reduce("sum", "sum", x, (2,))
    with pytest.raises(IndexError, match="Expected reduction dim 1 to have non-zero size"):
        reduction.reduce("max", "max", np.zeros((2, 0), np.float32), (1,))


def test_the_benchmark_cases_run_and_match_numpy():
    from bench import generated_kernels
    generated_kernels.check()  # each case once at a tiny size, asserting its relative error


@pytest.mark.parametrize("n", [1, 3, 4, 5, 1027, 4099])
def test_contiguous_vectors_and_their_tail(rng, to_device, to_host, n):
    # n not a multiple of the vector width: the last n % 4 elements take the scalar tail; a view that starts
    # one element in is not 16-byte aligned and takes the one-element-per-load kernel
    x = rng.standard_normal(n + 1).astype(np.float32)
    y = rng.standard_normal(n + 1).astype(np.float32)
    aligned = elementwise.elementwise("add", "a + b", [to_device(x[:n]), to_device(y[:n])])
    np.testing.assert_array_equal(to_host(aligned), x[:n] + y[:n])
    shifted = elementwise.elementwise("add", "a + b", [to_device(x)[1:], to_device(y)[1:]])
    np.testing.assert_array_equal(to_host(shifted), x[1:] + y[1:])
    widths = {key[-1] for key in elementwise._kernels if key[0] == "a + b" and key[4] == 0}
    assert {1, 4} <= widths


@pytest.mark.parametrize("shape", [(3, 1030), (37, 5), (2, 3, 1025)])
def test_broadcast_rows_cover_every_column(rng, to_device, to_host, shape):
    # 4 columns per thread, 1024 per block: rows longer and shorter than a block, of no round size
    x = rng.standard_normal(shape).astype(np.float32)
    w = rng.standard_normal(shape[-1]).astype(np.float32)
    b = rng.standard_normal(shape[:-1] + (1,)).astype(np.float32)
    got = elementwise.elementwise("scale_shift", "a * b + c", [to_device(x), to_device(w), to_device(b)])
    # within float32 rounding, not bit for bit: a GPU fuses a * b + c into one multiply-add, rounded once
    product = x.astype(np.float64) * w
    bound = 2 ** -23 * (np.abs(product) + np.abs(b))  # a float32 unit of each term
    assert np.all(np.abs(to_host(got) - (product + b)) <= bound)


@pytest.mark.parametrize("columns", [36, 37, 300])
def test_a_warp_per_row(rng, to_device, to_host, columns):
    # enough rows (1100, more than the 132 x 8 blocks that fill the GPU) for the warp-per-row kernel;
    # 36 columns: 9 float4 vectors a row, 37: one float per load, 300: several rounds of 4 loads
    x = rng.standard_normal((1100, columns)).astype(np.float32)
    x[5, 7] = x[5, 30] = 100.0  # a tie: the first index wins
    x[9, 3] = np.nan
    total = reduction.reduce("sum", "sum", to_device(x), (1,))
    np.testing.assert_allclose(to_host(total), x.astype(np.float64).sum(1), rtol=1e-5, atol=1e-5)
    values, where = reduction.reduce("max", "max", to_device(x), (1,))
    np.testing.assert_array_equal(to_host(values), x.max(1))
    np.testing.assert_array_equal(to_host(where), x.argmax(1))
    assert to_host(where)[5] == 7 and to_host(where)[9] == 3


@pytest.mark.parametrize("shape, dim", [((300, 64), 0), ((300, 66), 0), ((5, 700, 12), 1), ((1, 4096, 8), 1)])
def test_split_reductions_match_float64_and_repeat_their_bits(rng, to_device, to_host, shape, dim):
    # few output columns: the reduced axis is split between blocks, and a second pass adds the partials
    x = rng.standard_normal(shape).astype(np.float32)
    x.reshape(-1)[::97] = 4.0  # ties across splits: the first index must win
    device = to_device(x)
    total = reduction.reduce("sum", "sum", device, (dim,))
    np.testing.assert_allclose(to_host(total), x.astype(np.float64).sum(dim), rtol=1e-5, atol=1e-5)
    for _ in range(3):
        np.testing.assert_array_equal(to_host(reduction.reduce("sum", "sum", device, (dim,))), to_host(total))
    mean = reduction.reduce("mean", "sum", device, (dim,), scale=1.0 / shape[dim])
    np.testing.assert_allclose(to_host(mean), x.astype(np.float64).mean(dim), rtol=1e-5, atol=1e-6)
    values, where = reduction.reduce("max", "max", device, (dim,))
    np.testing.assert_array_equal(to_host(values), x.max(dim))
    np.testing.assert_array_equal(to_host(where), x.argmax(dim))
    ids = rng.integers(-9, 9, shape).astype(np.int32)
    np.testing.assert_array_equal(to_host(reduction.reduce("sum", "sum", to_device(ids), (dim,))), ids.sum(dim))


def test_split_max_lets_nan_win(to_device, to_host):
    x = np.zeros((512, 8), np.float32)
    x[400, 2] = np.nan
    x[100, 3] = 1.0
    values, where = reduction.reduce("max", "max", to_device(x), (0,))
    assert np.isnan(to_host(values)[2]) and to_host(where)[2] == 400 and to_host(where)[3] == 100
    assert to_host(where)[0] == 0  # all equal: the first index


@pytest.mark.parametrize("shape, w_shape, b_shape, axes", [((5, 8), (8,), (5, 1), 2),    # a column broadcast along rows
                                                           ((3, 5, 12), (5, 1), (12,), 3),  # the middle one broadcast
                                                           ((2, 4), (1,), (2, 4), 1)])   # a single element
def test_the_rows_kernel_reads_four_columns_per_load(rng, to_device, to_host, shape, w_shape, b_shape, axes):
    # rows whose length is a multiple of 4, every operand along them or broadcast: the rows kernel
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in (shape, w_shape, b_shape))
    product = x.astype(np.float64) * w
    bound = 2 ** -23 * (np.abs(product) + np.abs(b))  # a float32 unit of each term (a GPU fuses a * b + c)
    elementwise._kernels.clear()
    got = elementwise.elementwise("scale_shift", "a * b + c", [to_device(x), to_device(w), to_device(b)])
    assert [(key[4], key[5] is not None) for key in elementwise._kernels] == [(axes, True)]
    assert np.all(np.abs(to_host(got) - (product + b)) <= bound)
    # x one element past a 16-byte boundary: the general kernel, one column per load
    shifted = to_device(np.concatenate([[0.0], x.reshape(-1)]).astype(np.float32))[1:].reshape(shape)
    again = elementwise.elementwise("scale_shift", "a * b + c", [shifted, to_device(w), to_device(b)])
    assert [key[5] for key in elementwise._kernels][-1] is None
    assert np.all(np.abs(to_host(again) - (product + b)) <= bound)
