"""gpt2_cupy.data: exact round trips through the tokenizer, deterministic outputs, llm.c token files, batches.

Expected values come from outside the code under test: header bytes from struct.pack, decoded text from
sentencepiece's own decoder and from the original files, windows from slicing the token array by hand.
"""

import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from gpt2_cupy import backend, data

DATA_DIR = data.DATA_DIR
SHAKESPEARE = DATA_DIR / "tinyshakespeare.txt"
AOZORA = sorted((DATA_DIR / "aozora").glob("*.txt"))
# A few works for training a test tokenizer quickly; the round trips then run over all 19, so characters
# these three never use are exercised too.
AOZORA_TRAINING = [DATA_DIR / "aozora" / name for name in ("bottyan.txt", "tyuumon.txt", "serohiki.txt")]


def read(path):
    return path.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def shakespeare_tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shakespeare")
    return data.Tokenizer(data.train_tokenizer([SHAKESPEARE], 1024, folder / "tok"))


@pytest.fixture(scope="module")
def aozora_tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("aozora")
    return data.Tokenizer(data.train_tokenizer(AOZORA_TRAINING, 4096, folder / "tok"))


# ---------------------------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------------------------


def test_round_trip_tinyshakespeare(shakespeare_tokenizer):
    text = read(SHAKESPEARE)
    ids = shakespeare_tokenizer.encode(text)
    assert shakespeare_tokenizer.decode(ids) == text
    assert 0 not in ids  # <unk>
    assert len(text) / len(ids) > 2  # it does compress: pieces longer than one character are used


def test_round_trip_aozora(aozora_tokenizer):
    for path in AOZORA:
        text = read(path)
        ids = aozora_tokenizer.encode(text)
        assert aozora_tokenizer.decode(ids) == text, path.name
        assert 0 not in ids, path.name


def test_decode_agrees_with_sentencepiece(shakespeare_tokenizer, aozora_tokenizer):
    samples = [(shakespeare_tokenizer, read(SHAKESPEARE)[:100_000]), (aozora_tokenizer, read(AOZORA[0]))]
    for tokenizer, text in samples:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == tokenizer.processor.decode(ids)


def test_newlines_and_full_width_characters_survive(aozora_tokenizer):
    newline = aozora_tokenizer.processor.piece_to_id("\n")
    assert aozora_tokenizer.encode("\n") == [newline]
    texts = ["吾輩は猫である。\n名前はまだ無い？", "　全角の空白　", "a\n\n\nb", "  two  spaces  ", "\r\n", "▁", "x▁▁y"]
    for text in texts:
        assert aozora_tokenizer.decode(aozora_tokenizer.encode(text)) == text, repr(text)


def random_unicode(rng, length):
    """A string mixing likely and unlikely characters: newlines, full-width punctuation, emoji, any code point."""
    pools = [
        list("abc XYZ 019.,;:!?'\n\n\t\r"),
        list("の、。？！「」　漢字カナ"),
        list("😀🦀👍🏽🇯🇵鰻𠮷é\u0301\u2581\u00a0\ufeff\x00"),
    ]
    characters = []
    for _ in range(length):
        kind = rng.integers(4)
        if kind < 3:
            pool = pools[kind]
            characters.append(pool[rng.integers(len(pool))])
        else:  # any code point but the surrogates, which UTF-8 cannot encode
            code = int(rng.integers(0x110000 - 0x800))
            characters.append(chr(code if code < 0xD800 else code + 0x800))
    return "".join(characters)


def test_space_without_a_space_piece(aozora_tokenizer):
    # The Aozora texts contain no space, so sentencepiece learns no "▁" piece; a space is then spelled as the
    # byte 0x20 (sentencepiece alone would fall back to the bytes of "▁" and decode it as "▁").
    assert aozora_tokenizer.processor.piece_to_id("\u2581") == 0
    assert aozora_tokenizer.pieces(aozora_tokenizer.encode(" ")) == ["<0x20>"]
    assert aozora_tokenizer.decode(aozora_tokenizer.encode("猫 と 犬  ")) == "猫 と 犬  "


