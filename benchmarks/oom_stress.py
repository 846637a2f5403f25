"""OOM stress: "if I set the batch too large, what does memtrain cost me, and does it lose anything?"

    python benchmarks/oom_stress.py --device cpu --quick            # CI size, simulated device (< 60 s)
    python benchmarks/oom_stress.py --device cpu --engines ddp,fsdp,zero2,zero3 --results --plot oom.png
    python benchmarks/oom_stress.py --device cuda --memory_cap_gib 12 --engines ddp,fsdp,zero3

Steady scenario, per engine, on a device too small for the whole per-rank batch: memtrain
started at micro-batch = the whole share (recovers), memtrain with ``micro_batch_size auto``,
and every plan predicted to fit run by hand (fixed micro-batch, activation checkpointing off or
on, recovery off), in alternating order ``--repeats`` times (after the first repeat only the
three fastest static plans again). Reported per configuration: tokens/s after the last plan
change, min/median/max over repeats; the ratios recovered / best static and auto / best static,
taken per repeat, min/median/max; OOMs; seconds from the first OOM to the first completed step;
the planner's prediction errors; and against the static run of the plan recovery landed on,
the steps whose trained data differ (``batch_fingerprint``; must be 0) and the largest relative
loss difference.

Spike scenario (``--scenario spike``): OOMs only on rare steps (the long inputs of variable-length
data), every ``--spike_every`` steps; memtrain shrinks and grows back after ``--grow_back_window``
steps. Reported: shrinks, grow-backs, and tokens/s against a run that never grows back.

On CPU the device is simulated (``faults.memory_budget_mib``: micro-batch per_rank/4 without
activation checkpointing just fits; the spike scenario uses the token rule
``faults.oom_above_tokens``); on CUDA OOMs are real, under ``memory.cuda_memory_cap_gib``.

Host-limit scenario (``--scenario host_limit``, CPU): no simulated device; every process runs
under a real ``RLIMIT_DATA`` (as ``prlimit --data`` sets it), so a micro-batch too large fails a
real allocation in torch's CPU allocator. The same job (``peer_scripts/``, one data file) for
memtrain (DDP and FSDP2 given the whole rank share, and ``auto``), a plain Accelerate loop under
``find_executable_batch_size`` and transformers' Trainer with ``auto_find_batch_size``
(:func:`host_limit`).

    python benchmarks/oom_stress.py --scenario host_limit --results
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (CPU_ARGS, ENGINES, GPU_ARGS, REPO, RunFailed, bar_chart, emit, read_metrics,  # noqa: E402
                    run_cli, run_memtrain, scratch_dir, spread, tokens_per_s)

def scenario_args(device: str, nproc: int, cap_gib: float) -> tuple[list[str], int, list[str]]:
    """(base arguments, per-rank batch, OOM-making arguments) for the device: CUDA under the
    memory cap; on CPU the simulated device (``faults.memory_budget_mib``, set per engine by
    :func:`cpu_budget`)."""
    if device == "cuda":
        per_rank = 32
        base = GPU_ARGS + ["--training.global_batch_size", str(per_rank * nproc), "--precision", "bf16"]
        return base, per_rank, ["--memory.cuda_memory_cap_gib", str(cap_gib)]
    per_rank = 16
    return CPU_ARGS + ["--training.global_batch_size", str(per_rank * nproc)], per_rank, []


def plan_table(base: list[str], nproc: int, extra: list[str]) -> list[dict]:
    """``memtrain plan --json`` for the run's config: one dict per candidate."""
    out = run_cli(["plan", *base, *extra, "--world_size", str(nproc), "--json"], ok_codes=(0, 3))  # 3: none fits
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def cpu_budget(base: list[str], per_rank: int, nproc: int) -> list[str]:
    """A simulated device on which micro-batch ``per_rank / 4`` without activation checkpointing
    just fits (its predicted peak + 1 KiB): the starting plan (the whole share) does not."""
    table = plan_table(base, nproc, [])
    peak = next(c["predicted_peak_bytes"] for c in table
                if c["micro_batch_size"] == per_rank // 4 and c["activation_checkpointing"] == "off")
    return ["--faults.memory_budget_mib", repr((peak + 1024) / 2**20)]


PLAN_EVENTS = ("plan_chosen", "oom_shrink", "activation_checkpointing_on", "oom_replan", "grow_back", "grow_back_failed")
OOM_EVENTS = ("oom_shrink", "activation_checkpointing_on", "oom_replan", "grow_back_failed")


def plan_events(records: list[dict]) -> list[dict]:
    """The training plan's changes (not evaluation's, resumes or checkpoints)."""
    return [e for r in records for e in r.get("plan_changes", []) if e["event"] in PLAN_EVENTS]


def compare(records: list[dict], reference: list[dict]) -> tuple[int, float]:
    """(steps whose trained data differ, max relative loss difference) of two runs of the same steps."""
    lost = sum(a["batch_fingerprint"] != b["batch_fingerprint"] for a, b in zip(records, reference))
    lost += abs(len(records) - len(reference))
    rel = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(records, reference))
    return lost, rel


