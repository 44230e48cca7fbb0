"""Random numbers, as torch.random: Generator, manual_seed, seed, initial_seed, get_rng_state, set_rng_state.

A Generator holds two streams that one seed starts:
    numpy's PCG64       the host stream: initial weights, randn, rand, randint, randperm, multinomial, normal_,
                        uniform_ (drawn on the host, then copied to the backend, so that the same seed gives the
                        same numbers on a GPU and on the CPU executor)
    (seed, offset)      dropout's counter-based Philox stream on the device: a mask is the Philox numbers at
                        offset, offset + 1, ...; each dropout call moves the offset on by what it drew

The default generator (torch.default_generator) is what every function without generator= draws from;
manual_seed(s) seeds it and returns it, as PyTorch's does. A function that takes generator= draws from that
generator instead and leaves the default one untouched.

get_state() is a uint8 tensor (PyTorch's ByteTensor) that set_state() takes back: the seed, the PCG64 state
and dropout's offset, so that a restored generator repeats the numbers that followed the save.
"""

import contextlib
import copy
import threading

import numpy

from gpt2_cupy import backend
from gpt2_cupy.autograd import Tensor

# PyTorch's default seed, the one a generator has before anyone seeds it
DEFAULT_SEED = 67280421310721
_STATE_FIELDS = 7  # seed, PCG64's state and increment (two 64-bit halves each), has_uint32, uinteger
_UINT64_MASK = (1 << 64) - 1


class Generator:
    """torch.Generator: Generator(device="cpu"); device "cpu" or "cuda" both name the active backend."""

    def __init__(self, device="cpu", _dropout_holder=None):
        self.device = device
        # dropout's (seed, offset) device array, under "rng": for the default generator the module's
        # _dropout_state, which a CUDA graph's capture on the CPU swaps for an array that records copies
        self._holder = {} if _dropout_holder is None else _dropout_holder
        self.manual_seed(DEFAULT_SEED)

    def manual_seed(self, seed):
        """Restart both streams from seed (any int; taken modulo 2⁶⁴ as PyTorch's). Returns self."""
        seed = int(seed) & _UINT64_MASK
        self._seed = seed
        self.numpy = numpy.random.Generator(numpy.random.PCG64(seed))
        self._holder["rng"] = backend.xp.array([seed, 0], dtype=numpy.uint64)
        return self

    def seed(self):
        """Seed from the operating system's entropy; returns the seed chosen."""
        seed = int(numpy.random.SeedSequence().generate_state(1, numpy.uint64)[0])
        self.manual_seed(seed)
        return seed

    def initial_seed(self):
        return self._seed

    def dropout_state(self):
        """The (seed, offset) device array dropout reads and advances."""
        return self._holder["rng"]

    def get_state(self):
        """A uint8 Tensor of the whole state (seed, PCG64's state, dropout's offset)."""
        pcg = self.numpy.bit_generator.state["state"]
        has_uint32 = self.numpy.bit_generator.state["has_uint32"]
        uinteger = self.numpy.bit_generator.state["uinteger"]
        offset = int(backend.asnumpy(self.dropout_state())[1])
        words = [self._seed, pcg["state"] & _UINT64_MASK, pcg["state"] >> 64, pcg["inc"] & _UINT64_MASK,
                 pcg["inc"] >> 64, has_uint32, uinteger, offset]
        return Tensor(backend.xp.asarray(numpy.array(words, dtype=numpy.uint64).view(numpy.uint8)))

    def set_state(self, new_state):
        """Restore a state get_state() returned."""
        array = backend.asnumpy(getattr(new_state, "_data", new_state))
        if array.dtype != numpy.uint8 or array.size != 8 * (_STATE_FIELDS + 1):
            raise RuntimeError("RNG state must be a torch.ByteTensor returned by get_state()")
        words = [int(w) for w in numpy.ascontiguousarray(array).view(numpy.uint64)]
        seed, state_low, state_high, inc_low, inc_high, has_uint32, uinteger, offset = words
        self.manual_seed(seed)
        self.numpy.bit_generator.state = {
            "bit_generator": "PCG64", "has_uint32": has_uint32, "uinteger": uinteger,
            "state": {"state": state_low | (state_high << 64), "inc": inc_low | (inc_high << 64)}}
        self.dropout_state()[...] = backend.xp.asarray(numpy.array([seed, offset], dtype=numpy.uint64))
        return self


default_generator = Generator(_dropout_holder={})
_own = threading.local()  # .generator: the default generator of a thread that called use_own_random_state


def current_generator():
    """The default generator this thread draws from: the process's, or a simulated rank's own."""
    own = getattr(_own, "generator", None)
    return default_generator if own is None else own


class _CurrentDropoutState:
    """Dropout's state as the current thread's default generator holds it ("rng": its (seed, offset) array, which
    a CUDA graph's capture on the CPU swaps for an array that records copies)."""

    def _holder(self):
        return current_generator()._holder

    def __getitem__(self, key):
        return self._holder()[key]

    def __setitem__(self, key, value):
        self._holder()[key] = value

    def __contains__(self, key):
        return key in self._holder()

    def get(self, key, default=None):
        return self._holder().get(key, default)


_dropout_state = _CurrentDropoutState()


def use_own_random_state():
    """From now on this thread draws from a default generator of its own, a copy of the process's: a simulated
    rank (a thread of distributed.run_simulated) seeds and advances it as a process of its own would."""
    own = copy.copy(default_generator)
    own.numpy = copy.deepcopy(default_generator.numpy)
    own._holder = {"rng": default_generator.dropout_state().copy()}
    _own.generator = own


def manual_seed(seed):
    """Seed the default generator (initial weights, random factories, dropout's masks); returns it."""
    return current_generator().manual_seed(seed)


def seed():
    return current_generator().seed()


def initial_seed():
    return current_generator().initial_seed()


def get_rng_state():
    return current_generator().get_state()


def set_rng_state(new_state):
    current_generator().set_state(new_state)


def init_generator():
    """The numpy generator that nn's layers draw their initial weights from (seeded by manual_seed)."""
    return current_generator().numpy


def dropout_rng_state():
    """The (seed, offset) device array of dropout's generator."""
    return current_generator().dropout_state()


# ---- dropout under data parallelism: a rank's rows are a part of the global batch ------------------------------
_batch_part = threading.local()  # .place: (index, parts), this thread's rows' place in the global batch


@contextlib.contextmanager
def dropout_batch_part(index, parts):
    """Inside the block this thread's batch is part `index` of `parts` equal parts of a global batch, along the
    leading axis of every tensor that dropout drops (rank `index` of `parts` under data parallelism): each
    dropout draws the random numbers of its elements' places in the global tensor, and moves the generator past
    all the parts, so that the parts together draw what one process draws for the whole batch."""
    if not 0 <= index < parts:
        raise ValueError(f"dropout_batch_part: index must be in [0, {parts - 1}], got {index}")
    previous = getattr(_batch_part, "place", (0, 1))
    _batch_part.place = (index, parts)
    try:
        yield
    finally:
        _batch_part.place = previous


def dropout_draw(count):
    """(start, advance) of a dropout over `count` elements of this thread's batch: the stream index of its first
    element, and how far the generator's offset moves past it (count, or the whole global batch's)."""
    index, parts = getattr(_batch_part, "place", (0, 1))
    return index * count, parts * count


def host_stream(generator=None):
    """The numpy generator to draw from: generator's, or the default generator's."""
    if generator is not None and not isinstance(generator, Generator):
        raise TypeError(f"generator must be a torch.Generator, not {type(generator).__name__}")
    return (current_generator() if generator is None else generator).numpy
