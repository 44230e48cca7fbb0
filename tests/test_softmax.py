"""Softmax (chapter 04): gpt2_cupy.ops.softmax against float64 numpy, finite differences and PyTorch.

Row lengths cover the kernels (a warp per row up to 1024 columns, with float4 loads when the rows are a
multiple of 4 long and the arrays start on 16 bytes, single floats otherwise; beyond, a block per row with
the row in shared memory, or the two-pass block kernels it falls back to) and lengths that are not multiples of 32
(1, 31, 33, 1000, 50257) nor of 4 (rows that start off a 16-byte boundary); inputs include huge values (1e4,
where exp overflows unless the maximum is subtracted) and -inf entries (masked positions).
"""


import numpy as np
import pytest

from gpt2_cupy import backend
from gpt2_cupy.ops import softmax as softmax_ops
from gpt2_cupy.ops.softmax import softmax_backward, softmax_forward
from gpt2_cupy.testing import finite_difference_gradient, relative_error

from bench import softmax_variants  # the kernels launched with the op's choices asked for

TOLERANCE = 1e-5
COLUMNS = [1, 2, 31, 32, 33, 1000, 1024, 1025, 50257]


def softmax_reference(x, scale=1.0, causal=False):
    z = scale * np.asarray(x, dtype=np.float64)
    if causal:
        T = z.shape[-1]
        z = np.where(np.tril(np.ones((T, T), dtype=bool)), z, -np.inf)
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def softmax_backward_reference(dout, y, scale=1.0):
    dout, y = np.asarray(dout, np.float64), np.asarray(y, np.float64)
    return scale * y * (dout - (dout * y).sum(axis=-1, keepdims=True))


def test_reference_backward_matches_central_differences(rng):
    x = rng.normal(size=(3, 7))
    dout = rng.normal(size=(3, 7))
    numeric = finite_difference_gradient(lambda: np.sum(dout * softmax_reference(x, 0.7)), x)
    assert relative_error(softmax_backward_reference(dout, softmax_reference(x, 0.7), 0.7), numeric) < 1e-8


@pytest.mark.parametrize("columns", COLUMNS)
def test_forward_and_backward_match_float64(columns, rng, to_device, to_host):
    rows = 3 if columns > 2000 else 37
    x = rng.normal(0.0, 3.0, (rows, columns)).astype(np.float32)
    dout = rng.normal(size=(rows, columns)).astype(np.float32)
    scale = 0.125
    y = softmax_forward(to_device(x), scale=scale)
    reference = softmax_reference(x, scale)
    assert relative_error(to_host(y), reference) < TOLERANCE
    np.testing.assert_allclose(to_host(y).astype(np.float64).sum(axis=-1), 1.0, atol=1e-5)
    dx = softmax_backward(to_device(dout), y, scale=scale)
    expected = softmax_backward_reference(dout, to_host(y), scale)
    if columns == 1:  # softmax of one number is 1 whatever it is: its gradient is exactly 0
        assert np.all(to_host(dx) == 0)
    else:
        assert relative_error(to_host(dx), expected) < TOLERANCE


@pytest.mark.parametrize("columns", [33, 1000, 50257])
def test_huge_inputs_do_not_overflow(columns, rng, to_device, to_host):
    x = rng.uniform(-1e4, 1e4, (2, columns)).astype(np.float32)
    x[:, 0] = 1e4
    y = to_host(softmax_forward(to_device(x)))
    assert np.all(np.isfinite(y))
    assert relative_error(y, softmax_reference(x)) < TOLERANCE


@pytest.mark.parametrize("columns", [5, 100, 3000])
def test_minus_infinity_entries_get_zero(columns, rng, to_device, to_host):
    x = rng.normal(size=(4, columns)).astype(np.float32)
    x[:, ::3] = -np.inf  # including the first column: the running maximum starts at -inf
    y = to_host(softmax_forward(to_device(x)))
    assert np.all(y[:, ::3] == 0)
    assert relative_error(y, softmax_reference(x)) < TOLERANCE