def settled_tps(records: list[dict]) -> float:
    """Median tokens/s of the steps after the last plan change (and the step after it)."""
    last = max((e["step"] for e in plan_events(records)), default=0)
    after = [r for r in records if r["step"] > last + 1]
    return tokens_per_s(after or records[-1:])


def static_configs(table: list[dict]) -> dict[str, list[str]]:
    """Every candidate predicted to fit, as a fixed plan with recovery off ("by hand")."""
    return {f"{c['micro_batch_size']}x{c['gradient_accumulation_steps']}{AC_SUFFIX[c['activation_checkpointing']]}":
            ["--training.micro_batch_size", str(c["micro_batch_size"]), "--memory.oom_recovery", "false",
             "--memory.activation_checkpointing", c["activation_checkpointing"]]
            for c in table if c["fits"]}


AC_SUFFIX = {"off": "", "selective": "+SAC", "on": "+AC"}


def plan_name(records: list[dict]) -> str:
    """The plan a run ended with, as ``static_configs`` names it (``4x4+AC``)."""
    events = plan_events(records)
    ac = events[-1].get("activation_checkpointing", "off") if events else "off"
    return f"{records[-1]['micro_batch_size']}x{records[-1]['gradient_accumulation_steps']}{AC_SUFFIX[ac]}"


def steady(engine: str, args) -> dict:
    """Recovery (started at the whole rank share), ``auto``, and every fitting static plan, run
    in alternating order ``--repeats`` times; after the first repeat only the three fastest
    static plans are run again. Ratios are per repeat (same machine state), then min/median/max."""
    base, per_rank, oom = scenario_args(args.device, args.nproc, args.memory_cap_gib)
    base = base + ENGINES[engine] + ["--training.max_steps", str(args.steps), "--memory.grow_back_window", "0"]
    if args.device == "cpu":
        oom = cpu_budget(base, per_rank, args.nproc)
    configs = {"recovered": ["--training.micro_batch_size", str(per_rank)], "auto": ["--training.micro_batch_size", "auto"]}
    statics = static_configs(plan_table(base, args.nproc, oom))
    tps: dict[str, list[float]] = {}
    runs: dict[str, list[dict]] = {}
    for repeat in range(args.repeats):
        names = list(configs) + (list(statics) if repeat == 0 else
                                 sorted(statics, key=lambda k: -statistics.median(tps.get(k, [0.0])))[:3])
        for name in names:
            if args.quick and name in statics and name not in (plan_name(runs["recovered"]), plan_name(runs["auto"])):
                continue  # CI size: only the static plans recovery and auto landed on
            out = scratch_dir(name.replace("+", "_"))
            try:
                records = run_memtrain(base + oom + configs.get(name, statics.get(name)), out, args.nproc)
            except RunFailed:
                if name in configs:
                    raise
                records = None  # a static plan predicted to fit that did not
            finally:
                shutil.rmtree(out, ignore_errors=True)
            if records is not None:
                tps.setdefault(name, []).append(settled_tps(records))
                runs.setdefault(name, records)
    complete = [k for k in statics if len(tps.get(k, [])) == args.repeats]
    if not complete:
        raise SystemExit(f"oom_stress: no static plan completed every repeat under {engine}")
    best = max(complete, key=lambda k: statistics.median(tps[k]))
    recovered, auto = runs["recovered"], runs["auto"]
    events, final = plan_events(recovered), plan_name(recovered)
    lost, rel = compare(recovered, runs[final]) if final in runs else (None, None)
    first_done = next((r for r in recovered if r["step"] >= events[0]["step"]), None) if events else None
    return {
        "benchmark": "oom_stress", "scenario": "steady", "device": args.device, "engine": engine,
        "world_size": args.nproc, "steps": args.steps, "repeats": args.repeats, "start_plan": f"{per_rank}x1",
        "budget": oom, "ooms": sum(e["event"] in OOM_EVENTS for e in events),
        "first_oom_to_first_step_s": (first_done["elapsed_s"] - events[0]["elapsed_s"]) if events else 0.0,
        "final_plan": final, "auto_plan": plan_name(auto), "auto_ooms": sum(e["event"] in OOM_EVENTS for e in plan_events(auto)),
        "tokens_per_s": {k: spread(v) for k, v in tps.items()},
        "best_static_plan": best,
        "ratio_recovered_to_best_static": spread([a / b for a, b in zip(tps["recovered"], tps[best])]),
        "ratio_auto_to_best_static": spread([a / b for a, b in zip(tps["auto"], tps[best])]),
        "prediction_error": [e.get("prediction_error") for e in events + plan_events(auto) if "prediction_error" in e],
        "steps_with_other_data_than_static_final_plan": lost, "max_rel_loss_diff_vs_static_final_plan": rel,
    }


