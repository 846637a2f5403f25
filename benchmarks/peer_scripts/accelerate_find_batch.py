"""A plain Accelerate loop under Accelerate's ``find_executable_batch_size``: its documented way
to survive an out-of-memory error (the micro-batch × 0.9 and the loop started again), with the
accumulation recomputed to keep the global batch as near as the new micro-batch allows."""

import json
import math
import os

import torch
from accelerate import Accelerator
from accelerate.utils import find_executable_batch_size
from torch.utils.data import DataLoader
from transformers import get_scheduler

from shared import SETTINGS, examples, model

s = SETTINGS
accelerator = Accelerator(cpu=True)
tried, trained = [], []


@find_executable_batch_size(starting_batch_size=s["micro_batch_size"])
def train(batch_size):
    tried.append(batch_size)
    trained.clear()
    accumulation = max(1, s["global_batch_size"] // (batch_size * accelerator.num_processes))
    accelerator.gradient_accumulation_steps = accumulation
    accelerator.free_memory()
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=s["lr"], weight_decay=s["weight_decay"],
                                  betas=(s["adam_beta1"], s["adam_beta2"]), eps=s["adam_eps"])
    scheduler = get_scheduler("cosine_with_min_lr", optimizer, num_warmup_steps=s["warmup_steps"],
                              num_training_steps=s["max_steps"], scheduler_specific_kwargs={"min_lr_rate": s["min_lr_ratio"]})
    loader = DataLoader(examples(), batch_size=batch_size, shuffle=False, drop_last=True)
    net, optimizer, loader, scheduler = accelerator.prepare(net, optimizer, loader, scheduler)
    samples = loss_sum = 0
    for _ in range(math.ceil(s["max_steps"] * accumulation / max(1, len(loader)))):
        for batch in loader:
            with accelerator.accumulate(net):
                loss = net(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            samples, loss_sum = samples + batch["input_ids"].shape[0] * accelerator.num_processes, loss_sum + float(loss)
            if accelerator.sync_gradients:
                trained.append({"samples": samples, "loss": loss_sum / accumulation})
                samples = loss_sum = 0
                if len(trained) == s["max_steps"]:
                    return


train()
os.makedirs(s["out"], exist_ok=True)
with open(os.path.join(s["out"], f"oom_record_{accelerator.process_index}.json"), "w") as fh:
    json.dump({"micro_batch_sizes": tried, "steps": trained}, fh)
