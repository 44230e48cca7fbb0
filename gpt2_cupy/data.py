"""From text files to the token windows a GPT trains on.

    prepare("tinyshakespeare")     trains a tokenizer on the training part of data/tinyshakespeare.txt and writes
                                   data/tinyshakespeare/{tokenizer.model, train.bin, val.bin}
    Tokenizer(model_file)          encode(text) -> ids, decode(ids) -> text, and decoder() for one token at a time
    write_tokens / read_tokens     token files in llm.c's format: a 256 x int32 header, then uint16 token ids
    Batches(tokens, B, T, seed)    (B, T) windows of input ids and, one position further on, their targets

The tokenizer is sentencepiece's byte-pair encoding, set up so that text comes back exactly as it went in:
every newline, every full-width "？", every character it never saw in training.
"""

import codecs
import hashlib
import io
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy
import sentencepiece
from tqdm import tqdm

from gpt2_cupy import backend   # (importing gpt2_cupy picks the backend anyway)
from gpt2_cupy.checkout import REPOSITORY
from gpt2_cupy.dtypes import LARGEST_INT

# The repository's data/ folder, when the package runs from a checkout (or an editable install of one);
# None for an installed wheel, which carries no corpora.
DATA_DIR = REPOSITORY / "data" if REPOSITORY is not None else None
DATA_DIR_VARIABLE = "GPT2_CUPY_DATA"  # a folder of corpora laid out as data/ is

# ---------------------------------------------------------------------------------------------------------
# The corpora
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Corpus:
    documents: str  # glob pattern under data/, one document per file
    paragraph_boundary: str  # where a document may be cut without splitting a paragraph
    vocab_size: int  # the vocabulary size prepare() uses unless told otherwise


CORPORA = {
    # One file of plays; speeches are separated by a blank line. 2048 tokens give 2.5 characters per token
    # on the validation text, and in 1 MB of text each token is seen often enough to be learned.
    "tinyshakespeare": Corpus("tinyshakespeare.txt", "\n\n", 2048),
    # 19 works, one line per paragraph. Japanese spends about 3,200 vocabulary entries on single characters
    # (see character_coverage below) before any merge; 8192 tokens give 1.8 characters per token.
    "aozora": Corpus("aozora/*.txt", "\n", 8192),
}

VALIDATION_FRACTION = 0.1  # the last ~10 % of each document is held out for validation

END_OF_TEXT = "<|endoftext|>"  # GPT-2's name for the token that separates unrelated texts

# ---------------------------------------------------------------------------------------------------------
# Training a tokenizer
# ---------------------------------------------------------------------------------------------------------

# sentencepiece's defaults are made for machine translation and rewrite the text: NFKC normalization turns a
# full-width "？" into "?", runs of spaces are collapsed, newlines become spaces, and a space is added in front
# of the text. A GPT trained on that could never write a newline or a "？". These options keep text exact.
SENTENCEPIECE_OPTIONS = dict(
    model_type="bpe",
    normalization_rule_name="identity",  # no NFKC: the bytes in are the bytes out
    remove_extra_whitespaces=False,  # keep leading, trailing and repeated spaces
    add_dummy_prefix=False,  # do not invent a space before the first word
    byte_fallback=True,  # a character not in the vocabulary is spelled as its UTF-8 bytes, never <unk>
    # The trainer reads its input line by line, so it never sees a newline inside a sentence. Declaring "\n"
    # a user-defined symbol makes it a token of its own, which the encoder emits for every newline.
    user_defined_symbols=["\n"],
    split_digits=True,  # 1987 becomes 1 9 8 7: no vocabulary entries spent on particular numbers
    # Characters covering 99.95 % of the text get a vocabulary entry; the rarest (hundreds of kanji seen once
    # or twice) are left to byte fallback rather than crowding out useful pieces.
    character_coverage=0.9995,
    # Deterministic training: use every sentence in file order, on one thread. (The number of threads is
    # recorded in the model file, so even the bytes differ between thread counts.)
    input_sentence_size=0,
    shuffle_input_sentence=False,
    num_threads=1,
    # An Aozora paragraph is one line of up to ~85 kB; longer lines than this limit would be dropped silently.
    max_sentence_length=1 << 20,
    # Special tokens: <unk> must exist (id 0, never produced thanks to byte fallback), one end-of-text token
    # separates documents in the token files, and there is no beginning-of-sentence or padding token.
    unk_id=0,
    eos_id=1,
    eos_piece=END_OF_TEXT,
    bos_id=-1,
    pad_id=-1,
    minloglevel=2,  # errors only; sentencepiece otherwise logs every step of training
)

