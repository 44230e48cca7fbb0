"""Collectives between the processes of a data-parallel run, with torch.distributed's names.

    from gpt2_cupy import distributed as dist
    dist.init_process_group("nccl")             # rank and world size from RANK, WORLD_SIZE, LOCAL_RANK
    dist.all_reduce(grads, op=dist.ReduceOp.AVG)  # every rank's grads become the mean of all ranks' grads
    dist.reduce_scatter_tensor(shard, grads)    # rank r gets the sum of everyone's r-th slice
    dist.all_gather_into_tensor(params, shard)  # every rank gets every rank's slice, in rank order
    dist.broadcast(weights, src=0)              # every rank gets rank 0's values
    dist.destroy_process_group()

A collective takes backend arrays or Tensors (their arrays) of COLLECTIVE_DTYPES, contiguous, and
writes its result in place. Two groups stand behind the same calls, and nothing outside this module
knows which one it has:

    NcclGroup       one process per GPU, NCCL's communicator (cupy.cuda.nccl). A collective is queued on
                    the current stream, as a kernel is: the host does not wait for it. With async_op=True
                    it runs on the group's own stream instead, after what the current stream has queued,
                    and the returned Work's wait() makes the current stream wait for it (still no host wait).
    SimulatedGroup  N ranks as N threads of one process, for the CPU executor and the tests:
                    run_simulated(N, function) calls function(rank) on each, with generators of its own (as a
                    process has). A collective waits until every
                    rank has called it, then computes the result from every rank's arrays.

The NCCL unique id, the 128 bytes every rank needs to find the others, comes from the launcher
(gpt2_cupy.launch): the environment variable GPT2_CUPY_NCCL_ID, or the file named by
GPT2_CUPY_NCCL_ID_FILE, which rank 0 writes and the others wait for. No socket of our own.

What the simulated group guarantees: a sum is taken in rank order, ((r0 + r1) + r2) + ..., in the
arrays' dtype, and an average divides that sum by N: the same inputs give the same bits every run. NCCL's
ring adds in another fixed order (and NCCL_ALGO may change it), so the two agree to float32 rounding,
not bit for bit; each is deterministic run to run on the same machine and world size.
"""

import os
import threading
import time
from pathlib import Path

import numpy

from gpt2_cupy import backend
from gpt2_cupy.autograd import Tensor
from gpt2_cupy.random import use_own_random_state
from gpt2_cupy.data import write_atomically

ID_VARIABLE = "GPT2_CUPY_NCCL_ID"            # the unique id, as 256 hex digits
ID_FILE_VARIABLE = "GPT2_CUPY_NCCL_ID_FILE"  # or a file that rank 0 writes it into
ID_FILE_WAIT_SECONDS = 120


class ReduceOp:
    SUM = "sum"
    AVG = "avg"


class DistributedAborted(RuntimeError):
    """Raised in a rank that waits for a collective when another rank has failed: it will never come."""


_default_group = None          # the process's group (NCCL), set by init_process_group
_thread_group = threading.local()  # a simulated rank's group: each thread of run_simulated has its own


def _current_group():
    """A simulated rank's group inside run_simulated, else the process's; None before init_process_group."""
    return getattr(_thread_group, "group", None) or _default_group


def _group():
    group = _current_group()
    if group is None:
        raise RuntimeError("Default process group has not been initialized, please make sure to call "
                           "init_process_group.")
    return group


def is_initialized():
    return _current_group() is not None


def get_rank():
    return _group().rank


def get_world_size():
    return _group().world_size


def uses_nccl():
    """Whether this rank's collectives go through NCCL (else: a simulated rank)."""
    return isinstance(_group(), NcclGroup)


def _check_world_size(world_size):
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")


def _check_rank(rank, world_size):
    _check_world_size(world_size)
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size - 1}] for world_size {world_size}, got {rank!r}")


def _from_environment(name, value):
    if value is not None and value >= 0:
        return value
    if name not in os.environ:
        raise ValueError(f"init_process_group: no {name.lower()} given and no {name} in the environment "
                         "(start the ranks with `python -m gpt2_cupy.train --nproc N` or torchrun)")
    return int(os.environ[name])