@pytest.mark.parametrize("T", [1, 5, 33, 1025])
def test_causal_equals_masking_with_minus_infinity(T, rng, to_device, to_host):
    x = rng.normal(size=(2, T, T)).astype(np.float32)
    x_device = to_device(x)
    y = to_host(softmax_forward(x_device, scale=0.3, causal=True))
    assert np.all(np.triu(y, 1) == 0)  # written as zeros, not left uninitialised
    assert relative_error(y, softmax_reference(x, 0.3, causal=True)) < TOLERANCE
    # the masked entries are never read: poisoning them changes nothing
    poisoned = np.where(np.tril(np.ones((T, T), dtype=bool)), x, np.nan).astype(np.float32)
    np.testing.assert_array_equal(to_host(softmax_forward(to_device(poisoned), scale=0.3, causal=True)), y)
    # and the backward needs no causal flag: y = 0 gives dx = 0 there
    dout = rng.normal(size=(2, T, T)).astype(np.float32)
    dx = to_host(softmax_backward(to_device(dout), to_device(y), scale=0.3))
    assert np.all(np.triu(dx, 1) == 0)


def test_backward_through_the_ops_matches_central_differences(rng, to_device, to_host):
    x = rng.normal(size=(2, 3, 9))
    dout = rng.normal(size=(2, 3, 9))
    numeric = finite_difference_gradient(lambda: np.sum(dout * softmax_reference(x, 0.5, causal=False)), x)
    y = softmax_forward(to_device(x.astype(np.float32)), scale=0.5)
    dx = softmax_backward(to_device(dout.astype(np.float32)), y, scale=0.5)
    assert relative_error(to_host(dx), numeric) < 1e-5


@pytest.mark.parametrize("shape", [(4, 40), (3, 2001)], ids=["warp rows", "long rows in shared memory"])
def test_in_place_and_out(shape, rng, to_device, to_host):
    """out may be the input: every kernel reads the whole row before it writes any of it."""
    x = rng.normal(size=shape).astype(np.float32)
    x_device = to_device(x)
    assert softmax_forward(x_device, out=x_device) is x_device
    assert relative_error(to_host(x_device), softmax_reference(x)) < TOLERANCE
    dout = to_device(rng.normal(size=shape).astype(np.float32))
    expected = softmax_backward_reference(to_host(dout), to_host(x_device))
    assert softmax_backward(dout, x_device, out=dout) is dout
    assert relative_error(to_host(dout), expected) < TOLERANCE


def test_empty_rows(to_device):
    assert softmax_forward(to_device(np.zeros((0, 8), np.float32))).shape == (0, 8)
    assert softmax_backward(to_device(np.zeros((3, 0), np.float32)), to_device(np.zeros((3, 0), np.float32))).shape == (3, 0)


def test_matches_pytorch(rng, to_device, to_host):
    torch = pytest.importorskip("torch")
    for shape in [(2, 3, 64, 64), (4, 5000)]:
        x = rng.normal(size=shape).astype(np.float32)
        dout = rng.normal(size=shape).astype(np.float32)
        x_torch = torch.tensor(x.astype(np.float64), requires_grad=True)
        y_torch = torch.softmax(0.25 * x_torch, dim=-1)
        y_torch.backward(torch.tensor(dout.astype(np.float64)))
        y = softmax_forward(to_device(x), scale=0.25)
        dx = softmax_backward(to_device(dout), y, scale=0.25)
        assert relative_error(to_host(y), y_torch.detach().numpy()) < TOLERANCE
        assert relative_error(to_host(dx), x_torch.grad.numpy()) < TOLERANCE


