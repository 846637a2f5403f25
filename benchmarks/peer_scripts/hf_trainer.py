"""transformers' Trainer: DDP, or its DeepSpeed / FSDP integration by one argument (``PEERS_ENGINE``)."""

import os

from transformers import Trainer, TrainerCallback, TrainingArguments

from shared import SETTINGS, StepClock, examples, finish, model, optimizer_and_schedule, sharded_units

s = SETTINGS
engine = {"ddp": {}, "zero2": {"deepspeed": s.get("deepspeed_zero2")}, "zero3": {"deepspeed": s.get("deepspeed_zero3")},
          "fsdp": {"fsdp": "full_shard auto_wrap", "fsdp_config": {"version": 2}}}[os.environ.get("PEERS_ENGINE", "ddp")]
world_size = int(os.environ.get("WORLD_SIZE", 1))
args = TrainingArguments(
    output_dir=s["out"], use_cpu=True, ddp_backend="gloo", seed=s["seed"], max_steps=s["max_steps"],
    per_device_train_batch_size=s["micro_batch_size"],
    gradient_accumulation_steps=s["global_batch_size"] // (s["micro_batch_size"] * world_size),
    learning_rate=s["lr"], weight_decay=s["weight_decay"], max_grad_norm=s["max_grad_norm"],
    adam_beta1=s["adam_beta1"], adam_beta2=s["adam_beta2"], adam_epsilon=s["adam_eps"],
    warmup_steps=s["warmup_steps"], logging_steps=1, save_strategy="no", report_to=[],
    train_sampling_strategy="sequential", **engine)  # the shared order


class Clock(TrainerCallback):
    def __init__(self):
        self.clock = StepClock()

    def on_step_end(self, args, state, control, **kwargs):
        self.clock.tick()


clock = Clock()
net = model()
# the shared optimizer and schedule under DDP; its DeepSpeed and FSDP integrations build their own from args
optimizers = optimizer_and_schedule(net.parameters()) if not engine else (None, None)
trainer = Trainer(model=net, args=args, train_dataset=examples(), callbacks=[clock], optimizers=optimizers)
trainer.train()
trainer.save_model(f"{s['out']}/model")
# what it ran: Accelerate's distributed type, and how many modules FSDP sharded
finish(clock.clock, args.process_index, distributed_type=str(trainer.accelerator.distributed_type),
       sharded_units=sharded_units(trainer.model_wrapped))
