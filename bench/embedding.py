"""Benchmark of chapter 06 (embedding) on a GPU: the lookup forward and the scatter-add backward.

    python -m bench.embedding   writes bench/embedding.json (device, date, results) and prints a table

Sizes are GPT-2 small's: V = 50257 tokens, C = 768 columns, T = 1024 positions, B·T = 8192 rows.
Forward in GB/s (the N rows read from the table and the N rows written, plus the ids) against the
device's copy bandwidth and torch.nn.functional.embedding. Backward in microseconds per call, at the
same sizes, for every version of the chapter (atomicAdd, a thread per column, grouped positions: the
package's embedding_backward, its grouping included, and its two parts alone), for a simpler version 3
(cupy's sort of the keys id * N + position, then one warp per group, whatever its length: kept here to
compare with) and for PyTorch's embedding backward
(aten.embedding_dense_backward, which returns a fresh gradient table: its time includes zeroing V·C
floats, which ours, adding into an existing buffer, does not do). Ids are drawn two ways: uniformly from
the vocabulary, and from a Zipf-like law as in text (a few ids take a large share of the positions), the
harder case for one warp per id. Also: how many elements of dweight differ between two runs of the
atomicAdd version and of both version 3s on the same inputs, and, for a comparison on torch's terms, the
package's version 3 after zeroing dweight (as torch's gradient table starts from zero).
"""

import numpy as np

from gpt2_cupy import backend, benchmark, kernels
from gpt2_cupy.ops.arrays import ceil_div
from gpt2_cupy.ops.embedding import (embedding_backward, embedding_forward, group_positions, sum_groups,
                                     token_position_embedding_backward, token_position_embedding_forward)
from gpt2_cupy.testing import torch_or_none

V, C, T, B = 50257, 768, 1024, 8
N = B * T
FLOAT = 4
NEW = "version 3: embedding_backward (grouping + chunks)"
SIMPLE = "version 3, simple: cupy sort + one warp per group"
NEW_ZEROED = "version 3 after zeroing dweight (torch's terms)"
TORCH = "torch embedding backward (embedding_dense_backward)"
TORCH_DETERMINISTIC = "torch embedding backward, deterministic mode"

# A simpler version 3: the positions sorted as keys id * N + position by cupy's sort, then one warp per
# group, which walks the whole group alone (a group of 700 positions is 700 steps of one warp).
SIMPLE_SOURCE = r'''
extern "C" __global__ void embedding_backward_sorted(float* dweight, const float* __restrict__ dout,
                                                     const long long* sorted_keys, int N, int C)
{
    int k = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (k >= N) {
        return;
    }
    long long id = sorted_keys[k] / N;
    if (k > 0 && sorted_keys[k - 1] / N == id) {
        return;  // not the first key of its id
    }
    int first_column = blockIdx.y * 128 + lane;
    float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int batch = k; batch < N; batch += 32) {
        int j = batch + lane;
        long long lane_key = j < N ? sorted_keys[j] : -1;
        int position = (lane_key >= 0 && lane_key / N == id) ? (int)(lane_key - id * N) : -1;
        int count = __popc(__ballot_sync(0xffffffffu, position >= 0));
#pragma unroll 4
        for (int r = 0; r < count; ++r) {
            const float* row = dout + (long long)__shfl_sync(0xffffffffu, position, r) * C;
            for (int u = 0; u < 4; ++u) {
                int c = first_column + 32 * u;
                if (c < C) {
                    sum[u] += row[c];
                }
            }
        }
        if (count < 32) {
            break;
        }
    }
    for (int u = 0; u < 4; ++u) {
        int c = first_column + 32 * u;
        if (c < C) {
            dweight[id * C + c] += sum[u];
        }
    }
}
'''


def sorted_position_keys(ids):
    """The simpler grouping: keys id * N + position, sorted by cupy."""
    cupy = backend.xp
    keys = ids.reshape(-1).astype(cupy.int64) * N + cupy.arange(N, dtype=cupy.int64)
    keys.sort()
    return keys


def simple_backward(kernel, dweight, dout, ids):
    keys = sorted_position_keys(ids)
    kernel((ceil_div(N, 8), ceil_div(C, 128)), (256,), (dweight, dout, keys, np.int32(N), np.int32(C)))


def text_like_ids(rng, count):
    """Ids with Zipf's law over the vocabulary: the r-th most frequent id has probability ~ 1 / r."""
    weights = 1.0 / np.arange(1, V + 1)
    return rng.choice(V, size=count, p=weights / weights.sum()).astype(np.int32)


