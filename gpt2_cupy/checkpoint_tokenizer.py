"""The tokenizer that comes with a checkpoint, read from the checkpoint's own directory.

    tokenizer = load_tokenizer("path/to/hf-llama")    # tokenizer.json, else tokenizer.model
    ids = tokenizer.prompt_ids("吾輩は")               # what generation starts from (<s> first for Llama)
    tokenizer.encode(text), tokenizer.decode(ids)      # text to ids and back, no special tokens added
    decoder = tokenizer.decoder()                      # one token at a time, never half a character
    tokenizer.token_bytes[token], tokenizer.byte_of(token)

Two file formats, one interface:
- tokenizer.model, a sentencepiece model (Llama 2's, and the course's own): data.Tokenizer;
- tokenizer.json, Hugging Face's `tokenizers` library (GPT-2's byte-level BPE, Llama 3's): HuggingFaceTokenizer.

Both give token_bytes, the bytes each token stands for, so that data.IncrementalDecoder streams both alike and
the sampler can tell which tokens would break the UTF-8 of the text (gpt2_cupy.sample.Utf8Mask).
"""

import json
from pathlib import Path

import tokenizers

from gpt2_cupy import data

SENTENCEPIECE_FILE = "tokenizer.model"
HUGGING_FACE_FILE = "tokenizer.json"


def load_tokenizer(directory):
    """The tokenizer of a checkpoint directory: tokenizer.json (what transformers loads first), else
    tokenizer.model. FileNotFoundError, naming both, when it has neither."""
    directory = Path(directory)
    if (directory / HUGGING_FACE_FILE).exists():
        return HuggingFaceTokenizer(directory / HUGGING_FACE_FILE, end_of_text=_end_of_text_id(directory))
    if (directory / SENTENCEPIECE_FILE).exists():
        return data.Tokenizer(directory / SENTENCEPIECE_FILE)
    raise FileNotFoundError(f"{directory} holds no tokenizer: looked for {HUGGING_FACE_FILE} (Hugging Face's "
                            f"tokenizers) and {SENTENCEPIECE_FILE} (sentencepiece)")


def _end_of_text_id(directory):
    """The end-of-text token's id as the checkpoint's config.json gives it (eos_token_id), or None."""
    config = directory / "config.json"
    if not config.exists():
        return None
    eos = json.loads(config.read_text()).get("eos_token_id")
    return eos[0] if isinstance(eos, list) else eos  # Llama 3 lists several end tokens: the first is end of text


class HuggingFaceTokenizer:
    """A tokenizer.json, run by Hugging Face's `tokenizers` library.

    The library encodes and decodes; what it does not give is the bytes of one token (decoding one token of
    a split character gives "�"), which streaming needs. Those are read from the vocabulary here, by the
    rule of the tokenizer's decoder: byte-level (GPT-2, Llama 3) or sentencepiece-style (Llama 2's json).
    """

    def __init__(self, tokenizer_file, end_of_text=None):
        self.tokenizer_file = Path(tokenizer_file)
        self.library = tokenizers.Tokenizer.from_file(str(self.tokenizer_file))
        self.vocab_size = self.library.get_vocab_size(with_added_tokens=True)
        spec = json.loads(self.tokenizer_file.read_text(encoding="utf-8"))
        byte_level = _uses_byte_level(spec.get("decoder"))
        byte_fallback = bool(spec.get("model", {}).get("byte_fallback"))
        added = self.library.get_added_tokens_decoder()  # {id: AddedToken}: special and user-added tokens
        self.token_bytes, self.byte_values = [], {}
        for token in range(self.vocab_size):
            piece = self.library.id_to_token(token)
            if piece is None:
                self.token_bytes.append(b"")  # an id the vocabulary leaves unused
            elif token in added:
                # Special tokens (<|endoftext|>, <s>) print nothing, as decode(skip_special_tokens=True).
                self.token_bytes.append(b"" if added[token].special else piece.encode("utf-8"))
            elif byte_level:
                self.token_bytes.append(bytes(BYTE_OF_CHARACTER[character] for character in piece))
                if len(piece) == 1:
                    self.byte_values[token] = BYTE_OF_CHARACTER[piece]
            elif byte_fallback and _is_byte_piece(piece):
                self.byte_values[token] = int(piece[3:5], 16)
                self.token_bytes.append(bytes([self.byte_values[token]]))
            else:
                self.token_bytes.append(piece.replace(data.WHITESPACE_MARK, " ").encode("utf-8"))
        self.end_of_text = end_of_text
        if self.end_of_text is None:
            self.end_of_text = self.library.token_to_id(data.END_OF_TEXT)  # GPT-2's name; None if absent

    def encode(self, text):
        """The token ids of text, a list of ints, without special tokens."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, not {type(text).__name__}")
        return self.library.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        """The text of token ids, special tokens left out; bytes that are not UTF-8 become "�"."""
        return self.library.decode([data.check_id(token, self.vocab_size) for token in ids])

    def decoder(self):
        """A fresh data.IncrementalDecoder, for text that arrives one token at a time."""
        return data.IncrementalDecoder(self.token_bytes)

    def prompt_ids(self, text):
        """The ids generation starts from: the text's ids with the special tokens the tokenizer's own
        post-processor adds (Llama 3's <|begin_of_text|>), or the end-of-text token alone for an empty prompt."""
        ids = self.library.encode(text, add_special_tokens=True).ids
        if not ids and self.end_of_text is None:
            raise ValueError(f"{self.tokenizer_file}: an empty prompt needs an end-of-text token to start from, "
                             "and neither config.json's eos_token_id nor an <|endoftext|> token gives one")
        return ids or [self.end_of_text]

    def byte_of(self, token):
        """The byte a byte token stands for (0 to 255), None for any other token."""
        return self.byte_values.get(data.check_id(token, self.vocab_size))


def _uses_byte_level(decoder):
    """Whether a tokenizer.json decoder spec ({"type": ...}, or a Sequence of them) maps characters to bytes."""
    if decoder is None:
        return False
    if decoder["type"] == "Sequence":
        return any(_uses_byte_level(part) for part in decoder["decoders"])
    return decoder["type"] == "ByteLevel"


def _is_byte_piece(piece):
    return len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")


def _byte_level_alphabet():
    """GPT-2's map from each byte to the character that stands for it in a byte-level vocabulary.

    Byte-level BPE works on bytes but stores its vocabulary as text, so each of the 256 bytes is given a
    printable character: the printable Latin-1 bytes stand for themselves ("a" is "a", "é" is 0xE9), and the
    other 68 (control bytes, the space, 0x7F to 0xA0, 0xAD) take the characters from U+0100 on, in order, so
    a space is "Ġ" (U+0120) and a newline "Ċ" (U+010A).
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    character_of_byte = {byte: chr(byte) for byte in printable}
    others = [byte for byte in range(256) if byte not in character_of_byte]
    character_of_byte.update({byte: chr(256 + index) for index, byte in enumerate(others)})
    return {character: byte for byte, character in character_of_byte.items()}


BYTE_OF_CHARACTER = _byte_level_alphabet()