MAX_VOCAB_SIZE = 1 << 16  # token files store uint16 ids


def train_tokenizer(text_files, vocab_size, model_prefix):
    """Train a byte-pair-encoding tokenizer on text_files; write and return the path <model_prefix>.model.

    The same files and vocab_size always give the same model file, byte for byte.
    """
    if isinstance(text_files, (str, os.PathLike)):
        text_files = [text_files]
    text_files = [Path(path) for path in text_files]
    if not isinstance(vocab_size, (int, numpy.integer)) or isinstance(vocab_size, bool):
        raise TypeError(f"vocab_size must be an int, not {type(vocab_size).__name__}")
    if not 0 < vocab_size <= MAX_VOCAB_SIZE:
        raise ValueError(f"vocab_size={vocab_size}: must be 1 to {MAX_VOCAB_SIZE}, as token files hold uint16 ids")

    texts = [read_corpus_file(path) for path in text_files]  # refuse bad input before training starts
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        # Lines are handed over by an iterator rather than as file names because the trainer records its
        # input file names in the model: the same text in another folder would give different model bytes.
        sentence_iterator=(line for text in texts for line in text.split("\n")),
        model_writer=model,
        vocab_size=int(vocab_size),
        **SENTENCEPIECE_OPTIONS,
    )
    model_file = Path(f"{model_prefix}.model")
    write_atomically(model_file, model.getvalue())
    return model_file


def read_corpus_file(path):
    """The text of one training file, refused with the file's name and the problem if it cannot be trained on:
    an empty file, bytes that are not UTF-8, or a line longer than the trainer takes (it would drop it)."""
    raw = Path(path).read_bytes()
    if not raw.strip():
        raise ValueError(f"{path}: the file is empty (or only whitespace): no text to train a tokenizer on")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not valid UTF-8 at byte offset {error.start} "
                         f"(byte {raw[error.start]:#04x}: {error.reason})") from None
    limit = SENTENCEPIECE_OPTIONS["max_sentence_length"]
    offset = 0
    for number, line in enumerate(raw.split(b"\n"), start=1):
        if len(line) > limit:
            raise ValueError(f"{path}: line {number} (at byte offset {offset}) is {len(line)} bytes long; the "
                             f"tokenizer trainer takes lines of at most {limit} bytes and would drop it: "
                             "split it at sentence or paragraph boundaries")
        offset += len(line) + 1
    return text


