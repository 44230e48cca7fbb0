"""Chapter 15a's graded exercises: tensor-core tiles with mma.sync, from registers and through ldmatrix."""

from gpt2_cupy.exercises.chapter_01 import _product_arguments   # (C, A, B, M, N, K), as chapter 01's products
from gpt2_cupy.exercises.checker import Exercise, blocks
from gpt2_cupy.precision import tf32_values

# (M, N, K): one tile; ragged edges in every dimension; K over many slices of 8
SIZES = ({"M": 16, "N": 8, "K": 8}, {"M": 37, "N": 21, "K": 29}, {"M": 50, "N": 70, "K": 100})
# The reference multiplies the inputs rounded to TF32 (cvt.rna, as to_tf32 does) in float64, so what is left is
# float32 summation: far below 1e-4 for these K. Inputs cut to TF32 instead of rounded are off by up to 2^-10
# per product, about 1e-2 over a sum of 100: the check tells the two apart.
RTOL, ATOL = 1e-5, 1e-4


def _launch(size):
    return (blocks(size["N"], 8), blocks(size["M"], 16)), (32,)


EXERCISES = [
    Exercise(
        id="15a.mma_tiles", title="mma.sync tiles of a TF32 product, any size", kernel="mma_tiles_tf32",
        arguments=_product_arguments(transpose_b=False), launch=_launch,
        reference=lambda A, B, M, N, K: {"C": tf32_values(A) @ tf32_values(B)},
        sizes=SIZES, rtol=RTOL, atol=ATOL),
    Exercise(
        id="15a.ldmatrix_tiles", title="Fragments by ldmatrix from a padded tile", kernel="mma_tiles_ldmatrix",
        arguments=_product_arguments(transpose_b=True), launch=_launch,
        reference=lambda A, B, M, N, K: {"C": tf32_values(A) @ tf32_values(B).T},
        sizes=SIZES, rtol=RTOL, atol=ATOL),
]
