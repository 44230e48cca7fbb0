"""Timing kernels on a GPU, and the device's measured ceilings to compare them with.

Timings mean something only on a GPU: on the CPU executor `meaningful()` is False, and the chapters plot the
results a GPU stored in bench/NAME.json instead. Each bench/NAME.py (`python -m bench.NAME` on a GPU) times
with seconds_per_call and ends with report(), which prints its table (bandwidth_rows() writes the lines of
GB/s against the copy) and writes that file.
"""

import datetime
import json
import time
from functools import lru_cache
from pathlib import Path

import numpy

from . import backend
from .data import write_atomically


def meaningful():
    """Whether timings here say anything about a GPU kernel."""
    return backend.ON_GPU


def require_gpu(reason="timings on the CPU executor say nothing about a GPU"):
    """Stop a GPU-only script (a bench/NAME.py) on the CPU executor: the reason on stderr, exit status 1."""
    if not meaningful():
        raise SystemExit(f"{reason}: run this on a GPU.")


# A kernel that keeps the stream busy for a given time: the calls being timed queue up behind it, so the
# GPU runs them back to back however long Python takes to launch them (nvbench's "blocking kernel" idea).
# %globaltimer is the GPU's nanosecond clock; __nanosleep keeps the spinning thread from hogging its SM.
HOLD_STREAM_SOURCE = r"""
extern "C" __global__ void hold_stream(long long nanoseconds)
{
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < (unsigned long long)nanoseconds);
}
"""
MOST_CALLS_QUEUED = 200  # well under the ~1000 launches a CUDA stream queues before a launch blocks


@lru_cache(maxsize=None)
def _hold_stream_kernel():
    return backend.xp.RawKernel(HOLD_STREAM_SOURCE, "hold_stream")


def seconds_per_call(run, warmup=3, repeat=20):
    """Median GPU seconds of one run() call, timed with CUDA events: the one timing wrapper of the package.

    Python needs microseconds to launch a kernel (more for an op that checks its arguments first), and a
    short kernel can finish before the next launch arrives; timed naively, the GPU would wait for Python
    and the time would be Python's. So each timing queues as many calls as fill about a millisecond of GPU
    time behind hold_stream, a kernel that keeps the GPU busy until Python has launched them all, and the
    events around the calls measure the GPU's work alone. If launching took longer than the hold (run()
    waits for the GPU, say), the hold is lengthened; if that never suffices, the timing is the plain one,
    which counts Python's time too.
    """
    if not meaningful():
        raise RuntimeError("timings on the CPU executor do not say anything about a GPU: run this on a GPU")
    cupy = backend.xp
    for _ in range(warmup):
        run()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()

    def timed(calls, hold_seconds=0.0):
        """(GPU seconds per call, host seconds spent launching the calls)."""
        if hold_seconds:
            _hold_stream_kernel()((1,), (1,), (numpy.int64(hold_seconds * 1e9),))
        launching = time.perf_counter()
        start.record()
        for _ in range(calls):
            run()
        stop.record()
        launching = time.perf_counter() - launching
        stop.synchronize()
        return cupy.cuda.get_elapsed_time(start, stop) / 1e3 / calls, launching

    plain, launching = timed(1)
    calls = max(1, min(MOST_CALLS_QUEUED, int(1e-3 / max(plain, 1e-7))))
    _, launching = timed(calls)
    hold, held, times = 2 * launching + 2e-4, True, []
    for _ in range(repeat):
        if held:
            for _attempt in range(3):
                seconds, launching = timed(calls, hold)
                if launching < hold:  # every call was queued while the GPU was still held
                    break
                hold = 2 * launching
            else:
                held = False  # run() waits for the GPU itself: no hold can cover its launches
        if not held:
            seconds, _ = timed(calls)
        times.append(seconds)
    return float(numpy.median(times))


