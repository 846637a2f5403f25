"""The planner's predicted peak beside an independent count, per engine and plan.

For each engine (DDP, FSDP2, ZeRO-2, ZeRO-3; 2 ranks) and each plan (micro-batch size ×
activation checkpointing off/on) one short run counts its second optimizer step (ZeRO-3's
fourth: :data:`COUNTED_STEP`) with torch's
``MemTracker`` (``logging.memory_breakdown_step``: every tensor the rank allocates, from before
the model is built, engine buffers included; on CUDA ``max_memory_allocated`` is reported beside
it), and ``memtrain.estimate.plan_report`` predicts the same plan's peak without running
anything. One JSON row per (engine, plan, rank 0):

    engine, micro_batch_size, gradient_accumulation_steps, activation_checkpointing,
    predicted_bytes (the planned peak: on CUDA with the allocator's headroom), predicted_tensor_bytes
    (without it), measured_bytes, relative_error = (predicted_tensor - measured) / measured,
    cuda_max_memory_allocated and cuda_relative_error = (predicted - max_memory_allocated) / it (CUDA),
    measured_by_category (MemTracker's: Parameter, Gradient, Optstate, Activation, Temp, ...),
    predicted_state_bytes, predicted_activation_bytes

and a last ``summary`` row: min/median/max relative error per engine.

    python benchmarks/memory_accuracy.py                    # the CPU model of benchmarks/common.py, 4 engines × 4 plans
    python benchmarks/memory_accuracy.py --shape gpt2_small # GPT-2 small's blocks (86M parameters), 4 engines × 2 plans
    python benchmarks/memory_accuracy.py --quick            # the tests' tiny model, 4 engines × 1 plan (prints only)
    python benchmarks/memory_accuracy.py --device cuda --shape gpt2_small --precision bf16
                                                            # one GPU, 1 rank: also cuda_relative_error, the
                                                            # prediction against torch.cuda.max_memory_allocated
    python benchmarks/memory_accuracy.py --levers           # each lever's saving: predicted and counted
    python benchmarks/memory_accuracy.py --results          # also append the rows to benchmarks/results/

``--families``: new sizes. The model families the accounting was developed on at seed 0's sizes
(so only the sizes drawn from another seed are out of sample: Llama with
grouped-query attention, Mistral with a sliding window, Qwen2 with attention biases, GPT-NeoX
with partial rotary embeddings, GPT-2), two mixture-of-experts families added after it
(Mixtral, Qwen2-MoE; ZeRO-3's and FSDP2's terms were then changed with their seed-1 rows in
view) and the speech recipe's WavLM for CTC (on one global batch of synthetic utterances, so the
counted step holds the longest micro-batch, the one the planner traces), each at sizes drawn
from ``--seed`` (recorded in every row with the drawn ``model_config``; from seed 2 on the
sequence length, a speech model's words per utterance, is drawn too, :mod:`model_families`), ×
the 4 engines × activation checkpointing off/selective/on ×
fp32/bf16 × 1 and 2 ranks (``--engines``, ``--ac``, ``--precisions``, ``--world_sizes`` pick a
subset), at a global batch of 16 (micro-batches of 4: accumulation 2 on 2 ranks, 4 on 1), or
``--accumulation`` micro-batches per step (1: a plan that does not accumulate, the planner's
first candidate). Rows ``memory_accuracy_families`` carry ``model_type``, ``seed``,
``gradient_accumulation_steps`` and the commit; the summary gives, per engine and per family, the
median, p90 and worst |relative error| (goal: ≤ 2%, ≤ 4%, ≤ 10%, and no row under by more than
2%). The count is the highest rank's (:func:`measured`).

``--levers``: per engine, each lever (selective AC, chunked cross-entropy, bf16 optimizer state
where the engine takes it) at micro-batch 16 with AC otherwise off, and chunked cross-entropy
again with logits large enough for two chunks (:data:`LARGE_LOGITS`), against the same plan
without it: the bytes it saves, predicted and counted by MemTracker (rows
``memory_accuracy_levers``, ``saving_error`` = (predicted − counted) / counted; goal within 10%).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CPU_ARGS, ENGINES, REPO, TINY_ARGS, emit, run_memtrain, scratch_dir  # noqa: E402
from model_families import FAMILIES, SPEECH, draw, model_args  # noqa: E402

from memtrain.levers.activation_checkpointing import setting  # noqa: E402 (results of older versions hold a bool)

FULL_PLANS = [(16, "off"), (8, "off"), (16, "on"), (4, "on")]  # global batch 64 on 2 ranks
QUICK_PLANS = [(2, "off")]  # global batch 8 on 2 ranks
# GPT-2 small's 12 blocks of width 768 with the corpus's 1024-token vocabulary (86M parameters; its
# blocks are past ZeRO-3's persistence threshold, so ZeRO-3 partitions and gathers them)
GPT2_SMALL_ARGS = CPU_ARGS + ["--model.config.n_layer", "12", "--model.config.n_embd", "768", "--model.config.n_head", "12",
                              "--model.config.n_positions", "128", "--data.seq_len", "128", "--training.global_batch_size", "8"]
GPT2_SMALL_PLANS = [(2, "off"), (2, "on")]  # global batch 8 on 2 ranks: accumulation 2
SHAPES = {"cpu": (CPU_ARGS + ["--training.global_batch_size", "64"], FULL_PLANS),
          "gpt2_small": (GPT2_SMALL_ARGS, GPT2_SMALL_PLANS), "quick": (TINY_ARGS + ["--checkpoint.every_steps", "0"], QUICK_PLANS)}


def predicted(args: list[str], micro: int, ac: str, world_size: int, flags: tuple[str, ...] = ()) -> dict:
    """The planner's prediction for plan ``micro`` × AC ``ac`` with the lever ``flags`` (bytes per rank)."""
    from memtrain.config import parse_args
    from memtrain.estimate import plan_report

    cfg = parse_args(args + ["--training.micro_batch_size", str(micro), "--memory.activation_checkpointing", ac,
                             *flags])
    report = plan_report(cfg, world_size)
    row = next(c for c in report["candidates"] if c["micro_batch_size"] == micro and setting(
        c.get("activation_checkpointing")) == ac)
    from memtrain.memory.accounting import without_allocator_headroom

    tensors = without_allocator_headroom(row["predicted_peak_bytes"], report["machine"]["device_type"])
    return {"gradient_accumulation_steps": row["gradient_accumulation_steps"], "predicted_tensor_bytes": tensors,
            "predicted_bytes": row["predicted_peak_bytes"], "predicted_activation_bytes": row["activation_bytes"],
            "predicted_state_bytes": row["predicted_peak_bytes"] - row["activation_bytes"]}


