"""The resume and export moments: predicted device bytes against MemTracker's count, per engine.

A run of one step saves a checkpoint; a second run resumes it under the engine of the row, runs
one more step (the run's last) and exports. ``logging.memory_breakdown_step`` counts that step,
and MemTracker, entered before the model is built, also gives the peak before the step began
(the model's build, the engine's set-up and the checkpoint's load: the resume moment) and the
export's peak (:class:`memtrain.memory.breakdown.MemoryBreakdown`). The prediction is the
engine's ``held_bytes`` and what each moment adds on the CPU
(:func:`memtrain.memory.moments.moment_terms`); ``plan_peak_bytes`` is what the plan was fitted
to (its steps' peak and the larger moment: ``Candidate.planned_bytes``), which must cover both
counts (``covered``). The count is the highest rank's (rank 0 holds
the export's copy).

Rows ``moment_accuracy``: engine, ``resumed_from`` (the engine that wrote the checkpoint),
``checkpoint_format`` and ``resumed_format`` (the run's ``checkpoint.format`` and the one the
checkpoint was written in; ``auto``: the engine's own), world_size, precision, moment (``resume`` | ``export``), predicted_bytes, measured_bytes,
relative_error = (predicted − measured) / measured, plan_peak_bytes, covered. Goal (issue 76's
bounds): per moment |error| median ≤ 2%, p90 ≤ 4%, worst over ≤ 10%, none under by more than 2%.

    python benchmarks/moment_accuracy.py                  # 4 engines × fp32/bf16 × 1 and 2 ranks
    python benchmarks/moment_accuracy.py --quick          # the tests' tiny model, 2 ranks fp32, and QUICK_SWITCHES (prints only)
    python benchmarks/moment_accuracy.py --results        # also append the rows to benchmarks/results/
    python benchmarks/moment_accuracy.py --switch --results   # the engine switch: another engine's checkpoint

``--switch``: each pair of :data:`SWITCHES` (the checkpoint written under the first engine,
resumed under the second; 2 ranks, fp32). The engine switch reads the whole weights and
optimizer state on every rank; the prediction is the switch's
(:func:`memtrain.memory.moments.switch_resume_bytes`), which ``memtrain plan`` makes when the
checkpoint it would resume was written by another engine. A change of ``checkpoint.format`` is
read the same way (:data:`FORMAT_SWITCHES`, measured with ``--switch``). Not measured here: GPU
runs, where the files' reads and rank 0's copy are host memory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CPU_ARGS, ENGINES, TINY_ARGS, emit, run_memtrain, scratch_dir  # noqa: E402
from memory_accuracy import error_distribution  # noqa: E402

# the benchmarks' CPU model at width 256: its blocks' matrices pass ZeRO-3's persistence threshold,
# so ZeRO-3 partitions and gathers them (at width 64 it keeps every block parameter whole)
MODEL_ARGS = CPU_ARGS + ["--model.config.n_embd", "256", "--training.global_batch_size", "8",
                         "--training.micro_batch_size", "4"]
SWITCHES = (("ddp", "fsdp"), ("fsdp", "ddp"), ("ddp", "zero2"), ("ddp", "zero3"), ("zero2", "ddp"),
            ("fsdp", "zero2"), ("zero2", "fsdp"), ("zero3", "ddp"), ("zero3", "fsdp"))
"""(the engine that writes the checkpoint, the engine that resumes it) for ``--switch``."""
FORMAT_SWITCHES = (("ddp", "ddp+dcp"), ("ddp+dcp", "ddp"))
"""The ``checkpoint.format`` changes ``--switch`` adds (``engine+format``: the engine writing that
format): DDP's safetensors checkpoint resumed by DDP writing dcp, and the reverse."""
QUICK_SWITCHES = (("fsdp", "zero2"), ("zero3", "fsdp"))
"""The switches ``--quick`` adds: torch.distributed.checkpoint's read into ZeRO's universal load,
DeepSpeed's conversion into FSDP2's shards."""
QUICK_ARGS = TINY_ARGS + ["--model.config.n_embd", "256", "--model.config.n_head", "4"]


def split_run(run: str) -> tuple[str, str]:
    """``run`` (an engine of ``common.ENGINES``, or ``engine+format``: that engine writing that
    ``checkpoint.format``) as (engine, format; ``""`` for the engine's own)."""
    engine, _, checkpoint_format = run.partition("+")
    return engine, checkpoint_format


def engine_args(run: str) -> list[str]:
    """The arguments of ``run`` (:func:`split_run`): the engine's, with ``--checkpoint.format``
    where the run names one."""
    engine, checkpoint_format = split_run(run)
    return ENGINES[engine] + (["--checkpoint.format", checkpoint_format] if checkpoint_format else [])


