"""Llama generation at batch 1 on a GPU: bf16 decode against the memory-bandwidth bound and transformers.

    python -m bench.llama_generation [--shape 1b tinyllama 7b] [--prompt 512] [--new-tokens 128] [--prefill 2048]

Three shapes, random weights (the speed does not depend on them), built in bf16 on the device:
    1b         Llama 3.2 1B: 16 layers, 2048 channels, 32 query and 8 key-value heads of 64, MLP 8192,
               vocabulary 128256, tied embeddings;
    tinyllama  TinyLlama 1.1B: 22 layers, 2048 channels, 32 query and 4 key-value heads of 64, MLP 5632,
               vocabulary 32000;
    7b         Llama 2 7B: 32 layers, 4096 channels, 32 heads of 128, MLP 11008, vocabulary 32000 (13.5 GB in
               bf16).
Greedy decoding from a random prompt, batch 1, the next token chosen on the device (argmax):
- decode tokens/s, ours eager (a Python call per op) and ours with the step captured as a CUDA graph
  (Llama.generate(..., cuda_graph=True)'s gpt2_cupy.generation.DecodeGraph), and transformers' LlamaForCausalLM in bf16 with
  generate(cache_implementation="static") in the same run (its decode rate: (tokens of a long run - 1) over
  the long run's time minus a one-token run's);
- the bound: every weight read once per token at the measured copy bandwidth, tokens/s = bandwidth / bytes;
- prefill: the prompt (and, for 7b, a 2048-token prompt) through the model into an empty cache, ms, against
  transformers' forward of the same prompt.
- gemv: the one-row (and few-row) products alone, GB/s of weights for R = 1, 2, 4, 8, 16 rows, our GEMV kernel
  against the tiled tensor-core GEMM the product would take otherwise and against torch.matmul (cuBLAS).

Writes bench/llama_generation.json (a run of one shape keeps the other shape's stored results), prints a table.

    python -m bench.llama_generation --shape 1b --settings default backend.DEPENDENT_LAUNCHES=False gemv.WARPS_PER_MULTIPROCESSOR=32

--settings: only the captured decode step, captured once under each setting of the package's module switches
(MODULE.NAME=VALUE of gpt2_cupy.ops.MODULE or gpt2_cupy.MODULE, several joined by commas; "default" is none),
on one model, and replayed in turns (--rounds), so that the settings are compared in one process on one card;
prints tokens/s against the bound and writes no file.

    python -m bench.llama_generation --shape 1b --profile

--profile: only the captured decode step's kernels, per step, from torch.profiler over replays (captured without
dependent launches, so that each kernel's duration is its own), and the gaps between them.
"""

import argparse
import ast
import contextlib
import importlib
import json
import time
from pathlib import Path

import numpy as np

from gpt2_cupy import backend, benchmark, nn, testing
from gpt2_cupy.autograd import no_grad
from gpt2_cupy.random import manual_seed
from gpt2_cupy.elementwise import converted
from gpt2_cupy.generation import DecodeGraph
from gpt2_cupy.llama import Llama, LlamaConfig
from gpt2_cupy.ops.arrays import BFLOAT16

SHAPES = {
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096, rope_theta=500000.0,
               tie_word_embeddings=True),
    "tinyllama": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                      num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                      rope_theta=10000.0, tie_word_embeddings=False),
    "7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, rope_theta=10000.0,
               tie_word_embeddings=False),
}
NAMES = {"1b": "Llama 3.2 1B", "tinyllama": "TinyLlama 1.1B", "7b": "Llama 2 7B"}
RESULTS = Path(__file__).resolve().parent / "llama_generation.json"


def seconds(run, synchronize):
    synchronize()
    started = time.perf_counter()
    run()
    synchronize()
    return time.perf_counter() - started


@contextlib.contextmanager
def random_bf16_weights_on_device():
    """Layers built with bf16 parameters drawn on the device: the model holds one bf16 copy, and 6.7 billion
    numbers are not drawn by numpy on the host (minutes). Only for timing: the values are N(0, 0.02)."""
    xp = backend.xp
    original_normal, original_uniform, original_init = nn._normal, nn._uniform, Llama._init_weights

    def empty_parameter(shape, scale):
        parameter = nn.Parameter()
        parameter._data = xp.empty(shape, dtype=BFLOAT16)
        return parameter

    def device_normal(model):
        for parameter in model.parameters():
            if parameter.ndim == 2:
                parameter._data[...] = converted(xp.random.standard_normal(parameter.shape, dtype=np.float32)
                                                * np.float32(0.02), BFLOAT16)
        model.to(BFLOAT16)                                     # the norms' float32 ones

    nn._normal, nn._uniform, Llama._init_weights = empty_parameter, empty_parameter, device_normal
    try:
        yield
    finally:
        nn._normal, nn._uniform, Llama._init_weights = original_normal, original_uniform, original_init


