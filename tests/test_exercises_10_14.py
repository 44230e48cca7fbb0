"""Chapters 10-14's graded exercises: every solution passes, and every broken version of it fails with a
message that names its problem, on the GPU and on the CPU executor."""

import re

import pytest

from gpt2_cupy import backend, exercises
from gpt2_cupy.exercises import checker

# Text replacements of each solution that break it: "guard" removes (or widens) the bounds check, "wrong
# element" writes a result to another valid element (or reads the wrong one), "barrier" removes a
# __syncthreads(). "Nothing written" is derived for every exercise (its body emptied, as the skeleton).
BROKEN = {
    "10.gradient_norm_partial_sums": {
        "guard": ("g[k] = j < n ? grads[j] : 0.0f;", "g[k] = grads[j];"),
        "wrong element": ("partial_sums[blockIdx.x] =", "partial_sums[gridDim.x - 1 - blockIdx.x] ="),
        "barrier": ("partial[threadIdx.x] = sum;\n    __syncthreads();", "partial[threadIdx.x] = sum;"),
    },
    "10.adamw_clipped": {
        "guard": ("if (i < n) {", "{"),
        "wrong element": ("float g = grads[i] * scale;", "float g = grads[n - 1 - i] * scale;"),
    },
    "11.accumulate_gradient": {
        "guard": ("if (i < n) {", "{"),
        "wrong element": ("grad[i] += gradient[i];", "grad[n - 1 - i] += gradient[i];"),
    },
    "11.broadcast_gradient": {
        "guard": ("if (column < columns) {", "{"),
        "wrong element": ("dbias[column] += sum;", "dbias[columns - 1 - column] += sum;"),
    },
    "11b.layernorm_tail": {
        "guard": ("if (i < rows * columns) {", "{"),
        "wrong element": ("out[i] =", "out[rows * columns - 1 - i] ="),
    },
    "11b.row_mean_rstd": {
        "guard": ("c < columns;", "c < columns + blockDim.x;"),
        "wrong element": ("mean[blockIdx.x] = row_mean;", "mean[gridDim.x - 1 - blockIdx.x] = row_mean;"),
        "barrier": ("shared[threadIdx.x] = value;\n    __syncthreads();", "shared[threadIdx.x] = value;"),
    },
    "12.bias_gelu": {
        "guard": ("if (i < rows * columns) {", "{"),
        "wrong element": ("out[i] =", "out[rows * columns - 1 - i] ="),
    },
    "12.tied_head_gradient": {
        "guard": ("if (token < vocab && c < channels) {", "{"),
        "wrong element": ("dwte[token * channels + c] += sum;", "dwte[c * vocab + token] += sum;"),
    },
    "13.token_counts": {
        "guard": ("if (i < n) {", "{"),
        "wrong element": ("atomicAdd(&counts[ids[i]], 1);", "atomicAdd(&counts[ids[i] / 2], 1);"),
    },
    "13.byte_histogram": {
        "guard": ("byte < n;", "byte < n + 4 * blockDim.x;"),
        "wrong element": ("atomicAdd(&counts[threadIdx.x],", "atomicAdd(&counts[255 - threadIdx.x],"),
        "barrier": ("    __syncthreads();\n    atomicAdd(&counts", "    atomicAdd(&counts"),
    },
    "14.mean_loss": {
        "guard": ("i < n;", "i < n + blockDim.x;"),
        "wrong element": ("loss[0] = partial[0] / n;", "loss[0] = partial[1] / n;"),
        "barrier": ("partial[threadIdx.x] = sum;\n    __syncthreads();", "partial[threadIdx.x] = sum;"),
    },
    "14.sample_token": {
        "guard": ("if (row < rows) {", "{"),
        "wrong element": ("tokens[row] = token;", "tokens[rows - 1 - row] = token;"),
    },
}