def write_atomically(path, data):
    """Write bytes to path through a temporary file, so an interrupted write never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    os.replace(partial, path)


# ---------------------------------------------------------------------------------------------------------
# Encoding and decoding
# ---------------------------------------------------------------------------------------------------------

# sentencepiece writes a space inside a piece as "▁" (U+2581, LOWER ONE EIGHTH BLOCK), and decoding turns
# every "▁" of a piece back into a space.
WHITESPACE_MARK = "\u2581"


class Tokenizer:
    """A trained sentencepiece model: text to token ids and back, exactly."""

    def __init__(self, model_file):
        self.model_file = Path(model_file)
        self.processor = sentencepiece.SentencePieceProcessor(model_file=str(self.model_file))
        self.vocab_size = self.processor.vocab_size()
        # The course's tokenizers declare <|endoftext|> their end-of-sentence token; Llama 2's has </s> for it,
        # and <s>, which starts every prompt (the course's have none: begin_of_text None).
        eos, bos = self.processor.eos_id(), self.processor.bos_id()
        self.end_of_text = eos if eos >= 0 else self.processor.piece_to_id(END_OF_TEXT)
        self.begin_of_text = bos if bos >= 0 else None
        # Llama 2's model adds a "dummy prefix": "Hello" is encoded as "▁Hello", a space that was never there.
        self.adds_dummy_prefix = self.processor.encode("a", out_type=str)[0].startswith(WHITESPACE_MARK)
        # What each token stands for, as bytes: decoding is joining these and reading them as UTF-8.
        self.token_bytes = [bytes_of_token(self.processor, token) for token in range(self.vocab_size)]
        # Characters that sentencepiece would not give back, and that encode() therefore spells as byte tokens:
        # "▁", which it cannot tell from its own mark for a space, so that it would come back as a space; and,
        # when the vocabulary has no "▁" piece, the space itself, which would fall back to the bytes of "▁"
        # and come back as "▁". (The Aozora texts contain no space, so their tokenizer has no "▁" piece.)
        has_space_piece = self.processor.piece_to_id(WHITESPACE_MARK) != self.processor.unk_id()
        self.spelled_in_bytes = WHITESPACE_MARK if has_space_piece else WHITESPACE_MARK + " "
        self.spelled_in_bytes_pattern = re.compile(f"([{self.spelled_in_bytes}])")

    def encode(self, text):
        """The token ids of text, a list of ints."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, not {type(text).__name__}")
        ids = []
        # Splitting at the characters to spell in bytes (see __init__) puts each of them at an odd index.
        for index, part in enumerate(self.spelled_in_bytes_pattern.split(text)):
            if index % 2 == 1:
                ids += [self.byte_token(byte) for byte in part.encode("utf-8")]
            elif part:
                ids += self.processor.encode(part)
        return ids

    def decode(self, ids):
        """The text of token ids. Bytes that do not form valid UTF-8 become "�" (U+FFFD)."""
        text = b"".join(self.token_bytes[token] for token in self.check_ids(ids)).decode("utf-8", errors="replace")
        # The dummy prefix's space goes, as sentencepiece's own decode drops it.
        return text[1:] if self.adds_dummy_prefix and text.startswith(" ") else text

    def prompt_ids(self, text):
        """The ids generation starts from: <s> where the model has one, then the text's; for an empty prompt
        without <s>, the end-of-text token alone."""
        ids = ([self.begin_of_text] if self.begin_of_text is not None else []) + self.encode(text)
        return ids or [self.end_of_text]

    def decoder(self):
        """A fresh IncrementalDecoder, for text that arrives one token at a time (a sampler's output)."""
        return IncrementalDecoder(self.token_bytes)

    def pieces(self, ids):
        """The vocabulary entry of each id, as sentencepiece writes it ("▁" for a space, "<0xE3>" for a byte)."""
        return [self.processor.id_to_piece(token) for token in self.check_ids(ids)]

    def byte_of(self, token):
        """The byte a byte-fallback token stands for (0 to 255), None for any other token."""
        return self.token_bytes[token][0] if self.processor.is_byte(check_id(token, self.vocab_size)) else None

    def byte_token(self, byte):
        """The id of the byte-fallback token for one byte value, 0 to 255."""
        return self.processor.piece_to_id(f"<0x{byte:02X}>")

    def check_ids(self, ids):
        """ids as a list of Python ints, each a valid token id."""
        return [check_id(token, self.vocab_size) for token in ids]