def init_process_group(backend="nccl", init_method=None, world_size=-1, rank=-1):
    """Join the process group; rank and world_size default to RANK and WORLD_SIZE from the environment.

    Only "nccl" exists here, on a GPU: the CPU executor has no NCCL; there, run_simulated(N, function)
    runs N ranks in one process. init_method is accepted for torch's signature; the unique id always
    comes from the launcher (see the module's docstring).
    """
    global _default_group
    if backend != "nccl":
        raise ValueError(f"init_process_group: backend {backend!r} is not supported; use 'nccl'")
    if is_initialized():
        raise RuntimeError("trying to initialize the default process group twice!")
    world_size, rank = _from_environment("WORLD_SIZE", world_size), _from_environment("RANK", rank)
    _check_rank(rank, world_size)
    if not _on_gpu():
        raise RuntimeError("init_process_group('nccl') needs a GPU and CuPy; on the CPU executor use "
                           "gpt2_cupy.distributed.run_simulated(world_size, function)")
    _use_device(int(os.environ.get("LOCAL_RANK", rank)))
    _default_group = NcclGroup(rank, world_size, _unique_id(rank, world_size))


def _on_gpu():  # (init_process_group's argument `backend`, torch's name, hides the module of that name there)
    return backend.ON_GPU


def _use_device(index):
    backend.xp.cuda.Device(index).use()


def destroy_process_group():
    global _default_group
    if _default_group is not None:
        _default_group.close()
    _default_group = None


# ---- the collectives ---------------------------------------------------------------------------------------

# What the collectives take (bytes of any other dtype travel as uint8: DistributedDataParallel's buffers)
COLLECTIVE_DTYPES = ("float32", "float64", "int32", "uint8")


def _array(tensor_or_array, what):
    array = tensor_or_array._data if isinstance(tensor_or_array, Tensor) else tensor_or_array
    if not isinstance(array, backend.xp.ndarray):
        raise TypeError(f"{what}: expected a Tensor or a {backend.xp.__name__}.ndarray, got "
                        f"{type(tensor_or_array).__name__}")
    if array.dtype.name not in COLLECTIVE_DTYPES:
        raise TypeError(f"{what}: dtype {array.dtype} is not supported; use {', '.join(COLLECTIVE_DTYPES)}")
    if not array.flags.c_contiguous:
        raise ValueError(f"{what}: the array must be contiguous (collectives read and write flat memory)")
    return array


def _check_op(op):
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"op must be ReduceOp.SUM or ReduceOp.AVG, got {op!r}")


def all_reduce(tensor, op=ReduceOp.SUM, async_op=False):
    """tensor ← op over every rank's tensor, in place on every rank."""
    _check_op(op)
    return _group().all_reduce(_array(tensor, "all_reduce"), op, async_op)


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, async_op=False):
    """output (n) ← op over every rank's input[rank·n : (rank+1)·n]; input holds world_size·n elements.
    output may be that slice of input itself (in place, as llm.c's ZeRO does)."""
    _check_op(op)
    output, input = _array(output, "reduce_scatter_tensor"), _array(input, "reduce_scatter_tensor")
    _check_sizes("reduce_scatter_tensor", output.size, input.size)
    return _group().reduce_scatter(output, input, op, async_op)


def all_gather_into_tensor(output, input, async_op=False):
    """output[r·n : (r+1)·n] ← rank r's input (n), on every rank; input may be that slice of output."""
    output, input = _array(output, "all_gather_into_tensor"), _array(input, "all_gather_into_tensor")
    _check_sizes("all_gather_into_tensor", input.size, output.size)
    return _group().all_gather(output, input, async_op)


