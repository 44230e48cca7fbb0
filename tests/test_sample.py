"""gpt2_cupy.sample: the KV cache gives the full forward's logits, streaming never breaks a character."""

import io
from types import SimpleNamespace

import numpy as np
import pytest

import gpt2_cupy
from gpt2_cupy import backend, data
from gpt2_cupy import sample as sampling
from gpt2_cupy.model import GPT, GPTConfig


@pytest.fixture(scope="module")
def model():
    gpt2_cupy.manual_seed(7)
    model = GPT(GPTConfig(block_size=16, vocab_size=2048, n_layer=2, n_head=1, n_embd=32))
    return model.eval()


def test_generation_with_the_cache_gives_the_logits_of_the_full_forward(model, rng, to_device, to_host):
    ids = rng.integers(0, 2048, size=(1, 12)).astype(np.int32)
    with gpt2_cupy.no_grad():
        full = to_host(model(to_device(ids))[0].data)
        cache = model.new_kv_cache(1, 12)
        pieces = [to_host(model(to_device(ids[:, :5]), kv_cache=cache)[0].data)]  # the prompt at once
        for position in range(5, 12):                                              # then one position each
            pieces.append(to_host(model(to_device(ids[:, position:position + 1]), kv_cache=cache)[0].data))
    cached = np.concatenate(pieces, axis=1)
    assert cached.shape == full.shape
    assert np.max(np.abs(cached - full)) / np.max(np.abs(full)) < 1e-5


def test_generate_is_seeded_and_greedy_is_the_argmax(model, to_device, to_host):
    prompt = [1, 2, 3]
    first = list(sampling.generate(model, prompt, 8, temperature=1.0, top_k=20, seed=3))
    again = list(sampling.generate(model, prompt, 8, temperature=1.0, top_k=20, seed=3))
    assert first == again and len(first) == 8
    greedy = list(sampling.generate(model, prompt, 3, temperature=0))
    context = list(prompt)
    with gpt2_cupy.no_grad():
        for token in greedy:  # the full forward of the whole context, no cache: the same argmax
            logits = to_host(model(to_device(np.array([context], np.int32)))[0].data)[0, -1]
            assert token == int(np.argmax(logits))
            context.append(token)


def test_generation_past_block_size_continues(model):
    tokens = list(sampling.generate(model, [1], 40, temperature=1.0, seed=0))  # block_size is 16
    assert len(tokens) == 40 and all(0 <= t < 2048 for t in tokens)


def test_top_k_keeps_only_the_k_largest():
    logits = np.array([0.0, 5.0, 1.0, 4.0, 3.0])
    generator = np.random.default_rng(0)
    drawn = {sampling.next_token(logits, 1.0, 2, generator) for _ in range(200)}
    assert drawn == {1, 3}


def test_bad_arguments_are_refused(model):
    with pytest.raises(ValueError, match="temperature"):
        next(sampling.generate(model, [1], 1, temperature=-1))
    with pytest.raises(ValueError, match="top_k"):
        next(sampling.generate(model, [1], 1, top_k=0))
    with pytest.raises(ValueError, match="no tokens"):
        next(sampling.generate(model, [], 1))


def test_streamed_text_never_holds_half_a_character(monkeypatch):
    tokenizer = data.Tokenizer(data.prepare("aozora", progress=False).tokenizer)
    text = "吾輩は猫である。檎"  # 檎 is outside the vocabulary: three byte-fallback tokens
    ids = tokenizer.encode(text)
    assert len([t for t in ids if tokenizer.processor.is_byte(t)]) == 3
    monkeypatch.setattr(sampling, "generate", lambda *arguments: iter(ids))
    stream = io.StringIO()
    writes = []
    stream.write = lambda piece: writes.append(piece)
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=tokenizer.vocab_size))  # generate is replaced
    assert sampling.sample_text(model, tokenizer, "吾輩", len(ids), stream=stream) == text
    assert "".join(writes) == text and not any("\ufffd" in piece for piece in writes)


def test_a_japanese_prompt_is_continued(to_device):
    tokenizer = data.Tokenizer(data.prepare("aozora", progress=False).tokenizer)
    gpt2_cupy.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=tokenizer.vocab_size, n_layer=1, n_head=1, n_embd=32)).eval()
    stream = io.StringIO()
    text = sampling.sample_text(model, tokenizer, "吾輩は猫である。", 10, temperature=1.0, top_k=50, seed=1,
                                stream=stream)
    assert stream.getvalue() == text
    assert isinstance(text, str) and len(text) > 0
