"""Checkpoints: one .npz file holding everything a run needs to continue exactly where it stopped.

    save(path, arrays, meta)      arrays: {name: numpy array}; meta: anything json can write
    arrays, meta = load(path)

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