COUNTED_STEP = {"zero3": 4}
"""The optimizer step an engine's run is counted at (its last), where not the second: the first
step after the engine has settled. DeepSpeed ZeRO-3 settles at its fourth: its parameter
coordinator records the order of module calls in step 1 (``reset_step``), and where a step has
one micro-batch, step 2's backward calls more modules than step 1 recorded (``trace_prologue``
invalidates the trace), so step 2 releases even the persistent parameters after each use
(``release_sub_module`` keeps them only under a complete trace) and step 3 records again; from
step 4 on the trace holds and the persistent parameters stay whole. MemTracker, GPT-NeoX of
0.29M parameters (seed 7), AC off, fp32, 2 ranks, one micro-batch per step: step 2 7,790,625
bytes, none of them the parameters; step 6 8,933,537, the parameters' 1,142,912 more (the trace
modes logged from ``PartitionedParameterCoordinator``, DeepSpeed 0.19.8)."""


def counted_step(engine: str) -> int:
    """The optimizer step ``engine``'s runs are counted at (:data:`COUNTED_STEP`, else the second)."""
    return COUNTED_STEP.get(engine, 2)


def measured(args: list[str], engine: str, micro: int, ac: str, world_size: int, flags: tuple[str, ...] = ()) -> dict:
    """The MemTracker count of a run of the plan (with the lever ``flags``) that ends at the step
    :func:`counted_step` names and counts it, on the rank whose peak is highest (ranks of a speech
    batch hold utterances of different lengths)."""
    out = scratch_dir(f"memacc-{engine}")
    step = str(counted_step(engine))
    try:
        run_memtrain(args + ENGINES[engine] + ["--training.max_steps", step, "--logging.memory_breakdown_step", step,
                                               "--training.micro_batch_size", str(micro),
                                               "--memory.activation_checkpointing", ac, *flags],
                     out, nproc=world_size, timeout=900)
        counts = []
        for rank in range(world_size):
            with open(os.path.join(out, "memory_breakdown", f"rank_{rank:05d}.json")) as fh:
                counts.append(json.load(fh))
        return max(counts, key=lambda count: count["peak_bytes"])
    finally:
        shutil.rmtree(out, ignore_errors=True)


