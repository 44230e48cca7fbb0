"""Loss curves of one GPT trained in float32 and in bf16 autocast, from the same weights and the same batches.

    GPT2_CUPY_BACKEND=cuda python -m bench.train_bf16_parity --preset course --steps 1000
                                          writes bench/train_bf16_parity.json (the chapter's loss curves)
    python -m bench.train_bf16_parity --preset tiny --steps 4 --eval-interval 2 --out /tmp/parity.json
                                          a quick look on any backend (the CPU executor's tensor cores are slow)

Both runs are gpt2_cupy.train's Trainer on the same corpus, preset and seed: the same initial weights,
the same training windows, the same dropout masks, the same learning-rate schedule, gradient clipping and
AdamW. The bf16 run differs in one line: the model's forward runs inside
gpt2_cupy.autocast(device_type="cuda", dtype=bfloat16), for training and for evaluation, as nanoGPT wraps
both in its `ctx`. The masters, AdamW's moments and the loss stay float32 (gpt2_cupy.amp).

The file holds each run's training loss at every step, its validation loss at every evaluation, and the
largest relative difference between the two validation curves (issue 28 asks for at most 2 %).
"""

import argparse
import datetime
import json
import tempfile
import time
from pathlib import Path

from gpt2_cupy import amp, backend, bfloat16
from gpt2_cupy.train import Trainer, make_config

OUT = Path(__file__).resolve().parent / "train_bf16_parity.json"


def train(precision, preset, steps, eval_interval, corpus, out_dir):
    """{"train_loss": [...], "val_loss": [[step, loss], ...], "seconds"}: one run of `steps` optimizer steps."""
    config = make_config(corpus=corpus, preset=preset, max_steps=steps, out_dir=out_dir, progress=False)
    trainer = Trainer(config)
    if precision == "bf16":
        trainer.model.forward = amp.autocast(device_type="cuda", dtype=bfloat16)(trainer.model.forward)
    train_loss, val_loss = [], []
    started = time.perf_counter()
    for step in range(steps):
        loss, _, _ = trainer.train_step()
        train_loss.append(loss)
        if trainer.step % eval_interval == 0 or trainer.step == steps:
            val_loss.append([trainer.step, trainer.evaluate()])
            print(f"{precision:8} step {trainer.step:5d}  train {loss:.4f}  val {val_loss[-1][1]:.4f}", flush=True)
    return {"train_loss": train_loss, "val_loss": val_loss, "seconds": time.perf_counter() - started}


def main():
    parser = argparse.ArgumentParser(prog="python -m bench.train_bf16_parity", description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="course", help="gpt2_cupy.train's preset: tiny, course or gpt2")
    parser.add_argument("--corpus", default="tinyshakespeare")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--eval-interval", type=int, default=100)
    parser.add_argument("--out", type=Path, default=OUT, help=f"the json file to write (default {OUT})")
    arguments = parser.parse_args()
    runs = {}
    with tempfile.TemporaryDirectory() as scratch:   # the Trainer's checkpoints and logs are not kept
        for precision in ("float32", "bf16"):
            runs[precision] = train(precision, arguments.preset, arguments.steps, arguments.eval_interval,
                                    arguments.corpus, str(Path(scratch) / precision))
    differences = [abs(bf16 - float32) / float32
                   for (_, float32), (_, bf16) in zip(runs["float32"]["val_loss"], runs["bf16"]["val_loss"])]
    result = {
        "description": __doc__.split("\n")[0],
        "device": backend.device_name(),
        "backend": backend.name,
        "date": datetime.date.today().isoformat(),
        "preset": arguments.preset,
        "corpus": arguments.corpus,
        "steps": arguments.steps,
        "runs": runs,
        "largest_relative_val_difference": max(differences),
    }
    arguments.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"largest relative difference of the validation losses: {max(differences):.2%}; written to {arguments.out}")


if __name__ == "__main__":
    main()
