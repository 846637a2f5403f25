"""transformers' Trainer with ``auto_find_batch_size``: its documented way to survive an
out-of-memory error (the per-device batch is reduced and training restarts)."""

import json
import os

from transformers import Trainer, TrainerCallback, TrainingArguments

from shared import SETTINGS, examples, model

s = SETTINGS
world_size = int(os.environ.get("WORLD_SIZE", 1))
args = TrainingArguments(
    output_dir=s["out"], use_cpu=True, ddp_backend="gloo", seed=s["seed"], max_steps=s["max_steps"],
    per_device_train_batch_size=s["micro_batch_size"], auto_find_batch_size=True,
    gradient_accumulation_steps=s["global_batch_size"] // (s["micro_batch_size"] * world_size),
    learning_rate=s["lr"], weight_decay=s["weight_decay"], max_grad_norm=s["max_grad_norm"],
    adam_beta1=s["adam_beta1"], adam_beta2=s["adam_beta2"], adam_epsilon=s["adam_eps"],
    lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": s["min_lr_ratio"]},
    warmup_steps=s["warmup_steps"], logging_steps=1, save_strategy="no", report_to=[])


class Steps(TrainerCallback):
    """Each optimizer step's global batch (per-device batch × accumulation × ranks) and loss."""

    def __init__(self):
        self.tried, self.steps = [], []

    def on_train_begin(self, args, state, control, **kwargs):
        self.tried.append(state.train_batch_size)
        self.steps.clear()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.steps.append({"samples": state.train_batch_size * args.gradient_accumulation_steps * world_size,
                               "loss": logs["loss"]})


steps = Steps()
Trainer(model=model(), args=args, train_dataset=examples(), callbacks=[steps]).train()
os.makedirs(s["out"], exist_ok=True)
with open(os.path.join(s["out"], f"oom_record_{args.process_index}.json"), "w") as fh:
    json.dump({"micro_batch_sizes": steps.tried, "steps": steps.steps}, fh)
