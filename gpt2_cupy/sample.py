"""Text from a trained model: `python -m gpt2_cupy.sample --prompt "ROMEO:" --tokens 200`.

    model, tokenizer = load_model("runs/tinyshakespeare-tiny/checkpoint.npz")
    for token in generate(model, prompt_ids, max_new_tokens=100, temperature=0.8, top_k=50, seed=0): ...
    text = sample_text(model, tokenizer, "ROMEO:", max_new_tokens=100)

Generation keeps a KV cache: the prompt goes through the model once, then each new token costs the
forward of one position, whose query attends to the cached keys and values of all earlier ones.
The text is streamed through the tokenizer's IncrementalDecoder, which holds back the bytes of a character
split over several byte-fallback tokens until it is complete, so a broken character is never printed.
"""

import argparse
import sys
import tempfile
from pathlib import Path

import numpy

from gpt2_cupy import backend, checkpoint, data
from gpt2_cupy.autograd import no_grad
from gpt2_cupy.model import GPT, GPTConfig

DEFAULT_CHECKPOINT = Path("runs") / "tinyshakespeare-tiny" / "checkpoint.npz"


def load_model(path):
    """(model, tokenizer) from a checkpoint written by gpt2_cupy.train (tokenizer None if it has none)."""
    arrays, meta = checkpoint.load(path)
    model = GPT(GPTConfig(**meta["model_config"]))
    weights = {name[len("model/"):]: value for name, value in arrays.items() if name.startswith("model/")}
    weights["lm_head.weight"] = weights["transformer.wte.weight"]  # tied: stored once
    model.load_state_dict(weights)
    model.eval()
    tokenizer = None
    if arrays["tokenizer"].size:
        # sentencepiece loads a model from a file: the checkpoint's own copy, so it can never be the wrong one.
        with tempfile.TemporaryDirectory() as scratch:
            model_file = Path(scratch) / "tokenizer.model"
            model_file.write_bytes(arrays["tokenizer"].tobytes())
            tokenizer = data.Tokenizer(model_file)
    return model, tokenizer


def next_token(logits, temperature, top_k, generator):
    """One token id drawn from the logits of one position (a numpy float vector)."""
    logits = numpy.asarray(logits, dtype=numpy.float64)
    if temperature == 0:
        return int(numpy.argmax(logits))  # greedy
    logits = logits / temperature
    if top_k is not None and top_k < logits.size:
        kth_largest = numpy.partition(logits, -top_k)[-top_k]
        logits = numpy.where(logits < kth_largest, -numpy.inf, logits)  # only the top k remain possible
    probabilities = numpy.exp(logits - logits.max())
    probabilities /= probabilities.sum()
    return int(generator.choice(probabilities.size, p=probabilities))


def generate(model, prompt_ids, max_new_tokens, temperature=1.0, top_k=None, seed=0):
    """Yields max_new_tokens token ids continuing prompt_ids (a non-empty list of ints).

    Sampling happens on the host with numpy's generator, so a seed gives the same text on a GPU and on the
    CPU as long as the logits agree. Past block_size positions the context is cut to its last half and
    the cache refilled from it.
    """
    if not prompt_ids:
        raise ValueError("generate: the prompt has no tokens (start from the end-of-text token for no prompt)")
    if temperature < 0:
        raise ValueError(f"generate: temperature = {temperature}; it must be >= 0")
    if top_k is not None and top_k < 1:
        raise ValueError(f"generate: top_k = {top_k}; it must be at least 1")
    config = model.config
    generator = numpy.random.default_rng(seed)
    context = list(prompt_ids)[-config.block_size:]
    use_cache = config.attention == "softmax"  # the cache path computes softmax attention only
    cache, new = None, context
    with no_grad():
        for _ in range(max_new_tokens):
            if not use_cache:
                logits, _ = model(backend.xp.asarray(numpy.array([context], dtype=numpy.int32)))
            else:
                if cache is None or cache.length + len(new) > config.block_size:
                    new = context[-(config.block_size // 2):] if cache is not None else context
                    context = list(new)
                    cache = model.new_kv_cache(1, config.block_size)
                logits, _ = model(backend.xp.asarray(numpy.array([new], dtype=numpy.int32)), kv_cache=cache)
            token = next_token(backend.asnumpy(logits.data[0, -1]), temperature, top_k, generator)
            yield token
            context.append(token)
            context = context[-config.block_size:] if not use_cache else context
            new = [token]


def sample_text(model, tokenizer, prompt, max_new_tokens, temperature=1.0, top_k=None, seed=0, stream=None):
    """The prompt's continuation as text; written piece by piece to stream (a file) if one is given."""
    prompt_ids = tokenizer.encode(prompt) if prompt else [tokenizer.end_of_text]
    decoder = tokenizer.decoder()
    pieces = []
    for token in generate(model, prompt_ids, max_new_tokens, temperature, top_k, seed):
        text = decoder.feed(token)  # "" while a character's bytes are incomplete
        pieces.append(text)
        if stream is not None and text:
            stream.write(text)
            stream.flush()
    pieces.append(decoder.finish())
    if stream is not None:
        stream.write(pieces[-1])
        stream.flush()
    return "".join(pieces)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m gpt2_cupy.sample", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--prompt", default="", help="empty: start from the end-of-text token")
    parser.add_argument("--tokens", type=int, default=200, help="how many tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=50, dest="top_k", help="0: no top-k cut")
    parser.add_argument("--seed", type=int, default=0)
    arguments = parser.parse_args(argv)
    try:
        model, tokenizer = load_model(arguments.checkpoint)
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}" + ("\n(train one first: python -m gpt2_cupy.train --preset tiny --steps 50)"
                                   if isinstance(error, FileNotFoundError) else ""), file=sys.stderr)
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
