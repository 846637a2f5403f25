"""The benchmark tables of docs/ (and README.md), generated from ``benchmarks/results/*.jsonl`` (the newest row per
configuration), so the docs show what the code measured and nothing typed by hand.

    python benchmarks/tables.py oom_stress [--device cpu]     # markdown on stdout
    python benchmarks/tables.py largest_model_plan             # memtrain plan's placements per Llama shape
    python benchmarks/tables.py overhead [--device cpu]        # memtrain vs each engine's plain loop, and pooled
    python benchmarks/tables.py memory_accuracy [--device cpu] # predicted peak vs MemTracker, per engine and shape
    python benchmarks/tables.py solver                         # memory.levers auto vs off at three budgets
    python benchmarks/tables.py solver_exhaustive              # auto vs every fitting lever setting, timed
    python benchmarks/tables.py lossy_levers                   # optimizer.state_dtype: loss and bytes
    python benchmarks/tables.py lossy_step_cost                # the planner's charge for a lossier step vs timed
    python benchmarks/tables.py memory_accuracy_levers         # each lever's saving, predicted vs MemTracker
    python benchmarks/tables.py memory_accuracy_families       # new sizes: |error| per engine and family
    python benchmarks/tables.py peers                          # memtrain beside transformers' Trainer and Accelerate
    python benchmarks/tables.py seq_len_reach                  # the longest data.seq_len under one budget
    python benchmarks/tables.py placement_accuracy             # the placement accounting vs DeepSpeed's tensors
    python benchmarks/tables.py host_step_rates                # the CPU's optimizer-step rates an offload is charged
    python benchmarks/tables.py stale                          # which results measured code that changed since
    python benchmarks/tables.py freshness                      # the same as docs/benchmarks.md's markdown table

Every row records the commit it measured (``commit``, ``worktree_clean``: benchmarks/common.py's
``provenance``); rows from before that was recorded have neither.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Optional

from memtrain.levers.activation_checkpointing import setting  # results of older versions hold a bool
from memtrain.levers.optimizer_state import STATE_DTYPES
from memory_accuracy import error_distribution  # the benchmark's own summary (a sibling: this folder is on the path)
from largest_model import recipe_global_batch_size  # the batch the benchmark plans by default
from peers import paired as peers_paired  # the benchmark's own pairing of repeats

RESULTS = Path(__file__).resolve().parent / "results"
MEASURED_BY = {"lossy_step_cost": "lossy_levers", "largest_model_plan": "largest_model", "solver_exhaustive": "solver"}
"""A results name written by another benchmark's script (the rest: ``benchmarks/<name>.py``)."""
ENGINE_NAMES = {"ddp": "DDP", "fsdp": "FSDP2", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}
SHAPE_NAMES = {"cpu": "GPT-2, 4 × 64 wide (0.27M)", "gpt2_small": "GPT-2 small's blocks, 12 × 768 (86M)"}
"""The models of benchmarks/memory_accuracy.py's ``--shape``."""


def newest(name: str, device: str, scenario: str) -> list[dict]:
    """The newest row per engine of ``scenario`` with repeats (rows of older formats are skipped)."""
    rows: dict[str, dict] = {}
    with open(RESULTS / f"{name}-{device}.jsonl") as fh:
        for line in fh:
            row = json.loads(line)
            if row.get("scenario") == scenario and "repeats" in row:
                rows[row["engine"]] = row
    return [rows[e] for e in ENGINE_NAMES if e in rows]


def newest_by(name: str, device: str, key) -> dict:
    """``{key(row): row}`` over ``benchmarks/results/<name>-<device>.jsonl``: the newest row per key."""
    rows: dict = {}
    with open(RESULTS / f"{name}-{device}.jsonl") as fh:
        for line in fh:
            row = json.loads(line)
            rows[key(row)] = row
    return rows


def fmt(value, spec: str = ".1e") -> str:
    """A number, or "n/a" where the benchmark could not measure it."""
    return "n/a" if value is None else format(value, spec)


def spread(s: dict, fmt: str = "{:.2f}") -> str:
    return " / ".join(fmt.format(s[k]) for k in ("min", "median", "max"))


