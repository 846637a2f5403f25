"""What every peer script of ``benchmarks/peers.py`` shares, so that only the trainer differs: the
settings (a JSON file named by ``PEERS_SETTINGS``), the data (token rows [N, T] in an ``.npz``
file, examples ``{"input_ids": ids, "labels": ids}`` in transformers' convention), the model
(a transformers config built from the same seed) and the record each rank writes at the end.
Not counted as user code: each trainer needs the same."""

from __future__ import annotations

import json
import os
import resource
import time

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

SETTINGS = json.load(open(os.environ["PEERS_SETTINGS"])) if "PEERS_SETTINGS" in os.environ else {}
"""``data`` (.npz with ``train``/``validation``), ``model`` (a transformers config dict), ``seed``,
``global_batch_size``, ``micro_batch_size``, ``lr``, ``warmup_steps``, ``min_lr_ratio``,
``weight_decay``, ``max_grad_norm``, ``adam_beta1``, ``adam_beta2``, ``adam_eps``, ``max_steps``, ``out``
(this run's folder)."""


def examples(split: str = "train") -> list[dict]:
    """The split's rows as examples ``{"input_ids": ids, "labels": ids}`` (int64 [T] each)."""
    rows = np.load(SETTINGS["data"])[split].astype(np.int64)
    return [{"input_ids": torch.from_numpy(r), "labels": torch.from_numpy(r)} for r in rows]


def build_model(settings: dict) -> torch.nn.Module:
    """The model of ``settings`` (its ``model`` config dict, its ``seed``)."""
    torch.manual_seed(settings["seed"])
    config = dict(settings["model"])
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config))


def model() -> torch.nn.Module:
    """The model every trainer starts from: the same config, the same seed, the same weights."""
    return build_model(SETTINGS)


class StepClock:
    """Wall-clock seconds at the end of each optimizer step (``tick``), the same clock for every trainer."""

    def __init__(self):
        self.times = [time.perf_counter()]

    def tick(self) -> None:
        self.times.append(time.perf_counter())


def finish(clock: StepClock, rank: int) -> None:
    """Write this rank's record: its step end times and its peak resident memory (bytes,
    ``getrusage``'s ``ru_maxrss``: the same counter for every trainer)."""
    record = {"rank": rank, "step_end_s": [t - clock.times[0] for t in clock.times[1:]],
              "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    os.makedirs(SETTINGS["out"], exist_ok=True)
    with open(os.path.join(SETTINGS["out"], f"record_{rank}.json"), "w") as fh:
        json.dump(record, fh)
