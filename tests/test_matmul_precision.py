"""The package's products under set_float32_matmul_precision, against float64, on the active backend.

Each precision is checked twice:
- against the exact float64 product, with the tolerance its input format implies (relative error
  max |got - ref| / max |ref|): float32 < 1e-4 as in tests/test_linear.py; TF32 (10 mantissa bits, a
  rounding of at most 2^-11 per input) < 2e-3; bf16 (7 stored mantissa bits, 2^-8 per input) < 2e-2;
- against the float64 product of the inputs rounded to that format, < 1e-5: the sums are float32, so what
  remains is float32 summation error, and a product that ran in another format would fail this check.

Sizes stay under 64: the CPU executor runs each mma.sync warp by warp, in Python-driven C.
"""

import numpy as np
import pytest
from ml_dtypes import bfloat16

import gpt2_cupy
from gpt2_cupy import checkpoint
from gpt2_cupy import train as training
from gpt2_cupy.autograd import Tensor
from gpt2_cupy.nn import functional as F
from gpt2_cupy.ops.attention import attention_forward
from gpt2_cupy.ops.tensor_core_attention import tensor_core_attention_forward
from gpt2_cupy.dispatch import batched_matmul, linear_backward, linear_forward
from gpt2_cupy.precision import PRECISIONS, bf16_bits, bf16_values, tf32_values
from gpt2_cupy.testing import relative_error
from tests.test_tensor_core_attention import reference_backward, reference_forward

TOLERANCE = {"highest": 1e-4, "high": 2e-3, "medium": 2e-2}
SUMMATION_TOLERANCE = 1e-5
AS_READ = {  # what each precision's product reads of a float32 input, as float64
    "highest": lambda x: np.asarray(x, dtype=np.float64),
    "high": tf32_values,
    "medium": lambda x: bf16_values(bf16_bits(x)),
}


@pytest.fixture(autouse=True)
def restore_precision():
    """Each test may change the process-wide setting; the next one starts from what was there."""
    before = gpt2_cupy.get_float32_matmul_precision()
    yield
    gpt2_cupy.set_float32_matmul_precision(before)


def assert_product(got, exact, as_read, precision):
    assert relative_error(got, exact) < TOLERANCE[precision]
    assert relative_error(got, as_read) < SUMMATION_TOLERANCE


@pytest.mark.parametrize("precision", PRECISIONS)
def test_linear_forward_and_backward_follow_the_precision(rng, to_device, to_host, precision):
    B, T, C_in, C_out = 2, 9, 40, 36
    x = rng.standard_normal((B, T, C_in)).astype(np.float32)
    weight = (rng.standard_normal((C_out, C_in)) / np.sqrt(C_in)).astype(np.float32)
    bias = rng.standard_normal(C_out).astype(np.float32)
    dy = rng.standard_normal((B, T, C_out)).astype(np.float32)
    dweight_before = rng.standard_normal((C_out, C_in)).astype(np.float32)  # the weight gradient adds to it
    gpt2_cupy.set_float32_matmul_precision(precision)
    read = AS_READ[precision]

    y = to_host(linear_forward(to_device(x), to_device(weight), to_device(bias)))
    assert_product(y, x.astype(np.float64) @ weight.T.astype(np.float64) + bias,
                   read(x) @ read(weight).T + bias, precision)

    dweight = to_device(dweight_before)
    dx = to_host(linear_backward(to_device(dy), to_device(x), to_device(weight), dweight=dweight))
    assert_product(dx, dy.astype(np.float64) @ weight, read(dy) @ read(weight), precision)
    dy_rows, x_rows = dy.reshape(-1, C_out), x.reshape(-1, C_in)
    assert_product(to_host(dweight), dweight_before + dy_rows.T.astype(np.float64) @ x_rows,
                   dweight_before + read(dy_rows).T @ read(x_rows), precision)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("transpose_a, transpose_b", [(False, True), (True, False)])  # q kᵀ, and Pᵀ dO
def test_batched_products_follow_the_precision(rng, to_device, to_host, precision, transpose_a, transpose_b):
    batch, M, N, K = 3, 20, 24, 33
    a = rng.standard_normal((batch, K, M) if transpose_a else (batch, M, K)).astype(np.float32)
    b = rng.standard_normal((batch, N, K) if transpose_b else (batch, K, N)).astype(np.float32)
    gpt2_cupy.set_float32_matmul_precision(precision)
    got = to_host(batched_matmul(to_device(a), to_device(b), transpose_a=transpose_a, transpose_b=transpose_b))

    def product(a, b):
        return (a.transpose(0, 2, 1) if transpose_a else a) @ (b.transpose(0, 2, 1) if transpose_b else b)

    assert_product(got, product(a.astype(np.float64), b.astype(np.float64)),
                   product(AS_READ[precision](a), AS_READ[precision](b)), precision)


ATTENTION_TOLERANCE = {"highest": 1e-5, "high": 4e-3, "medium": 3e-2}   # of out, dq, dk, dv against float64


