"""The course preset trained on both corpora on a GPU, and text from it (chapter 14's closing results).

    python -m bench.course_runs                      the preset's 1000 steps: bench/course_runs.json, .png
    python -m bench.course_runs --steps 5000 --seconds 400 --concurrent --name course_runs_long
    python -m bench.course_runs --model llama        a Llama of the same size: bench/course_runs_llama.json, .png

Trains gpt2_cupy.train's `course` preset (6 layers, 6 heads, 384 channels, T = 256, B = 64, dropout 0.2)
on tinyshakespeare, then on aozora; --concurrent trains both at once, each in its own process on the one
GPU. A run stops at its last step, or cleanly (checkpoint saved) once --seconds have passed. Then each run
writes text from its checkpoint with the lowest validation loss (best.npz).

Both corpora are small (0.35M and 0.96M training tokens, against 16,384 tokens a step): the second command
shows what training far past the preset's 1000 steps does, the model memorising its training text.

--model llama trains the Llama of the preset's size (gpt2_cupy.train.llama_config: RMSNorm, RoPE, SwiGLU, no
dropout, untied output head) on the same batches, for chapter 17a's comparison with GPT-2.

Writes bench/NAME.json (validation curves, the lowest validation loss and its step, bits per character,
tokens per second, the samples) and bench/NAME.png.
"""

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from gpt2_cupy import benchmark, data
from gpt2_cupy.sample import load_model, sample_text
from gpt2_cupy.train import Trainer, make_config, plot_losses

HERE = Path(__file__).resolve().parent
CORPORA = ("tinyshakespeare", "aozora")
PROMPTS = {"tinyshakespeare": ["ROMEO:\n", "KING HENRY VI:\n"], "aozora": ["吾輩は", "先生は"]}
SAMPLE = dict(max_new_tokens=200, temperature=0.8, top_k=50, seed=0)
TRAIN_LOSS_EVERY = 10  # steps between the training losses kept in the JSON (the full log stays in runs/)


def characters_per_token(corpus_files):
    """Characters of the validation text per token: turns nats per token into bits per character."""
    tokenizer = data.Tokenizer(corpus_files.tokenizer)
    ids = np.asarray(data.read_tokens(corpus_files.val))
    return len(tokenizer.decode([int(i) for i in ids])) / len(ids)


def train_one(corpus, steps, seconds, out_dir, model="gpt2"):
    """Train one corpus (steps None: the preset's), sample from its best checkpoint; a JSON-able summary."""
    config = make_config(corpus=corpus, preset="course", max_steps=steps, out_dir=out_dir, progress=False,
                         model=model)
    trainer = Trainer(config)
    # Past the time budget, the loop finishes its step, saves and stops, as after a Ctrl-C.
    deadline = threading.Timer(seconds, lambda: setattr(trainer, "stop_requested", True))
    if math.isfinite(seconds):
        deadline.start()
    started = time.perf_counter()
    try:
        records = trainer.run()
    finally:
        deadline.cancel()
    wall = time.perf_counter() - started
    evaluations = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    best_step, best_loss = min(evaluations, key=lambda evaluation: evaluation[1])
    per_character = characters_per_token(trainer.corpus)
    tokens_per_second = [r["tokens_per_second"] for r in records if "tokens_per_second" in r][10:]
    model, tokenizer = load_model(trainer.best_path)
    samples = {prompt: sample_text(model, tokenizer, prompt, **SAMPLE) for prompt in PROMPTS[corpus]}
    return {
        "model": config.model, "steps": trainer.step, "planned_steps": config.max_steps, "wall_seconds": wall,
        "dropout": getattr(trainer.model_config, "dropout", 0.0),   # Llama has none
        "parameters": trainer.model.get_num_params(), "vocab_size": trainer.model_config.vocab_size,
        "tokens_per_step": config.batch_size * config.block_size * config.grad_accum,
        "median_tokens_per_second": statistics.median(tokens_per_second) if tokens_per_second else None,
        "validation": evaluations,
        "train": [(r["step"], r["loss"]) for r in records if "loss" in r and r["step"] % TRAIN_LOSS_EVERY == 0],
        "lowest_validation_loss": best_loss, "lowest_at_step": best_step,
        "last_validation_loss": evaluations[-1][1],
        "characters_per_token": per_character,
        "lowest_bits_per_character": best_loss / math.log(2) / per_character,
        "samples": samples, "sampling": SAMPLE,
    }


