"""``memtrain plot RUN_DIR [--out FILE.png]``: one PNG of a run's ``metrics.jsonl``.

Panels over the optimizer step: loss and val_loss (the validation loss before step 1 at step 0);
learning rate; throughput (``<unit>_per_s``); peak memory (GiB, with the budget the run ran under
as a horizontal line; under a simulated device its peak and budget in MiB on an axis of their own
at the right, beside the process's GiB). Every panel carries a vertical line per event of the records' ``event``
field (plan changes, resume, checkpoint saves, others), and the loss panel names the plan
(micro-batch × accumulation and the levers on) wherever it changes. The title's steps and
minutes are the records' (every segment), so a plot of a run still going is not stale. Drawn
with matplotlib's Agg canvas (no display).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional

from memtrain.checkpoint.layout import read_summary
from memtrain.levers import LEVERS, describe, lever_events, restore_settings
from memtrain.metrics import read_records as metrics_records
from memtrain.records import duration_words, training_minutes

GIB = 2 ** 30
MIB = 2 ** 20

PLAN_EVENTS = frozenset({"plan_chosen", "oom_shrink", "oom_replan", "grow_back", "grow_back_failed",
                         "eval_oom_shrink"}) | lever_events()
EVENT_STYLES = {  # kind of event → legend label and line style
    "plan": {"label": "plan change", "color": "tab:red", "linestyle": "--"},
    "resume": {"label": "resume", "color": "tab:green", "linestyle": "-"},
    "checkpoint": {"label": "checkpoint saved", "color": "tab:gray", "linestyle": ":"},
    "other": {"label": "other event", "color": "tab:purple", "linestyle": "-."},
}
EVENT_GID = "memtrain-event"
"""The ``gid`` of every event line (``Line2D.get_gid()``), to tell them from data lines."""


class PlotError(Exception):
    """The run directory cannot be plotted (missing, no ``metrics.jsonl``, no records)."""


def read_records(run_dir: str) -> list[dict[str, Any]]:
    """The step records of ``RUN_DIR/metrics.jsonl``, sorted by ``step``.

    A line that is not a JSON object with a ``step`` (a line cut short by a kill) is skipped.
    Raises PlotError when the directory or the file is missing or holds no record.
    """
    if not os.path.isdir(run_dir):
        raise PlotError(f"{run_dir}: no such run directory")
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise PlotError(f"{run_dir}: no metrics.jsonl (not a memtrain run directory?)")
    records = [record for _, record in metrics_records(path)]
    if not records:
        raise PlotError(f"{path}: no step records")
    return sorted(records, key=lambda r: r["step"])


def event_kind(name: str) -> str:
    """The legend group of an event name: ``plan``, ``resume``, ``checkpoint`` or ``other``."""
    if name in PLAN_EVENTS:
        return "plan"
    return {"resume": "resume", "checkpoint_saved": "checkpoint"}.get(name, "other")


def events(records: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """(step, event name) for every name in the records' comma-separated ``event`` fields."""
    return [(r["step"], name) for r in records if isinstance(r.get("event"), str)
            for name in r["event"].split(",") if name]


