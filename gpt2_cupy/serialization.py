"""save and load with PyTorch's names: state dicts and checkpoint dicts in one file, loaded safely by default.

    gpt2_cupy.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 100}, path)
    checkpoint = gpt2_cupy.load(path, map_location="cpu")

The file is a pickle, as PyTorch's. Unpickling an arbitrary file can run any code it names, so load reads
with weights_only=True by default, as PyTorch does since 2.6: only Tensors, numpy arrays and scalars,
numbers, strings, bytes, None, and lists, tuples, dicts and sets of those. Anything else (a class, a
function, os.system) is refused with pickle.UnpicklingError before it is called. weights_only=False reads
any pickle: for files from a source you trust.

Tensors are stored as numpy arrays and come back on the active backend, whatever map_location says.
"""

import builtins
import collections
import io
import pickle

import numpy

from gpt2_cupy import backend
from gpt2_cupy.autograd import Tensor


def _rebuild_tensor(array, requires_grad):
    """What load calls for each stored Tensor: a Tensor on the active backend (the one allowed constructor)."""
    return Tensor(backend.xp.asarray(array), requires_grad=requires_grad)


def _rebuild_array(array):
    """What load calls for each stored backend array: the array on the active backend."""
    return backend.xp.asarray(array)


def _reduce_tensor(tensor):
    return _rebuild_tensor, (backend.asnumpy(tensor._data), tensor.requires_grad)


def _checked_dtype(*arguments):
    dtype = numpy.dtype(*arguments)
    if dtype.hasobject:
        raise pickle.UnpicklingError("load: an array of Python objects is not allowed with weights_only=True")
    return dtype


# What a weights-only file may name, each a constructor of plain data. numpy's array pickles name
# _reconstruct, ndarray and dtype (under numpy.core before numpy 2, numpy._core since).
_ALLOWED = {
    (__name__, "_rebuild_tensor"): _rebuild_tensor,
    (__name__, "_rebuild_array"): _rebuild_array,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): builtins.set,
    ("builtins", "frozenset"): builtins.frozenset,
    ("builtins", "slice"): builtins.slice,
    ("builtins", "complex"): builtins.complex,
    ("numpy", "ndarray"): numpy.ndarray,
    ("numpy", "dtype"): _checked_dtype,
}
for _module in ("numpy.core.multiarray", "numpy._core.multiarray"):
    _ALLOWED[(_module, "_reconstruct")] = numpy.zeros(0).__reduce__()[0]
    _ALLOWED[(_module, "scalar")] = numpy.float32(0).__reduce__()[0]
for _module in ("numpy.dtypes",):
    for _name in ("Float32DType", "Float64DType", "Float16DType", "Int64DType", "Int32DType", "Int16DType",
                  "Int8DType", "UInt8DType", "UInt16DType", "UInt32DType", "UInt64DType", "BoolDType"):
        if hasattr(numpy.dtypes, _name):
            _ALLOWED[(_module, _name)] = getattr(numpy.dtypes, _name)


class _WeightsOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        raise pickle.UnpicklingError(
            f"Weights only load failed: the file names {module}.{name}, which is not a tensor, an array or plain "
            "data; unpickling it could run code. Load it with weights_only=False only if you trust its source.")


class _TensorPickler(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, Tensor):
            return _reduce_tensor(obj)
        if isinstance(obj, backend.xp.ndarray) and backend.xp is not numpy:
            return _rebuild_array, (backend.asnumpy(obj),)  # a device array is stored as its numpy copy
        return NotImplemented


def save(obj, f):
    """Write obj (a state dict, a checkpoint dict, Tensors, arrays, numbers) to a path or a binary file."""
    if isinstance(f, (str, bytes)) or hasattr(f, "__fspath__"):
        with open(f, "wb") as file:
            _TensorPickler(file, protocol=4).dump(obj)
    else:
        _TensorPickler(f, protocol=4).dump(obj)


def load(f, map_location=None, weights_only=True):
    """Read what save wrote. weights_only=True (the default) refuses any file that would run code."""
    del map_location  # every Tensor comes back on the active backend
    if isinstance(f, (str, bytes)) or hasattr(f, "__fspath__"):
        with open(f, "rb") as file:
            data = file.read()
    else:
        data = f.read()
    if weights_only:
        return _WeightsOnlyUnpickler(io.BytesIO(data)).load()
    return pickle.loads(data)
