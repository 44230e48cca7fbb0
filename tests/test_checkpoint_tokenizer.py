"""gpt2_cupy.checkpoint_tokenizer: a checkpoint's tokenizer.json or tokenizer.model behind one interface.

The references are the libraries themselves (sentencepiece's and tokenizers' own decode), Python's UTF-8
codec, and GPT-2's byte alphabet as the tokenizers library lists it.
"""

import json

import pytest
from tokenizers import pre_tokenizers

from gpt2_cupy import data
from gpt2_cupy.checkpoint_tokenizer import BYTE_OF_CHARACTER, HuggingFaceTokenizer, load_tokenizer
from tiny_tokenizers import JAPANESE, UNSEEN, write_byte_level_bpe, write_sentencepiece

TEXTS = ["吾輩は猫である。", UNSEEN, "猫 と cat\n" + JAPANESE[2], ""]


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpt2-style")
    write_byte_level_bpe(directory)
    return load_tokenizer(directory)


@pytest.fixture(scope="module")
def sentencepiece_tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama2-style")
    write_sentencepiece(directory)
    return load_tokenizer(directory)


def split_characters(tokenizer, text):
    """How many token boundaries of text's encoding fall inside a character."""
    ends, split = 0, 0
    for token in tokenizer.encode(text)[:-1]:
        ends += len(tokenizer.token_bytes[token])
        split += not is_character_boundary(text.encode(), ends)
    return split


def is_character_boundary(encoded, offset):
    return offset == len(encoded) or not 0x80 <= encoded[offset] <= 0xBF


def test_the_directory_decides_the_library(tmp_path):
    write_sentencepiece(tmp_path)
    assert isinstance(load_tokenizer(tmp_path), data.Tokenizer)
    write_byte_level_bpe(tmp_path)  # both: tokenizer.json, as transformers prefers it
    assert isinstance(load_tokenizer(tmp_path), HuggingFaceTokenizer)


def test_a_directory_without_a_tokenizer_is_refused_naming_both_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json .*tokenizer.model"):
        load_tokenizer(tmp_path)


def test_the_byte_alphabet_is_gpt2s():
    assert sorted(BYTE_OF_CHARACTER) == sorted(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(BYTE_OF_CHARACTER.values()) == list(range(256))
    assert BYTE_OF_CHARACTER["Ġ"] == ord(" ") and BYTE_OF_CHARACTER["Ċ"] == ord("\n")  # GPT-2's space and newline
    assert BYTE_OF_CHARACTER["a"] == ord("a") and BYTE_OF_CHARACTER["é"] == 0xE9


@pytest.mark.parametrize("name", ["byte_level", "sentencepiece_tokenizer"])
def test_text_comes_back_and_the_token_bytes_spell_it(name, request):
    tokenizer = request.getfixturevalue(name)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        spelled = b"".join(tokenizer.token_bytes[token] for token in ids).decode("utf-8")
        # Llama 2's dummy prefix: a space that decode drops and the stream keeps (it continues a prompt).
        assert spelled == (" " + text if name == "sentencepiece_tokenizer" and text else text)
    # A token that is whole characters reads as the library's decode of it, after a character that keeps
    # sentencepiece from taking a leading space for its dummy prefix.
    anchor = tokenizer.encode("猫である。")[-1]
    assert tokenizer.decode([anchor]) == "。"
    for token in range(tokenizer.vocab_size):
        try:
            own_text = tokenizer.token_bytes[token].decode("utf-8")
        except UnicodeDecodeError:
            continue
        library = tokenizer.library if name == "byte_level" else tokenizer.processor
        assert own_text == library.decode([anchor, token])[1:], token


@pytest.mark.parametrize("name", ["byte_level", "sentencepiece_tokenizer"])
def test_the_stream_never_prints_a_broken_character(name, request):
    tokenizer = request.getfixturevalue(name)
    text = "".join(JAPANESE) + UNSEEN
    assert split_characters(tokenizer, text) >= 4  # the tiny vocabularies do split characters
    decoder = tokenizer.decoder()
    pieces = [decoder.feed(token) for token in tokenizer.encode(text)] + [decoder.finish()]
    assert "".join(pieces).removeprefix(" ") == text
    assert not any("\ufffd" in piece for piece in pieces)


def test_byte_tokens_stand_for_their_byte(byte_level, sentencepiece_tokenizer):
    # Byte-level BPE: the 256 one-character tokens of GPT-2's alphabet.
    vocabulary = byte_level.library.get_vocab()
    for character, byte in BYTE_OF_CHARACTER.items():
        assert byte_level.byte_of(vocabulary[character]) == byte
    assert sum(byte_level.byte_of(token) is not None for token in range(byte_level.vocab_size)) == 256
    assert byte_level.byte_of(byte_level.encode("吾輩は")[0]) is None  # a merge of several bytes
    # sentencepiece: the <0xE6> pieces of byte fallback.
    for byte in (0x00, 0x41, 0xE6, 0xFF):
        assert sentencepiece_tokenizer.byte_of(sentencepiece_tokenizer.byte_token(byte)) == byte
    assert sentencepiece_tokenizer.byte_of(sentencepiece_tokenizer.encode("猫")[-1]) is None
    with pytest.raises(ValueError, match="outside this vocabulary"):
        byte_level.byte_of(byte_level.vocab_size)


def test_prompts_start_from_the_models_special_tokens(tmp_path, byte_level, sentencepiece_tokenizer):
    # Llama 2: <s> (id 1) in front of every prompt, </s> (id 2) ends the text.
    assert sentencepiece_tokenizer.begin_of_text == 1 and sentencepiece_tokenizer.end_of_text == 2
    assert sentencepiece_tokenizer.prompt_ids("猫") == [1] + sentencepiece_tokenizer.processor.encode("猫")
    assert sentencepiece_tokenizer.prompt_ids("") == [1]
    # GPT-2: no token in front; an empty prompt starts from <|endoftext|>.
    assert byte_level.prompt_ids("猫") == byte_level.encode("猫")
    assert byte_level.prompt_ids("") == [byte_level.library.token_to_id("<|endoftext|>")] == [0]
    # config.json's eos_token_id names the end-of-text token where there is one (Llama 3 lists several).
    write_byte_level_bpe(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    assert load_tokenizer(tmp_path).end_of_text == 7


def test_the_course_tokenizers_read_as_before():
    tokenizer = data.Tokenizer(data.prepare("tinyshakespeare", progress=False).tokenizer)
    assert tokenizer.begin_of_text is None and not tokenizer.adds_dummy_prefix
    assert tokenizer.end_of_text == tokenizer.processor.piece_to_id(data.END_OF_TEXT)
    assert tokenizer.prompt_ids("") == [tokenizer.end_of_text]
    assert tokenizer.prompt_ids(" ROMEO:") == tokenizer.encode(" ROMEO:")
    assert tokenizer.decode(tokenizer.encode(" ROMEO:\n")) == " ROMEO:\n"