def rows(args: list[str], plans: list[tuple[int, str]], engines: list[str], world_size: int, shape: str):
    """One row per engine and plan (see the module docstring)."""
    for engine in engines:
        engine_args = args + ENGINES[engine]
        for micro, ac in plans:
            count = measured(args, engine, micro, ac, world_size)
            guess = predicted(engine_args, micro, ac, world_size)
            yield {"benchmark": "memory_accuracy", "shape": shape, "engine": engine, "world_size": world_size,
                   "micro_batch_size": micro, "activation_checkpointing": ac, **guess,
                   "measured_bytes": count["peak_bytes"], "measured_by_category": count["peak_by_category"],
                   "counted_step": counted_step(engine),
                   "cuda_max_memory_allocated": count["cuda_max_memory_allocated"],
                   "relative_error": (guess["predicted_tensor_bytes"] - count["peak_bytes"]) / count["peak_bytes"],
                   **({"cuda_relative_error": (guess["predicted_bytes"] - count["cuda_max_memory_allocated"])
                       / count["cuda_max_memory_allocated"]} if count["cuda_max_memory_allocated"] else {})}


LEVERS = (("selective activation checkpointing", "selective", ()),
          ("chunked cross-entropy", "off", ("--memory.chunked_cross_entropy", "true")),
          ("bf16 optimizer state", "off", ("--optimizer.state_dtype", "bf16")))
"""Each lever against the same plan without it: (name, AC setting, flags). Not here: activation
offload (on a CPU its tensors stay in the one memory MemTracker counts: its device-side saving is
a GPU measurement) and int8 optimizer state (torchao's compiled step cannot run under MemTracker;
tests/test_optimizer_state.py counts its bytes against the optimizer's own tensors)."""


LARGE_LOGITS = (["--training.global_batch_size", "128", "--data.vocab_size", "8192"], 64,
                (("chunked cross-entropy, logits of two chunks", "off", ("--memory.chunked_cross_entropy", "true")),))
"""Chunked cross-entropy where it saves: a chunk holds 64 MiB of fp32 logits, all of the CPU model's
at micro-batch 16 (4 MiB); with an 8192-token vocabulary at micro-batch 64 they are 128 MiB."""


def lever_rows(args: list[str], micro: int, engines: list[str], world_size: int, shape: str, levers=LEVERS):
    """Per engine, each of ``levers`` it takes: the peak it saves at plan ``micro`` (AC off),
    predicted (``memtrain plan``) and counted (MemTracker, the run without the lever less the run
    with it), and ``saving_error`` = (predicted − counted) / counted."""
    for engine in engines:
        engine_args = args + ENGINES[engine]
        base = measured(args, engine, micro, "off", world_size)["peak_bytes"]
        base_guess = predicted(engine_args, micro, "off", world_size)["predicted_tensor_bytes"]
        for name, ac, flags in levers:
            if (engine == "zero3" and ac == "selective") or (engine in ("zero2", "zero3") and "--optimizer.state_dtype"
                                                                 in flags):
                continue  # refused there by name (ZeRO-3 has no selective AC; ZeRO keeps fp32 moments)
            count = measured(args, engine, micro, ac, world_size, flags)["peak_bytes"]
            guess = predicted(engine_args, micro, ac, world_size, flags)["predicted_tensor_bytes"]
            saved, predicted_saved = base - count, base_guess - guess
            yield {"benchmark": "memory_accuracy_levers", "shape": shape, "engine": engine, "world_size": world_size,
                   "micro_batch_size": micro, "lever": name, "measured_bytes_without": base, "measured_bytes": count,
                   "predicted_bytes_without": base_guess, "predicted_bytes": guess, "measured_saving_bytes": saved,
                   "predicted_saving_bytes": predicted_saved,
                   "saving_error": (predicted_saved - saved) / saved if saved else None}


