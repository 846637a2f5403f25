"""The lossy levers (``optimizer.state_dtype bf16|int8``) against fp32 AdamW states: what they
cost in validation loss and speed for what they save in optimizer memory. Reported, not a bar:
the solver never turns them on by itself.

    python benchmarks/lossy_levers.py --quick                # the plumbing (< 2 min)
    python benchmarks/lossy_levers.py --results              # 300 steps of the tiny recipe per dtype
    python benchmarks/lossy_levers.py --step_cost --results  # the planner's charge for each dtype's step vs timed
    python benchmarks/lossy_levers.py --placement fsdp_offload --results  # fp32 and bf16 moments on the host

The tiny recipe (``recipes/code_lm_tiny.yaml``: a 3.2M-parameter GPT-2 on the Python standard
library, fp32 on CPU), 2 ranks under DDP, the same seed and data order for every dtype; the
validation loss (nats per token over the recipe's 128 validation samples) at the last step, the
last training loss, the median tokens/s after the first two steps, and the optimizer state per
rank the engine's accounting predicts for that dtype (``memtrain memory``'s report).
``--placement fsdp_offload`` trains under FSDP2's optimizer offload with all of the optimizer state on
the host (``backend.offload optimizer``; fp32 master weights, the moments fp32 or bf16; int8 is not
offered there): the lossy host bytes.

``--step_cost`` checks what the placement planner charges a lossier dtype before it may choose it
(``memtrain.levers.optimizer_state.step_seconds_over_fp32``: the parameters a rank steps over the
optimizer rate measured on one matrix in a process with a rank's threads) against the step time
of the same runs (``--steps`` steps, the first 2 left out, median step; every dtype in
alternating order, ``--repeats`` times): per repeat, the dtype's median step minus fp32's in the
same repeat; min/median/max over repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import CPU_ARGS, REPO, emit, run_cli, run_memtrain, scratch_dir, step_times, tokens_per_s  # noqa: E402

from memtrain.levers.optimizer_state import STATE_DTYPES  # noqa: E402


def predicted_state_bytes(base: list[str], nproc: int) -> dict[str, int]:
    """``memtrain memory``'s optimizer state per rank for each dtype (its JSON report)."""
    out = run_cli(["memory", *base, "--world_size", str(nproc)])
    return json.loads(out[out.index("{"):])["optimizer_state_bytes"]


PLACEMENTS = {"ddp": ["--backend.name", "ddp"],
              "fsdp_offload": ["--backend.name", "fsdp", "--backend.offload", "optimizer"]}
"""The engines the dtypes are compared under (``--placement``)."""


def measure(steps: int, nproc: int, dtypes: tuple[str, ...], quick: bool = False, placement: str = "ddp") -> list[dict]:
    recipe = CPU_ARGS if quick else ["--config", str(REPO / "recipes" / "code_lm_tiny.yaml"), "--precision", "fp32"]
    base = recipe + [*PLACEMENTS[placement], "--training.max_steps", str(steps), "--training.eval_every", str(steps),
                     "--checkpoint.every_steps", "0"]
    predicted = predicted_state_bytes(base, nproc)
    rows = []
    for dtype in dtypes:
        out = scratch_dir(f"lossy_{dtype}_")
        records = run_memtrain(base + ["--optimizer.state_dtype", dtype], out, nproc)
        shutil.rmtree(out, ignore_errors=True)
        steps_done = [r for r in records if "loss" in r]
        rows.append({"benchmark": "lossy_levers", **({"placement": placement} if placement != "ddp" else {}),
                     "optimizer_state_dtype": dtype, "steps": steps, "world_size": nproc,
                     "val_loss": next(r["val_loss"] for r in reversed(records) if "val_loss" in r),
                     "last_loss": steps_done[-1]["loss"], "tokens_per_s": tokens_per_s(steps_done[2:]),
                     "predicted_optimizer_state_bytes": predicted[dtype]})
    return rows


def step_cost(steps: int, repeats: int, nproc: int, quick: bool = False) -> list[dict]:
    """Per lossier dtype: the planner's charge (seconds per step, predicted) and the measured extra
    step seconds over fp32 (one value per repeat; min/median/max)."""
    import torch

    from memtrain.levers.optimizer_state import LOSSY, step_seconds_over_fp32
    from memtrain.memory.machine import Machine, optimizer_params_per_s
    from memtrain.planning.placement import Placement

    recipe = CPU_ARGS if quick else ["--config", str(REPO / "recipes" / "code_lm_tiny.yaml"), "--precision", "fp32"]
    base = recipe + ["--backend.name", "ddp", "--training.max_steps", str(steps), "--training.eval_every", "0",
                     "--checkpoint.every_steps", "0"]
    out = run_cli(["memory", *base, "--world_size", str(nproc)])
    n_params = json.loads(out[out.index("{"):])["parameters"]
    step_s: dict[str, list[float]] = {d: [] for d in STATE_DTYPES}
    for rep in range(repeats):
        for dtype in STATE_DTYPES[rep % 3:] + STATE_DTYPES[:rep % 3]:  # each dtype first in turn
            folder = scratch_dir(f"lossy_cost_{dtype}_")
            records = [r for r in run_memtrain(base + ["--optimizer.state_dtype", dtype], folder, nproc) if "loss" in r]
            shutil.rmtree(folder, ignore_errors=True)
            step_s[dtype].append(statistics.median(step_times(records[2:])))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # a rank's threads, as its planner measures
    machine = Machine(None, None, nproc, "cpu", 0.0, 0.0, 0, None, optimizer_params_per_s)
    rows = []
    for dtype in LOSSY:
        extra = [a - b for a, b in zip(step_s[dtype], step_s["fp32"])]
        charged = step_seconds_over_fp32(Placement("ddp", None, "none", state_dtype=dtype), n_params, nproc, machine)
        rows.append({"benchmark": "lossy_step_cost", "optimizer_state_dtype": dtype, "world_size": nproc,
                     "steps": steps, "repeats": repeats, "parameters": n_params, "charged_s": charged,
                     "step_s": step_s[dtype], "fp32_step_s": step_s["fp32"],
                     "measured_extra_s": {"min": min(extra), "median": statistics.median(extra), "max": max(extra)}})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 300; --step_cost: 30)")
    ap.add_argument("--quick", action="store_true", help="the benchmarks' 0.4M model, 4 steps per dtype, nothing written")
    ap.add_argument("--results", action="store_true", help="append to benchmarks/results/lossy_levers-cpu.jsonl "
                    "(--step_cost: lossy_step_cost-cpu.jsonl)")
    ap.add_argument("--step_cost", action="store_true", help="the planner's charge for each lossier dtype's step "
                    "against the timed step (--repeats)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--placement", choices=list(PLACEMENTS), default="ddp", help="the engine (fsdp_offload: FSDP2's "
                    "optimizer offload, all on the host; fp32 and bf16 moments)")
    args = ap.parse_args(argv)
    if args.step_cost:
        steps = 4 if args.quick else args.steps or 30
        for row in step_cost(steps, 1 if args.quick else args.repeats, 2, args.quick):
            emit("lossy_step_cost", "cpu", row, args.results and not args.quick)
        return 0
    dtypes = STATE_DTYPES if args.placement == "ddp" else ("fp32", "bf16")
    for row in measure(4 if args.quick else args.steps or 300, 2, dtypes, args.quick, args.placement):
        emit("lossy_levers", "cpu", row, args.results and not args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
