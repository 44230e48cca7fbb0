"""Embedding lookups and their backward (gpt2_cupy.ops.embedding, kernels/embedding.cu, chapter 06),
against numpy in float64, finite differences, the float32 summation bound, and PyTorch when installed."""

import numpy as np
import pytest

from gpt2_cupy import backend, kernels
from gpt2_cupy.ops.embedding import (POSITIONS_PER_CHUNK, embedding_backward, embedding_forward, group_positions,
                                     token_position_embedding_backward, token_position_embedding_forward)
from gpt2_cupy.testing import assert_within_summation_bound, finite_difference_gradient, torch_or_none

SHAPES = [(1, 1, 1), (2, 3, 13), (3, 37, 16), (2, 65, 200), (4, 33, 257)]  # (B, T, C); C = 16: float4


def scatter_reference(dout, ids, V, padding_idx=None):
    """float64 sum of dout's rows into V rows by id; the terms per row, for the summation bound."""
    C = dout.shape[-1]
    rows, flat = dout.reshape(-1, C).astype(np.float64), ids.reshape(-1)
    terms = np.zeros((len(flat), V, C))
    terms[np.arange(len(flat)), flat] = rows
    if padding_idx is not None:
        terms[:, padding_idx] = 0
    return terms


@pytest.mark.parametrize("B, T, C", SHAPES)
def test_forward_is_the_rows_of_the_table(B, T, C, rng, to_device, to_host):
    V = 50
    weight = rng.normal(size=(V, C)).astype(np.float32)
    ids = rng.integers(0, V, (B, T)).astype(np.int32)
    out = embedding_forward(to_device(ids), to_device(weight))
    assert out.shape == (B, T, C)
    np.testing.assert_array_equal(to_host(out), weight[ids])


@pytest.mark.parametrize("B, T, C", SHAPES)
def test_token_position_forward(B, T, C, rng, to_device, to_host):
    V, positions = 50, T + 3
    wte = rng.normal(size=(V, C)).astype(np.float32)
    wpe = rng.normal(size=(positions, C)).astype(np.float32)
    ids = rng.integers(0, V, (B, T)).astype(np.int32)
    out = token_position_embedding_forward(to_device(ids), to_device(wte), to_device(wpe))
    np.testing.assert_array_equal(to_host(out), wte[ids] + wpe[:T])  # one float32 add: exact both ways


def test_forward_on_misaligned_tables_takes_the_one_column_path(rng, to_device, to_host):
    V, C = 9, 8
    buffer = to_device(rng.normal(size=V * C + 1).astype(np.float32))
    weight = buffer[1:].reshape(V, C)  # 4 bytes past a 16-byte boundary
    ids = rng.integers(0, V, 21).astype(np.int32)
    np.testing.assert_array_equal(to_host(embedding_forward(to_device(ids), weight)), to_host(weight)[ids])


@pytest.mark.parametrize("B, T, C", SHAPES)
def test_backward_adds_each_row_into_its_id(B, T, C, rng, to_device, to_host):
    V = 7  # few ids: many positions share one, the case the scatter must get right
    ids = rng.integers(0, V, (B, T)).astype(np.int32)
    dout = rng.normal(size=(B, T, C)).astype(np.float32)
    start = rng.normal(size=(V, C)).astype(np.float32)
    dweight = to_device(start)
    embedding_backward(to_device(dout), to_device(ids), dweight=dweight)
    assert_within_summation_bound(to_host(dweight), scatter_reference(dout, ids, V), start)


@pytest.mark.parametrize("group", [1, 15, 16, 17, 32, 33, 97, 300])
def test_backward_with_groups_longer_than_a_chunk(group, rng, to_device, to_host):
    # Warps sum chunks of 16 grouped positions: groups of every length around one, two and many chunks,
    # between short groups, so that they begin and end at every place in a chunk.
    C = 130
    ids = np.concatenate([np.full(group, 1), np.full(7, 0), np.full(group + 1, 4), np.arange(5, 40)]).astype(np.int32)
    rng.shuffle(ids)
    dout = rng.normal(size=(len(ids), C)).astype(np.float32)
    dweight = to_device(np.zeros((40, C), np.float32))
    embedding_backward(to_device(dout), to_device(ids), dweight=dweight)
    assert_within_summation_bound(to_host(dweight), scatter_reference(dout, ids, 40))


