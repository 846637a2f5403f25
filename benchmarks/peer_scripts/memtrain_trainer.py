"""memtrain's Trainer: the same model and data from Python (the engine by ``PEERS_ENGINE``; with
``PEERS_TRAINER=memtrain_glibc`` glibc's malloc thresholds left as the peers have them, with
``memtrain_fast`` fixed at a GPU run's 32 / 64 MiB)."""

import os

from memtrain import Trainer
from shared import SETTINGS, StepClock, examples, finish, model

s = SETTINGS
engine = {"ddp": {"name": "ddp"}, "fsdp": {"name": "fsdp"}, "zero2": {"name": "deepspeed", "zero_stage": 2},
          "zero3": {"name": "deepspeed", "zero_stage": 3}}[os.environ.get("PEERS_ENGINE", "ddp")]
settings = {"output_dir": s["out"], "precision": "fp32", "backend": engine, "checkpoint": {"every_steps": 0},
            "memory": {"host_allocator_thresholds": {"memtrain_glibc": False, "memtrain_fast": True}.get(
                os.environ.get("PEERS_TRAINER"))},
            "training": {"global_batch_size": s["global_batch_size"], "micro_batch_size": s["micro_batch_size"],
                         "max_steps": s["max_steps"], "seed": s["data_seed"], "lr": s["lr"], "warmup_steps": s["warmup_steps"],
                         "min_lr_ratio": s["min_lr_ratio"], "weight_decay": s["weight_decay"],
                         "max_grad_norm": s["max_grad_norm"], "adam_beta1": s["adam_beta1"],
                         "adam_beta2": s["adam_beta2"], "adam_eps": s["adam_eps"], "eval_every": 0}}
clock = StepClock()
# the built model, as the other scripts pass theirs: every engine starts from the same weights (a
# function would run inside deepspeed.zero.Init under ZeRO-3, where transformers draws them in its own order)
result = Trainer(settings, model=model(), train_dataset=examples("train")).fit()  # its sampler: the order
clock.times += [clock.times[0] + r["elapsed_s"] for r in result.records]  # memtrain's own step clocks
clock.cpu_times += [clock.cpu_times[0] + r["cpu_s"] for r in result.records]
finish(clock, int(os.environ.get("RANK", 0)))
