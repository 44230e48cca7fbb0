"""The dtypes the package's kernels read and write, and what each is called in CUDA C: one home for both.

    FLOAT32, BFLOAT16       the storage dtypes of the kernels templated on their element (STORAGE_DTYPES)
    C_TYPES                 numpy dtype -> the C type a generated kernel reads it as
    LARGEST_INT             kernels index with int: no array may have more elements

bf16 is ml_dtypes' bfloat16, the numpy dtype that CuPy and JAX share. This module needs numpy only, so that
preparing data (gpt2_cupy.data) can use it without an array backend.
"""

import ml_dtypes
import numpy

FLOAT32 = numpy.dtype(numpy.float32)
BFLOAT16 = numpy.dtype(ml_dtypes.bfloat16)
STORAGE_DTYPES = (FLOAT32, BFLOAT16)
LARGEST_INT = 2**31 - 1

C_TYPES = {FLOAT32: "float", numpy.dtype(numpy.float64): "double", numpy.dtype(numpy.int32): "int",
           numpy.dtype(numpy.int64): "long long", numpy.dtype(numpy.bool_): "bool",
           numpy.dtype(numpy.uint8): "unsigned char", BFLOAT16: "__nv_bfloat16"}
