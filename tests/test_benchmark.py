"""gpt2_cupy.benchmark: seconds_per_call measures the GPU's time, not Python's, and refuses the CPU executor."""

import time

import numpy as np
import pytest

from gpt2_cupy import backend, benchmark

needs_gpu = pytest.mark.skipif(backend.name != "cuda", reason="timings mean something only on a GPU")


def busy_host_then_copy(destination, source, host_seconds):
    """A call whose Python side takes host_seconds, far longer than its tiny copy takes on the GPU."""
    def run():
        finish = time.perf_counter() + host_seconds
        while time.perf_counter() < finish:
            pass
        backend.xp.copyto(destination, source)
    return run


def test_timings_are_refused_on_the_cpu_executor():
    if backend.name == "cuda":
        pytest.skip("the active backend is a GPU")
    with pytest.raises(RuntimeError, match="CPU executor"):
        benchmark.seconds_per_call(lambda: None)


@needs_gpu
def test_python_time_between_launches_is_not_counted():
    source = backend.xp.ones(1024, dtype=np.float32)
    destination = backend.xp.empty_like(source)
    host_seconds = 200e-6
    seconds = benchmark.seconds_per_call(busy_host_then_copy(destination, source, host_seconds), repeat=5)
    # A 4 KB copy takes a few microseconds of GPU time; the host spends 200 µs per call.
    assert seconds < host_seconds / 4


@needs_gpu
def test_a_long_kernel_times_as_events_around_one_call_do():
    cupy = backend.xp
    source = cupy.ones(64 * 2**20, dtype=np.float32)  # 256 MB: tens of microseconds
    destination = cupy.empty_like(source)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    plain = []
    for _ in range(10):
        start.record()
        cupy.copyto(destination, source)
        stop.record()
        stop.synchronize()
        plain.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
    seconds = benchmark.seconds_per_call(lambda: cupy.copyto(destination, source), repeat=5)
    assert seconds == pytest.approx(float(np.median(plain)), rel=0.15)


@needs_gpu
def test_a_call_that_waits_for_the_gpu_is_timed_with_python_included():
    source = backend.xp.ones(1024, dtype=np.float32)
    destination = backend.xp.empty_like(source)
    host_seconds = 200e-6
    copy = busy_host_then_copy(destination, source, host_seconds)

    def copy_and_wait():
        copy()
        backend.synchronize()  # a held stream never drains: the hold cannot help, the plain timing is used

    seconds = benchmark.seconds_per_call(copy_and_wait, warmup=1, repeat=3)
    assert seconds >= host_seconds


def test_gpu_only_scripts_stop_on_the_cpu_executor_saying_why():
    if backend.name == "cuda":
        pytest.skip("the active backend is a GPU")
    with pytest.raises(SystemExit, match="course preset take hours on the CPU executor: run this on a GPU"):
        benchmark.require_gpu("the course preset take hours on the CPU executor")


def test_tensor_core_peak_is_none_on_the_cpu_and_a_datasheet_magnitude_on_a_hopper_gpu():
    if not benchmark.meaningful():
        assert benchmark.tensor_core_peak_tflops("bf16") is None
        return
    if backend.xp.cuda.Device().compute_capability != "90":
        pytest.skip("the magnitude is checked against an H100's or H200's datasheet")
    bf16, tf32 = benchmark.tensor_core_peak_tflops("bf16"), benchmark.tensor_core_peak_tflops("tf32")
    assert 700 < bf16 < 1200   # dense bf16: 756 (H100 PCIe) to 989 TFLOP/s (SXM) at the boost clock, more at the highest
    assert tf32 == pytest.approx(bf16 / 2)


def test_datasheet_bandwidth_by_the_devices_name():
    assert benchmark.datasheet_gb_per_s("NVIDIA H100 80GB HBM3") == 3350
    assert benchmark.datasheet_gb_per_s("NVIDIA H100 PCIe") == 2000
    assert benchmark.datasheet_gb_per_s("NVIDIA H200") == 4800
    assert benchmark.datasheet_gb_per_s("Tesla T4") is None


def test_bandwidth_rows_against_the_copy_and_the_datasheet():
    rows = benchmark.bandwidth_rows({"a": 2000.0, "longer name": 1000.0}, 2500.0, seconds={"a": 1e-6, "longer name": 2e-6},
                                    datasheet=4000.0)
    assert rows[0].split() == ["a", "1.0", "µs", "2000", "GB/s", "80.0%", "of", "copy", "50.0%", "of", "datasheet"]
    assert rows[1].split()[-6:] == ["40.0%", "of", "copy", "25.0%", "of", "datasheet"]
    assert rows[0].index("2000") == rows[1].index("1000")  # the names padded to one width
    unknown = benchmark.bandwidth_rows({"a": 2000.0}, 2500.0, datasheet=0)
    assert "datasheet" not in unknown[0]
