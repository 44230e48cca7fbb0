"""CUDA graphs: record a step's kernel launches once, then replay them without Python, as PyTorch's.

    g = gpt2_cupy.cuda.CUDAGraph()
    pool = graph_pool_handle()              # the memory the graph's buffers come from
    with use_pool(pool):                    # warm-up: the step once, eagerly, so that its buffers exist
        loss = step(static_inputs)
    with gpt2_cupy.cuda.graph(g, pool=pool):   # capture: the kernels are recorded, not run
        loss = step(static_inputs)
    static_inputs[...] = next_batch         # (backend.copy_into) new values into the same buffers
    g.replay()                              # every recorded launch again, on the same buffers
    print(float(loss))                      # read after the replay

Why: launched one by one from Python, a kernel costs microseconds of Python and driver time; replayed from
a captured graph, several times less (bench/design_choices.json). GPT-2 launches about a hundred kernels per
layer and step.

What a graph holds is launches with their arguments: the same device addresses, grid sizes and scalar
arguments at every replay. So everything that changes from one replay to the next must live in device
memory that the host (or the graph itself) rewrites: the input batch, the learning rate, the step count,
dropout's Philox offset. Inside capture nothing runs, so the host cannot read a value there: a host copy or
a synchronisation raises RuntimeError naming the call (backend.asnumpy, .item(), float(), print(tensor)).

Memory, as PyTorch manages it: a graph owns a private memory pool (or shares one, pool=...), and every
array made during the warm-up and the capture comes from it. At a replay the kernels write to the addresses
they were captured with, so those blocks must never be handed to anyone else: outside use_pool and the
capture, nobody allocates from the pool. A capture that needs memory the warm-up did not leave in the pool
raises RuntimeError with the number of bytes: everything must be allocated before capture.

On the GPU (CuPy) the capture runs on the pool's own stream, made current for the block, so that every
CuPy call and RawKernel launch in it is recorded by CUDA's stream capture; the warm-up runs on that stream
too, since CuPy's pool keeps freed blocks per stream. Capture mode "global" (PyTorch's default): any call
that could synchronise or allocate with cudaMalloc, from any thread, fails the capture at once, so a
forbidden call is found at capture, named, instead of leaving a graph that is quietly wrong. "relaxed" lets
such calls through (cudaMalloc then grows the pool); the growth still raises here.

On the CPU executor the same API records instead: backend's RawKernel and RawModule functions, fill_zero and
copy_into append to a Recording, and replay() runs it in order. numpy calls made through backend.xp that
return a new array (xp.zeros, xp.concatenate, xp.ascontiguousarray...) or write into an argument are
recorded as well, as CuPy's would be on a GPU; a call that writes into its out= argument is recorded and not
run at capture, as a kernel launch is, so the capture leaves that array as it found it, as a GPU's does.
What cannot be recorded is numpy's array methods and
operators (a.copy(), a.fill(0), a[...] = b, a += b): they run once, at capture, and never again. Step code
uses backend.fill_zero and backend.copy_into instead; a test that compares graph and eager results finds
what slips through. The pool's stand-in on the CPU: the sizes of the arrays made during the warm-up; an
array of a size the warm-up never made raises at capture, as a pool growth would on a GPU.
"""

import contextlib
import functools
import gc

import numpy

from gpt2_cupy import backend, random

CAPTURE_ERROR_MODES = {"global": 0, "thread_local": 1, "relaxed": 2}  # CUDA's cudaStreamCaptureMode values
POOL_ROUNDING = 512  # bytes: CuPy's pool hands out blocks in multiples of 512


def is_current_stream_capturing():
    """True while a graph is being captured (torch.cuda.is_current_stream_capturing): a check that would
    read the device (an id range, a NaN test) cannot run then."""
    return backend._capturing


