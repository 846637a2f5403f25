"""Train your own nn.Module on your own data with memtrain, from Python.

The model is a small transformer encoder written with torch.nn (no transformers); the data is
built here: sequences of digits of varying length, each to be read back reversed; the collate
function pads them; the objective is this script's own (cross-entropy per labelled position), and
so is the evaluation's metric (the share of labelled positions read back right).

    python examples/train_module.py --output_dir runs/reverse
    torchrun --nproc_per_node 2 examples/train_module.py --output_dir runs/reverse_ddp2 --backend.name ddp

Every memtrain setting can be given as on the command line (``--training.max_steps 200``,
``--backend.name deepspeed --backend.zero_stage 3``); rerunning the same command resumes (and a
finished run's folder trains nothing more: give each run its own ``--output_dir``).
"""

import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # memtrain from this clone

import memtrain  # noqa: E402

VOCAB, PAD = 12, 11  # digits 0-9, a separator 10, padding 11
IGNORE = -100  # labels the loss skips


class ReverseModel(nn.Module):
    """Token ids [B, T] → logits [B, T, VOCAB]: embeddings, positions, a stack of encoder layers."""

    def __init__(self, dim: int = 64, layers: int = 2, heads: int = 4, max_len: int = 64):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.position = nn.Embedding(max_len, dim)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, input_ids: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids) + self.position(torch.arange(input_ids.shape[1], device=input_ids.device))
        for layer in self.layers:
            h = layer(h, src_key_padding_mask=padding_mask)
        return self.head(h)


def make_examples(n: int, seed: int) -> list[dict]:
    """``n`` examples: digits, a separator, then the digits reversed (to be predicted)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        digits = torch.randint(0, 10, (int(torch.randint(4, 16, (), generator=g)),), generator=g)
        tokens = torch.cat([digits, torch.tensor([10]), digits.flip(0)])
        labels = torch.full_like(tokens, IGNORE)
        labels[len(digits):-1] = digits.flip(0)  # at the separator and after: the next reversed digit
        out.append({"input_ids": tokens, "labels": labels})
    return out


def collate(examples: list[dict]) -> dict[str, torch.Tensor]:
    """Pad to the longest example: ids with PAD, labels with IGNORE, and a mask of the padding."""
    longest = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), longest), PAD)
    labels = torch.full((len(examples), longest), IGNORE)
    for i, e in enumerate(examples):
        ids[i, :len(e["input_ids"])] = e["input_ids"]
        labels[i, :len(e["labels"])] = e["labels"]
    return {"input_ids": ids, "labels": labels, "padding_mask": ids == PAD}


class TokenCrossEntropy:
    """The objective: summed cross-entropy of the labelled positions, counted in those positions
    (memtrain divides the global sum by the global count, so the loss is per position whatever
    the micro-batch split)."""

    unit = "positions"

    def loss_sum(self, model, micro_batch):
        logits = model(micro_batch["input_ids"], micro_batch["padding_mask"])
        return F.cross_entropy(logits.flatten(0, 1).float(), micro_batch["labels"].flatten(), ignore_index=IGNORE,
                               reduction="sum")

    def count(self, batch):
        return (batch["labels"] != IGNORE).sum()


def accuracy(logits, labels):
    """``compute_metrics``: labelled positions whose most likely digit is right, as (right, labelled),
    summed over the whole evaluation set and every rank before memtrain divides."""
    kept = labels != IGNORE
    return {"accuracy": (float((logits.argmax(-1) == labels)[kept].sum()), float(kept.sum()))}


DEFAULTS = {
    "output_dir": "runs/reverse",
    "precision": "fp32",
    "training": {"global_batch_size": 32, "micro_batch_size": 16, "max_steps": 120, "lr": 3e-3, "warmup_steps": 5,
                 "eval_every": 40, "eval_samples": 64, "log_every": 10},
    "checkpoint": {"every_steps": 40},
}

if __name__ == "__main__":
    trainer = memtrain.Trainer(DEFAULTS, model=ReverseModel, train_dataset=make_examples(2048, seed=0),
                               eval_dataset=make_examples(64, seed=1), collate_fn=collate,
                               objective=TokenCrossEntropy(), compute_metrics=accuracy, args=sys.argv[1:])
    result = trainer.fit()
    first, last = result.summary.get("initial_val_loss"), result.summary.get("final_val_loss")
    if int(os.environ.get("RANK", "0")) == 0:
        if not result.records:  # memtrain said why: the folder's run had finished
            print(f"nothing trained: {trainer.config.output_dir} holds a finished run (give another --output_dir)")
        elif first is not None and last is not None:
            print(f"validation loss {first:.3f} -> {last:.3f} per position; model in {trainer.config.output_dir}/model")
            evaluated = [r["val_accuracy"] for r in result.records if "val_accuracy" in r]
            if evaluated:
                print(f"validation accuracy {evaluated[0]:.3f} -> {evaluated[-1]:.3f} of labelled positions")
