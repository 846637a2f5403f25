"""Train with your own optimizer, learning-rate schedule and callbacks, from Python.

``train_module.py``'s model, data, objective and metric, trained with torch's NAdam (Adam with
Nesterov momentum, decoupled weight decay) and a ``StepLR`` schedule from ``optimizer_factory`` and ``scheduler_factory`` instead of
memtrain's AdamW and warmup + cosine; a callback prints each evaluation and
``memtrain.EarlyStopping`` ends the run when the validation accuracy stops rising.

    python examples/own_optimizer.py --output_dir runs/reverse_sgd

Every memtrain setting can be given as on the command line; rerunning the same command resumes
(the optimizer's momentum and the schedule's position come back from the checkpoint). The
optimizer runs under DDP and FSDP2 (DeepSpeed builds its own: refused by name).
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # memtrain from this clone

import memtrain  # noqa: E402
from train_module import DEFAULTS, ReverseModel, TokenCrossEntropy, accuracy, collate, make_examples  # noqa: E402


def nadam(param_groups):
    """``optimizer_factory``: the two groups memtrain hands over keep their weight decay."""
    return torch.optim.NAdam(param_groups, lr=3e-3, decoupled_weight_decay=True)


def halve_every_40_steps(optimizer):
    """``scheduler_factory``: stepped once per optimizer step."""
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=40, gamma=0.5)


class PrintEvaluations(memtrain.TrainerCallback):
    """Says each evaluation's accuracy and learning rate (on rank 0)."""

    def on_evaluate(self, state, metrics):
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"step {state.step}: validation accuracy {metrics['val_accuracy']:.3f}, lr {state.record['lr']:.3g}")


if __name__ == "__main__":
    settings = {**DEFAULTS, "output_dir": "runs/reverse_sgd",
                "training": {**DEFAULTS["training"], "eval_every": 20}, "checkpoint": {"every_steps": 20}}
    trainer = memtrain.Trainer(settings, model=ReverseModel, train_dataset=make_examples(2048, seed=0),
                               eval_dataset=make_examples(64, seed=1), collate_fn=collate,
                               objective=TokenCrossEntropy(), compute_metrics=accuracy,
                               optimizer_factory=nadam, scheduler_factory=halve_every_40_steps,
                               callbacks=[PrintEvaluations(), memtrain.EarlyStopping("val_accuracy", patience=2,
                                                                                    mode="max")],
                               args=sys.argv[1:])
    result = trainer.fit()
    first, last = result.summary.get("initial_val_loss"), result.summary.get("final_val_loss")
    if int(os.environ.get("RANK", "0")) == 0 and first is not None and last is not None:
        where = (f"stopped early, its checkpoint in {trainer.config.output_dir}/checkpoints"
                 if result.summary.get("preempted") else f"model in {trainer.config.output_dir}/model")
        print(f"validation loss {first:.3f} -> {last:.3f} per position after step {result.records[-1]['step']}; {where}")