def oom_stress_steady(device: str) -> str:
    out = ["| engine | OOMs | first OOM → first step | plan after recovery | `auto` plan | best static plan "
           "| tokens/s: recovered / auto / best static (median) | recovered ÷ best static (min / median / max) "
           "| auto ÷ best static (min / median / max) | predicted peak error | steps with other data | max rel. loss diff |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in newest("oom_stress", device, "steady"):
        t = r["tokens_per_s"]
        errors = ", ".join(f"{e:+.1%}" for e in sorted(set(r["prediction_error"])))
        out.append(f"| {ENGINE_NAMES[r['engine']]} | {r['ooms']} | {r['first_oom_to_first_step_s']:.2f} s "
                   f"| {r['final_plan']} | {r['auto_plan']} ({r['auto_ooms']} OOMs)"
                   f" | {r['best_static_plan']} | {t['recovered']['median']:,.0f} / {t['auto']['median']:,.0f} / "
                    f"{t[r['best_static_plan']]['median']:,.0f} | {spread(r['ratio_recovered_to_best_static'])} "
                    f"| {spread(r['ratio_auto_to_best_static'])} | {errors} "
                    f"| {r['steps_with_other_data_than_static_final_plan']} | {fmt(r['max_rel_loss_diff_vs_static_final_plan'])} |")
    return "\n".join(out)


def oom_stress_spike(device: str) -> str:
    out = ["| engine | shrinks | grow-backs | tokens/s with grow-back (median) | never grow back (median) "
           "| ratio (min / median / max) | steps with other data |", "|---|---|---|---|---|---|---|"]
    for r in newest("oom_stress", device, "spike"):
        out.append(f"| {ENGINE_NAMES[r['engine']]} | {r['shrinks']} | {r['grow_backs']} "
                   f"| {r['tokens_per_s']['median']:,.0f} | {r['tokens_per_s_never_grow']['median']:,.0f} "
                   f"| {spread(r['ratio_to_never_grow'])} | {r['steps_with_other_data']} |")
    return "\n".join(out)


HOST_TRAINERS = {"memtrain": "memtrain", "accelerate_find_batch": "Accelerate `find_executable_batch_size`",
                 "hf_auto_find": "transformers `auto_find_batch_size`"}


def oom_stress_host_limit(device: str) -> str:
    """``oom_stress.py --scenario host_limit``: the newest run's rows (one commit), one per trainer,
    engine and micro-batch."""
    rows: list[dict] = []
    with open(RESULTS / f"oom_stress-{device}.jsonl") as fh:
        for line in fh:
            row = json.loads(line)
            if row.get("scenario") == "host_limit":
                rows = [r for r in rows if r.get("commit") == row.get("commit")] + [row]
    out = ["| trainer | engine | micro-batch given | exit | micro-batches tried | steps | samples per step (global batch "
           "512) | same data and losses as the reference | wall s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tried = r.get("micro_batch_sizes_tried") or ([e.split(" ")[1] for e in r.get("plan_events", [])])
        same = (f"{r['steps_with_other_data_than_reference']} steps differ, losses within "
                f"{fmt(r['max_rel_loss_diff_vs_reference'])}" if "steps_with_other_data_than_reference" in r else
                "not recorded by the trainer")
        restarts = f" ({r['restarts_from_step_1']} restarts from step 1)" if r.get("restarts_from_step_1") else ""
        out.append(f"| {HOST_TRAINERS.get(r['trainer'], r['trainer'])} | {ENGINE_NAMES[r['engine']]} | {r['micro_batch_size']} "
                   f"| {r['exit']} | {', '.join(str(t) for t in tried) or '-'}{restarts} | {r.get('steps_trained', 0)} "
                   f"| {', '.join(str(n) for n in r.get('samples_per_step', [])) or '-'} | {same} | {r['wall_s']:.0f} |")
    return "\n".join(out)


def largest_model_plan(global_batch_size: Optional[int] = None) -> str:
    """The placements ``benchmarks/largest_model.py --plan`` printed at ``global_batch_size``
    (None: ``recipes/llama_10b.yaml``'s, as the benchmark reads it; rows before the key existed
    planned 16), newest row per shape and ``--extra`` (a row planned with extra arguments names
    them beside its shape)."""
    global_batch_size = global_batch_size or recipe_global_batch_size()
    rows: dict[tuple, dict] = {}
    with open(RESULTS / "largest_model_plan-cpu.jsonl") as fh:
        for line in fh:
            row = json.loads(line)
            if row.get("global_batch_size", 16) == global_batch_size:
                rows[row["shape"], row.get("extra", "")] = row
    out = ["| shape (parameters) | placement | micro × accum | AC | GPU GiB | host GiB | predicted s/step | fits |",
           "|---|---|---|---|---|---|---|---|"]
    for (shape, extra), row in rows.items():
        for p in row["placements"]:
            fits = "**chosen**" if p["chosen"] else "yes" if p["fits"] else "no (GPU)" if not p["fits_device"] else "no (host)"
            label = f"{shape} ({p.get('parameters', 0) / 1e9:.2f}B)" + (f", `{extra}`" if extra else "")
            out.append(f"| {label} | {p['name']} | {p['micro_batch_size']} × "
                       f"{p['gradient_accumulation_steps']} | {setting(p['activation_checkpointing'])} "
                       f"| {p['device_bytes'] / 2**30:.1f} | {p['host_bytes'] / 2**30:.1f} | {p['predicted_step_s']:.2f} | {fits} |")
    return "\n".join(out)


def overhead(device: str) -> str:
    """memtrain's step time against each engine's plain loop with the same process settings,
    newest such row per engine: the median step and the mean step (wall time per step) of each
    run, their ratios over repeats, the tuning gain (a plain loop with its defaults over
    memtrain, median step) and, where measured, memtrain with the OOM agreements inside compute
    made as on a GPU (``--armed``) with each variant's agreements over its run."""
    rows: dict[str, dict] = {}
    with open(RESULTS / f"overhead-{device}.jsonl") as fh:
        for line in fh:
            row = json.loads(line)
            if row.get("plain_settings") == "same":  # rows before the fair comparison are not shown
                rows[row["engine"]] = row
    out = ["| engine | plain loop | ms per step, median step: plain / memtrain | overhead (min / median / max) "
           "| ms per step, mean step: plain / memtrain | overhead (min / median / max) "
           "| tuning gain (min / median / max) | agreements inside compute made (as on a GPU): overhead, median step "
           "(min / median / max) | OOM agreements per run: memtrain / made inside compute | repeats × steps |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    plain = {"ddp": "Accelerate (`accumulate`, `backward`)", "fsdp": "`fully_shard` per block + root",
             "zero2": "`deepspeed.initialize`, `engine.backward`/`step`"}
    for engine in ENGINE_NAMES:
        r = rows.get(engine)
        if not r:
            continue
        cells = []
        for stat, prefix in (("median", ""), ("mean", "mean_")):
            if f"plain_step_s_{stat}" not in r:  # rows from before the mean was reported
                cells += ["–", "–"]
                continue
            cells += [f"{r[f'plain_step_s_{stat}'] * 1e3:.1f} / {r[f'memtrain_step_s_{stat}'] * 1e3:.1f}",
                      f"{r[prefix + 'ratio_min']:.2f} / {r[prefix + 'ratio_median']:.2f} / {r[prefix + 'ratio_max']:.2f}"]
        gain = f"{r['tuning_gain_min']:.2f} / {r['tuning_gain_median']:.2f} / {r['tuning_gain_max']:.2f}"
        armed = (" / ".join(f"{r[f'armed_ratio_{k}']:.2f}" for k in ("min", "median", "max"))
                 if "armed_ratio_median" in r else "not measured")
        points = r.get("oom_agreements", {})
        counts = f"{points['memtrain']} / {points['memtrain_armed']}" if "memtrain_armed" in points else "–"
        out.append(f"| {ENGINE_NAMES[engine]} | {plain.get(engine, '')} | {' | '.join(cells)} | {gain} | {armed} | "
                   f"{counts} | {r['repeats']} × {r['steps']} |")
    return "\n".join(out)


def median_interval(values: list[float], coverage: float = 0.95) -> tuple[float, float, float]:
    """The narrowest order-statistic interval ``(low, high, its coverage)`` that holds the true
    median of the values' distribution with at least ``coverage`` probability, whatever that
    distribution (the k-th smallest and k-th largest values; binomial(n, ½) tails; e.g. Conover,
    *Practical Nonparametric Statistics*, §3.2). Needs n ≥ 6 for 95%; fewer give min and max."""
    from math import comb

    ordered, n = sorted(values), len(values)
    cover = lambda k: 1 - 2 * sum(comb(n, i) for i in range(k)) / 2**n  # noqa: E731 (k-th from each end)
    k = 1
    while k + 1 <= n // 2 and cover(k + 1) >= coverage:
        k += 1
    return ordered[k - 1], ordered[n - k], cover(k)


POOLED_SINCE = {"ddp": "4338af9", "fsdp": "4338af9", "zero2": "4338af9"}
"""Per engine, the commit from which its rows are pooled: the step code every engine runs changed
in the rounds before it (the OOM protocol's agreements, the records and the console line; DDP
trained unwrapped from 49fa197, FSDP2 reduces every micro-batch under its optimizer offload from
966c2d5), so rows measured before it time other code and are left out."""


def measured_since(row: dict, commit: str, repo: Path = RESULTS.parents[1]) -> bool:
    """Whether ``row`` records a commit that has ``commit`` in its history (False for a row
    without one, or where git cannot tell)."""
    if not row.get("commit"):
        return False
    check = subprocess.run(["git", "merge-base", "--is-ancestor", commit, row["commit"]], cwd=repo,
                           capture_output=True, timeout=60)
    return check.returncode == 0


def overhead_pooled(device: str, results: Path = RESULTS, since: Optional[dict] = None) -> str:
    """memtrain ÷ plain (median step) per engine over every repeat of the rows that timed the
    ``--armed`` variant (the code that makes the OOM points inside compute only where an OOM can
    be raised there) and, for an engine in ``since`` (default :data:`POOLED_SINCE`), were measured
    at or after its commit: the ratios' count, median and its order-statistic 95% interval
    (:func:`median_interval`), and the same for the armed variant where rows keep its ratios."""
    since = POOLED_SINCE if since is None else since
    pooled: dict[str, dict[str, list[float]]] = {}
    with open(results / f"overhead-{device}.jsonl") as fh:
        for line in fh:
            row = json.loads(line)
            if row.get("engine") in since and not measured_since(row, since[row["engine"]], results.parents[1]):
                continue
            if row.get("plain_settings") == "same" and "armed_ratio_median" in row:
                into = pooled.setdefault(row["engine"], {"ratios": [], "armed": [], "rows": []})
                into["ratios"] += row["ratios"]
                into["armed"] += row.get("armed_ratios", [])
                into["rows"].append(f"{row['repeats']}")
    out = ["| engine | runs (repeats each) | overhead: ratios, median (95% interval of the median) "
           "| agreements inside compute made: ratios, median (95% interval) |", "|---|---|---|---|"]

    def cell(values: list[float]) -> str:
        if len(values) < 6:
            return "–"
        low, high, cover = median_interval(values)
        return f"{len(values)}, {statistics.median(values):.3f} ({low:.3f}–{high:.3f}, {cover:.1%})"

    for engine in ENGINE_NAMES:
        if engine in pooled:
            p = pooled[engine]
            out.append(f"| {ENGINE_NAMES[engine]} | {' + '.join(p['rows'])} | {cell(p['ratios'])} | {cell(p['armed'])} |")
    return "\n".join(out)


def memory_accuracy(device: str) -> str:
    """The planner's predicted peak against MemTracker's count: per model shape, precision and
    engine, the relative error's min / median / max over the plans (newest row per shape,
    precision, engine and plan); on a GPU also against ``torch.cuda.max_memory_allocated``."""
    newest_rows: dict[tuple, dict] = {}
    with open(RESULTS / f"memory_accuracy-{device}.jsonl") as fh:
        for line in fh:
            row = json.loads(line)
            if "engine" in row and row["benchmark"] == "memory_accuracy":
                key = (row.get("shape", "cpu"), row.get("precision", "fp32"), row.get("world_size", 2), row["engine"],
                       row["micro_batch_size"], row["activation_checkpointing"])
                newest_rows.pop(key, None)  # keep the row order of the newest run
                newest_rows[key] = row
    runs: dict[tuple, list[dict]] = {}
    for (shape, precision, world_size, *_), row in newest_rows.items():
        runs.setdefault((shape, precision, world_size), []).append(row)
    cuda = any("cuda_relative_error" in r for r in newest_rows.values())
    out = ["| model | precision | ranks | engine | plans (micro-batch × accumulation, AC) | relative error min / median / max |"
           + (" against max_memory_allocated |" if cuda else "") + " commit |",
           "|---|---|---|---|---|---|" + ("---|" if cuda else "") + "---|"]

    def spread(errors: list[float]) -> str:
        return f"{min(errors):+.1%} / {statistics.median(errors):+.1%} / {max(errors):+.1%}"

    for (shape, precision, world_size), rows in runs.items():
        for engine in ENGINE_NAMES:
            mine = [r for r in rows if r["engine"] == engine]
            if not mine:
                continue
            plans = ", ".join(f"{r['micro_batch_size']} × {r.get('gradient_accumulation_steps', '?')} "
                              f"{r['activation_checkpointing']}" for r in mine)
            line = (f"| {SHAPE_NAMES.get(shape, shape)} | {precision} | {world_size} | {ENGINE_NAMES[engine]} | {plans} | "
                    f"{spread([r['relative_error'] for r in mine])} |")
            if cuda:
                line += f" {spread([r['cuda_relative_error'] for r in mine if 'cuda_relative_error' in r] or [float('nan')])} |"
            out.append(line + f" {', '.join(sorted({(r.get('commit') or 'none')[:7] for r in mine}))} |")
    return "\n".join(out)


def memory_accuracy_families(device: str) -> str:
    """``benchmarks/memory_accuracy.py --families``: per seed the models were drawn with, and apart
    the plans that do not accumulate (``--accumulation 1``), the |relative error|'s median, p90
    and worst and the most under (the lowest error) per engine over every family, precision, AC
    setting and rank count (newest row per configuration), then per family; each group's commits."""
    rows = newest_by("memory_accuracy", device, lambda row: (
        row.get("benchmark"), row.get("model_type"), json.dumps(row.get("model_config"), sort_keys=True),
        row.get("engine"), row.get("world_size"), row.get("precision"), row.get("activation_checkpointing"),
        row.get("gradient_accumulation_steps")))
    mine = [r for (kind, *_), r in rows.items() if kind == "memory_accuracy_families" and "engine" in r]

    def line(name: str, group: list[dict], other: str) -> str:
        d = error_distribution([r["relative_error"] for r in group])
        commits = ", ".join(sorted({(r.get("commit") or "none")[:7] for r in group}))
        under = min(r["relative_error"] for r in group)
        return (f"| {name} | {d['rows']} | {len({r[other] for r in group})} | {d['median']:.1%} | {d['p90']:.1%} "
                f"| {d['worst']:.1%} | {under:+.1%} | {commits} |")

    header = "| {} | rows | {} | \\|error\\| median | p90 | worst | lowest | commits |"
    rule = "|---|---|---|---|---|---|---|---|"
    out = []
    groups = sorted({(r["seed"], r.get("gradient_accumulation_steps", 2) == 1) for r in mine})
    for seed, alone in groups:
        drawn = [r for r in mine if r["seed"] == seed and (r.get("gradient_accumulation_steps", 2) == 1) == alone]
        title = f"Seed {seed}, one micro-batch per step (`--accumulation 1`):" if alone else f"Seed {seed}:"
        out += [title, "", header.format("engine", "families"), rule]
        out += [line(name, [r for r in drawn if r["engine"] == engine], "model_type")
                for engine, name in ENGINE_NAMES.items() if any(r["engine"] == engine for r in drawn)]
        out += ["", header.format("family", "engines"), rule]
        out += [line(family, [r for r in drawn if r["model_type"] == family], "engine")
                for family in sorted({r["model_type"] for r in drawn})] + [""]
    return "\n".join(out + ["Each row's drawn `model_config` is in the results file; lowest: the most under (negative)."])


def host_step_rates(device: str) -> str:
    """``benchmarks/host_step_rates.py``: the newest row's rates per method (G parameters/s, min /
    median / max over its alternating repeats), per core, the CPU share, and its commit."""
    (row,) = newest_by("host_step_rates", device, lambda row: row["benchmark"]).values()
    names = {"offload_host_step": "FSDP2's optimizer offload, its host step (bf16 gradient in, bf16 value out)",
             "torch_adamw_fused": "torch AdamW, fused CPU kernel (fp32)", "torch_adamw_foreach": "torch AdamW, foreach (fp32)",
             "deepspeed_cpu_adam": "DeepSpeed CPU Adam (fp32)"}
    g = lambda s: f"{s['min'] / 1e9:.2f} / {s['median'] / 1e9:.2f} / {s['max'] / 1e9:.2f}"  # noqa: E731
    out = [f"{row['parameters'] / 2**20:.0f}M parameters, {row['repeats']} repeats, {row['threads']} threads, "
           f"commit {(row.get('commit') or '?')[:7]}; `memtrain plan`'s reference rate for another machine "
           f"{row['reference_params_per_s'] / 1e9:.1f} G/s.", "",
           "| method | G parameters/s (min / median / max) | per core | CPU s per wall s (median) |", "|---|---|---|---|"]
    for name, label in names.items():
        m = row["methods"].get(name)
        out.append(f"| {label} | {g(m['params_per_s'])} | {g(m['params_per_s_per_core'])} | "
                   f"{m['cpu_s_per_wall_s']['median']:.2f} |" if m else f"| {label} | not measured: {row['not_measured'][name]} | | |")
    return "\n".join(out)


def peers(device: str) -> str:
    """``benchmarks/peers.py``: per engine and trainer, the newest summary row (min / median / max
    over its repeats) and the commit it measured; then, per engine from the newest commit's run
    rows, each memtrain's paired ratios to each peer (:func:`peers.paired`)."""
    rows = newest_by("peers", device, lambda row: (row.get("summary", False), row.get("paired", False),
                                                   row.get("engine"), row.get("trainer")))
    order = lambda kv: (list(ENGINE_NAMES).index(kv[0][2]), kv[0][3] != "memtrain", kv[0][3])  # noqa: E731
    out = ["| engine | trainer | repeats (failed) | tokens/s (min / median / max) | tokens per CPU-second, both "
           "ranks (min / median / max) | peak resident MiB, largest rank (min / median / max) | of it: imports MiB "
           "(median) | above the imports MiB (median) | model state MiB | validation loss (min / median / max) "
           "| lines of user code | commit |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (summary, pair, engine, trainer), r in sorted(rows.items(), key=order):
        if not summary:
            continue
        mib = {k: v / 2**20 for k, v in r["peak_bytes"].items()} if r["peak_bytes"] else None
        cells = [spread(r[k], f) if r.get(k) else "n/a" for k, f in (
            ("tokens_per_s", "{:,.0f}"), ("tokens_per_cpu_s", "{:,.0f}"), ("val_loss", "{:.4f}"))]
        parts = [f"{r[k]['median'] / 2**20:,.0f}" if r.get(k) else "n/a" for k in ("imports_bytes", "above_imports_bytes")]
        state = f"{r['model_state_bytes'] / 2**20:.1f}" if r.get("model_state_bytes") else "n/a"
        out.append(f"| {ENGINE_NAMES[engine]} | {trainer} | {r['repeats']} ({r['failed']}) | {cells[0]} | {cells[1]} "
                   f"| {spread(mib, '{:,.0f}') if mib else 'n/a'} | {parts[0]} | {parts[1]} | {state} | {cells[2]} "
                   f"| {r['user_lines']} | {(r.get('commit') or 'none')[:7]} |")
    out += ["", "| engine | ÷ | pairs | tokens per CPU-second (min / median / max) | tokens/s (min / median / max) "
            "| commit |", "|---|---|---|---|---|---|"]
    for engine, (commit, runs) in sorted(newest_runs(device).items(), key=lambda kv: list(ENGINE_NAMES).index(kv[0])):
        for r in peers_paired(runs):
            cells = [spread(r[k]) if r.get(k) else "n/a" for k in ("memtrain_over_peer_tokens_per_cpu_s",
                                                                    "memtrain_over_peer_tokens_per_s")]
            out.append(f"| {ENGINE_NAMES[engine]} | {r['numerator']} ÷ {r['trainer']} | {r['pairs']} | {cells[0]} "
                       f"| {cells[1]} | {commit[:7]} |")
    return "\n".join(out)


def newest_runs(device: str) -> dict[str, tuple[str, list[dict]]]:
    """``{engine: (commit, its run rows)}``: per engine the run rows (one per trainer and repeat) of
    the newest commit that measured that engine, the rows :func:`peers.paired` divides."""
    by_commit: dict[str, dict[str, list[dict]]] = {}
    with open(RESULTS / f"peers-{device}.jsonl") as fh:
        for line in fh:
            row = json.loads(line)
            if "repeat" in row and row.get("commit"):
                by_commit.setdefault(row["engine"], {}).setdefault(row["commit"], []).append(row)
    return {engine: list(commits.items())[-1] for engine, commits in by_commit.items()}


def memory_accuracy_levers(device: str) -> str:
    """``benchmarks/memory_accuracy.py --levers``: each lever's saving, predicted and counted by
    MemTracker, newest row per (engine, lever)."""
    rows = newest_by("memory_accuracy", device, lambda row: (row.get("benchmark"), row.get("shape"),
                                                            row.get("precision"), row.get("engine"), row.get("lever")))
    out = ["| model | engine | lever | peak without it (MiB, counted) | saving: predicted (MiB) | saving: counted (MiB) "
           "| error of the predicted saving |", "|---|---|---|---|---|---|---|"]
    for (kind, shape, precision, engine, lever), r in rows.items():
        if kind != "memory_accuracy_levers":
            continue
        small = max(abs(r["measured_saving_bytes"]), abs(r["predicted_saving_bytes"])) < 0.01 * r["measured_bytes_without"]
        error = "– (both under 1% of the peak)" if small or r["saving_error"] is None else f"{r['saving_error']:+.1%}"
        out.append(f"| {SHAPE_NAMES.get(shape, shape)}, {precision} | {ENGINE_NAMES[engine]} | {lever} | {r['measured_bytes_without'] / 2**20:.2f} "
                   f"| {r['predicted_saving_bytes'] / 2**20:.2f} | {r['measured_saving_bytes'] / 2**20:.2f} | {error} |")
    return "\n".join(out)


def solver(device: str) -> str:
    """``benchmarks/solver.py``: the newest row per (engine, budget)."""
    rows = newest_by("solver", device, lambda row: (row["engine"], row["budget"]))
    out = ["| engine | budget (MiB per rank) | plan: levers off | plan: levers auto | OOM events (off / auto) "
           "| tokens/s off (min / median / max) | tokens/s auto (min / median / max) | auto ÷ off (min / median / max) "
           "| auto from 16 × 1: OOM events → plan |",
           "|---|---|---|---|---|---|---|---|---|"]
    for (engine, budget), r in sorted(rows.items(), key=lambda kv: (list(ENGINE_NAMES).index(kv[0][0]),
                                                                      ["tight", "medium", "loose"].index(kv[0][1]))):
        t = r["tokens_per_s"]
        out.append(f"| {ENGINE_NAMES[engine]} | {budget} ({r['budget_mib']:.1f}) | {r['plan']['off']} | {r['plan']['auto']} "
                   f"| {r['oom_events']['off']} / {r['oom_events']['auto']} | {spread(t['off'], '{:,.0f}')} "
                   f"| {spread(t['auto'], '{:,.0f}')} | {spread(r['ratio_auto_to_off'])} | {recovery(r)} |")
    return "\n".join(out)


def solver_exhaustive(device: str) -> str:
    """``benchmarks/solver.py --exhaustive``: the newest row per (engine, budget)."""
    rows = newest_by("solver_exhaustive", device, lambda row: (row["engine"], row["budget"]))
    out = ["| engine | budget (MiB per rank) | levers auto chose | fastest setting timed | settings timed "
           "| tokens/s auto (min / median / max) | tokens/s fastest (min / median / max) "
           "| auto ÷ fastest (min / median / max) |", "|---|---|---|---|---|---|---|---|"]
    for (engine, budget), r in sorted(rows.items(), key=lambda kv: (list(ENGINE_NAMES).index(kv[0][0]),
                                                                      ["tight", "medium", "loose"].index(kv[0][1]))):
        t, settings = r["tokens_per_s"], [m for m in r["tokens_per_s"] if m != "auto"]
        out.append(f"| {ENGINE_NAMES[engine]} | {budget} ({r['budget_mib']:.1f}) | {r['auto_plan']} | {r['best_setting']} "
                   f"| {len(settings)} ({sum(r['oom_events'][m] > 0 for m in settings)} ran out of memory) "
                   f"| {spread(t['auto'], '{:,.0f}')} | {spread(t[r['best_setting']], '{:,.0f}')} "
                   f"| {spread(r['ratio_auto_to_best'])} |")
    return "\n".join(out)


def recovery(row: dict) -> str:
    """The solver row's recovery cell: OOM events, then the plan it landed on (= auto's or not)."""
    if "auto_from_whole_share" not in row["plan"]:
        return "–"  # rows from before the recovery run
    same = " (= auto's)" if row["recovery_lands_on_auto_plan"] else ""
    return f"{row['oom_events']['auto_from_whole_share']} → {row['plan']['auto_from_whole_share']}{same}"


def lossy_levers(device: str) -> str:
    """``benchmarks/lossy_levers.py``: the newest row per engine (DDP, FSDP2's optimizer offload) and
    optimizer state dtype."""
    rows = newest_by("lossy_levers", device, lambda row: (row.get("placement", "ddp"), row["optimizer_state_dtype"]))
    out = ["| engine | optimizer.state_dtype | optimizer state per rank (MiB, predicted) | validation loss "
           "| last training loss | tokens/s (median step) |", "|---|---|---|---|---|---|"]
    for placement in ("ddp", "fsdp_offload"):
        for dtype in STATE_DTYPES:
            if (placement, dtype) in rows:
                r = rows[placement, dtype]
                engine = "DDP" if placement == "ddp" else "FSDP2, optimizer on the host"
                out.append(f"| {engine} | {dtype} | {r['predicted_optimizer_state_bytes'] / 2**20:.1f} "
                           f"| {r['val_loss']:.4f} | {r['last_loss']:.4f} | {r['tokens_per_s']:,.0f} |")
    return "\n".join(out)


def lossy_step_cost(device: str) -> str:
    """``benchmarks/lossy_levers.py --step_cost``: the newest row per lossier dtype."""
    rows = newest_by("lossy_step_cost", device, lambda row: row["optimizer_state_dtype"])
    out = ["| optimizer.state_dtype | charged by the planner (ms per step) | measured: step − fp32's step (ms; min / "
           "median / max) | step ms (median) | fp32 step ms (median) | repeats |", "|---|---|---|---|---|---|"]
    for dtype in STATE_DTYPES:
        if dtype in rows:
            r = rows[dtype]
            extra = spread({k: v * 1e3 for k, v in r["measured_extra_s"].items()}, "{:.1f}")
            out.append(f"| {dtype} | {r['charged_s'] * 1e3:.1f} | {extra} | {statistics.median(r['step_s']) * 1e3:.0f} "
                       f"| {statistics.median(r['fp32_step_s']) * 1e3:.0f} | {r['repeats']} |")
    return "\n".join(out)


def seq_len_reach(device: str) -> str:
    """``benchmarks/seq_len_reach.py``: the newest row per engine."""
    rows = newest_by("seq_len_reach", device, lambda row: row["engine"])
    out = ["| engine | budget (MiB per rank) | longest seq_len: levers off | plan there | longest seq_len: levers auto "
           "| plan there | auto ÷ off | OOM events (off / auto) | with activation offload: longest seq_len | plan there |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for engine, r in sorted(rows.items(), key=lambda kv: list(ENGINE_NAMES).index(kv[0])):
        off, auto, offload = r["off"], r["auto"], r.get("auto_offload")
        where = lambda mode: mode["plans"].get(str(mode["longest_seq_len"]), "–")  # noqa: E731
        reach = (f"{offload['longest_seq_len']}" + (" (the longest tried)" if offload["longest_seq_len"] ==
                                                   r["lengths_tried"][-1] else "") + f" | {where(offload)}"
                 if offload else "not measured | –")
        out.append(f"| {ENGINE_NAMES[engine]} | {r['budget_mib']:.1f} | {off['longest_seq_len']} | {where(off)} "
                   f"| {auto['longest_seq_len']} | {where(auto)} | {r['ratio_auto_to_off']:.0f}× "
                   f"| {off['oom_events']} / {auto['oom_events']} | {reach} |")
    return "\n".join(out)


def placement_accuracy(device: str) -> str:
    """``benchmarks/placement_accuracy.py``: per model size and placement, each held component's
    (predicted − measured) / measured, the measured total, ZeRO-3's gathered parameters (the
    most held after a fetch beside the accounting's bound) and the host bytes per rank the run
    planned beside rank 0's resident peak over the run, (planned − resident) / resident (newest
    row per size, placement, component; DDP: the host peak only)."""
    rows = newest_by("placement_accuracy", device, lambda row: (row.get("size"), row.get("placement"), row.get("component")))
    components = ("parameters", "gradients", "optimizer_state", "buffers")
    out = ["| model | placement | parameters | gradients | optimizer state | buffers | total: measured MiB | total "
           "| ZeRO-3 gathered MiB: held / bound | host peak MiB per rank: planned / resident |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    runs = dict.fromkeys((size, placement) for size, placement, component in rows
                         if component in ("total", "failed", "host_peak"))
    for size, placement in runs:
        peak = rows.get((size, placement, "host_peak"))
        host = (f"{peak['predicted_bytes'] / 2**20:.0f} / {peak['measured_bytes'] / 2**20:.0f} "
                f"({fmt(peak['relative_error'], '+.0%')})") if peak else "–"
        if (size, placement, "total") not in rows and peak:  # DDP: the host peak only
            out.append(f"| {size} ({peak['parameters'] / 1e6:.1f}M) | {placement} | – | – | – | – | – | – | – | {host} |")
            continue
        if (size, placement, "total") not in rows:
            failed = rows[size, placement, "failed"]
            why = "a rank was killed (SIGKILL): past this machine's memory" if "SIGKILL" in failed["stderr_tail"] else ""
            out.append(f"| {size} | {placement} | did not run (exit {failed['returncode']}{'; ' + why if why else ''}) "
                       f"| | | | | | | |")
            continue
        total = rows[size, placement, "total"]
        cells = [fmt(rows[size, placement, c]["relative_error"], "+.1%") if (size, placement, c) in rows else "–"
                 for c in components]
        gathered = rows.get((size, placement, "gathered"))
        held = f"{gathered['measured_bytes'] / 2**20:.0f} / {gathered['predicted_bytes'] / 2**20:.0f}" if gathered else "–"
        out.append(f"| {size} ({total['parameters'] / 1e6:.1f}M) | {placement} | {' | '.join(cells)} "
                   f"| {total['measured_bytes'] / 2**20:.1f} | {fmt(total['relative_error'], '+.1%')} | {held} | {host} |")
    return "\n".join(out)


def moment_accuracy(device: str) -> str:
    """``benchmarks/moment_accuracy.py``: per engine and moment (resume, export), the newest row per
    rank count and precision: each relative error, the |error| median and worst, and whether the
    plan's peak covered every count; each group's commits."""
    rows = newest_by("moment_accuracy", device, lambda row: (
        row.get("engine"), row.get("resumed_from"), row.get("moment"), row.get("world_size"), row.get("precision"),
        row.get("checkpoint_format", "auto"), row.get("resumed_format", "auto")))
    mine = [r for r in rows.values() if "moment" in r]

    def switched(r: dict) -> bool:  # another engine's checkpoint, or another format's
        return (r["resumed_from"], r.get("resumed_format", "auto")) != (r["engine"], r.get("checkpoint_format", "auto"))

    def named(engine: str, checkpoint_format: str) -> str:
        return ENGINE_NAMES[engine] + ("" if checkpoint_format == "auto" else f" writing {checkpoint_format}")

    out = ["| engine | moment | rows | errors (ranks, precision: error) | \\|error\\| median | worst | lowest "
           "| within the plan's peak | commits |", "|---|---|---|---|---|---|---|---|---|"]
    for engine, name in ENGINE_NAMES.items():
        for moment in ("resume", "export"):
            group = sorted((r for r in mine if r["engine"] == engine and r["moment"] == moment and not switched(r)),
                           key=lambda r: (r["world_size"], r["precision"]))
            if not group:
                continue
            d = error_distribution([r["relative_error"] for r in group])
            cells = ", ".join(f"{r['world_size']} {r['precision']}: {r['relative_error']:+.1%}" for r in group)
            commits = ", ".join(sorted({(r.get("commit") or "none")[:7] for r in group}))
            covered = "all" if all(r["covered"] for r in group) else "**not all**"
            out.append(f"| {name} | {moment} | {d['rows']} | {cells} | {d['median']:.1%} | {d['worst']:.1%} "
                       f"| {min(r['relative_error'] for r in group):+.1%} | {covered} | {commits} |")
    switches = sorted((r for r in mine if switched(r) and r["moment"] == "resume"),
                      key=lambda r: (r["resumed_from"], r.get("resumed_format", "auto"), r["engine"],
                                     r.get("checkpoint_format", "auto")))
    if switches:
        out += ["", "The engine switch (another engine's checkpoint, or another checkpoint.format, resumed; "
                "2 ranks, fp32):", "",
                "| checkpoint of | resumed under | predicted | counted | error | within the plan's peak | commit |",
                "|---|---|---|---|---|---|---|"]
        out += [f"| {named(r['resumed_from'], r.get('resumed_format', 'auto'))} "
                f"| {named(r['engine'], r.get('checkpoint_format', 'auto'))} | {r['predicted_bytes'] / 1e6:.1f} MB "
                f"| {r['measured_bytes'] / 1e6:.1f} MB | {r['relative_error']:+.1%} | {'yes' if r['covered'] else '**no**'} "
                f"| {(r.get('commit') or 'none')[:7]} |" for r in switches]
    return "\n".join(out)


def staleness(results: Path = RESULTS) -> list[dict]:
    """Per results file (``<name>-<device>.jsonl``): its rows, how many record the commit they
    measured, the newest such commit, and whether the code it measured — ``memtrain/``,
    ``benchmarks/common.py`` and the benchmark's script — differs between that commit and the
    checkout's HEAD (``code_changed_since``; None where no row records a commit or git cannot
    tell). A changed file is not a changed number: it says which tables to measure again.

    Raises:
        FileNotFoundError: ``results`` does not exist.
    """
    repo = results.parents[1]
    report = []
    for path in sorted(results.glob("*.jsonl")):
        name = path.stem.split("-")[0]
        with open(path) as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
        commits = [r["commit"] for r in rows if r.get("commit")]
        changed = None
        if commits:
            script = f"benchmarks/{MEASURED_BY.get(name, name)}.py"
            diff = subprocess.run(["git", "diff", "--quiet", commits[-1], "HEAD", "--", "memtrain", "benchmarks/common.py",
                                   script], cwd=repo, capture_output=True, timeout=60)
            changed = {0: False, 1: True}.get(diff.returncode)  # any other code: git could not tell
        report.append({"results": path.name, "rows": len(rows), "rows_with_commit": len(commits),
                       "newest_commit": commits[-1] if commits else None, "code_changed_since": changed})
    return report


FRESHNESS_BEGIN, FRESHNESS_END = "<!-- freshness: begin -->", "<!-- freshness: end -->"
"""The markers around docs/benchmarks.md's generated freshness table (:func:`freshness`)."""


def freshness(results: Path = RESULTS) -> str:
    """Per results file, from :func:`staleness`: its newest commit and whether the code that
    measured it changed since (``stale``: its table shows rows older than the code), as the
    markdown table docs/benchmarks.md carries between :data:`FRESHNESS_BEGIN` and
    :data:`FRESHNESS_END` (``tests/test_docs.py`` fails when it is not this output)."""
    words = {False: "no", True: "**yes: stale**", None: "cannot tell (no row records its commit)"}
    out = ["| results | rows (with their commit) | newest commit | measured code changed since |", "|---|---|---|---|"]
    for e in staleness(results):
        commit = e["newest_commit"][:7] if e["newest_commit"] else "-"
        out.append(f"| `{e['results']}` | {e['rows']} ({e['rows_with_commit']}) | {commit} "
                   f"| {words[e['code_changed_since']]} |")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("benchmark", choices=["oom_stress", "largest_model_plan", "overhead", "memory_accuracy", "solver",
                                              "solver_exhaustive", "lossy_levers", "lossy_step_cost", "seq_len_reach",
                                              "memory_accuracy_levers", "memory_accuracy_families", "peers",
                                              "placement_accuracy", "host_step_rates", "moment_accuracy", "stale",
                                              "freshness"])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if args.benchmark == "freshness":
        print(freshness())
        return 0
    if args.benchmark == "stale":  # JSON lines, one per results file
        for entry in staleness():
            print(json.dumps(entry))
        return 0
    if args.benchmark == "largest_model_plan":
        print(largest_model_plan())
        return 0
    simple = {"overhead": overhead, "memory_accuracy": memory_accuracy, "solver": solver, "lossy_levers": lossy_levers,
              "seq_len_reach": seq_len_reach, "placement_accuracy": placement_accuracy,
              "solver_exhaustive": solver_exhaustive, "lossy_step_cost": lossy_step_cost,
              "memory_accuracy_levers": memory_accuracy_levers, "memory_accuracy_families": memory_accuracy_families,
              "peers": peers, "host_step_rates": host_step_rates, "moment_accuracy": moment_accuracy}
    if args.benchmark in simple:
        print(simple[args.benchmark](args.device))
        pooled = overhead_pooled(args.device) if args.benchmark == "overhead" else ""
        if pooled.count("\n") > 1:  # a row under the header
            since = ", ".join(f"{ENGINE_NAMES[e]} {c}" for e, c in POOLED_SINCE.items())
            print(f"\nPooled over the runs with the armed variant measured at or after ({since}):\n\n" + pooled)
        return 0
    print("Steady:\n\n" + oom_stress_steady(args.device))
    if newest("oom_stress", args.device, "spike"):
        print("\nSpike:\n\n" + oom_stress_spike(args.device))
    host = oom_stress_host_limit(args.device)
    if host.count("\n") > 1:
        print("\nUnder a real per-process limit (host_limit):\n\n" + host)
    return 0


if __name__ == "__main__":
    sys.exit(main())
