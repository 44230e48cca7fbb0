"""Start one process per GPU, as torchrun does: `python -m gpt2_cupy.train --nproc 4 ...` calls launch().

Each rank is the same command with its own environment: RANK and LOCAL_RANK (0 to N-1, one machine),
WORLD_SIZE (N), and GPT2_CUPY_NCCL_ID, the NCCL unique id the launcher made, which every rank hands to
NCCL to find the others (gpt2_cupy.distributed). Rank r uses GPU r (LOCAL_RANK).

No rank is left hanging: when one exits with an error, the others are stopped (their NCCL calls would
wait forever for it) and ChildFailedError names that rank; Ctrl-C stops them all. Each rank runs in its own
session (process group), so the terminal's Ctrl-C reaches the launcher alone, which then stops every
rank at the same moment, compilers and other children of the ranks included.
"""

import contextlib
import os
import signal
import subprocess
import threading
import time

from gpt2_cupy import backend, distributed

POLL_SECONDS = 0.1
GRACE_SECONDS = 10  # after SIGTERM, how long a rank may take to exit before SIGKILL


class ChildFailedError(RuntimeError):
    """A rank exited with an error (torchrun's name); .rank and .exit_code say which and how."""

    def __init__(self, rank, exit_code):
        self.rank, self.exit_code = rank, exit_code
        how = f"was killed by signal {-exit_code}" if exit_code < 0 else f"exited with code {exit_code}"
        super().__init__(f"rank {rank} {how}; the other ranks were stopped (its error is above, in its output)")


def rank_environment(rank, world_size, unique_id=None):
    environment = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size)}
    if unique_id is not None:
        environment[distributed.ID_VARIABLE] = unique_id
    return environment


def launch(command, nproc):
    """Run command (a list, as for subprocess) as nproc ranks; return when all have exited with 0."""
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive int, got {nproc!r}")
    unique_id = os.environ.get(distributed.ID_VARIABLE)
    if unique_id is None and backend.ON_GPU:
        unique_id = distributed.new_unique_id()
    with ctrl_c_as_a_flag() as interrupted:
        ranks = [subprocess.Popen(command, env={**os.environ, **rank_environment(rank, nproc, unique_id)},
                                  start_new_session=True) for rank in range(nproc)]
        try:
            while not interrupted:
                for rank, process in enumerate(ranks):
                    exit_code = process.poll()
                    if exit_code not in (None, 0):
                        raise ChildFailedError(rank, exit_code)
                if all(process.returncode == 0 for process in ranks):
                    return
                time.sleep(POLL_SECONDS)
            raise KeyboardInterrupt
        finally:   # a rank's failure, Ctrl-C, or any other error in the launcher
            stop(ranks)


@contextlib.contextmanager
def ctrl_c_as_a_flag():
    """Inside the block, Ctrl-C (SIGINT) appends to the yielded list instead of raising KeyboardInterrupt
    wherever the launcher happens to be: raised inside subprocess's poll(), it could leave that process's lock
    taken, and stop()'s wait for it would then hang. Outside the main thread (where no handler can be set)
    Ctrl-C keeps its usual effect."""
    interrupted = []
    if threading.current_thread() is not threading.main_thread():
        yield interrupted
        return
    previous = signal.signal(signal.SIGINT, lambda number, frame: interrupted.append(number))
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)


def stop(ranks):
    """SIGTERM every rank's process group still running, then SIGKILL what is left after GRACE_SECONDS."""
    for process in ranks:
        if process.poll() is None:
            _signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    for process in ranks:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(process, signal.SIGKILL)
            process.wait()


def _signal_group(process, number):
    try:
        os.killpg(process.pid, number)
    except ProcessLookupError:  # already gone
        pass