def spike(engine: str, args) -> dict:
    base, per_rank, oom = scenario_args(args.device, args.nproc, args.memory_cap_gib)
    spikes = list(range(3, args.steps + 1, args.spike_every))
    if args.device == "cpu":  # the token rule on rare steps: more than 4 × 64 tokens "does not fit"
        oom = ["--faults.oom_above_tokens", str(4 * 64), "--faults.oom_at_steps", str(spikes)]
    base = base + ENGINES[engine] + ["--training.max_steps", str(args.steps), "--training.micro_batch_size", str(per_rank)]
    results: dict[str, list[dict]] = {}
    tps: dict[str, list[float]] = {"grow_back": [], "never_grow": []}
    for _ in range(args.repeats):  # alternating
        for name, window in (("grow_back", args.grow_back_window), ("never_grow", 0)):
            out = scratch_dir(name)
            results[name] = run_memtrain(base + oom + ["--memory.grow_back_window", str(window)], out, args.nproc)
            shutil.rmtree(out, ignore_errors=True)
            tps[name].append(tokens_per_s(results[name][1:]))
    events = plan_events(results["grow_back"])
    lost, _ = compare(results["grow_back"], results["never_grow"])
    return {
        "benchmark": "oom_stress", "scenario": "spike", "device": args.device, "engine": engine,
        "world_size": args.nproc, "steps": args.steps, "spike_steps": spikes if args.device == "cpu" else None,
        "grow_back_window": args.grow_back_window,
        "shrinks": sum(e["event"] == "oom_shrink" for e in events),
        "grow_backs": sum(e["event"] == "grow_back" for e in events),
        "grow_backs_failed": sum(e["event"] == "grow_back_failed" for e in events),
        "repeats": args.repeats, "tokens_per_s": spread(tps["grow_back"]), "tokens_per_s_never_grow": spread(tps["never_grow"]),
        "ratio_to_never_grow": spread([a / b for a, b in zip(tps["grow_back"], tps["never_grow"])]),
        "steps_with_other_data": lost,
    }