def check_id(token, vocab_size):
    """token as a Python int, refused unless it is an integer id in 0 to vocab_size - 1."""
    if isinstance(token, bool) or not isinstance(token, (int, numpy.integer)):
        raise TypeError(f"token ids must be integers, not {type(token).__name__} ({token!r})")
    if not 0 <= token < vocab_size:
        raise ValueError(f"token id {token} is outside this vocabulary (0 to {vocab_size - 1})")
    return int(token)


def bytes_of_token(processor, token):
    """The bytes a token stands for: one raw byte for a byte-fallback token, else its text in UTF-8."""
    if processor.is_byte(token):  # the piece is written "<0xE3>"
        return bytes([int(processor.id_to_piece(token)[3:5], 16)])
    if processor.is_control(token):  # <s>, </s>, the end-of-text token: no text
        return b""
    if processor.is_unknown(token):
        return processor.decode([token]).encode("utf-8")  # sentencepiece writes <unk> as " ⁇ "
    # The piece itself with each "▁" a space. (processor.decode([token]) would drop the leading space of a
    # piece when the model adds a dummy prefix, as Llama 2's does: "▁the" alone decodes as "the".)
    return processor.id_to_piece(token).replace(WHITESPACE_MARK, " ").encode("utf-8")


class IncrementalDecoder:
    """Decodes token ids one at a time without ever cutting a character in half.

    A character outside the vocabulary arrives as several byte tokens: "檎", for the Aozora tokenizer, as
    <0xE6> <0xAA> <0x8E>.
    Decoding each token on its own would print three "�". This decoder keeps the bytes of an unfinished
    character and emits the character when its last byte arrives.
    """

    def __init__(self, token_bytes):
        self.token_bytes = token_bytes
        # Python's UTF-8 decoder already knows how to wait for the rest of a character: its incremental
        # form returns only complete characters and keeps the trailing incomplete bytes for the next call.
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token):
        """The text completed by one more token: possibly "", possibly several characters."""
        # check_id refuses -1, which Python's indexing would read as the last token.
        return self.utf8.decode(self.token_bytes[check_id(token, len(self.token_bytes))])

    def pending_bytes(self):
        """The bytes held back: the start of a character whose remaining bytes have not arrived yet."""
        return self.utf8.getstate()[0]

    def finish(self):
        """Whatever is still held back, at the end of the stream (an unfinished character becomes "�")."""
        return self.utf8.decode(b"", final=True)


# ---------------------------------------------------------------------------------------------------------
# Token files, in llm.c's format
# ---------------------------------------------------------------------------------------------------------

# A header of 256 little-endian int32: magic number, version, token count, then zeros. Then the tokens.
TOKEN_FILE_MAGIC = 20240520
TOKEN_FILE_VERSION = 1  # version 1 stores uint16 ids (GPT-2's 50,257 fit); llm.c's version 2 is uint32
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
HEADER_DTYPE = numpy.dtype("<i4")
TOKEN_DTYPE = numpy.dtype("<u2")


def write_tokens(path, ids):
    """Write token ids (a sequence or 1-D numpy array of ints, each 0 to 65535) as an llm.c token file."""
    ids = numpy.asarray(ids)
    if ids.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, not of shape {ids.shape}")
    if ids.size == 0:
        ids = ids.astype(numpy.int64)  # numpy reads [] as float64; an empty file is still a valid file
    if not numpy.issubdtype(ids.dtype, numpy.integer):
        raise TypeError(f"token ids must be integers, not {ids.dtype}")
    if ids.size and ids.min() < 0:
        at = int(numpy.argmin(ids))
        raise ValueError(f"token id {ids[at]} at position {at} is negative")
    if ids.size and ids.max() > numpy.iinfo(TOKEN_DTYPE).max:
        at = int(numpy.argmax(ids))
        raise ValueError(f"token id {ids[at]} at position {at} does not fit in a uint16 token file (ids < 65536)")
    if ids.size > numpy.iinfo(HEADER_DTYPE).max:
        raise ValueError(f"{ids.size} tokens are more than an int32 header can count")

    header = numpy.zeros(HEADER_INTS, dtype=HEADER_DTYPE)
    header[0] = TOKEN_FILE_MAGIC
    header[1] = TOKEN_FILE_VERSION
    header[2] = ids.size
    write_atomically(path, header.tobytes() + ids.astype(TOKEN_DTYPE).tobytes())


