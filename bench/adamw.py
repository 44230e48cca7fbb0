"""The optimizer step over GPT-2 small's 124M parameters on a GPU (chapter 10's benchmark).

    python -m bench.adamw        prints a table and writes bench/adamw.json

AdamW must read θ, g, m, v and write θ, m, v: 28 bytes per parameter, 3.5 GB for GPT-2 small. Its time
is compared with the device's copy bandwidth (the ceiling: 85 % of it is the target) and with
torch.optim.AdamW in the same run, fused=True (one kernel over lists of tensors) and foreach=True
(PyTorch's default on a GPU). Also timed: SGD with momentum (20 bytes per parameter), zero_grad (one
memset, 4 bytes per parameter), and the global gradient norm with clipping (a read of every gradient,
plus a read and a write when the clip factor is below 1).
"""

import numpy as np

from gpt2_cupy import backend, benchmark, optim, testing

C, V, BLOCK_SIZE, LAYERS = 768, 50257, 1024, 12


def gpt2_small_shapes():
    """(shape, decays) of every GPT-2 small parameter: matrices and embeddings decay, the rest not."""
    layer = [((C,), False), ((C,), False),                      # ln_1 weight, bias
             ((3 * C, C), True), ((3 * C,), False),             # attn.c_attn
             ((C, C), True), ((C,), False),                     # attn.c_proj
             ((C,), False), ((C,), False),                      # ln_2
             ((4 * C, C), True), ((4 * C,), False),             # mlp.c_fc
             ((C, 4 * C), True), ((C,), False)]                 # mlp.c_proj
    return [((V, C), True), ((BLOCK_SIZE, C), True)] + layer * LAYERS + [((C,), False), ((C,), False)]


class Parameter:
    def __init__(self, data):
        self.data, self.grad = data, None


def measure():
    benchmark.require_gpu()
    cupy = backend.xp
    shapes = gpt2_small_shapes()
    count = sum(int(np.prod(shape)) for shape, _ in shapes)
    random = cupy.random.default_rng(0)
    parameters = [Parameter(random.standard_normal(shape, dtype=cupy.float32) * 0.02) for shape, _ in shapes]
    for p in parameters:  # every parameter has a gradient, so that a step updates them all
        p.grad = random.standard_normal(p.data.shape, dtype=cupy.float32) * 1e-3
    groups = [{"params": [p for p, (_, decay) in zip(parameters, shapes) if decay], "weight_decay": 0.1},
              {"params": [p for p, (_, decay) in zip(parameters, shapes) if not decay], "weight_decay": 0.0}]
    adamw = optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95))
    sgd_parameters = [Parameter(p.data.copy()) for p in parameters]
    for sgd_p, p in zip(sgd_parameters, parameters):
        sgd_p.grad = p.grad.copy()
    sgd = optim.SGD(sgd_parameters, lr=1e-3, momentum=0.9)
    runs = {
        "AdamW step (ours: prepare + one update launch)": (28 * count, adamw.step),
        "SGD momentum step (ours)": (20 * count, sgd.step),
        "zero_grad (one memset)": (4 * count, lambda: sgd.zero_grad(set_to_none=False)),
        "gradient norm, no clipping needed": (4 * count, lambda: adamw.clip_grad_norm_(1e9)),
    }
    torch = testing.torch_or_none()
    if torch is not None:
        for variant in ("fused", "foreach"):
            torch_parameters = [torch.from_dlpack(p.data.copy()).requires_grad_() for p in parameters]
            for tp, p in zip(torch_parameters, parameters):
                tp.grad = torch.from_dlpack(p.grad.copy())
            torch_groups = [{"params": [tp for tp, (_, d) in zip(torch_parameters, shapes) if d], "weight_decay": 0.1},
                            {"params": [tp for tp, (_, d) in zip(torch_parameters, shapes) if not d],
                             "weight_decay": 0.0}]
            torch_adamw = torch.optim.AdamW(torch_groups, lr=6e-4, betas=(0.9, 0.95), **{variant: True})
            runs[f"torch.optim.AdamW({variant}=True)"] = (28 * count, torch_adamw.step)
    seconds = {name: benchmark.seconds_per_call(run) for name, (_, run) in runs.items()}
    return {
        **benchmark.measured_on(),
        "parameters": count,
        "copy_bandwidth_gb_per_s": benchmark.copy_bandwidth() / 1e9,
        "bytes": {name: bytes_moved for name, (bytes_moved, _) in runs.items()},
        "milliseconds": {name: s * 1e3 for name, s in seconds.items()},
        "gb_per_s": {name: benchmark.gigabytes_per_second(runs[name][0], s) for name, s in seconds.items()},
    }


def table(measured):
    ceiling = measured["copy_bandwidth_gb_per_s"]
    lines = [f"{measured['device']}, {measured['date']}: {measured['parameters']} parameters (GPT-2 small), "
             f"copy bandwidth {ceiling:.0f} GB/s"]
    lines += benchmark.bandwidth_rows(measured["gb_per_s"], ceiling,
                                      {name: ms / 1e3 for name, ms in measured["milliseconds"].items()})
    return lines


def report(measured):
    """The table as one text, for a notebook to print."""
    return "\n".join(table(measured))


if __name__ == "__main__":
    measured = measure()
    benchmark.report("adamw", measured, table(measured))