FAMILY_ARGS = ["--config", str(REPO / "recipes" / "code_lm_tiny.yaml"), "--data.max_bytes", "1000000",
               "--data.vocab_size", "1024", "--training.global_batch_size", "16", "--training.warmup_steps", "2",
               "--training.eval_every", "0", "--training.eval_samples", "8", "--checkpoint.every_steps", "0"]
SPEECH_FAMILY_ARGS = ["--config", str(REPO / "recipes" / "asr_ctc_wavlm_tiny.yaml"), "--data.speech.train_utterances",
                      "16", "--data.speech.test_utterances", "8", "--training.global_batch_size", "16",
                      "--training.warmup_steps", "2", "--training.eval_every", "0", "--training.eval_samples", "8",
                      "--checkpoint.every_steps", "0"]
"""A speech family's runs: the speech recipe's synthetic utterances, one global batch of them,
so the counted step holds the longest micro-batch (sorted by length: ``bucket_batches``) on one
rank, the batch the planner traces (:func:`memtrain.planning.activations.trace_batch`)."""
FAMILY_MICRO_BATCH = 4  # global batch 16: accumulation 2 on 2 ranks, 4 on 1
AC_SETTINGS = ("off", "selective", "on")


def accumulation_args(family: str, world_size: int, accumulation: Optional[int]) -> list[str]:
    """The arguments that make a family's runs accumulate ``accumulation`` micro-batches of
    :data:`FAMILY_MICRO_BATCH` per step on ``world_size`` ranks (a speech family's utterances one
    global batch of them); None = the global batch of 16 (accumulation 2 on 2 ranks, 4 on 1)."""
    if accumulation is None:
        return []
    batch = str(FAMILY_MICRO_BATCH * world_size * accumulation)
    return ["--training.global_batch_size", batch] + (["--data.speech.train_utterances", batch]
                                                      if family in SPEECH else [])


def family_rows(families: list[str], seed: int, engines: list[str], acs: list[str], precisions: list[str],
                world_sizes: list[int], data_args: list[str], accumulations: tuple = (None,)):
    """New sizes (``--families``): one row per family × engine × AC × precision × ranks (× the
    ``accumulations``: :func:`accumulation_args`), the family's model drawn with ``seed``
    (:func:`model_families.draw`); ZeRO-3 refuses selective AC by name, so that combination is
    left out."""
    for family, world_size, accumulation in itertools.product(families, world_sizes, accumulations):
        config = draw(family, seed)
        for precision in precisions:
            base = SPEECH_FAMILY_ARGS if family in SPEECH else FAMILY_ARGS
            args = (base + data_args + model_args(config) + ["--precision", precision]
                    + accumulation_args(family, world_size, accumulation))
            for engine in engines:
                for ac in acs:
                    if engine == "zero3" and ac == "selective":
                        continue
                    count = measured(args, engine, FAMILY_MICRO_BATCH, ac, world_size)
                    guess = predicted(args + ENGINES[engine], FAMILY_MICRO_BATCH, ac, world_size)
                    yield {"benchmark": "memory_accuracy_families", "model_type": family, "seed": seed,
                           "model_config": config, "engine": engine, "world_size": world_size,
                           "precision": precision, "micro_batch_size": FAMILY_MICRO_BATCH,
                           "activation_checkpointing": ac, **guess, "measured_bytes": count["peak_bytes"],
                           "counted_step": counted_step(engine),
                           "measured_by_category": count["peak_by_category"],
                           "relative_error": (guess["predicted_tensor_bytes"] - count["peak_bytes"])
                           / count["peak_bytes"]}


def error_distribution(errors: list[float]) -> dict:
    """median, p90 and worst of ``|errors|`` (relative), and how many."""
    size = sorted(abs(e) for e in errors)
    p90 = size[min(len(size) - 1, max(0, round(0.9 * len(size)) - 1))]
    return {"median": statistics.median(size), "p90": p90, "worst": size[-1], "rows": len(size)}


def family_summary(results: list[dict], seed: int) -> dict:
    """The |error| distribution per engine and per family (:func:`error_distribution`)."""
    def by(key: str) -> dict:
        groups: dict[str, list[float]] = {}
        for r in results:
            groups.setdefault(r[key], []).append(r["relative_error"])
        return {k: error_distribution(v) for k, v in groups.items()}

    return {"benchmark": "memory_accuracy_families", "seed": seed, "summary": by("engine"),
            "summary_by_family": by("model_type")}