HOST_ROOM_MIB = 250
"""``--scenario host_limit``: host room per rank above the reference run's resident peak (VmData's
excess over the resident set, about 60 MiB, and the plans of 32 samples or fewer per micro-batch;
not the rank's whole share of 256)."""
HOST_JOB = {"global_batch_size": 512, "vocab": 512, "seq_len": 128, "steps": 3,
            "model": {"n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 128}}
"""The host-limit job: a 0.14M-parameter GPT-2 on 128-token rows, 512 a step on 2 ranks."""
HOST_RUNS = (("memtrain", "ddp", "256"), ("memtrain", "fsdp", "256"), ("memtrain", "ddp", "auto"),
             ("accelerate_find_batch", "ddp", "256"), ("hf_auto_find", "ddp", "256"))
"""(script of ``peer_scripts/``, engine, micro-batch): memtrain given the whole rank share (and
``auto``), Accelerate's ``find_executable_batch_size`` and transformers' ``auto_find_batch_size``
given the same."""


def host_limit(args) -> list[dict]:
    """The same job under one real per-process limit (``RLIMIT_DATA``, as ``prlimit --data`` sets
    it; no simulated device) for memtrain and the peers' own out-of-memory answers, 2 ranks each.
    The limit is the resident peak of memtrain's run at micro-batch 16 without a limit (the
    reference) + :data:`HOST_ROOM_MIB`. Per run: how it ended (exit code, or hung past the
    timeout), the micro-batches tried, steps trained, samples per optimizer step against the
    global batch, and for memtrain the steps whose data differ from the reference
    (``batch_fingerprint``), the largest relative loss difference and first failure → first
    completed step."""
    import peers

    folder = scratch_dir("host_limit")
    job = HOST_JOB
    settings = {**peers.SETTINGS, "global_batch_size": job["global_batch_size"], "max_steps": job["steps"],
                "model": {**peers.MODEL, **job["model"], "vocab_size": job["vocab"]},
                "data": peers.write_data(folder, job["steps"], None, job["vocab"], job["seq_len"], job["global_batch_size"])}
    try:
        reference = _host_run("memtrain", "ddp", "16", settings, folder, None, args)
        limit = reference["peak_rss_bytes"] + HOST_ROOM_MIB * 2**20
        rows = []
        for script, engine, micro in HOST_RUNS:
            row = _host_run(script, engine, micro, settings, folder, limit, args, reference["records"])
            rows.append({"benchmark": "oom_stress", "scenario": "host_limit", "device": "cpu", "world_size": 2,
                         "limit": {"RLIMIT_DATA_bytes": limit, "reference_peak_rss_bytes": reference["peak_rss_bytes"]},
                         **{k: v for k, v in row.items() if k not in ("records", "peak_rss_bytes")}})
            emit("oom_stress", "cpu", rows[-1], args.results)
        return rows
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _host_run(script: str, engine: str, micro: str, settings: dict, folder: str, limit, args,
              reference: Optional[list[dict]] = None) -> dict:
    """One run of :func:`host_limit` (``limit`` None: the reference, without one)."""
    import time

    import peers

    out = os.path.join(folder, f"{script}-{engine}-{micro}-{'limited' if limit else 'reference'}")
    path = out + ".json"
    with open(path, "w") as fh:
        json.dump({**settings, "micro_batch_size": micro if micro == "auto" else int(micro), "out": out}, fh)
    env = {"PEERS_SETTINGS": path, "PEERS_ENGINE": engine, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(peers.SCRIPTS), str(REPO), os.environ.get("PYTHONPATH", "")])}
    name = "memtrain_trainer" if script == "memtrain" else script
    row = {"trainer": script, "engine": engine, "micro_batch_size": micro, "global_batch_size": settings["global_batch_size"]}
    start = time.perf_counter()
    try:
        run_memtrain([], out, 2, timeout=args.host_timeout_s, env=env, script=str(peers.SCRIPTS / f"{name}.py"),
                     metrics=False, rlimit_data=limit)
        row["exit"] = 0
    except RunFailed as failed:
        row["exit"], row["error"] = failed.returncode, failed.stderr.strip().splitlines()[-1][-300:] if failed.stderr.strip() else ""
    except subprocess.TimeoutExpired:
        row["exit"] = f"hung past {args.host_timeout_s} s"
    row["wall_s"] = time.perf_counter() - start
    if script == "memtrain":
        return {**row, **_memtrain_outcome(out, reference, settings["global_batch_size"])}
    records = [json.load(open(p)) for p in sorted(Path(out).glob("oom_record_*.json"))]
    steps = records[0]["steps"] if records else []
    return {**row, "micro_batch_sizes_tried": records[0]["micro_batch_sizes"] if records else None,
            "steps_trained": len(steps), "samples_per_step": [s["samples"] for s in steps],
            "global_batch_kept": bool(steps) and all(s["samples"] == settings["global_batch_size"] for s in steps),
            "restarts_from_step_1": max(0, len(records[0]["micro_batch_sizes"]) - 1) if records else None}


