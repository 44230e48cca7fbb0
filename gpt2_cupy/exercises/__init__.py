"""Graded exercises: write a kernel in a chapter, and have it checked at once.

    from gpt2_cupy import exercises
    exercises.check("00.scale_and_add", source)   prints one verdict and returns it (.passed, .message)
    exercises.list()                              every exercise: (id, chapter, title)
    exercises.solution("00.scale_and_add")        the reference solution's CUDA C

A check compiles the source, runs the kernel at several sizes (some not multiples of the block size),
on the CPU under the executor's bounds and race checks, and compares every output with a float64 numpy
reference; the verdict names the first thing wrong in the kernel's own terms. How an exercise is stated,
and how to add one: gpt2_cupy/exercises/checker.py.
"""

from gpt2_cupy import kernels
from gpt2_cupy.exercises import (chapter_00, chapter_01, chapter_02, chapter_03, chapter_04, chapter_05, chapter_06,
                                 chapter_07, chapter_08, chapter_09)
from gpt2_cupy.exercises import chapter_10, chapter_11, chapter_11b, chapter_12, chapter_13, chapter_14
from gpt2_cupy.exercises import chapter_15a, chapter_15b
from gpt2_cupy.exercises import chapter_16a, chapter_16b, chapter_16c, chapter_17a, chapter_17b
from gpt2_cupy.exercises import chapter_18
from gpt2_cupy.exercises.checker import Exercise, Result, run_check

__all__ = ["check", "list", "solution", "exercise", "Exercise", "Result"]

_CHAPTERS = (chapter_00, chapter_01, chapter_02, chapter_03, chapter_04, chapter_05, chapter_06, chapter_07, chapter_08,
             chapter_09,
             chapter_10, chapter_11, chapter_11b, chapter_12, chapter_13, chapter_14,
             chapter_15a, chapter_15b,
             chapter_16a, chapter_16b, chapter_16c, chapter_17a, chapter_17b,
             chapter_18)
_EXERCISES = {exercise.id: exercise for chapter in _CHAPTERS for exercise in chapter.EXERCISES}


def exercise(exercise_id):
    """The Exercise named `exercise_id` ("NN.name"); KeyError naming the known ones otherwise."""
    if exercise_id not in _EXERCISES:
        raise KeyError(f"no exercise {exercise_id!r}; the exercises are {', '.join(_EXERCISES)}")
    return _EXERCISES[exercise_id]


def check(exercise_id, source):
    """Check the CUDA C `source` against the exercise: print the verdict's one line and return it as a Result."""
    result = run_check(exercise(exercise_id), source)
    print(result.message)
    return result


def list():  # noqa: A001 (the name the chapters call, as `exercises.list()`)
    """[(id, chapter, title)] of every exercise, in the chapters' order."""
    return [(e.id, e.chapter, e.title) for e in _EXERCISES.values()]


def solution(exercise_id):
    """The reference solution's source: kernels/exercises/NN_name.cu, exported from the chapter's solution cell."""
    return kernels.source(f"exercises/{exercise(exercise_id).file_name}")