def plot(results, path):
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 3.5), layout="constrained")
    for axes, corpus in zip(figure.subplots(1, len(CORPORA)), CORPORA):
        run = results["runs"][corpus]
        records = [{"step": s, "loss": v} for s, v in run["train"]] + [{"step": s, "val_loss": v}
                                                                     for s, v in run["validation"]]
        plot_losses(records, axes=axes, title=f"{corpus}: lowest validation loss {run['lowest_validation_loss']:.3f} "
                                              f"at step {run['lowest_at_step']}")
    figure.savefig(path, dpi=100)


def table(results):
    at_once = ", both runs at once on one GPU" if results["concurrent"] else ""
    lines = [f"{results['device']}, {results['date']}: the course preset, {results.get('model', 'gpt2')}{at_once}"]
    for corpus, run in results["runs"].items():
        lines.append(f"  {corpus:16s} {run['steps']} steps in {run['wall_seconds']:.0f} s "
                     f"({run['median_tokens_per_second']:,.0f} tokens/s), validation loss lowest "
                     f"{run['lowest_validation_loss']:.4f} at step {run['lowest_at_step']} "
                     f"({run['lowest_bits_per_character']:.3f} bits/character), last {run['last_validation_loss']:.4f}")
        for prompt, text in run["samples"].items():
            lines.append(f"    --- {prompt!r}\n{prompt}{text}")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, help="default: the preset's")
    parser.add_argument("--seconds", type=float, default=math.inf, help="each run's time budget")
    parser.add_argument("--concurrent", action="store_true", help="train both corpora at once")
    parser.add_argument("--model", choices=("gpt2", "llama"), default="gpt2")
    parser.add_argument("--name", help="writes bench/NAME.json and bench/NAME.png (default: course_runs, with "
                                       "_llama for --model llama)")
    parser.add_argument("--corpus", choices=CORPORA, help="train this one in this process (used internally)")
    parser.add_argument("--part", help="where --corpus writes its summary (used internally)")
    parser.add_argument("--out-dir", default="runs/course-runs")
    arguments = parser.parse_args(argv)
    arguments.name = arguments.name or ("course_runs" + ("_llama" if arguments.model == "llama" else ""))
    benchmark.require_gpu("thousands of steps of the course preset take hours on the CPU executor")

    def train(corpus):
        return train_one(corpus, arguments.steps, arguments.seconds, f"{arguments.out_dir}/{arguments.model}-{corpus}",
                         arguments.model)

    if arguments.corpus:
        Path(arguments.part).write_text(json.dumps(train(arguments.corpus), ensure_ascii=False))
        return 0
    if not arguments.concurrent:
        runs = {corpus: train(corpus) for corpus in CORPORA}
    else:
        with tempfile.TemporaryDirectory() as scratch:
            parts = {corpus: Path(scratch) / f"{corpus}.json" for corpus in CORPORA}
            options = ["--seconds", str(arguments.seconds), "--out-dir", arguments.out_dir, "--model", arguments.model]
            if arguments.steps is not None:
                options += ["--steps", str(arguments.steps)]
            processes = [subprocess.Popen([sys.executable, "-m", "bench.course_runs", "--corpus", corpus,
                                           "--part", str(part), *options]) for corpus, part in parts.items()]
            failed = [corpus for corpus, process in zip(CORPORA, processes) if process.wait() != 0]
            if failed:
                raise SystemExit(f"training failed for {', '.join(failed)}")
            runs = {corpus: json.loads(part.read_text()) for corpus, part in parts.items()}
    results = {**benchmark.measured_on(), "model": arguments.model, "concurrent": arguments.concurrent, "runs": runs}
    plot(results, HERE / f"{arguments.name}.png")
    benchmark.report(arguments.name, results, table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
