"""The lossy levers (``optimizer.state_dtype bf16|int8``) against fp32 AdamW states: what they
cost in validation loss and speed for what they save in optimizer memory. Reported, not a bar:
the solver never turns them on by itself.

    python benchmarks/lossy_levers.py --quick                # the plumbing (< 2 min)
    python benchmarks/lossy_levers.py --results              # 300 steps of the tiny recipe per dtype

The tiny recipe (``recipes/code_lm_tiny.yaml``: a 3.2M-parameter GPT-2 on the Python standard
library, fp32 on CPU), 2 ranks under DDP, the same seed and data order for every dtype; the
validation loss (nats per token over the recipe's 128 validation samples) at the last step, the
last training loss, the median tokens/s after the first two steps, and the optimizer state per
rank the engine's accounting predicts for that dtype (``memtrain memory``'s report).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import CPU_ARGS, REPO, emit, run_cli, run_memtrain, scratch_dir, tokens_per_s  # noqa: E402

from memtrain.levers.optimizer_state import STATE_DTYPES  # noqa: E402


def predicted_state_bytes(base: list[str], nproc: int) -> dict[str, int]:
    """``memtrain memory``'s optimizer state per rank for each dtype (its JSON report)."""
    out = run_cli(["memory", *base, "--world_size", str(nproc)])
    return json.loads(out[out.index("{"):])["optimizer_state_bytes"]


def measure(steps: int, nproc: int, dtypes: tuple[str, ...], quick: bool = False) -> list[dict]:
    recipe = CPU_ARGS if quick else ["--config", str(REPO / "recipes" / "code_lm_tiny.yaml"), "--precision", "fp32"]
    base = recipe + ["--backend.name", "ddp", "--training.max_steps", str(steps), "--training.eval_every", str(steps),
                     "--checkpoint.every_steps", "0"]
    predicted = predicted_state_bytes(base, nproc)
    rows = []
    for dtype in dtypes:
        out = scratch_dir(f"lossy_{dtype}_")
        records = run_memtrain(base + ["--optimizer.state_dtype", dtype], out, nproc)
        shutil.rmtree(out, ignore_errors=True)
        steps_done = [r for r in records if "loss" in r]
        rows.append({"benchmark": "lossy_levers", "optimizer_state_dtype": dtype, "steps": steps, "world_size": nproc,
                     "val_loss": next(r["val_loss"] for r in reversed(records) if "val_loss" in r),
                     "last_loss": steps_done[-1]["loss"], "tokens_per_s": tokens_per_s(steps_done[2:]),
                     "predicted_optimizer_state_bytes": predicted[dtype]})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--quick", action="store_true", help="the benchmarks' 0.4M model, 4 steps per dtype, nothing written")
    ap.add_argument("--results", action="store_true", help="append to benchmarks/results/lossy_levers-cpu.jsonl")
    args = ap.parse_args(argv)
    for row in measure(4 if args.quick else args.steps, 2, STATE_DTYPES, args.quick):
        emit("lossy_levers", "cpu", row, args.results and not args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