def reduce_scatter(output, input_list, op=ReduceOp.SUM, async_op=False):
    """torch's list form: output ← op over every rank's input_list[rank]. The list forms copy through one
    flat buffer and are done when they return (on a GPU: queued on the current stream), whatever async_op."""
    flat = backend.xp.concatenate([_array(t, "reduce_scatter").reshape(-1) for t in input_list])
    out = _array(output, "reduce_scatter")
    reduced = backend.xp.empty(out.size, dtype=out.dtype)
    reduce_scatter_tensor(reduced, flat, op)
    backend.copy_into(out, reduced.reshape(out.shape))


def all_gather(tensor_list, tensor, async_op=False):
    """torch's list form: tensor_list[r] ← rank r's tensor, on every rank (done when it returns)."""
    array = _array(tensor, "all_gather")
    if len(tensor_list) != get_world_size():
        raise ValueError(f"all_gather: tensor_list has {len(tensor_list)} entries for world_size {get_world_size()}")
    gathered = backend.xp.empty(array.size * len(tensor_list), dtype=array.dtype)
    all_gather_into_tensor(gathered, array)
    for r, destination in enumerate(tensor_list):
        backend.copy_into(_array(destination, "all_gather"), gathered[r * array.size:(r + 1) * array.size]
                          .reshape(array.shape))


def broadcast(tensor, src=0, async_op=False):
    """tensor ← rank src's tensor, on every rank."""
    _check_rank(src, get_world_size())
    return _group().broadcast(_array(tensor, "broadcast"), src, async_op)


def barrier():
    """Return when every rank has reached its barrier (on a GPU: and its queued work has finished)."""
    _group().barrier()


def _check_sizes(what, shard, whole):
    if shard * get_world_size() != whole:
        raise ValueError(f"{what}: the whole buffer must be world_size ({get_world_size()}) times the slice: "
                         f"{whole} elements for a slice of {shard}")


# ---- NCCL: one process per GPU ------------------------------------------------------------------------------

def _encode_id(unique_id):
    return bytes(value % 256 for value in unique_id).hex()


def _decode_id(text):
    return bytes.fromhex(text.strip())


def new_unique_id():
    """A fresh NCCL unique id as hex text (what the launcher hands to every rank)."""
    from cupy.cuda import nccl
    return _encode_id(nccl.get_unique_id())


def _unique_id(rank, world_size):
    if ID_VARIABLE in os.environ:
        return _decode_id(os.environ[ID_VARIABLE])
    if ID_FILE_VARIABLE in os.environ:
        path = Path(os.environ[ID_FILE_VARIABLE])
        if rank == 0:
            write_atomically(path, new_unique_id().encode("ascii"))  # the others never read half an id
        deadline = time.monotonic() + ID_FILE_WAIT_SECONDS
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}: rank 0 wrote no NCCL id into {path} in {ID_FILE_WAIT_SECONDS} s")
            time.sleep(0.05)
        return _decode_id(path.read_text())
    if world_size == 1:
        return _decode_id(new_unique_id())
    raise ValueError(f"no NCCL unique id: set {ID_VARIABLE} (the launcher does) or {ID_FILE_VARIABLE}")


class NcclWork:
    """A collective queued on the group's stream; wait() makes the current stream wait for it."""

    def __init__(self, done_event):
        self.done_event = done_event

    def wait(self):
        backend.xp.cuda.get_current_stream().wait_event(self.done_event)


