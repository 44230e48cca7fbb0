"""Text from a trained model: `python -m gpt2_cupy.sample --prompt "ROMEO:" --tokens 200`.

    model, tokenizer = load_model("runs/tinyshakespeare-tiny/checkpoint.npz")   # or a Hugging Face directory
    for token in generate(model, prompt_ids, max_new_tokens=100, temperature=0.8, top_k=50, seed=0): ...
    text = sample_text(model, tokenizer, "ROMEO:", max_new_tokens=100)

load_model reads the package's own checkpoints (.npz, written by gpt2_cupy.train) and Hugging Face GPT-2 and
Llama directories (config.json, safetensors weights, tokenizer.json or tokenizer.model).

Sampling happens on the host, one draw per token (gpt2_cupy.generation.next_token). Generation keeps a KV cache
(gpt2_cupy.generation): the prompt goes through the model once, then each new token costs the
forward of one position, whose query attends to the cached keys and values of all earlier ones.
The text is streamed through the tokenizer's IncrementalDecoder, which holds back the bytes of a character
split over several tokens until it is complete, so a broken character is never printed. Before each draw,
Utf8Mask takes away the tokens whose bytes could not continue those held-back bytes as valid UTF-8, so
that the sampler never writes a broken character in the first place.
"""

import argparse
import codecs
import json
import sys
import tempfile
from pathlib import Path

import numpy

from gpt2_cupy import backend, checkpoint, data
from gpt2_cupy.autograd import no_grad
from gpt2_cupy.checkpoint_tokenizer import load_tokenizer
from gpt2_cupy.generation import context_length, next_token
from gpt2_cupy.llama import Llama, LlamaConfig
from gpt2_cupy.model import GPT, GPTConfig

DEFAULT_CHECKPOINT = Path("runs") / "tinyshakespeare-tiny" / "checkpoint.npz"


def load_model(path):
    """(model, tokenizer) from a checkpoint: a .npz written by gpt2_cupy.train (tokenizer None if it has none),
    or a Hugging Face GPT-2 or Llama directory, with its tokenizer."""
    if Path(path).is_dir():
        return load_pretrained(path)
    arrays, meta = checkpoint.load(path)
    model = TRAINED_MODELS[meta["train_config"].get("model", "gpt2")](meta["model_config"])
    weights = {name[len("model/"):]: value for name, value in arrays.items() if name.startswith("model/")}
    model.load_state_dict(checkpoint.model_state(model, weights))
    model.eval()
    tokenizer = None
    if arrays["tokenizer"].size:
        # sentencepiece loads a model from a file: the checkpoint's own copy, so it can never be the wrong one.
        with tempfile.TemporaryDirectory() as scratch:
            model_file = Path(scratch) / "tokenizer.model"
            model_file.write_bytes(arrays["tokenizer"].tobytes())
            tokenizer = data.Tokenizer(model_file)
    return model, tokenizer


# gpt2_cupy.train's --model: the model a checkpoint's model_config builds.
TRAINED_MODELS = {"gpt2": lambda config: GPT(GPTConfig(**config)), "llama": lambda config: Llama(LlamaConfig(**config))}

# config.json says which model a directory holds: model_type, or the class names in architectures.
PRETRAINED_MODELS = {"gpt2": (GPT, "GPT2LMHeadModel"), "llama": (Llama, "LlamaForCausalLM")}


def load_pretrained(directory):
    """(model, tokenizer) from a Hugging Face directory; config.json's model_type (or architectures) picks
    GPT.from_pretrained or Llama.from_pretrained."""
    config_file = Path(directory) / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{directory} has no config.json: not a Hugging Face checkpoint directory")
    hf = json.loads(config_file.read_text())
    for model_type, (model_class, architecture) in PRETRAINED_MODELS.items():
        if hf.get("model_type") == model_type or architecture in hf.get("architectures", []):
            return model_class.from_pretrained(directory).eval(), load_tokenizer(directory)
    known = ", ".join(f"{model_type} ({architecture})" for model_type, (_, architecture) in PRETRAINED_MODELS.items())
    raise ValueError(f"{config_file}: model_type {hf.get('model_type')!r}, architectures {hf.get('architectures')}; "
                     f"this sampler runs {known}")


# ---- tokens that keep the text valid UTF-8 ---------------------------------------------------------


