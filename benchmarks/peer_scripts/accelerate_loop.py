"""A plain Accelerate training loop: what a user writes without a trainer."""

import math
import os

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import get_scheduler

from shared import SETTINGS, StepClock, examples, finish, model

s = SETTINGS
accumulation = s["global_batch_size"] // (s["micro_batch_size"] * int(os.environ.get("WORLD_SIZE", 1)))
accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
net = model()
decay = [p for p in net.parameters() if p.dim() >= 2]
no_decay = [p for p in net.parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": s["weight_decay"]},
                               {"params": no_decay, "weight_decay": 0.0}], lr=s["lr"],
                              betas=(s["adam_beta1"], s["adam_beta2"]), eps=s["adam_eps"])
# a prepared scheduler steps once per process per optimizer step (transformers' run_clm_no_trainer.py)
scheduler = get_scheduler("cosine_with_min_lr", optimizer, num_warmup_steps=s["warmup_steps"] * accelerator.num_processes,
                          num_training_steps=s["max_steps"] * accelerator.num_processes,
                          scheduler_specific_kwargs={"min_lr_rate": s["min_lr_ratio"]})
loader = DataLoader(examples(), batch_size=s["micro_batch_size"], shuffle=True, drop_last=True)
net, optimizer, loader, scheduler = accelerator.prepare(net, optimizer, loader, scheduler)
clock, step = StepClock(), 0
for epoch in range(math.ceil(s["max_steps"] * accumulation / len(loader))):
    for batch in loader:
        with accelerator.accumulate(net):
            loss = net(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(net.parameters(), s["max_grad_norm"])
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            step += 1
            clock.tick()
            if step == s["max_steps"]:
                break
    if step == s["max_steps"]:
        break
if accelerator.is_main_process:
    accelerator.unwrap_model(net).save_pretrained(f"{s['out']}/model")
finish(clock, accelerator.process_index)