def random_bf16_model(shape):
    """The Llama of SHAPES[shape], its weights random bf16 made on the device, in eval mode."""
    manual_seed(0)
    with random_bf16_weights_on_device():
        model = Llama(LlamaConfig(**SHAPES[shape]))
    return model.eval()


def ours(shape, prompts, new_tokens):
    model = random_bf16_model(shape)
    xp = backend.xp
    parameters = sum(p.numel() for p in model.parameters())
    run = {"dtype": "bfloat16", "parameters": parameters, "weight_bytes": 2 * parameters, "prefill_ms": {}}
    with no_grad():
        for length, prompt in prompts.items():
            ids = xp.asarray(prompt[None, :].astype(np.int32))

            def prefill():
                cache = model.new_kv_cache(1, length + new_tokens + 2)
                logits, _ = model(ids, kv_cache=cache)
                return cache, logits

            prefill()                                                        # compiles every kernel
            run["prefill_ms"][str(length)] = 1e3 * seconds(prefill, backend.synchronize)
        ids = xp.asarray(prompts[min(prompts)][None, :].astype(np.int32))
        length = min(prompts)

        def eager_decode(cache, logits):
            for _ in range(new_tokens):
                token = xp.argmax(converted(logits._data[:, -1], np.float32), axis=-1, keepdims=True)
                logits, _ = model(token, kv_cache=cache)

        for _ in range(2):                                                   # the second is timed
            cache = model.new_kv_cache(1, length + new_tokens + 2)
            logits, _ = model(ids, kv_cache=cache)
            run["eager_tokens_per_second"] = new_tokens / seconds(lambda: eager_decode(cache, logits),
                                                                  backend.synchronize)
        cache = model.new_kv_cache(1, length + new_tokens + 2)
        logits, _ = model(ids, kv_cache=cache)
        token = xp.argmax(converted(logits._data[:, -1], np.float32), axis=-1, keepdims=True)
        started = time.perf_counter()
        step = DecodeGraph(model, cache, token, greedy=True)
        backend.synchronize()
        run["graph_capture_ms"] = 1e3 * (time.perf_counter() - started)
        step.graph.replay()                                                  # the first replay uploads the graph
        replays = new_tokens - 2
        run["graph_tokens_per_second"] = replays / seconds(lambda: [step.run() for _ in range(replays)],
                                                           backend.synchronize)
        eager_tokens = model.generate(ids, 8, temperature=0)
        graph_tokens = model.generate(ids, 8, temperature=0, cuda_graph=True)
        run["graph_equals_eager_tokens"] = bool((eager_tokens == graph_tokens).all())
    del model, cache, logits, step
    xp.get_default_memory_pool().free_all_blocks()
    return run


def transformers_run(torch, shape, prompts, new_tokens):
    import transformers

    head_dim = SHAPES[shape]["hidden_size"] // SHAPES[shape]["num_attention_heads"]   # as ours: 64 for 1b
    config = transformers.LlamaConfig(**SHAPES[shape], head_dim=head_dim)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    parameters = sum(p.numel() for p in model.parameters())
    run = {"dtype": "bfloat16", "parameters": parameters, "weight_bytes": 2 * parameters, "prefill_ms": {},
           "transformers_version": transformers.__version__, "torch_version": torch.__version__}
    sync = torch.cuda.synchronize
    with torch.no_grad():
        for length, prompt in prompts.items():
            ids = torch.as_tensor(prompt[None, :], device="cuda", dtype=torch.long)
            model(input_ids=ids, use_cache=True)
            run["prefill_ms"][str(length)] = 1e3 * seconds(lambda: model(input_ids=ids, use_cache=True), sync)
        ids = torch.as_tensor(prompts[min(prompts)][None, :], device="cuda", dtype=torch.long)

        def generate(tokens):
            model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                           cache_implementation="static", pad_token_id=0)

        generate(new_tokens)                                                 # warm-up (and any compilation)
        long_run, one_token = seconds(lambda: generate(new_tokens), sync), seconds(lambda: generate(1), sync)
        run["static_cache_tokens_per_second"] = (new_tokens - 1) / (long_run - one_token)
    del model
    torch.cuda.empty_cache()
    return run


