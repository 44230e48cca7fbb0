"""Chapters 04-06's graded exercises, beyond the checks every exercise gets (tests/test_exercises.py): the
mistakes these kernels invite fail, each with a message that names what is wrong."""

import pytest

from gpt2_cupy import backend, exercises
from gpt2_cupy.exercises import checker

ON_CPU = backend.name == "cpu"


def _check_changed(exercise_id, old, new):
    """The verdict on the solution with `old` replaced by `new` (which must occur exactly once)."""
    source = exercises.solution(exercise_id)
    assert source.count(old) == 1, f"{exercise_id}: {old!r} is not in its solution exactly once"
    return checker.run_check(exercises.exercise(exercise_id), source.replace(old, new))


def test_log_softmax_without_the_maximum_overflows_on_large_inputs():
    # exp(x) of an input near 1e4 is inf in float32: the row's sum is inf, and every log-probability -inf or NaN
    result = _check_changed("04.log_softmax", "maximum = fmaxf(maximum, __shfl_xor_sync(FULL_MASK, maximum, offset));",
                            "maximum = 0.0f;  // nothing subtracted: right in exact arithmetic")
    assert not result.passed
    assert "failed at rows = 3, columns = 1000, largest = 10000: out[" in result.message


def test_an_online_sum_that_is_not_rescaled_is_wrong():
    # Combining two lanes' sums without moving them to the common maximum adds terms of different scales.
    result = _check_changed("04.online_max_and_sum", "d = d * expf(m - both) + other_d * expf(other_m - both);",
                            "d = d + other_d;")
    assert not result.passed
    assert ": sum[" in result.message and "expected" in result.message
    assert "maximum[" not in result.message  # the maxima are still right: the message names the sum


def test_a_block_softmax_that_forgets_the_last_lanes_state_is_wrong():
    # Warp 0's lanes past the block's warps must hold an empty state (the lowest float, 0). Holding (0, 1), as
    # if each had seen one value 0, adds exp(0 - m) to the row's sum per such lane.
    result = _check_changed("04b.online_block", "m = lane < blockDim.x / WARP_SIZE ? warp_maxima[lane] : LOWEST_FLOAT;\n"
                            "        d = lane < blockDim.x / WARP_SIZE ? warp_sums[lane] : 0.0f;",
                            "m = lane < blockDim.x / WARP_SIZE ? warp_maxima[lane] : 0.0f;\n"
                            "        d = lane < blockDim.x / WARP_SIZE ? warp_sums[lane] : 1.0f;")
    assert not result.passed
    assert ": y[" in result.message


def test_rmsnorm_with_the_mean_subtracted_is_layernorm_not_rmsnorm():
    result = _check_changed("05.rmsnorm_forward", "y[(long long)row * columns + column] = x_row[column] * scale",
                            "y[(long long)row * columns + column] = (x_row[column] - 0.5f) * scale")
    assert not result.passed
    assert ": y[" in result.message and "expected" in result.message


def test_layernorm_dx_without_the_mean_of_g_is_wrong():
    result = _check_changed("05.layernorm_backward_dx", "(g - g_mean - x_hat * g_x_hat_mean)", "(g - x_hat * g_x_hat_mean)")
    assert not result.passed
    assert ": dx[" in result.message


def test_dyt_partial_sums_that_forget_the_blocks_rows_range_are_wrong():
    # Every block summing all rows instead of its own rows_per_block: the partial rows repeat the whole sum.
    result = _check_changed("05b.dyt_partial_sums", "int end = min(first + rows_per_block, rows);", "int end = rows;")
    assert not result.passed
    assert "failed at rows = 70, columns = 40: weight_partials[" in result.message


def test_a_grouped_sum_that_skips_empty_groups_leaves_their_rows_unwritten():
    # An id with no positions still owns a row of the result: its gradient is 0, and it must be written.
    result = _check_changed("06.grouped_backward", "    if (c < C) {\n",
                            "    if (starts[v] == starts[v + 1]) {\n        return;\n    }\n    if (c < C) {\n")
    assert not result.passed
    assert "dweight[" in result.message and "was never written" in result.message


@pytest.mark.skipif(not ON_CPU, reason="only the CPU executor's bounds check sees a read outside the table; on a "
                                       "GPU it reads whatever lies there")
def test_a_lookup_without_the_id_check_reads_outside_the_table():
    result = _check_changed("06.token_position_forward", "out[i] = (0 <= id && id < V) ? wte[id * C + c] + wpe[t * C + c] : QUIET_NAN;",
                            "out[i] = wte[id * C + c] + wpe[t * C + c];")
    assert not result.passed
    assert "read wte[" in result.message and ("past its end" in result.message or "before the start" in result.message)


def test_every_exercise_of_these_chapters_is_listed_with_its_chapter():
    listed = {exercise_id: chapter for exercise_id, chapter, _ in exercises.list()}
    for chapter, names in {"04": ("log_softmax", "online_max_and_sum"), "04b": ("online_block", "backward_block"),
                           "05": ("rmsnorm_forward", "layernorm_backward_dx"),
                           "05b": ("dyt_forward", "dyt_partial_sums"),
                           "06": ("token_position_forward", "grouped_backward")}.items():
        for name in names:
            assert listed[f"{chapter}.{name}"] == chapter
