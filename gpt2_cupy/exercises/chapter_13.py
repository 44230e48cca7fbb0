"""Chapter 13's graded exercises: the length of the character each UTF-8 byte starts, and a shared-memory histogram
of a text's bytes."""

import numpy

from gpt2_cupy.exercises.checker import Exercise, Input, Output, Scalar, blocks

THREADS_PER_BLOCK = 256
HISTOGRAM_BLOCKS = 4   # byte_histogram: a fixed grid of this many blocks of 256 threads, one per byte value
# Characters of 1, 2, 3 and 4 bytes: ASCII, é, kana, kanji and full-width forms, and 𠮷 (outside the BMP)
SAMPLE = "吾輩は猫である。名前はまだ無い。ROMEO: What light through yonder window breaks? ２０２４年 café 𠮷野家\n".encode()


def _text_bytes(n):
    """n bytes of UTF-8 text, the sample repeated."""
    return (SAMPLE * (n // len(SAMPLE) + 1))[:n]


def _words(n):
    """The text's n bytes as little-endian int32 words, the last one padded with zero bytes (not counted)."""
    return numpy.frombuffer(_text_bytes(n) + bytes(-n % 4), dtype="<i4").copy()


def _bytes_of(words, n):
    return numpy.frombuffer(words.astype("<i4").tobytes(), dtype=numpy.uint8)[:n]


def _utf8_lengths_arguments(size, rng):
    n = size["n"]
    return [Output("lengths", (n,), dtype=numpy.int32), Input("words", _words(n)), Scalar("n", numpy.int32(n))]


def _utf8_lengths_reference(words, n):
    data = _bytes_of(words, n)
    lengths = numpy.select([data < 0x80, (data & 0xE0) == 0xC0, (data & 0xF0) == 0xE0, (data & 0xF8) == 0xF0],
                           [1, 2, 3, 4], default=0)
    return {"lengths": lengths.astype(numpy.float64)}


def _byte_histogram_arguments(size, rng):
    n = size["n"]
    words = _words(n)
    return [Output("counts", (256,), dtype=numpy.int32, initial=numpy.zeros(256, numpy.int32)),
            Input("words", words),
            Scalar("n", numpy.int32(n))]


def _byte_histogram_reference(counts, words, n):
    return {"counts": numpy.bincount(_bytes_of(words, n), minlength=256).astype(numpy.float64)}


EXERCISES = [
    Exercise(
        id="13.utf8_lengths", title="The length of the character each UTF-8 byte starts", kernel="utf8_lengths",
        arguments=_utf8_lengths_arguments,
        launch=lambda size: ((blocks(size["n"], THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,)),
        reference=_utf8_lengths_reference,
        sizes=({"n": 1}, {"n": 255}, {"n": 257}, {"n": 3001}),
        rtol=0.0),  # a length is right or wrong
    Exercise(
        id="13.byte_histogram", title="A byte histogram of UTF-8 text, in shared memory", kernel="byte_histogram",
        arguments=_byte_histogram_arguments,
        launch=lambda size: ((HISTOGRAM_BLOCKS,), (THREADS_PER_BLOCK,)),
        reference=_byte_histogram_reference,
        sizes=({"n": 1}, {"n": 255}, {"n": 1030}, {"n": 4099}),
        rtol=0.0),
]
