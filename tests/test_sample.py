"""gpt2_cupy.sample: the KV cache gives the full forward's logits, streaming never breaks a character, the
UTF-8 mask against a brute-force reference, and Hugging Face GPT-2 and Llama directories sampled from the
command line (tiny models and tokenizers built in the test)."""

import io
import json
from types import SimpleNamespace

import numpy as np
import pytest
from safetensors.numpy import load_file

import gpt2_cupy
from gpt2_cupy import data, safetensors_files
from gpt2_cupy import sample as sampling
from gpt2_cupy.checkpoint_tokenizer import load_tokenizer
from gpt2_cupy.llama import Llama, LlamaConfig
from gpt2_cupy.model import GPT, GPTConfig
from tiny_tokenizers import write_byte_level_bpe, write_sentencepiece


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


# ---- tokens that keep the text valid UTF-8 ---------------------------------------------------------------

# Bytes that may follow a character's first bytes: the edges of every range UTF-8 allows there.
CONTINUATIONS = [bytes([b]) for b in (0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF)]


def can_still_be_utf8(encoded):
    """Reference: whether some ending of at most 3 continuation bytes makes the bytes valid UTF-8."""
    endings = [b""] + CONTINUATIONS + [a + b for a in CONTINUATIONS for b in CONTINUATIONS]
    endings += [a + b + c for a in CONTINUATIONS for b in CONTINUATIONS for c in CONTINUATIONS]
    for ending in endings:
        try:
            (encoded + ending).decode("utf-8")
            return True
        except UnicodeDecodeError:
            pass
    return False


def test_the_mask_allows_exactly_the_tokens_that_can_still_be_utf8():
    japanese = "吾輩は猫🐈".encode()
    pieces = [bytes([byte]) for byte in range(256)] + [b"", b"ab", b"\xe3\x81", b"\x81\xaf", b"\xaf\xe7\x8c"]
    pieces += [japanese[start:end] for start in range(len(japanese)) for end in range(start + 1, len(japanese) + 1)]
    mask = sampling.Utf8Mask(pieces, len(pieces) + 3)  # 3 ids past the tokenizer's vocabulary: never allowed
    for pending in [b"", b"\xc3", b"\xe3", b"\xe3\x81", b"\xe0", b"\xed", b"\xf0", b"\xf0\x9f", b"\xf4\x8f\xbf"]:
        allowed = mask.allowed(pending)
        assert allowed.shape == (len(pieces) + 3,) and not allowed[-3:].any()
        for token, piece in enumerate(pieces):
            expected = can_still_be_utf8(pending + piece) and not (pending and not piece)
            assert allowed[token] == expected, (pending, piece)
        finishing = mask.allowed(pending, finishing=True)  # within the character: it is done in 3 tokens
        missing = sampling.utf8_length(pending[0]) - len(pending) if pending else 0
        assert all(finishing[t] == (allowed[t] and len(p) <= missing) for t, p in enumerate(pieces))


def test_the_mask_never_removes_every_token(tmp_path):
    vocabularies = [load_tokenizer(write_byte_level_bpe(tmp_path).parent).token_bytes,
                    data.Tokenizer(write_sentencepiece(tmp_path)).token_bytes]
    # Every way a character can have begun: lead bytes, then continuation bytes at the edges of their ranges.
    pending_states = []
    for lead in range(0xC2, 0xF5):
        started = [bytes([lead])]
        while started:
            pending_states += started
            started = [s + c for s in started for c in CONTINUATIONS
                       if len(s + c) < sampling.utf8_length(lead) and can_still_be_utf8(s + c)]
    assert len(pending_states) > 200
    for token_bytes in vocabularies:
        mask = sampling.Utf8Mask(token_bytes, len(token_bytes))
        for pending in [b""] + pending_states:
            assert mask.allowed(pending).any() and mask.allowed(pending, finishing=True).any(), pending
    # A vocabulary that cannot continue a character: the character is given up, not the sampler.
    mask = sampling.Utf8Mask([b"a", b"\xe3", b"b"], 3)
    assert mask.allowed(b"\xe3").tolist() == [True, True, True] == mask.allowed(b"\xe3", finishing=True).tolist()


def test_the_mask_comes_before_greedy_and_top_k():
    logits = np.array([9.0, 5.0, 1.0, 4.0, 3.0])
    allowed = np.array([False, True, True, False, True])
    generator = np.random.default_rng(0)
    assert sampling.next_token(logits, 0, None, generator, allowed) == 1
    assert {sampling.next_token(logits, 1.0, 2, generator, allowed) for _ in range(200)} == {1, 4}


def test_sampled_japanese_never_breaks_a_character(tmp_path):
    tokenizer = load_tokenizer(write_byte_level_bpe(tmp_path).parent)
    gpt2_cupy.manual_seed(3)
    model = GPT(GPTConfig(block_size=64, vocab_size=320, n_layer=1, n_head=1, n_embd=32)).eval()  # padded vocabulary
    prompt = "吾輩は猫"
    # Unmasked, a random model writes bytes that are no UTF-8 (a third of this vocabulary are lone continuation bytes).
    unmasked = list(sampling.generate(model, tokenizer.prompt_ids(prompt), 30, temperature=2.0, seed=0))
    assert "\ufffd" in tokenizer.decode([t for t in unmasked if t < tokenizer.vocab_size])
    stream = io.StringIO()
    writes = []
    stream.write = lambda piece: writes.append(piece)
    text = sampling.sample_text(model, tokenizer, prompt, 30, temperature=2.0, seed=0, stream=stream)
    assert "\ufffd" not in text and "".join(writes) == text and len(text) > 0
    text.encode("utf-8")  # whole characters only: no lone surrogate, nothing held back at the end


