"""The graded exercises' checker: every solution passes, and every broken version of it fails with a message
that names its problem, on the GPU and on the CPU executor."""

import re

import numpy
import pytest

from gpt2_cupy import backend, exercises
from gpt2_cupy.exercises import checker

# For every exercise, text replacements of its solution that break it: "guard" removes the bounds guard,
# "wrong element" writes the result to another (valid) element, "barrier" removes a __syncthreads() (for
# exercises that have one; "second barrier" another one). "Nothing written" is derived for every exercise
# (its body emptied).
BROKEN = {
    "00.scale_and_add": {
        "guard": ("if (i < n) {", "{"),
        "wrong element": ("out[i] =", "out[n - 1 - i] ="),
    },
    "00.matrix_add": {
        "guard": ("if (row < rows && column < columns) {", "{"),
        "wrong element": ("out[i] =", "out[column * rows + row] ="),
    },
    "01.column_blocked": {
        "guard": ("if (row < M && col < N) C[", "C["),
        "wrong element": ("C[row * N + col] = sums[i]", "C[row * N + N - 1 - col] = sums[i]"),
        "barrier": ("__syncthreads();  // the tiles are complete", "// the tiles are complete"),
        "second barrier": ("__syncthreads();  // nobody overwrites", "// nobody overwrites"),
    },
    "01.tiled_transposed_b": {
        "guard": ("if (row < M && col < N) {", "{"),
        "wrong element": ("C[row * N + col] = sum", "C[(M - 1 - row) * N + col] = sum"),
        "barrier": ("__syncthreads();  // the tiles are complete", "// the tiles are complete"),
        "second barrier": ("__syncthreads();  // nobody overwrites", "// nobody overwrites"),
    },
    # Chapters 04-06 (their own tests beyond these: tests/test_exercises_04_06.py)
    "04.log_softmax": {
        "guard": ("if (row >= rows) {\n        return;  // the whole warp leaves together: the shuffles below see all 32 lanes\n    }\n", ""),
        "wrong element": ("out[(long long)row * columns + column] =", "out[(long long)row * columns + columns - 1 - column] ="),
    },
    "04.online_max_and_sum": {
        "guard": ("if (row >= rows) {\n        return;\n    }\n", ""),
        "wrong element": ("maximum[row] = m;", "maximum[rows - 1 - row] = m;"),
    },
    "04b.online_block": {
        "guard": ("if (blockIdx.x >= rows) {\n        return;  // the whole block leaves: no thread of it waits at a barrier below\n    }\n", ""),
        "wrong element": ("y[(long long)blockIdx.x * columns + column] =", "y[(long long)blockIdx.x * columns + columns - 1 - column] ="),
        "barrier": ("__syncthreads();  // every warp's state is in shared memory", "// every warp's state is in shared memory"),
        "second barrier": ("__syncthreads();  // the row's state is in shared memory", "// the row's state is in shared memory"),
    },
    "04b.backward_block": {
        "guard": ("if (blockIdx.x >= rows) {\n        return;  // the whole block leaves: no thread of it waits at a barrier below\n    }\n", ""),
        "wrong element": ("dx[start + column] =", "dx[start + columns - 1 - column] ="),
        "barrier": ("__syncthreads();  // every warp's sum is in shared memory", "// every warp's sum is in shared memory"),
        "second barrier": ("__syncthreads();  // the row's dot product is in shared memory", "// the row's dot product is in shared memory"),
    },
    "05.rmsnorm_forward": {
        "guard": ("if (row >= rows) {\n        return;\n    }\n", ""),
        "wrong element": ("y[(long long)row * columns + column] =", "y[(long long)row * columns + columns - 1 - column] ="),
    },
    "05.layernorm_backward_dx": {
        "guard": ("if (row >= rows) {\n        return;\n    }\n", ""),
        "wrong element": ("dx[start + column] =", "dx[start + columns - 1 - column] ="),
    },
    "05b.dyt_forward": {
        "guard": ("if (i < n) {", "{"),
        "wrong element": ("y[i] =", "y[n - 1 - i] ="),
    },
    "05b.dyt_partial_sums": {
        # the write's guard: without the read's, the extra columns' sums are never written, and a GPU cannot tell
        "guard": ("if (threadIdx.y == 0 && column < columns) {", "if (threadIdx.y == 0) {"),
        "wrong element": ("weight_partials[(long long)blockIdx.y * columns + column] = weight_total;",
                          "weight_partials[(long long)blockIdx.y * columns + columns - 1 - column] = weight_total;"),
        "barrier": ("__syncthreads();  // all eight slots written", "// all eight slots written"),
    },
    "06.token_position_forward": {
        "guard": ("if (i < B * T * C) {", "{"),
        "wrong element": ("out[i] =", "out[B * T * C - 1 - i] ="),
    },
    "06.grouped_backward": {
        "guard": ("if (c < C) {", "{"),
        "wrong element": ("dweight[v * C + c] = sum;", "dweight[(V - 1 - v) * C + c] = sum;"),
    },
    "02.column_sum_strip": {
        "guard": ("if (threadIdx.y == 0 && column < columns) {", "if (threadIdx.y == 0) {"),
        "wrong element": ("sums[column] += total", "sums[columns - 1 - column] += total"),
        "barrier": ("__syncthreads();", ""),
    },
    "02.column_sum_block_per_column": {
        "guard": ("row < rows;", "row <= rows;"),
        "wrong element": ("sums[column] += total", "sums[columns - 1 - column] += total"),
        "barrier": ("__syncthreads();", ""),
    },
    "03.gelu_forward_sigmoid": {
        "guard": ("if (i < n) {", "{"),
        "wrong element": ("y[i] =", "y[n - 1 - i] ="),
    },
    "03.silu_backward": {
        "guard": ("if (i < n) {", "{"),
        "wrong element": ("dx[i] =", "dx[n - 1 - i] ="),
    },
    "07.dropout_residual": {
        "guard": ("if (i < n) {", "{"),
        "wrong element": ("out[i] =", "out[n - 1 - i] ="),
    },
    "07.box_muller": {
        "guard": ("if (i < n) {", "{"),
        "wrong element": ("z[i] =", "z[n - 1 - i] ="),
    },
    "08.forward_warp_per_row": {
        "guard": ("if (t >= T) {", "if (false) {"),
        "wrong element": ("out[t * d + c] =", "out[(T - 1 - t) * d + c] ="),
    },
    "08.dv_query_tiles": {
        "guard": ("if (j < T) {", "{"),
        "wrong element": ("dv[j * D + c] = gradient[c]", "dv[(T - 1 - j) * D + c] = gradient[c]"),
        "barrier": ("__syncthreads();  // the tiles are complete", "// the tiles are complete"),
        "second barrier": ("__syncthreads();  // nobody still reads", "// nobody still reads"),
    },
    "09.forward_warp_per_row": {
        "guard": ("if (row >= N) {", "if (false) {"),
        "wrong element": ("row_losses[row] =", "row_losses[N - 1 - row] ="),
    },
    "09.backward_from_lse": {
        "guard": ("if (row >= N) {", "if (false) {"),
        "wrong element": ("dlogits[i] =", "dlogits[(long long)(N - 1 - row) * V + j] ="),
    },
    # Chapters 10-14 (their own tests beyond these: tests/test_exercises_10_14.py)
    "10.gradient_norm_partial_sums": {
        "guard": ("g[k] = j < n ? grads[j] : 0.0f;", "g[k] = j <= n ? grads[j] : 0.0f;"),  # within the guard region on a GPU
        "wrong element": ("partial_sums[blockIdx.x] =", "partial_sums[gridDim.x - 1 - blockIdx.x] ="),
        "barrier": ("partial[threadIdx.x] = sum;\n    __syncthreads();", "partial[threadIdx.x] = sum;"),
    },
    "10.adamw_clipped": {
        "guard": ("if (i < n) {", "{"),
        "wrong element": ("float g = grads[i] * scale;", "float g = grads[n - 1 - i] * scale;"),
    },
    "11.accumulate_gradient": {
        "guard": ("if (i < n) {", "{"),
        "wrong element": ("grad[i] += gradient[i];", "grad[n - 1 - i] += gradient[i];"),
    },
    "11.broadcast_gradient": {
        "guard": ("if (column < columns) {", "{"),
        "wrong element": ("dbias[column] += sum;", "dbias[columns - 1 - column] += sum;"),
    },
    "11b.layernorm_tail": {
        "guard": ("if (i < rows * columns) {", "{"),
        "wrong element": ("out[i] =", "out[rows * columns - 1 - i] ="),
    },
    "11b.row_mean_rstd": {
        "guard": ("c < columns;", "c < columns + blockDim.x;"),
        "wrong element": ("mean[blockIdx.x] = row_mean;", "mean[gridDim.x - 1 - blockIdx.x] = row_mean;"),
        "barrier": ("shared[threadIdx.x] = value;\n    __syncthreads();", "shared[threadIdx.x] = value;"),
    },
    "12.bias_gelu": {
        "guard": ("if (i < rows * columns) {", "{"),
        "wrong element": ("out[i] =", "out[rows * columns - 1 - i] ="),
    },
    "12.tied_head_gradient": {
        "guard": ("if (token < vocab && c < channels) {", "{"),
        "wrong element": ("dwte[token * channels + c] += sum;", "dwte[c * vocab + token] += sum;"),
    },
    "13.utf8_lengths": {
        "guard": ("if (i < n) {", "{"),
        "wrong element": ("lengths[i] = length;", "lengths[n - 1 - i] = length;"),
    },
    "13.byte_histogram": {
        "guard": ("byte < n;", "byte < n + 4 * blockDim.x;"),
        "wrong element": ("atomicAdd(&counts[threadIdx.x],", "atomicAdd(&counts[255 - threadIdx.x],"),
        "barrier": ("    __syncthreads();\n    atomicAdd(&counts", "    atomicAdd(&counts"),
    },
    "14.mean_loss": {
        "guard": ("i < n;", "i < n + blockDim.x;"),
        "wrong element": ("loss[0] = partial[0] / n;", "loss[0] = partial[1] / n;"),
        "barrier": ("partial[threadIdx.x] = sum;\n    __syncthreads();", "partial[threadIdx.x] = sum;"),
    },
    "14.sample_token": {
        "guard": ("if (row < rows) {", "{"),
        "wrong element": ("tokens[row] = token;", "tokens[rows - 1 - row] = token;"),
    },
    # Chapters 16a-16c
    "16a.bf16_round": {
        "guard": ("if (i < n) {", "{"),
        "wrong element": ("out[i] =", "out[n - 1 - i] ="),
    },
    "16a.unscale_check": {
        "guard": ("if (i < n) {", "{"),
        "wrong element": ("unscaled[i] = value;", "unscaled[n - 1 - i] = value;"),
    },
    "16b.online_softmax_step": {
        "guard": ("if (row < rows) {", "{"),
        "wrong element": ("o[(long long)row * d + c] = total;", "o[(long long)row * d + d - 1 - c] = total;"),
    },
    "16b.dv_accumulate": {
        "guard": ("if (j < T && c < d) {", "{"),
        "wrong element": ("dv[(long long)j * d + c] += sum;", "dv[(long long)(T - 1 - j) * d + c] += sum;"),
    },
    "16c.sgd_device_scalars": {
        "guard": ("if (i < n) {", "{"),
        "wrong element": ("parameters[i] -=", "parameters[n - 1 - i] -="),
    },
    "16c.bias_gelu": {
        "guard": ("if (i < n) {", "{"),
        "wrong element": ("y[i] =", "y[n - 1 - i] ="),
    },
    # Chapters 17a-17b
    "17a.rmsnorm_forward": {
        "guard": ("if (row >= rows) {\n        return;  // the whole warp leaves together: the shuffles below see all 32 lanes\n    }\n", ""),
        "wrong element": ("out[(long long)row * columns + c] =", "out[(long long)row * columns + columns - 1 - c] ="),
    },
    "17a.rope_interleaved": {
        "guard": ("if (p < pairs) {", "{"),
        "wrong element": ("long long first = row * D + 2 * i;", "long long first = row * D + D - 2 - 2 * i;"),
    },
    "17b.gemv_float4": {
        "guard": ("if (n >= N) {\n        return;  // the whole warp leaves together: the shuffles below see all 32 lanes\n    }\n", ""),
        "wrong element": ("y[n] = sum;", "y[N - 1 - n] = sum;"),
    },
    "17b.decode_combine": {
        "guard": ("if (e < rows * d) {", "{"),
        "wrong element": ("out[e] =", "out[rows * d - 1 - e] ="),
    },
    # Chapters 15a-15b
    "15a.mma_tiles": {
        "guard": ("if (row < M && column < N) C[row * N + column] = d[e];", "C[row * N + column] = d[e];"),
        "wrong element": ("C[row * N + column] = d[e];", "C[row * N + column] = d[3 - e];"),
    },
    "15a.ldmatrix_tiles": {
        "guard": ("if (row < M && column < N) C[row * N + column] = d[e];", "C[row * N + column] = d[e];"),
        "wrong element": ("C[row * N + column] = d[e];", "C[row * N + column] = d[3 - e];"),
    },
    "15b.accumulator_store": {
        "guard": ("if (row < M) *reinterpret_cast", "*reinterpret_cast"),
        "wrong element": ("make_float2(d[i], d[i + 1])", "make_float2(d[i + 1], d[i])"),
    },
    "15b.split_k": {
        "guard": ("if (row < M) *reinterpret_cast", "*reinterpret_cast"),
        "wrong element": ("float* C = partials + (long long)blockIdx.z * M * N;",
                          "float* C = partials + (long long)(stretches - 1 - blockIdx.z) * M * N;"),
    },
    # Chapter 18
    "18.reduce_scatter": {
        "guard": ("if (i < shard_size) {", "{"),
        "wrong element": ("int j = rank * shard_size + i;", "int j = i;"),
    },
    "18.shard_sum_of_squares": {
        "guard": ("if (i < n) {", "{"),
        "wrong element": ("value = gradients[i] * gradients[i];", "value = gradients[n - 1 - i] * gradients[i];"),
        "barrier": ("    __syncthreads();\n    for", "    for"),
    },
}