def test_round_trip_random_unicode(shakespeare_tokenizer, aozora_tokenizer, rng):
    for tokenizer in (shakespeare_tokenizer, aozora_tokenizer):
        for _ in range(300):
            text = random_unicode(rng, int(rng.integers(0, 60)))
            ids = tokenizer.encode(text)
            assert all(0 < token < tokenizer.vocab_size for token in ids)
            assert tokenizer.decode(ids) == text, repr(text)


def test_unseen_character_is_spelled_in_bytes(shakespeare_tokenizer):
    ids = shakespeare_tokenizer.encode("鰻")
    assert shakespeare_tokenizer.pieces(ids) == ["<0xE9>", "<0xB0>", "<0xBB>"]
    assert bytes(int(piece[3:5], 16) for piece in shakespeare_tokenizer.pieces(ids)) == "鰻".encode("utf-8")


def test_incremental_decoder_never_cuts_a_character(shakespeare_tokenizer, aozora_tokenizer, rng):
    for tokenizer in (shakespeare_tokenizer, aozora_tokenizer):
        for _ in range(100):
            text = random_unicode(rng, int(rng.integers(1, 40)))
            decoder = tokenizer.decoder()
            emitted = [decoder.feed(token) for token in tokenizer.encode(text)]
            emitted.append(decoder.finish())
            assert "".join(emitted) == text
            if "\ufffd" not in text:
                assert not any("\ufffd" in piece for piece in emitted)


def test_incremental_decoder_holds_back_a_partial_character(shakespeare_tokenizer):
    decoder = shakespeare_tokenizer.decoder()
    first, second, third = shakespeare_tokenizer.encode("鰻")
    assert decoder.feed(first) == ""
    assert decoder.pending_bytes() == b"\xe9"
    assert decoder.feed(second) == ""
    assert decoder.pending_bytes() == b"\xe9\xb0"
    assert decoder.feed(third) == "鰻"
    assert decoder.pending_bytes() == b""
    # A stream that stops inside a character ends in one replacement character.
    decoder = shakespeare_tokenizer.decoder()
    decoder.feed(first)
    assert decoder.finish() == "\ufffd"


def test_bad_ids_and_text_are_refused(shakespeare_tokenizer):
    with pytest.raises(TypeError):
        shakespeare_tokenizer.encode(b"bytes")
    with pytest.raises(ValueError, match="1024"):
        shakespeare_tokenizer.decode([1024])
    with pytest.raises(ValueError, match="-1"):
        shakespeare_tokenizer.decode([-1])


# ---------------------------------------------------------------------------------------------------------
# Determinism
# ---------------------------------------------------------------------------------------------------------


def test_same_inputs_same_tokenizer(tmp_path):
    # Two trainings, the second on a copy of the file in another folder: the model bytes must not change.
    sample = tmp_path / "a" / "sample.txt"
    sample.parent.mkdir()
    sample.write_text(read(SHAKESPEARE)[:200_000] + read(AOZORA[-1]), encoding="utf-8")
    copy = tmp_path / "b" / "copy.txt"
    copy.parent.mkdir()
    shutil.copy(sample, copy)
    first = data.train_tokenizer([sample], 2048, tmp_path / "first").read_bytes()
    second = data.train_tokenizer([copy], 2048, tmp_path / "second").read_bytes()
    assert first == second


def small_data_dir(folder):
    """A data/ folder with slices of both corpora, small enough to prepare in a second or two."""
    folder.mkdir()
    (folder / "tinyshakespeare.txt").write_text(read(SHAKESPEARE)[:150_000], encoding="utf-8")
    (folder / "aozora").mkdir()
    for path in AOZORA_TRAINING:
        (folder / "aozora" / path.name).write_text(read(path)[:30_000], encoding="utf-8")
    return folder


def prepared_bytes(outputs):
    return [path.read_bytes() for path in (outputs.tokenizer, outputs.train, outputs.val)]