def test_bad_inputs_name_the_op_and_argument(to_device):
    x = to_device(np.zeros((4, 6), np.float32))
    with pytest.raises(TypeError, match="softmax_forward: x .*float64"):
        softmax_forward(to_device(np.zeros((4, 6), np.float64)))
    with pytest.raises(ValueError, match="softmax_forward: causal=True needs x of shape"):
        softmax_forward(x, causal=True)
    with pytest.raises(ValueError, match="softmax_forward: x .*C-contiguous"):
        softmax_forward(x.T)
    with pytest.raises(ValueError, match="softmax_backward: y has shape"):
        softmax_backward(x, to_device(np.zeros((4, 5), np.float32)))
    with pytest.raises(ValueError, match="softmax_forward: out has shape"):
        softmax_forward(x, out=to_device(np.zeros((6, 4), np.float32)))
    with pytest.raises(TypeError, match="softmax_backward: dout"):
        softmax_backward([1.0], x)


@pytest.mark.parametrize("shared_memory", [True, False])
def test_long_rows_give_the_same_bits_whatever_the_grid(shared_memory, rng, to_device, to_host):
    """The long-row kernels loop over rows: 300 rows on 132 or 264 blocks, or one block per row."""
    rows, columns = 300, 1100
    x = to_device(rng.normal(0.0, 3.0, (rows, columns)).astype(np.float32))
    dout = to_device(rng.normal(size=(rows, columns)).astype(np.float32))
    results = []
    for per_multiprocessor in (0, 1, 2):
        y, dx = backend.xp.empty_like(x), backend.xp.empty_like(x)
        softmax_variants.forward(y, x, rows, columns, np.float32(0.5), np.int32(0),
                                 blocks_per_multiprocessor=per_multiprocessor, shared_memory=shared_memory)
        softmax_variants.backward(dx, dout, y, rows, columns, np.float32(0.5),
                                  blocks_per_multiprocessor=per_multiprocessor, shared_memory=shared_memory)
        results.append((to_host(y), to_host(dx)))
    for y, dx in results[1:]:
        np.testing.assert_array_equal(y, results[0][0])
        np.testing.assert_array_equal(dx, results[0][1])
    assert relative_error(results[0][0], softmax_reference(to_host(x), 0.5)) < TOLERANCE
    expected = softmax_backward_reference(to_host(dout), results[0][0], 0.5)
    assert relative_error(results[0][1], expected) < TOLERANCE


@pytest.mark.parametrize("columns", [1025, 1026, 1027, 1028, 4099, 50257])
def test_shared_memory_and_two_pass_kernels_match_float64(columns, rng, to_device, to_host):
    """Rows of every length modulo 4 start at every offset from a 16-byte boundary: heads of 0 to 3 floats,
    tails of 0 to 3; 5 rows of 1025 floats start 0, 4, 8, 12 and 0 bytes past one."""
    rows = 5
    x = rng.normal(0.0, 3.0, (rows, columns)).astype(np.float32)
    x[1, :7] = -np.inf  # -inf in the head of a row that has one
    dout = rng.normal(size=(rows, columns)).astype(np.float32)
    x_device, dout_device = to_device(x), to_device(dout)
    for shared_memory in (True, False):  # the shared-memory kernels, and the two-pass ones they fall back to
        y, dx = backend.xp.empty_like(x_device), backend.xp.empty_like(x_device)
        softmax_variants.forward(y, x_device, rows, columns, np.float32(0.25), np.int32(0),
                                 shared_memory=shared_memory)
        softmax_variants.backward(dx, dout_device, y, rows, columns, np.float32(0.25), shared_memory=shared_memory)
        assert relative_error(to_host(y), softmax_reference(x, 0.25)) < TOLERANCE, shared_memory
        assert np.all(to_host(y)[1, :7] == 0)
        expected = softmax_backward_reference(dout, to_host(y), 0.25)
        assert relative_error(to_host(dx), expected) < TOLERANCE, shared_memory