class CUDAGraph:
    """torch.cuda.CUDAGraph: one captured sequence of launches, replayed with replay().

    capture_begin(pool=None, capture_error_mode="global") / capture_end() bracket the capture (the `graph`
    context manager calls them); replay() runs it; reset() forgets it; pool() is its memory pool, to share
    with another graph (graph(g2, pool=g1.pool())).
    """

    def __init__(self):
        self._captured = None   # a cupy.cuda.graph.Graph, or the CPU's Recording
        self._pool = None
        self._capture = None    # what capture_end must undo

    def pool(self):
        if self._pool is None:
            raise RuntimeError("CUDAGraph.pool(): the graph has no pool before capture_begin")
        return self._pool

    def capture_begin(self, pool=None, capture_error_mode="global", stream=None):
        if capture_error_mode not in CAPTURE_ERROR_MODES:
            raise ValueError(f"capture_error_mode={capture_error_mode!r}; use one of {tuple(CAPTURE_ERROR_MODES)}")
        if backend._capturing:
            raise RuntimeError("capture_begin: another graph is being captured; captures do not nest")
        if self._captured is not None:
            raise RuntimeError("capture_begin: this CUDAGraph holds a capture already; call reset() first")
        if pool is not None and not isinstance(pool, GraphPool):
            raise TypeError(f"pool must come from graph_pool_handle() or another graph's pool(), "
                            f"not {type(pool).__name__}")
        self._pool = GraphPool() if pool is None else pool
        self._pool.may_grow = capture_error_mode == "relaxed"
        begin = _begin_cuda_capture if backend.ON_GPU else _begin_cpu_capture
        self._capture = begin(self._pool, capture_error_mode, stream)

    def capture_end(self):
        """End the capture; the graph can be replayed from now on."""
        if self._capture is None:
            raise RuntimeError("capture_end: no capture was begun")
        capture, self._capture = self._capture, None
        self._captured = capture.end()

    def _abandon_capture(self):
        """End a capture that failed, leaving the backend as it was before capture_begin."""
        if self._capture is not None:
            capture, self._capture = self._capture, None
            capture.abandon()

    def replay(self):
        """Run the captured launches again (on a GPU, on the current stream, without waiting for them)."""
        if self._captured is None:
            raise RuntimeError("replay: nothing captured; capture with `with gpt2_cupy.cuda.graph(g): ...` first")
        if backend._capturing:
            raise RuntimeError("replay inside CUDA graph capture: replay graphs outside `with graph(...)` blocks")
        if backend.ON_GPU:
            self._captured.launch(backend.xp.cuda.get_current_stream())
        else:
            self._captured.replay()

    def reset(self):
        """Forget the capture (its pool's memory stays with the pool)."""
        self._captured = None

    def __repr__(self):
        state = "captured" if self._captured is not None else "empty"
        return f"CUDAGraph({state}, {'cuda' if backend.ON_GPU else 'cpu'})"


class graph:
    """torch.cuda.graph: `with graph(g, pool=None, stream=None, capture_error_mode="global"):` captures
    the block into g. Nothing in the block runs; a call that cannot be captured raises RuntimeError that
    says what it was, and g stays empty.

    pool: a graph_pool_handle() or another graph's pool(), else a new one. stream (GPU): the stream to
    capture on, by default the pool's, which use_pool warms up on (CuPy's pool keeps freed blocks per
    stream, so a capture on another stream finds none of them).
    """

    def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode="global"):
        if not isinstance(cuda_graph, CUDAGraph):
            raise TypeError(f"graph: expected a CUDAGraph, got {type(cuda_graph).__name__}")
        self.cuda_graph, self.pool, self.stream, self.capture_error_mode = cuda_graph, pool, stream, capture_error_mode

    def __enter__(self):
        if backend._capturing:
            raise RuntimeError("graph: another graph is being captured; captures do not nest")
        backend.synchronize()  # what is already queued runs before the capture, outside it
        self.cuda_graph.capture_begin(self.pool, self.capture_error_mode, self.stream)
        return self.cuda_graph

    def __exit__(self, kind, error, traceback):
        if error is None:
            self.cuda_graph.capture_end()
            return False
        self.cuda_graph._abandon_capture()
        translated = _capture_error(error)
        if translated is not None:
            raise translated from error
        return False