def test_prepare_is_deterministic(tmp_path):
    first = small_data_dir(tmp_path / "first")
    second = small_data_dir(tmp_path / "second")
    for corpus, vocab_size in (("tinyshakespeare", 512), ("aozora", 2000)):
        a = data.prepare(corpus, vocab_size, data_dir=first, progress=False)
        b = data.prepare(corpus, vocab_size, data_dir=second, progress=False)
        assert a.tokenizer == first / corpus / "tokenizer.model"
        assert prepared_bytes(a) == prepared_bytes(b)


def test_prepare_splits_at_paragraphs_and_keeps_all_text(tmp_path):
    folder = small_data_dir(tmp_path / "data")
    for corpus, boundary, documents in (
        ("tinyshakespeare", "\n\n", [folder / "tinyshakespeare.txt"]),
        ("aozora", "\n", sorted((folder / "aozora").glob("*.txt"))),
    ):
        vocab_size = 1000 if corpus == "tinyshakespeare" else 2000
        outputs = data.prepare(corpus, vocab_size, data_dir=folder, progress=False)
        tokenizer = data.Tokenizer(outputs.tokenizer)
        end = tokenizer.processor.piece_to_id("<|endoftext|>")
        train_ids = data.read_tokens(outputs.train).tolist()
        val_ids = data.read_tokens(outputs.val).tolist()
        # Each document contributes one part to each file, and each part starts with end-of-text.
        assert train_ids.count(end) == val_ids.count(end) == len(documents)
        assert train_ids[0] == val_ids[0] == end
        train_parts = [tokenizer.decode(part) for part in split_at(train_ids, end)]
        val_parts = [tokenizer.decode(part) for part in split_at(val_ids, end)]
        for document, train_text, val_text in zip(documents, train_parts, val_parts):
            text = read(document)
            assert train_text + val_text == text
            assert train_text.endswith(boundary)
            assert 0.0 < len(val_text) / len(text) <= 0.1


def split_at(ids, separator):
    """The runs of ids after each separator (the list starts with one)."""
    parts = []
    for token in ids:
        if token == separator:
            parts.append([])
        else:
            parts[-1].append(token)
    return parts


def test_prepare_skips_up_to_date_outputs(tmp_path):
    folder = small_data_dir(tmp_path / "data")
    outputs = data.prepare("tinyshakespeare", 512, data_dir=folder, progress=False)
    written = outputs.train.stat().st_mtime_ns
    data.prepare("tinyshakespeare", 512, data_dir=folder, progress=False)
    assert outputs.train.stat().st_mtime_ns == written  # nothing redone
    data.prepare("tinyshakespeare", 600, data_dir=folder, progress=False)
    assert data.Tokenizer(outputs.tokenizer).vocab_size == 600  # another vocabulary size is redone
    written = outputs.train.stat().st_mtime_ns
    source = folder / "tinyshakespeare.txt"
    os.utime(source, ns=(written + 10**9, written + 10**9))  # the input changed after the outputs were written
    data.prepare("tinyshakespeare", 600, data_dir=folder, progress=False)
    assert outputs.train.stat().st_mtime_ns > written


def test_prepare_refuses_unknown_corpus(tmp_path):
    with pytest.raises(ValueError, match="wikipedia"):
        data.prepare("wikipedia", data_dir=tmp_path)


# ---------------------------------------------------------------------------------------------------------
# Token files
# ---------------------------------------------------------------------------------------------------------


def test_token_file_bytes_match_llm_c(tmp_path):
    ids = [0, 1, 2, 50256, 65535, 7]
    path = tmp_path / "tokens.bin"
    data.write_tokens(path, ids)
    expected = struct.pack("<256i", 20240520, 1, len(ids), *([0] * 253)) + struct.pack("<6H", *ids)
    assert path.read_bytes() == expected
    tokens = data.read_tokens(path)
    assert isinstance(tokens, np.memmap)
    assert tokens.dtype == np.uint16
    assert tokens.tolist() == ids