IDS = [exercise_id for exercise_id, _, _ in exercises.list()]
# Barriers the CPU executor cannot find missing: their shared memory is written by cp.async and read by wgmma,
# which runs once the whole warpgroup (here the whole block) has reached it, so on the executor the reads
# always follow the writes. On a GPU the __syncthreads makes the other threads' copies visible to the reads.
BARRIERS_ONLY_A_GPU_NEEDS = {"15b.accumulator_store", "15b.split_k"}
ON_CPU = backend.name == "cpu"


def _broken(exercise_id, kind):
    old, new = BROKEN[exercise_id][kind]
    source = exercises.solution(exercise_id)
    assert source.count(old) == 1, f"{exercise_id}: {old!r} is not in its solution exactly once"
    return source.replace(old, new)


def _with_empty_body(exercise_id):
    """The solution with its kernel's body emptied: what a skeleton holds."""
    exercise = exercises.exercise(exercise_id)
    source = exercises.solution(exercise_id)
    start = source.index("{", source.index(f"void {exercise.kernel}("))
    return source[:start] + "{\n    // your code here\n}\n"


def test_there_are_exercises_and_each_has_its_broken_versions():
    assert len(IDS) >= 2
    assert len(set(IDS)) == len(IDS)
    for exercise_id in IDS:
        assert re.fullmatch(r"\d\d[a-z]?\.\w+", exercise_id)
        assert exercise_id.split(".")[0] == exercises.exercise(exercise_id).chapter
        assert {"guard", "wrong element"} <= set(BROKEN.get(exercise_id, {})), f"{exercise_id}: add it to BROKEN"
        if "__syncthreads()" in exercises.solution(exercise_id) and exercise_id not in BARRIERS_ONLY_A_GPU_NEEDS:
            assert "barrier" in BROKEN[exercise_id], f"{exercise_id}: its solution has a barrier; add its removal"