def measured(args: list[str], engine: str, world_size: int, resumed_from: str) -> tuple[dict, dict]:
    """The highest rank's counts: ``resume`` (MemTracker's peak before the resumed run's step)
    and ``export`` (the export's peak), bytes; and the prediction (:func:`predicted`) made as
    ``memtrain plan`` makes it before the resume, with the checkpoint in place."""
    out = scratch_dir(f"moments-{engine}")
    try:
        run_memtrain(args + engine_args(resumed_from) + ["--training.max_steps", "1", "--checkpoint.every_steps", "1"],
                     out, nproc=world_size, timeout=900)
        guess = predicted(args + ["--output_dir", out], engine, world_size)
        run_memtrain(args + engine_args(engine) + ["--training.max_steps", "2", "--checkpoint.every_steps", "1",
                                               "--logging.memory_breakdown_step", "2"],
                     out, nproc=world_size, timeout=900)
        counts = []
        for rank in range(world_size):
            with open(os.path.join(out, "memory_breakdown", f"rank_{rank:05d}.json")) as fh:
                counts.append(json.load(fh))
        return {"resume": max(c["before_step_peak_bytes"] for c in counts),
                "export": max(c["export_peak_bytes"] for c in counts)}, guess
    finally:
        shutil.rmtree(out, ignore_errors=True)


def predicted(args: list[str], engine: str, world_size: int) -> dict:
    """The engine's predicted moments on the CPU and the plan's predicted peak (tensor bytes)."""
    from memtrain.config import parse_args
    from memtrain.estimate import plan_report
    from memtrain.memory.accounting import without_allocator_headroom
    from memtrain.memory.moments import moment_terms

    report = plan_report(parse_args(args + engine_args(engine)), world_size)
    moments = moment_terms(report["model_state_bytes"][split_run(engine)[0]], "cpu")
    chosen = next(c for c in report["candidates"] if c.get("chosen"))
    planned = max(chosen["predicted_peak_bytes"], chosen["moment_bytes"])  # what the plan was fitted to
    return {**moments, "plan_peak_bytes": without_allocator_headroom(planned, "cpu")}


def rows(args: list[str], engines: list[str], world_sizes: list[int], precisions: list[str], resumed_from=None):
    """Two rows (resume, export) per engine × ranks × precision."""
    for world_size in world_sizes:
        for precision in precisions:
            run_args = list(args)
            run_args[run_args.index("--precision") + 1] = precision
            for engine in engines:
                source = resumed_from or engine
                count, guess = measured(run_args, engine, world_size, source)
                (name, fmt), (saved_by, saved_fmt) = split_run(engine), split_run(source)
                for moment in ("resume", "export"):
                    yield {"benchmark": "moment_accuracy", "engine": name, "resumed_from": saved_by,
                           "checkpoint_format": fmt or "auto", "resumed_format": saved_fmt or "auto",
                           "world_size": world_size, "precision": precision, "moment": moment,
                           "predicted_bytes": guess[moment], "measured_bytes": count[moment],
                           "relative_error": (guess[moment] - count[moment]) / count[moment],
                           "plan_peak_bytes": guess["plan_peak_bytes"],
                           "covered": guess["plan_peak_bytes"] >= count[moment]}


def summary(results: list[dict]) -> dict:
    """The |error| distribution per moment and per engine, the most under, and whether every
    count was covered by its plan's peak."""
    out = {}
    for key in ("moment", "engine"):
        groups: dict[str, list[float]] = {}
        for r in results:
            groups.setdefault(r[key], []).append(r["relative_error"])
        out[f"by_{key}"] = {k: {**error_distribution(v), "lowest": min(v)} for k, v in groups.items()}
    return {"benchmark": "moment_accuracy", **out, "all_covered": all(r["covered"] for r in results)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tests' tiny model, 2 ranks, fp32 (prints only)")
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of " + ",".join(ENGINES))
    parser.add_argument("--precisions", default="fp32,bf16", help="comma-separated precisions")
    parser.add_argument("--world_sizes", default="1,2", help="comma-separated rank counts")
    parser.add_argument("--results", action="store_true", help="append to benchmarks/results/ (not with --quick)")
    parser.add_argument("--switch", action="store_true",
                        help="the engine switch (SWITCHES) and the checkpoint.format switch (FORMAT_SWITCHES), 2 ranks, fp32")
    opts = parser.parse_args(argv)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU: one memory for the device and the host
    args = QUICK_ARGS if opts.quick else MODEL_ARGS
    sizes, precisions = ([2], ["fp32"]) if opts.quick else ([int(w) for w in opts.world_sizes.split(",")],
                                                            opts.precisions.split(","))
    results = []
    pairs = ([(dst, src) for src, dst in SWITCHES + FORMAT_SWITCHES] if opts.switch
             else [(e, None) for e in opts.engines.split(",")])
    pairs += [(dst, src) for src, dst in QUICK_SWITCHES] if opts.quick else []
    every = (row for engine, source in pairs
             for row in rows(args, [engine], [2] if source else sizes, ["fp32"] if source else precisions, source))
    for row in every:
        results.append(row)
        emit("moment_accuracy", "cpu", row, save=opts.results and not opts.quick)
    emit("moment_accuracy", "cpu", summary(results), save=opts.results and not opts.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