def test_empty_token_file(tmp_path):
    path = tmp_path / "empty.bin"
    data.write_tokens(path, [])
    assert path.read_bytes() == struct.pack("<256i", 20240520, 1, 0, *([0] * 253))
    assert len(data.read_tokens(path)) == 0


@pytest.mark.parametrize(
    "bad_ids, error, words",
    [
        ([1, 65536], ValueError, "65536"),
        ([3, -1], ValueError, "negative"),
        ([1.0, 2.0], TypeError, "integers"),
        ([[1, 2], [3, 4]], ValueError, "one-dimensional"),
    ],
)
def test_write_tokens_refuses_bad_ids(tmp_path, bad_ids, error, words):
    path = tmp_path / "bad.bin"
    with pytest.raises(error, match=words):
        data.write_tokens(path, bad_ids)
    assert not path.exists()


def token_file_bytes(magic=20240520, version=1, count=3, tokens=(5, 6, 7)):
    return struct.pack("<256i", magic, version, count, *([0] * 253)) + struct.pack(f"<{len(tokens)}H", *tokens)


@pytest.mark.parametrize(
    "contents, words",
    [
        (token_file_bytes()[:-1], "truncated"),  # half of the last token is missing
        (token_file_bytes(count=4), "truncated"),  # the header promises more tokens than there are
        (token_file_bytes()[:100], "truncated"),  # not even a whole header
        (b"", "truncated"),
        (token_file_bytes(magic=20240521), "magic"),
        (token_file_bytes(version=2), "version 2"),
        (token_file_bytes(count=2), "too long"),
        (token_file_bytes() + b"\x00", "too long"),
        (token_file_bytes(count=-1, tokens=()), "negative"),
    ],
)
def test_read_tokens_names_the_file_and_the_problem(tmp_path, contents, words):
    path = tmp_path / "broken.bin"
    path.write_bytes(contents)
    with pytest.raises(ValueError, match=words) as error:
        data.read_tokens(path)
    assert "broken.bin" in str(error.value)


# ---------------------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------------------


def host(array):
    return backend.asnumpy(array)


def test_batches_shapes_dtype_and_targets():
    tokens = np.random.default_rng(0).integers(0, 65536, size=5000).astype(np.uint16)
    batches = data.Batches(tokens, B=4, T=16, seed=1)
    inputs, targets = batches.sample()
    assert isinstance(inputs, backend.xp.ndarray) and isinstance(targets, backend.xp.ndarray)
    assert inputs.shape == targets.shape == (4, 16)
    assert inputs.dtype == targets.dtype == np.int32
    inputs, targets = host(inputs), host(targets)
    for row_inputs, row_targets in zip(inputs, targets):
        # Find the window by hand: the row is a contiguous slice of the tokens.
        starts = [s for s in range(len(tokens) - 16) if np.array_equal(tokens[s : s + 16], row_inputs)]
        assert starts, "row is not a window of the tokens"
        start = starts[0]
        np.testing.assert_array_equal(row_targets, tokens[start + 1 : start + 17])


def test_batches_reproducible_from_seed():
    tokens = np.arange(3000, dtype=np.uint16)
    first, second, other = (data.Batches(tokens, 8, 32, seed) for seed in (7, 7, 8))
    for _ in range(5):
        a, b, c = first.sample(), second.sample(), other.sample()
        np.testing.assert_array_equal(host(a[0]), host(b[0]))
        np.testing.assert_array_equal(host(a[1]), host(b[1]))
    assert not np.array_equal(host(a[0]), host(c[0]))


def test_batches_reach_the_end_but_never_past_it():
    tokens = np.arange(20, dtype=np.uint16)  # token value == position, so a window's first value is its start
    batches = data.Batches(tokens, B=3, T=5, seed=0)
    starts = set()
    for _ in range(400):
        inputs, targets = (host(array) for array in batches.sample())
        np.testing.assert_array_equal(inputs, inputs[:, :1] + np.arange(5))
        np.testing.assert_array_equal(targets, inputs + 1)
        starts.update(inputs[:, 0].tolist())
    assert starts == set(range(20 - 5))  # 0 .. 14: the window starting at 14 has its last target at 19