def gemv_products(torch):
    """GB/s of weights for few-row products at the decode's matrix shapes: GEMV, the tiled GEMM, cuBLAS."""
    from gpt2_cupy.ops.gemv import gemv_forward
    from gpt2_cupy.dispatch import bf16_product

    xp, rows_tried, results = backend.xp, (1, 2, 4, 8, 16), []
    for N, K in ((4096, 4096), (11008, 4096), (4096, 11008), (32000, 4096), (128256, 2048), (512, 2048)):
        weight = converted(xp.random.standard_normal((N, K), dtype=np.float32), BFLOAT16)
        for R in rows_tried:
            x = converted(xp.random.standard_normal((R, K), dtype=np.float32), BFLOAT16)
            y = xp.empty((R, N), dtype=BFLOAT16)
            entry = {"N": N, "K": K, "rows": R}
            if R <= 8:
                entry["gemv_gb_per_s"] = 2 * N * K / benchmark.seconds_per_call(lambda: gemv_forward(x, weight, out=y)) / 1e9
            entry["tiled_gemm_gb_per_s"] = 2 * N * K / benchmark.seconds_per_call(
                lambda: bf16_product(x, weight, y, transpose_b=True)) / 1e9
            if torch is not None:
                tw, tx = torch.randn(N, K, device="cuda").bfloat16(), torch.randn(R, K, device="cuda").bfloat16()
                entry["cublas_gb_per_s"] = 2 * N * K / benchmark.seconds_per_call(lambda: torch.matmul(tx, tw.T)) / 1e9
            results.append(entry)
    return results


def parse_setting(text):
    """'gemv.WARPS_PER_MULTIPROCESSOR=32,backend.DEPENDENT_LAUNCHES=False' -> [(module, name, value), ...]."""
    changes = []
    for assignment in ([] if text == "default" else text.split(",")):
        target, _, value = assignment.partition("=")
        module_name, _, name = target.strip().rpartition(".")
        try:
            module = importlib.import_module(f"gpt2_cupy.ops.{module_name}")
        except ModuleNotFoundError:
            module = importlib.import_module(f"gpt2_cupy.{module_name}")
        if not hasattr(module, name):
            raise SystemExit(f"--settings {text}: {module.__name__} has no {name}")
        try:
            value = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            value = value.strip()                                            # a plain word: a string
        changes.append((module, name, value))
    return changes


@contextlib.contextmanager
def applied(changes):
    """The module switches set to the changes' values inside the block, and back after it."""
    saved = [(module, name, getattr(module, name)) for module, name, _ in changes]
    try:
        for module, name, value in changes:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def compare_settings(shape, settings, prompt, new_tokens, rounds):
    """Decode tokens/s of the captured step under each setting: {setting: [rate of each round]}. Each setting
    gets its own cache, filled to `prompt` positions (with zeros: the speed does not depend on them), and its
    own capture; the rounds replay new_tokens steps of each setting in turn."""
    model = random_bf16_model(shape)
    xp, steps, failed = backend.xp, {}, {}
    with no_grad():
        for setting in settings:
            cache = model.new_kv_cache(1, prompt + rounds * new_tokens + 2)
            cache.length = prompt
            try:
                with applied(parse_setting(setting)):
                    step = DecodeGraph(model, cache, xp.zeros((1, 1), dtype=np.int64), greedy=True)
                step.graph.replay()                                          # the first replay uploads the graph
            except Exception as error:  # noqa: BLE001  (a setting that does not compile: say so, time the rest)
                failed[setting] = f"{type(error).__name__}: {error}"[:300]
                continue
            steps[setting] = (step, cache.device_lengths)    # the graph reads that array: keep it alive
        rates = {setting: [] for setting in steps}
        for _ in range(rounds):
            for setting, (step, _) in steps.items():
                rates[setting].append(new_tokens / seconds(lambda: [step.graph.replay() for _ in range(new_tokens)],
                                                           backend.synchronize))
    parameters = sum(p.numel() for p in model.parameters())
    del model, steps
    if backend.name == "cuda":
        xp.get_default_memory_pool().free_all_blocks()
    return rates, failed, 2 * parameters


