"""Dropout with Philox4x32-10 (gpt2_cupy.ops.dropout, kernels/dropout.cu, chapter 07): the generator against
Random123's published known answers and an independent numpy Philox, the statistics of the mask, and the
forward and backward against numpy."""

import math

import numpy as np
import pytest

from gpt2_cupy import kernels
from gpt2_cupy.ops.dropout import (advance_rng_state, dropout_backward, dropout_forward, dropout_uniform,
                                   new_rng_state)

# Random123 (github.com/DEShawResearch/random123), tests/kat_vectors, the three "philox4x32 10" lines:
# counter (4 words), key (2 words), output (4 words).
KNOWN_ANSWERS = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
    ((0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff), (0xffffffff, 0xffffffff),
     (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)),
    ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
     (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1)),
]
LOW_32 = np.uint64(0xFFFFFFFF)


def philox_reference(counters, keys):
    """Philox4x32-10 in numpy, from the paper: counters (n, 4), keys (n, 2) uint32 -> (n, 4) uint32."""
    c = [counters[:, word].astype(np.uint64) for word in range(4)]
    key0, key1 = keys[:, 0].astype(np.uint64), keys[:, 1].astype(np.uint64)
    for _ in range(10):
        product0, product1 = np.uint64(0xD2511F53) * c[0], np.uint64(0xCD9E8D57) * c[2]
        c = [(product1 >> np.uint64(32)) ^ c[1] ^ key0, product1 & LOW_32,
             (product0 >> np.uint64(32)) ^ c[3] ^ key1, product0 & LOW_32]
        key0, key1 = (key0 + np.uint64(0x9E3779B9)) & LOW_32, (key1 + np.uint64(0xBB67AE85)) & LOW_32
    return np.stack(c, axis=1).astype(np.uint32)


def uniform_reference(n, seed, offset):
    """The uniforms dropout uses: element i from word i % 4 of Philox(counter (i // 4, 0, offset), key seed)."""
    groups = np.arange((n + 3) // 4, dtype=np.uint64)
    counters = np.stack([groups, 0 * groups, 0 * groups + (offset & 0xFFFFFFFF), 0 * groups + (offset >> 32)], 1)
    keys = np.tile(np.array([seed & 0xFFFFFFFF, seed >> 32], dtype=np.uint64), (len(groups), 1))
    words = philox_reference(counters.astype(np.uint32), keys.astype(np.uint32)).reshape(-1)[:n]
    return (words >> 8).astype(np.float32) * np.float32(2.0**-24)


def dropout_reference(x, p, seed, offset):
    keep = uniform_reference(x.size, seed, offset).reshape(x.shape) >= np.float32(p)
    with np.errstate(divide="ignore"):  # p = 1: an infinite scale that no kept element ever meets
        scale = np.float32(1.0) / (np.float32(1.0) - np.float32(p))
    return np.where(keep, x * scale, np.float32(0.0)), keep


def test_kernel_matches_the_published_known_answers(to_device, to_host):
    counters = np.array([c for c, _, _ in KNOWN_ANSWERS], dtype=np.uint32)
    keys = np.array([k for _, k, _ in KNOWN_ANSWERS], dtype=np.uint32)
    expected = np.array([e for _, _, e in KNOWN_ANSWERS], dtype=np.uint32)
    out = to_device(np.zeros((3, 4), np.uint32))
    kernels.function("dropout", "philox4x32_10_blocks")((1,), (32,), (out, to_device(counters), to_device(keys),
                                                                      np.int32(3)))
    np.testing.assert_array_equal(to_host(out), expected)
    np.testing.assert_array_equal(philox_reference(counters, keys), expected)


@pytest.mark.parametrize("seed, offset", [(0, 0), (1234, 77), (2**64 - 1, 2**40 + 3)])
def test_uniforms_match_the_numpy_philox(seed, offset, to_host):
    state = new_rng_state(seed)
    advance_rng_state(state, offset)
    np.testing.assert_array_equal(to_host(dropout_uniform(1003, state)), uniform_reference(1003, seed, offset))


@pytest.mark.parametrize("shape", [(1,), (3,), (257,), (4, 33, 65)])
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 1.0])
def test_forward_and_backward_against_numpy(shape, p, rng, to_device, to_host):
    x = rng.normal(size=shape).astype(np.float32)
    dout = rng.normal(size=shape).astype(np.float32)
    state = new_rng_state(42)
    expected, keep = dropout_reference(x, p, 42, 0)
    np.testing.assert_array_equal(to_host(dropout_forward(to_device(x), p, state)), expected)
    dx = to_host(dropout_backward(to_device(dout), p, state))
    np.testing.assert_array_equal(dx, dropout_reference(dout, p, 42, 0)[0])
    np.testing.assert_array_equal(dx != 0, keep & (dout != 0))  # the forward's mask, regenerated


