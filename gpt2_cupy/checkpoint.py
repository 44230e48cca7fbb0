"""Checkpoints: one .npz file holding everything a run needs to continue exactly where it stopped.

    save(path, arrays, meta)      arrays: {name: numpy array}; meta: anything json can write
    arrays, meta = load(path)
    model_arrays(model)           the model's state as {name: numpy array}, a tied matrix once
    model_state(model, arrays)    model_arrays' names back to a full state_dict, each tied name filled in

The file is written next to its final name and then renamed over it (os.replace, atomic on one file
system): a crash or a Ctrl-C in the middle of a write leaves the previous checkpoint as it was.
"""

import json
import os
from pathlib import Path

import numpy

META = "__meta__"  # the arrays' name for the json text of meta


def save(path, arrays, meta):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if META in arrays:
        raise ValueError(f"checkpoint.save: {META!r} is reserved for the metadata")
    partial = path.with_name(path.name + ".partial")
    meta_bytes = numpy.frombuffer(json.dumps(meta).encode("utf-8"), dtype=numpy.uint8)
    with open(partial, "wb") as file:
        numpy.savez(file, **{META: meta_bytes}, **arrays)
        file.flush()
        os.fsync(file.fileno())  # on disk before the rename makes it the checkpoint
    os.replace(partial, path)


def load(path):
    """(arrays, meta) of a checkpoint written by save(); a clear error for a file that is not one."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        with numpy.load(path, allow_pickle=False) as stored:
            arrays = {name: stored[name] for name in stored.files}
    except Exception as error:  # a truncated or foreign file: zipfile, pickle and value errors alike
        raise ValueError(f"{path} is not a readable checkpoint ({error})") from None
    if META not in arrays:
        raise ValueError(f"{path} is not a gpt2_cupy checkpoint (no {META!r} entry)")
    meta = json.loads(arrays.pop(META).tobytes().decode("utf-8"))
    return arrays, meta


def tied_names(model):
    """{name: the name it is tied to}: a parameter registered under several names (GPT-2's lm_head.weight is
    transformer.wte.weight; Llama's when tie_word_embeddings) maps each later name to its first one."""
    first_name, tied = {}, {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        tied_to = first_name.setdefault(id(parameter), name)
        if tied_to != name:
            tied[name] = tied_to
    return tied


def model_arrays(model):
    """The model's state_dict as host arrays, each tied matrix stored once, under its first name."""
    tied = tied_names(model)
    return {name: value.numpy() for name, value in model.state_dict().items() if name not in tied}


def model_state(model, arrays):
    """model_arrays' output (as loaded) back to a state_dict for model.load_state_dict, tied names filled in."""
    return {**arrays, **{name: arrays[first] for name, first in tied_names(model).items() if first in arrays}}