def profile_step(shape, prompt, replays):
    """Where a captured decode step's time goes: its kernels' durations per step from torch.profiler (CUPTI)
    over graph replays, captured without dependent launches so that no kernel overlaps the next and each
    duration is its own; their sum against the step's time without the profiler, the difference being the gaps
    between kernels. Prints a table of kernels by total time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    model = random_bf16_model(shape)
    xp = backend.xp
    with no_grad(), applied(parse_setting("backend.DEPENDENT_LAUNCHES=False")):
        cache = model.new_kv_cache(1, prompt + 2 * replays + 4)
        cache.length = prompt
        step = DecodeGraph(model, cache, xp.zeros((1, 1), dtype=np.int64), greedy=True)
        step.graph.replay()
        step_seconds = seconds(lambda: [step.graph.replay() for _ in range(replays)], backend.synchronize) / replays
        with profile(activities=[ProfilerActivity.CUDA]) as profiler:
            for _ in range(replays):
                step.graph.replay()
            backend.synchronize()
    kernels = [e for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    totals = {}
    for event in kernels:
        name = event.name if len(event.name) < 90 else event.name[:87] + "..."
        count, microseconds = totals.get(name, (0, 0.0))
        totals[name] = (count + 1, microseconds + event.time_range.elapsed_us())
    busy = sum(us for _, us in totals.values()) / replays
    span = (max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)) / replays
    print(f"{NAMES[shape]} profile ({benchmark.measured_on()['device']}, no dependent launches): step "
          f"{1e6 * step_seconds:.1f} us ({1 / step_seconds:.0f} tokens/s) unprofiled; profiled span {span:.1f} us a "
          f"step, kernels busy {busy:.1f} us, gaps {span - busy:.1f} us; {len(kernels) / replays:.0f} kernels a step")
    for name, (count, us) in sorted(totals.items(), key=lambda item: -item[1][1]):
        print(f"  {us / replays:8.1f} us/step  {count / replays:5.1f}x  {us / count:7.2f} us each  {name}")
    del model, step, cache
    xp.get_default_memory_pool().free_all_blocks()


def settings_table(arguments):
    """Prints, shape by shape, each setting's decode tokens/s (median and best of the rounds) against the bound."""
    for setting in arguments.settings:
        parse_setting(setting)                         # a misspelt name stops the run before any model is built
    benchmark.require_gpu()
    bandwidth = benchmark.copy_bandwidth()
    print(f"{benchmark.measured_on()['device']}, batch 1, bf16, the captured decode step after {arguments.prompt} "
          f"positions, {arguments.rounds} rounds of {arguments.new_tokens} tokens (copy: {bandwidth / 1e9:.0f} GB/s)",
          flush=True)
    for shape in arguments.shape:
        rates, failed, weight_bytes = compare_settings(shape, arguments.settings, arguments.prompt,
                                                       arguments.new_tokens, arguments.rounds)
        bound = bandwidth / weight_bytes
        datasheet = benchmark.datasheet_gb_per_s()
        datasheet_bound = datasheet * 1e9 / weight_bytes if datasheet else None
        lines = [f"{NAMES[shape]}: bound {bound:.0f} tokens/s at the copy rate"
                 + (f", {datasheet_bound:.0f} at the datasheet's {datasheet} GB/s" if datasheet_bound else "")]
        for setting, measured in rates.items():
            median, best = float(np.median(measured)), max(measured)
            of_datasheet = f", {median / datasheet_bound:.1%} of the datasheet's" if datasheet_bound else ""
            lines.append(f"  {setting:60} median {median:7.1f} ({median / bound:.1%} of the copy's{of_datasheet})  "
                         f"best {best:7.1f} ({best / bound:.1%})  rounds " + " ".join(f"{r:.0f}" for r in measured))
        lines += [f"  {setting:60} failed: {why}" for setting, why in failed.items()]
        print("\n".join(lines), flush=True)


