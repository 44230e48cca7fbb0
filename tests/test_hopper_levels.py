"""Chapter 15b's Hopper GEMM levels (kernels/steps/hopper_level*.cu) against float64 numpy.

Every level at sizes of several tiles and more slices than a ring has stages; the persistent levels also on
fewer blocks than tiles, so that a block's ring runs on from one tile to the next and (ping-pong) both
warpgroups take several tiles in turn. On a GPU they need an H100 or H200 (sm_90a); on the CPU the executor
runs wgmma, TMA and the mbarriers.
"""

import pytest

from bench.hopper_levels import BLOCK_N, LEVELS, SLICE_K, TOLERANCE, check
from gpt2_cupy import backend


def _is_hopper():
    return backend.xp.cuda.Device().compute_capability == "90"


pytestmark = pytest.mark.skipif(backend.name == "cuda" and not _is_hopper(),
                                reason="wgmma and TMA need compute capability 9.0 (H100, H200)")


@pytest.mark.parametrize("label", list(LEVELS))
def test_level_matches_float64(label):
    level = LEVELS[label]
    M, N, K = 2 * level.block_m, 3 * BLOCK_N, 6 * SLICE_K * level.splits
    assert check(level, M, N, K, seed=3) < TOLERANCE


@pytest.mark.parametrize("label", [label for label, level in LEVELS.items() if level.persistent])
@pytest.mark.parametrize("blocks", [1, 2, 5])
def test_persistent_level_on_fewer_blocks_than_tiles(label, blocks):
    level = LEVELS[label]
    assert check(level, 3 * level.block_m, 2 * BLOCK_N, 3 * SLICE_K, seed=blocks, blocks=blocks) < TOLERANCE


@pytest.mark.parametrize("label", list(LEVELS))
def test_level_refuses_sizes_that_are_not_whole_tiles(label):
    level = LEVELS[label]
    with pytest.raises(ValueError, match="a multiple of"):
        check(level, level.block_m, BLOCK_N + 8, SLICE_K * level.splits)


def test_single_slice_and_single_tile():
    for level in LEVELS.values():
        assert check(level, level.block_m, BLOCK_N, SLICE_K * level.splits, seed=9, blocks=1) < TOLERANCE