def plan_changes(records: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """(step, ``"<micro_batch_size>×<gradient_accumulation_steps>"`` and the levers on, e.g.
    ``1×32 + AC``) at the first record and wherever the plan differs from the record before."""
    changes, last = [], None
    names = [x.name for x in LEVERS]
    for r in records:
        levers = restore_settings({name: r[name] for name in names if name in r})
        plan = (r.get("micro_batch_size"), r.get("gradient_accumulation_steps"), tuple(levers.items()))
        if None not in plan[:2] and plan != last:
            changes.append((r["step"], f"{plan[0]}×{plan[1]}{describe(levers)}"))
            last = plan
    return changes


def validation_series(records: list[dict[str, Any]], summary: Optional[dict[str, Any]]):
    """(steps, val_loss) with the loss before step 1 at step 0 (step 1's ``initial_val_loss``, or
    the summary's for records of older versions)."""
    steps, values = series(records, "val_loss")
    first = next((r["initial_val_loss"] for r in records if isinstance(r.get("initial_val_loss"), float)), None)
    if first is None and summary and isinstance(summary.get("initial_val_loss"), float):
        first = summary["initial_val_loss"]
    return ([0, *steps], [first, *values]) if first is not None else (steps, values)


def loss_unit(records: list[dict[str, Any]]) -> str:
    """The unit the loss is averaged over (``token``, ``character``), from the throughput field."""
    key = throughput_key(records)
    return key[:-len("_per_s")].removesuffix("s") if key else "target"


def series(records: list[dict[str, Any]], key: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
    """(steps, values / scale) of the records that have a numeric ``key``."""
    points = [(r["step"], r[key] / scale) for r in records
              if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    return [p[0] for p in points], [p[1] for p in points]


def throughput_key(records: list[dict[str, Any]]) -> Optional[str]:
    """The records' ``<unit>_per_s`` field (``tokens_per_s``, ``characters_per_s``), or None."""
    for r in records:
        for key in r:
            if key.endswith("_per_s"):
                return key
    return None


def draw_events(axes: list, marks: list[tuple[int, str]]) -> None:
    """A vertical line (gid :data:`EVENT_GID`) per (step, name) on every axes; the first line of
    each kind on the top axes carries the legend label."""
    labelled: set[str] = set()
    for ax in axes:
        for step, name in marks:
            kind = event_kind(name)
            style = dict(EVENT_STYLES[kind])
            label = style.pop("label")
            if ax is not axes[0] or kind in labelled:
                label = "_nolegend_"
            else:
                labelled.add(kind)
            ax.axvline(step, linewidth=1, alpha=0.7, gid=EVENT_GID, label=label, **style)


def figure(records: list[dict[str, Any]], summary: Optional[dict[str, Any]] = None, title: str = ""):
    """The run's matplotlib Figure (Agg canvas): four panels sharing the step axis.

    Args:
        records: step records (``read_records``); ``loss``, ``lr``, ``peak_memory_bytes`` (bytes)
            and ``<unit>_per_s`` are drawn where present, ``val_loss`` and ``simulated_peak_bytes`` too.
        summary: ``summary.json`` (optional): its steps, minutes and backend go into the title.
        title: the title's first part (the run directory).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(10, 11), layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_lr, ax_rate, ax_mem = fig.subplots(4, 1, sharex=True)
    ax_loss.plot(*series(records, "loss"), label="loss", color="tab:blue")
    val_steps, val_losses = validation_series(records, summary)
    if val_steps:
        ax_loss.plot(val_steps, val_losses, "o-", label="val_loss", color="tab:orange")
    ax_loss.set_ylabel(f"loss (nats per {loss_unit(records)})")
    ax_lr.plot(*series(records, "lr"), color="tab:blue")
    ax_lr.set_ylabel("learning rate")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    rate = throughput_key(records)
    if rate is not None:
        ax_rate.plot(*series(records, rate), color="tab:blue")
    ax_rate.set_ylabel((rate or "throughput").replace("_per_s", " / s"))
    ax_mem.plot(*series(records, "peak_memory_bytes", GIB), label="peak_memory_bytes", color="tab:blue")
    ax_mem.set_ylabel("peak memory (GiB)")
    ax_budget = ax_mem  # a CUDA cap is device memory, as the peak is
    if any("simulated_peak_bytes" in r for r in records):  # MiB of a simulated device beside GiB of the process
        ax_budget = ax_mem.twinx()
        ax_budget.plot(*series(records, "simulated_peak_bytes", MIB), label="simulated_peak_bytes", color="tab:orange")
        ax_budget.set_ylabel("simulated device (MiB)", color="tab:orange")
    budgets = series(records, "memory_budget_bytes", MIB if ax_budget is not ax_mem else GIB)[1]
    if budgets:
        ax_budget.axhline(budgets[-1], color="tab:red", linewidth=1, label="memory budget", gid="memtrain-budget")
    ax_mem.set_xlabel("optimizer step")
    ax_mem.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes = [ax_loss, ax_lr, ax_rate, ax_mem]
    draw_events(axes, events(records))
    for step, plan in plan_changes(records):
        ax_loss.annotate(plan, xy=(step, 1.0), xycoords=ax_loss.get_xaxis_transform(), xytext=(2, -2),
                         textcoords="offset points", va="top", fontsize=8, gid="memtrain-plan")
    for ax in axes:
        ax.grid(True, alpha=0.3)
    ax_loss.legend(loc="best", fontsize=8)
    lines = ax_mem.get_lines() + (ax_budget.get_lines() if ax_budget is not ax_mem else [])
    if any(line.get_label() in ("simulated_peak_bytes", "memory budget") for line in lines):
        ax_budget.legend(lines, [line.get_label() for line in lines], loc="best", fontsize=8)
    fig.suptitle(title_line(title, summary, records))
    return fig


def title_line(title: str, summary: Optional[dict[str, Any]], records: Optional[list[dict[str, Any]]] = None) -> str:
    """``title`` plus the steps and minutes of ``records`` (the summary's without records), and the
    summary's backend × world size and precision when known."""
    parts = [title] if title else []
    steps = records[-1]["step"] if records else (summary or {}).get("steps")
    minutes = training_minutes(records) if records else (summary or {}).get("minutes")
    if isinstance(steps, int) and isinstance(minutes, (int, float)):
        parts.append(f"{steps} steps in {duration_words(minutes)}")
    if summary:
        if summary.get("backend"):
            parts.append(f"{summary['backend']} × {summary.get('world_size', '?')}")
        if summary.get("precision"):
            parts.append(str(summary["precision"]))
    return ", ".join(parts)


def main(argv: Optional[list[str]] = None, command: str = "plot") -> int:
    """``memtrain plot RUN_DIR [--out FILE.png]``: writes the PNG, prints its path; returns the exit
    status (0, or 2 with one ``memtrain plot: …`` line on stderr when the run cannot be read or
    the PNG cannot be written)."""
    parser = argparse.ArgumentParser(prog=f"memtrain {command}", description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("run_dir", help="a run's output_dir (holding metrics.jsonl)")
    parser.add_argument("--out", help="PNG to write (default RUN_DIR/run.png)")
    args = parser.parse_args(argv)
    out = args.out or os.path.join(args.run_dir, "run.png")
    try:
        records = read_records(args.run_dir)
        fig = figure(records, read_summary(args.run_dir), title=os.path.basename(os.path.normpath(args.run_dir)))
        fig.savefig(out + ".tmp", dpi=100, format="png")  # whole or not at all
        os.replace(out + ".tmp", out)
    except PlotError as exc:
        print(f"memtrain plot: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(f"memtrain plot: needs matplotlib (pip install matplotlib): {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"memtrain plot: cannot write {out}: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