def read_tokens(path):
    """The token ids of an llm.c token file, memory-mapped (read from disk as they are used) as uint16.

    Raises ValueError, naming the file, if it is not a complete version-1 token file.
    """
    path = Path(path)
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise ValueError(f"{path}: truncated: {size} bytes, less than the {HEADER_BYTES}-byte header")
    # Python ints, so that the size arithmetic below cannot overflow int32.
    magic, version, count = (int(value) for value in numpy.fromfile(path, dtype=HEADER_DTYPE, count=3))
    if magic != TOKEN_FILE_MAGIC:
        raise ValueError(f"{path}: not a token file: magic number {magic}, expected {TOKEN_FILE_MAGIC}")
    if version != TOKEN_FILE_VERSION:
        raise ValueError(
            f"{path}: token file version {version} is not supported; version {TOKEN_FILE_VERSION} stores uint16 ids"
        )
    if count < 0:
        raise ValueError(f"{path}: the header gives a negative token count, {count}")
    expected_size = HEADER_BYTES + count * TOKEN_DTYPE.itemsize
    promised = f"the header promises {count} tokens ({expected_size} bytes), the file has {size} bytes"
    if size < expected_size:
        raise ValueError(f"{path}: truncated: {promised}")
    if size > expected_size:
        raise ValueError(f"{path}: too long: {promised}")
    if count == 0:
        return numpy.zeros(0, dtype=TOKEN_DTYPE)  # a memory map cannot map zero bytes
    return numpy.memmap(path, dtype=TOKEN_DTYPE, mode="r", offset=HEADER_BYTES, shape=(count,))


# ---------------------------------------------------------------------------------------------------------
# Preparing a corpus
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PreparedCorpus:
    tokenizer: Path  # tokenizer.model
    train: Path  # train.bin: the first ~90 % of each document
    val: Path  # val.bin: the last ~10 % of each document


def corpus_folders(data_dir=None):
    """Where to look for corpora, in order: data_dir (--data-dir), then $GPT2_CUPY_DATA, then the checkout's data/."""
    candidates = [data_dir, os.environ.get(DATA_DIR_VARIABLE) or None, DATA_DIR]
    return [Path(folder) for folder in candidates if folder is not None]


def find_corpus(corpus, data_dir=None):
    """(the folder that holds `corpus`, its documents): the first of corpus_folders() that has them."""
    pattern = CORPORA[corpus].documents
    for folder in corpus_folders(data_dir):
        documents = sorted(folder.glob(pattern))
        if documents:
            return folder, documents
    looked = "\n".join(f"  {folder / pattern}" for folder in corpus_folders(data_dir))
    raise FileNotFoundError(
        f"corpus {corpus!r} not found; looked for\n{looked}\nPoint at a folder that holds it with --data-dir DIR "
        f"(data_dir= in Python) or {DATA_DIR_VARIABLE}=DIR: the repository's data/ folder has every corpus.")


def prepared_folder(corpus, folder):
    """Where prepare() writes a corpus's tokenizer and token files: beside its text when that folder can be
    written to (the checkout's data/), else in the user's cache, one folder per corpus folder."""
    if os.access(folder, os.W_OK):
        return folder / corpus
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpt2_cupy" / "data"
    digest = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:12]
    return cache / f"{corpus}-{digest}"