CHAPTERS = ("10", "11", "11b", "12", "13", "14")
IDS = [exercise_id for exercise_id, chapter, _ in exercises.list() if chapter in CHAPTERS]
ON_CPU = backend.name == "cpu"


def _broken(exercise_id, kind):
    old, new = BROKEN[exercise_id][kind]
    source = exercises.solution(exercise_id)
    assert source.count(old) == 1, f"{exercise_id}: {old!r} is not in its solution exactly once"
    return source.replace(old, new)


def _with_empty_body(exercise_id):
    """The solution with its kernel's body emptied: what a skeleton holds."""
    exercise = exercises.exercise(exercise_id)
    source = exercises.solution(exercise_id)
    start = source.index("{", source.index(f"void {exercise.kernel}("))
    return source[:start] + "{\n    // your code here\n}\n"


def test_two_exercises_per_chapter_each_with_its_broken_versions():
    for chapter in CHAPTERS:
        assert sum(exercises.exercise(i).chapter == chapter for i in IDS) >= 2, chapter
    assert set(IDS) == set(BROKEN)
    for exercise_id in IDS:
        assert {"guard", "wrong element"} <= set(BROKEN[exercise_id])
        if "__syncthreads()" in exercises.solution(exercise_id):
            assert "barrier" in BROKEN[exercise_id], f"{exercise_id}: its solution has a barrier; add its removal"


@pytest.mark.parametrize("exercise_id", IDS)
def test_the_solution_passes(exercise_id):
    result = checker.run_check(exercises.exercise(exercise_id), exercises.solution(exercise_id))
    assert result.passed, result.message
    assert result.message.startswith(f"{exercise_id}: passed at ")


@pytest.mark.parametrize("exercise_id", IDS)
def test_nothing_written_fails(exercise_id):
    result = checker.run_check(exercises.exercise(exercise_id), _with_empty_body(exercise_id))
    assert not result.passed
    # An output the kernel must fill is named as never written; one it adds into (a gradient, a count) still
    # holds what it held before, which the check names as a wrong value at the first element that should change.
    assert ("was never written" in result.message
            or re.search(r"\w+\[[\d, ]+\] is \S+, expected \S+", result.message)), result.message


@pytest.mark.parametrize("exercise_id", IDS)
def test_a_missing_bounds_guard_fails(exercise_id):
    result = checker.run_check(exercises.exercise(exercise_id), _broken(exercise_id, "guard"))
    assert not result.passed
    if ON_CPU:  # the executor's bounds check names the thread and the element
        assert re.search(r"thread \S+ of block \S+ (read|wrote) \w+\[-?\d+\], ((one )?past its end|before the start)",
                         result.message)
        assert "bounds check" in result.message
    else:  # a GPU has no bounds check: the guard region after an output sees the stray write, or the NaN
        # guard after an input reaches the results
        assert re.search(r"\w+\[\d+\] was written, past the end of \w+|\w+\[[\d, ]+\] is NaN", result.message)


@pytest.mark.parametrize("exercise_id", IDS)
def test_the_wrong_element_fails(exercise_id):
    result = checker.run_check(exercises.exercise(exercise_id), _broken(exercise_id, "wrong element"))
    assert not result.passed
    assert re.search(r"\w+\[[\d, ]+\] is \S+, expected \S+ \(\d+ of \d+ elements are off", result.message)


@pytest.mark.skipif(not ON_CPU, reason="a missing barrier is found by the CPU executor's race check; on a GPU "
                                       "the race may not bite, and the kernel may pass")
@pytest.mark.parametrize("exercise_id", [i for i in IDS if "barrier" in BROKEN[i]])
def test_a_missing_barrier_is_a_race(exercise_id):
    result = checker.run_check(exercises.exercise(exercise_id), _broken(exercise_id, "barrier"))
    assert not result.passed
    assert re.search(r"a race on \S+: .*__syncthreads\(\)",
                     result.message), result.message