@lru_cache(maxsize=None)
def copy_bandwidth(megabytes=512):
    """Bytes per second of a device-to-device copy, counting bytes read and written: the memory ceiling."""
    cupy = backend.xp
    source = cupy.ones(megabytes * 2**20 // 4, dtype=cupy.float32)
    destination = cupy.empty_like(source)
    seconds = seconds_per_call(lambda: cupy.copyto(destination, source))
    return 2 * source.nbytes / seconds


# HBM bandwidth in GB/s from NVIDIA's datasheets, by a name the device's name contains (the most specific
# first): the rate of the memory's pins, above what any copy reaches. A bound against it and one against the
# measured copy (copy_bandwidth) say different things: how far from the hardware, and how far from the best a
# kernel does.
DATASHEET_GB_PER_S = {"H100 PCIe": 2000, "H100 NVL": 3900, "H100": 3350, "H200": 4800}


def datasheet_gb_per_s(device_name=None):
    """The datasheet's memory bandwidth of the named device (the current one by default), or None where the
    table does not know it (or on the CPU)."""
    if device_name is None:
        if not meaningful():
            return None
        device_name = backend.device_name()
    return next((rate for name, rate in DATASHEET_GB_PER_S.items() if name in device_name), None)


# Dense multiply-adds per clock per multiprocessor of the tensor cores, by compute capability and input type
# (NVIDIA's architecture whitepapers: four tensor cores per multiprocessor; TF32 at half bf16's rate).
TENSOR_CORE_MULTIPLY_ADDS = {"80": {"bf16": 1024, "tf32": 512}, "86": {"bf16": 512, "tf32": 256},
                             "89": {"bf16": 512, "tf32": 256}, "90": {"bf16": 2048, "tf32": 1024}}


def tensor_core_peak_tflops(input_type):
    """The tensor cores' dense peak in TFLOP/s for "bf16" or "tf32" inputs at the highest clock (a reference
    line, not a ceiling any product reaches), or None on a GPU the table does not know or on the CPU."""
    if not meaningful():
        return None
    device = backend.xp.cuda.Device()
    per_clock = TENSOR_CORE_MULTIPLY_ADDS.get(device.compute_capability, {}).get(input_type)
    clock_khz = device.attributes.get("ClockRate")
    if per_clock is None or not clock_khz:
        return None
    return device.attributes["MultiProcessorCount"] * per_clock * 2 * clock_khz * 1e3 / 1e12


def gigabytes_per_second(bytes_moved, seconds):
    return bytes_moved / seconds / 1e9


def tflops(flops, seconds):
    return flops / seconds / 1e12


def bandwidth_rows(gb_per_s, copy_gb_per_s, seconds=None, datasheet=None):
    """Lines of a table, one per {name: GB/s} entry, `  name   2781 GB/s  83.5% of copy  83.0% of datasheet`,
    the names aligned.

    seconds: {name: seconds per call}, to show each call's time (in µs) before its rate. datasheet: the
    device's datasheet bandwidth in GB/s (by default the current device's, datasheet_gb_per_s()); the last
    column is left out where it is not known.
    """
    datasheet = datasheet if datasheet is not None else datasheet_gb_per_s()
    width = max(map(len, gb_per_s), default=0)
    lines = []
    for name, rate in gb_per_s.items():
        time = f"{seconds[name] * 1e6:9.1f} µs " if seconds is not None else ""
        of_datasheet = f" {rate / datasheet:6.1%} of datasheet" if datasheet else ""
        lines.append(f"  {name:<{width}s} {time}{rate:7.0f} GB/s {rate / copy_gb_per_s:6.1%} of copy{of_datasheet}")
    return lines


def measured_on():
    """The device and the time of a measurement, to stamp a results file with."""
    return {"device": backend.device_name(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def write_results(path, results):
    """Write a benchmark's results as JSON (bench/NAME.json beside bench/NAME.py), atomically."""
    write_atomically(path, (json.dumps(results, indent=1, ensure_ascii=False) + "\n").encode())


def report(name, results, table, section=None, keep=()):
    """The tail of every bench/NAME.py: print the table, stamp results with measured_on(), write bench/NAME.json.

    results: a JSON-able dict of what was measured; table: lines of text, a short summary to print.
    section: a key of bench/NAME.json to write the stamped results under, the file's other keys kept (two
    benchmarks sharing one file); keep: keys of the stored file that a run without section keeps (the other
    benchmark's section). Returns the path written.
    """
    for line in table:
        print(line)
    path = Path(__file__).resolve().parent.parent / "bench" / f"{name}.json"
    stored = json.loads(path.read_text()) if path.exists() else {}
    stamped = {**measured_on(), **results}
    if section is not None:
        write_results(path, {**stored, section: stamped})
    else:
        write_results(path, {**{key: stored[key] for key in keep if key in stored}, **stamped})
    print(f"written: {path}")
    return path