def _memtrain_outcome(out: str, reference: Optional[list[dict]], global_batch_size: int) -> dict:
    """What a memtrain run of :func:`host_limit` did: its records' plans, data and losses."""
    ranks = [json.load(open(p)) for p in sorted(Path(out).glob("record_*.json"))]
    records = read_metrics(out) if Path(out, "metrics.jsonl").exists() else []
    events = plan_events(records)
    first_done = next((r for r in records if events and r["step"] >= events[0]["step"]), None)
    row = {"records": records, "peak_rss_bytes": max((r["peak_rss_bytes"] for r in ranks), default=None),
           "steps_trained": len(records), "plan_events": [f"{e['event']} {e['old']}→{e['new']}" for e in events],
           "final_plan": plan_name(records) if records else None,
           "samples_per_step": [r["samples_seen"] - p for r, p in zip(records, [0] + [r["samples_seen"] for r in records])],
           "first_oom_to_first_step_s": (first_done["elapsed_s"] - events[0]["elapsed_s"]) if first_done and any(
               e["event"] in OOM_EVENTS for e in events) else None}
    row["global_batch_kept"] = bool(records) and all(n == global_batch_size for n in row["samples_per_step"])
    if reference is not None and records:
        lost, rel = compare(records, reference)
        row.update({"steps_with_other_data_than_reference": lost, "max_rel_loss_diff_vs_reference": rel})
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--engines", default="ddp", help="comma-separated: ddp,fsdp,zero2,zero3")
    parser.add_argument("--scenario", choices=["steady", "spike", "both", "host_limit"], default="steady",
                        help="host_limit: the same job under a real per-process limit (RLIMIT_DATA), memtrain "
                             "beside Accelerate's find_executable_batch_size and transformers' auto_find_batch_size")
    parser.add_argument("--host_timeout_s", type=float, default=600, help="host_limit: a run's time limit (a hang)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (quick: 4; else 20 / 40 spike)")
    parser.add_argument("--nproc", type=int, default=None, help="ranks (CPU default 2, CUDA default 1)")
    parser.add_argument("--memory_cap_gib", type=float, default=12.0)
    parser.add_argument("--spike_every", type=int, default=10)
    parser.add_argument("--grow_back_window", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="alternating repeats (quick: 1)")
    parser.add_argument("--quick", action="store_true",
                        help="CI size: one engine, 4 steps, static search (AC off) from 2x the recovered micro-batch")
    parser.add_argument("--results", action="store_true", help="append to benchmarks/results/oom_stress-<device>.jsonl")
    parser.add_argument("--plot", default=None, help="write a PNG chart of tokens/s here")
    args = parser.parse_args(argv)
    args.nproc = args.nproc or (2 if args.device == "cpu" else 1)
    engines = args.engines.split(",")
    requested_steps = 4 if args.quick else args.steps
    if args.quick:
        engines, args.repeats = engines[:1], 1
    rows = []
    if args.scenario == "host_limit":
        host_limit(args)
        return 0
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
        bar_chart(args.plot, f"OOM recovery and auto vs best static plan ({args.device}, median)",
                  [r["engine"] for r in steady_rows],
                  {"after recovery": [r["tokens_per_s"]["recovered"]["median"] for r in steady_rows],
                   "auto": [r["tokens_per_s"]["auto"]["median"] for r in steady_rows],
                   "best static plan": [r["tokens_per_s"][r["best_static_plan"]]["median"] for r in steady_rows]},
                  "tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
