"""Chapter 13's graded exercises: counting tokens, and counting a text's bytes with a shared-memory histogram."""

import numpy

from gpt2_cupy.exercises.checker import Exercise, Input, Output, Scalar, blocks

THREADS_PER_BLOCK = 256
HISTOGRAM_BLOCKS = 4   # byte_histogram: a fixed grid of this many blocks of 256 threads, one per byte value
SAMPLE = "吾輩は猫である。名前はまだ無い。ROMEO: What light through yonder window breaks? ２０２４年\n".encode()


def _token_counts_arguments(size, rng):
    n, vocab = size["n"], size["vocab"]
    ids = rng.zipf(1.3, n) % vocab   # a few frequent ids and a long tail, like a real text's
    return [Output("counts", (vocab,), dtype=numpy.int32, initial=numpy.zeros(vocab, numpy.int32)),
            Input("ids", ids.astype(numpy.int32)),
            Scalar("n", numpy.int32(n))]


def _text_bytes(n):
    """n bytes of UTF-8 text, the sample repeated."""
    return (SAMPLE * (n // len(SAMPLE) + 1))[:n]


def _byte_histogram_arguments(size, rng):
    n = size["n"]
    padded = _text_bytes(n) + bytes(-n % 4)   # whole words; the padding bytes are not counted
    words = numpy.frombuffer(padded, dtype="<i4").copy()
    return [Output("counts", (256,), dtype=numpy.int32, initial=numpy.zeros(256, numpy.int32)),
            Input("words", words),
            Scalar("n", numpy.int32(n))]


def _byte_histogram_reference(counts, words, n):
    data = numpy.frombuffer(words.astype("<i4").tobytes(), dtype=numpy.uint8)[:n]
    return {"counts": numpy.bincount(data, minlength=256).astype(numpy.float64)}


EXERCISES = [
    Exercise(
        id="13.token_counts", title="How often each token occurs", kernel="token_counts",
        arguments=_token_counts_arguments,
        launch=lambda size: ((blocks(size["n"], THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,)),
        reference=lambda counts, ids, n: {"counts": numpy.bincount(ids, minlength=counts.size).astype(numpy.float64)},
        sizes=({"n": 1, "vocab": 5}, {"n": 255, "vocab": 64}, {"n": 257, "vocab": 2048}, {"n": 5000, "vocab": 100}),
        rtol=0.0),  # counts are exact
    Exercise(
        id="13.byte_histogram", title="A byte histogram of UTF-8 text, in shared memory", kernel="byte_histogram",
        arguments=_byte_histogram_arguments,
        launch=lambda size: ((HISTOGRAM_BLOCKS,), (THREADS_PER_BLOCK,)),
        reference=_byte_histogram_reference,
        sizes=({"n": 1}, {"n": 255}, {"n": 1030}, {"n": 4099}),
        rtol=0.0),
]