def prepare(corpus, vocab_size=None, data_dir=None, progress=True, force=False):
    """Turn a corpus's text into {tokenizer.model, train.bin, val.bin} and return their paths.

    corpus is "tinyshakespeare" or "aozora", found by find_corpus() (data_dir, $GPT2_CUPY_DATA, the
    checkout's data/); the files go to prepared_folder(): data/<corpus>/ in a checkout. vocab_size defaults
    to CORPORA[corpus].vocab_size. The tokenizer is trained on the training parts only, so validation text
    is as new to it as to the model. In both token files, each document's part starts with the end-of-text
    token. Nothing is redone when the outputs are newer than every input and the tokenizer has the
    vocabulary size asked for (force=True redoes it anyway).
    """
    if corpus not in CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}; the corpora are {', '.join(CORPORA)}")
    spec = CORPORA[corpus]
    vocab_size = spec.vocab_size if vocab_size is None else vocab_size
    folder, documents = find_corpus(corpus, data_dir)
    written = prepared_folder(corpus, folder)
    outputs = PreparedCorpus(
        tokenizer=written / "tokenizer.model",
        train=written / "train.bin",
        val=written / "val.bin",
    )
    if not force and is_up_to_date(outputs, documents, vocab_size):
        return outputs

    steps = tqdm(total=len(documents) + 1, desc=f"{corpus}: train tokenizer", disable=not progress)
    parts = [split_train_val(read_corpus_file(path), spec.paragraph_boundary) for path in documents]
    with tempfile.TemporaryDirectory() as scratch:
        train_files = [Path(scratch) / f"{index:03d}.txt" for index in range(len(parts))]
        for file, (train_text, _) in zip(train_files, parts):
            file.write_text(train_text, encoding="utf-8")
        train_tokenizer(train_files, vocab_size, outputs.tokenizer.with_suffix(""))
    steps.update()

    tokenizer = Tokenizer(outputs.tokenizer)
    train_ids, val_ids = [], []
    steps.set_description(f"{corpus}: encode")
    for train_text, val_text in parts:
        train_ids += [tokenizer.end_of_text] + tokenizer.encode(train_text)
        val_ids += [tokenizer.end_of_text] + tokenizer.encode(val_text)
        steps.update()
    write_tokens(outputs.train, train_ids)
    write_tokens(outputs.val, val_ids)
    steps.close()
    return outputs


def split_train_val(text, paragraph_boundary):
    """(training part, validation part) of a document: the last ~10 %, cut just after a paragraph boundary."""
    cut = text.find(paragraph_boundary, int(len(text) * (1 - VALIDATION_FRACTION)))
    if cut < 0:  # no boundary in the last 10 %: take the last one before it
        cut = text.rfind(paragraph_boundary)
    if cut < 0:
        raise ValueError(f"the text has no {paragraph_boundary!r} to split it at")
    cut += len(paragraph_boundary)
    return text[:cut], text[cut:]


def is_up_to_date(outputs, inputs, vocab_size):
    """Whether every output exists, none is older than any input, and the tokenizer has vocab_size tokens."""
    outputs = [outputs.tokenizer, outputs.train, outputs.val]
    if not all(path.exists() for path in outputs):
        return False
    if max(path.stat().st_mtime_ns for path in inputs) > min(path.stat().st_mtime_ns for path in outputs):
        return False
    return Tokenizer(outputs[0]).vocab_size == vocab_size


# ---------------------------------------------------------------------------------------------------------
# Batches for training and evaluation
# ---------------------------------------------------------------------------------------------------------


# Batches hold int32 ids, as the embedding kernels read them: at most LARGEST_INT of them (gpt2_cupy.dtypes).


