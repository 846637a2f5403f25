"""PyTorch Lightning: a LightningModule around the same transformers model, its Trainer on DDP, or
its FSDP / DeepSpeed ZeRO-2/3 strategy by one argument (``PEERS_ENGINE``)."""

import os

import pytorch_lightning as pl
from torch.utils.data import DataLoader, DistributedSampler

from shared import SETTINGS, StepClock, examples, finish, model, optimizer_and_schedule

s = SETTINGS
world_size = int(os.environ.get("WORLD_SIZE", 1))
strategy = {"ddp": "ddp" if world_size > 1 else "auto", "fsdp": "fsdp", "zero2": "deepspeed_stage_2",
            "zero3": "deepspeed_stage_3"}[os.environ.get("PEERS_ENGINE", "ddp")]


class CausalLM(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = model()

    def training_step(self, batch, batch_idx):
        return self.net(**batch).loss

    def configure_optimizers(self):
        optimizer, scheduler = optimizer_and_schedule(self.net.parameters())
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        data = examples()  # the shared order: Lightning's own distributed sampler would shuffle it
        sampler = DistributedSampler(data, self.trainer.world_size, self.trainer.global_rank, shuffle=False)
        return DataLoader(data, batch_size=s["micro_batch_size"], sampler=sampler, drop_last=True)


class Clock(pl.Callback):
    def __init__(self):
        self.clock, self.steps = StepClock(), 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step > self.steps:  # an optimizer step ended with this micro-batch
            self.steps = trainer.global_step
            self.clock.tick()


pl.seed_everything(s["seed"])
clock = Clock()
trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy,
                     max_steps=s["max_steps"], accumulate_grad_batches=s["global_batch_size"] // (s["micro_batch_size"] * world_size),
                     gradient_clip_val=s["max_grad_norm"], precision="32-true", callbacks=[clock], logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     use_distributed_sampler=False,
                     default_root_dir=s["out"])
module = CausalLM()
trainer.fit(module)
if trainer.is_global_zero:
    module.net.save_pretrained(f"{s['out']}/model")
finish(clock.clock, trainer.global_rank)