class GraphPool:
    """The memory of one or more graphs (torch.cuda.graph_pool_handle()); use_pool(pool) for the warm-up.

    On a GPU: a CuPy MemoryPool and the stream that warm-ups and captures run on. On the CPU: the rounded
    sizes of the arrays made in it so far, the stand-in for the blocks a GPU pool would hold.
    """

    def __init__(self):
        if backend.ON_GPU:
            cupy = backend.xp
            self.memory = cupy.cuda.MemoryPool()
            self.stream = cupy.cuda.Stream(non_blocking=True)
        else:
            self.sizes = set()

    may_grow = False   # set by capture_begin: a "relaxed" capture may take new device memory into the pool

    def malloc(self, size):
        """CuPy's allocator while the pool is in use: a block from the pool; inside a capture, a new one only
        in "relaxed" mode (cudaMalloc is refused in the others). Either way the block stays the pool's."""
        if not backend._capturing or self.may_grow:
            return self.memory.malloc(size)
        reserved = self.memory.total_bytes()
        try:
            memory = self.memory.malloc(size)
        except backend.xp.cuda.runtime.CUDARuntimeError as error:  # cudaMalloc refused under capture
            raise _growth_error(size, f"{reserved} bytes reserved, none of them free for it") from error
        if self.memory.total_bytes() > reserved:
            raise _growth_error(size, f"{reserved} bytes reserved before, none of them free for it")
        return memory

    def note(self, nbytes):
        """CPU: an array of nbytes was made in the pool (outside capture) or is wanted (inside)."""
        if nbytes == 0:
            return
        rounded = -(-nbytes // POOL_ROUNDING) * POOL_ROUNDING
        if backend._capturing and not self.may_grow and rounded not in self.sizes:
            raise _growth_error(nbytes, "the warm-up made no array of that size")
        self.sizes.add(rounded)


def graph_pool_handle():
    """A new memory pool to share between graphs: graph(g1, pool=p) and graph(g2, pool=p) (PyTorch's name).

    Graphs that share a pool may use the same memory for their temporaries: replay them one after the other
    on one stream, never at the same time. An array that one graph leaves for another (a loss, a norm) must
    stay referenced from Python from its capture on, or its block could become another graph's temporary.
    """
    return GraphPool()


@contextlib.contextmanager
def use_pool(pool):
    """Run the block eagerly with pool's memory (on a GPU, also on pool's stream): the warm-up before capture."""
    if backend._capturing:
        raise RuntimeError("use_pool inside capture: warm up before the capture")
    if backend.ON_GPU:
        cupy = backend.xp
        caller = cupy.cuda.get_current_stream()
        pool.stream.wait_event(caller.record())
        try:
            with pool.stream, cupy.cuda.using_allocator(pool.malloc):
                yield pool
        finally:
            caller.wait_event(pool.stream.record())
    else:
        previous = backend.xp
        backend.set_array_module(_NumpyThatNotes(lambda call: _note_new_arrays(pool, call)))
        try:
            yield pool
        finally:
            backend.set_array_module(previous)


def _growth_error(nbytes, why):
    return RuntimeError(
        f"new memory inside CUDA graph capture: {nbytes} bytes that the graph's memory pool does not hold "
        f"({why}). Everything a captured step uses must exist before capture: run the same code once, "
        "eagerly, inside gpt2_cupy.graphs.use_pool(pool) (the warm-up), then capture with "
        "graph(g, pool=pool); or allocate the buffer before the capture.")


def _capture_error(error):
    """CuPy's stream-capture errors as a RuntimeError that says what they mean; None for other errors."""
    if not backend.ON_GPU:
        return None
    if isinstance(error, backend.xp.cuda.runtime.CUDARuntimeError):
        if "Capture" not in str(error):  # cudaErrorStreamCaptureUnsupported, ...Invalidated, ...Implicit, ...
            return None
    elif not (type(error) is RuntimeError and "stream is capturing" in str(error)):
        return None  # CuPy refuses its own device-to-host copies with "the current stream is capturing, ..."
    return RuntimeError(
        f"CUDA graph capture failed ({error}): capture forbids host copies and synchronisation, and the block "
        "made one: int(), float() or bool() of a device array, .item(), .get(), print of a tensor, a check "
        "that reads device values (ids in range, no NaN), a new cudaMalloc... The call is in the traceback "
        "above. Read values after g.replay(), or skip the check while "
        "gpt2_cupy.graphs.is_current_stream_capturing().")


# ---- the GPU: CUDA stream capture through CuPy --------------------------------------------------------------

class _CudaCapture:
    """A capture in progress on a stream, and what to put back when it ends."""

    def __init__(self, stream, undo, gc_was_enabled):
        self.stream, self.undo, self.gc_was_enabled = stream, undo, gc_was_enabled

    def end(self):
        try:
            return self.stream.end_capture()
        except backend.xp.cuda.runtime.CUDARuntimeError as error:
            translated = _capture_error(error)
            raise (translated or error) from error
        finally:
            self._restore()

    def abandon(self):
        try:
            self.stream.end_capture()  # an invalidated capture still has to be ended; its error is expected
        except Exception:  # noqa: BLE001  (the block's own error is the one to report)
            pass
        finally:
            self._restore()

    def _restore(self):
        backend.set_capture(None)
        self.undo.close()
        if self.gc_was_enabled:
            gc.enable()


def _begin_cuda_capture(pool, capture_error_mode, stream):
    cupy = backend.xp
    stream = pool.stream if stream is None else stream
    stream.wait_event(cupy.cuda.get_current_stream().record())  # the capture comes after queued work
    # A garbage collection inside the capture could free an object whose __del__ makes a forbidden call
    # (destroying a stream or an event): collect now, and not again until the capture ends.
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    undo = contextlib.ExitStack()
    undo.enter_context(stream)                                      # current for the block
    undo.enter_context(cupy.cuda.using_allocator(pool.malloc))      # every allocation from the pool
    try:
        backend.set_capture(True)
        stream.begin_capture(CAPTURE_ERROR_MODES[capture_error_mode])
    except BaseException:
        backend.set_capture(None)
        undo.close()
        if gc_was_enabled:
            gc.enable()
        raise
    return _CudaCapture(stream, undo, gc_was_enabled)


# ---- the CPU executor: a recording of launches, fills, copies and numpy calls ----------------------------

class Recording:
    """What a CPU capture recorded, in order; replay() runs it. Holds every array its steps use, so their
    memory lives as long as the graph does (on a GPU the private pool keeps it)."""

    def __init__(self, pool):
        self.pool = pool
        self.steps = []
        self.array_module = _NumpyThatNotes(self._numpy_call, record_only_out=True)

    def launch(self, kernel, grid, block, args, shared_mem, checks_wanted):
        self.steps.append(functools.partial(kernel, grid, block, tuple(args), shared_mem, **checks_wanted))

    def fill_zero(self, array):
        self.steps.append(functools.partial(array.fill, 0))

    def copy_into(self, dst, src):
        self.steps.append(functools.partial(numpy.copyto, dst, src))

    def replay(self):
        for step in self.steps:
            step()

    def _numpy_call(self, call):
        """A call of backend.xp during capture: record it when it made new arrays or wrote into an argument."""
        function, args, kwargs, result = call
        if result is None or "out" in kwargs:  # it wrote into one of its arguments: run it again
            self.steps.append(functools.partial(function, *args, **kwargs))
            return
        made, results = _new_arrays(call), _results(result)
        for index in made:
            self.pool.note(results[index].nbytes)
        if function in (numpy.empty, numpy.empty_like) or not made:
            return  # no values to make again (nothing in them yet, or views and numbers)

        def again():  # the call once more, its new results copied into the arrays the capture handed out
            results_now = _results(function(*args, **kwargs))
            for index in made:
                numpy.copyto(results[index], results_now[index])

        self.steps.append(again)


class _NumpyThatNotes:
    """numpy in backend.xp's place on the CPU during a warm-up or a capture: every call of one of its
    functions (and of their attributes: xp.add.at) is passed to on_call(function, args, kwargs, result).
    record_only_out (a capture): a call with an out= argument is not run, only passed on with result None."""

    def __init__(self, on_call, record_only_out=False):
        self._on_call, self._record_only_out = on_call, record_only_out

    def __getattr__(self, name):
        return _noted(getattr(numpy, name), self._on_call, self._record_only_out)


def _noted(value, on_call, record_only_out):
    if not callable(value) or isinstance(value, type):  # xp.ndarray, xp.float32, xp.random, xp.pi...
        return value
    return _NotedFunction(value, on_call, record_only_out)


class _NotedFunction:
    def __init__(self, function, on_call, record_only_out):
        self._function, self._on_call, self._record_only_out = function, on_call, record_only_out

    def __call__(self, *args, **kwargs):
        if self._record_only_out and "out" in kwargs:
            self._on_call((self._function, args, kwargs, None))   # run at each replay, not now
            return kwargs["out"]
        result = self._function(*args, **kwargs)
        self._on_call((self._function, args, kwargs, result))
        return result

    def __getattr__(self, name):
        return _noted(getattr(self._function, name), self._on_call, self._record_only_out)


def _results(result):
    return list(result) if isinstance(result, (tuple, list)) else [result]


def _new_arrays(call):
    """Which results of a numpy call are new arrays (not views of an argument): their indices."""
    function, args, kwargs, result = call
    inputs = [a for a in list(args) + list(kwargs.values()) for a in (a if isinstance(a, (tuple, list)) else (a,))
              if isinstance(a, numpy.ndarray)]
    return [index for index, value in enumerate(_results(result))
            if isinstance(value, numpy.ndarray) and not any(numpy.may_share_memory(value, a) for a in inputs)]


def _note_new_arrays(pool, call):
    results = _results(call[3])
    for index in _new_arrays(call):
        pool.note(results[index].nbytes)


class _DropoutStateThatRecordsCopies(numpy.ndarray):
    """Dropout's (seed, offset) array while a CPU graph captures. Its Function keeps the state of each
    call with the array method .copy() (nn.functional.Dropout), which a recording cannot see; this view
    of the same memory records that copy, so that every replay draws from the offset the graph has
    advanced to, as the copy on a GPU's capturing stream does."""

    def copy(self, order="C"):
        copied = numpy.empty(self.shape, dtype=self.dtype)
        backend.copy_into(copied, self.view(numpy.ndarray))
        return copied


class _CpuCapture:
    def __init__(self, recording, array_module, dropout_state):
        self.recording, self.array_module, self.dropout_state = recording, array_module, dropout_state

    def end(self):
        self._restore()
        return self.recording

    def abandon(self):
        self._restore()

    def _restore(self):
        backend.set_capture(None)
        backend.set_array_module(self.array_module)
        if self.dropout_state is not None:
            random._dropout_state["rng"] = self.dropout_state


def _begin_cpu_capture(pool, capture_error_mode, stream):
    recording = Recording(pool)
    previous_array_module = backend.xp
    dropout_state = random._dropout_state.get("rng")
    if dropout_state is not None:
        random._dropout_state["rng"] = dropout_state.view(_DropoutStateThatRecordsCopies)
    backend.set_capture(recording)
    backend.set_array_module(recording.array_module)
    return _CpuCapture(recording, previous_array_module, dropout_state)