class NcclGroup:
    def __init__(self, rank, world_size, unique_id):
        from cupy.cuda import nccl
        self.nccl, self.rank, self.world_size = nccl, rank, world_size
        try:
            self.communicator = nccl.NcclCommunicator(world_size, unique_id, rank)
        except TypeError:   # CuPy before 14 takes the id as a tuple of signed bytes
            signed = tuple(value - 256 if value > 127 else value for value in unique_id)
            self.communicator = nccl.NcclCommunicator(world_size, signed, rank)
        self.stream = backend.xp.cuda.Stream(non_blocking=True)  # where async collectives run
        self.types = {numpy.dtype(name): getattr(nccl, "NCCL_" + name.upper()) for name in COLLECTIVE_DTYPES}
        # ncclAvg (NCCL 2.10 and later) is 4; older CuPy releases do not name it
        self.ops = {ReduceOp.SUM: nccl.NCCL_SUM, ReduceOp.AVG: getattr(nccl, "NCCL_AVG", 4)}

    def _run(self, call, async_op):
        """call(stream pointer) on the current stream, or on the group's stream after the current one."""
        cuda = backend.xp.cuda
        if not async_op:
            call(cuda.get_current_stream().ptr)
            return None
        ready = cuda.Event(disable_timing=True)
        ready.record(cuda.get_current_stream())
        self.stream.wait_event(ready)  # the gradients are written before NCCL reads them
        call(self.stream.ptr)
        done = cuda.Event()  # timed: a bucket timeline (nn.parallel.BucketTimeline) reads when it completed
        done.record(self.stream)
        return NcclWork(done)

    def all_reduce(self, array, op, async_op):
        return self._run(lambda stream: self.communicator.allReduce(
            array.data.ptr, array.data.ptr, array.size, self.types[array.dtype], self.ops[op], stream), async_op)

    def reduce_scatter(self, output, input, op, async_op):
        return self._run(lambda stream: self.communicator.reduceScatter(
            input.data.ptr, output.data.ptr, output.size, self.types[input.dtype], self.ops[op], stream), async_op)

    def all_gather(self, output, input, async_op):
        return self._run(lambda stream: self.communicator.allGather(
            input.data.ptr, output.data.ptr, input.size, self.types[input.dtype], stream), async_op)

    def broadcast(self, array, src, async_op):
        return self._run(lambda stream: self.communicator.broadcast(
            array.data.ptr, array.data.ptr, array.size, self.types[array.dtype], src, stream), async_op)

    def barrier(self):
        token = backend.xp.zeros(1, dtype=numpy.float32)
        self.all_reduce(token, ReduceOp.SUM, False)
        backend.xp.cuda.get_current_stream().synchronize()

    def close(self):
        self.communicator.destroy()


# ---- simulated: N ranks as threads of one process -----------------------------------------------------------

class _Collective:
    """One collective as the ranks arrive at it: what each brought, and whether the result is written."""

    def __init__(self, kind, world_size):
        self.kind, self.arrivals, self.done = kind, [None] * world_size, False
        self.done_at = None  # time.perf_counter() when the last rank arrived and the result was written


class SimulatedWorld:
    """What the N simulated ranks share.

    One rank runs at a time (it holds `turn`) and hands over only while it waits for a collective, so the
    ranks never run kernels or touch the package's module state at the same time: the simulation is as
    deterministic as one process.
    """

    def __init__(self, world_size):
        self.world_size = world_size
        self.turn = threading.Lock()
        self.changed = threading.Condition()
        self.collectives = {}   # sequence number -> _Collective
        self.failure = None     # (rank, exception) of the first rank that failed
        self.finished = set()   # ranks whose function has returned: they will call no more collectives

    def arrive(self, rank, number, kind, arguments, compute):
        """Rank `rank` brings its arguments to collective `number`; the last to arrive computes the result."""
        with self.changed:
            collective = self.collectives.setdefault(number, _Collective(kind, self.world_size))
            if collective.kind != kind:
                raise RuntimeError(f"rank {rank} called {kind} as its collective #{number}, another rank called "
                                   f"{collective.kind}: every rank must call the same collectives in the same order")
            collective.arrivals[rank] = arguments
            if all(arrival is not None for arrival in collective.arrivals):
                compute(collective.arrivals)
                collective.done, collective.done_at = True, time.perf_counter()
                del self.collectives[number]
                self.changed.notify_all()
        return SimulatedWork(self, collective)

    def wait_for(self, collective):
        with self.changed:
            if collective.done:
                return
            self.turn.release()  # let the other ranks run up to this collective
            try:
                while not collective.done and self.failure is None and not self._never_arrives(collective):
                    self.changed.wait()
            finally:
                self.changed.release()
                self.turn.acquire()
                self.changed.acquire()
            if not collective.done and self.failure is None:
                raise RuntimeError(f"ranks {sorted(self._never_arrives(collective))} returned without calling "
                                   f"{collective.kind[0]}: every rank must call the same collectives")
            if not collective.done:
                rank, error = self.failure
                raise DistributedAborted(f"rank {rank} failed ({type(error).__name__}: {error}); this rank "
                                         "stopped waiting for it")

    def _never_arrives(self, collective):
        return {rank for rank in self.finished if collective.arrivals[rank] is None}

    def finish(self, rank):
        with self.changed:
            self.finished.add(rank)
            self.changed.notify_all()

    def fail(self, rank, error):
        with self.changed:
            if self.failure is None:
                self.failure = (rank, error)
            self.changed.notify_all()