@pytest.mark.parametrize("T", [1025, 1030])
def test_long_causal_rows_in_shared_memory(T, rng, to_device, to_host):
    """Causal rows longer than 1024: row t loads only its t + 1 first columns into shared memory."""
    x = rng.normal(size=(1, T, T)).astype(np.float32)
    y = backend.xp.empty_like(to_device(x))
    softmax_variants.forward(y, to_device(x), T, T, np.float32(0.3), np.int32(1), shared_memory=True)
    y = to_host(y)
    assert np.all(np.triu(y, 1) == 0)
    assert relative_error(y, softmax_reference(x, 0.3, causal=True)) < TOLERANCE


def test_arrays_off_16_bytes_take_the_two_pass_kernels(rng, to_device, to_host):
    """An array that starts 4 bytes past a 16-byte boundary cannot be read as float4s: the op falls back."""
    rows, columns = 3, 1500
    x = rng.normal(size=(rows, columns)).astype(np.float32)
    buffer = backend.xp.zeros(rows * columns + 1, dtype=np.float32)
    shifted = buffer[1:].reshape(rows, columns)  # C-contiguous, starting 4 bytes into the buffer
    shifted[...] = to_device(x)
    assert backend.address(shifted) % 16 == 4
    y = softmax_forward(shifted)
    assert relative_error(to_host(y), softmax_reference(x)) < TOLERANCE
    dout = rng.normal(size=(rows, columns)).astype(np.float32)
    dx = softmax_backward(to_device(dout), y, out=shifted)
    assert relative_error(to_host(dx), softmax_backward_reference(dout, to_host(y))) < TOLERANCE
    with pytest.raises(ValueError, match="start on 16 bytes"):
        softmax_variants.forward(y, shifted, rows, columns, np.float32(1), np.int32(0), shared_memory=True)


def test_rows_longer_than_shared_memory_take_the_two_pass_kernels(rng, to_device, to_host):
    """The row must fit in a block's shared memory (227 KB on an H100: about 58 000 floats)."""
    largest = (backend.shared_memory_per_block() - softmax_ops.REDUCTION_SHARED_BYTES) // 4 - 3
    assert softmax_ops.row_fits_in_shared_memory(largest)
    assert not softmax_ops.row_fits_in_shared_memory(largest + 1)
    x = rng.normal(size=(1, largest + 1)).astype(np.float32)
    assert relative_error(to_host(softmax_forward(to_device(x))), softmax_reference(x)) < TOLERANCE


def test_shared_memory_kernels_reuse_their_cache_without_races(rng, to_device, to_host):
    """Two blocks loop over 5 rows each, refilling shared memory for every row. On the CPU executor the race
    check runs the threads in another order too: without the __syncthreads() at the end of a row, a fast
    thread would overwrite the cache while others still read the previous row (on a GPU, just the check of
    the values)."""
    rows, columns = 10, 1031
    x = rng.normal(0.0, 3.0, (rows, columns)).astype(np.float32)
    dout = rng.normal(size=(rows, columns)).astype(np.float32)
    x_device, dout_device = to_device(x), to_device(dout)
    y, dx = backend.xp.empty_like(x_device), backend.xp.empty_like(x_device)
    arguments = (np.int32(rows), np.int32(columns), np.float32(0.5))
    shared_mem = softmax_ops.cached_row_bytes(columns)
    with backend.checks(bounds=True, races=True):
        softmax_ops.shared_kernel("forward")((2,), (1024,), (y, x_device, *arguments, np.int32(0)),
                                             shared_mem=shared_mem)
        softmax_ops.shared_kernel("backward")((2,), (1024,), (dx, dout_device, y, *arguments), shared_mem=shared_mem)
    assert relative_error(to_host(y), softmax_reference(x, 0.5)) < TOLERANCE
    assert relative_error(to_host(dx), softmax_backward_reference(dout, to_host(y), 0.5)) < TOLERANCE


@pytest.fixture
def warp_widths(monkeypatch):
    """The floats per load of every warp kernel the op launches, recorded in order."""
    widths = []
    original = softmax_ops.warp_kernel

    def recording(direction, columns, width):
        widths.append(width)
        return original(direction, columns, width)

    monkeypatch.setattr(softmax_ops, "warp_kernel", recording)
    return widths