def measure(arguments):
    benchmark.require_gpu()
    bandwidth = benchmark.copy_bandwidth()
    stored = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results = {"copy_bandwidth_gb_per_s": bandwidth / 1e9, "datasheet_gb_per_s": benchmark.datasheet_gb_per_s(),
               "batch": 1, "shapes": stored.get("shapes", {})}
    torch = testing.torch_or_none()
    for shape in arguments.shape:
        rng = np.random.default_rng(0)
        lengths = sorted({arguments.prompt} | ({arguments.prefill} if shape == "7b" else set()))
        prompts = {length: rng.integers(0, SHAPES[shape]["vocab_size"], length) for length in lengths}
        entry = {"name": NAMES[shape], "prompt_tokens": arguments.prompt, "new_tokens": arguments.new_tokens,
                 "measured_on": benchmark.measured_on(), "runs": {"gpt2_cupy bf16": ours(shape, prompts,
                                                                                         arguments.new_tokens)}}
        if torch is not None:
            try:
                entry["runs"]["transformers bf16"] = transformers_run(torch, shape, prompts, arguments.new_tokens)
            except Exception as error:  # noqa: BLE001  (a transformers version without these names: say so)
                entry["runs"]["transformers bf16"] = {"error": f"{type(error).__name__}: {error}"}
        bound_bytes = entry["runs"]["gpt2_cupy bf16"]["weight_bytes"]
        entry["bound_tokens_per_second"] = bandwidth / bound_bytes
        if results["datasheet_gb_per_s"]:
            entry["datasheet_bound_tokens_per_second"] = results["datasheet_gb_per_s"] * 1e9 / bound_bytes
        results["shapes"][shape] = entry
    if arguments.gemv:
        results["gemv"], results["gemv_measured_on"] = gemv_products(torch), benchmark.measured_on()
    elif "gemv" in stored:  # the table of a run with --gemv, kept with the device and date it was timed on
        results["gemv"] = stored["gemv"]
        results["gemv_measured_on"] = stored.get("gemv_measured_on",
                                                 {"device": stored.get("device"), "date": stored.get("date")})
    return results


def table(results):
    datasheet = results.get("datasheet_gb_per_s")
    lines = [f"batch 1, bf16 (copy: {results['copy_bandwidth_gb_per_s']:.0f} GB/s"
             + (f", datasheet: {datasheet} GB/s)" if datasheet else ")")]
    for shape, entry in results["shapes"].items():
        bound, datasheet_bound = entry["bound_tokens_per_second"], entry.get("datasheet_bound_tokens_per_second")
        lines.append(f"{entry['name']} ({entry['measured_on']['device']}, {entry['measured_on']['date']}): "
                     f"bound {bound:.0f} tokens/s at the copy rate"
                     + (f", {datasheet_bound:.0f} at the datasheet's" if datasheet_bound else ""))
        for name, run in entry["runs"].items():
            if "error" in run:
                lines.append(f"  {name:20} not run: {run['error']}")
                continue
            rates = {k: v for k, v in run.items() if k.endswith("tokens_per_second")}
            for kind, rate in rates.items():
                lines.append(f"  {name:20} {kind:34} {rate:8.1f} ({rate / bound:.0%} of the copy's bound"
                             + (f", {rate / datasheet_bound:.0%} of the datasheet's)" if datasheet_bound else ")"))
            prefill = ", ".join(f"{length} tokens {ms:.1f} ms" for length, ms in run["prefill_ms"].items())
            lines.append(f"  {name:20} prefill: {prefill}")
    for entry in results.get("gemv", []):
        lines.append("  gemv N={N:6} K={K:5} R={rows:2}: ".format(**entry) + "  ".join(
            f"{k[:-9]} {v:6.0f} GB/s" for k, v in entry.items() if k.endswith("_gb_per_s")))
    return lines


def main():
    parser = argparse.ArgumentParser(prog="python -m bench.llama_generation", description=__doc__.split("\n")[0])
    parser.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens before decoding")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prefill", type=int, default=2048, help="a longer prompt timed for 7b's prefill")
    parser.add_argument("--gemv", action="store_true", help="also time the few-row products alone")
    parser.add_argument("--settings", nargs="+", metavar="MODULE.NAME=VALUE[,...]",
                        help="only compare the captured decode step under these module switches (see above)")
    parser.add_argument("--rounds", type=int, default=5, help="--settings: turns of new-tokens replays each")
    parser.add_argument("--profile", action="store_true", help="only the captured step's kernels, torch.profiler")
    arguments = parser.parse_args()
    if arguments.profile:
        benchmark.require_gpu()
        for shape in arguments.shape:
            profile_step(shape, arguments.prompt, arguments.new_tokens)
        return
    if arguments.settings:
        settings_table(arguments)
        return
    results = measure(arguments)
    benchmark.report("llama_generation", results, table(results))


if __name__ == "__main__":
    main()