@pytest.mark.parametrize("exercise_id", IDS)
def test_the_solution_passes(exercise_id, capsys):
    result = exercises.check(exercise_id, exercises.solution(exercise_id))
    assert result.passed, result.message
    assert capsys.readouterr().out == result.message + "\n"
    assert result.message.startswith(f"{exercise_id}: passed at ")


@pytest.mark.parametrize("exercise_id", IDS)
def test_nothing_written_fails(exercise_id):
    result = checker.run_check(exercises.exercise(exercise_id), _with_empty_body(exercise_id))
    assert not result.passed
    assert re.search(r"was never written: .*(NaN|-?\d+|what) it held before the launch", result.message)


@pytest.mark.parametrize("exercise_id", IDS)
def test_a_missing_bounds_guard_fails(exercise_id):
    result = checker.run_check(exercises.exercise(exercise_id), _broken(exercise_id, "guard"))
    assert not result.passed
    if ON_CPU:  # the executor's bounds check names the thread and the element
        assert re.search(r"thread \S+ of block (\([\d, ]+\)|\S+) (read|wrote) \w+\[\d+\], (one )?past its end",
                         result.message)
        assert "bounds check" in result.message
    else:  # a GPU has no bounds check: the guard region after each output sees a stray write, and a stray read
        # brings in the NaN of an input's guard region
        assert (re.search(r"\w+\[\d+\] was written, past the end of \w+ .* bounds check", result.message)
                or re.search(r"\w+\[[\d, ]+\] is \S+, expected \S+", result.message)), result.message