@pytest.mark.parametrize("causal", [False, True], ids=["full rows", "causal"])
@pytest.mark.parametrize("columns", [4, 128, 132, 1020, 1024])
def test_float4_warp_kernels_match_float64(columns, causal, warp_widths, rng, to_device, to_host):
    """Rows that are a multiple of 4 long, in arrays that start on 16 bytes, move as float4s: K = 1, 2, 4, 8
    groups per lane, some lanes with no group (132, 1020), causal rows whose last valid column falls at
    every place within a group."""
    shape = (1, columns, columns) if causal else (37, columns)
    x = rng.normal(0.0, 3.0, shape).astype(np.float32)
    dout = rng.normal(size=shape).astype(np.float32)
    y = softmax_forward(to_device(x), scale=0.125, causal=causal)
    assert relative_error(to_host(y), softmax_reference(x, 0.125, causal)) < TOLERANCE
    dx = softmax_backward(to_device(dout), y, scale=0.125)
    assert relative_error(to_host(dx), softmax_backward_reference(dout, to_host(y), 0.125)) < TOLERANCE
    assert warp_widths == [4, 4]
    if causal:  # the masked neighbours a float4 brings along never reach the arithmetic
        assert np.all(np.triu(to_host(y), 1) == 0)
        poisoned = np.where(np.tril(np.ones((columns, columns), dtype=bool)), x, np.nan).astype(np.float32)
        np.testing.assert_array_equal(to_host(softmax_forward(to_device(poisoned), scale=0.125, causal=True)),
                                      to_host(y))


@pytest.mark.parametrize("width", [1, 4])
def test_both_widths_agree_with_float64_on_the_same_rows(width, rng, to_device, to_host):
    """The one-float kernels, which the op takes for rows off 16 bytes, and the float4 ones give the softmax
    on the same rows."""
    rows, columns = 19, 1024
    x = rng.normal(0.0, 3.0, (rows, columns)).astype(np.float32)
    dout = rng.normal(size=(rows, columns)).astype(np.float32)
    x_device = to_device(x)
    y, dx = backend.xp.empty_like(x_device), backend.xp.empty_like(x_device)
    softmax_variants.forward(y, x_device, rows, columns, np.float32(0.5), np.int32(0), width=width)
    softmax_variants.backward(dx, to_device(dout), y, rows, columns, np.float32(0.5), width=width)
    assert relative_error(to_host(y), softmax_reference(x, 0.5)) < TOLERANCE
    assert relative_error(to_host(dx), softmax_backward_reference(dout, to_host(y), 0.5)) < TOLERANCE


def test_rows_off_16_bytes_take_one_float_loads(warp_widths, rng, to_device, to_host):
    """A view that starts 4 bytes past a 16-byte boundary, or rows whose length is not a multiple of 4 (so
    that every other row starts off one), cannot be read as float4s: the op takes the one-float kernels."""
    rows, columns = 6, 128
    x = rng.normal(0.0, 3.0, (rows, columns)).astype(np.float32)
    dout = rng.normal(size=(rows, columns)).astype(np.float32)
    buffer = backend.xp.zeros(rows * columns + 1, dtype=np.float32)
    shifted = buffer[1:].reshape(rows, columns)  # C-contiguous, starting 4 bytes into the buffer
    shifted[...] = to_device(x)
    assert backend.address(shifted) % 16 == 4
    y = softmax_forward(shifted, scale=0.5)
    assert relative_error(to_host(y), softmax_reference(x, 0.5)) < TOLERANCE
    dx = softmax_backward(to_device(dout), y, scale=0.5, out=shifted)  # here only the output is off 16 bytes
    assert relative_error(to_host(dx), softmax_backward_reference(dout, to_host(y), 0.5)) < TOLERANCE
    wide = rng.normal(size=(rows, 130)).astype(np.float32)
    assert relative_error(to_host(softmax_forward(to_device(wide))), softmax_reference(wide)) < TOLERANCE
    assert warp_widths == [1, 1, 1]
