"""Chunked cross-entropy (``memory.chunked_cross_entropy``) against the plain loss on the full logits.

    python benchmarks/chunked_loss.py --quick                 # CI size (seconds)
    python benchmarks/chunked_loss.py --repeats 7 --results   # the tiny recipe's shape, vocab 8192

A GPT-2 of the tiny recipe's shape (4 layers, 192 wide) with a vocabulary of 8192, micro-batch 16
of 128 tokens, fp32 on CPU, random weights and tokens. Reported:

- ``loss_saved_bytes``: what the loss alone (final hidden states → summed cross-entropy) keeps for
  backward, counted by the simulated device's saved-tensor hooks. Goal: chunked ≥ 4× lower.
- ``model_saved_bytes``: the same for the whole model's forward (what the planner predicts with).
- ``step_s``: forward + backward seconds, plain and chunked in alternating repeats, and the ratio
  chunked / plain per repeat (min / median / max): the price of recomputing the logits;
  ``step_s_each_repeat`` holds every repeat's seconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import emit  # noqa: E402


def _model(vocab: int, layers: int, width: int, seq: int, chunked: bool):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from memtrain.objectives import CausalLM

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_head=4, n_embd=width, vocab_size=vocab, n_positions=seq, bos_token_id=0,
                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg).float()
    if chunked:
        from memtrain.levers.chunked_cross_entropy import install_chunked_head

        install_chunked_head(model)
    return model, CausalLM(chunked=chunked)


def saved_bytes(fn, params) -> int:
    """Peak bytes autograd saves for backward while ``fn()`` runs (parameters excluded)."""
    from memtrain.memory.simulated import SimulatedMemory

    counter = SimulatedMemory(2**62, 0, params)
    with counter.context():
        out = fn()
    del out
    return counter.peak_bytes


def loss_only_bytes(model, objective, batch) -> int:
    """Saved bytes of the loss alone: the hidden states enter as a leaf."""
    import torch

    with torch.no_grad():
        hidden = model.transformer(input_ids=batch["input_ids"]).last_hidden_state
    hidden.requires_grad_(True)
    head = model.lm_head
    if objective.chunked:
        from memtrain.levers.chunked_cross_entropy import chunked_cross_entropy_sum

        return saved_bytes(lambda: chunked_cross_entropy_sum(hidden, head.weight, head.bias, batch["labels"]),
                           model.parameters())
    return saved_bytes(lambda: torch.nn.functional.cross_entropy(head(hidden).flatten(0, 1),
                                                                 batch["labels"].flatten(), reduction="sum"),
                       model.parameters())


def step_seconds(model, objective, batch) -> float:
    start = time.perf_counter()
    objective.loss_sum(model, batch).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model and 2 repeats (CI)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--results", action="store_true", help="append the JSON to benchmarks/results/")
    args = parser.parse_args(argv)
    import torch

    vocab, layers, width, seq, micro = (8192, 1, 64, 128, 4) if args.quick else (8192, 4, 192, 128, 16)
    repeats = 2 if args.quick else args.repeats
    ids = torch.randint(0, vocab, (micro, seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.roll(-1, 1)}
    runs = {name: _model(vocab, layers, width, seq, name == "chunked") for name in ("plain", "chunked")}
    result = {"benchmark": "chunked_loss", "device": "cpu", "vocab_size": vocab, "n_layer": layers, "n_embd": width,
              "seq_len": seq, "micro_batch_size": micro, "precision": "fp32", "repeats": repeats}
    result["loss_saved_bytes"] = {k: loss_only_bytes(m, o, batch) for k, (m, o) in runs.items()}
    result["model_saved_bytes"] = {k: saved_bytes(lambda m=m, o=o: o.loss_sum(m, batch), m.parameters())
                                   for k, (m, o) in runs.items()}
    for name in ("loss_saved_bytes", "model_saved_bytes"):
        result[name]["plain_over_chunked"] = result[name]["plain"] / result[name]["chunked"]
    for m, o in runs.values():  # warm-up
        step_seconds(m, o, batch)
    times = {"plain": [], "chunked": []}
    for _ in range(repeats):  # alternating
        for name, (m, o) in runs.items():
            times[name].append(step_seconds(m, o, batch))
    ratios = [c / p for p, c in zip(times["plain"], times["chunked"])]
    result["step_s"] = {k: {"min": min(v), "median": statistics.median(v), "max": max(v)} for k, v in times.items()}
    result["step_s_each_repeat"] = times
    result["ratio_chunked_to_plain_step_s"] = {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios)}
    result["goal_loss_saved_bytes_ratio"] = 4.0
    emit("chunked_loss", "cpu", result, args.results)


if __name__ == "__main__":
    main()