class SimulatedWork:
    def __init__(self, world, collective):
        self.world, self.collective = world, collective

    def wait(self):
        self.world.wait_for(self.collective)


def _reduce(arrays, op):
    """The sum in rank order (the simulated group's guarantee), divided by N for AVG, in the arrays' dtype."""
    total = arrays[0].copy()
    for array in arrays[1:]:
        total += array
    if op == ReduceOp.AVG:
        total /= total.dtype.type(len(arrays))
    return total


class SimulatedGroup:
    """One rank's side of a SimulatedWorld: the same collectives as NcclGroup."""

    def __init__(self, world, rank):
        self.world, self.rank, self.world_size = world, rank, world.world_size
        self.calls = 0

    def _collective(self, kind, arguments, compute, async_op):
        work = self.world.arrive(self.rank, self.calls, kind, arguments, compute)
        self.calls += 1
        if async_op:
            return work
        work.wait()
        return None

    def all_reduce(self, array, op, async_op):
        def compute(arrays):
            total = _reduce(arrays, op)
            for array in arrays:
                array[...] = total
        return self._collective(("all_reduce", op, array.size), array, compute, async_op)

    def reduce_scatter(self, output, input, op, async_op):
        def compute(pairs):
            total = _reduce([whole for _, whole in pairs], op)  # every input read before any output is written
            for rank, (shard, _) in enumerate(pairs):
                shard[...] = total[rank * shard.size:(rank + 1) * shard.size].reshape(shard.shape)
        return self._collective(("reduce_scatter", op, input.size), (output, input), compute, async_op)

    def all_gather(self, output, input, async_op):
        def compute(pairs):
            shards = [shard.reshape(-1).copy() for _, shard in pairs]
            for whole, _ in pairs:
                whole.reshape(-1)[...] = backend.xp.concatenate(shards)
        return self._collective(("all_gather", input.size), (output, input), compute, async_op)

    def broadcast(self, array, src, async_op):
        def compute(arrays):
            source = arrays[src].copy()
            for array in arrays:
                array[...] = source
        return self._collective(("broadcast", src, array.size), array, compute, async_op)

    def barrier(self):
        self._collective(("barrier",), True, lambda arrivals: None, False)

    def close(self):
        pass


def run_simulated(world_size, function):
    """function(rank) on world_size simulated ranks (threads of this process); their results, in rank order.

    Inside function, get_rank(), get_world_size() and every collective act for that rank. When a rank
    raises, the ranks that wait for it stop with DistributedAborted, and this raises RuntimeError naming
    the rank that failed first, from its exception.
    """
    _check_world_size(world_size)
    world = SimulatedWorld(world_size)
    results, errors = [None] * world_size, [None] * world_size

    def rank_main(rank):
        _thread_group.group = SimulatedGroup(world, rank)
        with world.turn:
            try:
                use_own_random_state()  # a rank's generators are its own, as a process's are
                results[rank] = function(rank)
                world.finish(rank)
            except BaseException as error:  # noqa: B036 (KeyboardInterrupt too: the others must not hang)
                errors[rank] = error
                world.fail(rank, error)

    threads = [threading.Thread(target=rank_main, args=(rank,), name=f"rank {rank}") for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if world.failure is not None:
        rank, error = world.failure
        raise RuntimeError(f"rank {rank} failed: {type(error).__name__}: {error}") from error
    return results
