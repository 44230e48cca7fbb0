"""What GPT (gpt2_cupy.model) and Llama (gpt2_cupy.llama) share around their modules: reading and writing a
Hugging Face checkpoint directory, and nanoGPT's AdamW set-up.

    hf = read_config(directory)                             config.json as a dict
    check_loaded(names, loaded, directory)                  ValueError naming the first parameter not loaded
    write(directory, tensors, hf, dtype, max_shard_size)     model.safetensors (or shards) and config.json
    optimizer = adamw(model, weight_decay, learning_rate, betas)

The tensors go through gpt2_cupy.safetensors_files one at a time, so the host never holds a second copy
of a model.
"""

import json
import os

from gpt2_cupy import optim, safetensors_files


def read_config(directory):
    with open(os.path.join(directory, "config.json")) as file:
        return json.load(file)


def check_loaded(names, loaded, directory):
    """Every name of names (the model's parameters) must be in loaded (the checkpoint's tensors read)."""
    missing = [name for name in names if name not in loaded]
    if missing:
        raise ValueError(f"{missing[0]}: missing from the checkpoint in {directory}"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))


def write(directory, tensors, hf, dtype, max_shard_size):
    """tensors ({name: array}) as model.safetensors, or shards of at most max_shard_size bytes with their index,
    in dtype ("float32", "float16" or "bfloat16"), and hf as config.json."""
    os.makedirs(directory, exist_ok=True)
    safetensors_files.write_tensors(directory, tensors, dtype=dtype, max_shard_bytes=max_shard_size)
    with open(os.path.join(directory, "config.json"), "w") as file:
        json.dump(hf, file, indent=2)


def adamw(model, weight_decay, learning_rate, betas):
    """AdamW with nanoGPT's two groups: matrices and embeddings decay, biases and norm weights do not."""
    parameters = model.parameters()
    groups = [{"params": [p for p in parameters if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in parameters if p.ndim < 2], "weight_decay": 0.0}]
    return optim.AdamW(groups, lr=learning_rate, betas=betas)