def test_backward_with_text_like_ids(rng, to_device, to_host):
    # Zipf's law, as in text: the most frequent ids take hundreds of positions, most ids one or none.
    V, N, C = 3000, 2048, 40
    weights = 1.0 / np.arange(1, V + 1)
    ids = rng.choice(V, size=N, p=weights / weights.sum()).astype(np.int32)
    assert np.bincount(ids).max() > 4 * POSITIONS_PER_CHUNK
    dout = rng.normal(size=(N, C)).astype(np.float32)
    dweight = to_device(np.zeros((V, C), np.float32))
    embedding_backward(to_device(dout), to_device(ids), dweight=dweight)
    got = to_host(dweight)
    for v in np.unique(ids):  # each id's row against the float64 sum of its rows
        assert_within_summation_bound(got[v], dout[ids == v])
    np.testing.assert_array_equal(got[np.bincount(ids, minlength=V) == 0], 0.0)


@pytest.mark.parametrize("N, V", [(1, 3), (33, 3), (200, 7), (1000, 50), (2100, 2000), (300, 50257)])
def test_grouping_is_a_stable_sort_by_id(N, V, rng, to_device, to_host):
    ids = rng.integers(-2, V + 2, N).astype(np.int32)  # some ids outside [0, V): left out, as the padding id
    padding = V // 2
    starts, grouped = group_positions(to_device(ids), V, padding)
    kept = (ids >= 0) & (ids < V) & (ids != padding)
    expected = np.argsort(np.where(kept, ids, V), kind="stable")[:kept.sum()]  # by id, then by position
    np.testing.assert_array_equal(to_host(grouped)[:kept.sum()], expected)
    np.testing.assert_array_equal(to_host(starts), np.concatenate([[0], np.cumsum(np.bincount(ids[kept], minlength=V))]))