@pytest.mark.parametrize("count, B, T", [(1000, 4, 16), (65, 4, 16), (64 * 3 + 1, 8, 8), (500, 1, 1)])
def test_sequential_pass_covers_the_tokens_once(count, B, T):
    tokens = np.arange(count, dtype=np.uint16)
    batches = data.Batches(tokens, B, T)
    passes = list(batches.sequential())
    assert len(passes) == batches.sequential_batches == (count - 1) // (B * T)
    covered = len(passes) * B * T
    inputs = np.concatenate([host(i).reshape(-1) for i, _ in passes])
    targets = np.concatenate([host(t).reshape(-1) for _, t in passes])
    np.testing.assert_array_equal(inputs, np.arange(covered))
    np.testing.assert_array_equal(targets, np.arange(1, covered + 1))
    assert all(i.shape == (B, T) and i.dtype == np.int32 for i, _ in passes)


def test_batches_from_a_token_file(tmp_path):
    path = tmp_path / "tokens.bin"
    data.write_tokens(path, np.arange(300) * 200)
    inputs, targets = data.Batches(path, 2, 10, seed=3).sample()
    inputs, targets = host(inputs), host(targets)
    np.testing.assert_array_equal(targets, inputs + 200)
    first_inputs, _ = next(data.Batches(str(path), 2, 10).sequential())
    np.testing.assert_array_equal(host(first_inputs), (np.arange(20) * 200).reshape(2, 10))


@pytest.mark.parametrize(
    "tokens, B, T, seed, error, words",
    [
        (np.arange(64), 4, 16, 0, ValueError, "B=4, T=16 is too big for 64 tokens"),
        (np.arange(10), 1, 10, 0, ValueError, "too big"),
        (np.arange(100), 0, 4, 0, ValueError, "B must be at least 1"),
        (np.arange(100), 2, 4.0, 0, TypeError, "T must be an int"),
        (np.arange(100), True, 4, 0, TypeError, "B must be an int"),
        (np.arange(100), 2, 4, 0.5, TypeError, "seed"),
        (list(range(100)), 2, 4, 0, TypeError, "list"),
        (np.arange(100.0), 2, 4, 0, TypeError, "float64"),
        (np.arange(100).reshape(10, 10), 2, 4, 0, TypeError, "2-D"),
    ],
)
def test_batches_refuse_bad_arguments(tokens, B, T, seed, error, words):
    with pytest.raises(error, match=words):
        data.Batches(tokens, B, T, seed)


# ---------------------------------------------------------------------------------------------------------
# Bad input is refused, naming the file and the problem
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "contents, words",
    [
        (b"", "empty"),
        (b"  \n\n", "empty"),
        (b"fine text\n\xe6\xaa more", r"not valid UTF-8 at byte offset 10"),
        (b"short line\n" + b"x" * ((1 << 20) + 1), r"line 2 \(at byte offset 11\) is 1048577 bytes long"),
        (b"y" * ((1 << 20) + 5), "line 1 .* 1048581 bytes long"),  # only such lines: sentencepiece's INTERNAL error
    ],
)
def test_train_tokenizer_refuses_a_bad_corpus_file(tmp_path, contents, words):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(contents)
    with pytest.raises(ValueError, match=words) as raised:
        data.train_tokenizer(corpus, 300, tmp_path / "tokenizer")
    assert str(corpus) in str(raised.value)
    assert not (tmp_path / "tokenizer.model").exists()


@pytest.mark.parametrize(
    "tokens, B, T, words",
    [
        (np.array([1, 2, 2**33 + 5, 4, 5], dtype=np.int64), 1, 2, r"2\*\*31|int32"),
        (np.array([1, 2, -3, 4, 5]), 1, 2, "token id -3 at position 2 is negative"),
        (np.array([1, 2, 3, 4, 5], dtype=np.uint64) + np.uint64(2**32), 1, 2, "does not fit in int32"),
        (np.arange(100), np.int32(2**16), np.int32(2**16), r"B\*T = 4294967296 tokens per batch do not fit"),
    ],
)
def test_batches_refuse_ids_and_sizes_beyond_int32(tokens, B, T, words):
    with pytest.raises(ValueError, match=words):
        data.Batches(tokens, B, T)