def utf8_length(lead_byte):
    """How many bytes a UTF-8 character has, from its first byte (0 for a byte that cannot start one)."""
    if lead_byte < 0x80:
        return 1
    return 2 if 0xC2 <= lead_byte <= 0xDF else 3 if 0xE0 <= lead_byte <= 0xEF else 4 if 0xF0 <= lead_byte <= 0xF4 else 0


def continues_utf8(pending, token_bytes):
    """Whether the bytes of a token can follow pending (the start of a character, or b"") in valid UTF-8.

    Python's UTF-8 decoder is the judge: decoding pending + token_bytes strictly, but not as the end of the
    text, raises when the bytes can never be valid. It does not yet check the second byte of a character it
    holds back, whose range depends on the first (after 0xE0 only 0xA0 to 0xBF, after 0xED only 0x80 to
    0x9F: those would be surrogates, ...); a held-back start of two bytes or more is therefore completed with
    0x80s, which every later position accepts, and decoded once more. A token with no bytes (a special token)
    may come between characters, not inside one.
    """
    if pending and not token_bytes:
        return False
    decoder = codecs.getincrementaldecoder("utf-8")(errors="strict")
    try:
        decoder.decode(pending + token_bytes, final=False)
        held_back = decoder.getstate()[0]
        if len(held_back) > 1:
            (held_back + b"\x80" * (utf8_length(held_back[0]) - len(held_back))).decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


class Utf8Mask:
    """Which of a model's token ids may come next, given the bytes the decoder holds back.

    A byte-fallback or byte-level vocabulary can spell anything, including bytes that are no UTF-8: a lone
    continuation byte, or a character's first byte followed by the first byte of another. A sampler that
    draws such a token has written a "�" that nothing after can repair. Masking those tokens (logit -inf)
    before the softmax makes it draw only among tokens that keep the text valid.

    The masks are computed once per held-back state and kept: with nothing held back every token is
    checked; with a character started, only tokens whose first byte is a continuation byte (0x80 to 0xBF)
    can continue it, a few hundred at most.
    """

    def __init__(self, token_bytes, vocab_size):
        # Ids past the tokenizer's vocabulary (a model's vocabulary padded to a round size) stand for nothing
        # and are never allowed; tokenizer ids past the model's vocabulary can never be drawn anyway.
        self.token_bytes = token_bytes[:vocab_size]
        self.vocab_size = vocab_size
        self.continuation_tokens = [token for token, piece in enumerate(self.token_bytes)
                                    if piece and 0x80 <= piece[0] <= 0xBF]
        self.masks = {}

    def allowed(self, pending, finishing=False):
        """A boolean array over the vocabulary: True where the token keeps the text valid UTF-8 after pending.

        finishing: only tokens that stay within the character pending began (they complete it or add to it),
        so that it is complete within three more tokens. Never all False: where the vocabulary has no token
        that continues a character, the character is given up (the decoder prints "�" for it) rather than
        leaving the sampler nothing to draw."""
        key = (pending, finishing)
        if key not in self.masks:
            mask = numpy.zeros(self.vocab_size, dtype=bool)
            missing = utf8_length(pending[0]) - len(pending) if pending else 0
            for token in self.continuation_tokens if pending else range(len(self.token_bytes)):
                piece = self.token_bytes[token]
                mask[token] = continues_utf8(pending, piece) and not (finishing and len(piece) > missing)
            if not mask.any():
                mask = self.allowed(pending) if finishing else self.allowed(b"") if pending else ~mask
            self.masks[key] = mask
        return self.masks[key]


# ---- drawing tokens ----------------------------------------------------------------------------------


