"""A plain Accelerate training loop: what a user writes without a trainer."""

import math
import os

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from shared import SETTINGS, StepClock, examples, finish, model, optimizer_and_schedule

s = SETTINGS
accumulation = s["global_batch_size"] // (s["micro_batch_size"] * int(os.environ.get("WORLD_SIZE", 1)))
accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
net = model()
# a prepared scheduler steps once per process per optimizer step (transformers' run_clm_no_trainer.py)
optimizer, scheduler = optimizer_and_schedule(net.parameters(), steps_per_step=accelerator.num_processes)
loader = DataLoader(examples(), batch_size=s["micro_batch_size"], shuffle=False, drop_last=True)  # the shared order
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
