"""OOM stress: "if I set the batch too large, what does memtrain cost me, and does it lose anything?"

    python benchmarks/oom_stress.py --device cpu --quick            # CI size, injected OOMs (< 60 s)
    python benchmarks/oom_stress.py --device cpu --engines ddp,fsdp,zero2,zero3 --results --plot oom.png
    python benchmarks/oom_stress.py --device cuda --memory_cap_gib 12 --engines ddp,fsdp,zero3

Steady scenario, per engine: start at a micro-batch equal to the whole per-rank batch, let
memtrain recover, continue ``--steps``; then the best static plan found by hand (each
power-of-two micro-batch, largest first, with activation checkpointing off and on, recovery
off), and a run started at the plan memtrain settled on. Reported: OOMs, seconds from the first
OOM to the first completed step, final plan, tokens/s after recovery, tokens/s of the best
static plan and their ratio, samples lost or duplicated (``batch_fingerprint`` against the
reference run; must be 0), and the largest relative loss difference against it.

Spike scenario (``--scenario spike``): OOMs only on rare steps (the long inputs of variable-length
data), every ``--spike_every`` steps; memtrain shrinks and grows back after ``--grow_back_window``
steps. Reported: shrinks, grow-backs, and tokens/s against a run that never grows back.

On CPU, OOMs are injected (``faults.oom_above_tokens``: a micro-batch of more than 4 × seq_len
tokens "does not fit"); on CUDA they are real, under ``torch.cuda.set_per_process_memory_fraction``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (CPU_ARGS, ENGINES, GPU_ARGS, RunFailed, bar_chart, emit, run_memtrain,  # noqa: E402
                    scratch_dir, tokens_per_s)

OOM_EVENTS = ("oom_shrink", "activation_checkpointing_on", "grow_back_failed")


def scenario_args(device: str, nproc: int, cap_gib: float) -> tuple[list[str], int, list[str]]:
    """(base arguments, per-rank batch, OOM-making arguments) for the device."""
    if device == "cuda":
        per_rank = 32
        base = GPU_ARGS + ["--training.global_batch_size", str(per_rank * nproc), "--precision", "bf16"]
        return base, per_rank, ["--memory.cuda_memory_cap_gib", str(cap_gib)]
    per_rank = 16
    base = CPU_ARGS + ["--training.global_batch_size", str(per_rank * nproc)]
    return base, per_rank, ["--faults.oom_above_tokens", str(4 * 64)]


def plan_events(records: list[dict]) -> list[dict]:
    return [e for r in records for e in r.get("plan_changes", []) if e["event"] != "checkpoint_saved"]


def compare(records: list[dict], reference: list[dict]) -> tuple[int, float]:
    """(samples lost or duplicated, max relative loss difference) of two runs of the same steps."""
    lost = sum(a["batch_fingerprint"] != b["batch_fingerprint"] for a, b in zip(records, reference))
    lost += abs(len(records) - len(reference))
    rel = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(records, reference))
    return lost, rel


def best_static(base: list[str], per_rank: int, nproc: int, quick: bool, start_micro: int) -> dict:
    """Try power-of-two micro-batches by hand (largest first, from ``start_micro``; recovery
    off) with activation checkpointing off and on (quick: off only); the fastest plan that fits."""
    best = {"tokens_per_s": 0.0, "plan": None, "activation_checkpointing": None}
    for ac in (["off"] if quick else ["off", "on"]):
        micro = start_micro
        while micro >= 1:
            out = scratch_dir("static")
            try:
                records = run_memtrain(base + ["--training.micro_batch_size", str(micro), "--memory.oom_recovery", "false",
                                               "--memory.activation_checkpointing", ac], out, nproc)
            except RunFailed:
                micro //= 2  # out of memory: try half
                continue
            finally:
                shutil.rmtree(out, ignore_errors=True)
            tps = tokens_per_s(records[1:])
            if tps > best["tokens_per_s"]:
                best = {"tokens_per_s": tps, "plan": f"{micro}x{per_rank // micro}", "activation_checkpointing": ac}
            break
    return best


def steady(engine: str, args) -> dict:
    base, per_rank, oom = scenario_args(args.device, args.nproc, args.memory_cap_gib)
    base = base + ENGINES[engine] + ["--training.max_steps", str(args.steps), "--memory.grow_back_window", "0"]
    out = scratch_dir("recover")
    records = run_memtrain(base + oom + ["--training.micro_batch_size", str(per_rank)], out, args.nproc)
    shutil.rmtree(out, ignore_errors=True)
    events = plan_events(records)
    ooms = sum(e["event"] in OOM_EVENTS for e in events)
    last_change = max((e["step"] for e in events), default=0)
    after = [r for r in records if r["step"] > last_change]
    first_done = next((r for r in records if r["step"] >= events[0]["step"]), None) if events else None
    final_micro = records[-1]["micro_batch_size"]

    out = scratch_dir("reference")  # started at the plan memtrain found
    reference = run_memtrain(base + oom + ["--training.micro_batch_size", str(final_micro)], out, args.nproc)
    shutil.rmtree(out, ignore_errors=True)
    lost, rel = compare(records, reference)
    # quick: start the search one step above the recovered plan instead of at the whole batch
    static = best_static(base + oom, per_rank, args.nproc, args.quick,
                         min(per_rank, 2 * final_micro) if args.quick else per_rank)
    recovered_tps = tokens_per_s(after[1:] if len(after) > 2 else after)
    return {
        "benchmark": "oom_stress", "scenario": "steady", "device": args.device, "engine": engine,
        "world_size": args.nproc, "steps": args.steps, "start_plan": f"{per_rank}x1",
        "ooms": ooms, "first_oom_to_first_step_s": (first_done["elapsed_s"] - events[0]["elapsed_s"]) if events else 0.0,
        "final_plan": f"{final_micro}x{records[-1]['gradient_accumulation_steps']}",
        "final_activation_checkpointing": any(e["event"] == "activation_checkpointing_on" for e in events),
        "tokens_per_s_after_recovery": recovered_tps,
        "best_static_plan": static["plan"], "best_static_activation_checkpointing": static["activation_checkpointing"],
        "best_static_tokens_per_s": static["tokens_per_s"],
        "ratio_to_best_static": recovered_tps / static["tokens_per_s"] if static["tokens_per_s"] else None,
        "samples_lost_or_duplicated": lost, "max_rel_loss_diff_vs_reference": rel,
    }


def spike(engine: str, args) -> dict:
    base, per_rank, oom = scenario_args(args.device, args.nproc, args.memory_cap_gib)
    spikes = list(range(3, args.steps + 1, args.spike_every))
    if args.device == "cpu":
        oom = oom + ["--faults.oom_at_steps", str(spikes)]
    base = base + ENGINES[engine] + ["--training.max_steps", str(args.steps), "--training.micro_batch_size", str(per_rank)]
    results = {}
    for name, window in (("grow_back", args.grow_back_window), ("never_grow", 0)):
        out = scratch_dir(name)
        results[name] = run_memtrain(base + oom + ["--memory.grow_back_window", str(window)], out, args.nproc)
        shutil.rmtree(out, ignore_errors=True)
    events = plan_events(results["grow_back"])
    lost, _ = compare(results["grow_back"], results["never_grow"])
    tps, tps_never = (tokens_per_s(results[k][1:]) for k in ("grow_back", "never_grow"))
    return {
        "benchmark": "oom_stress", "scenario": "spike", "device": args.device, "engine": engine,
        "world_size": args.nproc, "steps": args.steps, "spike_steps": spikes if args.device == "cpu" else None,
        "grow_back_window": args.grow_back_window,
        "shrinks": sum(e["event"] == "oom_shrink" for e in events),
        "grow_backs": sum(e["event"] == "grow_back" for e in events),
        "grow_backs_failed": sum(e["event"] == "grow_back_failed" for e in events),
        "tokens_per_s": tps, "tokens_per_s_never_grow": tps_never,
        "ratio_to_never_grow": tps / tps_never if tps_never else None,
        "samples_lost_or_duplicated": lost,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--engines", default="ddp", help="comma-separated: ddp,fsdp,zero2,zero3")
    parser.add_argument("--scenario", choices=["steady", "spike", "both"], default="steady")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (quick: 4; else 20 / 40 spike)")
    parser.add_argument("--nproc", type=int, default=None, help="ranks (CPU default 2, CUDA default 1)")
    parser.add_argument("--memory_cap_gib", type=float, default=12.0)
    parser.add_argument("--spike_every", type=int, default=10)
    parser.add_argument("--grow_back_window", type=int, default=4)
    parser.add_argument("--quick", action="store_true",
                        help="CI size: one engine, 4 steps, static search (AC off) from 2x the recovered micro-batch")
    parser.add_argument("--results", action="store_true", help="append to benchmarks/results/oom_stress-<device>.jsonl")
    parser.add_argument("--plot", default=None, help="write a PNG chart of tokens/s here")
    args = parser.parse_args(argv)
    args.nproc = args.nproc or (2 if args.device == "cpu" else 1)
    engines = args.engines.split(",")
    requested_steps = 4 if args.quick else args.steps
    if args.quick:
        engines = engines[:1]
    rows = []
    for engine in engines:
        if engine not in ENGINES:
            parser.error(f"--engines: '{engine}' is not one of {', '.join(ENGINES)}")
        if args.scenario in ("steady", "both"):
            args.steps = requested_steps or 20
            rows.append(steady(engine, args))
            emit("oom_stress", args.device, rows[-1], args.results)
        if args.scenario in ("spike", "both"):
            args.steps = max(requested_steps or 40, 2 * args.spike_every)
            rows.append(spike(engine, args))
            emit("oom_stress", args.device, rows[-1], args.results)
    if args.plot:
        steady_rows = [r for r in rows if r["scenario"] == "steady"]
        bar_chart(args.plot, f"OOM recovery vs best static plan ({args.device})", [r["engine"] for r in steady_rows],
                  {"memtrain after recovery": [r["tokens_per_s_after_recovery"] for r in steady_rows],
                   "best static plan": [r["best_static_tokens_per_s"] for r in steady_rows]}, "tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
