"""The references of chapters 07-09's graded exercises, each against an independent one: the numpy Philox
against Random123's published answers and the package's dropout kernel, the attention and cross-entropy
references against the package's ops. (tests/test_exercises.py runs every solution and its broken versions.)"""

import numpy as np

from gpt2_cupy import backend, exercises
from gpt2_cupy.exercises import chapter_07, chapter_08, chapter_09
from gpt2_cupy.exercises.checker import Output
from gpt2_cupy.ops.attention import attention_forward
from gpt2_cupy.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
from gpt2_cupy.ops.dropout import dropout_uniform
from gpt2_cupy.testing import relative_error

# Random123 (github.com/DEShawResearch/random123), tests/kat_vectors, the first and last "philox4x32 10" lines.
KNOWN_ANSWERS = [((0, 0, 0, 0), (0, 0), (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
                 ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
                  (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1))]


def _exercise_inputs(exercise_id, size):
    """{name: value} of an exercise's inputs and scalars at `size`, as its check draws them."""
    exercise = exercises.exercise(exercise_id)
    arguments = exercise.arguments(size, np.random.default_rng(1))
    return {a.name: getattr(a, "array", getattr(a, "value", None)) for a in arguments
            if not isinstance(a, Output)}


def test_the_numpy_philox_gives_the_published_answers():
    for counter, key, expected in KNOWN_ANSWERS:
        assert chapter_07.philox_words(np.array([counter]), key)[0].tolist() == list(expected)


def test_the_uniforms_are_the_dropout_kernels():
    for seed, offset in [(7, 0), (2**40 + 3, 2**33 + 5)]:
        state = backend.xp.asarray(np.array([seed, offset], dtype=np.uint64))
        assert np.array_equal(chapter_07._uniforms(1001, seed, offset), backend.asnumpy(dropout_uniform(1001, state)))


def test_the_normals_have_mean_0_and_variance_1():
    z = chapter_07._normal_reference(np.uint64(3), 400_000)["z"]
    assert abs(z.mean()) < 5 / np.sqrt(z.size) and abs(z.var() - 1) < 5 * np.sqrt(2 / z.size)


def test_the_attention_references_agree_with_the_package():
    inputs = _exercise_inputs("08.forward_warp_per_row", {"T": 70, "d": 32})
    expected = chapter_08._forward_reference(**inputs)
    out, lse = attention_forward(*(backend.xp.asarray(inputs[name]) for name in ("q", "k", "v")))
    assert relative_error(out, expected["out"]) < 1e-5 and relative_error(lse, expected["lse"]) < 1e-5
    inputs = _exercise_inputs("08.dv_query_tiles", {"T": 65})
    # dv from the naive chain: P (from the package's forward) transposed times dout
    p = np.exp(chapter_08._scores(inputs["q"], inputs["k"]) - inputs["lse"].astype(np.float64)[:, None])
    assert relative_error(chapter_08._dv_reference(**inputs)["dv"], p.T @ inputs["dout"].astype(np.float64)) < 1e-12
    assert relative_error(np.exp(chapter_08._log_sum_exp(chapter_08._scores(inputs["q"], inputs["k"]))),
                          np.exp(inputs["lse"].astype(np.float64))) < 1e-6


def test_the_cross_entropy_references_agree_with_the_package():
    inputs = _exercise_inputs("09.forward_warp_per_row", {"N": 5, "V": 33})
    logits, targets = (backend.xp.asarray(inputs[name]) for name in ("logits", "targets"))
    loss, lse = cross_entropy_forward(logits, targets, ignore_index=chapter_09.IGNORE_INDEX)
    expected = chapter_09._forward_reference(**inputs)
    counted = int((inputs["targets"] != chapter_09.IGNORE_INDEX).sum())
    assert relative_error(lse, expected["lse"]) < 1e-6
    assert relative_error(backend.asnumpy(loss), expected["row_losses"].sum() / counted) < 1e-6
    inputs = _exercise_inputs("09.backward_from_lse", {"N": 5, "V": 33})
    dout = backend.xp.asarray(np.float32(1.0))
    logits, targets = (backend.xp.asarray(inputs[name]) for name in ("logits", "targets"))
    _, lse = cross_entropy_forward(logits, targets, ignore_index=chapter_09.IGNORE_INDEX)
    dlogits = cross_entropy_backward(dout, logits, targets, lse, ignore_index=chapter_09.IGNORE_INDEX)
    assert relative_error(dlogits, chapter_09._backward_reference(**inputs)["dlogits"]) < 1e-5