@pytest.mark.parametrize("exercise_id", IDS)
def test_the_wrong_element_fails(exercise_id):
    result = checker.run_check(exercises.exercise(exercise_id), _broken(exercise_id, "wrong element"))
    assert not result.passed
    assert re.search(r"\w+\[[\d, ]+\] is \S+, expected \S+ \(\d+ of \d+ elements are off", result.message)


@pytest.mark.skipif(not ON_CPU, reason="a missing barrier is found by the CPU executor's race check; on a GPU "
                                       "the race may not bite, and the kernel may pass")
@pytest.mark.parametrize("exercise_id, barrier", [(i, kind) for i in IDS for kind in BROKEN.get(i, {}) if "barrier" in kind])
def test_a_missing_barrier_is_a_race(exercise_id, barrier):
    result = checker.run_check(exercises.exercise(exercise_id), _broken(exercise_id, barrier))
    assert not result.passed
    # (between atomic updates and a plain load or store, the verdict says where the __syncthreads() goes)
    assert re.search(r"a race on [^:]+: .*(a __syncthreads\(\) is missing between the writes and the reads|"
                     r"with no __syncthreads\(\))", result.message)


def test_a_compile_error_quotes_the_compiler_with_its_line():
    source = exercises.solution("00.scale_and_add").replace("y[i];", "z[i];")
    line = source[:source.index("z[i]")].count("\n") + 1
    result = checker.run_check(exercises.exercise("00.scale_and_add"), source)
    assert not result.passed
    assert result.message.startswith(f"00.scale_and_add: the kernel does not compile: line {line}: ")
    assert "z" in result.message