def chunked_sum_reference(dout, ids, V):
    """dweight in float32, with the additions in the order the kernels document: each group in order of
    position, cut at every multiple of POSITIONS_PER_CHUNK of the grouped positions; the pieces of a group
    cut that way are summed on their own, then added chunk after chunk."""
    grouped = np.argsort(ids, kind="stable")
    dweight = np.zeros((V, dout.shape[1]), np.float32)
    for id in np.unique(ids):
        slots = np.flatnonzero(ids[grouped] == id)  # the group's places in `grouped`
        pieces = np.split(slots, np.flatnonzero(np.diff(slots // POSITIONS_PER_CHUNK)) + 1)
        total = None
        for piece in pieces:
            piece_sum = np.zeros(dout.shape[1], np.float32)
            for slot in piece:
                piece_sum += dout[grouped[slot]]
            total = piece_sum if total is None else total + piece_sum
        dweight[id] += total
    return dweight


def test_backward_adds_in_the_documented_order(rng, to_device, to_host):
    # The same bits as a float32 sum in the documented order: on every device, not only from run to run.
    V, N, C = 60, 700, 24
    weights = 1.0 / np.arange(1, V + 1)
    ids = rng.choice(V, size=N, p=weights / weights.sum()).astype(np.int32)
    dout = rng.normal(size=(N, C)).astype(np.float32)
    dweight = to_device(np.zeros((V, C), np.float32))
    embedding_backward(to_device(dout), to_device(ids), dweight=dweight)
    np.testing.assert_array_equal(to_host(dweight), chunked_sum_reference(dout, ids, V))


def test_backward_against_finite_differences(rng, to_device, to_host):
    V, C = 5, 3
    ids = np.array([[1, 3, 1], [4, 1, 0]], dtype=np.int32)
    dout = rng.normal(size=(2, 3, C))
    weight = rng.normal(size=(V, C))
    numeric = finite_difference_gradient(lambda: np.sum(dout * weight[ids]), weight)
    dweight = to_device(np.zeros((V, C), np.float32))
    embedding_backward(to_device(dout.astype(np.float32)), to_device(ids), dweight=dweight)
    np.testing.assert_allclose(to_host(dweight), numeric, rtol=1e-5, atol=1e-6)
    assert np.all(numeric[2] == 0)  # id 2 appears nowhere: no gradient


def test_padding_row_receives_no_gradient(rng, to_device, to_host):
    V, C, padding = 6, 40, 2
    ids = rng.integers(0, V, (3, 50)).astype(np.int32)
    ids[0, :5] = padding
    dout = rng.normal(size=(3, 50, C)).astype(np.float32)
    start = rng.normal(size=(V, C)).astype(np.float32)
    dweight = to_device(start)
    embedding_backward(to_device(dout), to_device(ids), dweight=dweight, padding_idx=padding)
    got = to_host(dweight)
    np.testing.assert_array_equal(got[padding], start[padding])
    assert_within_summation_bound(got, scatter_reference(dout, ids, V, padding), start)


def test_backward_is_bit_reproducible(rng, to_device, to_host):
    V, C = 3, 100
    ids = to_device(rng.integers(0, V, 4000).astype(np.int32))
    dout = to_device(rng.normal(size=(4000, C)).astype(np.float32))
    results = []
    for _ in range(3):
        dweight = to_device(np.zeros((V, C), np.float32))
        embedding_backward(dout, ids, dweight=dweight)
        results.append(to_host(dweight))
    assert all(np.array_equal(results[0], r) for r in results[1:])


def test_token_position_backward(rng, to_device, to_host):
    B, T, C, V, positions = 3, 17, 24, 11, 20
    ids = rng.integers(0, V, (B, T)).astype(np.int32)
    dout = rng.normal(size=(B, T, C)).astype(np.float32)
    dwte, dwpe = to_device(np.zeros((V, C), np.float32)), to_device(np.ones((positions, C), np.float32))
    token_position_embedding_backward(to_device(dout), to_device(ids), dwte=dwte, dwpe=dwpe)
    assert_within_summation_bound(to_host(dwte), scatter_reference(dout, ids, V))
    got = to_host(dwpe)
    assert_within_summation_bound(got[:T], dout, np.ones((T, C)))
    np.testing.assert_array_equal(got[T:], 1.0)  # positions past T: untouched


@pytest.mark.parametrize("bad", [-1, 50, 2**31 - 1])
def test_ids_outside_the_table_are_refused(bad, to_device):
    weight = to_device(np.zeros((50, 8), np.float32))
    ids = to_device(np.array([[3, 4], [bad, 5]], np.int32))
    with pytest.raises(ValueError, match=r"embedding_forward: ids must be in \[0, 50\).*ids\[1, 0\]"):
        embedding_forward(ids, weight)
    with pytest.raises(ValueError, match="embedding_backward: ids"):
        embedding_backward(to_device(np.zeros((2, 2, 8), np.float32)), ids, dweight=weight)
    with pytest.raises(ValueError, match="token_position_embedding_forward: ids"):
        token_position_embedding_forward(ids, weight, to_device(np.zeros((2, 8), np.float32)))


def test_unchecked_bad_ids_never_leave_the_table(to_device, to_host):
    weight = to_device(np.arange(40, dtype=np.float32).reshape(5, 8))
    ids = to_device(np.array([1, -7, 5, 2], np.int32))
    with backend.checks(bounds=True):  # on the CPU executor: any access outside an array is an error
        out = to_host(embedding_forward(ids, weight, check_ids=False))
        dweight = to_device(np.zeros((5, 8), np.float32))
        embedding_backward(to_device(np.ones((4, 8), np.float32)), ids, dweight=dweight, check_ids=False)
    assert np.isnan(out[1]).all() and np.isnan(out[2]).all()
    np.testing.assert_array_equal(out[[0, 3]], to_host(weight)[[1, 2]])
    np.testing.assert_array_equal(to_host(dweight).sum(axis=1), [0, 8, 8, 0, 0])


def test_bad_arguments_name_the_op_and_the_argument(to_device):
    weight = to_device(np.zeros((10, 8), np.float32))
    with pytest.raises(TypeError, match="embedding_forward: ids has dtype int64"):
        embedding_forward(to_device(np.zeros(3, np.int64)), weight)
    with pytest.raises(TypeError, match="embedding_forward: weight has dtype float64"):
        embedding_forward(to_device(np.zeros(3, np.int32)), to_device(np.zeros((10, 8))))
    with pytest.raises(ValueError, match="embedding_backward: dweight .* C = 8, but dout .* C = 7"):
        embedding_backward(to_device(np.zeros((3, 7), np.float32)), to_device(np.zeros(3, np.int32)),
                           dweight=weight)
    with pytest.raises(ValueError, match="embedding_backward: padding_idx"):
        embedding_backward(to_device(np.zeros((3, 8), np.float32)), to_device(np.zeros(3, np.int32)),
                           dweight=weight, padding_idx=10)
    with pytest.raises(ValueError, match="token_position_embedding_forward: T = 5 positions"):
        token_position_embedding_forward(to_device(np.zeros((2, 5), np.int32)), weight,
                                         to_device(np.zeros((4, 8), np.float32)))


@pytest.mark.parametrize("name", ["embedding_backward_atomic", "embedding_backward_per_column"])
def test_teaching_versions(name, rng, to_device, to_host):
    V, N, C = 4, 300, 37
    ids = rng.integers(0, V, N).astype(np.int32)
    dout = rng.normal(size=(N, C)).astype(np.float32)
    dweight = to_device(np.zeros((V, C), np.float32))
    threads = C if name.endswith("per_column") else N * C
    kernels.function("steps/embedding_backward", name)(
        ((threads + 255) // 256,), (256,), (dweight, to_device(dout), to_device(ids), np.int32(N), np.int32(C)))
    assert_within_summation_bound(to_host(dweight), scatter_reference(dout, ids, V))


def test_against_torch(rng, to_device, to_host):
    torch = torch_or_none()
    if torch is None or backend.name != "cuda":
        pytest.skip("PyTorch with CUDA is not installed here")
    V, B, T, C = 1000, 4, 64, 96
    ids = rng.integers(0, V, (B, T)).astype(np.int32)
    weight = rng.normal(size=(V, C)).astype(np.float32)
    dout = rng.normal(size=(B, T, C)).astype(np.float32)
    weight_torch = torch.tensor(weight, device="cuda", requires_grad=True)
    out_torch = torch.nn.functional.embedding(torch.tensor(ids, device="cuda").long(), weight_torch)
    out_torch.backward(torch.tensor(dout, device="cuda"))
    np.testing.assert_array_equal(to_host(embedding_forward(to_device(ids), to_device(weight))),
                                  out_torch.detach().cpu().numpy())
    dweight = to_device(np.zeros((V, C), np.float32))
    embedding_backward(to_device(dout), to_device(ids), dweight=dweight)
    np.testing.assert_allclose(to_host(dweight), weight_torch.grad.cpu().numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.cpu_only
def test_grouped_backward_does_not_depend_on_the_order_of_threads(rng, to_device):
    # The executor runs each launch again with its threads in another order and reports outputs that differ.
    ids = to_device(rng.integers(0, 3, 200).astype(np.int32))
    dout = to_device(rng.normal(size=(200, 40)).astype(np.float32))
    with backend.checks(races=True):
        embedding_backward(dout, ids, dweight=to_device(np.zeros((3, 40), np.float32)))
        token_position_embedding_backward(dout.reshape(4, 50, 40), ids.reshape(4, 50),
                                          dwte=to_device(np.zeros((3, 40), np.float32)),
                                          dwpe=to_device(np.zeros((50, 40), np.float32)))


@pytest.mark.cpu_only
def test_the_version_without_atomics_is_reported_as_a_race(to_device):
    dweight = to_device(np.zeros((1, 8), np.float32))
    with pytest.raises(Exception, match="race"), backend.checks(races=True):
        kernels.function("steps/embedding_backward", "embedding_backward_racy")(
            (1,), (256,), (dweight, to_device(np.ones((64, 8), np.float32)), to_device(np.zeros(64, np.int32)),
                           np.int32(64), np.int32(8)))