def generate(model, prompt_ids, max_new_tokens, temperature=1.0, top_k=None, seed=0, allowed_tokens=None):
    """Yields max_new_tokens token ids continuing prompt_ids (a non-empty list of ints).

    Sampling happens on the host with numpy's generator, so a seed gives the same text on a GPU and on the
    CPU as long as the logits agree. Past the context length (block_size, or Llama's max_position_embeddings)
    the context is cut to its last half and the cache refilled from it. allowed_tokens: a function called
    before each draw, returning the boolean mask of the tokens that may come next (None: any token); it
    runs after the consumer has seen the previous token, as a generator runs only when asked for the next.
    """
    if not prompt_ids:
        raise ValueError("generate: the prompt has no tokens (start from the end-of-text token for no prompt)")
    if temperature < 0:
        raise ValueError(f"generate: temperature = {temperature}; it must be >= 0")
    if top_k is not None and top_k < 1:
        raise ValueError(f"generate: top_k = {top_k}; it must be at least 1")
    block_size = context_length(model.config)
    generator = numpy.random.default_rng(seed)
    context = list(prompt_ids)[-block_size:]
    use_cache = getattr(model.config, "attention", "softmax") == "softmax"  # the cache computes softmax attention
    cache, new = None, context
    with no_grad():
        for _ in range(max_new_tokens):
            if not use_cache:
                logits, _ = model(backend.xp.asarray(numpy.array([context], dtype=numpy.int32)))
            else:
                if cache is None or cache.length + len(new) > block_size:
                    new = context[-(block_size // 2):] if cache is not None else context
                    context = list(new)
                    cache = model.new_kv_cache(1, block_size)
                logits, _ = model(backend.xp.asarray(numpy.array([new], dtype=numpy.int32)), kv_cache=cache)
            allowed = allowed_tokens() if allowed_tokens is not None else None
            token = next_token(backend.asnumpy(logits._data[0, -1]), temperature, top_k, generator, allowed)
            yield token
            context.append(token)
            context = context[-block_size:] if not use_cache else context
            new = [token]


# Past max_new_tokens, a character already begun is finished: at most 3 more tokens (UTF-8 characters are at most
# 4 bytes long, and the mask then allows only tokens that stay within that character).
LONGEST_CHARACTER = 4


def sample_text(model, tokenizer, prompt, max_new_tokens, temperature=1.0, top_k=None, seed=0, stream=None):
    """The prompt's continuation as text; written piece by piece to stream (a file) if one is given."""
    decoder = tokenizer.decoder()
    mask = Utf8Mask(tokenizer.token_bytes, model.config.vocab_size)
    drawn = 0

    def allowed_tokens():
        return mask.allowed(decoder.pending_bytes(), finishing=drawn >= max_new_tokens)

    limit = max_new_tokens + LONGEST_CHARACTER - 1 if max_new_tokens > 0 else 0
    pieces = []
    for token in generate(model, tokenizer.prompt_ids(prompt), limit, temperature, top_k, seed, allowed_tokens):
        text = decoder.feed(token)  # "" while a character's bytes are incomplete
        pieces.append(text)
        if stream is not None and text:
            stream.write(text)
            stream.flush()
        drawn += 1
        if drawn >= max_new_tokens and not decoder.pending_bytes():
            break
    pieces.append(decoder.finish())
    if stream is not None:
        stream.write(pieces[-1])
        stream.flush()
    return "".join(pieces)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m gpt2_cupy.sample", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT),
                        help="a .npz from gpt2_cupy.train, or a Hugging Face GPT-2 or Llama directory")
    parser.add_argument("--prompt", default="", help="empty: start from the beginning- or end-of-text token")
    parser.add_argument("--tokens", type=int, default=200, help="how many tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=50, dest="top_k", help="0: no top-k cut")
    parser.add_argument("--seed", type=int, default=0)
    arguments = parser.parse_args(argv)
    try:
        model, tokenizer = load_model(arguments.checkpoint)
    except (FileNotFoundError, ValueError, NotImplementedError) as error:
        untrained = isinstance(error, FileNotFoundError) and not Path(arguments.checkpoint).is_dir()
        print(f"error: {error}" + ("\n(train one first: python -m gpt2_cupy.train --preset tiny --steps 50)"
                                   if untrained else ""), file=sys.stderr)
        return 1
    if tokenizer is None:
        print("error: this checkpoint holds no tokenizer: its corpus directory had no tokenizer.model", file=sys.stderr)
        return 1
    # Windows consoles and pipes may not default to UTF-8; the text is UTF-8 whatever the prompt's language.
    stream = sys.stdout
    if hasattr(stream, "reconfigure"):
        stream.reconfigure(encoding="utf-8")
    stream.write(arguments.prompt)
    sample_text(model, tokenizer, arguments.prompt, arguments.tokens, arguments.temperature,
                arguments.top_k or None, arguments.seed, stream=stream)
    stream.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
