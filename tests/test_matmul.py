"""Chapter 01's matmul kernels and gpt2_cupy.ops.matmul against float64 numpy (and PyTorch when installed).

Relative error: max |C - C_ref| / max |C_ref|, with C_ref computed in float64 from the same float32
inputs; float32 accumulation over K of a few hundred lands near 1e-6, and the tolerance is 1e-4.
Shapes are chosen not to be multiples of the tiles (32, 128 and the slice depth 8), and to take both the
float4 path (rows of a multiple of 4 floats) and the float-by-float path of the package kernel.
"""

import numpy as np
import pytest

from gpt2_cupy import backend, kernels
from gpt2_cupy.ops import matmul as ops_matmul
from gpt2_cupy.ops.matmul import batched_matmul, k_splits, matmul
from gpt2_cupy.testing import relative_error, torch_or_none

TOLERANCE = 1e-4

# (M, N, K): odd everywhere (float-by-float loads), multiples of 4 but not of the tiles (float4 loads),
# K long enough for rounding to build up, and degenerate single rows and columns.
SHAPES = [(127, 65, 33), (127, 68, 36), (130, 132, 516), (1, 5, 300), (200, 1, 7), (1, 1, 1)]


def operands(rng, M, N, K, transpose_a=False, transpose_b=False, batch=None):
    """float32 inputs stored as the kernel expects, and op(A) @ op(B) in float64."""
    lead = () if batch is None else (batch,)
    a = rng.standard_normal(lead + ((K, M) if transpose_a else (M, K)), dtype=np.float32)
    b = rng.standard_normal(lead + ((N, K) if transpose_b else (K, N)), dtype=np.float32)
    op_a = np.swapaxes(a, -1, -2) if transpose_a else a
    op_b = np.swapaxes(b, -1, -2) if transpose_b else b
    return a, b, op_a.astype(np.float64) @ op_b.astype(np.float64)


# ---- the teaching kernels: C = A @ B --------------------------------------------------------------------

def blocks(n, size):
    return (n + size - 1) // size


TEACHING_KERNELS = {
    "matmul_naive": ("steps/matmul_naive", (32, 8), lambda M, N: (blocks(N, 32), blocks(M, 8))),
    "matmul_naive_uncoalesced": ("steps/matmul_naive", (32, 8), lambda M, N: (blocks(M, 32), blocks(N, 8))),
    "matmul_tiled": ("steps/matmul_tiled", (32, 32), lambda M, N: (blocks(N, 32), blocks(M, 32))),
    "matmul_register_blocked": ("steps/matmul_register_blocked", (256,), lambda M, N: (blocks(N, 128), blocks(M, 128))),
}


@pytest.mark.parametrize("name", sorted(TEACHING_KERNELS))
@pytest.mark.parametrize("M, N, K", [(127, 65, 33), (130, 129, 257), (1, 1, 1)])
def test_teaching_kernel_matches_float64(name, M, N, K, rng, to_device, to_host):
    file_name, block, grid = TEACHING_KERNELS[name]
    a, b, reference = operands(rng, M, N, K)
    c = to_device(np.full((M, N), np.nan, dtype=np.float32))  # every element must be written
    kernels.function(file_name, name)(grid(M, N), block, (c, to_device(a), to_device(b),
                                                          np.int32(M), np.int32(N), np.int32(K)))
    assert relative_error(to_host(c), reference) < TOLERANCE


# ---- the package's matmul ------------------------------------------------------------------------------

@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("M, N, K", SHAPES)
def test_matmul_matches_float64(M, N, K, transpose_a, transpose_b, rng, to_device, to_host):
    a, b, reference = operands(rng, M, N, K, transpose_a, transpose_b)
    out = matmul(to_device(a), to_device(b), transpose_a=transpose_a, transpose_b=transpose_b)
    assert out.shape == (M, N) and out.dtype == np.float32
    assert relative_error(to_host(out), reference) < TOLERANCE


