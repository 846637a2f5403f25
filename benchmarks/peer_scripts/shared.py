"""What every peer script of ``benchmarks/peers.py`` shares, so that only the trainer differs: the
settings (a JSON file named by ``PEERS_SETTINGS``), the data (token rows [N, T] in an ``.npz``
file, examples ``{"input_ids": ids, "labels": ids}`` in transformers' convention), the model
(a transformers config built from the same seed) and the record each rank writes at the end.
Not counted as user code: each trainer needs the same.

The data order is one for all: memtrain reads ``train`` and draws its global batches with its
own sampler (seeded by ``data_seed``); the ``.npz`` also holds those global batches one after
the other (``train_in_order``), which the other trainers read without shuffling, so every
trainer's optimizer step ``k`` averages the gradients of the same rows."""

from __future__ import annotations

import json
import math
import os
import resource
import time

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

SETTINGS = json.load(open(os.environ["PEERS_SETTINGS"])) if "PEERS_SETTINGS" in os.environ else {}
"""``data`` (.npz with ``train``, ``train_in_order`` and ``validation``), ``model`` (a transformers
config dict), ``seed`` (the weights'), ``data_seed`` (the global batches' order),
``global_batch_size``, ``micro_batch_size``, ``lr``, ``warmup_steps``, ``min_lr_ratio``,
``weight_decay``, ``max_grad_norm``, ``adam_beta1``, ``adam_beta2``, ``adam_eps``, ``max_steps``, ``out``
(this run's folder)."""


def examples(split: str = "train_in_order") -> list[dict]:
    """The split's rows as examples ``{"input_ids": ids, "labels": ids}`` (int64 [T] each): by
    default the global batches in the order every trainer takes them (read them unshuffled)."""
    rows = np.load(SETTINGS["data"])[split].astype(np.int64)
    labels = rows.copy()
    labels[:, 0] = -100  # no token predicts the first: transformers' Trainer counts labels to average the loss
    return [{"input_ids": torch.from_numpy(r), "labels": torch.from_numpy(lab)} for r, lab in zip(rows, labels)]


def build_model(settings: dict) -> torch.nn.Module:
    """The model of ``settings`` (its ``model`` config dict, its ``seed``)."""
    torch.manual_seed(settings["seed"])
    config = dict(settings["model"])
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config))


def model() -> torch.nn.Module:
    """The model every trainer starts from: the same config, the same seed, the same weights."""
    return build_model(SETTINGS)


def optimizer_and_schedule(params, steps_per_step: int = 1):
    """AdamW with :data:`SETTINGS`' hyperparameters, weight decay on matrices only (biases and norms
    without), and the schedule every trainer follows, memtrain's (``memtrain/optim.py``): the
    learning rate of optimizer step ``k + 1`` is ``lr × (k + 1) / warmup_steps`` during warmup,
    then a cosine from ``lr`` to ``lr × min_lr_ratio`` at ``max_steps``. ``steps_per_step``: times
    the scheduler is stepped per optimizer step (a prepared Accelerate scheduler: once per process).
    Returns ``(optimizer, scheduler)``."""
    s = SETTINGS
    params = list(params)
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": s["weight_decay"]},
                                   {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=s["lr"],
                                  betas=(s["adam_beta1"], s["adam_beta2"]), eps=s["adam_eps"])

    def multiplier(count: int) -> float:
        k = count // steps_per_step
        if k < s["warmup_steps"]:
            return (k + 1) / s["warmup_steps"]
        progress = min(1.0, (k - s["warmup_steps"]) / max(1, s["max_steps"] - s["warmup_steps"]))
        return s["min_lr_ratio"] + (1 - s["min_lr_ratio"]) * 0.5 * (1 + math.cos(math.pi * progress))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)


class StepClock:
    """Wall-clock and process CPU seconds (every thread of this rank: ``time.process_time``) at the
    end of each optimizer step (``tick``), the same clocks for every trainer."""

    def __init__(self):
        self.times, self.cpu_times = [time.perf_counter()], [time.process_time()]

    def tick(self) -> None:
        self.times.append(time.perf_counter())
        self.cpu_times.append(time.process_time())


def peak_rss_bytes() -> int:
    """This process's resident peak so far, bytes (``getrusage``'s ``ru_maxrss``: the same counter
    for every trainer)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


IMPORTS_RSS_BYTES = peak_rss_bytes()
"""The resident peak when this module is imported: after the script's own imports (its trainer's
library) and this module's (torch, transformers, numpy), before any model or data: the process's
import footprint."""


def sharded_units(model: torch.nn.Module) -> int:
    """How many modules of ``model`` FSDP shards (FSDP2's ``fully_shard`` units and FSDP1's
    wrappers): 0 when the trainer did not shard it, whatever engine it was asked for."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return sum(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in model.modules())


def finish(clock: StepClock, rank: int, **ran) -> None:
    """Write this rank's record: its step end times (wall and CPU), its peak resident memory and its
    import footprint (bytes, :func:`peak_rss_bytes`), and ``ran``: what the trainer says it ran
    (e.g. ``sharded_units``)."""
    record = {"rank": rank, "step_end_s": [t - clock.times[0] for t in clock.times[1:]],
              "step_end_cpu_s": [t - clock.cpu_times[0] for t in clock.cpu_times[1:]],
              "peak_rss_bytes": peak_rss_bytes(), "imports_rss_bytes": IMPORTS_RSS_BYTES, "ran": ran}
    os.makedirs(SETTINGS["out"], exist_ok=True)
    with open(os.path.join(SETTINGS["out"], f"record_{rank}.json"), "w") as fh:
        json.dump(record, fh)