def test_incremental_decoder_refuses_ids_outside_the_vocabulary(shakespeare_tokenizer):
    decoder = shakespeare_tokenizer.decoder()
    decoder.feed(shakespeare_tokenizer.encode("a")[0])
    with pytest.raises(ValueError, match="-1 is outside this vocabulary"):
        decoder.feed(-1)  # Python's indexing would have returned the last token's text
    with pytest.raises(ValueError, match="1024 is outside this vocabulary"):
        decoder.feed(shakespeare_tokenizer.vocab_size)
    with pytest.raises(TypeError, match="float"):
        decoder.feed(3.0)


def test_decode_refuses_ids_that_are_not_integers(shakespeare_tokenizer):
    with pytest.raises(TypeError, match=r"integers, not float \(65.5\)"):
        shakespeare_tokenizer.decode([65, 65.5])
    with pytest.raises(TypeError, match="str"):
        shakespeare_tokenizer.decode(["65"])
    assert shakespeare_tokenizer.decode(np.array([65, 66], dtype=np.int32)) == shakespeare_tokenizer.decode([65, 66])


def test_a_corpus_not_found_names_every_place_looked_and_how_to_point_at_one(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "DATA_DIR", tmp_path / "no-checkout")
    monkeypatch.setenv(data.DATA_DIR_VARIABLE, str(tmp_path / "from-the-environment"))
    with pytest.raises(FileNotFoundError) as error:
        data.prepare("tinyshakespeare", data_dir=tmp_path / "given", progress=False)
    message = str(error.value)
    for folder in ("given", "from-the-environment", "no-checkout"):
        assert str(tmp_path / folder / "tinyshakespeare.txt") in message
    assert "--data-dir" in message and data.DATA_DIR_VARIABLE in message


def test_corpora_are_found_in_order_given_folder_environment_checkout(tmp_path, monkeypatch):
    given, environment = small_data_dir(tmp_path / "given"), small_data_dir(tmp_path / "environment")
    monkeypatch.setattr(data, "DATA_DIR", tmp_path / "no-checkout")
    monkeypatch.setenv(data.DATA_DIR_VARIABLE, str(environment))
    assert data.find_corpus("tinyshakespeare", given)[0] == given
    assert data.find_corpus("tinyshakespeare")[0] == environment
    (environment / "tinyshakespeare.txt").unlink()  # not there: the next place is looked in
    monkeypatch.setattr(data, "DATA_DIR", given)
    assert data.find_corpus("tinyshakespeare")[0] == given


def test_a_corpus_folder_that_cannot_be_written_to_prepares_into_the_cache(tmp_path, monkeypatch):
    folder = small_data_dir(tmp_path / "read-only")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    writable = os.access
    monkeypatch.setattr(data.os, "access", lambda path, mode: False if Path(path) == folder else writable(path, mode))
    outputs = data.prepare("tinyshakespeare", 512, data_dir=folder, progress=False)
    assert (tmp_path / "cache" / "gpt2_cupy" / "data") in outputs.train.parents
    assert sorted(p.name for p in folder.iterdir()) == ["aozora", "tinyshakespeare.txt"]  # nothing written beside it
    assert data.read_tokens(outputs.train).size > 1000


@pytest.mark.parametrize("content, problem", [(b"", "empty"), (b"caf\xe9 au lait\n\n" * 100, "not valid UTF-8")])
def test_prepare_refuses_an_empty_or_non_utf8_corpus_file_by_name(tmp_path, content, problem):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "tinyshakespeare.txt").write_bytes(content)
    with pytest.raises(ValueError, match=problem) as error:
        data.prepare("tinyshakespeare", 512, data_dir=folder, progress=False)
    assert str(folder / "tinyshakespeare.txt") in str(error.value)