@pytest.mark.parametrize("transpose_a, transpose_b", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("M, N, K", [(127, 65, 33), (130, 132, 516)])
def test_accumulate_adds_to_out(M, N, K, transpose_a, transpose_b, rng, to_device, to_host):
    a, b, reference = operands(rng, M, N, K, transpose_a, transpose_b)
    start = rng.standard_normal((M, N), dtype=np.float32)
    out = to_device(start.copy())  # on the CPU to_device returns the same numpy array
    returned = matmul(to_device(a), to_device(b), transpose_a, transpose_b, out=out, accumulate=True)
    assert returned is out
    assert relative_error(to_host(out), reference + start) < TOLERANCE


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("M, N, K, transpose_a", [(40, 36, 2000, True), (130, 132, 516, False), (1, 5, 300, True)])
def test_split_k_matches_float64(M, N, K, transpose_a, accumulate, rng, to_device, to_host):
    """Few tiles and a long K: the product is computed in stretches of K, summed by a second kernel."""
    assert k_splits(M, N, K)[0] > 1
    a, b, reference = operands(rng, M, N, K, transpose_a)
    start = rng.standard_normal((M, N), dtype=np.float32)
    out = to_device(start.copy()) if accumulate else None
    out = matmul(to_device(a), to_device(b), transpose_a=transpose_a, out=out, accumulate=accumulate)
    assert relative_error(to_host(out), reference + start if accumulate else reference) < TOLERANCE


def test_split_k_only_where_the_gpu_would_idle(monkeypatch):
    """On an H100 (132 multiprocessors, 264 blocks at a time) only products that leave it idle are split."""
    monkeypatch.setattr(ops_matmul.backend, "multiprocessor_count", lambda: 132)
    assert k_splits(4096, 4096, 4096) == (1, 0)       # 1024 tiles: 3.9 full rounds of blocks
    assert k_splits(8192, 2304, 768) == (1, 0)        # GPT-2's qkv projection, 1152 tiles
    assert k_splits(127, 65, 33) == (1, 0)            # K too short to be worth splitting
    assert k_splits(40, 36, 2000, batch=3) == (1, 0)  # batched products use blockIdx.z for the batch
    assert k_splits(8192, 768, 3072)[0] == 2          # 384 tiles: 1.45 rounds become 2.9
    for M, N, K in [(768, 768, 8192), (2304, 768, 8192), (8192, 768, 3072)]:  # weight gradients and MLP down
        splits, k_per_split = k_splits(M, N, K)
        assert splits > 1 and k_per_split % 8 == 0 and (splits - 1) * k_per_split < K <= splits * k_per_split


def test_out_without_accumulate_overwrites_whatever_was_there(rng, to_device, to_host):
    a, b, reference = operands(rng, 127, 68, 36)
    out = to_device(np.full((127, 68), np.nan, dtype=np.float32))
    matmul(to_device(a), to_device(b), out=out)
    assert relative_error(to_host(out), reference) < TOLERANCE


def test_misaligned_arrays_take_the_float_by_float_path(rng, to_device, to_host):
    """Rows of a multiple of 4 floats, but starting 4 bytes past a 16-byte boundary: float4 loads would fault."""
    M, N, K = 67, 72, 40
    a, b, reference = operands(rng, M, N, K)
    xp = backend.xp

    def shifted(array):
        storage = xp.zeros(array.size + 1, dtype=np.float32)
        view = storage[1:].reshape(array.shape)
        view[...] = to_device(array)
        return view

    out = shifted(np.zeros((M, N), dtype=np.float32))
    matmul(shifted(a), shifted(b), out=out)
    assert relative_error(to_host(out), reference) < TOLERANCE


def test_batched_matmul_matches_float64(rng, to_device, to_host):
    for transpose_a, transpose_b in [(False, False), (False, True), (True, False), (True, True)]:
        a, b, reference = operands(rng, 37, 20, 24, transpose_a, transpose_b, batch=3)
        out = batched_matmul(to_device(a), to_device(b), transpose_a, transpose_b)
        assert out.shape == (3, 37, 20)
        assert relative_error(to_host(out), reference) < TOLERANCE


def test_batched_matmul_accumulates(rng, to_device, to_host):
    a, b, reference = operands(rng, 33, 17, 65, batch=2)
    start = rng.standard_normal((2, 33, 17), dtype=np.float32)
    out = to_device(start.copy())  # on the CPU to_device returns the same numpy array
    batched_matmul(to_device(a), to_device(b), out=out, accumulate=True)
    assert relative_error(to_host(out), reference + start) < TOLERANCE


def test_transposed_views_are_read_in_place(rng, to_device, to_host):
    """a.T of a C-contiguous array is F-contiguous: matmul flips the transpose flag instead of copying."""
    a, b, reference = operands(rng, 65, 47, 129)
    a_t, b_t = to_device(np.ascontiguousarray(a.T)), to_device(np.ascontiguousarray(b.T))
    assert not a_t.T.flags.c_contiguous
    assert relative_error(to_host(matmul(a_t.T, b_t.T)), reference) < TOLERANCE
    assert relative_error(to_host(matmul(a_t, b_t.T, transpose_a=True)), reference) < TOLERANCE


def test_strided_inputs_are_copied(rng, to_device, to_host):
    a, b, reference = operands(rng, 30, 20, 40)
    wide = to_device(np.repeat(a, 2, axis=1))  # every other column is a
    assert relative_error(to_host(matmul(wide[:, ::2], to_device(b))), reference) < TOLERANCE


def test_linear_layer_products(rng, to_device, to_host):
    """The three products of y = x Wᵀ, as chapter 02 uses them, against numpy in float64."""
    N, C_in, C_out = 37, 68, 50
    x = rng.standard_normal((N, C_in), dtype=np.float32)
    w = rng.standard_normal((C_out, C_in), dtype=np.float32)
    dy = rng.standard_normal((N, C_out), dtype=np.float32)
    dw_start = rng.standard_normal((C_out, C_in), dtype=np.float32)
    x64, w64, dy64 = (v.astype(np.float64) for v in (x, w, dy))
    y = matmul(to_device(x), to_device(w), transpose_b=True)
    dx = matmul(to_device(dy), to_device(w))
    dw = to_device(dw_start.copy())
    matmul(to_device(dy), to_device(x), transpose_a=True, out=dw, accumulate=True)
    matmul(to_device(dy), to_device(x), transpose_a=True, out=dw, accumulate=True)
    assert relative_error(to_host(y), x64 @ w64.T) < TOLERANCE
    assert relative_error(to_host(dx), dy64 @ w64) < TOLERANCE
    assert relative_error(to_host(dw), dw_start + 2 * dy64.T @ x64) < TOLERANCE


def test_linear_gradients_against_pytorch_autograd(rng, to_device, to_host):
    torch = torch_or_none() or pytest.skip("PyTorch is not installed")
    N, C_in, C_out = 33, 20, 12
    x = rng.standard_normal((N, C_in), dtype=np.float32)
    w = rng.standard_normal((C_out, C_in), dtype=np.float32)
    dy = rng.standard_normal((N, C_out), dtype=np.float32)
    x_t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    w_t = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    (x_t @ w_t.T).backward(torch.tensor(dy, dtype=torch.float64))
    dx = matmul(to_device(dy), to_device(w))
    dw = matmul(to_device(dy), to_device(x), transpose_a=True)
    assert relative_error(to_host(dx), x_t.grad.numpy()) < TOLERANCE
    assert relative_error(to_host(dw), w_t.grad.numpy()) < TOLERANCE


def test_no_race_and_no_out_of_bounds_access(rng, to_device, to_host):
    """On the CPU executor: threads run in two orders and arrays sit against guard pages (on a GPU: no-op)."""
    for M, N, K, transpose_a, transpose_b in [(127, 65, 33, False, True), (131, 132, 20, True, False),
                                              (40, 36, 600, True, False)]:
        a, b, reference = operands(rng, M, N, K, transpose_a, transpose_b)
        with backend.checks(bounds=True, races=True):
            out = matmul(to_device(a), to_device(b), transpose_a, transpose_b)
        assert relative_error(to_host(out), reference) < TOLERANCE


def test_empty_sum_gives_zeros_and_empty_shapes_work(to_device, to_host):
    xp = backend.xp
    out = matmul(xp.ones((3, 0), dtype=np.float32), xp.ones((0, 4), dtype=np.float32))
    np.testing.assert_array_equal(to_host(out), np.zeros((3, 4), dtype=np.float32))
    kept = xp.ones((3, 4), dtype=np.float32)
    matmul(xp.ones((3, 0), dtype=np.float32), xp.ones((0, 4), dtype=np.float32), out=kept, accumulate=True)
    np.testing.assert_array_equal(to_host(kept), np.ones((3, 4), dtype=np.float32))
    assert matmul(xp.ones((0, 5), dtype=np.float32), xp.ones((5, 4), dtype=np.float32)).shape == (0, 4)


# ---- errors --------------------------------------------------------------------------------------------

def test_wrong_dtype_is_a_type_error():
    xp = backend.xp
    with pytest.raises(TypeError, match="float64"):
        matmul(xp.ones((2, 3)), xp.ones((3, 4), dtype=np.float32))
    with pytest.raises(TypeError, match="int32"):
        matmul(xp.ones((2, 3), dtype=np.float32), xp.ones((3, 4), dtype=np.float32),
               out=xp.ones((2, 4), dtype=np.int32))


def test_not_an_array_is_a_type_error():
    with pytest.raises(TypeError, match="ndarray"):
        matmul([[1.0]], backend.xp.ones((1, 1), dtype=np.float32))


def test_inner_dimensions_that_differ_are_a_value_error_naming_the_shapes():
    xp = backend.xp
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(4, 5\)"):
        matmul(xp.ones((2, 3), dtype=np.float32), xp.ones((4, 5), dtype=np.float32))
    with pytest.raises(ValueError, match="inner dimensions"):
        matmul(xp.ones((2, 3), dtype=np.float32), xp.ones((3, 5), dtype=np.float32), transpose_b=True)


def test_wrong_number_of_dimensions_is_a_value_error():
    xp = backend.xp
    with pytest.raises(ValueError, match=r"a must have shape \(M, K\)"):
        matmul(xp.ones(3, dtype=np.float32), xp.ones((3, 4), dtype=np.float32))
    with pytest.raises(ValueError, match=r"a must have shape \(batch, M, K\)"):
        batched_matmul(xp.ones((3, 4), dtype=np.float32), xp.ones((4, 5), dtype=np.float32))
    with pytest.raises(ValueError, match="gives batch = 3.*gives batch = 2"):
        batched_matmul(xp.ones((2, 3, 4), dtype=np.float32), xp.ones((3, 4, 5), dtype=np.float32))


def test_bad_out_is_a_value_error():
    xp = backend.xp
    a, b = xp.ones((2, 3), dtype=np.float32), xp.ones((3, 4), dtype=np.float32)
    with pytest.raises(ValueError, match=r"\(4, 2\).*\(2, 4\)"):
        matmul(a, b, out=xp.ones((4, 2), dtype=np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        matmul(a, b, out=xp.ones((4, 2), dtype=np.float32).T)
    with pytest.raises(ValueError, match="out must be given"):
        matmul(a, b, accumulate=True)
    square = xp.ones((3, 3), dtype=np.float32)
    with pytest.raises(ValueError, match="overlaps"):
        matmul(square, square, out=square)
