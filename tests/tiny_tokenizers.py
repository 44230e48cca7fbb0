"""Tiny tokenizers trained in the test on a few lines of Japanese, written as a checkpoint directory has them.

    write_sentencepiece(directory)    tokenizer.model as Llama 2's: byte fallback, <s> and </s>, a dummy prefix
    write_byte_level_bpe(directory)   tokenizer.json as GPT-2's: byte-level BPE, <|endoftext|>

Both vocabularies are small, so that many characters are not in them: a character is split over several
tokens, as byte tokens (sentencepiece's fallback) or across the merges of byte-level BPE.
"""

import io

import sentencepiece
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# The opening of Natsume Soseki's "I Am a Cat" (1905, public domain).
JAPANESE = [
    "吾輩は猫である。名前はまだ無い。",
    "どこで生れたかとんと見当がつかぬ。",
    "何でも薄暗いじめじめした所でニャーニャー泣いていた事だけは記憶している。",
    "吾輩はここで始めて人間というものを見た。",
    "しかもあとで聞くとそれは書生という人間中で一番獰悪な種族であったそうだ。",
]
UNSEEN = "林檎と葡萄"  # characters of no training line: spelled in bytes by both tokenizers
VOCAB_SIZE = 300  # byte-level BPE: the 256 bytes, the end-of-text token and 43 merges


def write_sentencepiece(directory):
    """Train a Llama-2-style sentencepiece model; write directory/tokenizer.model and return its path."""
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(JAPANESE * 4), model_writer=model, model_type="bpe",
        vocab_size=VOCAB_SIZE + 40, hard_vocab_limit=False,  # 259 bytes and specials, the characters, what merges
        byte_fallback=True, character_coverage=0.98,  # the rarest characters are left to the byte tokens
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, add_dummy_prefix=True, normalization_rule_name="identity",
        num_threads=1, minloglevel=2)
    path = directory / "tokenizer.model"
    path.write_bytes(model.getvalue())
    return path


def write_byte_level_bpe(directory):
    """Train a GPT-2-style byte-level BPE; write directory/tokenizer.json and return its path."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(JAPANESE * 4, trainer)
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    return path
