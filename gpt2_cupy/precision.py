"""How float32 matrix products may use tensor cores, chosen as in PyTorch:

    gpt2_cupy.set_float32_matmul_precision("high")
    gpt2_cupy.get_float32_matmul_precision()          # "high"
    gpt2_cupy.backends.cuda.matmul.allow_tf32         # True: PyTorch's older switch, another view of the same

    "highest"  float32 accuracy (the default)
    "high"     TF32: inputs rounded to 10 mantissa bits, float32 sums (relative error about 1e-3)
    "medium"   bf16: inputs rounded to 8 mantissa bits, float32 sums (about 1e-2)

The package's products read the setting in one place, gpt2_cupy.dispatch.product: the Linear
layer's forward, input gradient and weight gradient, and the batched products (attention's unfused path).
At "highest" they run chapter 01's float32 kernels, except on an H100 or H200, where a large 2-D product
(a Linear layer's, at GPT-2's sizes) runs tensor_core_matmul's 3xTF32 on the wgmma: as accurate
(bench/design_choices.json, "wgmma_matmul.SLICES_PER_SUM") and faster (bench/tensor_cores.json has both
kernels against cuBLAS float32). The CPU executor keeps the float32 kernels.
Attention (gpt2_cupy.dispatch.attention) follows the setting too: at "high" its
tensor-core kernels run in TF32, at "medium" in bf16, where they take the shape; at "highest" chapter 08's
float32 kernels run. The tensor-core kernels have a 3xTF32 format too (tensor_core_attention_forward's
precision="highest": each operand, and P and dS, split into two TF32 parts), as accurate as chapter 08's
but slower, three times TF32's mma.sync work, so "highest" keeps chapter 08's (bench/design_choices.json has the
figures).

gpt2_cupy.ops.tensor_core_matmul reads the setting when it is not given a precision, and there "highest"
means 3xTF32; chapter 15a explains each format and measures its error against float64. An unknown name is
a ValueError. Below, the three formats emulated in numpy (as float64 values), for references and error studies.
"""

import numpy

PRECISIONS = ("highest", "high", "medium")

_precision = "highest"


def set_float32_matmul_precision(precision):
    """Choose how float32 matrix products may use tensor cores: "highest", "high" or "medium" (see the
    module's doc: at "highest" the package's products run float32 kernels or 3xTF32, at "high" TF32, at
    "medium" bf16 inputs; sums are float32 in all three; attention follows)."""
    global _precision
    if precision not in PRECISIONS:
        raise ValueError(f"set_float32_matmul_precision: {precision!r} is not one of "
                         f"{', '.join(repr(p) for p in PRECISIONS)}")
    _precision = precision


def get_float32_matmul_precision():
    """The precision set_float32_matmul_precision chose last: "highest" until then."""
    return _precision


# ---- the formats in numpy: what a tensor core reads, as float64 values, for references and error studies ----

def tf32_values(x):
    """float32 x rounded to TF32 as cvt.rna.tf32.f32 does (10 mantissa bits, to nearest, ties away from
    zero), as float64. Overflow past TF32's largest value gives infinity, as on the GPU."""
    x = numpy.asarray(x, dtype=numpy.float32).astype(numpy.float64)
    _, exponent = numpy.frexp(x)
    unit = numpy.ldexp(1.0, numpy.maximum(exponent - 1, -126) - 10)   # TF32's last place at x
    with numpy.errstate(invalid="ignore", over="ignore"):
        magnitude = numpy.floor(numpy.abs(x) / unit + 0.5) * unit
        magnitude = numpy.where(magnitude > (2.0 - 2.0 ** -10) * 2.0 ** 127, numpy.inf, magnitude)
    return numpy.where(numpy.isfinite(x), numpy.copysign(magnitude, x), x)


def tf32_split(x):
    """(big, small) of 3xTF32 as float64, as a kernel computes them: big = x in TF32, small = (x - big) in TF32.
    x - big is exact in float32, but a kernel subtracts with subnormals flushed (flush_subnormals): a subnormal x
    or big is read as a zero of its sign, and a subnormal difference is written as one."""
    big = tf32_values(x)
    x, big32 = (flush_subnormals(v).astype(numpy.float64) for v in (x, big))
    return big, tf32_values(flush_subnormals((x - big32).astype(numpy.float32)))


def flush_subnormals(x):
    """float32 x with every subnormal made a zero of its sign: what a float32 add, multiply or fma in a kernel
    reads and writes, since CuPy compiles kernels with -ftz=true (the CPU executor does the same)."""
    x = numpy.asarray(x, dtype=numpy.float32)
    return numpy.where(numpy.abs(x) < numpy.finfo(numpy.float32).tiny, numpy.copysign(numpy.float32(0), x), x)


def bf16_bits(x):
    """The bf16 nearest each float32 of x (ties to even), as uint16 bits; NaN stays NaN."""
    bits = numpy.asarray(x, dtype=numpy.float32).view(numpy.uint32).astype(numpy.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return numpy.where(nan, (bits | 0x400000) >> 16, rounded).astype(numpy.uint16)


def bf16_values(bits):
    """float64 values of bf16 bits."""
    return (numpy.asarray(bits, dtype=numpy.uint16).astype(numpy.uint32) << 16).view(numpy.float32).astype(numpy.float64)
