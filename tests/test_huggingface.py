"""Hugging Face interop (chapter 12): GPT.from_pretrained and save_pretrained against transformers itself.

Both directions on a randomly initialised GPT-2 configuration: transformers' GPT2LMHeadModel saved with
save_pretrained and loaded here, and ours saved here and loaded by GPT2LMHeadModel.from_pretrained; the
logits must agree within 1e-4 (max absolute difference). No network: everything is written to a temporary
directory. transformers and PyTorch are installed on the GPU machine; elsewhere these tests are skipped.
The round trip through our own files (no transformers) is in tests/test_nn_model.py.
"""

import numpy as np
import pytest

from gpt2_cupy.autograd import no_grad
from gpt2_cupy.model import GPT

torch = pytest.importorskip("torch", reason="PyTorch is not installed here (it is on the GPU machine)")
transformers = pytest.importorskip("transformers",
                                   reason="transformers is not installed here (it is on the GPU machine)")

TOLERANCE = 1e-4


def random_hugging_face_model():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=128, n_layer=2, n_head=4)
    return transformers.GPT2LMHeadModel(config).eval()


def their_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def our_logits(model, tokens, to_device, to_host):
    with no_grad():
        return to_host(model(to_device(tokens))[0].data)


def test_their_checkpoint_loads_here(tmp_path, rng, to_device, to_host):
    theirs = random_hugging_face_model()
    theirs.save_pretrained(tmp_path, safe_serialization=True)
    ours = GPT.from_pretrained(tmp_path)
    tokens = rng.integers(0, 512, size=(2, 64))
    difference = np.abs(our_logits(ours, tokens, to_device, to_host) - their_logits(theirs, tokens)).max()
    assert difference < TOLERANCE, f"max |logit difference| {difference:.3g}"


def test_our_checkpoint_loads_there(tmp_path, rng, to_device, to_host):
    theirs = random_hugging_face_model()
    theirs.save_pretrained(tmp_path / "theirs", safe_serialization=True)
    ours = GPT.from_pretrained(tmp_path / "theirs")
    ours.save_pretrained(tmp_path / "ours")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "ours").eval()
    tokens = rng.integers(0, 512, size=(2, 64))
    difference = np.abs(our_logits(ours, tokens, to_device, to_host) - their_logits(loaded, tokens)).max()
    assert difference < TOLERANCE, f"max |logit difference| {difference:.3g}"
    for name, value in loaded.state_dict().items():   # every stored tensor came back unchanged
        if name in theirs.state_dict() and not name.endswith((".attn.bias", ".attn.masked_bias")):
            assert torch.equal(value, theirs.state_dict()[name]), name
