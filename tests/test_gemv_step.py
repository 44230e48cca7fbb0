"""Chapter 17b's teaching step of the GEMV (kernels/steps/gemv_warp_per_row.cu): W x against float64 numpy on
ragged sizes, and nothing written past y's end. (That each chapter launches and checks every kernel file it
exports is tests/test_chapter_kernels_checked.py.)"""

import numpy as np
import pytest

from gpt2_cupy import backend, kernels
from gpt2_cupy.testing import relative_error


@pytest.mark.parametrize("N, K", [(1, 1), (7, 33), (77, 100), (300, 1031)])
def test_gemv_warp_per_row_step(N, K):
    rng = np.random.default_rng(N * 1000 + K)
    x, weight = rng.standard_normal(K).astype(np.float32), rng.standard_normal((N, K)).astype(np.float32)
    y = backend.xp.full(N + 8, np.nan, dtype=np.float32)                  # 8 more: a stray write shows
    kernels.function("steps/gemv_warp_per_row", "gemv_warp_per_row")(
        (-(-N // 8),), (256,), (y, backend.xp.asarray(x), backend.xp.asarray(weight), np.int32(N), np.int32(K)))
    y = backend.asnumpy(y)
    assert relative_error(y[:N], weight.astype(np.float64) @ x.astype(np.float64)) < 1e-5
    assert np.isnan(y[N:]).all()
