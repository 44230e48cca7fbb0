"""Llama generation on a GPU: prefill and decode against Hugging Face transformers, at Llama 3.2 1B's shape.

    python -m bench.llama_generation [--prompt 512] [--new-tokens 128]

A model of Llama 3.2 1B's sizes (16 layers, 2048 channels, 32 query and 8 key-value heads of 128, MLP 8192,
vocabulary 128256, tied embeddings) with random weights: the speed does not depend on them. Greedy decoding
from a random prompt, batch 1, the next token chosen on the device (argmax), so that a step waits for nothing:
- prefill: the prompt through the model into an empty KV cache, milliseconds;
- decode: new_tokens steps of one token over the cache, tokens per second, and the bytes of weights each
  token reads (all of them once) as GB/s against the copy bandwidth: decoding at batch 1 is bound by it.
Ours runs float32 (Llama's kernels take float32); transformers' LlamaForCausalLM runs float32 and bfloat16.

Writes bench/llama_generation.json, prints a table.
"""

import argparse
import time

import numpy as np

from gpt2_cupy import backend, benchmark, testing
from gpt2_cupy.autograd import manual_seed, no_grad
from gpt2_cupy.llama import Llama, LlamaConfig

ONE_B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048, rope_theta=500000.0,
             tie_word_embeddings=True)


def seconds(run, synchronize):
    synchronize()
    started = time.perf_counter()
    run()
    synchronize()
    return time.perf_counter() - started


def ours(prompt, new_tokens):
    manual_seed(0)
    model = Llama(LlamaConfig(**ONE_B))
    model.eval()
    xp = backend.xp
    ids = xp.asarray(prompt[None, :].astype(np.int32))
    parameters = sum(p.data.size for p in model.parameters())

    def prefill():
        cache = model.new_kv_cache(1, len(prompt) + new_tokens + 1)
        logits, _ = model(ids, kv_cache=cache)
        return cache, logits

    def decode(cache, logits):
        for _ in range(new_tokens):
            token = logits.data[:, -1].argmax(axis=-1).astype(np.int32).reshape(1, 1)
            logits, _ = model(token, kv_cache=cache)

    with no_grad():
        prefill()                                                # compiles every kernel
        prefill_seconds = seconds(prefill, backend.synchronize)
        decode(*prefill())                                       # the decode shapes once
        cache, logits = prefill()
        decode_seconds = seconds(lambda: decode(cache, logits), backend.synchronize)
    del model, cache, logits
    xp.get_default_memory_pool().free_all_blocks()
    return {"dtype": "float32", "parameters": parameters, "weight_bytes": 4 * parameters,
            "prefill_ms": 1e3 * prefill_seconds, "decode_tokens_per_second": new_tokens / decode_seconds}


def transformers_run(torch, prompt, new_tokens, dtype_name):
    import transformers

    config = transformers.LlamaConfig(**ONE_B, head_dim=128)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    ids = torch.as_tensor(prompt[None, :], device="cuda", dtype=torch.long)
    parameters = sum(p.numel() for p in model.parameters())

    def prefill():
        cache = transformers.DynamicCache()
        output = model(input_ids=ids, past_key_values=cache, use_cache=True)
        return output.past_key_values, output.logits

    def decode(cache, logits):
        for _ in range(new_tokens):
            token = logits[:, -1].argmax(dim=-1, keepdim=True)
            output = model(input_ids=token, past_key_values=cache, use_cache=True)
            cache, logits = output.past_key_values, output.logits

    with torch.no_grad():
        prefill()
        prefill_seconds = seconds(prefill, torch.cuda.synchronize)
        decode(*prefill())
        cache, logits = prefill()
        decode_seconds = seconds(lambda: decode(cache, logits), torch.cuda.synchronize)
    del model, cache, logits
    torch.cuda.empty_cache()
    return {"dtype": dtype_name, "parameters": parameters, "weight_bytes": parameters * (4 if dtype_name == "float32" else 2),
            "prefill_ms": 1e3 * prefill_seconds, "decode_tokens_per_second": new_tokens / decode_seconds}


def measure(arguments):
    benchmark.require_gpu()
    results = {**benchmark.measured_on(), "copy_bandwidth_gb_per_s": benchmark.copy_bandwidth() / 1e9,
               "shape": "Llama 3.2 1B", "prompt_tokens": arguments.prompt, "new_tokens": arguments.new_tokens,
               "runs": {}}
    prompt = np.random.default_rng(0).integers(0, ONE_B["vocab_size"], arguments.prompt)
    results["runs"]["gpt2_cupy float32"] = ours(prompt, arguments.new_tokens)
    torch = testing.torch_or_none()
    if torch is not None:
        for dtype_name in ("float32", "bfloat16"):
            try:
                results["runs"][f"transformers {dtype_name}"] = transformers_run(torch, prompt, arguments.new_tokens,
                                                                                 dtype_name)
            except Exception as error:  # noqa: BLE001  (a transformers version without these names: say so)
                results["runs"][f"transformers {dtype_name}"] = {"error": f"{type(error).__name__}: {error}"}
    for run in results["runs"].values():
        if "decode_tokens_per_second" in run:
            run["decode_gb_per_s"] = run["weight_bytes"] * run["decode_tokens_per_second"] / 1e9
    return results


def table(results):
    lines = [f"{results['device']}, {results['date']}: {results['shape']}, prompt {results['prompt_tokens']}, "
             f"{results['new_tokens']} new tokens, batch 1 (copy: {results['copy_bandwidth_gb_per_s']:.0f} GB/s)"]
    for name, run in results["runs"].items():
        if "error" in run:
            lines.append(f"  {name:22} not run: {run['error']}")
            continue
        lines.append(f"  {name:22} prefill {run['prefill_ms']:8.2f} ms   decode {run['decode_tokens_per_second']:7.1f} "
                     f"tokens/s  {run['decode_gb_per_s']:6.0f} GB/s of weights "
                     f"({run['decode_gb_per_s'] / results['copy_bandwidth_gb_per_s']:.0%} of copy)")
    return lines


def main():
    parser = argparse.ArgumentParser(prog="python -m bench.llama_generation", description=__doc__.split("\n")[0])
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=128)
    results = measure(parser.parse_args())
    benchmark.report("llama_generation", results, table(results))


if __name__ == "__main__":
    main()
