"""Timing kernels on a GPU, and the device's measured ceilings to compare them with.

Timings mean something only on a GPU: on the CPU executor `meaningful()` is False, and the chapters plot the
results a GPU stored in bench/NAME.json instead. Each bench/NAME.py (`python -m bench.NAME` on a GPU) times
with seconds_per_call and ends with report(), which prints its table (bandwidth_rows() writes the lines of
GB/s against the copy) and writes that file.
"""

import datetime
import json
from functools import lru_cache
from pathlib import Path

import numpy

from . import backend


def meaningful():
    """Whether timings here say anything about a GPU kernel."""
    return backend.name == "cuda"


def seconds_per_call(run, warmup=3, repeat=20):
    """Median seconds of one run() call, timed with CUDA events: the one timing wrapper of the package.

    A short kernel finishes before Python has launched the next one, so timing calls one by one would
    count Python's launch time as GPU time. Each timing therefore covers as many calls back to back as
    fill about a millisecond.
    """
    if not meaningful():
        raise RuntimeError("timings on the CPU executor do not say anything about a GPU: run this on a GPU")
    cupy = backend.xp
    for _ in range(warmup):
        run()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()

    def timed(calls):
        start.record()
        for _ in range(calls):
            run()
        stop.record()
        stop.synchronize()
        return cupy.cuda.get_elapsed_time(start, stop) / 1e3 / calls

    calls = max(1, min(1000, int(1e-3 / max(timed(1), 1e-7))))
    return float(numpy.median([timed(calls) for _ in range(repeat)]))


@lru_cache(maxsize=None)
def copy_bandwidth(megabytes=512):
    """Bytes per second of a device-to-device copy, counting bytes read and written: the memory ceiling."""
    cupy = backend.xp
    source = cupy.ones(megabytes * 2**20 // 4, dtype=cupy.float32)
    destination = cupy.empty_like(source)
    seconds = seconds_per_call(lambda: cupy.copyto(destination, source))
    return 2 * source.nbytes / seconds


def gigabytes_per_second(bytes_moved, seconds):
    return bytes_moved / seconds / 1e9


def tflops(flops, seconds):
    return flops / seconds / 1e12


def bandwidth_rows(gb_per_s, copy_gb_per_s, seconds=None):
    """Lines of a table, one per {name: GB/s} entry: `  name   2781 GB/s  83.5% of copy`, the names aligned.

    seconds: {name: seconds per call}, to show each call's time (in µs) before its rate.
    """
    width = max(map(len, gb_per_s), default=0)
    lines = []
    for name, rate in gb_per_s.items():
        time = f"{seconds[name] * 1e6:9.1f} µs " if seconds is not None else ""
        lines.append(f"  {name:<{width}s} {time}{rate:7.0f} GB/s {rate / copy_gb_per_s:6.1%} of copy")
    return lines


def measured_on():
    """The device and the time of a measurement, to stamp a results file with."""
    return {"device": backend.device_name(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def write_results(path, results):
    """Write a benchmark's results as JSON (bench/NAME.json beside bench/NAME.py)."""
    Path(path).write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")


def report(name, results, table):
    """The tail of every bench/NAME.py: print the table, stamp results with measured_on(), write bench/NAME.json.

    results: a JSON-able dict of what was measured; table: lines of text, a short summary to print.
    Returns the path written.
    """
    for line in table:
        print(line)
    path = Path(__file__).resolve().parent.parent / "bench" / f"{name}.json"
    write_results(path, {**measured_on(), **results})
    print(f"written: {path}")
    return path
