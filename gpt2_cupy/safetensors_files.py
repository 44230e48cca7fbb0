"""Hugging Face checkpoint files read and written one tensor at a time, in float32, float16 or bfloat16.

    for name, array in read_tensors(directory, wanted):    # float32 numpy arrays, one at a time
    write_tensors(directory, tensors, dtype="bfloat16", max_shard_bytes=None)

A directory holds model.safetensors, or shards model-00001-of-0000n.safetensors listed by
model.safetensors.index.json ({"metadata": {"total_size": ...}, "weight_map": {name: file}}). A safetensors file
is an 8-byte little-endian header length, a JSON header {name: {"dtype", "shape", "data_offsets"}}, then the raw
little-endian bytes of each tensor. These functions read the header themselves rather than through the
safetensors package, whose numpy interface has no bfloat16 (numpy has no such type).

Conversions to float32 are exact, ±inf and NaN included: float16 by numpy's cast; bfloat16 is the top half of a
float32, so its 16 bits shifted left by 16 are the float32's bits. To bfloat16, the float32 bits are rounded to
the nearest even 16-bit value, and a NaN stays a (quiet) NaN rather than rounding into an infinity.
"""

import json
import os

import numpy

from gpt2_cupy import backend

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"F32": numpy.dtype("<f4"), "F16": numpy.dtype("<f2"), "BF16": numpy.dtype("<u2")}  # BF16 as its bits
NAMES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def bfloat16_bits_to_float32(bits):
    """uint16 bfloat16 bits -> float32, exactly."""
    return (bits.astype(numpy.uint32) << 16).view(numpy.float32)


def float32_to_bfloat16_bits(values):
    """float32 -> uint16 bfloat16 bits, rounded to nearest even; NaN kept NaN (its quiet bit set)."""
    bits = numpy.ascontiguousarray(values, dtype=numpy.float32).view(numpy.uint32)
    rounded = ((bits + numpy.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16).astype(numpy.uint16)
    quiet_nan = ((bits >> 16) | 0x0040).astype(numpy.uint16)
    return numpy.where(numpy.isnan(values), quiet_nan, rounded)


def _header(path):
    with open(path, "rb") as file:
        length = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(length))
    header.pop("__metadata__", None)
    return 8 + length, header


def files_of(directory):
    """{tensor name: file path} of a checkpoint directory, single-file or sharded."""
    index = os.path.join(directory, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as file:
            weight_map = json.load(file)["weight_map"]
        return {name: os.path.join(directory, shard) for name, shard in weight_map.items()}
    single = os.path.join(directory, SINGLE_FILE)
    if not os.path.exists(single):
        raise FileNotFoundError(f"{directory} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
    return {name: single for name in _header(single)[1]}


def read_tensors(directory):
    """(name, float32 numpy array) for every tensor of the checkpoint, read one at a time from its file.

    An unknown dtype is refused with a ValueError naming the tensor."""
    by_file = {}
    for name, path in files_of(directory).items():
        by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        start, header = _header(path)
        with open(path, "rb") as file:
            for name in names:
                if name not in header:
                    raise ValueError(f"{name}: listed in {INDEX_FILE} but not in {os.path.basename(path)}")
                entry = header[name]
                if entry["dtype"] not in DTYPES:
                    raise ValueError(f"{name}: dtype {entry['dtype']} in {os.path.basename(path)} is not one this "
                                     f"reader converts ({', '.join(DTYPES)})")
                dtype, shape = DTYPES[entry["dtype"]], tuple(entry["shape"])
                begin, end = entry["data_offsets"]
                if end - begin != dtype.itemsize * int(numpy.prod(shape)):
                    raise ValueError(f"{name}: {end - begin} bytes stored for shape {shape} in {entry['dtype']}")
                file.seek(start + begin)
                stored = numpy.fromfile(file, dtype=dtype, count=int(numpy.prod(shape))).reshape(shape)
                if entry["dtype"] == "BF16":
                    yield name, bfloat16_bits_to_float32(stored)
                else:
                    yield name, stored.astype(numpy.float32)  # float16 -> float32 is exact, inf and NaN too


def _encoded(array, dtype):
    array = numpy.asarray(backend.asnumpy(array), dtype=numpy.float32)  # a host copy of this one tensor
    if dtype == "bfloat16":
        return float32_to_bfloat16_bits(array)
    return array.astype(DTYPES[NAMES[dtype]])


def _write_file(path, tensors, dtype):
    """One safetensors file of tensors {name: float32 array} stored in dtype, written tensor by tensor."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, array in tensors.items():
        size = int(numpy.prod(array.shape)) * DTYPES[NAMES[dtype]].itemsize
        header[name] = {"dtype": NAMES[dtype], "shape": list(array.shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts on 8 bytes, as the safetensors package writes it
    with open(path, "wb") as file:
        file.write(len(encoded).to_bytes(8, "little"))
        file.write(encoded)
        for array in tensors.values():
            file.write(_encoded(array, dtype).tobytes())


def write_tensors(directory, tensors, dtype="float32", max_shard_bytes=None):
    """Write {name: float32 array, numpy or the backend's} as model.safetensors, or as shards of at most max_shard_bytes each (a tensor
    larger than that gets a shard of its own) with model.safetensors.index.json."""
    if dtype not in NAMES:
        raise ValueError(f"save_pretrained: dtype={dtype!r}; use one of {', '.join(NAMES)}")
    itemsize = DTYPES[NAMES[dtype]].itemsize
    shards, size = [{}], 0
    for name, array in tensors.items():
        nbytes = int(numpy.prod(array.shape)) * itemsize
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += nbytes
    for stale in (SINGLE_FILE, INDEX_FILE):
        if os.path.exists(os.path.join(directory, stale)):
            os.remove(os.path.join(directory, stale))
    if max_shard_bytes is None:
        _write_file(os.path.join(directory, SINGLE_FILE), shards[0], dtype)
        return
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        file_name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        _write_file(os.path.join(directory, file_name), shard, dtype)
        weight_map.update(dict.fromkeys(shard, file_name))
    total = sum(int(numpy.prod(a.shape)) * itemsize for a in tensors.values())
    with open(os.path.join(directory, INDEX_FILE), "w") as file:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, file, indent=2)