def measure():
    benchmark.require_gpu()
    cupy, torch = backend.xp, torch_or_none()
    rng = np.random.default_rng(0)
    wte = cupy.asarray(rng.standard_normal((V, C), dtype=np.float32))
    wpe = cupy.asarray(rng.standard_normal((T, C), dtype=np.float32))
    dout = cupy.asarray(rng.standard_normal((B, T, C), dtype=np.float32))
    out = cupy.empty((B, T, C), dtype=cupy.float32)
    dwte, dwpe = cupy.zeros_like(wte), cupy.zeros_like(wpe)
    id_draws = {"uniform": rng.integers(0, V, N).astype(np.int32), "text-like (Zipf)": text_like_ids(rng, N)}
    steps = kernels.module("steps/embedding_backward")
    simple = backend.RawKernel(SIMPLE_SOURCE, "embedding_backward_sorted")
    lookup_bytes = 2 * N * C * FLOAT + N * 4
    results = {"copy_bandwidth_gb_per_s": benchmark.copy_bandwidth() / 1e9, "forward_gb_per_s": {},
               "backward_microseconds": {}, "elements_differing_between_two_runs": {}, "longest_group": {}}
    for draw, ids_host in id_draws.items():
        ids = cupy.asarray(ids_host.reshape(B, T))
        forward = {
            "embedding_forward (float4)": (lookup_bytes, lambda: embedding_forward(ids, wte, out=out, check_ids=False)),
            "token_position_embedding_forward (fused, float4)": (
                lookup_bytes + T * C * FLOAT,
                lambda: token_position_embedding_forward(ids, wte, wpe, out=out, check_ids=False)),
            "embedding_forward with the id check (one sync)": (
                lookup_bytes, lambda: embedding_forward(ids, wte, out=out)),
            "cupy wte[ids]": (lookup_bytes, lambda: cupy.take(wte, ids, axis=0, out=out)),
        }
        flat = ids.reshape(-1)
        grouping = group_positions(ids, V)
        backward = {
            "version 1: atomicAdd": lambda: steps.get_function("embedding_backward_atomic")(
                (ceil_div(N * C, 256),), (256,), (dwte, dout, flat, np.int32(N), np.int32(C))),
            "version 2: a thread per column": lambda: steps.get_function("embedding_backward_per_column")(
                (ceil_div(C, 256),), (256,), (dwte, dout, flat, np.int32(N), np.int32(C))),
            SIMPLE: lambda: simple_backward(simple, dwte, dout, ids),
            "  of which the sort (cupy)": lambda: sorted_position_keys(ids),
            NEW: lambda: embedding_backward(dout, ids, dweight=dwte, check_ids=False),
            "  of which the grouping (counting sort, 4 kernels)": lambda: group_positions(ids, V),
            "  of which the summing (chunks, then long groups)": lambda: sum_groups(dwte, dout, ids, *grouping, V, C),
            NEW_ZEROED: lambda: (dwte.fill(0), embedding_backward(dout, ids, dweight=dwte, check_ids=False)),
            "token_position_embedding_backward (wte and wpe)": lambda: token_position_embedding_backward(
                dout, ids, dwte=dwte, dwpe=dwpe, check_ids=False),
        }
        if torch is not None:
            ids_torch = torch.from_dlpack(ids).long()
            wte_torch, dout_torch = torch.from_dlpack(wte), torch.from_dlpack(dout)
            forward["torch embedding"] = (lookup_bytes, lambda: torch.nn.functional.embedding(ids_torch, wte_torch))
            backward[TORCH] = (
                lambda: torch.ops.aten.embedding_dense_backward(dout_torch, ids_torch, V, -1, False))

            def torch_deterministic():
                torch.use_deterministic_algorithms(True)
                try:
                    torch.ops.aten.embedding_dense_backward(dout_torch, ids_torch, V, -1, False)
                finally:
                    torch.use_deterministic_algorithms(False)
            backward[TORCH_DETERMINISTIC] = torch_deterministic
        results["forward_gb_per_s"][draw] = {
            name: benchmark.gigabytes_per_second(moved, benchmark.seconds_per_call(run))
            for name, (moved, run) in forward.items()}
        results["backward_microseconds"][draw] = {name: benchmark.seconds_per_call(run) * 1e6
                                                  for name, run in backward.items()}
        differing = {}
        for name in ("version 1: atomicAdd", SIMPLE, NEW):
            runs = []
            for _ in range(2):
                dwte.fill(0)
                backward[name]()
                runs.append(cupy.asnumpy(dwte))
            differing[name] = int(np.count_nonzero(runs[0] != runs[1]))
        results["elements_differing_between_two_runs"][draw] = differing
        results["longest_group"][draw] = int(np.bincount(ids_host).max())
    return {**benchmark.measured_on(), "V": V, "C": C, "T": T, "B": B, **results}


def table(measured):
    ceiling = measured["copy_bandwidth_gb_per_s"]
    lines = [f"{measured['device']}, {measured['date']}: copy bandwidth {ceiling:.0f} GB/s; "
             f"B·T = {measured['B'] * measured['T']}, V = {measured['V']}, C = {measured['C']}"]
    for draw, rates in measured["forward_gb_per_s"].items():
        lines.append(f"forward, {draw} ids:")
        lines += benchmark.bandwidth_rows(rates, ceiling)
    for draw, times in measured["backward_microseconds"].items():
        lines.append(f"backward, {draw} ids (longest group: {measured['longest_group'][draw]} positions):")
        lines += [f"  {name:<55s} {us:9.1f} µs" for name, us in times.items()]
        for name, count in measured["elements_differing_between_two_runs"][draw].items():
            lines.append(f"  two runs of {name}: {count} elements of dweight differ")
        for name in (TORCH, TORCH_DETERMINISTIC):
            if name in times:
                lines.append(f"  {name} / version 3: {times[name] / times[NEW]:.2f}x "
                             f"({times[name] / times[NEW_ZEROED]:.2f}x with the zeroing)")
    return lines


def report(measured):
    """The table as one text, for a notebook to print."""
    return "\n".join(table(measured))


if __name__ == "__main__":
    measured = measure()
    benchmark.report("embedding", measured, table(measured))