class Batches:
    """(B, T) windows of token ids and their targets, the ids one position further on.

    tokens: a token file's path or a 1-D numpy integer array. A batch needs B*T + 1 tokens.

        inputs, targets = batches.sample()          B windows at random places, for training
        for inputs, targets in batches.sequential():  the tokens once, in order, for evaluation

    Both return backend.xp int32 arrays of shape (B, T) with targets[b, t] == the token after inputs[b, t].
    The random windows come from numpy's generator on the host, so a seed gives the same batches on a GPU
    machine and on a CPU one.
    """

    def __init__(self, tokens, B, T, seed=0):
        if isinstance(tokens, (str, os.PathLike)):
            tokens = read_tokens(tokens)
        if not isinstance(tokens, numpy.ndarray):
            raise TypeError(f"tokens must be a token file's path or a numpy array, not {type(tokens).__name__}")
        if tokens.ndim != 1 or not numpy.issubdtype(tokens.dtype, numpy.integer):
            raise TypeError(f"tokens must be a 1-D integer array, not {tokens.ndim}-D {tokens.dtype}")
        for name, value in (("B", B), ("T", T)):
            if not isinstance(value, (int, numpy.integer)) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, not {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name} must be at least 1, not {value}")
        if not isinstance(seed, (int, numpy.integer)) or isinstance(seed, bool):
            raise TypeError(f"seed must be an int, not {type(seed).__name__}")
        tokens_per_batch = int(B) * int(T)  # Python ints: a product of numpy int32s would overflow silently
        if tokens_per_batch > LARGEST_INT:
            raise ValueError(f"B={B}, T={T}: B*T = {tokens_per_batch} tokens per batch do not fit the int32 "
                             f"positions of a batch (at most {LARGEST_INT})")
        dtype_range = numpy.iinfo(tokens.dtype)
        may_not_fit = dtype_range.min < 0 or dtype_range.max > LARGEST_INT  # a uint16 token file always fits
        if may_not_fit and len(tokens) and (tokens.min() < 0 or tokens.max() > LARGEST_INT):
            at = int(numpy.argmax((tokens < 0) | (tokens > LARGEST_INT)))
            problem = "is negative" if tokens[at] < 0 else f"does not fit in int32 (at most {LARGEST_INT})"
            raise ValueError(f"token id {tokens[at]} at position {at} {problem}")
        if len(tokens) < tokens_per_batch + 1:
            raise ValueError(
                f"B={B}, T={T} is too big for {len(tokens)} tokens: "
                f"a batch needs B*T + 1 = {tokens_per_batch + 1} (each of B*T inputs needs the next token as its target)"
            )
        self.tokens = tokens
        self.B = int(B)
        self.T = int(T)
        self.random_generator = numpy.random.default_rng(seed)
        self.xp = backend.xp

    def sample(self):
        """B windows starting at random positions: (inputs, targets), each (B, T)."""
        # A window takes T + 1 tokens (the last input's target is one further), so the last possible start
        # is len - T - 1; integers() excludes its upper bound.
        starts = self.random_generator.integers(0, len(self.tokens) - self.T, size=self.B)
        windows = self.tokens[starts[:, None] + numpy.arange(self.T + 1)]
        return self.to_device(windows[:, :-1]), self.to_device(windows[:, 1:])

    @property
    def sequential_batches(self):
        """How many batches sequential() yields; the last (len - 1) % (B*T) tokens are left out."""
        return (len(self.tokens) - 1) // (self.B * self.T)

    def sequential(self):
        """Consecutive, non-overlapping batches from the first token on, each covering the next B*T tokens.

        Row b of batch k holds tokens k*B*T + b*T to k*B*T + b*T + T - 1; its targets are those plus one.
        """
        tokens_per_batch = self.B * self.T
        for batch in range(self.sequential_batches):
            start = batch * tokens_per_batch
            chunk = self.tokens[start : start + tokens_per_batch + 1]
            yield (
                self.to_device(chunk[:-1].reshape(self.B, self.T)),
                self.to_device(chunk[1:].reshape(self.B, self.T)),
            )

    def to_device(self, ids):
        """ids as a contiguous int32 array of the backend (on the GPU when there is one)."""
        return self.xp.asarray(numpy.ascontiguousarray(ids, dtype=numpy.int32))