# ---- Hugging Face directories ----------------------------------------------------------------------------


def tiny_gpt2_directory(directory, dtype, max_shard_size=None):
    gpt2_cupy.manual_seed(5)
    model = GPT(GPTConfig(block_size=32, vocab_size=300, n_layer=2, n_head=1, n_embd=32))
    model.save_pretrained(directory, dtype=dtype, max_shard_size=max_shard_size)
    write_byte_level_bpe(directory)
    return model


def rounded(values, dtype):
    """Reference rounding to float16 (numpy's) or bfloat16 (8 significant bits, ties to even, in float64)."""
    if dtype == "float16":
        return values.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        mantissa, exponent = np.frexp(values.astype(np.float64))
        return np.ldexp(np.round(mantissa * 256) / 256, exponent).astype(np.float32)
    return values


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("sharded", [False, True])
def test_gpt2_from_pretrained_reads_shards_and_half_precision(tmp_path, rng, to_device, to_host, dtype, sharded):
    model = tiny_gpt2_directory(tmp_path, dtype, max_shard_size=20_000 if sharded else None)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert ("model.safetensors.index.json" in files and "model-00002-of-" in " ".join(files)) == sharded
    loaded = GPT.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    for name, original in model.state_dict().items():
        assert np.array_equal(loaded.state_dict()[name].numpy(), rounded(original.numpy(), dtype)), name
    if dtype == "float16" and not sharded:  # Conv1D's (in, out) on disk, read by the safetensors package
        stored = load_file(tmp_path / "model.safetensors")
        weight = model.state_dict()["transformer.h.0.attn.c_attn.weight"].numpy()   # (3C, C)
        assert np.array_equal(stored["transformer.h.0.attn.c_attn.weight"], weight.T.astype(np.float16))
        assert "lm_head.weight" not in stored
    idx = to_device(rng.integers(0, 300, size=(1, 7)).astype(np.int32))
    with gpt2_cupy.no_grad():
        model.load_state_dict(loaded.state_dict())
        assert np.array_equal(to_host(model(idx)[0].data), to_host(loaded(idx)[0].data))


def test_gpt2_from_pretrained_names_a_missing_tensor(tmp_path):
    tiny_gpt2_directory(tmp_path, "float32")
    tensors = dict(safetensors_files.read_tensors(tmp_path))
    del tensors["transformer.h.1.mlp.c_fc.bias"]
    safetensors_files.write_tensors(tmp_path, tensors)
    with pytest.raises(ValueError, match=r"transformer\.h\.1\.mlp\.c_fc\.bias: missing"):
        GPT.from_pretrained(tmp_path)


def run_main(arguments, capsys):
    status = sampling.main(arguments)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_the_command_line_samples_a_hugging_face_gpt2_directory(tmp_path, capsys):
    tiny_gpt2_directory(tmp_path, "bfloat16", max_shard_size=20_000)
    status, out, _ = run_main(["--checkpoint", str(tmp_path), "--prompt", "吾輩は", "--tokens", "12", "--seed", "2"],
                              capsys)
    assert status == 0
    model, tokenizer = GPT.from_pretrained(tmp_path).eval(), load_tokenizer(tmp_path)
    expected = sampling.sample_text(model, tokenizer, "吾輩は", 12, temperature=0.8, top_k=50, seed=2)
    assert out == "吾輩は" + expected + "\n" and "\ufffd" not in out


def test_the_command_line_samples_a_hugging_face_llama_directory(tmp_path, capsys):
    gpt2_cupy.manual_seed(6)
    tokenizer = data.Tokenizer(write_sentencepiece(tmp_path))
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    Llama(config).save_pretrained(tmp_path, dtype="float16")
    status, out, _ = run_main(["--checkpoint", str(tmp_path), "--prompt", "吾輩は", "--tokens", "40"], capsys)
    assert status == 0
    model = Llama.from_pretrained(tmp_path).eval()
    expected = sampling.sample_text(model, tokenizer, "吾輩は", 40, temperature=0.8, top_k=50, seed=0)
    assert out == "吾輩は" + expected + "\n" and "\ufffd" not in out


def test_the_command_line_names_what_it_looked_for(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}))
    status, _, err = run_main(["--checkpoint", str(tmp_path)], capsys)
    assert status == 1 and "'mistral'" in err and "gpt2 (GPT2LMHeadModel)" in err and "llama" in err
    tiny_gpt2_directory(tmp_path, "float32")
    (tmp_path / "tokenizer.json").unlink()
    status, _, err = run_main(["--checkpoint", str(tmp_path)], capsys)
    assert status == 1 and "tokenizer.json" in err and "tokenizer.model" in err and "train one first" not in err


def test_a_trained_llama_checkpoint_samples(tmp_path):
    # gpt2_cupy.train --model llama writes the Llama's own config and output head; the sampler rebuilds that model
    from gpt2_cupy.train import Trainer, make_config

    trainer = Trainer(make_config(corpus="tinyshakespeare", preset="tiny", model="llama", n_layer=1, n_embd=32,
                                  n_head=2, block_size=16, batch_size=2, max_steps=1, eval_interval=1, eval_batches=1,
                                  checkpoint_interval=1, cuda_graph=False, progress=False, out_dir=str(tmp_path)))
    trainer.run()
    model, tokenizer = sampling.load_model(trainer.checkpoint_path)
    assert type(model) is type(trainer.model) and tokenizer is not None
    for name, value in trainer.model.state_dict().items():
        assert np.array_equal(model.state_dict()[name].numpy(), value.numpy()), name