def test_a_missing_kernel_or_a_wrong_parameter_list_is_named():
    exercise = exercises.exercise("00.scale_and_add")
    renamed = exercises.solution("00.scale_and_add").replace("void scale_and_add(", "void saxpy(")
    assert "defines no kernel" in checker.run_check(exercise, renamed).message
    extra = exercises.solution("00.scale_and_add").replace("int n)", "int n, int m)")
    assert "has 6 parameters, but the exercise passes 5: (out, x, y, alpha, n)" in checker.run_check(exercise, extra).message


def test_a_write_into_the_guard_is_named_without_the_executor():
    """What a GPU reports: the guard after out is what shows the stray write."""
    exercise = exercises.exercise("00.scale_and_add")
    argument = checker.Output("out", (10,))
    whole = checker._unwritten(10 + 4, numpy.dtype(numpy.float32))
    whole[:10] = numpy.arange(10)
    assert checker._output_problem(exercise, argument, whole.copy(), 10, numpy.arange(10.0)) == ""
    whole[11] = numpy.nan  # a NaN computed from an input's guard still counts as written
    message = checker._output_problem(exercise, argument, whole, 10, numpy.arange(10.0))
    assert message.startswith("out[11] was written, past the end of out (it has 10 elements, valid indices 0..9)")


def test_unknown_exercise_is_a_key_error_naming_the_known_ones():
    with pytest.raises(KeyError, match="00.scale_and_add"):
        exercises.check("99.nothing", "")


def test_a_kernel_with_launch_bounds_is_found():
    source = exercises.solution("00.scale_and_add").replace("void scale_and_add(", "void __launch_bounds__(256) scale_and_add(")
    assert checker.run_check(exercises.exercise("00.scale_and_add"), source).passed


def test_a_source_that_is_not_text_is_a_type_error():
    with pytest.raises(TypeError, match="CUDA C as a str"):
        exercises.check("00.scale_and_add", object())