def test_misaligned_and_in_place_give_the_same_mask(rng, to_device, to_host):
    x = rng.normal(size=1001).astype(np.float32)
    state = new_rng_state(7)
    expected = to_host(dropout_forward(to_device(x), 0.3, state))
    buffer = to_device(np.concatenate([[0.0], x]).astype(np.float32))
    view = buffer[1:]  # 4 bytes past a 16-byte boundary: the one-element path
    np.testing.assert_array_equal(to_host(dropout_forward(view, 0.3, state)), expected)
    dropout_forward(view, 0.3, state, out=view)
    np.testing.assert_array_equal(to_host(view), expected)


def test_fraction_dropped_within_binomial_bounds(to_device, to_host):
    n, p = 400_000, 0.1
    y = to_host(dropout_forward(to_device(np.ones(n, np.float32)), p, new_rng_state(3)))
    dropped = np.count_nonzero(y == 0)
    assert abs(dropped - n * p) < 5 * math.sqrt(n * p * (1 - p))  # 5 standard deviations
    np.testing.assert_array_equal(np.unique(y), [0.0, np.float32(1) / np.float32(0.9)])


def test_uniforms_pass_a_chi_squared_test(to_host):
    n, bins = 400_000, 100
    counts = np.histogram(to_host(dropout_uniform(n, new_rng_state(11))), bins=bins, range=(0, 1))[0]
    chi2 = np.sum((counts - n / bins) ** 2 / (n / bins))
    # chi-squared with 99 degrees of freedom: mean 99, standard deviation 14; 99 + 5 * 14 is far in the tail.
    assert 99 - 5 * 14 < chi2 < 99 + 5 * 14


def test_advancing_the_offset_gives_new_numbers(to_host):
    state = new_rng_state(5)
    first = to_host(dropout_uniform(1000, state))
    advance_rng_state(state, 1000)
    np.testing.assert_array_equal(to_host(state), [5, 1000])
    second = to_host(dropout_uniform(1000, state))
    assert np.count_nonzero(first == second) < 5
    np.testing.assert_array_equal(second, uniform_reference(1000, 5, 1000))


def test_bad_arguments_name_the_op_and_the_argument(to_device):
    x, state = to_device(np.zeros(8, np.float32)), new_rng_state(0)
    with pytest.raises(ValueError, match="dropout_forward: p must be a probability"):
        dropout_forward(x, 1.5, state)
    with pytest.raises(TypeError, match="dropout_forward: rng_state has dtype int64"):
        dropout_forward(x, 0.1, to_device(np.zeros(2, np.int64)))
    with pytest.raises(ValueError, match="dropout_backward: rng_state must have shape"):
        dropout_backward(x, 0.1, to_device(np.zeros(3, np.uint64)))
    with pytest.raises(TypeError, match="dropout_backward: dout has dtype float64"):
        dropout_backward(to_device(np.zeros(8)), 0.1, state)
    with pytest.raises(ValueError, match="dropout_forward: out has shape"):
        dropout_forward(x, 0.1, state, out=to_device(np.zeros(9, np.float32)))
    with pytest.raises(ValueError, match="advance_rng_state: count"):
        advance_rng_state(state, -1)


@pytest.mark.parametrize("start", [0, 4, 6, 1001])
def test_a_part_starting_at_start_draws_the_numbers_of_its_place_in_the_whole(start, rng, to_device, to_host):
    """A rank's rows under data parallelism: elements start .. start + n - 1 of the stream, the one-element path
    where start is not a multiple of 4, against numpy's Philox for the whole; the backward regenerates them."""
    n, p = 37, 0.4
    x = rng.normal(size=n).astype(np.float32)
    state = new_rng_state(11)
    advance_rng_state(state, 5)
    keep = uniform_reference(start + n, 11, 5)[start:] >= np.float32(p)
    expected = np.where(keep, x / np.float32(1 - p), np.float32(0.0))
    np.testing.assert_allclose(to_host(dropout_forward(to_device(x), p, state, start=start)), expected, rtol=1e-6)
    np.testing.assert_array_equal(to_host(dropout_backward(to_device(x), p, state, start=start)) != 0, keep)
    with pytest.raises(ValueError, match="start must be an int"):
        dropout_forward(to_device(x), p, state, start=-1)