def summary(results: list[dict], shape: str) -> dict:
    """min/median/max relative error per engine."""
    by_engine: dict[str, list[float]] = {}
    for r in results:
        by_engine.setdefault(r["engine"], []).append(r["relative_error"])
    return {"benchmark": "memory_accuracy", "shape": shape, "summary": {
        e: {"min": min(v), "median": statistics.median(v), "max": max(v), "rows": len(v)} for e, v in by_engine.items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tests' tiny model, one plan per engine")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cpu: 2 ranks (gloo); cuda: 1 rank on one GPU")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="the runs' precision")
    parser.add_argument("--world_size", type=int, default=None, help="ranks (CPU default 2; CUDA: 1, one GPU)")
    parser.add_argument("--shape", choices=[k for k in SHAPES if k != "quick"], default="cpu",
                        help="the model: the benchmarks' CPU model (0.27M parameters) or GPT-2 small's blocks (86M)")
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of " + ",".join(ENGINES))
    parser.add_argument("--results", action="store_true", help="append to benchmarks/results/ (not with --quick)")
    parser.add_argument("--data_cache_dir", default=None, help="a corpus cache to reuse (data.cache_dir)")
    parser.add_argument("--levers", action="store_true", help="each lever's saving, predicted and counted, at "
                        "micro-batch 16 of the CPU model (rows memory_accuracy_levers)")
    parser.add_argument("--families", default=None, help="new sizes: comma-separated subset of "
                        + ",".join(FAMILIES) + " (rows memory_accuracy_families)")
    parser.add_argument("--seed", type=int, default=0, help="--families: the seed the model sizes are drawn with")
    parser.add_argument("--ac", default=",".join(AC_SETTINGS), help="--families: activation checkpointing settings")
    parser.add_argument("--precisions", default="fp32,bf16", help="--families: precisions")
    parser.add_argument("--world_sizes", default="1,2", help="--families: ranks")
    parser.add_argument("--accumulation", default=None, help="--families: gradient accumulation steps of "
                        f"micro-batches of {FAMILY_MICRO_BATCH} (comma-separated; default: a global batch of 16)")
    opts = parser.parse_args(argv)
    if opts.families:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        extra = ["--data.cache_dir", opts.data_cache_dir] if opts.data_cache_dir else []
        results = []
        for row in family_rows(opts.families.split(","), opts.seed, opts.engines.split(","), opts.ac.split(","),
                               opts.precisions.split(","), [int(w) for w in opts.world_sizes.split(",")], extra,
                               tuple(int(a) for a in opts.accumulation.split(",")) if opts.accumulation else (None,)):
            results.append(row)
            emit("memory_accuracy", "cpu", row, save=opts.results)
        emit("memory_accuracy", "cpu", family_summary(results, opts.seed), save=opts.results)
        return 0
    shape = "quick" if opts.quick else opts.shape
    args, plans = list(SHAPES[shape][0]), SHAPES[shape][1]
    if opts.data_cache_dir:
        args += ["--data.cache_dir", opts.data_cache_dir]
    args[args.index("--precision") + 1] = opts.precision
    if opts.device == "cpu":  # on a GPU host too: the runs and the plan on the CPU (the rows say cpu)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    else:
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device here")
    world_size = opts.world_size or (2 if opts.device == "cpu" else 1)
    if opts.levers:
        cases = [([], 2 if opts.quick else 16, LEVERS)] + ([] if opts.quick else [LARGE_LOGITS])
        for extra, micro, levers in cases:
            for row in lever_rows(args + extra, micro, opts.engines.split(","), world_size, shape, levers):
                emit("memory_accuracy", opts.device, {**row, "precision": opts.precision, "extra_args": extra},
                     save=opts.results and not opts.quick)
        return 0
    results = []
    for row in rows(args, plans, opts.engines.split(","), world_size=world_size, shape=shape):
        row["precision"] = opts.precision
        results.append(row)
        emit("memory_accuracy", opts.device, row, save=opts.results and not opts.quick)
    emit("memory_accuracy", opts.device, summary(results, shape), save=opts.results and not opts.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
