"""argmax_forward (gpt2_cupy.ops.argmax), greedy generation's choice, against numpy's argmax: rows shorter and
longer than a block's stretch, float32 and bf16, ties (the first wins), NaN (the first NaN wins), -inf rows,
and the errors for input it does not take."""

import numpy as np
import pytest

from gpt2_cupy import backend
from gpt2_cupy.ops.argmax import ELEMENTS_PER_BLOCK, argmax_forward
from gpt2_cupy.ops.arrays import BFLOAT16, FLOAT32


@pytest.mark.parametrize("dtype", [FLOAT32, BFLOAT16])
@pytest.mark.parametrize("V", [1, 37, ELEMENTS_PER_BLOCK, 2 * ELEMENTS_PER_BLOCK + 5])
def test_argmax_equals_numpy(rng, dtype, V):
    logits = rng.normal(size=(2, 3, V)).astype(dtype)
    index = argmax_forward(backend.xp.asarray(logits))
    assert index.dtype == np.int64 and index.shape == (2, 3, 1)
    assert np.array_equal(backend.asnumpy(index)[..., 0], np.argmax(logits.astype(np.float64), axis=-1))


def test_argmax_ties_nan_and_infinities_as_numpy(rng):
    V = 3 * ELEMENTS_PER_BLOCK + 11
    logits = rng.normal(size=(5, V)).astype(np.float32)
    logits[0, [V - 1, 7, ELEMENTS_PER_BLOCK + 3]] = 50.0             # ties in three blocks: the first wins
    logits[1, [2 * ELEMENTS_PER_BLOCK + 1, V - 2]] = np.nan          # the first NaN wins, whatever the values
    logits[2] = -np.inf                                              # all equal: index 0
    logits[3, ELEMENTS_PER_BLOCK - 1] = np.inf
    logits[4, :] = 0.0
    logits[4, 9] = -0.0                                              # -0 == 0: still index 0
    out = backend.xp.empty((5, 1), dtype=np.int64)
    assert argmax_forward(backend.xp.asarray(logits), out=out) is out
    assert np.array_equal(backend.asnumpy(out)[:, 0], np.argmax(logits, axis=-1))


def test_argmax_refuses_what_it_does_not_take():
    with pytest.raises(ValueError, match="empty last axis"):
        argmax_forward(backend.xp.zeros((2, 0), dtype=np.float32))
    with pytest.raises(TypeError, match="argmax_forward: logits has dtype float64"):
        argmax_forward(backend.xp.zeros((2, 5)))
    with pytest.raises(ValueError, match="out has shape"):
        argmax_forward(backend.xp.zeros((2, 5), dtype=np.float32), out=backend.xp.zeros((2,), dtype=np.int64))