@pytest.mark.parametrize("precision", PRECISIONS)
def test_attention_follows_the_precision(rng, to_device, to_host, precision):
    """F.scaled_dot_product_attention of float32 heads large enough for the tensor-core kernels (B H T² d =
    2^24 multiply-adds): at "highest" chapter 08's float32 kernels, at "high" the tensor-core kernels in
    TF32, at "medium" in bf16 (inputs rounded, out widened back): the same bits as those kernels called
    directly, and out and the gradients within the precision's tolerance of float64 (max |error| / max |ref|)."""
    B, H, T, d = 1, 4, 256, 64
    q, k, v, dout = (rng.standard_normal((B, H, T, d)).astype(np.float32) for _ in range(4))
    gpt2_cupy.set_float32_matmul_precision(precision)
    inputs = [Tensor(to_device(x), requires_grad=True) for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*inputs, is_causal=True)
    out.backward(Tensor(to_device(dout)))
    assert out.dtype == np.float32 and all(x.grad.dtype == np.float32 for x in inputs)

    if precision == "highest":
        direct, _ = attention_forward(*(to_device(x) for x in (q, k, v)), causal=True)
    elif precision == "high":
        direct, _ = tensor_core_attention_forward(*(to_device(x) for x in (q, k, v)))
    else:
        direct, _ = tensor_core_attention_forward(*(to_device(x.astype(bfloat16)) for x in (q, k, v)))
        direct = to_device(to_host(direct).astype(np.float32))
    assert np.array_equal(to_host(out.data), to_host(direct))
    wide = [x.astype(np.float64) for x in (q, k, v, dout)]
    references = [reference_forward(*wide[:3])[0], *reference_backward(wide[3], *wide[:3])]
    for name, got, reference in zip(("out", "dq", "dk", "dv"), [out.data] + [x.grad for x in inputs], references):
        assert relative_error(to_host(got), reference) < ATTENTION_TOLERANCE[precision], name


def test_highest_runs_large_products_as_3xtf32_on_hopper(rng, to_device, to_host):
    """At "highest", a Linear-sized product (512 x 512 x 1024, 2^28 multiply-adds) runs as 3xTF32 on an H100's
    or H200's wgmma: the bits of tensor_core_matmul's "highest", within float32's tolerance of float64. The
    CPU executor, and other GPUs, keep chapter 01's float32 kernel."""
    from gpt2_cupy.dispatch import highest_on_tensor_cores, matmul, tensor_core_matmul
    M, N, K = 512, 512, 1024
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((N, K)).astype(np.float32)
    out = to_device(np.empty((M, N), np.float32))
    on_tensor_cores = highest_on_tensor_cores(out, K)
    assert on_tensor_cores == (not gpt2_cupy.backend.TENSOR_CORES_EMULATED and gpt2_cupy.backend.runs_wgmma())
    got = to_host(matmul(to_device(a), to_device(b), transpose_b=True, out=out))
    assert relative_error(got, a.astype(np.float64) @ b.T.astype(np.float64)) < TOLERANCE["highest"]
    if on_tensor_cores:
        expected = to_host(tensor_core_matmul(to_device(a), to_device(b), transpose_b=True, precision="highest"))
        assert np.array_equal(got, expected)


def test_allow_tf32_reads_and_writes_the_precision():
    matmul = gpt2_cupy.backends.cuda.matmul
    assert gpt2_cupy.get_float32_matmul_precision() == "highest" and matmul.allow_tf32 is False
    matmul.allow_tf32 = True
    assert gpt2_cupy.get_float32_matmul_precision() == "high"
    matmul.allow_tf32 = False
    assert gpt2_cupy.get_float32_matmul_precision() == "highest"
    # The other way round, as torch.backends.cuda.matmul.allow_tf32 after torch.set_float32_matmul_precision:
    for precision, allowed in (("high", True), ("medium", True), ("highest", False)):
        gpt2_cupy.set_float32_matmul_precision(precision)
        assert matmul.allow_tf32 is allowed


def test_the_train_command_sets_and_records_the_precision(tmp_path):
    arguments = ["--n-layer", "1", "--n-head", "1", "--n-embd", "32", "--block-size", "16", "--batch-size", "2",
                 "--steps", "1", "--eval-interval", "1", "--eval-batches", "1", "--no-progress"]
    config, _ = training.parse_arguments(arguments + ["--out-dir", str(tmp_path / "default")])
    assert config.matmul_precision == "highest"
    with pytest.raises(SystemExit):
        training.parse_arguments(arguments + ["--matmul-precision", "low"])

    losses = {}
    for precision in ("highest", "medium"):
        out_dir = tmp_path / precision
        assert training.main(arguments + ["--out-dir", str(out_dir), "--matmul-precision", precision]) == 0
        assert gpt2_cupy.get_float32_matmul_precision() == precision
        _, meta = checkpoint.load(out_dir / "checkpoint.npz")
        assert meta["train_config"]["matmul_precision"] == precision
        losses[precision] = [r["val_loss"] for r in training.read_log(out_dir / "log.jsonl") if "val_loss" in r]
    # The same weights and batches: the first evaluation differs only by bf16's rounding of the products' inputs.
    assert losses["medium"][0] != losses["highest"][0]
    assert losses["medium"][0] == pytest.approx(losses["highest"][0], rel=1e-2)
